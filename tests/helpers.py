"""Helpers shared by the test modules: the repository root, the tiny model's overrides, real process launches.

Test modules import from here (never from one another, never from conftest); fixtures live in conftest.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A small, fast model for every end-to-end test; recipes/tiny.yaml supplies the rest.
TINY_OVERRIDES = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=128",
    "data.seq_len=32",
    "data.val_windows=16",
    "logging.plots=false",  # ~1.3 s of CPU per run; the tests of the plots set it back
    "logging.peak_tflops=0.1",  # no CPU matmul probe (~0.3 s per run): tests/unit/test_report.py tests it
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "schedule.warmup_steps=2",
    "logging.log_every_steps=1",
    "logging.progress_bar=false",
    "checkpoint.export_at_end=false",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict:
    """This process's environment as a user's shell would give it to a run: no wandb key, no wandb service of this
    process (``wandb.login`` with a key starts one here and names it in ``WANDB_SERVICE``; once torn down, a run given
    the name would connect to a socket that is gone), offline trackers, one thread, no launcher's rank variables."""
    env = dict(os.environ)
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_SERVICE", None)
    env.update(
        PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
        ACCELERATE_DISABLE_RICH="1", PYTHONUNBUFFERED="1",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch_cmd(nproc: int) -> list[str]:
    """The command a user types: accelerate launch for several processes, plain python for one."""
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
    ]


RUN_TIMEOUT_S = 600
IN_PROCESS = os.environ.get("LMRECIPE_TEST_IN_PROCESS", "1") != "0"
"""One-process runs of :func:`run_script` in the test's process (``LMRECIPE_TEST_IN_PROCESS=0``: each in its own)."""


