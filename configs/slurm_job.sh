#!/bin/bash
# A SLURM batch script: one meshrun per node; meshrun reads the node count, its node rank and
# the rendezvous host (the first node of the allocation) from SLURM's environment.
#SBATCH --job-name=char-lm
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=01:00:00

srun meshrun --nproc-per-node gpu --max-restarts 3 examples/train_char_lm.py --steps 2000
