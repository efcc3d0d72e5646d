#!/bin/bash
# A SLURM batch script: one meshrun per node; meshrun reads the node count, its node rank and
# the rendezvous host (the first node of the allocation) from SLURM's environment, so no
# endpoint is typed. Runs as is on CPU nodes; on GPU nodes it uses every GPU of each node.
#
#   source .venv/bin/activate     # meshrun must be on PATH (the job inherits it)
#   sbatch configs/slurm_job.sh   # from the repository root
#
# To adapt: --nodes; on GPU nodes add "#SBATCH --gpus-per-node=8" (or your cluster's gres);
# STEPS=N sbatch ... to train longer or shorter. SLURM's "save soon" warning
# (#SBATCH --signal=USR1@120) reaches each worker once and the job goes on: the example saves
# a checkpoint when it gets SIGTERM; handle SIGUSR1 in your script to save on the warning.
#SBATCH --job-name=char-lm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=01:00:00

# srun runs a program found in the working directory before PATH: from the repository root a
# bare "meshrun" would be the package directory. Give srun meshrun's absolute path.
MESHRUN=$(command -v meshrun) || {
    echo "meshrun is not on PATH: activate its virtualenv (source .venv/bin/activate) first" >&2
    exit 2
}
srun "$MESHRUN" --nproc-per-node auto --max-restarts 3 \
    examples/train_char_lm.py --steps "${STEPS:-2000}" ${EXAMPLE_ARGS:-}
