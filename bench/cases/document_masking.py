"""What document masking costs and what it changes: step time, the SDPA mask's memory, the validation loss
(docs/benchmarks/10-document-masking.md).

    bench/run.py document_masking step          # train_step masked and plain, tiny and 34M models, interleaved blocks
    bench/run.py document_masking mask-memory   # bytes of the SDPA, eager and flash masks at seq_len 2k / 8k / 32k
    bench/run.py document_masking val-loss      # recipes/tiny.yaml --steps steps masked and plain, then eval.py both ways
"""

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C

PAIRS = 4
SIDES = ("masked", "plain")


def options(parser) -> None:
    parser.add_argument("part", choices=["step", "mask-memory", "val-loss"])
    parser.add_argument("--hidden-size", type=int, default=640, help="the larger model's width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=10, help="the larger model's blocks (default: %(default)s)")
    parser.add_argument("--tiny-only", action="store_true", help="step: time the tiny model only")
    parser.add_argument("--block-steps", type=int, default=3, help="step: steps per timed block (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="val-loss: steps per run (default: %(default)s)")
    parser.add_argument("--tmp", default=None, help="val-loss: folder for the two runs (default: a new temp folder)")


def name(args) -> str:
    return f"document_masking_{args.part.replace('-', '_')}"


def run(args, report) -> None:
    report.figures = {"step": bench_step, "mask-memory": bench_mask_memory, "val-loss": bench_val_loss}[args.part](
        args, report)


def bench_step(args, report) -> dict:
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.step import train_step

    models = {"tiny": [], "34M": [f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.layers}",
                                  f"model.num_heads={args.hidden_size // 64}"]}
    results = {}
    for model in ["tiny"] if args.tiny_only else models:
        overrides = [*models[model], "train.micro_batch_size=8", "train.global_batch_size=8", "data.seq_len=256"]
        with tempfile.TemporaryDirectory(prefix="bench_docmask_") as tmp:
            runs = {side: build_run(C.bench_config(args.recipe, [f"data.document_masking={str(side == 'masked').lower()}",
                                                                 *overrides], f"{tmp}/{side}", args.data), Path(tmp) / side)
                    for side in SIDES}
            steps = {side: itertools.count() for side in SIDES}

            def time_steps(side: str) -> float:
                start = time.perf_counter()
                for _ in range(args.block_steps):
                    loss = train_step(runs[side], next(steps[side])).loss
                loss.item()
                return (time.perf_counter() - start) / args.block_steps

            seconds, stats = C.interleave(
                report, args.pairs, SIDES, time_steps, {"masked/plain": lambda g: g["masked"] / g["plain"]},
                lambda g: f"{model}: " + ", ".join(f"{side} {1e3 * s:.0f} ms/step" for side, s in g.items()), warm_up=True)
            for run in runs.values():
                run.prefetcher.close()
        results[model] = {"params": runs["plain"].n_params, "ratio": stats["masked/plain"],
                          **{f"{side}_ms": statistics.median(s) * 1e3 for side, s in seconds.items()}}
        report.line(f"{model} ({runs['plain'].n_params / 1e6:.1f}M params, micro-batch 8 x seq_len 256): "
                    f"masked / plain step time {C.fmt_ratio(stats['masked/plain'])}")
    return results


def bench_mask_memory(args, report) -> dict:
    import numpy as np

    from lmrecipe.data.documents import document_batch
    from lmrecipe.model.attention import additive_mask, block_causal_mask

    results = {}
    for seq_len in (2048, 8192, 32768):
        # one row holding documents of about 1,000 tokens (the order of a code or web corpus's median)
        starts = np.append(np.arange(0, 4 * seq_len, 1000), 4 * seq_len).astype(np.uint64)
        docs = document_batch(starts, np.array([123]), seq_len).as_tensors()
        mask = block_causal_mask(docs.document_ids)
        bool_bytes = mask.numel() * mask.element_size()
        float_bytes = bool_bytes * 4 if seq_len > 8192 else additive_mask(mask).nbytes
        offsets_bytes = docs.cu_seqlens.numel() * docs.cu_seqlens.element_size()
        del mask
        results[seq_len] = {"sdpa_bool_mask_bytes_per_row": bool_bytes, "eager_float_mask_bytes_per_row": float_bytes,
                            "flash_offsets_bytes_per_row": offsets_bytes, "segments": docs.n_segments}
        report.line(f"seq_len {seq_len:>6}: SDPA bool mask {bool_bytes / 2**20:8.1f} MiB per row; eager float mask "
                    f"{float_bytes / 2**20:8.1f} MiB per row; flash offsets {offsets_bytes} bytes ({docs.n_segments} "
                    "segments)")
    return results


def bench_val_loss(args, report) -> dict:
    results, root = {}, Path(args.tmp or tempfile.mkdtemp(prefix="bench_docmask_val_"))
    for side in SIDES:
        out = root / side
        C.run_checked([sys.executable, "train.py", args.recipe, f"out_dir={out}", f"data.path={args.data}",
                       f"data.document_masking={str(side == 'masked').lower()}",
                       f"train.max_steps={args.steps}", "logging.progress_bar=false", "checkpoint.resume=none"])
        results[side] = row = {}
        for eval_side, flag in (("eval_masked", []), ("eval_stream", ["--no-document-masking"])):
            C.run_checked([sys.executable, "eval.py", str(out / "export"), "--data", args.data, "--output",
                           str(out / f"{eval_side}.json"), "--overwrite", *flag])
            row[eval_side] = json.loads((out / f"{eval_side}.json").read_text())["loss"]
        report.line(f"trained {side:>6}: val loss evaluated with masking {row['eval_masked']:.4f}, on the plain stream "
                    f"{row['eval_stream']:.4f}")
    return results
