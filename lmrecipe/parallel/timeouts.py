"""Every process group's timeout set to ``distributed.timeout_s``, the groups DeepSpeed builds for itself included.

``init_process_group`` takes the recipe's timeout for the world group only. A group made later with
``torch.distributed.new_group`` and no timeout gets torch's default (30 minutes on gloo, 10 on NCCL) whatever the world
group's is, and DeepSpeed makes its own: its copy of the world group (``deepspeed.utils.groups._clone_world_group``),
on which ZeRO reduces the gradients, and its sequence- and expert-parallel groups. A rank waiting there for a stuck
peer waited 30 minutes under ``distributed.timeout_s=60``. :func:`bound_group_timeouts` sets the timeout of every
group that exists once the engine is built.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

logger = logging.getLogger(__name__)


def bound_group_timeouts(timeout_s: float) -> int:
    """Set the timeout of every process group this rank belongs to to ``timeout_s`` seconds; the number of groups
    changed (0 when torch.distributed is not initialized). Every rank calls it, in any order (no collective)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    changed = 0
    for group in list(c10d._world.pg_map):
        if c10d._rank_not_in_group(group) or not isinstance(group, dist.ProcessGroup):
            continue
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, RuntimeError) as err:  # a backend without a settable timeout (torch's "fake" one)
            logger.debug("process group %s keeps its own timeout: %s", group.group_desc, err)
            continue
        changed += 1
    return changed


def group_timeouts_s() -> dict[str, float]:
    """The timeout (seconds) of each process group's CPU (gloo) backend this rank belongs to, by the group's
    description (what :func:`bound_group_timeouts` changes; for tests and diagnostics)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    found = {}
    for index, group in enumerate(list(c10d._world.pg_map)):
        if c10d._rank_not_in_group(group) or torch.device("cpu") not in group._device_types:
            continue
        backend = group._get_backend(torch.device("cpu"))
        if isinstance(backend, dist.ProcessGroupGloo):
            found[f"{index}:{group.group_desc}"] = backend.options._timeout.total_seconds()
    return found
