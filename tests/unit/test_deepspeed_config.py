"""What a DeepSpeed JSON may say: the parallel splits are the recipe's (``distributed.*``), so a JSON that sets one is
refused with the recipe key, before any process group or file exists."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import ROOT, TINY_OVERRIDES, write_data

from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.parallel.deepspeed_config import load_deepspeed_config, log_op_compilation, ops_to_compile
from lmrecipe.errors import UserError


def json_with(tmp_path, **sections) -> str:
    ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    path = tmp_path / "custom.json"
    path.write_text(json.dumps({**ds, **sections}))
    return str(path)


@pytest.mark.parametrize("section, fix", [
    ({"sequence_parallel_size": 2}, "set distributed.sequence_parallel_size=2 in the"),
    ({"tensor_parallel": {"autotp_size": 2}}, "set distributed.tensor_parallel_size=2 in the"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "set distributed.expert_parallel_size=N"),
], ids=["sequence_parallel_size", "tensor_parallel", "expert_parallel"])
def test_a_json_that_sets_a_parallel_split_is_refused_with_the_recipe_key(tmp_path, section, fix):
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", TINY_OVERRIDES)
    with pytest.raises(UserError, match=fix) as err:
        load_deepspeed_config(json_with(tmp_path, **section), cfg.optim, cfg.distributed,
                              BatchLayout.from_config(cfg.train, 1), "fp32")
    assert err.value.exit_code == 2 and str(tmp_path / "custom.json") in str(err.value)


def test_a_run_given_such_a_json_writes_nothing(tmp_path):
    from lmrecipe.train.trainer import train

    out = tmp_path / "run"
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"out_dir={out}", f"data.path={write_data(tmp_path / 'data')}", *TINY_OVERRIDES, "train.max_steps=2",
        f"distributed.deepspeed_config={json_with(tmp_path, tensor_parallel={'autotp_size': 1})}"])
    with pytest.raises(UserError, match="set distributed.tensor_parallel_size=1 in the"):
        train(cfg)
    assert not out.exists()


def test_the_ops_deepspeed_is_about_to_compile_are_named_before_the_wait(tmp_path, monkeypatch, caplog):
    # a first launch waited a minute with no output while DeepSpeed compiled its CPU collectives
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="lmrecipe.parallel.deepspeed_config"):
        log_op_compilation(offload_optimizer=True)
    (record,) = caplog.records
    assert "cpu_adam" in record.message and f"cached in {tmp_path}" in record.message
    assert "tools/build_ops.py" in record.message
    compiled = ops_to_compile(offload_optimizer=True)
    for name in compiled:
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmrecipe.parallel.deepspeed_config"):
        log_op_compilation(offload_optimizer=True)
    assert caplog.records == [] and ops_to_compile(offload_optimizer=False) == []
