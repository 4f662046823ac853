"""PNG figures people would rather look at than read."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on clusters; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from lmrecipe.fileio import atomic_path  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_training(rows: list[dict], path: str | Path) -> None:
    """Train/val loss, learning rate, grad norm and tokens/s against optimizer step.

    A data mixture's rows (``val_loss/<name>``, ``tokens_seen/<name>``) add a column: validation loss and tokens
    seen per source; multiple-choice tasks (``acc/<task>``, ``acc_norm/<task>``, ``chance/<task>``) another: accuracy
    and normalised accuracy per task, against chance.
    """
    per_source = sorted({k.partition("/")[0] for r in rows for k in r if k.startswith(("val_loss/", "tokens_seen/"))})
    tasks = sorted({k.partition("/")[2] for r in rows for k in r if k.startswith("acc/")})
    columns = 2 + bool(per_source) + bool(tasks)
    fig, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 7), constrained_layout=True)
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
        (axes[1, 1], "tokens_per_sec", "tokens/s"),
    ):
        ax.plot(*_series(rows, key), lw=1)
        ax.set_ylabel(label)
    if per_source:
        for ax, prefix, label, style in ((axes[0, 2], "val_loss/", "val loss per source (nats/token)", "o-"),
                                         (axes[1, 2], "tokens_seen/", "tokens seen per source", "-")):
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
    _save(fig, path)


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
