"""One list of start-up checks (lmrecipe/train/preflight.py): a run and its dry run find the same problems, all at
once, before anything is built or written."""

from __future__ import annotations

import logging

import pytest
from helpers import ROOT, write_data

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.train.dry_run import dry_run
from lmrecipe.train.preflight import preflight
from lmrecipe.train.setup import build_run
from lmrecipe.train.trainer import train

RECIPE = str(ROOT / "recipes" / "tiny.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("preflight") / "data", vocab=384)


def config(tmp_path, data, *overrides):
    return load_config(RECIPE, [f"out_dir={tmp_path / 'run'}", f"data.path={data}", *overrides])


def test_a_run_and_its_dry_run_report_the_same_problems_at_once_and_write_nothing(tmp_path, data, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("WORLD_SIZE", "two")
    cfg = load_config(RECIPE, [f"out_dir={blocker}/run", f"data.path={tmp_path / 'missing'}"])
    found = dry_run(cfg).problems
    assert len(found) == 3, found  # the out_dir under a file, the launcher's WORLD_SIZE, the data
    with pytest.raises(UserError) as err:
        train(cfg)
    message = str(err.value)
    assert message.startswith("3 problems found before the start")
    assert all(problem in message for problem in found)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_model_is_built_from_the_data_only_when_the_data_could_be_read(tmp_path, data):
    missing = preflight(config(tmp_path, tmp_path / "missing"), dry=True)
    assert len(missing.problems) == 1 and "does not exist" in missing.problems[0] and missing.hf_config is None
    found = preflight(config(tmp_path, data), dry=True)
    assert found.problems == [] and found.hf_config.vocab_size == 384 and found.topology.world_size == 1


def test_notes_are_warnings_of_a_run_and_notes_of_its_dry_run(tmp_path, data, caplog):
    cfg = config(tmp_path, data, "train.max_steps=1", "schedule.warmup_steps=5", "data.val_windows=64")
    notes = ["schedule.warmup_steps=5 exceeds train.max_steps=1: the learning rate stops at 0.0004",
             "the validation split holds 6 windows of 128 tokens, fewer than data.val_windows=64"]
    lines = dry_run(cfg).lines
    assert all(any(line.startswith("note: ") and note in line for line in lines) for note in notes), lines
    with caplog.at_level(logging.WARNING):
        build_run(cfg, tmp_path / "run").prefetcher.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert all(sum(note in w for w in warned) == 1 for note in notes), warned



def test_a_model_vocabulary_beyond_the_datas_is_refused_unless_kept_on_purpose(tmp_path, data):
    for dry in (True, False):
        found = preflight(config(tmp_path, data, "model.vocab_size=1024"), dry=dry)
        assert len(found.problems) == 1 and "model.vocab_size=1,024 but" in found.problems[0]
        assert "model.vocab_beyond_data=true" in found.problems[0]
        kept = preflight(config(tmp_path, data, "model.vocab_size=1024", "model.vocab_beyond_data=true"), dry=dry)
        assert kept.problems == [] and kept.hf_config.vocab_size == 1024


@pytest.mark.parametrize("compile_", ["none", "layers"])
def test_fp8_in_eager_mode_is_noted_as_slower_than_bf16(tmp_path, data, compile_):
    lines = dry_run(config(tmp_path, data, "train.precision=fp8", f"train.compile={compile_}")).lines
    noted = [line for line in lines if "fp8 eager ran at 0.558x bf16's tokens/s" in line]
    assert len(noted) == (1 if compile_ == "none" else 0), lines
    assert not noted or noted[0].startswith("note: train.precision=fp8 with train.compile=none: on one H100")
    warned = preflight(config(tmp_path, data, "train.precision=fp8", f"train.compile={compile_}")).notes  # a run's
    assert sum("0.558x bf16's tokens/s" in note for note in warned) == len(noted)
    assert not any("0.558x" in line for line in dry_run(config(tmp_path, data, "train.precision=bf16")).lines)


def test_the_dry_run_says_what_model_kernels_auto_chose(tmp_path, data):
    lines = dry_run(config(tmp_path, data)).lines
    assert "model.kernels=auto: none here (Liger-Kernel needs a CUDA GPU, Triton and " in "\n".join(lines), lines
    assert not any(line.startswith("model.kernels=") for line in dry_run(config(tmp_path, data, "model.kernels=none")).lines)
