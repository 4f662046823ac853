"""Host synchronisations per training step, and the throughput effect, against a baseline commit.

Two trees: this checkout ("new") and --baseline checked out into a temporary git worktree. A worker process per
measurement runs that tree's ``lmrecipe`` training in-process (PYTHONPATH = the tree). syncs: this tree's
``HostSyncCounter`` (loaded by file path, so it counts either tree's loop alike) over runs of 3 and 11 steps whose
only sync points are step 1 and the last: the difference / 8 = host syncs per unlogged step, by kind. throughput:
``recipes/tiny.yaml`` for --steps steps, tokens/s = the median of the logged rows after the first; rounds alternate
the trees; the figure is the median ratio new / baseline (on a CPU nothing waits at a sync: this is the CPU cost).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C

PAIRS = 4
RECIPE = None
SHORT, LONG = 3, 11


def options(parser) -> None:
    parser.add_argument("--baseline", default="35f6679", help="git revision to compare with (default: %(default)s)")
    parser.add_argument("--baseline-data", default=None,
                        help="prepared data folder in the baseline's format (default: prepared by the baseline's "
                             "tools/prepare_data.py on the embedded corpus, into a temporary folder)")
    parser.add_argument("--steps", type=int, default=60, help="steps of each throughput run (default: %(default)s)")


def _train(cfg) -> None:
    try:
        from lmrecipe.train.trainer import train
    except ImportError:  # a baseline tree from before the package had subfolders
        from lmrecipe.trainer import train
    train(cfg)


def worker(args) -> dict:
    import logging

    from lmrecipe.config import load_config

    logging.disable(logging.INFO)
    base = [f"data.path={args.data}", "logging.progress_bar=false", "checkpoint.export_at_end=false",
            "schedule.warmup_steps=2", "checkpoint.resume=none", "train.eval_every_steps=0", "checkpoint.every_steps=0"]
    with tempfile.TemporaryDirectory(prefix="bench_syncs_") as tmp:
        if args.worker == "throughput":
            _train(load_config("recipes/tiny.yaml", [*base, f"out_dir={tmp}/run", f"train.max_steps={args.steps}",
                                                     "logging.log_every_steps=10"]))
            rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
            return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in rows
                                                        if "tokens_per_sec" in r and r["step"] > 1)}
        spec = importlib.util.spec_from_file_location("_sync_counter", C.ROOT / "lmrecipe" / "observe" / "host_syncs.py")
        counter_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(counter_module)
        counts = {}
        for steps in (SHORT, LONG):
            with counter_module.HostSyncCounter() as counter:
                _train(load_config("recipes/tiny.yaml", [*base, f"out_dir={tmp}/{steps}", f"train.max_steps={steps}",
                                                         "logging.log_every_steps=1000"]))
            counts[steps] = dict(counter.calls)
        kinds = sorted(set(counts[SHORT]) | set(counts[LONG]))
        import lmrecipe

        return {"per_unlogged_step": {k: (counts[LONG].get(k, 0) - counts[SHORT].get(k, 0)) / (LONG - SHORT) for k in kinds},
                "counts": counts, "package": lmrecipe.__file__}


def run_side(args, tree: Path, kind: str, data: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads or os.cpu_count()),
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return C.run_worker(C.worker_command(args, kind, "--data", str(Path(data).resolve())), f"{tree} {kind}", env, cwd=tree)


def run(args, report) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_baseline_") as tmp:
        baseline = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(baseline), args.baseline], cwd=C.ROOT, check=True)
        try:
            trees = {"baseline": baseline, "new": C.ROOT}
            data = {"new": args.data, "baseline": args.baseline_data or str(Path(tmp) / "data")}
            if args.baseline_data is None:
                subprocess.run([sys.executable, "tools/prepare_data.py", "--output", data["baseline"], "--vocab-size", "8192"],
                               cwd=baseline, env={**os.environ, "PYTHONPATH": str(baseline)}, check=True,
                               capture_output=True)
            report.line(f"baseline {args.baseline}, new = this checkout; recipes/tiny.yaml, 1 process, "
                        f"threads {args.threads or 'default'}")
            syncs = {side: run_side(args, tree, "syncs", data[side]) for side, tree in trees.items()}
            for side in trees:
                per = syncs[side]["per_unlogged_step"]
                report.line(f"{side:>8}: {sum(per.values()):.2f} host syncs per unlogged step {per}")
            rates, stats = C.interleave(
                report, args.pairs, ("baseline", "new"),
                lambda side: run_side(args, trees[side], "throughput", data[side])["tokens_per_sec"],
                {"new/baseline": lambda g: g["new"] / g["baseline"]},
                lambda g: ", ".join(f"{side} {r:,.0f} tok/s" for side, r in g.items()))
            report.line(f"throughput new / baseline: {C.fmt_ratio(stats['new/baseline'])}")
            report.figures = {"syncs": syncs, "tokens_per_sec": rates, "ratio": stats["new/baseline"],
                              "baseline": args.baseline}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=C.ROOT, check=False)
