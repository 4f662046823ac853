"""The third-party lines filtered by default (``lmrecipe/observe/quiet.py``): each row drops its line and no other,
and verbose shows them all."""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import pytest

from lmrecipe.cli import cli_main
from lmrecipe.observe import quiet as quiet_module
from lmrecipe.observe.quiet import QUIET_LINES, VERBOSE_ENV, quiet, quiet_prints

# A line each row drops, as the library writes it (observed on this project's machines).
OBSERVED = {
    "torchao": "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load "
               "this library: /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so",
    "torchao.kernel.intmm": "Warning: Detected no triton, on systems without Triton certain kernels will not work",
    "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                           "torch.compile as an opaque value type. Calling register_constant() on Enum subclasses is "
                           "deprecated and will be an error in a future release.",
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    "accelerate.accelerator": "[RANK 0] Saving current state to /runs/tiny/checkpoints/.tmp_step_00000020",
    "accelerate.checkpointing": "[RANK 0] Optimizer state saved in /runs/tiny/checkpoints/.tmp_step_00000020/optimizer.bin",
    "botocore.credentials": "Found credentials in environment variables.",
}
# More lines of the same rows (a resume's, a DeepSpeed save's).
ALSO_DROPPED = {
    "accelerate.accelerator": ["[RANK 0] Loading states from /runs/tiny/checkpoints/step_00000020",
                               "[RANK 0] Loading in 0 custom states",
                               "[RANK 0] Saving DeepSpeed Model and Optimizer",
                               "[RANK 0] DeepSpeed Model and Optimizer saved to output dir /runs/tiny/pytorch_model"],
    "accelerate.checkpointing": ["[RANK 0] All model weights loaded successfully",
                                 "[RANK 0] All random states loaded successfully",
                                 "[RANK 0] Random states saved in /runs/tiny/random_states_0.pkl"],
}
# Lines from the same sources that say something about the run: they pass.
KEPT = {
    "torchao": "Skipping import of cpp extensions due to incompatible torch version. Please upgrade to torch >= 2.11.0",
    "DeepSpeed": "Setting ds_accelerator to cuda (auto detect)",
    "accelerate.accelerator": "Gradient accumulation steps mismatch: 2 != 4",
}
PRINTED = [
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n",
    "Processing zero checkpoint '/runs/tiny/checkpoints/step_00000020/pytorch_model'\n",
    "Reconstructed fp32 state dict with 39 params 2950272 elements\n",
    "\rWriting model shards:   0%|          | 0/1 [00:00<?, ?it/s]",
    "\rWriting model shards: 100%|##########| 1/1 [00:00<00:00, 357.14it/s]",
    "\n",
]


@pytest.fixture
def captured(monkeypatch):
    """Records reaching a handler on each filtered logger; the filters removed again afterwards, and ``$LMRECIPE_VERBOSE``
    as it was (``quiet(verbose=True)`` sets it: left set, every later run of the worker would show every line)."""
    monkeypatch.setenv(VERBOSE_ENV, "")  # records the caller's value, or its absence, to restore
    monkeypatch.delenv(VERBOSE_ENV)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(row.source) for row in QUIET_LINES if row.kind == "logger"]
    saved = {logger: (list(logger.filters), logger.propagate, logger.level) for logger in loggers}
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    saved_warnings = list(warnings.filters)
    yield records
    for logger, (filters, propagate, level) in saved.items():
        logger.removeHandler(handler)
        logger.filters[:] = filters
        logger.propagate, logger.level = propagate, level
    warnings.filters[:] = saved_warnings


def emit_all() -> None:
    for name, message in OBSERVED.items():
        logging.getLogger(name).warning("%s", message)
    for name, messages in ALSO_DROPPED.items():
        for message in messages:
            logging.getLogger(name).info(message)
    for name, message in KEPT.items():
        logging.getLogger(name).warning(message)


