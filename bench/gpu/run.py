"""The GPU kit: one command on a GPU node that installs what the node lacks from a pack (tools/offline_install.py), prepares
data, measures each stage's sides (``stages.py``) in fresh processes (``worker.py``) and rewrites ``gpu_kit.json``
under ``--out`` after every stage (``bench/gpu/README.md``).

    python3 bench/gpu/run.py --out runs/gpu_kit                  # on the GPU node: the default stages
    .venv/bin/python bench/gpu/run.py --dry-run --out /tmp/kit   # on a CPU: every stage, tiny recipe, 2 steps

Exit 0, also when a stage failed (its row says why); 2 for a bad argument or no GPU without --dry-run.
"""

import argparse
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
import stages as S  # noqa: E402 - beside this script, which Python puts first on sys.path

GPU_RECIPE, DRY_RECIPE = "recipes/llama_1b.yaml", "recipes/tiny.yaml"
# The levers' baseline is the dense mask without Liger (the recipe's own choice is the best window, measured on top)
GPU_BASE = ("model.vocab_size=128256", "model.vocab_beyond_data=true", "train.global_batch_size=16", "train.micro_batch_size=8",
            "model.attn_implementation=sdpa", "model.kernels=none")
# The tests' tiny model: every stage's dry run in seconds.
DRY_BASE = ("model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128",
            "data.seq_len=32", "data.val_windows=16", "train.global_batch_size=8", "train.micro_batch_size=4",
            "train.loss_chunk_tokens=64")
