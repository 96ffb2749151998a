#!/bin/bash
# kiln on one SLURM node: srun starts one torchrun, torchrun starts one worker per GPU.
#
#   mkdir -p logs      # once: SLURM opens logs/%x-%j.out before this script runs and
#                      # does not create the folder (without it the job has no log)
#   sbatch scripts/slurm/singlenode.sh configs/train/7b.toml --train.max_steps=1000
#
# Options on the sbatch command line override the #SBATCH lines below, e.g.
#   sbatch --gpus-per-node=4 --cpus-per-task=64 --time=12:00:00 scripts/slurm/singlenode.sh ...
# Before the time limit (or on `scancel --signal=TERM --batch`), the run writes a
# checkpoint and the job requeues itself; the requeued job resumes. See docs/slurm.md.
#
#SBATCH --job-name=kiln
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:SIGTERM@120
#SBATCH --requeue

set -euo pipefail

log() { echo "kiln-slurm: $*"; }

if (($# < 1)); then
    echo "usage: sbatch scripts/slurm/singlenode.sh RECIPE.toml [--section.key=value ...]" >&2
    exit 2
fi
config=$1
shift
if [[ ! -f $config ]]; then
    echo "kiln-slurm: recipe not found: $config (relative to $PWD)" >&2
    exit 2
fi
job_id=${SLURM_JOB_ID:?not inside a SLURM job: submit this script with sbatch}

# --- Signals --------------------------------------------------------------------------------
# SLURM sends SIGTERM to this shell only (--signal=B:...) 120 s before the time limit. The shell
# passes it on to the job step as SIGUSR1: srun turns a SIGTERM it receives into SIGKILL of its
# tasks, but forwards SIGUSR1 unchanged; torchrun (--signals-to-handle) forwards it to the
# workers and waits --shutdown-timeout seconds for them to checkpoint and exit.
signalled=""   # name of the first signal this shell got
signal_count=0 # signals this shell got
forwarded=""   # set once the step has been signalled (a second signal would cut torchrun's wait)
srun_pid=""

forward_to_step() {
    if [[ -n $srun_pid && -z $forwarded ]]; then
        forwarded=1
        log "forwarding SIGUSR1 to the job step (srun pid $srun_pid)"
        kill -USR1 "$srun_pid" 2>/dev/null || true
    fi
}

# shellcheck disable=SC2329  # called from the trap strings below, which shellcheck does not read
on_signal() {
    log "batch shell got SIG$1 at $(date '+%F %T')"
    signal_count=$((signal_count + 1))
    if [[ -z $signalled ]]; then
        signalled=$1
    fi
    forward_to_step
}

trap 'on_signal TERM' TERM
trap 'on_signal USR1' USR1

# --- Environment (site setup goes here) ------------------------------------------------------
# KILN_SETUP: a file to source first (module loads, conda or venv activation). Without it, the
# submission directory's .venv is activated when there is one.
set +u # activation scripts are not always written for `set -u`
if [[ -n ${KILN_SETUP:-} ]]; then
    # shellcheck disable=SC1090  # the file is chosen by the user at submission time
    source "$KILN_SETUP"
elif [[ -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091  # the venv is created by `make`, not part of the repository
    source .venv/bin/activate
fi
set -u

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
nproc=${KILN_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-gpu}} # "gpu": torchrun counts the GPUs
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
    OMP_NUM_THREADS=1
    if [[ ${SLURM_CPUS_PER_TASK:-} =~ ^[0-9]+$ && $nproc =~ ^[1-9][0-9]*$ ]]; then
        OMP_NUM_THREADS=$((SLURM_CPUS_PER_TASK / nproc > 0 ? SLURM_CPUS_PER_TASK / nproc : 1))
    fi
fi
export OMP_NUM_THREADS

# --- Launch -----------------------------------------------------------------------------------
# --kill-on-bad-exit=0: when the workers stop on a signal, one node finishing first must not
# have SLURM kill the others while they still write their part of the checkpoint.
srun_args=(--nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=0)
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi
torchrun_args=(
    --standalone --nnodes=1 --nproc-per-node="$nproc"
    --signals-to-handle='SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1'
    --shutdown-timeout="${KILN_SHUTDOWN_TIMEOUT:-100}"
)

log "job $job_id (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
    "$nproc processes, OMP_NUM_THREADS=$OMP_NUM_THREADS, recipe $config $*"

if [[ -z $signalled ]]; then
    srun "${srun_args[@]}" torchrun "${torchrun_args[@]}" -m kiln train "$config" "$@" &
    srun_pid=$!
    if [[ -n $signalled ]]; then
        forward_to_step # the signal came between starting srun and recording its pid
    fi
    # `wait` returns early (status > 128) when a trapped signal arrives, and the trap runs
    # before the next line: then srun is still stopping, so wait for it again.
    while :; do
        seen=$signal_count
        status=0
        wait "$srun_pid" || status=$?
        if ((signal_count == seen || status <= 128)); then
            break
        fi
    done
else
    status=1 # signalled before the launch: nothing ran, requeue
fi

# --- Requeue or exit ------------------------------------------------------------------------
# kiln exits with 75 after a checkpoint on SIGTERM/SIGUSR1; torchrun reports that (and its own
# shutdown on a signal) as 1, so a signal to this shell is what usually decides.
reason=""
if ((status == 75)); then
    reason="the job step exited with 75 (stopped after a checkpoint)"
elif [[ -n $signalled ]] && ((status != 0)); then
    reason="the batch shell got SIG$signalled (time limit near, or preemption) and the job step stopped with status $status"
fi
if [[ -n $reason ]]; then
    log "requeueing job $job_id: $reason; the requeued job resumes from the newest complete checkpoint"
    if ! scontrol requeue "$job_id"; then
        log "scontrol requeue $job_id failed; resubmit the same command to resume" >&2
    fi
    exit "$status"
fi
log "job step exited with status $status"
exit "$status"
