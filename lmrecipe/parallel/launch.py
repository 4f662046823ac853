"""The launch: the process count the launcher was asked for, and what the recipe needs of the launch
(:func:`check_launch`, which decides the run's :class:`~lmrecipe.parallel.topology.Topology`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

from lmrecipe.config import Workload
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import fail
from lmrecipe.parallel.deepspeed_config import (
    check_compile_stage,
    check_sequence_parallel_stage,
    check_tensor_parallel_stage,
    load_deepspeed_config,
)
from lmrecipe.parallel.topology import (
    Topology,
    ZeroSetup,
    check_expert_parallel_topology,
    check_sequence_parallel_topology,
    check_tensor_parallel_topology,
)


def _launch_arguments(argv: list[str]) -> list[str] | None:
    """The arguments after ``accelerate launch`` (or ``python -m accelerate.commands.launch``) in a command line;
    None when it is not that command."""
    for i, arg in enumerate(argv):
        if arg == "launch" and i > 0 and Path(argv[i - 1]).name in ("accelerate", "accelerate_cli.py"):
            return argv[i + 1:]
        if arg in ("accelerate.commands.launch", "accelerate.commands.accelerate_cli") and i > 0 and argv[i - 1] == "-m":
            rest = argv[i + 1:]
            return rest[1:] if arg.endswith("accelerate_cli") and rest[:1] == ["launch"] else rest
    return None


def shrunk_launch(environ: dict, parent_argv: list[str] | None) -> int | None:
    """The process count that ``accelerate launch`` was asked for (``--num_processes N``, N > 1) when it started this
    process alone: without ``--multi_gpu`` (or ``--use_deepspeed``, ``--use_fsdp``), or with ``--cpu``, its simple
    launcher runs the script once, sets no ``WORLD_SIZE`` and says nothing. None otherwise.

    ``environ``: this process's environment; ``parent_argv``: the parent process's command line (the launcher's).
    """
    if "WORLD_SIZE" in environ or "ACCELERATE_DYNAMO_BACKEND" not in environ or not parent_argv:
        return None  # a distributed launcher's process, or not one of accelerate's launcher
    launch_args = _launch_arguments(parent_argv)
    if launch_args is None:
        return None
    import io

    from accelerate.commands.launch import launch_command_parser
    from accelerate.commands.utils import CustomArgumentParser

    # The parser of the accelerate command line itself: hyphens or underscores, no abbreviations.
    commands = CustomArgumentParser(add_help=False, allow_abbrev=False)
    launch_command_parser(commands.add_subparsers())
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = commands.parse_args(["launch", *launch_args])
    except SystemExit:
        return None
    processes = args.num_processes
    distributed = args.multi_gpu or args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.tpu
    if processes is None or processes < 2 or (distributed and not args.cpu):
        return None
    return processes


def _parent_command_line() -> list[str] | None:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None  # no /proc (not Linux): the check is skipped
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def check_launched_processes() -> None:
    """Exit 2 when ``accelerate launch --num_processes N`` started this process alone (:func:`shrunk_launch`): the run
    would train on one process instead of N, silently."""
    requested = shrunk_launch(dict(os.environ), _parent_command_line())
    if requested is None:
        return
    raise fail(f"accelerate launch was asked for {requested} processes (--num_processes {requested}) but started this "
               "script once: without --multi_gpu (or --use_deepspeed), or with --cpu, its launcher runs a single "
               f"process, and this run would train on 1 process instead of {requested}. Relaunch with accelerate "
               f"launch --multi_gpu --num_processes {requested} train.py RECIPE [key=value ...] (python "
               "tools/launch_flags.py RECIPE [key=value ...] prints the flags a recipe needs), or leave out "
               "--num_processes to train on one process.")


def check_launch(work: Workload, ds_path: str | Path | None, world_size: int,
                 precision: str) -> tuple[Topology, BatchLayout, dict | None]:
    """What a launch of ``world_size`` processes needs of the recipe's ``work`` and its DeepSpeed JSON, checked before
    any process group exists (training, and the tools that plan runs, judge it alike): the parallel splits divide the
    processes, the global batch splits over the data-parallel ranks, the JSON is valid for the recipe and its ZeRO
    stage suits the splits. Returns the run's topology, the batch split (of rank 0) and the filled DeepSpeed config
    (None without DeepSpeed)."""
    dist = work.distributed
    check_sequence_parallel_topology(dist.sequence_parallel_size, world_size)
    check_tensor_parallel_topology(dist.tensor_parallel_size, world_size)
    check_expert_parallel_topology(dist.expert_parallel_size, world_size)
    topology = Topology.of_launch(dist, world_size, ZeroSetup())
    batch = topology.batch_layout(work.train)
    if ds_path is None:
        return topology, batch, None
    ds_config = load_deepspeed_config(ds_path, work.optim, dist, batch, precision)
    topology = replace(topology, zero=ZeroSetup.from_ds_config(ds_config))  # the batch split does not depend on it
    check_tensor_parallel_stage(dist.tensor_parallel_size, topology.zero, Path(ds_path))
    check_compile_stage(work.train.compile, topology.zero, Path(ds_path))
    check_sequence_parallel_stage(dist.sequence_parallel_size, ds_config, precision, Path(ds_path), work.train.precision)
    return topology, batch, ds_config
