"""The benchmarks' shared pieces: the machine description, the report (``bench/results/<name>.txt`` and ``.json``
with the command that reproduces it), interleaved rounds (A B, B A, ...: a shared machine's drift hits both sides
of a round alike) and their median-of-ratios statistics, worker processes, and the two loops the cases drive.
"""

import contextlib
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from collections import Counter
from pathlib import Path

from lmrecipe.errors import fail

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNNER = ROOT / "bench" / "run.py"
RESULT_PREFIX = "BENCH_RESULT "  # a worker prints it before its JSON result


def print_result(result: dict, file=None) -> None:
    print(RESULT_PREFIX + json.dumps(result), file=file or sys.stdout, flush=True)


def read_result(lines) -> dict | None:
    """The first result a worker printed among ``lines`` (read no further), or None."""
    return next((json.loads(line[len(RESULT_PREFIX):]) for line in lines if line.startswith(RESULT_PREFIX)), None)


def worker_command(args, kind: str, *extra: str) -> list[str]:
    """This case's own command line run as worker ``kind``; ``extra`` options override the parent's."""
    return [sys.executable, str(RUNNER), args.case, *args.argv, "--worker", kind, *extra]


def run_checked(cmd: list[str], **env: str) -> str:
    """Run a command from the repository root with ``env`` over this environment (and Accelerate's rich output off);
    its stdout, or exit naming it with the end of its output."""
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "ACCELERATE_DISABLE_RICH": "1", **env}, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return proc.stdout


def run_worker(cmd: list[str], side: str, **env: str) -> dict:
    """Run a worker process (``run_checked``) and return the JSON result it printed."""
    if (result := read_result(run_checked(cmd, **env).splitlines())) is None:
        raise SystemExit(f"the {side} worker printed no result: {' '.join(cmd)}")
    return result


def command_line() -> str:
    """The command that reproduces this run, from the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return " ".join([".venv/bin/python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


def version(module: str) -> str:
    """A module's ``__version__``, else its distribution's (liger_kernel has none of its own), else "n/a"."""
    import importlib.metadata

    for get in (lambda: __import__(module).__version__, lambda: importlib.metadata.version(module.replace("_", "-"))):
        with contextlib.suppress(Exception):  # not installed: the description says so rather than failing
            return get()
    return "n/a"


VERSIONED = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "tokenizers", "numpy")


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
            "versions": {m: version(m) for m in VERSIONED}}
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

    def table(self, header: list[str], rows: list[list]) -> None:
        """A Markdown table: the first column left-aligned, the others right-aligned."""
        for cells in (header, ["---"] + ["---:"] * (len(header) - 1), *rows):
            self.line("| " + " | ".join(map(str, cells)) + " |")

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


def interleave(report: Report, pairs: int, sides: tuple[str, ...], measure: typing.Callable[[str], typing.Any],
               ratios: dict[str, typing.Callable[[dict], float]], describe=lambda got: "",
               warm_up: bool = False) -> tuple[dict, dict]:
    """``measure(side)`` for every side, ``pairs`` rounds in rotated order (A B, B A, ... / A B C, B C A, ...: no side
    always runs right after another; with ``warm_up``, after a round that is neither kept nor reported); a line per
    round (``describe(got)`` and each ratio). Returns each side's results in round order and ``ratio_stats`` of each
    named ratio of a round."""
    if warm_up:
        for side in sides:
            measure(side)
    rounds = []
    for i in range(1, pairs + 1):
        order = sides[(i - 1) % len(sides):] + sides[:(i - 1) % len(sides)]
        rounds.append(got := {side: measure(side) for side in order})
        report.line(f"round {i} ({' '.join(order)}): {describe(got)}"
                    + "".join(f"; {name} {ratio(got):.3f}" for name, ratio in ratios.items()))
    return ({side: [got[side] for got in rounds] for side in sides},
            {name: ratio_stats([ratio(got) for got in rounds]) for name, ratio in ratios.items()})


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def sync(device) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        __import__("torch").cuda.synchronize(device)


@contextlib.contextmanager
def quiet_stdout():
    """Swallow the loop's own progress lines while a timed block runs."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def cpu_seconds(*who: int) -> float:
    """User and system CPU seconds of ``resource.RUSAGE_SELF`` and/or ``RUSAGE_CHILDREN`` (those that have ended)."""
    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, who))


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ...) in KiB; 0 if absent."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next((int(line.split()[1]) for line in lines if line.startswith(field + ":")), 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TINY_FAST = ["train.global_batch_size=8", "train.micro_batch_size=4"]  # the tiny recipe at 1,024 tokens per step
# What a timed run must not do: evaluate, checkpoint, export, resume, draw a progress bar, sync a tracker.
QUIET_RUN = ["train.eval_every_steps=0", "checkpoint.every_steps=0", "checkpoint.export_at_end=false",
             "checkpoint.resume=none", "logging.progress_bar=false", "logging.trackers=[]"]


def bench_config(recipe: str, overrides: list[str], out_dir: str, data_path: str | None = None):
    """A recipe without what a timed block must not do (``QUIET_RUN``), nor stop at max_steps."""
    from lmrecipe.config import load_config

    fixed = [f"out_dir={out_dir}", "train.max_steps=1000000000", *QUIET_RUN]
    return load_config(recipe, [*fixed, *([f"data.path={data_path}"] if data_path else []), *overrides])


