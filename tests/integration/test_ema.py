"""Weight EMA: the update's closed form, skipped steps, the swap, checkpoints (no DeepSpeed, ZeRO-3), resume, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import HALF, STEPS, cached_run, losses, plain_run, run_script
from safetensors import safe_open
from safetensors.torch import load_file

from lmrecipe.checkpoint.ema_files import COUNT_KEY, FULL_FILE, partition_file, read_ema_state_dict
from lmrecipe.checkpoint.storage import read_checkpoint, step_dir_name
from lmrecipe.errors import UserError
from lmrecipe.observe.metrics_log import read_metrics

DECAY = 0.5  # a short memory, so that 6 steps leave the average well apart from the weights
EMA_TOL = 1e-6
LOSS_TOL = 1e-5  # fp32 on CPU, as for the export round trips


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path)


def val_rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r}


def export_val_loss(export: Path, data: Path) -> float:
    from transformers import AutoModelForCausalLM

    return model_val_loss(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval(), data)


def model_val_loss(model, data: Path, n_windows: int = 16, seq_len: int = 32) -> float:
    """Loss on the run's validation windows (the same ``ValBatches`` the training run evaluates), in this process."""
    from lmrecipe.data.batches import ValBatches
    from lmrecipe.data.format import TokenWindows
    from lmrecipe.model.loss import causal_lm_loss

    total, count = 0.0, 0.0
    with torch.no_grad():
        for inputs, targets, valid, _ in ValBatches(TokenWindows(data, "val", seq_len), n_windows, 8, 1, 0):
            per_token = causal_lm_loss(model, inputs, targets, "none")
            total += float((per_token.sum(dim=1).double() * valid).sum())
            count += float(valid.sum()) * targets.shape[1]
    return total / count


# ---------------------------------------------------------------------------------------------- one process, no DeepSpeed


EMA_COMMON = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}", "train.eval_every_steps=2",
              f"train.ema_decay={DECAY}"]


@pytest.fixture(scope="module")
def ema_plain(tmp_path_factory, tiny_data) -> Path:
    """6 steps with the EMA, saved every 3, evaluated every 2, exporting the EMA at the end."""
    out, _ = cached_run(tmp_path_factory, "ema_plain_a", tiny_data, EMA_COMMON + [
        "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32", "checkpoint.export_weights=ema"])
    return out


def test_ema_run_logs_saves_and_exports_the_ema(ema_plain, tmp_path_factory, tiny_data):
    a = ema_plain
    # The EMA's evaluations leave training alone: the losses are those of the same run without the EMA.
    assert losses(a) == losses(plain_run(tmp_path_factory, tiny_data))
    rows = val_rows(a)
    assert sorted(rows) == [2, 4, 6] and all(r["val_loss_ema"] != r["val_loss"] for r in rows.values())
    assert f"| validation loss of the weight EMA: final, best | {rows[STEPS]['val_loss_ema']:,.4f}," in (a / "report.md").read_text()
    final = json.loads((a / "final.json").read_text())
    assert final["export_weights"] == "ema" and final["last_val_loss_ema"] == pytest.approx(rows[STEPS]["val_loss_ema"])
    ckpt = a / "checkpoints" / step_dir_name(STEPS)
    assert FULL_FILE in read_checkpoint(ckpt)["manifest"]
    assert load_tensors(ckpt / FULL_FILE)[COUNT_KEY].item() == STEPS
    # The end-of-run export holds the EMA, and its loss is the one the run logged for the EMA.
    export_loss = export_val_loss(a / "export", tiny_data)
    assert export_loss == pytest.approx(rows[STEPS]["val_loss_ema"], abs=LOSS_TOL)
    assert abs(export_loss - rows[STEPS]["val_loss"]) > 1e-3


