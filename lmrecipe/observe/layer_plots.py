"""``layers.png``: the per-layer instruments (``logging.layer_stats``) as heat maps, part of the model x logged step."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on clusters; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from lmrecipe.fileio import atomic_path  # noqa: E402

PANELS = (("grad_norm", "gradient norm (pre-clip), log10"), ("update_ratio", "update / parameter norm, log10"))


def layer_grid(rows: list[dict], figure: str) -> tuple[list[str], list[int], list[list[float]]]:
    """(parts in the rows' order, logged steps, ``log10`` of ``<figure>/<part>`` per part and step; NaN where a row
    lacks it or the value is not positive)."""
    parts: list[str] = []
    for row in rows:
        for key in row:
            if key.startswith(f"{figure}/") and (part := key.partition("/")[2]) not in parts:
                parts.append(part)
    logged = [row for row in rows if any(f"{figure}/{part}" in row for part in parts)]
    steps = [row["step"] for row in logged]
    grid = [[_log10(row.get(f"{figure}/{part}")) for row in logged] for part in parts]
    return parts, steps, grid


def _log10(value) -> float:
    return math.log10(value) if isinstance(value, (int, float)) and value > 0 and math.isfinite(value) else math.nan


def plot_layers(rows: list[dict], path: str | Path, title: str | None = None) -> None:
    """Two heat maps of ``rows`` (metrics.jsonl's): each part's gradient norm and update ratio (rows: embeddings at
    the top, then the blocks, the final norm, the head) against the logged steps."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6.5 * len(PANELS), 5.5), constrained_layout=True)
    if title:
        fig.suptitle(title)
    for ax, (figure, label) in zip(axes, PANELS):
        parts, steps, grid = layer_grid(rows, figure)
        if not steps:
            ax.set_axis_off()
            continue
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks(range(len(parts)), parts, fontsize=7 if len(parts) > 20 else 9)
        ticks = sorted({round(i * (len(steps) - 1) / max(1, min(8, len(steps) - 1))) for i in range(min(9, len(steps)))})
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.set_xlabel("optimizer step (logged)")
        ax.set_title(label)
        fig.colorbar(image, ax=ax)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
