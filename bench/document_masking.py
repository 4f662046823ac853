"""What document masking costs and what it changes: step time, the SDPA mask's memory, the validation loss.

    .venv/bin/python bench/document_masking.py step                 # train_step with and without masking, interleaved
    .venv/bin/python bench/document_masking.py mask-memory          # bytes of the SDPA mask at seq_len 2k / 8k / 32k
    .venv/bin/python bench/document_masking.py val-loss             # recipes/tiny.yaml 300 steps with and without

step: for the tiny recipe's model and a 34M one (``--hidden-size 640 --layers 10``, 34.3M parameters with the 8k vocabulary), two runs are built in one process
(``data.document_masking`` true and false, same seed and data) and ``train_step`` itself is timed in interleaved
blocks (A B B A ...); the ratio of each pair's seconds per step is reported (median, min, max).

mask-memory: the block-causal boolean mask of the SDPA path holds ``rows x seq_len^2`` bytes per forward (built on
the device from the document ids); eager's additive float mask 4 bytes per element; the flash path passes
``4 x (segments + 1)`` bytes of offsets. The masks are built here at each length and their bytes read back.

val-loss: ``train.py recipes/tiny.yaml`` twice (masking on, off) for the same 300 steps, then ``eval.py`` on both
exports with masking (the documents as the model will meet them) and without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402


def build(recipe: str, data: str, masking: bool, overrides: list[str], out_dir: Path):
    from lmrecipe.train.setup import build_run

    cfg = C.bench_config(recipe, [f"data.document_masking={str(masking).lower()}", *overrides], str(out_dir), data)
    return build_run(cfg, out_dir)


def time_steps(run, first_step: int, n_steps: int) -> float:
    from lmrecipe.train.step import train_step

    start = time.perf_counter()
    for step in range(first_step, first_step + n_steps):
        result = train_step(run, step)
    result.loss.item()  # the last step's work is done (a no-op wait on CPU)
    return (time.perf_counter() - start) / n_steps


def bench_step(args, report) -> dict:
    models = {"tiny": []}
    if not args.tiny_only:
        models["34M"] = [f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.layers}",
                         f"model.num_heads={args.hidden_size // 64}"]
    results = {}
    for name, overrides in models.items():
        overrides = [*overrides, f"train.micro_batch_size={args.micro_batch_size}",
                     f"train.global_batch_size={args.micro_batch_size}", f"data.seq_len={args.seq_len}"]
        with tempfile.TemporaryDirectory(prefix="bench_docmask_") as tmp:
            runs = {side: build(args.recipe, args.data, side == "masked", overrides, Path(tmp) / side)
                    for side in ("masked", "plain")}
            step = {side: 0 for side in runs}
            for side, run in runs.items():  # warm-up (allocator, first-call costs)
                time_steps(run, 0, 2)
                step[side] = 2
            per_pair = []
            for order in C.pair_orders(args.pairs, ("masked", "plain")):
                seconds = {}
                for side in order:
                    seconds[side] = time_steps(runs[side], step[side], args.block_steps)
                    step[side] += args.block_steps
                per_pair.append(seconds)
                report.line(f"  {name}: masked {seconds['masked'] * 1e3:.0f} ms/step, plain {seconds['plain'] * 1e3:.0f} "
                            f"ms/step, ratio {seconds['masked'] / seconds['plain']:.3f}")
            for run in runs.values():
                run.prefetcher.close()
        stats = C.ratio_stats([p["masked"] / p["plain"] for p in per_pair])
        n_params = runs["plain"].n_params
        results[name] = {"params": n_params, "ratio": stats,
                         "masked_ms": statistics.median(p["masked"] for p in per_pair) * 1e3,
                         "plain_ms": statistics.median(p["plain"] for p in per_pair) * 1e3}
        report.line(f"{name} ({n_params / 1e6:.1f}M params, micro-batch {args.micro_batch_size} x seq_len {args.seq_len}): "
                    f"masked / plain step time {C.fmt_ratio(stats)}")
    return results


def bench_mask_memory(args, report) -> dict:
    import numpy as np

    from lmrecipe.model.attention import additive_mask, block_causal_mask
    from lmrecipe.data.documents import document_batch

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


def run_cmd(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=C.ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def bench_val_loss(args, report) -> dict:
    results = {}
    root = Path(args.tmp or tempfile.mkdtemp(prefix="bench_docmask_val_"))
    for side in ("masked", "plain"):
        out = root / side
        run_cmd([sys.executable, "train.py", args.recipe, f"out_dir={out}", f"data.path={args.data}",
                 f"data.document_masking={str(side == 'masked').lower()}", f"train.max_steps={args.steps}",
                 "logging.progress_bar=false", "checkpoint.resume=none"])
        row = {}
        for eval_side, flag in (("eval_masked", []), ("eval_stream", ["--no-document-masking"])):
            result = out / f"{eval_side}.json"
            run_cmd([sys.executable, "eval.py", str(out / "export"), "--data", args.data, "--output", str(result),
                     "--overwrite", *flag])
            row[eval_side] = json.loads(result.read_text())["loss"]
        results[side] = row
        report.line(f"trained {side:>6}: val loss evaluated with masking {row['eval_masked']:.4f}, on the plain stream "
                    f"{row['eval_stream']:.4f}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["step", "mask-memory", "val-loss"])
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--hidden-size", type=int, default=640, help="the larger model's width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=10, help="the larger model's blocks (default: %(default)s)")
    parser.add_argument("--tiny-only", action="store_true", help="step: time the tiny model only")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block-steps", type=int, default=3, help="step: steps per timed block (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="val-loss: steps per run (default: %(default)s)")
    parser.add_argument("--tmp", default=None, help="val-loss: folder for the two runs (default: a new temp folder)")
    C.add_common_args(parser, pairs=4, device=False)
    args = parser.parse_args()
    C.set_threads(args.threads)
    C.check_data(args.data)
    report = C.Report(f"document_masking_{args.part.replace('-', '_')}", output=args.output)
    part = {"step": bench_step, "mask-memory": bench_mask_memory, "val-loss": bench_val_loss}[args.part]
    report.figures = part(args, report)
    report.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
