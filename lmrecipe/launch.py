"""How a training run is launched: the `accelerate launch` command for one node of a job.

slurm/launch.sh computes the topology from SLURM's environment and asks :func:`launcher_flags` which
launcher the recipe needs; tools/compare_zero.py builds its single-node commands with
:func:`accelerate_launch_cmd`, so both start training the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmrecipe.config import DistributedConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


def launcher_flags(distributed: DistributedConfig) -> list[str]:
    """Launcher flags for the recipe: DeepSpeed's ``standard`` multinode launcher, or ``--multi_gpu``.

    ``standard`` runs one ``torch.distributed.run`` per node (no ssh/pdsh), which is what ``srun`` needs.
    A recipe without DeepSpeed must not get ``--use_deepspeed``: Accelerate would then build a default
    ZeRO-2 plugin from the launcher's environment and silently train under it.
    """
    if distributed.deepspeed_config is not None:
        return ["--use_deepspeed", "--deepspeed_multinode_launcher", "standard"]
    return ["--multi_gpu"]


def accelerate_launch_cmd(
    distributed: DistributedConfig,
    script_args: list[str],
    num_processes: int,
    main_process_port: int,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str = "127.0.0.1",
    python: str = sys.executable,
) -> list[str]:
    """``python -m accelerate.commands.launch ... train.py RECIPE [overrides]`` for one node.

    ``num_processes`` counts all processes of the job (nodes x processes per node), as Accelerate expects.
    Precision comes from the recipe (the Accelerator is built in code), so the launcher's is left at "no".
    """
    return [
        python, "-m", "accelerate.commands.launch",
        "--num_machines", str(num_machines),
        "--machine_rank", str(machine_rank),
        "--main_process_ip", main_process_ip,
        "--main_process_port", str(main_process_port),
        "--num_processes", str(num_processes),
        "--mixed_precision", "no",
        "--dynamo_backend", "no",
        *launcher_flags(distributed),
        str(REPO_ROOT / "train.py"), *script_args,
    ]
