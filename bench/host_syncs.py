"""Host synchronisations per training step, and the throughput effect, against a baseline commit.

    .venv/bin/python bench/host_syncs.py --threads 1                  # baseline: 35f6679 (before the sync-free step)
    .venv/bin/python bench/host_syncs.py --baseline HEAD~3 --pairs 6 --steps 60

Two trees: this checkout ("new") and the baseline commit, checked out into a temporary git worktree. A worker
process per measurement runs that tree's ``lmrecipe.train`` in-process (PYTHONPATH = the tree):

- syncs: this tree's ``lmrecipe.observe.host_syncs.HostSyncCounter`` (loaded by file path, so it counts either tree's loop
  the same way) over two runs whose only sync points are step 1 and the last step (3 and 11 steps, no eval or
  checkpoint in between); (count of the long run - count of the short run) / 8 = host syncs per unlogged step,
  by kind. On a GPU each one stalls the CPU until the device queue drains.
- throughput: ``recipes/tiny.yaml`` (one process, fp32, logged every 10 steps) for --steps steps; tokens/s = the
  median of the logged rows after the first. Rounds alternate the trees (A B, B A, ...); the figure is the median of
  the per-round ratios new / baseline. On a CPU nothing waits at a sync, so this shows the CPU cost of the change
  (fused AdamW, prefetch thread), not the GPU gain.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C  # noqa: E402

DEFAULT_BASELINE = "35f6679"
SHORT, LONG = 3, 11


def _counter_class():
    spec = importlib.util.spec_from_file_location("_sync_counter", C.ROOT / "lmrecipe" / "observe" / "host_syncs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostSyncCounter


def worker(args) -> None:
    import logging
    import os

    import torch  # from PYTHONPATH's tree under test (run_side), before this checkout's

    from lmrecipe.config import load_config
    try:
        from lmrecipe.train.trainer import train
    except ImportError:  # a baseline tree from before the package had subfolders
        from lmrecipe.trainer import train

    logging.disable(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = [f"data.path={args.data}", "logging.progress_bar=false", "checkpoint.export_at_end=false", "schedule.warmup_steps=2",
            "checkpoint.resume=none"]
    with tempfile.TemporaryDirectory(prefix="bench_syncs_") as tmp:
        if args.worker == "syncs":
            counter_cls, counts = _counter_class(), {}
            for steps in (SHORT, LONG):
                cfg = load_config("recipes/tiny.yaml", [*base, f"out_dir={tmp}/{steps}", f"train.max_steps={steps}",
                                                        "logging.log_every_steps=1000", "train.eval_every_steps=0",
                                                        "checkpoint.every_steps=0"])
                with counter_cls() as counter:
                    train(cfg)
                counts[steps] = dict(counter.calls)
            kinds = sorted(set(counts[SHORT]) | set(counts[LONG]))
            per_step = {k: (counts[LONG].get(k, 0) - counts[SHORT].get(k, 0)) / (LONG - SHORT) for k in kinds}
            import lmrecipe

            C.print_result({"per_unlogged_step": per_step, "counts": counts, "package": lmrecipe.__file__})
        else:
            cfg = load_config("recipes/tiny.yaml", [*base, f"out_dir={tmp}/run", f"train.max_steps={args.steps}",
                                                    "logging.log_every_steps=10", "train.eval_every_steps=0",
                                                    "checkpoint.every_steps=0"])
            train(cfg)
            rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
            rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r["step"] > 1]
            C.print_result({"tokens_per_sec": statistics.median(rates), "pid": os.getpid()})


def run_side(tree: Path, kind: str, args, data: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads or os.cpu_count()),
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--data", str(Path(data).resolve()),
           "--steps", str(args.steps)] + (["--threads", str(args.threads)] if args.threads else [])
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(C.RESULT_PREFIX)]
    if not lines:
        raise SystemExit(f"{tree} {kind} worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(C.RESULT_PREFIX):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision to compare with (default: %(default)s)")
    parser.add_argument("--data", default="data/stdlib", help="prepared data folder of this tree (default: %(default)s)")
    parser.add_argument("--baseline-data", default=None,
                        help="prepared data folder in the baseline's format (default: prepared by the baseline's "
                             "tools/prepare_data.py on the embedded corpus, into a temporary folder)")
    parser.add_argument("--steps", type=int, default=60, help="steps of each throughput run (default: %(default)s)")
    parser.add_argument("--worker", choices=["syncs", "throughput"], help=argparse.SUPPRESS)
    C.add_common_args(parser, pairs=4, device=False)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    C.check_data(args.data)
    report = C.Report("host_syncs", "cpu", args.output)
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
            syncs = {side: run_side(tree, "syncs", args, data[side]) for side, tree in trees.items()}
            for side in trees:
                per = syncs[side]["per_unlogged_step"]
                report.line(f"{side:>8}: {sum(per.values()):.2f} host syncs per unlogged step {per}")
            ratios, rates = [], {"baseline": [], "new": []}
            for order in C.pair_orders(args.pairs, ("baseline", "new")):
                got = {side: run_side(trees[side], "throughput", args, data[side])["tokens_per_sec"] for side in order}
                for side in got:
                    rates[side].append(got[side])
                ratios.append(got["new"] / got["baseline"])
                report.line(f"round {len(ratios)}: baseline {got['baseline']:,.0f} tok/s, new {got['new']:,.0f} tok/s, "
                            f"ratio {ratios[-1]:.3f}")
            stats = C.ratio_stats(ratios)
            report.line(f"throughput new / baseline: {C.fmt_ratio(stats)}")
            report.figures = {"syncs": syncs, "tokens_per_sec": rates, "ratio": stats, "baseline": args.baseline}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=C.ROOT, check=False)
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
