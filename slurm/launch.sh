#!/usr/bin/env bash
# One `accelerate launch` per node: slurm/train.sbatch starts this script with `srun --ntasks-per-node=1`.
#
# Usage: slurm/launch.sh RECIPE [key=value ...]
#
# It only computes the topology; every hyperparameter stays in the recipe and the overrides, which are
# passed through untouched. Topology, each overridable from the environment (rules in slurm/topology.sh):
#   MASTER_ADDR      address of the job's first node: its NodeAddr from `scontrol show node`, else its name
#   MASTER_PORT      20000 + SLURM_JOB_ID % 20000, so jobs sharing a node do not collide
#   NUM_MACHINES     SLURM_NNODES (default 1)
#   MACHINE_RANK     SLURM_NODEID (default 0)
#   LMRECIPE_PROCS_PER_NODE  processes per node; default the node's GPUs, 1 on a CPU node (no GPUs or 0)
#   OMP_NUM_THREADS  threads per process; default the task's CPUs / processes per node
#   PYTHON           interpreter with the project's dependencies (default: python)
#   LAUNCH_DRY_RUN=1 print the command instead of running it
# The launcher flags come from tools/launch_flags.py (DeepSpeed's `standard` multinode launcher when the
# recipe names a DeepSpeed JSON, else --multi_gpu; see lmrecipe/launch.py).
#
# Preemption: on SIGUSR1 or SIGTERM this script asks the training processes (the launcher's children, which
# torch.distributed.run starts in sessions of their own, so signals to this process group miss them) to
# stop with SIGUSR1. They finish the step, save a checkpoint and exit with code 124; this script then exits
# 124 too, which tells slurm/train.sbatch to requeue. The launcher itself ignores SIGUSR1 (an ignored signal
# stays ignored across exec and torch.distributed.run installs no handler for it), so it survives a SIGUSR1
# that SLURM delivers to every process of the step. Its children inherit that: a training process ignores
# SIGUSR1 until it installs its handler, just before the first step. A stop that arrives earlier is kept and
# delivered to each training process once /proc shows it catching SIGUSR1; one that arrives before the
# launcher starts stops the node at once with exit 124 (there is nothing to save yet).
#
# Exit status: the launcher reports any failed worker as 1 (after a ChildFailedError traceback). The training
# processes record how they ended in $LMRECIPE_EXIT_FILE (lmrecipe/cli.py); this script exits with that code
# (2: bad input, 3: a hang, 4: a lost peer, 124: preempted, 130: Ctrl-C) and repeats the error's paragraph as its
# last line; a stop it was asked for turns an unrecorded failure into 124. With LMRECIPE_STATUS_DIR set
# (slurm/train.sbatch sets it), it also writes that code to $LMRECIPE_STATUS_DIR/node<MACHINE_RANK>, or `killed` when
# the launcher failed and no training process recorded how it ended (killed by a signal, or before it could record).
set -euo pipefail

EXIT_PREEMPTED=124  # lmrecipe.checkpoint.EXIT_PREEMPTED

stop_requested=0
launcher_pid=
delivered=" "

# shellcheck disable=SC2329  # invoked by the traps below
request_stop() {
    if [[ $stop_requested -eq 0 ]]; then
        echo "[launch] node ${SLURM_NODEID:-0}: $1 received, asking the training processes to checkpoint and stop" >&2
    fi
    stop_requested=1
}
# First thing: a stop during the set-up below must not be lost.
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

