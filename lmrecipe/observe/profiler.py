"""Profiler on demand: ``torch.profiler`` over the optimizer steps ``profile.first_step..last_step``.

Each profiling rank writes ``out_dir/profile/rank{N}.pt.trace.json`` (a Chrome trace: Perfetto and
``chrome://tracing`` open it) and ``rank{N}.json`` (its breakdown); the main process then writes
``out_dir/profile/summary.md`` with, per rank, the fraction of step time in each section.

The sections are ``record_function`` regions that ``train_step`` opens through :func:`region` (data, forward,
backward, optimizer step), on the training thread. Communication is the time the training thread spends inside
a collective (c10d, gloo, NCCL; DeepSpeed's communication goes through them); it is taken out of the section
it happens in, and what no section covers is idle/other (Python between regions, the loop, waits). So the
fractions partition the step time and sum to 100 %. Collectives that run on other threads while a section
computes (DDP's gradient buckets during backward) are overlapped with it; their time is given apart.

While profiling on a GPU each region ends with a device synchronisation, so host time is the device time of
the region (the queue cannot run ahead into the next one). This serialises what would overlap, a small
distortion accepted for a breakdown that adds up. When profiling is off, :func:`region` is a ``nullcontext``:
no profiler event, no synchronisation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from lmrecipe.config import ProfileConfig
from lmrecipe.fileio import write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)

PREFIX = "lmrecipe/"
STEP = "step"
SECTIONS = ("forward", "backward", "optimizer", "data")
TITLES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step", "data": "data",
          "communication": "communication", "other": "idle/other"}
_COMM = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms)|all_?reduce|all_?gather|reduce_scatter|broadcast|"
                   r"barrier|all_to_all", re.IGNORECASE)


def region(name: str):
    """A named section of the step in the profiler's trace; nothing at all when no profiler is running."""
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return _profiled_region(name)


@contextlib.contextmanager
def _profiled_region(name: str) -> Iterator[None]:
    with torch.profiler.record_function(PREFIX + name):
        yield
        _device_sync()