@pytest.mark.slow
def test_ema_resumes_exactly(ema_plain, tmp_path_factory, tiny_data):
    a = ema_plain
    b, _ = cached_run(tmp_path_factory, "ema_plain_b", tiny_data,
                      EMA_COMMON + [f"checkpoint.resume={a / 'checkpoints' / step_dir_name(HALF)}"])
    uninterrupted = load_tensors(a / "checkpoints" / step_dir_name(STEPS) / FULL_FILE)
    resumed = load_tensors(b / "checkpoints" / step_dir_name(STEPS) / FULL_FILE)
    assert uninterrupted.keys() == resumed.keys() and uninterrupted[COUNT_KEY].item() == STEPS
    diff = max((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted)
    print(f"no DeepSpeed: max |EMA difference| resumed vs uninterrupted = {diff:.3g}")
    assert diff <= EMA_TOL


def test_eval_of_a_checkpoint_ema(ema_plain, tiny_data):
    a = ema_plain
    proc = run_script(["eval.py", str(a / "checkpoints" / step_dir_name(STEPS)), "--data", str(tiny_data),
                       "--max-batches", "2", "--batch-size", "8", "--weights", "ema"])
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["loss"] == pytest.approx(val_rows(a)[STEPS]["val_loss_ema"], abs=LOSS_TOL)


def test_export_of_a_checkpoint_without_ema_is_refused(tmp_path, tmp_path_factory, tiny_data):
    from lmrecipe.export import export_checkpoint

    source = plain_run(tmp_path_factory, tiny_data) / "checkpoints" / step_dir_name(STEPS)
    with pytest.raises(UserError, match="holds no weight EMA"):
        export_checkpoint(source, tmp_path / "out", weights="ema")
    assert not (tmp_path / "out").exists()


def test_resume_from_a_checkpoint_without_ema_starts_it_from_the_weights(tmp_path, tmp_path_factory, tiny_data):
    source = plain_run(tmp_path_factory, tiny_data) / "checkpoints" / step_dir_name(STEPS)
    out, stderr = cached_run(tmp_path_factory, "ema_from_plain", tiny_data, [
        f"train.max_steps={STEPS + 1}", f"train.ema_decay={DECAY}", f"checkpoint.resume={source}"])
    assert "holds no weight EMA" in stderr
    ckpt = out / "checkpoints" / step_dir_name(STEPS + 1)
    ema, raw = load_tensors(ckpt / FULL_FILE), load_tensors(ckpt / "model.safetensors")
    assert ema[COUNT_KEY].item() == 1  # one update since the resume: the average is the weights (bias correction)
    assert all(torch.equal(ema[name], raw[name]) for name in raw)


# ---------------------------------------------------------------------------------------------- ZeRO-3, 2 processes


@pytest.fixture(scope="module")
def ema_zero3(tmp_path_factory, tiny_data) -> tuple[Path, Path]:
    """ZeRO-3 with tied embeddings: ``a`` 6 steps with the EMA saved every 3, evaluated every 2; ``b`` resumes a's step 3."""
    common = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}", "train.eval_every_steps=2",
              f"train.ema_decay={DECAY}", "distributed.deepspeed_config=zero3", "model.tie_embeddings=true"]
    a, _ = cached_run(tmp_path_factory, "ema_zero3_a", tiny_data, common, nproc=2)
    b, _ = cached_run(tmp_path_factory, "ema_zero3_b", tiny_data,
                      common + [f"checkpoint.resume={a / 'checkpoints' / step_dir_name(HALF)}"], nproc=2)
    return a, b


