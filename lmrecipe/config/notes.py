"""Settings that are valid but that a run, as configured, never reaches: notes for ``train.py --dry-run`` and
warnings at start-up, each naming the key, the value and what it meets.

A data stage or a batch-size ramp point that starts at or after ``train.max_steps`` is allowed (a short smoke run
of a long recipe trains its first steps): the run ends before the setting takes effect, and these say so.
"""

from __future__ import annotations

from lmrecipe.config.sections import DataConfig, TrainConfig


def unreached_steps(data: DataConfig, train: TrainConfig) -> list[str]:
    """One note per key whose stages or ramp points start at or after ``train.max_steps`` (the optimizer steps run
    0 .. max_steps - 1): ``data.stages``, ``train.batch_ramp`` or the linear ramp; [] when every one is reached."""
    return [note for note in (_unreached_stages(data, train.max_steps), _unreached_ramp(train)) if note]


def _unreached_stages(data: DataConfig, max_steps: int) -> str | None:
    late = [(i, stage.start_step) for i, stage in enumerate(data.stages) if stage.start_step >= max_steps]
    if not late:
        return None
    keys = ", ".join(f"data.stages[{i}] (start_step {step})" for i, step in late)
    return (f"{keys} {_never(len(late), max_steps)}: the run trains on data.stages[{late[0][0] - 1}]'s weights to its end. "
            f"Raise train.max_steps above {late[-1][1]} to train every stage.")


def _unreached_ramp(train: TrainConfig) -> str | None:
    points, max_steps = train.ramp_points(), train.max_steps
    late = [(i, step, size) for i, (step, size) in enumerate(points) if step >= max_steps]
    if not late:
        return None
    ends = (f"the run ends at {points[late[0][0] - 1][1]} sequences per step, below train.global_batch_size="
            f"{train.global_batch_size}. Raise train.max_steps above {late[-1][1]} to reach the full size.")
    if not train.batch_ramp:
        return (f"The linear batch-size ramp (train.batch_ramp_start_size={train.batch_ramp_start_size}, "
                f"train.batch_ramp_increment={train.batch_ramp_increment}, train.batch_ramp_steps_per_increment="
                f"{train.batch_ramp_steps_per_increment}) reaches train.global_batch_size only at step {late[-1][1]}, "
                f"at or after train.max_steps={max_steps} (the last optimizer step is {max_steps - 1}): its sizes "
                f"from step {late[0][1]} on never take effect, and {ends}")
    keys = ", ".join(f"train.batch_ramp[{i}] (step {step}, size {size})" for i, step, size in late)
    return f"{keys} {_never(len(late), max_steps)}: {ends}"


def _never(count: int, max_steps: int) -> str:
    return (f"{'starts' if count == 1 else 'start'} at or after train.max_steps={max_steps} (the last optimizer step "
            f"is {max_steps - 1}), so {'it never takes' if count == 1 else 'they never take'} effect")