def _device_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepProfiler:
    """Runs ``torch.profiler`` over the configured steps; the loop wraps each ``train_step`` in :meth:`step`."""

    def __init__(self, section: ProfileConfig, out_dir: Path, *, rank: int, is_main: bool,
                 barrier: Callable[[], None]):
        """
        Args:
            section: the recipe's ``profile`` section (steps, ranks).
            barrier: waits for every rank (called on every rank once the last profiled step is done).
        """
        self.first = section.first_step
        self.last = section.last() if section.first_step is not None else None
        self.dir = out_dir / "profile"
        self.rank = rank
        self.is_main = is_main
        self.barrier = barrier
        self.profiles_here = self.first is not None and (section.ranks == "all" or is_main)
        self._prof: torch.profiler.profile | None = None

    def step(self, step: int):
        """Context for optimizer step ``step`` (1-based): profiled if in range, else a ``nullcontext``."""
        if self.first is None or not self.first <= step <= self.last:
            return contextlib.nullcontext()
        return self._profiled_step(step)

    @contextlib.contextmanager
    def _profiled_step(self, step: int) -> Iterator[None]:
        if self.profiles_here and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            _device_sync()
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
            logger.info("Profiling steps %d-%d", step, self.last)
        if self._prof is not None:
            with torch.profiler.record_function(PREFIX + STEP):
                yield
                _device_sync()
        else:
            yield
        if step == self.last:
            self._finish()

    def _finish(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self.dir.mkdir(parents=True, exist_ok=True)
            trace = self.dir / f"rank{self.rank}.pt.trace.json"
            self._prof.export_chrome_trace(str(trace))
            breakdown = step_breakdown(self._prof.events())
            write_json_atomic(self.dir / f"rank{self.rank}.json", {"rank": self.rank, "trace": trace.name, **breakdown})
            self._prof = None
        self.barrier()
        if self.is_main:
            ranks = [json.loads(p.read_text()) for p in sorted(self.dir.glob("rank*.json"))
                     if not p.name.endswith(".trace.json")]
            write_text_atomic(self.dir / "summary.md", format_summary(sorted(ranks, key=lambda r: r["rank"]),
                                                                      self.first, self.last))
            logger.info("Profile of steps %d-%d written to %s", self.first, self.last, self.dir)


# --------------------------------------------------------------------------------------------------
# The breakdown, from the profiler's events (times in microseconds)

Intervals = list[tuple[float, float]]


def _union(intervals: Intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def step_breakdown(events) -> dict:
    """Seconds and fractions of the profiled steps' time per section, communication and idle/other.

    ``events``: ``torch.profiler``'s function events. The fractions (``fractions``) sum to 1.
    """
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    steps = [e for e in cpu if e.name == PREFIX + STEP]
    if not steps:
        return {"steps": 0, "step_time_s": 0.0, "seconds": {}, "fractions": {}}
    thread = steps[0].thread
    step_span = _union([(e.time_range.start, e.time_range.end) for e in steps])
    total = _length(step_span)
    on_thread = [e for e in cpu if e.thread == thread]
    comm_any = _intersect(_union([(e.time_range.start, e.time_range.end) for e in cpu
                                  if not e.name.startswith(PREFIX) and _COMM.search(e.name)]), step_span)
    comm = _intersect(_union([(e.time_range.start, e.time_range.end) for e in on_thread
                              if not e.name.startswith(PREFIX) and _COMM.search(e.name)]), step_span)
    seconds = {"communication": _length(comm)}
    for name in SECTIONS:
        spans = _intersect(_union([(e.time_range.start, e.time_range.end) for e in on_thread
                                   if e.name == PREFIX + name]), step_span)
        seconds[name] = _length(spans) - _length(_intersect(spans, comm))
    seconds["other"] = max(total - sum(seconds.values()), 0.0)
    total = max(total, sum(seconds.values()))
    result = {
        "steps": len(steps),
        "step_time_s": total / len(steps) / 1e6,
        "seconds": {k: v / 1e6 for k, v in seconds.items()},
        "fractions": {k: v / total for k, v in seconds.items()},
        "overlapped_communication_s": (_length(comm_any) - _length(comm)) / 1e6,
    }
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:
        busy = _intersect(_union([(e.time_range.start, e.time_range.end) for e in kernels]), step_span)
        result["device_busy_fraction"] = _length(busy) / total
    return result


def format_summary(ranks: list[dict], first: int, last: int) -> str:
    columns = ["forward", "backward", "optimizer", "data", "communication", "other"]
    lines = [
        f"# Profile of optimizer steps {first}-{last}",
        "",
        "Fraction of the profiled steps' wall time per section, per rank (they sum to 100 %). Communication is time",
        "the training thread spent in collectives, taken out of the section it happened in; idle/other is what no",
        "section covers. Under DeepSpeed the engine's optimizer step runs inside backward at the accumulation",
        "boundary, so it is counted as backward.",
        "",
        "| rank | steps | mean step (s) | " + " | ".join(TITLES[c] for c in columns) + " | sum |",
        "| --- | --- | --- | " + " | ".join("---" for _ in columns) + " | --- |",
    ]
    for r in ranks:
        fractions = r["fractions"]
        cells = [f"{100 * fractions.get(c, 0.0):.1f} %" for c in columns]
        lines.append(f"| {r['rank']} | {r['steps']} | {r['step_time_s']:.4f} | " + " | ".join(cells)
                     + f" | {100 * sum(fractions.values()):.1f} % |")
    lines.append("")
    for r in ranks:
        extra = f"rank {r['rank']}: trace `{r['trace']}`; collectives on other threads overlapped with the sections " \
                f"for {r.get('overlapped_communication_s', 0.0):.4f} s"
        if "device_busy_fraction" in r:
            extra += f"; the GPU ran kernels {100 * r['device_busy_fraction']:.1f} % of the step time"
        lines.append(f"- {extra}.")
    lines += ["", "Open a trace in https://ui.perfetto.dev or chrome://tracing. The regions are named `lmrecipe/...`."]
    return "\n".join(lines) + "\n"
