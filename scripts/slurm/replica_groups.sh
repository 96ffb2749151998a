#!/bin/bash
# kiln with fault tolerance on SLURM (docs/fault_tolerance.md): the job's nodes are split into
# replica groups, torchft's lighthouse runs on the first node, and each group is a torchrun of
# its own. A group that fails is started again (up to KILN_GROUP_RESTARTS times) and takes its
# state from a live group while the others train on.
#
#   mkdir -p logs
#   sbatch --nodes=4 scripts/slurm/replica_groups.sh configs/train/7b.toml --train.max_steps=1000
#   KILN_NODES_PER_GROUP=2 sbatch --nodes=8 scripts/slurm/replica_groups.sh ...  # 4 groups of 2
#
# The recipe's layout is one group's (dp_shard, tp, pp, ...); distributed.dp_replicate is set
# to the number of groups. A node that dies takes its group with it; its restart needs the node
# back (SLURM does not replace a node inside a job).
#
#SBATCH --job-name=kiln-ft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append

set -euo pipefail

log() { echo "kiln-slurm: $*"; }
fail() {
    echo "kiln-slurm: $*" >&2
    exit 2
}

if (($# < 1)); then
    fail "usage: sbatch scripts/slurm/replica_groups.sh RECIPE.toml [--section.key=value ...]"
fi
config=$1
shift
[[ -f $config ]] || fail "recipe not found: $config (relative to $PWD)"
job_id=${SLURM_JOB_ID:?not inside a SLURM job: submit this script with sbatch}

# --- Environment (site setup goes here, as in multinode.sh) ----------------------------------
set +u
if [[ -n ${KILN_SETUP:-} ]]; then
    # shellcheck disable=SC1090  # the file is chosen by the user at submission time
    source "$KILN_SETUP"
elif [[ -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091  # the venv is created by `make`, not part of the repository
    source .venv/bin/activate
fi
set -u
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
nproc=${KILN_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-gpu}}

# --- Groups -----------------------------------------------------------------------------------
mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
per_group=${KILN_NODES_PER_GROUP:-1}
((${#hosts[@]} % per_group == 0)) ||
    fail "${#hosts[@]} nodes do not split into groups of KILN_NODES_PER_GROUP=$per_group"
groups=$((${#hosts[@]} / per_group))
((groups >= 2)) || fail "fault tolerance needs at least 2 replica groups; this job has $groups"
lighthouse="http://${hosts[0]}:${KILN_LIGHTHOUSE_PORT:-29510}"
restarts_left=${KILN_GROUP_RESTARTS:-3}
# The lighthouse's quorum and kiln's commit rule take the same number of live groups.
min_replicas=${KILN_MIN_REPLICAS:-1}
rdzv_port=${KILN_RDZV_PORT:-29500}

log "job $job_id: $groups replica groups of $per_group node(s) x $nproc processes," \
    "lighthouse $lighthouse, recipe $config $*"

# The lighthouse forms each step's quorum; a dead group is dropped after its heartbeat timeout.
srun --nodes=1 --ntasks=1 --overlap --nodelist="${hosts[0]}" \
    torchft_lighthouse --min_replicas "$min_replicas" \
    --bind "[::]:${KILN_LIGHTHOUSE_PORT:-29510}" --join_timeout_ms 10000 &
lighthouse_pid=$!

declare -a pids attempts
start_group() {
    local group=$1 first=$(($1 * per_group))
    shift
    local nodes
    nodes=$(IFS=,; echo "${hosts[*]:first:per_group}")
    attempts[group]=$((${attempts[group]:-0} + 1))
    log "starting replica group $group on $nodes (attempt ${attempts[group]})"
    srun --nodes="$per_group" --ntasks="$per_group" --ntasks-per-node=1 --nodelist="$nodes" \
        --kill-on-bad-exit=1 \
        torchrun --nnodes="$per_group" --nproc-per-node="$nproc" --rdzv-backend=c10d \
        --rdzv-endpoint="${hosts[first]}:$((rdzv_port + group))" \
        --rdzv-id="$job_id-$group-${attempts[group]}" \
        -m kiln train "$config" "$@" --distributed.dp_replicate="$groups" \
        --fault_tolerance.enabled=true --fault_tolerance.replica_group="$group" \
        --fault_tolerance.lighthouse="$lighthouse" --fault_tolerance.min_replicas="$min_replicas" &
    pids[group]=$!
}

for ((group = 0; group < groups; group++)); do
    start_group "$group" "$@"
done

# --- Supervision ------------------------------------------------------------------------------
# Polled, not `wait -n`: bash 4 has no way to learn which child ended.
finished=0
running=$groups
while ((running > 0)); do
    sleep "${KILN_POLL_SECONDS:-5}"
    for ((group = 0; group < groups; group++)); do
        pid=${pids[group]:-}
        if [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null; then
            continue
        fi
        status=0
        wait "$pid" || status=$?
        pids[group]=""
        if ((status == 0)); then
            log "replica group $group finished"
            finished=$((finished + 1))
            running=$((running - 1))
        elif ((finished == 0 && restarts_left > 0)); then
            restarts_left=$((restarts_left - 1))
            log "replica group $group exited with $status; restarting it ($restarts_left restarts left)"
            start_group "$group" "$@"
        else
            log "replica group $group exited with $status; not restarted"
            running=$((running - 1))
        fi
    done
done
kill "$lighthouse_pid" 2>/dev/null || true
if ((finished == 0)); then
    log "no replica group finished the run; resubmit to resume from the newest checkpoint"
    exit 1
fi
log "$finished of $groups replica groups finished the run"