def train_command(recipe: str, out_dir, data_path: str, overrides: list[str]) -> list[str]:
    """``train.py`` on ``recipe`` in a fresh process, without what a timed run must not do (``QUIET_RUN``)."""
    return [sys.executable, "train.py", recipe, f"out_dir={out_dir}", f"data.path={data_path}", *QUIET_RUN, *overrides]


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 1e6


def check_tokenizer(path: str, alternative: str = "") -> None:
    if not (Path(path) / "tokenizer.json").is_file():
        raise fail(f"no tokenizer at {path} (no tokenizer.json): prepare data/stdlib with .venv/bin/python "
                   f"tools/prepare_data.py --output data/stdlib --vocab-size 8192, or pass --tokenizer a tokenizer "
                   f"folder{alternative}.")


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
        self.device = self.accelerator.device
        self.train_batches, self.n_params, self.flops_per_token = run.train_batches, run.n_params, run.flops_per_token
        self.tokens_per_step, self.hf_config = run.tokens_per_step, self.accelerator.unwrap_model(run.model).config
        self.sections = Counter()  # seconds per named section of train_step, summed over a block
        self.trainer = build_trainer(run, out_dir, timer=lambda name, seconds: self.sections.update({name: seconds}))
        self.trainer.start()
        self.state, self.close = self.trainer.state, self.trainer.close  # close: no export, no report

    def run(self, n_steps: int) -> None:
        for _ in range(n_steps):
            self.trainer.step()


@contextlib.contextmanager
def ours_loop(recipe: str, overrides: list[str], data_path: str | None):
    """An ``OursLoop`` of ``bench_config(recipe, overrides)`` in a temporary folder, closed (the folder removed) after."""
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        loop = OursLoop(bench_config(recipe, overrides, tmp, data_path), Path(tmp))
        try:
            yield loop
        finally:
            loop.close()


class RawLoop:
    """A minimal PyTorch loop on the same Hugging Face model as ``ours`` (an ``OursLoop``): forward, fp32
    cross-entropy, ``(loss / accum).backward()``, ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``; no Accelerate, no
    bookkeeping. Its micro-batches are those of ``ours``' first ``cached_steps`` steps, built once: step ``s`` reuses
    those of ``s % cached_steps``."""

    def __init__(self, ours: OursLoop, cached_steps: int = 16):
        import torch

        from lmrecipe.model.build import build_model
        from lmrecipe.optim import build_optimizer

        cfg = ours.cfg
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, cfg.train, ours.hf_config).to(ours.device).train()
        self.optimizer = build_optimizer(self.model, cfg.optim, cpu_offload=False)  # the trainer's AdamW and groups
        self.device, self.step, self.sections = ours.device, 0, Counter()
        self.micro_batches = [list(ours.train_batches.micro_batches(s)) for s in range(cached_steps)]
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ours.precision)
        self.grad_clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")

    def run(self, n_steps: int) -> None:
        import torch
        import torch.nn.functional as F

        clock, sections = time.perf_counter, self.sections
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
        for _ in range(n_steps):
            batches = self.micro_batches[self.step % len(self.micro_batches)]
            for inputs, targets, _ in batches:
                t0 = clock()
                with autocast:
                    logits = self.model(input_ids=inputs.to(self.device, non_blocking=True)).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.to(self.device, non_blocking=True).flatten())
                t1 = clock()
                (loss / len(batches)).backward()
                sections["backward"] += clock() - t1
                sections["forward+loss"] += t1 - t0
            t0 = clock()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            sections["clip+optimizer"] += clock() - t0
            self.step += 1


class Timing(typing.NamedTuple):
    wall_s: float  # what tokens/s is made of
    cpu_s: float  # this process's CPU seconds: blind to time descheduled by other processes' load


def timed_block(loop, n_steps: int) -> Timing:
    """Wall and CPU seconds of ``n_steps`` steps of ``loop`` (an ``OursLoop`` or ``RawLoop``; device work included)."""
    sync(loop.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    with quiet_stdout():
        loop.run(n_steps)
    sync(loop.device)
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


def advance(run, state) -> None:
    """One ``train_step`` of ``run`` at ``state``'s step, recorded in ``state`` as the loop does."""
    from lmrecipe.train.step import train_step

    state.record_step(train_step(run, state.step).skipped, run.tokens_per_step)


def save_round(run, checkpointer, state, steps_between: int) -> dict:
    """What the loop does around a save, timed (its output swallowed): ``maybe_save``, ``steps_between`` training
    steps, ``wait``."""
    sync(run.accelerator.device)
    with quiet_stdout():
        start = time.perf_counter()
        checkpointer.maybe_save(run.model, state)
        save_s, steps_s = time.perf_counter() - start, []
        for _ in range(steps_between):
            step_start = time.perf_counter()
            advance(run, state)
            steps_s.append(time.perf_counter() - step_start)
        sync(run.accelerator.device)
        start = time.perf_counter()
        checkpointer.wait()
        wait_s = time.perf_counter() - start
    return {"save_s": save_s, "wait_s": wait_s, "blocked_s": save_s + wait_s, "steps_s": sum(steps_s),
            "step_s": statistics.median(steps_s) if steps_s else 0.0}
