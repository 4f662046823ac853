"""The end of a run on paper: ``final.json`` (how it ended), ``run_meta.json``'s ``outcome`` and ``report.md``.

``report.md`` is readable on its own: the curves (``training.png``), tokens, wall time, device-hours and their
cost at ``logging.cost_per_device_hour``, peak memory, final and best validation loss, throughput and MFU, the
environment, and how the configuration differs from the recipe file and from the defaults. Every figure comes
from ``metrics.jsonl``, ``run_meta.json`` and the outcome passed in, so it matches them.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from lmrecipe.config import Config, flatten_config, load_config
from lmrecipe.errors import UserError
from lmrecipe.fileio import write_json_atomic, write_text_atomic
from lmrecipe.observe.doctor import diagnose, report_lines
from lmrecipe.observe.goodput import report_lines as goodput_lines
from lmrecipe.observe.metrics_log import METRICS_FILE, read_metrics, throughput
from lmrecipe.observe.run_meta import record_outcome

logger = logging.getLogger(__name__)

FINAL_FILE = "final.json"
REPORT_FILE = "report.md"


def write_run_end(out_dir: Path, outcome: dict, cost_per_device_hour: float | None,
                  prediction: dict | None = None) -> None:
    """Main process, at the end of a run: ``final.json``, ``run_meta.json["outcome"]``, ``report.md``.

    ``prediction``: the planner's figures at the run's configuration (``lmrecipe.planning.prediction.predict_run``), which the
    report sets against the measured ones.
    """
    write_json_atomic(out_dir / FINAL_FILE, outcome)
    meta = record_outcome(out_dir, outcome)
    write_text_atomic(out_dir / REPORT_FILE, build_report(out_dir, meta, outcome, cost_per_device_hour, prediction))
    logger.info("Run report written to %s", out_dir / REPORT_FILE)


def summarize_metrics(rows: list[dict]) -> dict:
    """The report's figures from metrics rows: throughput, MFU and step time by :func:`throughput` over every
    logged interval, and again without the first (``*_after_first``: start-up and compilation fall in step 1)."""
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    val_ema = [r for r in val if r.get("val_loss_ema") is not None]
    util = [r["gpu_util_pct"] for r in train if r.get("gpu_util_pct") is not None]
    after_first = throughput(train[1:]) if len(train) > 1 else {"tokens_per_sec": None, "train_time_s": None}

    return {
        "last_step": train[-1]["step"] if train else None,
        "tokens_seen": max((r["tokens_seen"] for r in rows if "tokens_seen" in r), default=0),
        "final_loss": train[-1]["loss"] if train else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "best_val_loss": min((r["val_loss"] for r in val), default=None),
        "best_val_step": min(val, key=lambda r: r["val_loss"])["step"] if val else None,
        "final_val_loss_ema": val_ema[-1]["val_loss_ema"] if val_ema else None,
        "best_val_loss_ema": min((r["val_loss_ema"] for r in val_ema), default=None),
        **throughput(train),
        "tokens_per_sec_after_first": after_first["tokens_per_sec"],
        "peak_mem_gb": max((r["peak_mem_gb"] for r in train if r.get("peak_mem_gb") is not None), default=None),
        "gpu_util_pct": sum(util) / len(util) if util else None,
        "gpu_mem_used_gb": max((r["gpu_mem_used_gb"] for r in train if r.get("gpu_mem_used_gb") is not None),
                               default=None),
    }


def task_table(rows: list[dict]) -> list[str]:
    """The multiple-choice tasks' accuracy (``eval.tasks``) at the first and last evaluation that scored them, and
    the best, against chance; nothing when the run scored none."""
    tasks = sorted({k.partition("/")[2] for r in rows for k in r if k.startswith("acc/")})
    if not tasks:
        return []
    lines = ["## Tasks (multiple choice, log-likelihood)", "",
             "| task | chance | accuracy: first (step) | last (step) | best | normalised accuracy: last | best |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for task in tasks:
        scored = [r for r in rows if r.get(f"acc/{task}") is not None]
        first, last = scored[0], scored[-1]
        lines.append(
            f"| {task} | {_fmt(last.get(f'chance/{task}'))} | {_fmt(first[f'acc/{task}'])} ({first['step']}) | "
            f"{_fmt(last[f'acc/{task}'])} ({last['step']}) | {_fmt(max(r[f'acc/{task}'] for r in scored))} | "
            f"{_fmt(last.get(f'acc_norm/{task}'))} | {_fmt(max(r.get(f'acc_norm/{task}', 0.0) for r in scored))} |")
    return lines + [""]


def config_differences(config: dict, recipe: str | None) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """(key, recipe value, run value) where the run differs from its recipe file, and (key, default, recipe value)
    where the recipe differs from the defaults. Without a readable recipe, the first list compares with the
    defaults and the second is empty."""
    run = flatten_config(config)
    defaults = flatten_config(Config().to_dict())
    recipe_values = None
    if recipe:
        try:
            recipe_values = flatten_config(load_config(recipe).to_dict())
        except UserError as err:
            logger.warning("Recipe %s not readable for the report (%s); comparing with the defaults", recipe, err)
    base = recipe_values if recipe_values is not None else defaults
    from_recipe = [(k, base.get(k), v) for k, v in run.items() if base.get(k) != v]
    from_defaults = ([(k, defaults.get(k), v) for k, v in recipe_values.items() if defaults.get(k) != v]
                     if recipe_values is not None else [])
    return from_recipe, from_defaults


def _fmt(value, digits: int = 4, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else f"{value}{unit}"


def _hours(seconds: float) -> str:
    h, rest = divmod(int(round(seconds)), 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def build_report(out_dir: Path, meta: dict, outcome: dict, cost_per_device_hour: float | None,
                 prediction: dict | None = None) -> str:
    rows = read_metrics(out_dir / METRICS_FILE)
    figures = summarize_metrics(rows)
    world = meta.get("world_size", 1)
    wall_s = float(outcome.get("wall_time_s") or 0.0)
    device_hours = wall_s * world / 3600
    tokens_seen = outcome.get("tokens_seen", figures["tokens_seen"])
    cost = f"{device_hours * cost_per_device_hour:,.2f}" if cost_per_device_hour is not None else \
        "n/a (set logging.cost_per_device_hour)"
    versions = meta.get("versions", {})
    hardware = meta.get("hardware", {})
    device = hardware.get("gpu") or f"CPU ({hardware.get('cpu_count')} cores, {hardware.get('torch_threads')} torch threads)"
    ended = "stopped early (no improvement of the validation loss)" if outcome.get("stopped_early") else \
        "preempted" if outcome.get("preempted") else "reached train.max_steps"
    lines = [
        f"# Run report: {out_dir.name}",
        "",
        f"Ended at step {outcome.get('step')} of {meta.get('config', {}).get('train', {}).get('max_steps')}: {ended}.",
        (f"Export: `{outcome['export']}`, taken from checkpoint `{outcome['export_from']}`"
         f"{' (weight EMA)' if outcome.get('export_weights') == 'ema' else ''}."
         if outcome.get("export") else "Export: none (checkpoint.export_at_end=false)."),
        "",
        *(["![training curves](training.png)", ""] if (out_dir / "training.png").is_file() else []),
        "## Figures",
        "",
        "| | |",
        "| --- | --- |",
        f"| tokens seen | {_fmt(tokens_seen)} |",
        f"| parameters | {_fmt(meta.get('n_params'))} |",
        f"| training wall time (all sessions) | {_hours(wall_s)} ({wall_s:,.1f} s) |",
        f"| devices | {world} x {device} |",
        f"| device-hours | {device_hours:,.4f} |",
        f"| cost at {_fmt(cost_per_device_hour, 2)} per device-hour | {cost} |",
        f"| final training loss | {_fmt(figures['final_loss'])} |",
        f"| final validation loss | {_fmt(figures['final_val_loss'])} |",
        f"| best validation loss | {_fmt(figures['best_val_loss'])} (step {_fmt(figures['best_val_step'])}) |",
        *([f"| validation loss of the weight EMA: final, best | {_fmt(figures['final_val_loss_ema'])}, "
           f"{_fmt(figures['best_val_loss_ema'])} |"] if figures["final_val_loss_ema"] is not None else []),
        f"| throughput (tokens/s): tokens of the logged intervals / their time in training steps | "
        f"{_fmt(figures['tokens_per_sec'], 1)} |",
        f"| throughput after the first logged interval (start-up and compilation left out) | "
        f"{_fmt(figures['tokens_per_sec_after_first'], 1)} |",
        f"| time in training steps, of the training wall time | {_fmt(figures['train_time_s'], 1, ' s')} of "
        f"{wall_s:,.1f} s |",
        f"| tokens seen / training wall time (evaluation and checkpoints included) | "
        f"{_fmt(tokens_seen / wall_s if wall_s else None, 1)} |",
        f"| MFU (over the time in training steps) | {_fmt(None if figures['mfu'] is None else 100 * figures['mfu'], 2, ' %')} |",
        f"| peak MFU reference | {_fmt(meta.get('peak_tflops_per_device'), 2)} TFLOP/s per device "
        f"({meta.get('peak_tflops_source', 'n/a')}) |",
        f"| peak memory per process | {_fmt(figures['peak_mem_gb'], 3, ' GB')} |",
        f"| GPU utilisation (NVML, mean of logged steps) | {_fmt(figures['gpu_util_pct'], 1, ' %')} |",
        f"| GPU memory in use (NVML, max) | {_fmt(figures['gpu_mem_used_gb'], 3, ' GB')} |",
        "",
        "Throughput counts the time inside optimizer steps (data wait, forward, backward, optimizer step, the log "
        "step's sync), every logged interval's tokens over every logged interval's seconds. Evaluation, checkpoint "
        "writes and logging between steps, and steps a rollback discarded, are in the wall time only. Each row of "
        "`metrics.jsonl` holds its interval's `interval_steps`, `interval_time_s` and `tokens_per_sec` by the same rule.",
        "",
        *task_table(rows),
        *sample_lines(rows),
        *goodput_lines(out_dir, rows),
        *report_lines(diagnose(rows, meta)),
        *(_plan_check(prediction, figures, meta, hardware.get("gpu")) if prediction else []),
        "## Environment",
        "",
        f"- code: git commit `{meta.get('git_commit')}`",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- platform: {hardware.get('platform')}; precision {meta.get('precision')}; "
        f"{world} process(es); accumulation {meta.get('accum_steps')}",
        f"- container: {_container(meta.get('container'))}",
        f"- recipe: `{meta.get('recipe') or 'none'}`; resumed from: {meta.get('resumed_from') or 'no (fresh start)'}",
        *_branch_line(meta.get("branched_from")),
        "",
        *_launches(meta.get("launches", [])),
    ]
    from_recipe, from_defaults = config_differences(meta.get("config", {}), meta.get("recipe"))
    lines += _table("## Configuration: differences from the recipe file" if meta.get("recipe") else
                    "## Configuration: differences from the defaults", ("recipe" if meta.get("recipe") else "default"),
                    "this run", from_recipe)
    if meta.get("recipe"):
        lines += _table("## The recipe file's differences from the defaults", "default", "recipe", from_defaults)
    lines.append("The resolved configuration is in `config.yaml`; every logged step is in `metrics.jsonl`.")
    return "\n".join(lines) + "\n"


def _plan_check(predicted: dict, figures: dict, meta: dict, gpu: str | None) -> list[str]:
    """The planner's figures at this run's configuration against the measured ones."""
    def row(name: str, key: str, scale: float = 1.0, digits: int = 4, unit: str = "", measured=None) -> str:
        p = predicted.get(key)
        m = figures.get(key) if measured is None else measured
        ratio = f"{m / p:,.2f}" if p and m is not None else "n/a"
        return (f"| {name} | {_fmt(None if p is None else p * scale, digits, unit)} | "
                f"{_fmt(None if m is None else m * scale, digits, unit)} | {ratio} |")

    memory_note = ("the allocator's peak" if gpu else
                   "the process's peak resident set, which also holds the Python runtime and its libraries")
    lines = [
        "## Plan against measurement",
        "",
        f"Predicted by `lmrecipe.planning.prediction.predict_run` at this run's configuration: MFU {100 * predicted['mfu']:.0f}% "
        f"assumed ({predicted['mfu_source']}), {meta.get('peak_tflops_per_device', float('nan')):.3g} TFLOP/s "
        f"per device, {_fmt(meta.get('flops_per_token'), 0)} FLOPs per token; memory by `lmrecipe.planning.memory.estimate` "
        f"(model states, activations of one micro-batch). Measured memory: {memory_note}. Measured throughput, MFU "
        "and step time: over the time in training steps of every logged interval, as in the figures above.",
        "",
        "| | predicted | measured | measured / predicted |",
        "| --- | --- | --- | --- |",
        row("throughput (tokens/s, all processes)", "tokens_per_sec", digits=1),
        row("MFU", "mfu", 100.0, 2, " %"),
        row("step time (s)", "step_time_s"),
        row("peak memory per process", "peak_mem_gb", digits=3, unit=" GB"),
    ]
    if predicted.get("model_states_measured_gb") is not None:
        lines.append(row("model states per process (largest rank)", "model_states_gb", digits=3, unit=" GB",
                         measured=predicted["model_states_measured_gb"]))
    return lines + [""] + ([] if gpu else _cpu_note(predicted, figures, meta))


def _cpu_note(predicted: dict, figures: dict, meta: dict) -> list[str]:
    """What the plan table means when the run trained on a CPU: the planner models an accelerator's memory and
    judges time against the CPU's own measured matmul rate."""
    before = [launch["host_rss_gb_before_training"] for launch in meta.get("launches", [])
              if launch.get("host_rss_gb_before_training") is not None]
    resident = (f" {before[-1]:,.3f} GB of it was already resident before the first step of the last session "
                "(the interpreter, torch and the other libraries, the model, the data index)." if before else "")
    peak = meta.get("peak_tflops_per_device")
    return [
        "On a CPU the planner's figures are those of the accelerator it models, and they read differently here. "
        "Memory: the prediction counts the model states and one micro-batch's activations, as an accelerator's "
        "allocator would hold them; the measured figure is the process's peak resident set (`ru_maxrss`), which "
        f"also holds the Python process, its libraries and the allocator's free blocks.{resident} "
        f"Time: the prediction is {100 * predicted['mfu']:.0f}% of this CPU's measured matmul rate "
        f"({_fmt(peak, 4)} TFLOP/s per process: a 1024 x 1024 {meta.get('precision')} matmul on "
        f"{meta.get('hardware', {}).get('torch_threads')} torch threads, {meta.get('peak_tflops_source', 'n/a')}); "
        "other processes sharing the cores during training slow the steps, and the reference only as far as they "
        "slowed the cached probes.",
        "",
    ]