def run_script(args: list[str], nproc: int = 1, timeout: int = RUN_TIMEOUT_S, check: bool = True,
               env_extra: dict | None = None, in_process: bool | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run ``train.py``/``eval.py``/a tool on ``nproc`` processes from the repo root and capture its output.

    ``env_extra``: variables added to the environment (fault injection). One process runs in this one
    (:func:`run_in_process`: the interpreter's imports are not paid again) unless ``in_process=False``: a run that
    must die, be killed or time out, or whose effects on its own process are what the test reads.
    """
    if in_process is None:
        in_process = nproc == 1 and IN_PROCESS and runs_in_process(args[0], timeout, env_extra, kwargs)
    if in_process:
        proc = run_in_process(args, env_extra)
    else:
        proc = subprocess.run(
            launch_cmd(nproc) + args, cwd=ROOT, env={**subprocess_env(), **(env_extra or {})}, capture_output=True,
            text=True, timeout=timeout, **kwargs
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return proc


_MAINS: dict[str, object] = {}
KILLING_FAULTS = ("LMRECIPE_FAULT_KILL_UPLOAD",)
"""Test faults that end their process (SIGKILL): a run given one has a process of its own."""


def runs_in_process(script: str, timeout: int, env_extra: dict | None, kwargs: dict) -> bool:
    """Whether a one-process run of ``script`` can run in the test's process: a script of the repository with a
    ``main`` (``train.py``, ``eval.py``, ``tools/``), no fault that kills its process, no time limit of its own (a run
    given one may hang by design, or compile at length: its process can be killed) and no other ``subprocess.run``
    option."""
    environment = {**os.environ, **(env_extra or {})}
    return (script in ("train.py", "eval.py") or script.startswith("tools/")) and timeout == RUN_TIMEOUT_S \
        and not kwargs and not any(environment.get(name) for name in KILLING_FAULTS)


def run_in_process(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` as :func:`run_script` runs it, in this process: the script's ``main`` with the
    environment of :func:`subprocess_env` (and ``env_extra``), from the repository root, its stdout and stderr (its
    log lines included) captured, its exit code as a subprocess's. The environment, the working folder, the logging
    set-up and the signal handlers are restored after it, as are DeepSpeed's, Accelerate's and wandb's state."""
    import io
    import logging
    import signal

    script, argv = args[0], list(args[1:])
    if script not in _MAINS:
        _MAINS[script] = script_main(script)
    root, cwd = logging.getLogger(), os.getcwd()
    handlers, level = root.handlers[:], root.level
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    out, err, argv0 = io.StringIO(), io.StringIO(), sys.argv
    # Accelerate's state of an earlier test of this process would be shared with the run
    with distributed_isolated():
        sys.argv = [script, *argv]  # every script's main reads sys.argv when called without arguments
        run_env = {**subprocess_env(), **(env_extra or {})}
        os.environ.clear()
        os.environ.update(run_env)
        os.chdir(ROOT)
        root.handlers = []  # the script's own logging set-up (basicConfig) writes to the captured stderr
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = _MAINS[script]()
                except SystemExit as stop:
                    code = stop.code
                    if not isinstance(code, (int, type(None))):  # a message: Python prints it and exits 1
                        print(code, file=sys.stderr)
                        code = 1
                except Exception:  # a crash: Python prints its traceback and exits 1
                    import traceback

                    traceback.print_exc()
                    code = 1
        finally:
            for handler in root.handlers:
                handler.close()
            root.handlers, root.level = handlers, level
            for sig, handler in signals.items():
                signal.signal(sig, handler)
            os.chdir(cwd)
            sys.argv = argv0
            if "wandb" in sys.modules:  # its settings, read from the run's environment, are kept process-wide
                sys.modules["wandb"].teardown()
    return subprocess.CompletedProcess(["python", *args], int(code or 0), out.getvalue(), err.getvalue())


def script_module(script: str):
    """A script of the repository (``train.py``, ``eval.py``, ``tools/plan.py``) loaded as a module in this process,
    to call its ``main`` without starting an interpreter."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem + "_under_test", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_main(script: str):
    """The ``main`` of :func:`script_module`."""
    return script_module(script).main


def run_train(out_dir: Path, data_dir: Path, overrides: list[str] = (), nproc: int = 1, **kwargs) -> subprocess.CompletedProcess:
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out_dir}", f"data.path={data_dir}", *TINY_OVERRIDES, *overrides]
    return run_script(args, nproc=nproc, **kwargs)


# ------------------------------------------------------------------------------------------- synthetic data
# Data folders written straight in the prepared-folder format (random ids, documents of ``doc_len`` tokens ending
# in EOS 0), so each test controls exactly what the files and meta.json say.

SEQ_LEN = 16
SHORT_DOC_LEN = 13
"""Documents of the ``short_docs`` fixture: windows of 32 tokens hold two or three boundaries."""


EOS = 0


def write_data(folder: Path, n_train: int = 4001, n_val: int = 801, vocab: int = 1000, dtype=np.uint16, seed: int = 0,
               doc_len: int = 50) -> Path:
    from lmrecipe.data.format import INDEX_DTYPE

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for name, n in (("train", n_train), ("val", n_val)):
        ids = rng.integers(1, vocab, size=n).astype(dtype)
        ends = np.append(np.arange(doc_len, n, doc_len), n) if n else np.zeros(0, dtype=np.int64)
        ids[ends - 1] = EOS
        ids.tofile(folder / f"{name}.bin")
        np.concatenate([[0], ends]).astype(INDEX_DTYPE).tofile(folder / f"{name}.idx")
        splits[name] = {"n_tokens": n, "n_documents": len(ends), "max_token_id": int(ids.max()) if n else None,
                        "sha256": ""}
    meta = {"format_version": 2, "tokenizer": "synthetic", "vocab_size": vocab, "eos_id": EOS,
            "dtype": np.dtype(dtype).name, "source": "test", "splits": splits}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


# ---------------------------------------------------------------------------------------------- shared runs

STEPS, HALF = 6, 3
LOSS_TOL = 1e-5  # fp32 on CPU: the bound for a resumed run against an uninterrupted one
TASK_ITEMS = 13  # items of the next_line task the ZeRO-3 pair's first run scores (odd: the 2 ranks' shares differ)
# Each run happens once per session, whichever test module asks first.


def build_docs_site(config_file: Path, site_dir: Path) -> None:
    """``mkdocs build --strict`` of ``config_file`` into ``site_dir``; raises mkdocs' Abort on any warning."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(str(config_file), strict=True, site_dir=str(site_dir)))


def build_once(tmp_path_factory, name: str, build) -> Path:
    """``build(path)`` once per test session, whichever worker asks first; the others wait for it and reuse it.

    ``make test`` runs pytest-xdist workers, each with a base folder of its own inside the session's, which they
    share. A folder whose build failed is removed, so the next test to ask builds it again (and fails with the cause).
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    done = out.parent / f"{name}.done"
    with FileLock(str(out.parent / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            done.touch()
    return out


WSD = ["schedule.decay_steps=6", "checkpoint.every_steps=5", "checkpoint.keep_last=10", "train.eval_every_steps=0"]
"""A warmup-stable-decay run of the tiny model: decay over the last 6 steps, checkpoints every 5 steps, all kept."""


def train_wsd(out_dir: Path, data: Path, *overrides: str) -> Path:
    """Train the tiny model with :data:`WSD` and ``overrides`` in this process (no subprocess); return ``out_dir``."""
    from lmrecipe.config import load_config
    from lmrecipe.train.trainer import train

    train(load_config("recipes/tiny.yaml", [f"out_dir={out_dir}", f"data.path={data}", *TINY_OVERRIDES, *WSD,
                                            *overrides]))
    return out_dir


def wsd_run(tmp_path_factory, data: Path, max_steps: int) -> Path:
    """A :func:`train_wsd` run of ``max_steps``, built once a session (the branch, schedule and averaging tests)."""
    return build_once(tmp_path_factory, f"wsd_{max_steps}",
                      lambda out: train_wsd(out, data, f"train.max_steps={max_steps}"))


def independent_average(checkpoints: list[Path], weights: list[float]) -> dict:
    """Each checkpoint consolidated whole by the export's reader, then averaged in fp32 in the order listed."""
    import torch

    from lmrecipe.export import checkpoint_state_dict

    states = [checkpoint_state_dict(c, torch.float32) for c in checkpoints]
    out = {name: torch.zeros_like(tensor) for name, tensor in states[0].items()}
    for weight, state in zip(weights, states):
        for name, total in out.items():
            total.add_(state[name], alpha=weight)
    return out


def cached_run(tmp_path_factory, name: str, data: Path, overrides: list[str], nproc: int = 1) -> tuple[Path, str]:
    """Train once per session (across workers) into a shared folder ``name``; return the run folder and its stderr."""
    def build(out: Path) -> None:
        proc = run_train(out, data, overrides, nproc=nproc)
        (out / "stderr.txt").write_text(proc.stderr)

    out = build_once(tmp_path_factory, f"runs/{name}", build)
    return out, (out / "stderr.txt").read_text()


def plain_run(tmp_path_factory, data: Path) -> Path:
    """1 process, no DeepSpeed: a checkpoint and an evaluation every step, keep_last=2, fp32 export at the end."""
    out, _ = cached_run(tmp_path_factory, "plain", data, [
        f"train.max_steps={STEPS}", "checkpoint.every_steps=1", "checkpoint.keep_last=2", "train.eval_every_steps=1",
        "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32",
    ])
    return out


def zero_pair(tmp_path_factory, data: Path, stage: int) -> dict:
    """2 processes: run ``a`` trains STEPS steps saving every HALF; run ``b`` resumes from a's step HALF.

    ZeRO-2: both use ds_configs/zero2.json and ``a`` exports at the end. ZeRO-3 (tied embeddings): ``a`` does
    not gather 16-bit weights at save time and scores the next_line task at its last step, ``b`` does gather
    (ds_configs/zero3.json) and exports at the end.
    """
    from lmrecipe.checkpoint.storage import step_dir_name

    export = ["checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32"]
    # The per-layer instruments ride along (their checks: assert_layer_norms_add_up); they do not change the training.
    common = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}", "logging.layer_stats=true", "logging.plots=true"]
    if stage == 2:
        a_extra = ["distributed.deepspeed_config=ds_configs/zero2.json", *export]
        b_extra = ["distributed.deepspeed_config=ds_configs/zero2.json"]
    else:
        def write_no_gather(folder: Path) -> None:
            ds = json.loads((ROOT / "ds_configs/zero3.json").read_text())
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
            folder.mkdir()
            (folder / "zero3.json").write_text(json.dumps(ds))

        no_gather = build_once(tmp_path_factory, "zero3_no_gather", write_no_gather) / "zero3.json"
        # The multiple-choice task is scored at the last step on the live ZeRO-3 model (tests/integration/test_tasks.py).
        a_extra = [f"distributed.deepspeed_config={no_gather}", "model.tie_embeddings=true", "eval.tasks=[next_line]",
                   f"eval.next_line_items={TASK_ITEMS}"]
        b_extra = ["distributed.deepspeed_config=ds_configs/zero3.json", "model.tie_embeddings=true", *export]
    a, _ = cached_run(tmp_path_factory, f"zero{stage}_a", data, common + a_extra, nproc=2)
    source = a / "checkpoints" / step_dir_name(HALF)

    def write_digest(folder: Path) -> None:  # before run b resumes from the source, which must leave it untouched
        folder.mkdir()
        (folder / "digest.json").write_text(json.dumps(tree_digest(source)))

    digest_file = build_once(tmp_path_factory, f"zero{stage}_source_digest", write_digest) / "digest.json"
    b_extra.append(f"checkpoint.resume={source}")
    b, b_stderr = cached_run(tmp_path_factory, f"zero{stage}_b", data, common + b_extra, nproc=2)
    return {"a": a, "b": b, "b_stderr": b_stderr, "source": source, "source_digest": json.loads(digest_file.read_text())}


def losses(out_dir: Path) -> list[tuple[int, float]]:
    from lmrecipe.observe.metrics_log import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def max_loss_diff(resumed: list[tuple[int, float]], reference: list[tuple[int, float]]) -> float:
    ref = dict(reference)
    return max(abs(loss - ref[step]) for step, loss in resumed)


def tree_digest(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def sources_arg(*sources: tuple[Path, float, str | None]) -> str:
    import yaml

    items = [{"path": str(p), "weight": w, **({"name": n} if n else {})} for p, w, n in sources]
    return "data.sources=" + yaml.safe_dump(items, default_flow_style=True).strip()


# The preparation tests' corpus: documents with unusual text, written by ``write_corpus``.
VOCAB = 320


DOCUMENTS = {
    "a.txt": "Hello, world!\nThis is   a test\twith\ttabs.\n\n\nEnd.\n",
    "b.md": "# Título\n\nÜnïcödé: 日本語テキスト, emoji 🙂🚀, math ∑ x² ≠ y.\n  indented  line  \n",
    "c.py": "def f(x):\n\treturn x  +  1\n\n\nclass C:\n    pass\n",
    "d.txt": "windows\r\nline endings\r\n and trailing spaces   ",
    "e.txt": "a document that mentions <|endoftext|> in its text\n",
    "sub/f.txt": "nested folder document; " * 20,
    "sub/g.txt": "  leading spaces and no newline at end",
    "sub/deeper/h.rst": "Heading\n=======\n\n* item one\n* item two\n",
    "i.txt": "the quick brown fox jumps over the lazy dog " * 10,
    "j.txt": "Zeile mit Umlauten: äöüß ÄÖÜ. Ligne française: é è ê à ç.\n",
    # Far bigger than the rest: its chunk finishes last, so a worker pool that returned chunks out of
    # order would show up as a different train.bin.
    "big/k.txt": "".join(f"line {i}: value={i * 7919 % 10007}\n" for i in range(8000)),
}


def write_corpus(root: Path) -> Path:
    for rel, text in DOCUMENTS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    (root / "empty.txt").write_text("   \n")  # whitespace only: skipped
    (root / "image.bin").write_bytes(b"\x00\x01")  # unsupported type inside a folder: skipped
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("hidden folders are skipped")
    return root


def siblings(out_dir: Path) -> list[str]:
    """Leftovers of the atomic write next to ``out_dir`` (temp or set-aside folders)."""
    return sorted(p.name for p in out_dir.parent.iterdir() if p.name.startswith(f"{out_dir.name}."))


def layout(world_size: int, stage: int | None, offload: bool = False):
    """The :class:`lmrecipe.parallel.topology.Topology` of a run on ``world_size`` processes, ZeRO ``stage`` (None: no DeepSpeed)."""
    from lmrecipe.parallel.topology import Topology

    return Topology.from_record({"world_size": world_size, "deepspeed": stage is not None, "zero_stage": stage or 0,
                                 "offload_optimizer": offload})


# ------------------------------------------------------------------------------------------ tracker read-back

def wandb_runs(wandb_dir: Path) -> dict[str, dict]:
    """The runs of a wandb folder's offline files, read back from their record logs (wandb's LevelDB-style format:
    a 7-byte header, 32 KiB blocks of records with a 7-byte header each): ``{run id: {"config": {...},
    "history": {step: row}}}``; sessions of one run id are merged in file order."""
    import struct

    from wandb.proto import wandb_internal_pb2

    def records(path: Path):
        data, pos, block, pending = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if block - pos % block < 7:
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending += chunk
            if kind in (1, 4) and pending:  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                yield record

    runs: dict[str, dict] = {}
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        run = runs.setdefault(path.stem.removeprefix("run-"), {"config": {}, "history": {}})
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                if "_step" in row:
                    run["history"][row["_step"]] = row
    return runs


def metric_rows(out: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of one key of a run's metrics.jsonl."""
    from lmrecipe.observe.metrics_log import read_metrics

    return {r["step"]: r[key] for r in read_metrics(out / "metrics.jsonl") if key in r}


def assert_layer_norms_add_up(out: Path, tol: float = 1e-5) -> None:
    """Every row of a ``logging.layer_stats`` run has every part's figures, and the parts' gradient norms add up (in
    squares) to the logged global pre-clip ``grad_norm`` within ``tol`` (relative)."""
    from lmrecipe.observe.metrics_log import read_metrics

    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert rows, f"no training rows in {out}"
    for row in rows:
        parts = [k.partition("/")[2] for k in row if k.startswith("grad_norm/")]
        assert parts[:2] == ["embed", "block_00"] and "final_norm" in parts, (row["step"], parts)
        assert all(f"param_norm/{p}" in row and row[f"update_ratio/{p}"] > 0 for p in parts), row
        total = sum(row[f"grad_norm/{p}"] ** 2 for p in parts) ** 0.5
        assert abs(total - row["grad_norm"]) <= tol * row["grad_norm"], (row["step"], total, row["grad_norm"])


def assert_same_run(run: Path, reference: Path, tol: float, first_step: int = 1) -> None:
    """Loss, gradient norm and validation loss of ``run`` within ``tol`` (relative above 1) of ``reference``'s, from
    ``first_step`` on, at the same steps."""
    for key in ("loss", "grad_norm", "val_loss"):
        got, want = metric_rows(run, key), metric_rows(reference, key)
        steps = [s for s in want if s >= first_step]
        assert sorted(got) == steps, (key, sorted(got), steps)
        worst = max(abs(got[s] - want[s]) / max(1.0, abs(want[s])) for s in steps)
        assert worst <= tol, f"{key}: {worst:.2e} between {run.name} and {reference.name}"


def rank_pid(out: Path, rank: int) -> int:
    """The pid of rank ``rank`` of the training run writing into ``out`` (read from /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"out_dir={out}".encode() in (proc / "cmdline").read_bytes() \
                    and f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no rank {rank} of {out} is running")


@contextlib.contextmanager
def distributed_isolated():
    """A clean one-process distributed state for what runs inside, torn down after it: no process group, none of the
    groups DeepSpeed caches (they would name a destroyed group), a fresh Accelerate state, and the environment as it
    was (a run sets RANK, WORLD_SIZE, MASTER_*, Accelerate's DeepSpeed settings)."""
    from lmrecipe.parallel.accelerator import release_distributed

    environment = dict(os.environ)
    release_distributed()
    try:
        yield
    finally:
        release_distributed()
        os.environ.clear()
        os.environ.update(environment)


def saved_bytes(hf_config, tokens: int, dtype=None) -> int:
    """Bytes of the tensors the model's forward saves for its backward (weights left out), read with saved-tensor
    hooks on one row of ``tokens`` random ids below 64; ``dtype``: the weights' (default fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype or torch.float32)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            found[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=torch.randint(0, 64, (1, tokens)))
    return sum(found.values())
