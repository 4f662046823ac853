"""Loop overhead: train.py's training step against a minimal raw PyTorch loop on the same model and batches.

    .venv/bin/python bench/loop_overhead.py                       # tiny recipe shape, micro-batch 4 x accumulation 2
    .venv/bin/python bench/loop_overhead.py --pairs 20 --block-steps 20 --profile
    .venv/bin/python bench/loop_overhead.py --device cuda --recipe recipes/llama_125m.yaml --overrides data.path=data/stdlib

Both sides run in this process, in alternating blocks of --block-steps optimizer steps (A B, B A, ...):

- ours: the trainer of train.py (lmrecipe.train.trainer.build_trainer over build_run), stepped by Trainer.step:
  lmrecipe.train.step.train_step (the prefetched batches, accelerator.accumulate, causal_lm_loss,
  accelerator.backward, optimizer_step with clipping, lr_at/set_lr), then every callback a run has (the log line
  every logging.log_every_steps, the spike rule, the preemption check, the checkpoint's cadence, ...)
  (bench/_common.py: OursLoop);
- raw: the same Hugging Face model and initial weights, AdamW with the same groups, the same micro-batches and
  accumulation, fp32 cross-entropy, (loss / accum).backward(), clip_grad_norm_, step, zero_grad - nothing else.
  By default its batches are pre-built tensors, so the data fetch counts as ours' overhead (--raw-data fetch
  makes it fetch from the memory map too).

The figure is the median over pairs of ours' tokens/s / raw's tokens/s. Target: >= 0.97. The same ratio from
the process's CPU seconds is printed too: on a shared machine it does not count time spent descheduled.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import _common as C  # noqa: E402

TINY_FAST = ["train.global_batch_size=8", "train.micro_batch_size=4"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--overrides", nargs="*", default=TINY_FAST,
                        help="key=value recipe overrides (default: %(default)s: a ~100-200 ms step on 2 cores)")
    parser.add_argument("--data", default="data/stdlib", help="prepared data folder (default: %(default)s)")
    parser.add_argument("--block-steps", type=int, default=10, help="optimizer steps per timed block (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps of each side first (default: %(default)s)")
    parser.add_argument("--raw-data", choices=["prebuilt", "fetch"], default="prebuilt",
                        help="raw loop's batches: pre-built tensors (strict) or fetched from the memory map like ours")
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table of a block of each side")
    C.add_common_args(parser, pairs=20)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU figures, also on a GPU machine
    C.set_threads(args.threads)
    C.check_data(args.data)
    report = C.Report("loop_overhead", args.device, args.output)

    with tempfile.TemporaryDirectory(prefix="bench_loop_") as tmp:
        cfg = C.bench_config(args.recipe, args.overrides, out_dir=tmp, data_path=args.data)
        ours = C.OursLoop(cfg, Path(tmp))
        device = ours.accelerator.device
        batches = (C.prebuilt_batches(ours.train_batches, 16) if args.raw_data == "prebuilt"
                   else C.fetched_batches(ours.train_batches))
        raw = C.RawLoop(cfg, ours.hf_config, device, ours.precision, batches)
        report.line(
            f"model: {ours.n_params / 1e6:.2f}M params, {cfg.model.num_layers} layers x {cfg.model.hidden_size} wide, "
            f"seq_len {cfg.data.seq_len}, micro-batch {cfg.train.micro_batch_size} x accumulation {ours.layout.accum_steps} "
            f"= {ours.tokens_per_step} tokens/step, precision {ours.precision}, grad_clip {cfg.optim.grad_clip}, "
            f"device {device}; raw batches: {args.raw_data}"
        )
        loops = {"ours": ours, "raw": raw}
        for loop in loops.values():
            C.timed_block(loop, args.warmup_steps, device)

        ratios, cpu_ratios, tps = [], [], {"ours": [], "raw": []}
        seconds = {"ours": 0.0, "raw": 0.0}
        for loop in loops.values():
            loop.sections.reset()
        for i, order in enumerate(C.pair_orders(args.pairs, ("ours", "raw"))):
            got, cpu = {}, {}
            for side in order:
                timing = C.timed_block(loops[side], args.block_steps, device)
                seconds[side] += timing.wall_s
                got[side] = args.block_steps * ours.tokens_per_step / timing.wall_s
                cpu[side] = timing.cpu_s
                tps[side].append(got[side])
            ratios.append(got["ours"] / got["raw"])
            cpu_ratios.append(cpu["raw"] / cpu["ours"])
            report.line(f"pair {i + 1:>2} ({' '.join(order)}): ours {got['ours']:>9,.0f} tok/s  raw {got['raw']:>9,.0f} tok/s  "
                        f"ratio {ratios[-1]:.3f}  (CPU-time ratio {cpu_ratios[-1]:.3f})")

        stats, cpu_stats = C.ratio_stats(ratios), C.ratio_stats(cpu_ratios)
        report.line()
        verdict = "MET" if stats["median"] >= 0.97 else "MISSED"
        report.line(f"ours / raw tokens/s: {C.fmt_ratio(stats)}   target >= 0.97: {verdict}")
        report.line(f"same, from CPU seconds per step (raw / ours; less sensitive to other processes): {C.fmt_ratio(cpu_stats)}")
        n_steps = args.pairs * args.block_steps
        report.line(f"per step (ms, mean over the {n_steps} timed steps of each side):")
        report.line(f"  {'section':<16}{'ours':>10}{'raw':>10}")
        breakdown = {}
        for side, loop in loops.items():
            parts = dict(loop.sections.seconds)
            parts.setdefault("data", 0.0)  # raw: inside its fetch, not timed apart
            parts["rest (bookkeeping)"] = seconds[side] - sum(parts.values())
            breakdown[side] = {k: 1000 * v / n_steps for k, v in parts.items()}
            breakdown[side]["step"] = 1000 * seconds[side] / n_steps
        for key in ["forward+loss", "backward", "clip+optimizer", "data", "rest (bookkeeping)", "step"]:
            report.line(f"  {key:<16}{breakdown['ours'].get(key, 0):>10.2f}{breakdown['raw'].get(key, 0):>10.2f}")
        # The sections both loops share (forward+loss, backward, clip+optimizer) run the same kernels; what ours adds
        # is its data fetch and bookkeeping. Their measured time is a steadier overhead figure than the ratio of two
        # noisy step times when other processes share the machine.
        extra_ms = (breakdown["ours"]["data"] + breakdown["ours"]["rest (bookkeeping)"] - breakdown["raw"]["rest (bookkeeping)"])
        share = extra_ms / breakdown["ours"]["step"]
        report.line(f"ours' extra time (data fetch + bookkeeping - raw's bookkeeping): {extra_ms:.2f} ms/step = "
                    f"{100 * share:.2f}% of its step, i.e. {1 - share:.3f}x raw's tokens/s if the shared sections ran "
                    "equally fast")
        report.figures = {"ratio_ours_over_raw": stats, "extra_ms_per_step": extra_ms, "implied_ratio": 1 - share,
                          "cpu_time_ratio": cpu_stats, "tokens_per_sec": tps, "ms_per_step": breakdown,
                          "tokens_per_step": ours.tokens_per_step, "n_params": ours.n_params, "raw_data": args.raw_data}

        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            for side, loop in loops.items():
                with profile(activities=activities) as prof:
                    C.timed_block(loop, args.block_steps, device)
                report.line(f"\ntorch.profiler, {args.block_steps} steps of {side}, top 15 ops by self CPU time:")
                for row in prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15).splitlines():
                    report.line(row)
        ours.close()
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