# True when process $1 has a handler for SIGUSR1 (bit 10 of SigCgt in /proc/PID/status).
catches_usr1() {
    local line
    while read -r line; do
        if [[ $line == SigCgt:* ]]; then
            (( (16#${line##*[[:space:]]} >> 9) & 1 ))
            return
        fi
    done 2>/dev/null < "/proc/$1/status"
    return 1
}

# SIGUSR1 once to each training process that is ready for it; the others are tried again on the next call.
deliver_stop() {
    local pid
    for pid in $(pgrep -P "$launcher_pid" || true); do
        if [[ $delivered != *" $pid "* ]] && catches_usr1 "$pid"; then
            kill -USR1 "$pid" 2>/dev/null || true
            delivered+="$pid "
        fi
    done
}

if [[ $# -lt 1 ]]; then
    echo "usage: slurm/launch.sh RECIPE [key=value ...]" >&2
    exit 2
fi
recipe=$1
shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/topology.sh
source "$repo/slurm/topology.sh"
python=${PYTHON:-python}
num_machines=${NUM_MACHINES:-${SLURM_NNODES:-1}}
machine_rank=${MACHINE_RANK:-${SLURM_NODEID:-0}}
procs=$(procs_per_node)
num_processes=$((num_machines * procs))
OMP_NUM_THREADS=$(threads_per_process "$procs")
export OMP_NUM_THREADS
MASTER_ADDR=${MASTER_ADDR:-$(rendezvous_addr)}
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

# Checks the recipe and overrides: a bad key fails here, on every node, before any rendezvous.
flags=$("$python" "$repo/tools/launch_flags.py" "$recipe" "$@")
read -r -a launcher_flags <<< "$flags"
if ((num_processes == 1)); then
    # Accelerate refuses --multi_gpu for a single process (one CPU node); without it, it runs train.py directly.
    single=()
    for flag in "${launcher_flags[@]}"; do
        [[ $flag == --multi_gpu ]] || single+=("$flag")
    done
    launcher_flags=("${single[@]}")
fi

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

echo "[launch] node $machine_rank of $num_machines on $(hostname): $procs processes per node x" \
     "$OMP_NUM_THREADS threads, $num_processes processes in all, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
if [[ "${LAUNCH_DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

if [[ $stop_requested -eq 1 ]]; then
    echo "[launch] node $machine_rank: stopped before training started" >&2
    exit "$EXIT_PREEMPTED"
fi
LMRECIPE_EXIT_FILE=$(mktemp "${TMPDIR:-/tmp}/lmrecipe-exit.XXXXXX")
rm -f "$LMRECIPE_EXIT_FILE"  # written by the training processes only when they end
export LMRECIPE_EXIT_FILE
(trap '' USR1 && exec "${cmd[@]}") &
launcher_pid=$!

# A trapped signal interrupts `wait`. Once a stop is requested, poll: deliver it to each training process as
# soon as it can take it, until the launcher exits.
status=
while [[ -z $status ]]; do
    if [[ $stop_requested -eq 1 ]] && kill -0 "$launcher_pid" 2>/dev/null; then
        deliver_stop
        sleep 0.5
        continue
    fi
    rc=0
    wait "$launcher_pid" || rc=$?
    kill -0 "$launcher_pid" 2>/dev/null || status=$rc
done

own=0
if [[ $status -ne 0 && -f $LMRECIPE_EXIT_FILE ]]; then
    # The training processes' own exit status and last words, which the launcher replaced by 1 and a traceback.
    recorded=$("$python" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["exit_code"], d.get("error") or "")' \
        "$LMRECIPE_EXIT_FILE" 2>/dev/null || true)
    if [[ $recorded =~ ^[0-9]+ ]]; then
        status=${recorded%% *}
        own=1
        words=${recorded#"$status"}
        words=${words# }
        echo "[launch] node $machine_rank: training exited $status${words:+: $words}" >&2
    fi
fi
rm -f "$LMRECIPE_EXIT_FILE"
outcome=$status
if [[ $status -ne 0 && $own -eq 0 ]]; then
    if [[ $stop_requested -eq 1 ]]; then
        # The launcher reports a worker's exit 124 as a generic failure; restore the meaning.
        status=$EXIT_PREEMPTED
        outcome=$status
    else
        outcome=killed  # the training processes ended without a word: killed by a signal (or before they could say)
    fi
fi
if [[ -n ${LMRECIPE_STATUS_DIR:-} ]]; then
    # This node's outcome for slurm/train.sbatch, which reads every node's (srun reports only the highest code).
    echo "$outcome" > "$LMRECIPE_STATUS_DIR/node$machine_rank" || true
fi
exit "$status"
