"""A plan written out: the text ``tools/plan.py`` prints, its JSON summary, and the recipe it writes."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import yaml

from lmrecipe.config import Config, load_config
from lmrecipe.fileio import write_text_atomic
from lmrecipe.planning.budget import STAGES, GiB, Plan, format_duration, format_count


def recipe_overrides(plan: Plan, out_dir: str) -> list[str]:
    """The ``key=value`` overrides that turn the base recipe into the chosen configuration."""
    i, c = plan.inputs, plan.chosen
    warmup = min(i.base.schedule.warmup_steps, max(1, plan.max_steps // 10))

    def every(interval: int) -> int:  # an interval no longer than the run (0 keeps its meaning: never / end only)
        return min(interval, plan.max_steps)

    out = [*c.shape.overrides(), f"data.seq_len={i.seq_len}", f"model.max_position_embeddings={i.seq_len}",
           f"train.micro_batch_size={i.micro_batch_size}", f"train.global_batch_size={plan.global_batch_size}",
           f"train.max_steps={plan.max_steps}", f"schedule.warmup_steps={warmup}",
           f"train.eval_every_steps={every(i.base.train.eval_every_steps)}",
           f"checkpoint.every_steps={every(i.base.checkpoint.every_steps)}",
           f"train.gradient_checkpointing={str(i.gradient_checkpointing).lower()}",
           f"distributed.deepspeed_config={'null' if c.stage == 0 else f'zero{c.stage}'}", f"out_dir={out_dir}",
           f"model.vocab_size={i.vocab_size}"]
    if i.cost_per_device_hour is not None:
        out.append(f"logging.cost_per_device_hour={i.cost_per_device_hour}")
    if i.device.name != "cpu":
        out.append(f"train.precision={i.precision}")
    return out


def write_recipe(plan: Plan, base_recipe: str | None, path: str | Path, base_overrides: list[str] = (),
                 command: str = "tools/plan.py") -> Config:
    """Write the chosen configuration (atomically) as a recipe that ``train.py`` accepts: a comment saying which plan
    it is and the ``command`` that made it, ``base:`` the base recipe (relative to the written file's folder), and
    only the keys that differ from it. Returns it as loaded."""
    path = Path(path)
    cfg = load_config(base_recipe, [*base_overrides, *recipe_overrides(plan, f"runs/{path.stem}")])
    changed = cfg.to_dict()
    lines = [f"# {line}" for line in plan_comment(plan, command)]
    if base_recipe is not None:
        changed = changed_keys(load_config(base_recipe).to_dict(), changed)
        lines.append(f"base: {os.path.relpath(Path(base_recipe).resolve(), path.resolve().parent)}")
    write_text_atomic(path, "\n".join(lines) + "\n" + yaml.safe_dump(changed, sort_keys=False))
    return load_config(path)


def plan_comment(plan: Plan, command: str) -> list[str]:
    """The written recipe's first lines: the plan it holds and the command that wrote it."""
    i, c = plan.inputs, plan.chosen
    return [f"Planned by {command}",
            f"{i.devices} x {i.device.name}, MFU {100 * i.mfu:.1f}%: {c.shape.describe()} "
            f"({format_count(c.shape.n_params)} parameters), {'ZeRO-' + str(c.stage) if c.stage else 'no ZeRO'}, "
            f"{c.device_bytes / GiB:,.1f} GiB per device estimated;",
            f"{plan.max_steps:,} steps x {plan.global_batch_size} sequences x {i.seq_len} tokens, predicted "
            f"{format_duration(plan.wall_seconds)}."]


def changed_keys(base: dict, cfg: dict) -> dict:
    """The entries of ``cfg`` (a ``Config.to_dict()``) whose values differ from ``base``'s, section by section; a
    value (a list, ``model.extra``) is kept whole, as the recipe loader replaces it whole."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "extra":
            inner = changed_keys(base[key], value)
            if inner:
                out[key] = inner
        elif base.get(key) != value:
            out[key] = value
    return out


def format_plan(plan: Plan) -> str:
    """The plan as the text ``tools/plan.py`` prints."""
    i, c = plan.inputs, plan.chosen
    asked = (f"{i.days:g} days" if i.days is not None else
             " and ".join(x for x in (f"{format_count(i.params)} parameters" if i.params is not None else "",
                                      f"{format_count(i.tokens)} tokens" if i.tokens is not None else "") if x))
    lines = [
        f"Devices: {i.devices} x {i.device.name}, {i.peak_tflops:,.3g} TFLOP/s peak ({i.precision}), "
        f"{i.memory_bytes / GiB:,.1f} GiB each ({100 * i.reserve:.0f}% kept free); MFU {100 * i.mfu:.1f}% "
        f"({i.mfu_source})",
        f"Asked: {asked}; {i.tokens_per_param:g} tokens per parameter (Hoffmann et al. 2022); seq_len {i.seq_len}, "
        f"micro-batch {i.micro_batch_size}, vocabulary {i.vocab_size:,}, activation checkpointing "
        f"{'on' if i.gradient_checkpointing else 'off'}",
        "",
        f"Compute budget:   {plan.compute_flops:.3e} FLOPs",
        f"Compute-optimal:  {format_count(plan.optimal_params)} parameters, {format_count(plan.optimal_tokens)} tokens",
        "",
        "Shapes (FLOPs per token: 6 x active non-embedding parameters + attention at seq_len):",
    ]
    for s in plan.shapes:
        lines.append(f"  {format_count(s.n_params):>9} params  {s.flops_per_token(i.seq_len) / 1e9:>9,.3f} GFLOP/token  "
                     f"{s.describe()}")
    lines += ["", "Memory per device (GiB, lmrecipe.planning.memory.estimate) by ZeRO stage, and whether it fits "
              f"{c.capacity_bytes / GiB:,.1f} GiB:"]
    header = f"  {'params':>9}" + "".join(f"  {'ZeRO-' + str(s) if s else 'no ZeRO':>14}" for s in STAGES)
    lines.append(header)
    for s in plan.shapes:
        cells = [x for x in plan.candidates if x.shape == s]
        lines.append(f"  {format_count(s.n_params):>9}" + "".join(
            f"  {x.device_bytes / GiB:>10,.2f} {'ok ' if x.fits else 'OOM'}" for x in cells))
    run_tokens = plan.max_steps * plan.global_batch_size * i.seq_len
    cost = (f", cost {plan.device_hours * i.cost_per_device_hour:,.2f} at {i.cost_per_device_hour:g} per device-hour"
            if i.cost_per_device_hour is not None else "")
    lines += [
        "",
        f"Chosen: {c.shape.describe()} ({format_count(c.shape.n_params)} params), "
        f"{'ZeRO-' + str(c.stage) if c.stage else 'no ZeRO'}: {c.device_bytes / GiB:,.2f} GiB per device, "
        f"{c.headroom_bytes / GiB:,.2f} GiB headroom (the nearest fitting shape to the optimum, under the stage that "
        "leaves the most memory free)",
        f"Run: {format_count(run_tokens)} tokens ({run_tokens / c.shape.n_params:,.1f} per parameter) = "
        f"{plan.max_steps:,} steps x {plan.global_batch_size} sequences x {i.seq_len} tokens",
        f"Predicted: {plan.tokens_per_sec:,.0f} tokens/s, wall time {format_duration(plan.wall_seconds)}, "
        f"{plan.device_hours:,.1f} device-hours{cost}",
        *(["", *plan.notes] if plan.notes else []),
    ]
    return "\n".join(lines)


def plan_summary(plan: Plan) -> dict:
    """The plan as JSON-ready numbers (``tools/plan.py --json``)."""
    i, c = plan.inputs, plan.chosen
    return {
        "devices": i.devices, "device": i.device.name, "peak_tflops": i.peak_tflops, "mfu": i.mfu,
        "precision": i.precision, "compute_flops": plan.compute_flops, "optimal_params": plan.optimal_params,
        "optimal_tokens": plan.optimal_tokens,
        "shapes": [{"n_params": s.n_params, "flops_per_token": s.flops_per_token(i.seq_len), **asdict(s),
                    "device_bytes": {str(x.stage): x.device_bytes for x in plan.candidates if x.shape == s}}
                   for s in plan.shapes],
        "memory_bytes": i.memory_bytes, "reserve": i.reserve,
        "chosen": {"n_params": c.shape.n_params, "stage": c.stage, "device_bytes": c.device_bytes,
                   "headroom_bytes": c.headroom_bytes},
        "tokens": plan.max_steps * plan.global_batch_size * i.seq_len, "max_steps": plan.max_steps,
        "global_batch_size": plan.global_batch_size, "tokens_per_sec": plan.tokens_per_sec,
        "wall_seconds": plan.wall_seconds, "device_hours": plan.device_hours,
        "cost": plan.device_hours * i.cost_per_device_hour if i.cost_per_device_hour is not None else None,
        "warnings": plan.warnings,
    }
