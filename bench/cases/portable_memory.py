"""Peak memory and time of converting a ZeRO-2 checkpoint to its topology-free form: the code before against this one.

    bench/run.py portable_memory --pairs 2                                                  # a 322M-parameter Llama
    bench/run.py portable_memory --hidden-size 256 --layers 2 --vocab-size 8192 --pairs 1   # quick

A 2-process ZeRO-2 checkpoint (one AdamW step), then rounds in fresh processes: *before*, ``portable.py`` at
--baseline (``git show``) consolidating in one process; *after*, this tree's ``plan_shards`` / ``write_share`` on 2
processes, then ``finish``. Each worker samples its RSS every 10 ms and reports ``VmHWM`` over its floor; the two forms
are compared tensor by tensor each round. Method: docs/benchmarks/09-checkpoint-stall.md.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common as C

PAIRS = 2
DATA = None
RECIPE = None
SIDES = ("before", "after")
WORLD = 2


def options(parser) -> None:
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--baseline", default="7f4a06f", help="the commit of the code before (default: %(default)s)")
    parser.add_argument("--tmp", default=None, help="folder for the checkpoint and the forms (default: system temp)")
    parser.add_argument("--side", choices=SIDES, help="worker: the side")
    parser.add_argument("--rank", type=int, default=0, help="worker: the rank of an after side")
    parser.add_argument("--checkpoint", type=Path, help="worker: the checkpoint folder")
    parser.add_argument("--out", help="worker: the form's folder")


def worker(args) -> dict | None:
    return worker_save(args) if args.worker == "save" else worker_convert(args)


class Sampler:
    """The peak of this process's anonymous and file-backed resident memory, sampled every 10 ms."""

    def __init__(self):
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for field in self.peak:
                self.peak[field] = max(self.peak[field], C.status_kb(field))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {f"peak_{k}_mb": v / 1024 for k, v in self.peak.items()}


def worker_save(args) -> dict | None:
    """One rank of the 2-process run that writes the ZeRO-2 checkpoint."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmrecipe.optim import split_params

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        intermediate_size=(8 * args.hidden_size // 3 + 255) // 256 * 256, num_attention_heads=args.hidden_size // 64,
        tie_word_embeddings=False))
    decay, no_decay = split_params(model, decay_embeddings=False)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000_000, "allgather_bucket_size": 20_000_000}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(args.checkpoint, tag="pytorch_model")
    if engine.global_rank == 0:
        return {"params": sum(p.numel() for p in model.parameters()),
                "largest_tensor_mb": max(p.numel() for p in model.parameters()) * 4 / 1e6}


def baseline_module(rev: str):
    """``lmrecipe/checkpoint/portable.py`` as of ``rev``, imported as a module of its own."""
    import importlib.util

    source = subprocess.run(["git", "show", f"{rev}:lmrecipe/checkpoint/portable.py"], cwd=C.ROOT, check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="portable_before_") as folder:
        path = Path(folder) / "portable_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("portable_before", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def worker_convert(args) -> dict:
    """One process of a side: ``before`` converts everything; ``after`` writes rank ``--rank``'s share."""
    from lmrecipe.checkpoint import portable, readers
    from lmrecipe.parallel.topology import Topology, ZeroSetup

    before = baseline_module(args.baseline) if args.side == "before" else None
    from deepspeed.utils import zero_to_fp32  # noqa: F401  (imported by both sides; part of the floor)

    ds_dir = Path(args.checkpoint) / "pytorch_model"
    floor_mb = C.status_kb("VmRSS") / 1024
    sampler = Sampler()
    started_at = time.time()
    start = time.perf_counter()
    if before is not None:
        before.convert(Path(args.checkpoint), Path(args.out), deepspeed_dir=ds_dir, param_names=[],
                       source_layout=Topology(WORLD, ZeroSetup(stage=2, deepspeed=True)), source_sha256="0" * 64)
    else:
        source = readers.open_source(Path(args.checkpoint), deepspeed_dir=ds_dir, param_names=[])
        plan = portable.plan_shards(source.shapes, WORLD)
        portable.write_share(source, plan, Path(args.out), args.rank)
        source.close()
    seconds = time.perf_counter() - start
    peak_mb = C.status_kb("VmHWM") / 1024
    return {"seconds": seconds, "started_at": started_at, "ended_at": time.time(), "floor_mb": floor_mb,
                    "VmHWM_mb": peak_mb, "growth_mb": peak_mb - floor_mb, **sampler.stop()}


