"""Mid-training on the tiny recipe: cosine against warmup-stable-decay with decay branches, and checkpoint averaging.

    .venv/bin/python bench/mid_training.py --steps 300
    .venv/bin/python bench/mid_training.py --steps 20 --average 2 --set model.hidden_size=64 --set model.num_layers=2 \
        --set data.seq_len=32 --set model.intermediate_size=128     # a quick check of the script

Four runs of recipes/tiny.yaml on --data, in this process, one after the other (all with the recipe's warmup and
peak learning rate, a validation every --steps/10 steps):

1. **cosine**: the recipe's schedule, cosine decay over the whole run to ``optim.min_lr``;
2. **wsd-90**: warmup-stable-decay with ``schedule.decay_fraction=0.1`` (the decay starts at 90 % of the run),
   saving a checkpoint every --steps/10 steps, all kept: the stable trunk;
3. **wsd-80**: a decay branch (``checkpoint.branch_from``) of wsd-90's checkpoint at 80 %, with
   ``schedule.decay_steps`` = 20 % of the run: the run that would have started its decay at 80 %;
4. **average**: the uniform average (``tools/average_checkpoints.py``'s module) of wsd-90's last --average
   checkpoints of the stable phase, up to 90 %, against the last of them alone.

The table compares validation losses at equal tokens: each end point is evaluated by ``evaluate_path`` (eval.py)
on the same validation windows (--eval-batches batches of 8; by default the windows training validates on, so the
table's figures are points of the curves). The figure draws the runs' validation curves (as
logged during training) and learning rates against tokens. Peak memory of the averaging: a fresh process averages
1 and then --average checkpoints, reporting its resident set before (imports done) and its peak (``VmHWM``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
from pathlib import Path

import _common as C  # noqa: E402


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def average_worker(checkpoints: list[str], out: str) -> None:
    """Average ``checkpoints`` into ``out`` in this process; print its resident floor and peak (MB)."""
    import lmrecipe.average as average  # noqa: F401  (imports first: they are the floor)
    import transformers  # noqa: F401

    floor = _status_kb("VmRSS")
    result = average.average_checkpoints([Path(c) for c in checkpoints], out, overwrite=True)
    C.print_result({"floor_mb": floor / 1024, "peak_mb": _status_kb("VmHWM") / 1024, "k": len(result.checkpoints)})


def train_run(recipe: str, data: str, out: Path, overrides: list[str]) -> Path:
    from lmrecipe.config import load_config
    from lmrecipe.train.trainer import train

    cfg = load_config(recipe, [f"out_dir={out}", f"data.path={data}", "logging.progress_bar=false",
                               "logging.trackers=[]", "checkpoint.export_at_end=false", *overrides])
    with C.quiet_stdout():
        train(cfg)
    return out


def rows(run: Path, key: str) -> dict[int, float]:
    from lmrecipe.observe.metrics_log import read_metrics

    return {r["step"]: r[key] for r in read_metrics(run / "metrics.jsonl") if key in r}


def plot(path: Path, runs: dict[str, Path], lrs: dict[str, list[float]], tokens_per_step: int,
         average: tuple[int, float, float, int]) -> None:
    """Validation curves (as logged) and learning rates of the runs against tokens, and the averaging's two points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, run in runs.items():
        val = rows(run, "val_loss")
        if name == "wsd-80":  # the branch's curve starts where it leaves its trunk
            val = {**{s: v for s, v in rows(runs["wsd-90"], "val_loss").items() if s < min(val)}, **val}
        top.plot([s * tokens_per_step for s in val], list(val.values()), marker=".", label=name)
        bottom.plot([(s + 1) * tokens_per_step for s in range(len(lrs[name]))], lrs[name], label=name)
    step, single, averaged, k = average
    top.scatter([step * tokens_per_step], [single], marker="x", color="black", zorder=5,
                label=f"stable checkpoint, step {step} (eval.py)")
    top.scatter([step * tokens_per_step], [averaged], marker="*", s=80, color="red", zorder=5,
                label=f"average of the last {k} stable checkpoints (eval.py)")
    top.set_ylabel("validation loss")
    finals = [v for run in runs.values() for v in rows(run, "val_loss").values()]
    top.set_ylim(min(finals + [single, averaged]) - 0.1, sorted(finals)[len(finals) // 2] + 0.5)
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("training tokens")
    bottom.grid(alpha=0.3)
    fig.suptitle("tiny recipe: cosine vs warmup-stable-decay branches; checkpoint averaging")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def schedule(recipe: str, overrides: list[str], n: int) -> list[float]:
    """The learning rate of each step of a run of ``recipe`` with ``overrides`` (``optim.lr_at``)."""
    from lmrecipe.config import load_config
    from lmrecipe.optim import lr_at

    cfg = load_config(recipe, [*overrides, f"train.max_steps={n}"])
    return [lr_at(s, n, cfg.optim, cfg.schedule) for s in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each full run (default: %(default)s)")
    parser.add_argument("--average", type=int, default=4,
                        help="checkpoints of the stable phase averaged (default: %(default)s)")
    parser.add_argument("--eval-batches", type=int, default=None,
                        help="validation batches of 8 windows (default: the recipe's data.val_windows / 8, the windows "
                             "training validates on)")
    parser.add_argument("--work", default=None,
                        help="folder for the runs, kept: a second call with the same arguments reuses the finished ones "
                             "(default: a temporary folder, removed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run (e.g. model.hidden_size=64 for a quick check)")
    parser.add_argument("--average-worker", nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--output", default=None, help="folder for the .txt/.json/.png results (default: bench/results)")
    args = parser.parse_args()
    if args.average_worker:
        average_worker(args.average_worker[:-1], args.average_worker[-1])
        return 0
    C.check_data(args.data)
    C.set_threads(args.threads)
    logging.disable(logging.INFO)
    from lmrecipe.average import average_checkpoints
    from lmrecipe.checkpoint.storage import complete_checkpoints, step_dir_name
    from lmrecipe.config import load_config
    from lmrecipe.evaluation.evaluate import evaluate_path

    n = args.steps
    every = max(1, n // 10)
    at80, at90 = round(0.8 * n), round(0.9 * n)
    report = C.Report("mid_training", "cpu", args.output)
    with contextlib.ExitStack() as stack:
        tmp = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_mid_")))
        common = [*args.set, f"train.max_steps={n}", f"train.eval_every_steps={every}"]
        runs = {
            "cosine": train_run(args.recipe, args.data, tmp / "cosine", [
                *common, f"checkpoint.every_steps={every}", "checkpoint.keep_last=1000"]),
            "wsd-90": train_run(args.recipe, args.data, tmp / "wsd90", [
                *common, "schedule.decay_fraction=0.1", f"checkpoint.every_steps={every}", "checkpoint.keep_last=1000"]),
        }
        trunk = tmp / "wsd90" / "checkpoints"
        runs["wsd-80"] = train_run(args.recipe, args.data, tmp / "wsd80", [
            *common, f"schedule.decay_steps={n - at80}", "checkpoint.every_steps=0",
            f"checkpoint.branch_from={trunk / step_dir_name(at80)}"])
        stable = [c.path for c in complete_checkpoints(trunk) if c.step <= at90][-args.average:]
        averaged = average_checkpoints(stable, tmp / "average", overwrite=True)

        recipe = load_config(args.recipe, args.set)
        tokens_per_step = recipe.train.global_batch_size * recipe.data.seq_len
        eval_batches = args.eval_batches or max(1, recipe.data.val_windows // 8)

        def val(path: Path) -> float:
            result, _ = evaluate_path(path, args.data, max_batches=eval_batches, batch_size=8)
            return result["loss"]

        figures = {
            "cosine_end": val(tmp / "cosine" / "checkpoints" / step_dir_name(n)),
            "wsd90_end": val(trunk / step_dir_name(n)),
            "wsd80_end": val(tmp / "wsd80" / "checkpoints" / step_dir_name(n)),
            "cosine_at90": val(tmp / "cosine" / "checkpoints" / step_dir_name(at90)),
            "stable_last": val(stable[-1]),
            "stable_average": val(averaged.out),
        }
        memory = {k: C.run_worker([sys.executable, "bench/mid_training.py", "--average-worker",
                                   *map(str, stable[-k:]), str(tmp / f"mem{k}")], f"average {k}")
                  for k in (1, len(stable))}
        model_mb = sum(p.stat().st_size for p in averaged.out.glob("model-*.safetensors")) / 2**20
        report.figures = {**figures, "steps": n, "tokens_per_step": tokens_per_step, "averaged": [c.name for c in stable],
                          "memory": memory, "model_fp32_mb": model_mb}
        report.line()
        report.line(f"{n} optimizer steps of {tokens_per_step} tokens; validation loss by eval.py's evaluate_path on "
                    f"{eval_batches} batches of 8 windows")
        report.line()
        report.line("| tokens | run | validation loss |")
        report.line("|---:|---|---:|")
        for name, key in (("cosine (decay over the whole run)", "cosine_end"), ("WSD, decay over the last 10 %",
                          "wsd90_end"), ("WSD branch at 80 %, decay over the last 20 %", "wsd80_end")):
            report.line(f"| {n * tokens_per_step:,} | {name} | {figures[key]:.4f} |")
        names = ", ".join(c.name for c in stable)
        report.line(f"| {at90 * tokens_per_step:,} | WSD stable phase, last checkpoint ({stable[-1].name}) | "
                    f"{figures['stable_last']:.4f} |")
        report.line(f"| {at90 * tokens_per_step:,} | WSD stable phase, uniform average of {len(stable)} ({names}) | "
                    f"{figures['stable_average']:.4f} |")
        report.line(f"| {at90 * tokens_per_step:,} | cosine at the same step (step_{at90:08d}) | "
                    f"{figures['cosine_at90']:.4f} |")
        report.line()
        for k, m in memory.items():
            report.line(f"averaging {k} checkpoint(s): resident {m['floor_mb']:.0f} MB after imports, peak "
                        f"{m['peak_mb']:.0f} MB (the model's weights in fp32: {model_mb:.1f} MB)")
        out_dir = report.output_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        trunk_lrs = schedule(args.recipe, [*args.set, "schedule.decay_fraction=0.1"], n)
        lrs = {"cosine": schedule(args.recipe, args.set, n), "wsd-90": trunk_lrs,
               "wsd-80": trunk_lrs[:at80] + schedule(args.recipe, [*args.set, f"schedule.decay_steps={n - at80}"], n)[at80:]}
        plot(out_dir / "mid_training.png", runs, lrs, tokens_per_step,
             (at90, figures["stable_last"], figures["stable_average"], len(stable)))
        report.line(f"figure: {out_dir / 'mid_training.png'}")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
