"""The benchmarks' shared pieces: the machine description, the report (``bench/results/<name>.txt`` and ``.json``
with the command that reproduces it), interleaved rounds (A B, B A, ...: a shared machine's drift hits both sides
of a round alike) and their median-of-ratios statistics, worker processes, and the two loops the cases drive.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import typing
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNNER = ROOT / "bench" / "run.py"
RESULT_PREFIX = "BENCH_RESULT "  # a worker prints it before its JSON result


class Refusal(Exception):
    """Bad input: ``bench/run.py`` prints the message and exits 2, before anything is measured or written."""


def print_result(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def worker_command(args, kind: str, *extra: str) -> list[str]:
    """This case's own command line run as worker ``kind``; ``extra`` options override the parent's."""
    return [sys.executable, str(RUNNER), args.case, *args.argv, "--worker", kind, *extra]


def run_worker(cmd: list[str], side: str, env: dict | None = None, cwd: Path = ROOT) -> dict:
    """Run a worker process and return the JSON result it printed last."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise SystemExit(f"{side} worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def run_checked(cmd: list[str], env: dict | None = None) -> str:
    """Run a command from the repository root; its stdout, or exit naming it with the end of its stderr."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def command_line() -> str:
    """The command that reproduces this run, from the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return " ".join([".venv/bin/python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


def version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or no __version__: the description says so rather than failing
        return "n/a"


def machine(device: str = "cpu") -> dict:
    """What the figures were measured on: CPU, cores, torch threads, load, GPU, library versions."""
    import torch

    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    desc = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
            "python": platform.python_version(),
            "versions": {m: version(m) for m in
                         ("torch", "transformers", "accelerate", "deepspeed", "datasets", "tokenizers", "numpy")}}
    if device.startswith("cuda") and torch.cuda.is_available():
        desc.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count())
    return desc


class Report:
    """Prints lines as they come and saves them (and a JSON of the figures) under bench/results/."""

    def __init__(self, name: str, device: str = "cpu", output: str | None = None):
        self.name, self.lines, self.figures = name, [], {}
        self.output_dir, self.machine_start = Path(output) if output else RESULTS, machine(device)
        for text in (f"# {name}", f"command: {command_line()}", f"machine: {json.dumps(self.machine_start)}"):
            self.line(text)

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def save(self) -> Path:
        load = [round(x, 2) for x in os.getloadavg()]
        self.line(f"load average at the end: {load}")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        text_path = self.output_dir / f"{self.name}.txt"
        text_path.write_text("\n".join(self.lines) + "\n")
        data = {"command": command_line(), "machine": self.machine_start, "load_avg_end": load, "figures": self.figures}
        text_path.with_suffix(".json").write_text(json.dumps(data, indent=2, default=float) + "\n")
        print(f"saved {text_path} and {text_path.with_suffix('.json')}", flush=True)
        return text_path


