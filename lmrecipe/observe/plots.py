"""PNG figures people would rather look at than read."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on clusters; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from lmrecipe.fileio import atomic_path  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


EVENT_STYLES = {"resume": ("tab:green", "--", 1.2), "rollback": ("tab:red", "-.", 1.2), "preemption": ("tab:orange", "-", 4.0)}
"""Colour, line style and width of each kind of event :func:`plot_training` marks (a preemption is wide and pale:
the resume after it sits on the same step)."""


def plot_training(rows: list[dict], path: str | Path, title: str | None = None, events: list[dict] | None = None,
                  run_tokens_per_sec: float | None = None) -> None:
    """Train/val loss, learning rate, grad norm, tokens/s, step time and memory against optimizer step, with a
    token axis above the top row (tokens per step taken as constant, from the last row's ``tokens_seen``).

    ``events``: ``{"step", "kind", "label"}`` marked as a vertical line on every panel, ``kind`` one of
    :data:`EVENT_STYLES` (a resume at its checkpoint's step, a rollback at the step it went back to, a preemption at
    the step it stopped after). The tokens/s panel draws each logged interval's rate and, as a line,
    ``run_tokens_per_sec``: the run's throughput (:func:`lmrecipe.observe.metrics_log.throughput`).

    A data mixture's rows (``val_loss/<name>``, ``tokens_seen/<name>``) add a column: validation loss and tokens
    seen per source; multiple-choice tasks (``acc/<task>``, ``acc_norm/<task>``, ``chance/<task>``) another: accuracy
    and normalised accuracy per task, against chance.
    """
    per_source = sorted({k.partition("/")[0] for r in rows for k in r if k.startswith(("val_loss/", "tokens_seen/"))})
    tasks = sorted({k.partition("/")[2] for r in rows for k in r if k.startswith("acc/")})
    columns = 3 + bool(per_source) + bool(tasks)
    fig, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 7.5), constrained_layout=True)
    if title:
        fig.suptitle(title)
    ax = axes[0, 0]
    ax.plot(*_series(rows, "loss"), label="train loss", lw=1)
    steps, val = _series(rows, "val_loss")
    if steps:
        ax.plot(steps, val, "o-", label="val loss", ms=4)
    steps, val_ema = _series(rows, "val_loss_ema")
    if steps:
        ax.plot(steps, val_ema, "s--", label="val loss (weight EMA)", ms=4)
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    for ax, key, label in (
        (axes[0, 1], "lr", "learning rate"),
        (axes[1, 0], "grad_norm", "grad norm (pre-clip)"),
    ):
        ax.plot(*_series(rows, key), lw=1)
        ax.set_ylabel(label)
    ax = axes[1, 1]
    ax.plot(*_series(rows, "tokens_per_sec"), ".-", lw=1, ms=4, label="logged interval")
    if run_tokens_per_sec:
        ax.axhline(run_tokens_per_sec, color="black", lw=1, ls="--",
                   label=f"run: {run_tokens_per_sec:,.0f} (all tokens / all time in steps)")
    ax.set_ylabel("tokens/s (time in training steps)")
    ax.legend(fontsize="small")
    ax = axes[0, 2]
    ax.plot(*_series(rows, "step_time_s"), ".-", lw=1, ms=4, label="step")
    ax.plot(*_series(rows, "data_time_s"), ".-", lw=1, ms=4, label="of which data wait")
    ax.set_ylabel("seconds per step (interval mean)")
    ax.legend(fontsize="small")
    _memory_panel(axes[1, 2], rows)
    if per_source:
        for ax, prefix, label, style in ((axes[0, 3], "val_loss/", "val loss per source (nats/token)", "o-"),
                                         (axes[1, 3], "tokens_seen/", "tokens seen per source", "-")):
            for key in sorted({k for r in rows for k in r if k.startswith(prefix)}):
                ax.plot(*_series(rows, key), style, label=key[len(prefix):], ms=4, lw=1)
            ax.set_ylabel(label)
            ax.legend()
    if tasks:
        panels = ((axes[0, -1], "acc/", "task accuracy"), (axes[1, -1], "acc_norm/", "task accuracy, length-normalised"))
        for ax, prefix, label in panels:
            for task in tasks:
                line, = ax.plot(*_series(rows, prefix + task), "o-", label=task, ms=4, lw=1)
                steps, chance = _series(rows, "chance/" + task)
                if steps:
                    ax.axhline(chance[-1], color=line.get_color(), ls=":", lw=1, label=f"{task}: chance")
            ax.set_ylim(0, 1)
            ax.set_ylabel(label)
            ax.legend()
    for ax in axes.flat:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    _mark_events(axes, events or [])
    _token_axis(axes[0], rows)
    _save(fig, path)


def _memory_panel(ax, rows: list[dict]) -> None:
    """Per logged interval: the device's peak (on a GPU the allocator's peak of the interval; on a CPU the
    process's peak resident set so far), the process's resident set at the log step, NVML's memory in use."""
    for key, label in (("peak_mem_gb", "peak (GPU: allocator, per interval; CPU: resident set, so far)"),
                       ("host_rss_gb", "host resident set at the log step"),
                       ("gpu_mem_used_gb", "GPU memory in use (NVML, all processes)")):
        steps, values = _series([r for r in rows if "loss" in r], key)
        if steps:
            ax.plot(steps, values, ".-", lw=1, ms=4, label=label)
    ax.set_ylabel("memory (GB)")
    ax.set_ylim(bottom=0)
    if ax.lines:
        ax.legend(fontsize="small")


def _mark_events(axes, events: list[dict]) -> None:
    labelled = set()
    for event in events:
        color, style, width = EVENT_STYLES.get(event["kind"], ("tab:gray", ":", 1.2))
        alpha = 0.35 if width > 2 else 1.0
        for ax in axes.flat:
            ax.axvline(event["step"], color=color, ls=style, lw=width, alpha=alpha, zorder=0 if width > 2 else 2)
        if event["kind"] not in labelled:  # one legend entry per kind, on the loss panel
            labelled.add(event["kind"])
            axes[0, 0].plot([], [], color=color, ls=style, lw=width, alpha=alpha, label=event.get("label") or event["kind"])
    if events:
        axes[0, 0].legend(fontsize="small")


def _token_axis(top_row, rows: list[dict]) -> None:
    last = max((r for r in rows if r.get("tokens_seen") and r.get("step")), key=lambda r: r["step"], default=None)
    if last is None:
        return
    tokens_per_step = last["tokens_seen"] / last["step"]
    for ax in top_row:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step, lambda t: t / tokens_per_step))
        top.xaxis.set_major_formatter(EngFormatter(sep=""))  # 120k, 1.5M, 2G: readable at any scale
        top.set_xlabel("tokens")


def plot_memory_throughput(names: list[str], memory_gb: list[float], tokens_per_sec: list[float], path: str | Path) -> None:
    """Per-rank memory and tokens/s side by side, one bar per configuration."""
    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ax_mem.bar(names, memory_gb, color="tab:blue")
    ax_mem.set_ylabel("memory per rank (GB)")
    ax_tps.bar(names, tokens_per_sec, color="tab:orange")
    ax_tps.set_ylabel("tokens/s")
    for ax in (ax_mem, ax_tps):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def _save(fig, path: str | Path) -> None:
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
