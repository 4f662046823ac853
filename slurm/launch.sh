#!/usr/bin/env bash
# One `accelerate launch` per node: slurm/train.sbatch starts this script with `srun --ntasks-per-node=1`.
#
# Usage: slurm/launch.sh RECIPE [key=value ...]
#
# It only computes the topology; every hyperparameter stays in the recipe and the overrides, which are
# passed through untouched. Topology, each overridable from the environment:
#   MASTER_ADDR      first host of SLURM_JOB_NODELIST (scontrol show hostnames; without scontrol, the
#                    first comma-separated entry)
#   MASTER_PORT      20000 + SLURM_JOB_ID % 20000, so jobs sharing a node do not collide
#   NUM_MACHINES     SLURM_NNODES (default 1)
#   MACHINE_RANK     SLURM_NODEID (default 0)
#   GPUS_PER_NODE    processes per node; default SLURM_GPUS_ON_NODE, else 1
#   PYTHON           interpreter with the project's dependencies (default: python)
#   LAUNCH_DRY_RUN=1 print the command instead of running it
# The launcher flags come from tools/launch_flags.py (DeepSpeed's `standard` multinode launcher when the
# recipe names a DeepSpeed JSON, else --multi_gpu; see lmrecipe/launch.py).
#
# Preemption: on SIGUSR1 or SIGTERM this script sends SIGUSR1 to the training processes (the launcher's
# children, which torch.distributed.run starts in sessions of their own, so signals to this process group
# miss them). They finish the step, save a checkpoint and exit with code 124; this script then exits 124
# too, which tells slurm/train.sbatch to requeue. The launcher itself ignores SIGUSR1 (an ignored signal
# stays ignored across exec and torch.distributed.run installs no handler for it), so it survives a
# SIGUSR1 that SLURM delivers to every process of the step.
set -euo pipefail

EXIT_PREEMPTED=124  # lmrecipe.checkpoint.EXIT_PREEMPTED

if [[ $# -lt 1 ]]; then
    echo "usage: slurm/launch.sh RECIPE [key=value ...]" >&2
    exit 2
fi
recipe=$1
shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python}
num_machines=${NUM_MACHINES:-${SLURM_NNODES:-1}}
machine_rank=${MACHINE_RANK:-${SLURM_NODEID:-0}}
gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
num_processes=$((num_machines * gpus_per_node))

if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
        echo "error: set MASTER_ADDR or run under SLURM (SLURM_JOB_NODELIST is empty)." >&2
        exit 2
    fi
    if command -v scontrol >/dev/null 2>&1; then
        # Read the whole list: `| head -n 1` would kill scontrol with SIGPIPE, which pipefail turns into an error.
        mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        MASTER_ADDR=${hosts[0]:?scontrol show hostnames returned nothing for $SLURM_JOB_NODELIST}
    else
        MASTER_ADDR=${SLURM_JOB_NODELIST%%,*}
    fi
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

# Checks the recipe and overrides: a bad key fails here, on every node, before any rendezvous.
flags=$("$python" "$repo/tools/launch_flags.py" "$recipe" "$@")
read -r -a launcher_flags <<< "$flags"

cmd=(
    "$python" -m accelerate.commands.launch
    --num_machines "$num_machines"
    --machine_rank "$machine_rank"
    --main_process_ip "$MASTER_ADDR"
    --main_process_port "$MASTER_PORT"
    --num_processes "$num_processes"
    --mixed_precision no
    --dynamo_backend no
    "${launcher_flags[@]}"
    "$repo/train.py" "$recipe" "$@"
)

echo "[launch] node $machine_rank of $num_machines on $(hostname): $num_processes processes in all," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
if [[ "${LAUNCH_DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

stop_requested=0
launcher_pid=

# shellcheck disable=SC2329  # invoked by the traps below
request_stop() {
    stop_requested=1
    echo "[launch] node $machine_rank: $1 received, asking the training processes to checkpoint and stop" >&2
    if [[ -n "$launcher_pid" ]]; then
        pkill -USR1 -P "$launcher_pid" || true
    fi
}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

(trap '' USR1 && exec "${cmd[@]}") &
launcher_pid=$!
# A trapped signal interrupts `wait`; keep waiting until the launcher has really exited.
status=0
wait "$launcher_pid" || status=$?
while kill -0 "$launcher_pid" 2>/dev/null; do
    status=0
    wait "$launcher_pid" || status=$?
done

if [[ $stop_requested -eq 1 && $status -ne 0 ]]; then
    # The launcher reports a worker's exit 124 as a generic failure; restore the meaning.
    exit "$EXIT_PREEMPTED"
fi
exit "$status"
