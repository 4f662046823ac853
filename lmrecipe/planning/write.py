"""A plan written out: the text ``tools/plan.py`` prints, its JSON summary, and the recipe it writes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from lmrecipe.config import Config, load_config, save_config
from lmrecipe.planning.budget import STAGES, Plan, format_duration, format_count


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


def write_recipe(plan: Plan, base_recipe: str | None, path: str | Path, base_overrides: list[str] = ()) -> Config:
    """Write the chosen configuration as a recipe YAML (atomically) that ``train.py`` accepts; returns it as loaded."""
    path = Path(path)
    cfg = load_config(base_recipe, [*base_overrides, *recipe_overrides(plan, f"runs/{path.stem}")])
    save_config(cfg, path)
    return load_config(path)


def format_plan(plan: Plan) -> str:
    """The plan as the text ``tools/plan.py`` prints."""
    i, c = plan.inputs, plan.chosen
    asked = (f"{i.days:g} days" if i.days is not None else
             " and ".join(x for x in (f"{format_count(i.params)} parameters" if i.params is not None else "",
                                      f"{format_count(i.tokens)} tokens" if i.tokens is not None else "") if x))
    lines = [
        f"Devices: {i.devices} x {i.device.name}, {i.peak_tflops:,.3g} TFLOP/s peak ({i.precision}), "
        f"{i.memory_gb:,.0f} GB each ({100 * i.reserve:.0f}% kept free); MFU {100 * i.mfu:.1f}% ({i.mfu_source})",
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
    lines += ["", "Memory per device (GB, lmrecipe.planning.memory.estimate) by ZeRO stage, and whether it fits "
              f"{c.capacity_bytes / 1e9:,.1f} GB:"]
    header = f"  {'params':>9}" + "".join(f"  {'ZeRO-' + str(s) if s else 'no ZeRO':>14}" for s in STAGES)
    lines.append(header)
    for s in plan.shapes:
        cells = [x for x in plan.candidates if x.shape == s]
        lines.append(f"  {format_count(s.n_params):>9}" + "".join(
            f"  {x.device_bytes / 1e9:>10,.2f} {'ok ' if x.fits else 'OOM'}" for x in cells))
    run_tokens = plan.max_steps * plan.global_batch_size * i.seq_len
    cost = (f", cost {plan.device_hours * i.cost_per_device_hour:,.2f} at {i.cost_per_device_hour:g} per device-hour"
            if i.cost_per_device_hour is not None else "")
    lines += [
        "",
        f"Chosen: {c.shape.describe()} ({format_count(c.shape.n_params)} params), "
        f"{'ZeRO-' + str(c.stage) if c.stage else 'no ZeRO'}: {c.device_bytes / 1e9:,.2f} GB per device, "
        f"{c.headroom_bytes / 1e9:,.2f} GB headroom (the nearest fitting shape to the optimum, under the stage that "
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
        "chosen": {"n_params": c.shape.n_params, "stage": c.stage, "device_bytes": c.device_bytes,
                   "headroom_bytes": c.headroom_bytes},
        "tokens": plan.max_steps * plan.global_batch_size * i.seq_len, "max_steps": plan.max_steps,
        "global_batch_size": plan.global_batch_size, "tokens_per_sec": plan.tokens_per_sec,
        "wall_seconds": plan.wall_seconds, "device_hours": plan.device_hours,
        "cost": plan.device_hours * i.cost_per_device_hour if i.cost_per_device_hour is not None else None,
        "warnings": plan.warnings,
    }
