#!/bin/bash

# Parameters
#SBATCH --array=0-6%7
#SBATCH --cpus-per-task=1
#SBATCH --error=/work/wt68/results/reference/spec_bench_slurm/sharded/jobs/.submitit/%A_%a/%A_%a_0_log.err
#SBATCH --job-name=spec-bench-board
#SBATCH --mem=3GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/work/wt68/results/reference/spec_bench_slurm/sharded/jobs/.submitit/%A_%a/%A_%a_0_log.out
#SBATCH --signal=USR2@120
#SBATCH --time=60
#SBATCH --wckey=submitit

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /work/wt68/results/reference/spec_bench_slurm/sharded/jobs/.submitit/%A_%a/%A_%a_%t_log.out --error /work/wt68/results/reference/spec_bench_slurm/sharded/jobs/.submitit/%A_%a/%A_%a_%t_log.err /work/main/.venv/bin/python -u -m submitit.core._submit /work/wt68/results/reference/spec_bench_slurm/sharded/jobs/.submitit/%j
