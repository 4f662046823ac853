"""Against transformers.Trainer: train.py's loop and Trainer on the same model, data, batch, accumulation, clipping,
optimizer and learning-rate schedule, tokens/s.

Each side a fresh process, in alternating order: ``lmrecipe.train(cfg)`` as train.py calls it, and
``transformers.Trainer`` on the same weights, windows, optimizer and schedule; tokens/s after --warmup-steps steps.
Target: ours >= 1.0x Trainer's (docs/benchmarks/02-vs-trainer.md).
"""

import logging
import tempfile
import time

import _common as C

DEVICE = True


def options(parser) -> None:
    parser.add_argument("--overrides", nargs="*", default=C.TINY_FAST, help="recipe overrides (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps before the timed window (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="log interval of both sides (default: %(default)s)")


def trainer_run(cfg, step_end, device_name: str, out_dir: str) -> None:
    """``transformers.Trainer`` on our model, windows, optimizer and schedule, calling ``step_end(device)`` per step."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lmrecipe.data.format import open_data
    from lmrecipe.model.build import build_hf_config, build_model
    from lmrecipe.optim import build_optimizer, lr_at
    from lmrecipe.parallel.precision import resolve_precision
    from lmrecipe.planning.zero_comparison import recipe_vocab_size

    hf_config = build_hf_config(cfg.model, recipe_vocab_size(cfg.model, cfg.data), cfg.data.seq_len)
    _, windows, _ = open_data(cfg.data.path, cfg.data.seq_len, hf_config.vocab_size)

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            inputs, _ = windows.batch([i])
            return {"input_ids": inputs[0], "labels": inputs[0]}

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end(args.device)

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.train, hf_config)
    optimizer = build_optimizer(model, cfg.optim, cpu_offload=False)
    schedule = LambdaLR(optimizer, lambda step: lr_at(step, cfg.train.max_steps, cfg.optim, cfg.schedule) / cfg.optim.lr)
    precision = resolve_precision(cfg.train.precision)
    args = TrainingArguments(
        output_dir=out_dir, max_steps=cfg.train.max_steps, per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=cfg.train.global_batch_size // cfg.train.micro_batch_size,
        max_grad_norm=cfg.optim.grad_clip, learning_rate=cfg.optim.lr, logging_steps=cfg.logging.log_every_steps,
        report_to=[], save_strategy="no", eval_strategy="no", use_cpu=device_name == "cpu", bf16=precision == "bf16",
        fp16=precision == "fp16", dataloader_num_workers=0, disable_tqdm=True, seed=cfg.train.seed)
    Trainer(model=model, args=args, train_dataset=Windows(), optimizers=(optimizer, schedule), callbacks=[StepEnd()]).train()


def worker(args) -> dict:
    from lmrecipe.observe import console
    from lmrecipe.train import trainer

    logging.basicConfig(level=logging.WARNING)
    marks: list[tuple[float, float]] = []  # wall and CPU time at the end of each optimizer step

    def step_end(device) -> None:
        C.sync(device)
        marks.append((time.perf_counter(), time.process_time()))

    with tempfile.TemporaryDirectory(prefix=f"bench_{args.worker}_") as tmp:
        overrides = [*args.overrides, f"train.max_steps={args.steps}", f"logging.log_every_steps={args.log_every}"]
        cfg = C.bench_config(args.recipe, overrides, out_dir=tmp, data_path=args.data)
        if args.worker == "ours":  # the loop's own step end, timed like Trainer's callback
            step_done = console.Reporter.step_done
            console.Reporter.step_done = lambda self, *a, **kw: (step_done(self, *a, **kw), step_end(self.accelerator.device))
            trainer.train(cfg)
        else:
            trainer_run(cfg, step_end, args.device, tmp)
    (t0, c0), (t1, c1) = marks[args.warmup_steps - 1], marks[-1]
    steps, tokens_per_step = len(marks) - args.warmup_steps, cfg.train.global_batch_size * cfg.data.seq_len
    return {"tokens_per_sec": steps * tokens_per_step / (t1 - t0), "tokens_per_cpu_sec": steps * tokens_per_step / (c1 - c0),
            "steps": steps, "ms_per_step": 1000 * (t1 - t0) / steps}


def run(args, report) -> None:
    report.line(f"recipe {args.recipe} {' '.join(args.overrides)}; {args.steps} steps per run, "
                f"timed after step {args.warmup_steps}; each run a fresh process")
    runs, stats = C.interleave(
        report, args.pairs, ("ours", "trainer"),
        lambda side: C.run_worker(C.worker_command(args, side), side, TOKENIZERS_PARALLELISM="false"),
        {"ratio": lambda got: got["ours"]["tokens_per_sec"] / got["trainer"]["tokens_per_sec"],
         "CPU-time ratio": lambda got: got["ours"]["tokens_per_cpu_sec"] / got["trainer"]["tokens_per_cpu_sec"]},
        lambda got: "  ".join(f"{side} {r['tokens_per_sec']:,.0f} tok/s" for side, r in got.items()))
    ratio, cpu = stats["ratio"], stats["CPU-time ratio"]
    report.line(f"ours / Trainer tokens/s: {C.fmt_ratio(ratio)}   target >= 1.0: {'MET' if ratio['median'] >= 1.0 else 'MISSED'}")
    report.line(f"same, per CPU second of the process (less sensitive to other processes): {C.fmt_ratio(cpu)}")
    medians = {side: C.median_of(runs[side], "ms_per_step") for side in runs}
    report.line(f"ms per optimizer step, median: ours {medians['ours']:.2f}, trainer {medians['trainer']:.2f}")
    report.figures = {"ratio_ours_over_trainer": ratio, "cpu_time_ratio": cpu, "runs": runs, "ms_per_step_median": medians}