def test_every_logger_row_drops_its_observed_line_and_passes_the_others(captured):
    assert {row.source for row in QUIET_LINES if row.kind == "logger"} == set(OBSERVED)
    quiet()
    emit_all()
    assert sorted(r.getMessage() for r in captured) == sorted(KEPT.values())


def test_verbose_shows_every_line(captured, monkeypatch):
    quiet()
    quiet(verbose=True)  # logging.verbose=true, once the config is read
    emit_all()
    shown = len(OBSERVED) + sum(map(len, ALSO_DROPPED.values())) + len(KEPT)
    assert len(captured) == shown
    assert quiet_module.verbose_from_env()  # the printed lines follow too
    monkeypatch.delenv(VERBOSE_ENV)
    quiet()
    emit_all()
    assert len(captured) == shown + len(KEPT)


def test_the_environment_variable_shows_every_line(captured, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    quiet()  # as setup_logging calls it, before any config is read
    emit_all()
    assert len(captured) == len(OBSERVED) + sum(map(len, ALSO_DROPPED.values())) + len(KEPT)


def test_warning_rows_drop_their_warning_only(captured):
    quiet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet()  # catch_warnings reset the filters: install again inside
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                      "`torch.distributed.reduce_scatter_single` instead.", FutureWarning)
        warnings.warn("`torch.foo` is deprecated.", FutureWarning)
    assert [str(w.message) for w in caught] == ["`torch.foo` is deprecated."]
    quiet(verbose=True)
    assert not any(getattr(f[1], "pattern", "").startswith("`torch\\.distributed") for f in warnings.filters)


def test_a_tool_that_sets_up_no_logging_drops_the_lines_too(captured):
    for row in QUIET_LINES:  # as in a fresh process: no filter installed yet
        if row.kind == "logger":
            logger = logging.getLogger(row.source)
            logger.filters[:] = [f for f in logger.filters if not isinstance(f, quiet_module.QuietFilter)]

    @cli_main
    def tool() -> int:  # tools/estimate_memory.py imports torchao inside its main
        emit_all()
        return 0

    assert tool() == 0
    assert sorted(r.getMessage() for r in captured) == sorted(KEPT.values())


def test_printed_lines_are_dropped_and_the_rest_kept(monkeypatch, capsys):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    out = io.StringIO()
    with quiet_prints(stdout=out):
        for text in PRINTED:
            print(text, end="")
        print("a line of the caller's")
    assert out.getvalue() == "a line of the caller's\n"
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with quiet_prints(stdout=out):
        print(PRINTED[0], end="")
    assert out.getvalue().endswith(PRINTED[0])


def test_torchao_binaries_are_skipped_only_where_none_can_load(tmp_path, monkeypatch):
    torchao, torch = tmp_path / "torchao", tmp_path / "torch"
    (torch / "lib").mkdir(parents=True)
    torchao.mkdir()
    (torchao / "_C_mxfp8.cpython-27-x86_64-linux-gnu.so").write_bytes(b"\x7fELF libtorch.so")
    (torchao / "_C_cutlass_90a.abi3.so").write_bytes(b"\x7fELF libtorch_cuda.so libcudart.so.13")

    class Spec:
        def __init__(self, folder: Path):
            self.origin = str(folder / "__init__.py")

    monkeypatch.setattr(quiet_module.importlib.util, "find_spec",
                        lambda name: Spec(torchao if name == "torchao" else torch))
    assert quiet_module.torchao_extensions_unloadable()  # a CPU torch: the CUDA one cannot load either
    monkeypatch.delenv(quiet_module.TORCHAO_SKIP_ENV, raising=False)
    quiet_module.maybe_skip_torchao_extensions()
    assert quiet_module.os.environ[quiet_module.TORCHAO_SKIP_ENV] == "1"
    (torch / "lib" / "libtorch_cuda.so").write_bytes(b"")
    assert not quiet_module.torchao_extensions_unloadable()  # with CUDA, the abi3 binary loads
