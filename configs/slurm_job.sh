#!/bin/bash
# A SLURM batch script: one meshrun per node; meshrun reads the node count, its node rank and
# the rendezvous host (the first node of the allocation) from SLURM's environment, so no
# endpoint is typed. Runs as is on CPU nodes; on GPU nodes it uses every GPU of each node.
#
#   source .venv/bin/activate     # meshrun must be on PATH (the job inherits it)
#   sbatch configs/slurm_job.sh   # from the repository root
#
# To adapt: --nodes; on GPU nodes add "#SBATCH --gpus-per-node=8" (or your cluster's gres);
# STEPS=N sbatch ... to train longer or shorter; MAX_RESTARTS=N for meshrun's own restarts of
# a failed worker group (default 3). SLURM's "save soon" warning (#SBATCH --signal=USR1@120)
# reaches each worker once and the job goes on: the example saves a checkpoint when it gets
# SIGTERM; handle SIGUSR1 in your script to save on the warning.
#
# Requeue or not: when meshrun's exit code says retrying may help (3 rendezvous or store
# failure, 124 hung, 143 stopped by SIGTERM), the job requeues itself, at most MAX_REQUEUES
# times (default 3; SLURM counts them in SLURM_RESTART_COUNT); any other code (2 bad input,
# the failed worker's own code) ends the job with that code. Table: docs/launching.md.
# --open-mode=append keeps every run's output in one file.
#SBATCH --job-name=char-lm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=01:00:00
#SBATCH --requeue
#SBATCH --open-mode=append

# srun runs a program found in the working directory before PATH: from the repository root a
# bare "meshrun" would be the package directory. Give srun meshrun's absolute path.
MESHRUN=$(command -v meshrun) || {
    echo "meshrun is not on PATH: activate its virtualenv (source .venv/bin/activate) first" >&2
    exit 2
}
srun "$MESHRUN" --nproc-per-node auto --max-restarts "${MAX_RESTARTS:-3}" \
    examples/train_char_lm.py --steps "${STEPS:-2000}" ${EXAMPLE_ARGS:-}
code=$?

case $code in
    3 | 124 | 143) retry=yes ;;  # the store or a node, a hang, a preemption: try again
    *) retry=no ;;               # 0 done; 2 bad input; the script's own failure: again fails
esac
runs=${SLURM_RESTART_COUNT:-0}
if [ "$retry" = yes ] && [ "$runs" -lt "${MAX_REQUEUES:-3}" ]; then
    echo "meshrun exited $code (retrying may help): requeueing job $SLURM_JOB_ID" \
        "(requeue $((runs + 1)) of ${MAX_REQUEUES:-3})" >&2
    scontrol requeue "$SLURM_JOB_ID" && exit 0  # SLURM ends this run and queues the job again
fi
[ "$retry" = yes ] && echo "meshrun exited $code: not requeued, $runs requeue(s) spent" >&2
exit "$code"
