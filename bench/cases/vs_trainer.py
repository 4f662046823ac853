"""Against transformers.Trainer: train.py's loop and Trainer on the same model, data, batch, accumulation, clipping,
optimizer and learning-rate schedule, tokens/s.

Each side is a fresh process (each builds an Accelerator, a per-process singleton), in alternating order: *ours* is
``lmrecipe.train(cfg)`` as train.py calls it; *trainer* is ``transformers.Trainer`` with the same initial weights, a
Dataset over the same memmap windows, our optimizer and our schedule as a LambdaLR. Both log every --log-every
steps. The figure is tokens/s from the end of step --warmup-steps to the last step; timers split each side's step
into forward+loss, backward, clip, optimizer.step and the rest. Target: ours >= 1.0x Trainer's tokens/s.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import _common as C

DEVICE = True
KEYS = ["forward+loss", "backward", "clip", "optimizer.step", "outside fwd/bwd/clip/step", "data", "step"]


def options(parser) -> None:
    parser.add_argument("--overrides", nargs="*", default=["train.global_batch_size=8", "train.micro_batch_size=4"],
                        help="key=value recipe overrides (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps before the timed window (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="log interval of both sides (default: %(default)s)")


class Timers:
    """Wall seconds per section, patched around the calls both sides make (and a snapshot at each step end)."""

    def __init__(self):
        self.seconds = {"forward+loss": 0.0, "backward": 0.0, "clip": 0.0, "optimizer.step": 0.0, "data": 0.0}
        self.step_marks: list[tuple[float, float, dict]] = []

    def wrap(self, owner, name: str, section: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[section] += time.perf_counter() - start

        setattr(owner, name, timed)

    def hook_optimizer(self, optimizer) -> None:
        state = {}
        def pre(*_):
            state["t"] = time.perf_counter()

        def post(*_):
            self.seconds["optimizer.step"] += time.perf_counter() - state["t"]

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    def mark_step_end(self, device) -> None:
        C.sync(device)
        self.step_marks.append((time.perf_counter(), time.process_time(), dict(self.seconds)))

    def result(self, warmup: int, tokens_per_step: int) -> dict:
        (t0, c0, s0), (t1, c1, s1) = self.step_marks[warmup - 1], self.step_marks[-1]
        steps = len(self.step_marks) - warmup
        wall = t1 - t0
        per_step = {k: 1000 * (s1[k] - s0[k]) / steps for k in s1}
        inside = sum(per_step[k] for k in ("forward+loss", "backward", "clip", "optimizer.step"))
        per_step["outside fwd/bwd/clip/step"] = 1000 * wall / steps - inside
        per_step["step"] = 1000 * wall / steps
        return {"tokens_per_sec": steps * tokens_per_step / wall, "tokens_per_cpu_sec": steps * tokens_per_step / (c1 - c0),
                "steps": steps, "ms_per_step": per_step}


def worker_ours(cfg, timers: Timers, warmup: int) -> dict:
    import accelerate

    from lmrecipe import optim as optim_mod
    from lmrecipe.data import format as data_format
    from lmrecipe.observe import console
    from lmrecipe.train import setup, trainer
    from lmrecipe.train import step as step_module

    timers.wrap(step_module, "training_loss", "forward+loss")
    timers.wrap(accelerate.Accelerator, "backward", "backward")
    timers.wrap(accelerate.Accelerator, "clip_grad_norm_", "clip")
    timers.wrap(data_format.TokenWindows, "batch", "data")
    original_build = optim_mod.build_optimizer

    def build_optimizer(*args, **kwargs):
        opt = original_build(*args, **kwargs)
        timers.hook_optimizer(opt)
        return opt

    setup.build_optimizer = build_optimizer
    original_step_done = console.Reporter.step_done

    def step_done(self, state, *args, **kwargs):
        original_step_done(self, state, *args, **kwargs)
        timers.mark_step_end(self.accelerator.device)

    console.Reporter.step_done = step_done
    trainer.train(cfg)
    return timers.result(warmup, cfg.train.global_batch_size * cfg.data.seq_len)


def worker_trainer(cfg, timers: Timers, warmup: int, device_name: str, out_dir: str) -> dict:
    import torch
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lmrecipe.data.format import load_meta, open_data
    from lmrecipe.parallel.precision import resolve_precision
    from lmrecipe.model.build import build_hf_config, build_model
    from lmrecipe.optim import build_optimizer, lr_at

    meta = load_meta(cfg.data.path)
    hf_config = build_hf_config(cfg.model, cfg.model.vocab_size or int(meta["vocab_size"]), cfg.data.seq_len)
    _, windows, _ = open_data(cfg.data.path, cfg.data.seq_len, hf_config.vocab_size)

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            inputs, _ = windows.batch([i])
            return {"input_ids": inputs[0], "labels": inputs[0]}

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.train, hf_config)
    optimizer = build_optimizer(model, cfg.optim, cpu_offload=False)
    timers.hook_optimizer(optimizer)
    schedule = LambdaLR(optimizer, lambda step: lr_at(step, cfg.train.max_steps, cfg.optim, cfg.schedule) / cfg.optim.lr)
    precision = resolve_precision(cfg.train.precision)
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=cfg.train.max_steps,
        per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=cfg.train.global_batch_size // cfg.train.micro_batch_size,
        max_grad_norm=cfg.optim.grad_clip,
        learning_rate=cfg.optim.lr,
        logging_steps=cfg.logging.log_every_steps,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        use_cpu=device_name == "cpu",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=cfg.train.seed,
    )

    class Timed(Trainer):
        def compute_loss(self, *a, **kw):
            start = time.perf_counter()
            try:
                return super().compute_loss(*a, **kw)
            finally:
                timers.seconds["forward+loss"] += time.perf_counter() - start

        def get_batch_samples(self, *a, **kw):
            start = time.perf_counter()
            try:
                return super().get_batch_samples(*a, **kw)
            finally:
                timers.seconds["data"] += time.perf_counter() - start

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            timers.mark_step_end(args.device)

    import accelerate

    timers.wrap(accelerate.Accelerator, "backward", "backward")
    timers.wrap(accelerate.Accelerator, "clip_grad_norm_", "clip")
    Timed(model=model, args=args, train_dataset=Windows(), optimizers=(optimizer, schedule), callbacks=[StepEnd()]).train()
    return timers.result(warmup, cfg.train.global_batch_size * cfg.data.seq_len)


def worker(args) -> dict:
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.worker}_") as tmp:
        overrides = [*args.overrides, f"train.max_steps={args.steps}", f"logging.log_every_steps={args.log_every}"]
        cfg = C.bench_config(args.recipe, overrides, out_dir=tmp, data_path=args.data)
        if args.worker == "ours":
            return worker_ours(cfg, Timers(), args.warmup_steps)
        return worker_trainer(cfg, Timers(), args.warmup_steps, args.device, tmp)


def run(args, report) -> None:
    report.line(f"recipe {args.recipe} {' '.join(args.overrides)}; {args.steps} steps per run, "
                f"timed after step {args.warmup_steps}; each run a fresh process")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_DISABLE_RICH": "1"}
    runs, stats = C.interleave(
        report, args.pairs, ("ours", "trainer"), lambda side: C.run_worker(C.worker_command(args, side), side, env),
        {"ratio": lambda got: got["ours"]["tokens_per_sec"] / got["trainer"]["tokens_per_sec"],
         "CPU-time ratio": lambda got: got["ours"]["tokens_per_cpu_sec"] / got["trainer"]["tokens_per_cpu_sec"]},
        lambda got: "  ".join(f"{side} {r['tokens_per_sec']:,.0f} tok/s" for side, r in got.items()))
    ratio, cpu = stats["ratio"], stats["CPU-time ratio"]
    report.line()
    report.line(f"ours / Trainer tokens/s: {C.fmt_ratio(ratio)}   target >= 1.0: {'MET' if ratio['median'] >= 1.0 else 'MISSED'}")
    report.line(f"same, per CPU second of the process (less sensitive to other processes): {C.fmt_ratio(cpu)}")
    report.line("per optimizer step (ms, median over runs):")
    report.line(f"  {'section':<28}{'ours':>10}{'trainer':>10}")
    medians = {side: {k: statistics.median(r["ms_per_step"][k] for r in runs[side]) for k in KEYS} for side in runs}
    for k in KEYS:
        label = "  of which data fetch" if k == "data" else k
        report.line(f"  {label:<28}{medians['ours'][k]:>10.2f}{medians['trainer'][k]:>10.2f}")
    report.figures = {"ratio_ours_over_trainer": ratio, "cpu_time_ratio": cpu, "runs": runs, "ms_per_step_median": medians}