JSON_NAME, LOG_NAME = "gpu_kit.json", "workers.log"
INSTALLER = ROOT / "tools" / "offline_install.py"
MIN_LEFT_S = 30  # no side starts with this many seconds of --budget-s left, or fewer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_kit.json and workers.log")
    parser.add_argument("--stages", default="default", help=f"comma-separated: {', '.join(S.BY_NAME)}; 'default' "
                        f"({', '.join(S.DEFAULT_STAGES)}) or 'all' (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny recipe, 2 steps: check every stage builds and runs")
    parser.add_argument("--pack", type=Path, default=ROOT / "offline" / "pack",
                        help="the folder tools/offline_pack.sh filled (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=HERE / "work", help="installed packages, data, runs (default: %(default)s)")
    parser.add_argument("--data", type=Path, default=None, help="a prepared data folder (default: prepared under --work)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per side or window (default: 8; dry run 2)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="steps before measuring (default: 3; dry run 0)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="start no side after this many seconds, stop a "
                        "worker when they are spent: a minute under your time on the node (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.selected = S.select(args.stages)
    except ValueError as exc:
        parser.error(f"--stages: {exc}")
    if (problem := argument_problem(args)) is not None:
        parser.error(problem)
    if args.data is not None:
        args.data = args.data.resolve()  # the workers run in the repository root
    args.steps = args.steps or (2 if args.dry_run else 8)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (0 if args.dry_run else 3)
    return args


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the numbers and folders given, with the fix; None when nothing is (checked before the install)."""
    if args.steps is not None and args.steps < 1:
        return f"--steps {args.steps}: the measured steps per side must be 1 or more (default: 8; dry run 2)."
    if args.warmup_steps is not None and args.warmup_steps < 0:
        return f"--warmup-steps {args.warmup_steps}: the steps before measuring must be 0 or more (default: 3)."
    if not math.isfinite(args.budget_s) or args.budget_s <= MIN_LEFT_S:
        return (f"--budget-s {args.budget_s}: give a number of seconds above {MIN_LEFT_S} (no side starts with "
                f"{MIN_LEFT_S} s or less left), e.g. a minute under your time on the node (default: 450).")
    for flag, folder in (("--out", args.out), ("--work", args.work)):
        if (problem := folder_problem(flag, folder)) is not None:
            return problem
    if args.data is None or (args.data / "meta.json").is_file():
        return None
    problem = "does not exist" if not args.data.exists() else "is a file, not a prepared data folder" \
        if not args.data.is_dir() else "holds no meta.json: it is not a prepared data folder"
    return (f"--data {args.data} {problem}. Pass a folder written by tools/prepare_data.py (python "
            "tools/prepare_data.py --output DIR), or leave --data out to prepare the embedded corpus under --work.")


def folder_problem(flag: str, folder: Path) -> str | None:
    """What stops the kit from writing into ``folder`` (made where missing), with the fix; None when nothing does."""
    fix = f"Pass {flag} a folder you can write to (it is made if missing)."
    if folder.exists() and not folder.is_dir():
        return f"{flag} {folder} is a file, not a folder. {fix}"
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {folder} lies under {existing}, which is a file, not a folder: it cannot be made. {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == folder.absolute() else f"would be made in {existing}, which is"
        return f"{flag} {folder} {what} not writable (read-only or owned by another user). {fix}"
    return None


def commit(pack: Path) -> str:
    """The tree's git HEAD, or where a copy of the tree holds no ``.git``, the commit offline_pack.sh recorded."""
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return proc.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    recorded = pack / "commit.txt"
    return f"{recorded.read_text().strip()} (recorded by offline_pack.sh)" if recorded.is_file() else "unknown"


class Record:
    """gpu_kit.json, rewritten whole after every step (atomically: a run cut short leaves it whole)."""

    def __init__(self, out: Path, args: argparse.Namespace):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data = {"mode": "dry run (CPU, tiny recipe: not GPU figures)" if args.dry_run else "gpu",
                     "command": " ".join(["python3", "bench/gpu/run.py", *map(shlex.quote, sys.argv[1:])]),
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(args.pack),
                     "recipe": args.recipe, "base_overrides": list(args.base), "warmup_steps": args.warmup_steps,
                     "steps": args.steps, "setup": {}, "versions": {}, "stages": []}

    def log(self, text: str) -> None:
        print(f"[gpu-kit {datetime.now(timezone.utc):%H:%M:%S}] {text}", flush=True)

    def save(self) -> None:
        tmp = self.out / (JSON_NAME + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.out / JSON_NAME)


def setup(args: argparse.Namespace, record: Record) -> dict:
    """Install (GPU) or check the pack (dry run) with tools/offline_install.py, prepare the data; returns the workers'
    environment. Without a pack the environment's packages are measured as they are."""
    target = None if args.dry_run else args.work / "site"
    proc = subprocess.run([sys.executable, str(INSTALLER), "--json", "--pack", str(args.pack),
                           *(["--check"] if args.dry_run else ["--target", str(target)])], capture_output=True, text=True)
    if proc.returncode == 0:
        for line in proc.stderr.splitlines():
            record.log(line)  # the install's steps
        done = json.loads(proc.stdout)
        record.data["setup"]["install"] = {"checked": done, "installed": "no (dry run)"} if args.dry_run else done
    else:
        error = record.data["setup"]["install"] = {"error": proc.stderr.strip()[-4000:]}
        record.log(f"install: {error['error']} (installed nothing: the environment's packages are measured as they are)")
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    path = [*([str(target)] if target else []), str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(filter(None, path)), ACCELERATE_DISABLE_RICH="1", TOKENIZERS_PARALLELISM="false")
    if args.dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
                   TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    args.data = args.data or prepare_data(args, env, record)
    record.data["setup"]["data"] = str(args.data)
    record.save()
    return env


def prepare_data(args: argparse.Namespace, env: dict, record: Record) -> Path:
    """The embedded corpus prepared once under --work: 1,000 documents, more than the kit's steps read (dry run: 100)."""
    data = args.work / ("data_dry" if args.dry_run else "data")
    if (data / "meta.json").is_file():
        return data
    cmd = [sys.executable, "tools/prepare_data.py", "--output", str(data), "--overwrite",
           *(["--vocab-size", "384", "--max-documents", "100", "--val-fraction", "0.1"] if args.dry_run
             else ["--vocab-size", "8192", "--max-documents", "1000"])]
    start, proc = time.perf_counter(), subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        record.data["setup"]["data_error"] = proc.stderr[-4000:]
        record.save()
        raise SystemExit(f"preparing the data failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    record.data["setup"]["prepare_s"] = round(time.perf_counter() - start, 1)
    return data


def side_groups(selected: list[S.Stage]) -> dict[str, dict]:
    """The distinct runs the selected stages need, keyed by overrides: a run several stages name is measured once."""
    return {side.key: {**dataclasses.asdict(side), "key": side.key, "overrides": list(side.overrides)}
            for stage in selected for side in stage.sides}


def run_job(args, env: dict, record: Record, groups: list[dict], name: str, timeout_s: float) -> dict:
    """Measure ``groups`` in one worker process: their results by key (an error for each that gave none); the first
    versions a worker imported go into the record."""
    work = args.work / "runs" / name
    work.mkdir(parents=True, exist_ok=True)
    log, result_path = work / "worker.log", work / "result.json"
    job = {"recipe": args.recipe, "base": list(args.base), "data": str(args.data), "work": str(work),
           "result": str(result_path), "sides": groups, "warmup_steps": args.warmup_steps, "steps": args.steps}
    (work / "job.json").write_text(json.dumps(job, indent=2))
    result_path.unlink(missing_ok=True)
    try:
        with open(log, "w") as sink:
            proc = subprocess.run([sys.executable, str(HERE / "worker.py"), str(work / "job.json")], cwd=ROOT, env=env,
                                  stdout=sink, stderr=subprocess.STDOUT, timeout=max(timeout_s, 1))
        failure = None if proc.returncode == 0 else f"worker exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"worker stopped after {timeout_s:.0f} s (--budget-s)"
    results = json.loads(result_path.read_text()) if result_path.is_file() else {}
    versions = results.pop("_versions", None)
    record.data["versions"] = record.data["versions"] or versions or {}
    text = log.read_text(errors="replace") if log.is_file() else ""
    tail = text[-1500:]
    with open(args.out / LOG_NAME, "a") as logs:
        logs.write(f"\n===== {name}: {', '.join(g['label'] for g in groups)} =====\n{text[-200_000:]}")
    for group in groups:
        result = results.setdefault(group["key"], {"label": group["label"], "error": f"{failure or 'no result'}: {tail}"})
        if result.get("partial"):  # its timed steps were measured, what followed them was not
            result["stopped"] = f"{failure or 'stopped'} after its timed steps: {tail[-300:]}"
    return results


def stage_row(stage: S.Stage, done: dict[str, dict], dry_run: bool) -> dict:
    results = {side.label: done[side.key] for side in stage.sides}
    row = {"stage": stage.name, "what": stage.what, "target": stage.target, "sides": results}
    problems = [f"{label}: {r['error'].splitlines()[0][:300]}" for label, r in results.items() if "error" in r]
    if problems:
        return {**row, "status": "failed: " + "; ".join(problems), "met": None, "figure": ""}
    try:
        row.update(stage.summarize(results))
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        stopped = "".join(f"; {label} {r['stopped'].splitlines()[0][:200]}" for label, r in results.items() if r.get("stopped"))
        return {**row, "status": f"failed: summary ({type(exc).__name__}: {exc}){stopped}", "met": None, "figure": ""}
    return {**row, "status": "dry run (CPU, tiny recipe, not a GPU figure)", "met": None} if dry_run else \
        {**row, "status": "measured"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.recipe, args.base = (DRY_RECIPE, DRY_BASE) if args.dry_run else (GPU_RECIPE, GPU_BASE)
    if not args.dry_run and not __import__("torch").cuda.is_available():
        print("run.py: no CUDA device is visible: on a machine without a GPU, run with --dry-run", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    record = Record(args.out, args)
    record.save()
    record.log(f"stages: {', '.join(s.name for s in args.selected)}; results in {args.out}")
    env, groups, done = setup(args, record), side_groups(args.selected), {}
    if args.dry_run:  # one process for every side: each starts its own Accelerator (worker._forget_run)
        done.update(run_job(args, env, record, list(groups.values()), "dry_run", args.budget_s))
    for stage in args.selected:
        for side in (side for side in stage.sides if side.key not in done):
            left = args.budget_s - (time.perf_counter() - start)
            if left <= MIN_LEFT_S:
                done[side.key] = {"label": side.label, "error": f"not run: --budget-s {args.budget_s:.0f} was spent"}
            else:
                record.log(f"{stage.name}: measuring {side.label} ({side.key or 'the base recipe'})")
                done.update(run_job(args, env, record, [groups[side.key]], f"side{len(done)}", left))
        row = stage_row(stage, done, args.dry_run)
        record.data["stages"].append(row)
        record.data["elapsed_s"] = round(time.perf_counter() - start, 1)
        record.save()
        record.log(f"{stage.name}: {row.get('figure') or row['status']}")
    record.log(f"done in {time.perf_counter() - start:.0f} s: {args.out / JSON_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