def _branch_line(branched_from: dict | None) -> list[str]:
    """The report's line on the checkpoint a branch (``checkpoint.branch_from``) started from; none otherwise."""
    if not branched_from:
        return []
    return [f"- branched from: `{branched_from.get('checkpoint')}` (step {branched_from.get('step')} of the run "
            f"`{branched_from.get('out_dir')}`)"]


def _launches(launches: list[dict]) -> list[str]:
    """The run's sessions (``run_meta.json``'s ``launches``): where each started, how, and what happened in it."""
    if not launches:
        return []
    lines = ["## Sessions", "", "| started (UTC) | at step | resumed from | processes | command | events |",
             "| --- | --- | --- | --- | --- | --- |"]
    for launch in launches:
        command = " ".join(launch["command"]).replace("|", "\\|") if launch.get("command") else "n/a (started from Python)"
        events = "; ".join([*_restart(launch), *(
            f"rolled back to step {e['step']}" if e["kind"] == "rollback" else
            f"stopped after step {e['step']} (exit {e.get('exit_code')}{', preempted' if e.get('preempted') else ''})"
            for e in launch.get("events", []))])
        lines.append(f"| {launch.get('started_at')} | {launch.get('start_step')} | "
                     f"{launch.get('resumed_from') or 'no (fresh start)'} | {launch.get('world_size')} | "
                     f"`{command}` | {events} |")
    return lines + [""]


