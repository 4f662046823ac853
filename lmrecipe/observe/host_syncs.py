"""A counter of the tensor calls that make the host wait for the device: the tests that hold a step free of them
(``tests/unit/test_step.py``, docs/benchmarks/08-host-syncs.md) count with it.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"})


class HostSyncCounter(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for the device, wherever they are made from.

    ``Tensor.item``, ``tolist``, ``numpy`` and the conversions ``bool()/float()/int()`` (an ``if tensor:``
    included) copy a value to the host; on a GPU each one stalls the CPU until the queue drains. On a CPU nothing
    waits, but the calls are the same, so counting them here tells what a GPU run would pay. Calls made inside
    ``torch.optim`` are counted apart (``in_optimizer``): CPU optimizer kernels read step counts that live on the
    GPU elsewhere.

    The autograd engine runs backward functions (custom ``autograd.Function.backward``, hooks) with torch-function
    modes off, so a read there is seen one level down instead: a dispatch mode counts ``aten._local_scalar_dense``
    (what ``item``, ``bool()`` and friends become) when no counted call above is in flight, as ``scalar_read``.
    """

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.in_optimizer = 0
        self.sources: dict[str, int] = {}
        """Counted calls by the first caller outside torch, as ``package/path.py:function`` (below site-packages or
        the repository)."""
        self._in_call = 0
        self._reads = _ScalarReads(self)

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._reads.__exit__(*exc)
        return result

    def record(self, name: str) -> None:
        if _called_from_torch_optim():
            self.in_optimizer += 1
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        source = _caller_outside_torch()
        self.sources[source] = self.sources.get(source, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _SYNC_METHODS:
            return func(*args, **(kwargs or {}))
        self.record(name)
        self._in_call += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._in_call -= 1

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class _ScalarReads(TorchDispatchMode):
    """The reads :class:`HostSyncCounter`'s torch-function mode cannot see (see its docstring)."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.counter._in_call:
            self.counter.record("scalar_read")
        return func(*args, **(kwargs or {}))


def _caller_outside_torch() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path and path != __file__.replace("\\", "/"):
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