@pytest.mark.slow
def test_zero3_ema_is_partitioned_saved_and_resumed_exactly(ema_zero3):
    a, b = ema_zero3
    ckpt = a / "checkpoints" / step_dir_name(STEPS)
    assert {partition_file(0), partition_file(1)} <= set(read_checkpoint(ckpt)["manifest"])
    assert not (ckpt / FULL_FILE).exists()
    diff = 0.0
    for rank in (0, 1):
        uninterrupted = load_tensors(ckpt / partition_file(rank))
        resumed = load_tensors(b / "checkpoints" / step_dir_name(STEPS) / partition_file(rank))
        assert uninterrupted.keys() == resumed.keys() and uninterrupted[COUNT_KEY].item() == STEPS
        diff = max(diff, *((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted))
        with safe_open(ckpt / partition_file(rank), framework="pt") as fh:
            shapes = json.loads(fh.metadata()["shapes"])
        # A partition, not the whole: each rank holds about half of every parameter.
        name = "model.embed_tokens.weight"
        assert uninterrupted[name].numel() * 2 >= shapes[name][0] * shapes[name][1] > uninterrupted[name].numel()
    print(f"ZeRO-3: max |EMA difference| resumed vs uninterrupted = {diff:.3g}")
    assert diff <= EMA_TOL
    reference = dict(losses(a))
    assert max(abs(loss - reference[step]) for step, loss in losses(b)) <= LOSS_TOL


@pytest.mark.slow
def test_zero3_ema_export_loads_in_transformers_and_gives_the_logged_loss(ema_zero3, tmp_path, tiny_data):
    from transformers import AutoModelForCausalLM

    from lmrecipe.export import export_checkpoint

    a, _ = ema_zero3
    ckpt = a / "checkpoints" / step_dir_name(STEPS)
    run_script(["tools/export_hf.py", str(ckpt), str(tmp_path / "ema"), "--dtype", "fp32", "--weights", "ema"])
    export_checkpoint(ckpt, tmp_path / "raw", dtype="fp32")
    ema_model = AutoModelForCausalLM.from_pretrained(tmp_path / "ema")
    raw_model = AutoModelForCausalLM.from_pretrained(tmp_path / "raw")
    assert ema_model.get_output_embeddings().weight is ema_model.get_input_embeddings().weight  # still tied
    # The consolidated partitions are the export's weights, by name and shape.
    averaged = read_ema_state_dict(ckpt)
    state = ema_model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in averaged.items())
    ids = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        gap = (ema_model(input_ids=ids).logits - raw_model(input_ids=ids).logits).abs().max().item()
    print(f"ZeRO-3: max |logit difference| EMA vs raw export = {gap:.3g}")
    assert gap > 1e-3
    # The losses logged at the last evaluation are those of the exported weights: the EMA's (evaluated by swapping
    # the partitions in) and the trained ones (evaluated after swapping back).
    row = val_rows(a)[STEPS]
    assert export_val_loss(tmp_path / "ema", tiny_data) == pytest.approx(row["val_loss_ema"], abs=LOSS_TOL)
    assert export_val_loss(tmp_path / "raw", tiny_data) == pytest.approx(row["val_loss"], abs=LOSS_TOL)


# ---------------------------------------------------------------------------------------------- ZeRO-2, 2 processes


@pytest.mark.slow
def test_zero2_ema_is_saved_whole_once_and_evaluates_as_logged(tmp_path_factory, tiny_data):
    from lmrecipe.export import load_for_inference

    out, _ = cached_run(tmp_path_factory, "ema_zero2", tiny_data, [
        "train.max_steps=4", "checkpoint.every_steps=4", "train.eval_every_steps=2", f"train.ema_decay={DECAY}",
        "distributed.deepspeed_config=zero2"], nproc=2)
    ckpt = out / "checkpoints" / step_dir_name(4)
    assert FULL_FILE in read_checkpoint(ckpt)["manifest"] and not (ckpt / "ema").exists()
    assert load_tensors(ckpt / FULL_FILE)[COUNT_KEY].item() == 4
    row = val_rows(out)[4]
    for weights, logged in (("ema", row["val_loss_ema"]), ("raw", row["val_loss"])):
        model, _, _ = load_for_inference(ckpt, weights=weights)
        assert model_val_loss(model, tiny_data) == pytest.approx(logged, abs=LOSS_TOL), weights