def _restart(launch: dict) -> list[str]:
    """The session's note when ``slurm/train.sbatch`` ran the training step again in the same job."""
    env = launch.get("launcher_env", {})
    if not env.get("LMRECIPE_JOB_RESTART"):
        return []
    return [f"run again in the same job after {env.get('LMRECIPE_JOB_RESTART_REASON', 'a failure')} "
            f"(restart {env['LMRECIPE_JOB_RESTART']})"]


def _container(info: dict | None) -> str:
    if not info:
        return "none (ran on the host)"
    return f"{info.get('runtime') or 'unknown runtime'}, image {info.get('image') or 'unknown'}"


def _table(title: str, base_name: str, new_name: str, diffs: list) -> list[str]:
    lines = [title, ""]
    if not diffs:
        return lines + ["None.", ""]
    lines += [f"| key | {base_name} | {new_name} |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {json.dumps(old)} | {json.dumps(new)} |" for k, old, new in diffs]
    return lines + [""]


def sample_lines(rows: list[dict]) -> list[str]:
    """The greedy continuations of ``eval.samples`` at the last evaluation that wrote them (its ``samples`` row);
    nothing when the run sampled none."""
    last = next((r for r in reversed(rows) if r.get("samples")), None)
    if last is None:
        return []
    lines = [f"## Samples (greedy, step {last['step']})", ""]
    for sample in last["samples"]:
        lines += [f"- `{_one_line(sample['prompt'])}` -> `{_one_line(sample['text'])}`"]
    return lines + [""]


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n").replace("`", "'")