def ratio_stats(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def fmt_ratio(stats: dict, unit: str = "x") -> str:
    return f"{stats['median']:.3f}{unit} (min {stats['min']:.3f}, max {stats['max']:.3f}, n={stats['n']})"


def pair_orders(n_pairs: int, sides: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Side order per round, rotated (A B, B A, ... / A B C, B C A, ...): no side always runs right after another."""
    return [tuple(sides[(i + j) % len(sides)] for j in range(len(sides))) for i in range(n_pairs)]


def interleave(report: Report, pairs: int, sides: tuple[str, ...], measure: typing.Callable[[str], typing.Any],
               ratios: dict[str, typing.Callable[[dict], float]], describe=lambda got: "") -> tuple[dict, dict]:
    """``measure(side)`` for every side, in rotated order, ``pairs`` rounds; a line per round (``describe(got)`` and
    each ratio). Returns each side's results in round order and ``ratio_stats`` of each named ratio of a round."""
    results: dict[str, list] = {side: [] for side in sides}
    values: dict[str, list[float]] = {name: [] for name in ratios}
    for i, order in enumerate(pair_orders(pairs, sides), start=1):
        got = {side: measure(side) for side in order}
        for side in sides:
            results[side].append(got[side])
        for name, ratio in ratios.items():
            values[name].append(ratio(got))
        report.line(f"round {i} ({' '.join(order)}): {describe(got)}"
                    + "".join(f"; {name} {v[-1]:.3f}" for name, v in values.items()))
    return results, {name: ratio_stats(v) for name, v in values.items()}


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def set_threads(threads: int | None) -> None:
    if threads:
        __import__("torch").set_num_threads(threads)


def sync(device) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        __import__("torch").cuda.synchronize(device)


@contextlib.contextmanager
def quiet_stdout():
    """Swallow the loop's own progress lines while a timed block runs."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ...) in KiB; 0 if absent."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next((int(line.split()[1]) for line in lines if line.startswith(field + ":")), 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_config(recipe: str, overrides: list[str], out_dir: str, data_path: str | None = None):
    """A recipe without what a timed block must not do: evaluate, checkpoint, export, stop at max_steps, sync a tracker."""
    from lmrecipe.config import load_config

    fixed = [f"out_dir={out_dir}", "train.max_steps=1000000000", "train.eval_every_steps=0", "checkpoint.every_steps=0",
             "checkpoint.export_at_end=false", "checkpoint.resume=none", "logging.progress_bar=false", "logging.trackers=[]"]
    return load_config(recipe, [*fixed, *([f"data.path={data_path}"] if data_path else []), *overrides])


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 1e6


def check_data(path: str) -> None:
    if not (Path(path) / "meta.json").is_file():
        raise Refusal(f"no prepared data at {path} (no meta.json there): prepare it with "
                      f".venv/bin/python tools/prepare_data.py --output {path} --vocab-size 8192, or pass --data "
                      "a folder tools/prepare_data.py wrote.")


def check_tokenizer(path: str, alternative: str = "") -> None:
    if not (Path(path) / "tokenizer.json").is_file():
        raise Refusal(f"no tokenizer at {path} (no tokenizer.json): prepare data/stdlib with .venv/bin/python "
                      f"tools/prepare_data.py --output data/stdlib --vocab-size 8192, or pass --tokenizer a tokenizer "
                      f"folder{alternative}.")


class Sections(Counter):
    """Seconds spent per named section, summed over the steps of a block."""

    def add(self, name: str, seconds: float) -> None:
        self[name] += seconds


class OursLoop:
    """The trainer of ``lmrecipe.train`` (one process, no DeepSpeed), driven in blocks of steps: built by its own
    ``build_run`` / ``build_trainer``, each step is ``Trainer.step`` (``train_step``, then every callback), and
    ``train_step`` reports its sections to ``self.sections``."""

    def __init__(self, cfg, out_dir: Path):
        from lmrecipe.train.setup import build_run
        from lmrecipe.train.trainer import build_trainer

        out_dir.mkdir(parents=True, exist_ok=True)
        self.cfg, run = cfg, build_run(cfg, out_dir)
        if run.runtime.topology.zero.deepspeed:
            raise SystemExit("OursLoop drives the no-DeepSpeed path; DeepSpeed runs go through train.py (the GPU kit does)")
        self.accelerator, self.precision, self.layout = run.accelerator, run.runtime.precision, run.runtime.batch
        self.train_batches, self.n_params, self.flops_per_token = run.train_batches, run.n_params, run.flops_per_token
        self.tokens_per_step, self.hf_config = run.tokens_per_step, self.accelerator.unwrap_model(run.model).config
        self.sections = Sections()
        self.trainer = build_trainer(run, out_dir, timer=self.sections.add)
        self.trainer.start()
        self.state, self.close = self.trainer.state, self.trainer.close  # close: no export, no report

    def run(self, n_steps: int) -> None:
        for _ in range(n_steps):
            self.trainer.step()


class RawLoop:
    """A minimal PyTorch loop on the same Hugging Face model: forward, fp32 cross-entropy, ``(loss / accum).backward()``,
    ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``; no Accelerate, no bookkeeping. ``micro_batches(step)``: the
    micro-batches of a step (``prebuilt_batches``)."""

    def __init__(self, cfg, hf_config, device, precision: str, micro_batches):
        import torch

        from lmrecipe.model.build import build_model
        from lmrecipe.optim import param_groups

        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, cfg.train, hf_config).to(device).train()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(param_groups(self.model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.device, self.micro_batches, self.step, self.sections = device, micro_batches, 0, Sections()
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.grad_clip = o.grad_clip if o.grad_clip > 0 else float("inf")

    def run(self, n_steps: int) -> None:
        import torch
        import torch.nn.functional as F

        add, clock = self.sections.add, time.perf_counter
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
        for _ in range(n_steps):
            batches = self.micro_batches(self.step)
            for inputs, targets, _ in batches:
                t0 = clock()
                with autocast:
                    logits = self.model(input_ids=inputs.to(self.device, non_blocking=True)).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.to(self.device, non_blocking=True).flatten())
                t1 = clock()
                (loss / len(batches)).backward()
                add("backward", clock() - t1)
                add("forward+loss", t1 - t0)
            t0 = clock()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            add("clip+optimizer", clock() - t0)
            self.step += 1


def prebuilt_batches(train_batches, n_steps: int):
    """The micro-batches of the first ``n_steps`` steps, built once; step ``s`` reuses those of ``s % n_steps``."""
    cache = [list(train_batches.micro_batches(s)) for s in range(n_steps)]
    return lambda step: cache[step % n_steps]


class Timing(typing.NamedTuple):
    wall_s: float  # what tokens/s is made of
    cpu_s: float  # this process's CPU seconds: blind to time descheduled by other processes' load


def timed_block(loop, n_steps: int, device) -> Timing:
    """Wall and CPU seconds of ``n_steps`` steps of ``loop`` (device work included)."""
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    with quiet_stdout():
        loop.run(n_steps)
    sync(device)
    return Timing(time.perf_counter() - start, time.process_time() - cpu_start)


def add_wide_model_options(parser) -> None:
    """The options of the cases that train a wider model of the recipe between saves."""
    parser.add_argument("--hidden-size", type=int, default=512, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--steps-between", type=int, default=3, help="training steps after each save (default: %(default)s)")
    parser.add_argument("--tmp", default=None, help="folder for the run and its checkpoints (default: system temp)")


def build_wide_run(args, out_dir: Path, overrides: list[str]):
    """``build_run`` of ``args.recipe`` at ``--hidden-size`` x ``--layers``, saving every step it is asked to."""
    from lmrecipe.train.setup import build_run

    wide = [f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.layers}",
            f"model.intermediate_size={(8 * args.hidden_size // 3 + 63) // 64 * 64}"]  # 8/3 of the width, to 64
    cfg = bench_config(args.recipe, [*wide, "checkpoint.every_steps=1", *overrides], str(out_dir), args.data)
    return build_run(cfg, out_dir)


def side_checkpointer(run, folder: Path, background: bool):
    """The trainer's own checkpointer of ``run``, saving at every step it is asked to, into ``folder``."""
    import dataclasses

    from lmrecipe.train.callbacks.checkpointing import build_checkpointer

    section = dataclasses.replace(run.cfg.checkpoint, every_steps=1, keep_last=1, background_save=background)
    return build_checkpointer(dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, checkpoint=section)), folder)


def save_round(run, checkpointer, state, steps_between: int) -> dict:
    """What the loop does around a save, timed: ``maybe_save``, ``steps_between`` training steps, ``wait``."""
    from lmrecipe.train.step import train_step

    sync(run.accelerator.device)
    start = time.perf_counter()
    checkpointer.maybe_save(run.model, state)
    save_s, steps_s = time.perf_counter() - start, []
    for _ in range(steps_between):
        step_start = time.perf_counter()
        state.record_step(train_step(run, state.step).skipped, run.tokens_per_step)
        steps_s.append(time.perf_counter() - step_start)
    sync(run.accelerator.device)
    start = time.perf_counter()
    checkpointer.wait()
    wait_s = time.perf_counter() - start
    return {"save_s": save_s, "wait_s": wait_s, "blocked_s": save_s + wait_s, "steps_s": sum(steps_s),
            "step_s": statistics.median(steps_s) if steps_s else 0.0}