def run_side(side: str, args, out: Path) -> dict:
    """One side in fresh processes; returns its wall time and each process's memory."""
    from lmrecipe.checkpoint import portable, readers
    from lmrecipe.parallel.topology import Topology, ZeroSetup

    base = C.worker_command(args, "convert", "--side", side, "--checkpoint", str(args.checkpoint), "--out", str(out))
    start = time.perf_counter()
    if side == "after":
        out.mkdir()
    ranks = range(WORLD if side == "after" else 1)
    with ThreadPoolExecutor(len(ranks)) as pool:  # the after side's ranks run at once
        results = list(pool.map(lambda rank: C.run_worker([*base, "--rank", str(rank)], f"{side} rank {rank}"), ranks))
    wall, finish_s = time.perf_counter() - start, 0.0
    if side == "after":  # rank 0 writes the indexes once both ranks are done (its source is open: not timed here)
        source = readers.open_source(args.checkpoint, deepspeed_dir=args.checkpoint / "pytorch_model", param_names=[])
        finish_start = time.perf_counter()
        portable.finish(out, portable.plan_shards(source.shapes, WORLD), source.steps,
                        source_layout=Topology(WORLD, ZeroSetup(stage=2, deepspeed=True)), source_sha256="0" * 64)
        finish_s = time.perf_counter() - finish_start
        source.close()
    wall += finish_s
    # What a resume waits for: from the first process starting to convert (its imports done) to the form complete.
    converting = max(r["ended_at"] for r in results) - min(r["started_at"] for r in results) + finish_s
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    return {"wall_s": wall, "converting_s": converting, "files": len(list(out.iterdir())), "size_mb": size_mb,
            "processes": results}


def same_content(a: Path, b: Path) -> bool:
    """The two forms hold the same tensors, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from lmrecipe.checkpoint.portable import PortableState

    after = PortableState(b)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        before = load_file(a / f"{key}.safetensors")
        if set(before) != set(after.meta["params"]):
            return False
        if not all(torch.equal(before[name], after.get(key, name)) for name in before):
            return False
    return True


def run(args, report) -> None:
    from deepspeed.utils import zero_to_fp32  # noqa: F401  (the driver's own imports stay out of the timed sides)

    with tempfile.TemporaryDirectory(prefix="bench_portable_", dir=args.tmp) as tmp:
        args.checkpoint = Path(tmp) / "checkpoint"
        start = time.perf_counter()
        cmd = C.worker_command(args, "save", "--checkpoint", str(args.checkpoint))
        cmd[:1] = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                   "--master_port", str(C.free_port())]
        saved = C.run_worker(cmd, "save")
        state_mb = saved["params"] * 12 / 1e6
        report.line(f"checkpoint: ZeRO-2 on {WORLD} processes, {saved['params']:,} parameters, fp32; full state "
                    f"(weights + 2 moments) {state_mb:,.0f} MB; largest tensor {saved['largest_tensor_mb']:,.1f} MB; "
                    f"shards on disk {C.folder_mb(args.checkpoint / 'pytorch_model'):,.0f} MB (written in "
                    f"{time.perf_counter() - start:.0f} s)")
        report.figures.update(params=saved["params"], state_mb=state_mb, largest_tensor_mb=saved["largest_tensor_mb"])
        rounds = []
        for order in C.pair_orders(args.pairs, SIDES):
            result = {side: run_side(side, args, Path(tmp) / side) for side in order}
            result["identical"] = same_content(Path(tmp) / "before", Path(tmp) / "after")
            for side in SIDES:
                shutil.rmtree(Path(tmp) / side)
            rounds.append(result)
            report.line(f"round {len(rounds)} ({' '.join(order)}): " + json.dumps(result))
        summarize(report, rounds, saved)


def summarize(report, rounds: list[dict], saved: dict) -> None:
    largest = saved["largest_tensor_mb"]
    report.line()
    report.line(f"| per process, median of {len(rounds)} rounds | before (1 process) | after (rank 0) | after (rank 1) |")
    report.line("| --- | ---: | ---: | ---: |")
    cells = {}
    for key, label in (("VmHWM_mb", "peak RSS (VmHWM), MB"), ("floor_mb", "RSS before converting (imports), MB"),
                       ("growth_mb", "peak - before, MB"), ("peak_RssAnon_mb", "peak anonymous, MB"),
                       ("peak_RssFile_mb", "peak file-backed, MB"), ("seconds", "conversion, s")):
        row = []
        for side, index in (("before", 0), ("after", 0), ("after", 1)):
            row.append(statistics.median(r[side]["processes"][index][key] for r in rounds))
        cells[key] = row
        report.line(f"| {label} | " + " | ".join(f"{v:,.1f}" for v in row) + " |")
    report.line()
    for key, label in (("converting_s", "from the first process starting to convert to the form complete (indexes "
                                        "included; what a resume waits for)"),
                       ("wall_s", "the whole side, processes started (imports) to the form complete")):
        median = {side: statistics.median(r[side][key] for r in rounds) for side in SIDES}
        ratio = C.ratio_stats([r["after"][key] / r["before"][key] for r in rounds])
        report.line(f"time, {label}: before {median['before']:.1f} s, after {median['after']:.1f} s; after / before "
                    f"{C.fmt_ratio(ratio)}")
        report.figures[key] = {"median": median, "ratio": ratio}
    worst = max(cells["growth_mb"][1:])
    full_mb = saved["params"] * 12 / 1e6
    report.line(f"after: peak - before = {worst:,.1f} MB on the larger rank = {worst / largest:.2f}x the largest tensor "
                f"({largest:,.1f} MB); before: {cells['growth_mb'][0]:,.1f} MB = {cells['growth_mb'][0] / full_mb:.2f}x the "
                f"full state ({full_mb:,.0f} MB)")
    report.line(f"same tensors in both forms (every parameter and state, bit for bit): {all(r['identical'] for r in rounds)}")
    report.figures.update(rounds=rounds, cells=cells)
