# shellcheck shell=bash
# Topology rules shared by slurm/launch.sh and slurm/compare_zero.sbatch (sourced, not run).
#
# Processes per node (procs_per_node):
#   1. LMRECIPE_PROCS_PER_NODE, when set (a positive integer; anything else is an error);
#   2. else the node's GPUs as SLURM reports them: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE
#      ("--gpus-per-node=a100:8" arrives as "a100:8");
#   3. else 1: a CPU node (no GPUs requested, or --gpus-per-node=0). One process holds one model replica
#      and uses the node's cores through intra-op threads; more processes per CPU node only add replicas
#      and gradient traffic. Set LMRECIPE_PROCS_PER_NODE to choose otherwise.
# Threads per process (threads_per_process): OMP_NUM_THREADS when set, else the CPUs SLURM gives the task
# (SLURM_CPUS_PER_TASK, else SLURM_CPUS_ON_NODE) divided by the processes per node, at least 1.
# Without it the launcher would give every process a single thread.

procs_per_node() {
    local n
    if [[ -n "${LMRECIPE_PROCS_PER_NODE:-}" ]]; then
        n=$LMRECIPE_PROCS_PER_NODE
        if [[ ! $n =~ ^[0-9]+$ ]] || ((n < 1)); then
            echo "error: LMRECIPE_PROCS_PER_NODE=$n; give the number of training processes per node (1 or more)." >&2
            return 2
        fi
        echo "$n"
        return 0
    fi
    n=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
    n=${n##*:}
    if [[ $n =~ ^[0-9]+$ ]] && ((n > 0)); then
        echo "$n"
    else
        echo 1
    fi
}

# threads_per_process PROCS_PER_NODE
threads_per_process() {
    local cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}
    if [[ -n "${OMP_NUM_THREADS:-}" ]]; then
        echo "$OMP_NUM_THREADS"
    elif [[ $cpus =~ ^[0-9]+$ ]] && ((cpus / $1 > 1)); then
        echo $((cpus / $1))
    else
        echo 1
    fi
}

# srun_cpu_flags: the CPUs of a job step. srun does not pass the allocation's --cpus-per-task on to a step
# (Slurm >= 22.05), so give it; without one (e.g. `sbatch --exclusive`), --whole gives the step every CPU
# the job holds on its nodes instead of one per task.
srun_cpu_flags() {
    if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
        echo "--cpus-per-task=$SLURM_CPUS_PER_TASK"
    else
        echo "--whole"
    fi
}

# rendezvous_addr: the address of the job's first node. Its NodeAddr from `scontrol show node`, so clusters
# whose node names do not resolve work; the node name when scontrol gives no address.
rendezvous_addr() {
    local hosts first info
    if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
        echo "error: set MASTER_ADDR or run under SLURM (SLURM_JOB_NODELIST is empty)." >&2
        return 2
    fi
    if ! command -v scontrol >/dev/null 2>&1; then
        echo "${SLURM_JOB_NODELIST%%,*}"
        return 0
    fi
    # Read the whole list: `| head -n 1` would kill scontrol with SIGPIPE, which pipefail turns into an error.
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    first=${hosts[0]:-}
    if [[ -z $first ]]; then
        echo "error: scontrol show hostnames returned nothing for $SLURM_JOB_NODELIST" >&2
        return 2
    fi
    info=$(scontrol -o show node "$first" 2>/dev/null) || info=
    if [[ $info =~ (^|[[:space:]])NodeAddr=([^[:space:]]+) ]]; then
        echo "${BASH_REMATCH[2]}"
    else
        echo "$first"
    fi
}
