"""A counter of the tensor calls that make the host wait for the device (tests and ``bench/host_syncs.py``).

Imports torch only, so a benchmark can load this file from another tree of the project.
"""

from __future__ import annotations

import logging
import sys

from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"})


class HostSyncCounter(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for the device, wherever they are made from.

    ``Tensor.item``, ``tolist``, ``numpy`` and the conversions ``bool()/float()/int()`` (an ``if tensor:``
    included) copy a value to the host; on a GPU each one stalls the CPU until the queue drains. On a CPU nothing
    waits, but the calls are the same, so counting them here tells what a GPU run would pay. Calls made inside
    ``torch.optim`` are counted apart (``in_optimizer``): CPU optimizer kernels read step counts that live on the
    GPU elsewhere.
    """

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.in_optimizer = 0
        self.sources: dict[str, int] = {}
        """Counted calls by the first caller outside torch, as ``package/path.py:function`` (below site-packages or
        the repository)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            if _called_from_torch_optim():
                self.in_optimizer += 1
            else:
                self.calls[name] = self.calls.get(name, 0) + 1
                source = _caller_outside_torch()
                self.sources[source] = self.sources.get(source, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def _caller_outside_torch() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path:
            if "/site-packages/" in path:
                path = path.split("/site-packages/")[-1]
            elif "/lmrecipe/" in path:
                path = "lmrecipe/" + path.split("/lmrecipe/", 1)[-1]
            return f"{path}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


def _called_from_torch_optim() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/optim/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False
