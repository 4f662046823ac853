"""Mid-training on the tiny recipe: cosine against warmup-stable-decay with decay branches, and checkpoint averaging
(docs/benchmarks/14-mid-training.md; the losses are plotted in ``mid_training.png``).

    bench/run.py mid_training --steps 300
    bench/run.py mid_training --steps 20 --average 2 --set model.hidden_size=64 --set model.num_layers=2 \
        --set data.seq_len=32 --set model.intermediate_size=128 --set schedule.warmup_steps=2   # a quick check
"""

import logging
import tempfile
from pathlib import Path

import _common as C

PAIRS = None


def options(parser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each full run (default: %(default)s)")
    parser.add_argument("--average", type=int, default=4, help="checkpoints of the stable phase averaged (default: %(default)s)")
    parser.add_argument("--work", default=None, help="folder for the runs, kept (default: a temporary folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for every run")
    parser.add_argument("--checkpoints", nargs="*", default=[], help="worker: the checkpoints to average")
    parser.add_argument("--out", default=None, help="worker: the averaged checkpoint's folder")


def worker(args) -> dict:
    """Average ``--checkpoints`` into ``--out`` in this process: its resident floor and peak (MB)."""
    import lmrecipe.average as average  # imports first: they are the floor
    import transformers  # noqa: F401

    floor = C.status_kb("VmRSS")
    result = average.average_checkpoints([Path(c) for c in args.checkpoints], args.out, overwrite=True)
    return {"floor_mb": floor / 1024, "peak_mb": C.status_kb("VmHWM") / 1024, "k": len(result.checkpoints)}


def train_run(args, out: Path, overrides: list[str]) -> None:
    from lmrecipe.config import load_config
    from lmrecipe.train.trainer import train

    cfg = load_config(args.recipe, [f"out_dir={out}", f"data.path={args.data}", "logging.progress_bar=false",
                                    "logging.trackers=[]", "checkpoint.export_at_end=false", *args.set, *overrides])
    with C.quiet_stdout():
        train(cfg)


def plot(path: Path, tmp: Path, tokens_per_step: int, at: int, single: float, averaged: float, k: int) -> None:
    """The runs' logged validation losses and learning rates against tokens, and the averaging's two points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lmrecipe.observe.metrics_log import read_metrics

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, folder in (("cosine", "cosine"), ("wsd-90", "wsd90"), ("wsd-80", "wsd80")):
        rows = read_metrics(tmp / folder / "metrics.jsonl")
        for axes, key in ((top, "val_loss"), (bottom, "lr")):
            points = [(r["step"] * tokens_per_step, r[key]) for r in rows if key in r]
            axes.plot(*zip(*points), marker="." if key == "val_loss" else None, label=name)
    top.scatter([at * tokens_per_step], [single], marker="x", color="black", zorder=5, label=f"stable, step {at}")
    top.scatter([at * tokens_per_step], [averaged], marker="*", s=80, color="red", zorder=5, label=f"average of {k}")
    top.set(ylabel="validation loss")
    bottom.set(ylabel="learning rate", xlabel="training tokens")
    top.legend()
    fig.suptitle("tiny recipe: cosine vs warmup-stable-decay branches; checkpoint averaging")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, report) -> None:
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="bench_mid_") as scratch:  # unused where --work keeps the runs
        measure(args, report, Path(args.work or scratch))


def measure(args, report, tmp: Path) -> None:
    from lmrecipe.average import average_checkpoints
    from lmrecipe.checkpoint.storage import complete_checkpoints, step_dir_name
    from lmrecipe.config import load_config
    from lmrecipe.evaluation.evaluate import evaluate_path

    n = args.steps
    every, at80, at90 = max(1, n // 10), round(0.8 * n), round(0.9 * n)
    common, trunk = [f"train.max_steps={n}", f"train.eval_every_steps={every}"], tmp / "wsd90" / "checkpoints"
    kept = [*common, f"checkpoint.every_steps={every}", "checkpoint.keep_last=1000"]
    train_run(args, tmp / "cosine", kept)
    train_run(args, tmp / "wsd90", [*kept, "schedule.decay_fraction=0.1"])
    train_run(args, tmp / "wsd80", [*common, f"schedule.decay_steps={n - at80}", "checkpoint.every_steps=0",
                                    f"checkpoint.branch_from={trunk / step_dir_name(at80)}"])
    stable = [c.path for c in complete_checkpoints(trunk) if c.step <= at90][-args.average:]
    averaged = average_checkpoints(stable, tmp / "average", overwrite=True)
    recipe = load_config(args.recipe, args.set)
    tokens_per_step = recipe.train.global_batch_size * recipe.data.seq_len
    eval_batches = max(1, recipe.data.val_windows // 8)  # the windows training validates on

    def val(path: Path) -> float:
        return evaluate_path(path, args.data, max_batches=eval_batches, batch_size=8)[0]["loss"]

    figures = {f"{name}_end": val(tmp / name / "checkpoints" / step_dir_name(n))
               for name in ("cosine", "wsd90", "wsd80")}
    figures.update(cosine_at90=val(tmp / "cosine" / "checkpoints" / step_dir_name(at90)), stable_last=val(stable[-1]),
                   stable_average=val(averaged.out))
    memory = {k: C.run_worker(C.worker_command(args, "average", "--checkpoints", *map(str, stable[-k:]), "--out",
                                               str(tmp / f"mem{k}")), f"average {k}") for k in (1, len(stable))}
    model_mb = sum(p.stat().st_size for p in averaged.out.glob("model-*.safetensors")) / 2**20
    report.figures = {**figures, "steps": n, "tokens_per_step": tokens_per_step, "averaged": [c.name for c in stable],
                      "memory": memory, "model_fp32_mb": model_mb}
    report.line(f"{n} steps of {tokens_per_step} tokens; validation loss of evaluate_path on {eval_batches} x 8 windows")
    report.line("| tokens | run | validation loss |\n|---:|---|---:|")
    end, at = f"{n * tokens_per_step:,}", f"{at90 * tokens_per_step:,}"
    for label, key, tokens in (("cosine", "cosine_end", end), ("WSD, decay over the last 10 %", "wsd90_end", end),
                               ("WSD branch at 80 %, decay over the last 20 %", "wsd80_end", end),
                               (f"WSD stable, last checkpoint ({stable[-1].name})", "stable_last", at),
                               (f"WSD stable, average of the last {len(stable)}", "stable_average", at),
                               ("cosine, same step", "cosine_at90", at)):
        report.line(f"| {tokens} | {label} | {figures[key]:.4f} |")
    for k, m in memory.items():
        report.line(f"averaging {k} checkpoint(s): {m['floor_mb']:.0f} MB after imports, peak {m['peak_mb']:.0f} MB "
                    f"(fp32 weights {model_mb:.1f} MB)")
    report.output_dir.mkdir(parents=True, exist_ok=True)
    plot(report.output_dir / "mid_training.png", tmp, tokens_per_step, at90, figures["stable_last"],
         figures["stable_average"], len(stable))
