"""Hugging Face exports (fresh-process round trip, ZeRO-2/3, tied embeddings, bf16), eval.py, and their bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import HALF, STEPS, plain_run, run_script, zero_pair

from lmrecipe.checkpoint.storage import LATEST, STATE_FILE, step_dir_name
from lmrecipe.errors import UserError
from lmrecipe.observe.metrics_log import read_metrics

FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (relative rounding 2^-9 per weight); through two layers that moved logits of
# magnitude ~1 by 0.002-0.005 here. The bound allows about 5 bf16 epsilons at the logits' scale.
BF16_TOL = 2e-2

# Runs in a fresh interpreter: nothing of the training process (DeepSpeed config, patched modules) is alive.
FRESH_PROCESS_CHECK = """
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
results = []
for export, probe_file in zip(sys.argv[1::2], sys.argv[2::2]):
    probe = load_file(probe_file)  # input ids and the training-time model's logits, saved in the checkpoint
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
    text = "def f(x):\\n    return x + 1\\n"
    results.append({
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_abs_diff": (logits - probe["logits"]).abs().max().item(),
        "logit_scale": probe["logits"].abs().max().item(),
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "tokenizer_round_trip": tokenizer.decode(tokenizer(text).input_ids) == text,
        "eos_token_id": model.generation_config.eos_token_id,
    })
print(json.dumps(results))
"""


def fresh_process_check(cases: dict[str, tuple[Path, Path]]) -> dict[str, dict]:
    """{name: (export folder, checkpoint whose probe it must reproduce)} -> measurements from a new process."""
    args = [str(p) for export, ckpt in cases.values() for p in (export, ckpt / "probe.safetensors")]
    proc = run_script(["-c", FRESH_PROCESS_CHECK, *args])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: {**result, "path": cases[name][0]} for name, result in zip(cases, results)}


def assert_export_folder(path: Path, min_shards: int = 1) -> None:
    files = sorted(p.name for p in path.iterdir())
    shards = [f for f in files if f.startswith("model-")]
    n = len(shards)
    assert n >= min_shards and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(files)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)


def assert_round_trip(result: dict, dtype: str, tied: bool) -> None:
    assert result["dtype"] == dtype and result["tied"] is tied
    assert result["tokenizer_round_trip"] and result["eos_token_id"] == 0  # the data's <|endoftext|>
    tol = FP32_TOL if dtype == "float32" else BF16_TOL * max(1.0, result["logit_scale"])
    assert result["max_abs_diff"] <= tol, result


def eval_json(proc) -> dict:
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_data) -> Path:
    return plain_run(tmp_path_factory, tiny_data)


# ---------------------------------------------------------------------------------------------- no DeepSpeed


def test_end_of_run_export_round_trip_in_a_fresh_process(plain):
    assert_export_folder(plain / "export")
    result = fresh_process_check({"plain": (plain / "export", plain / "checkpoints" / step_dir_name(STEPS))})["plain"]
    print(f"no DeepSpeed fp32 export: max |logit difference| = {result['max_abs_diff']:.3g}")
    assert_round_trip(result, "float32", tied=False)


def test_the_export_has_a_model_card_with_the_runs_figures(plain, tiny_data):
    import yaml

    text = (plain / "export" / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"causal-lm", "llama", "lmrecipe"} <= set(meta["tags"])
    source = json.loads((tiny_data / "meta.json").read_text())["source"]  # the corpus folder it was prepared from
    assert "datasets" not in meta and f"- {source} (`{tiny_data}`)" in body  # a local folder is no Hub dataset name
    rows = read_metrics(plain / "metrics.jsonl")
    loss = [r["loss"] for r in rows if "loss" in r][-1]
    val_loss = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    assert f"| training loss (step {STEPS}) | {loss:.4f} |" in body
    assert f"| validation loss (step {STEPS}) | {val_loss:.4f} |" in body
    n_params = json.loads((plain / "run_meta.json").read_text())["n_params"]
    assert f"{n_params:,} parameters" in body and f"{STEPS} optimizer steps" in body
    assert "train.py" in body and "AutoModelForCausalLM.from_pretrained" in body
    # transformers loads the folder with the card in it: test_end_of_run_export_round_trip_in_a_fresh_process


def test_eval_of_a_checkpoint_reproduces_the_training_validation_loss(plain, tiny_data, tiny_shards):
    # 2 batches of 8 = the run's 16 validation windows (data.val_windows=16 in the tiny overrides); the same corpus
    # prepared as 3 shards alongside, which holds the same validation windows.
    proc = run_script(["eval.py", str(plain / "checkpoints" / step_dir_name(STEPS)), "--data", str(tiny_data),
                       str(tiny_shards), "--max-batches", "2", "--batch-size", "8"])
    result = eval_json(proc)
    val_loss = [r["val_loss"] for r in read_metrics(plain / "metrics.jsonl") if r.get("step") == STEPS and "val_loss" in r][-1]
    assert result["loss"] == pytest.approx(val_loss, rel=1e-6) and result["tokens"] == 2 * 16 * 32
    assert result["sources"][tiny_shards.name]["loss"] == result["sources"][tiny_data.name]["loss"]
    assert result["perplexity"] == pytest.approx(2.718281828459045 ** result["loss"])


@pytest.fixture
def export_copy(tmp_path, plain) -> Path:
    copy = tmp_path / "export"
    shutil.copytree(plain / "export", copy)
    return copy


def test_export_without_config_json_is_refused(export_copy, tiny_data):
    from lmrecipe.export import load_for_inference

    (export_copy / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json"):
        load_for_inference(export_copy)
    proc = run_script(["eval.py", str(export_copy), "--data", str(tiny_data)], check=False)
    assert proc.returncode == 2 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_export_with_a_missing_or_truncated_shard_is_refused(export_copy):
    from lmrecipe.export import check_export

    shard = export_copy / "model-00001-of-00001.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(UserError, match="truncated"):
        check_export(export_copy)
    shard.unlink()
    with pytest.raises(UserError, match="model-00001-of-00001.safetensors, listed in model.safetensors.index.json, is missing"):
        check_export(export_copy)


def test_export_tool_refuses_bad_checkpoints_and_occupied_folders(tmp_path, plain):
    from lmrecipe.export import export_checkpoint

    source = plain / "checkpoints" / step_dir_name(STEPS)
    with pytest.raises(UserError, match="already exists and is not empty"):
        export_checkpoint(source, plain / "export")
    with pytest.raises(UserError, match="inside the checkpoint"):
        export_checkpoint(source, source / "export")
    with pytest.raises(UserError, match="'5GiB' is not a size"):
        export_checkpoint(source, tmp_path / "out", max_shard_size="5GiB")
    incomplete = tmp_path / "incomplete"
    shutil.copytree(source, incomplete)
    (incomplete / STATE_FILE).unlink()
    with pytest.raises(UserError, match="has no train_state.json"):
        export_checkpoint(incomplete, tmp_path / "out")
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / LATEST).write_text("step_00000042\n")
    proc = run_script(["tools/export_hf.py", str(run.parent), str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "points to 'step_00000042'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- ZeRO-2 / ZeRO-3, 2 processes


@pytest.fixture(scope="module")
def zero_exports(tmp_path_factory, tiny_data) -> dict[str, dict]:
    from lmrecipe.export import export_checkpoint

    z2, z3 = zero_pair(tmp_path_factory, tiny_data, 2), zero_pair(tmp_path_factory, tiny_data, 3)
    out = tmp_path_factory.mktemp("exports")
    step3, step6 = step_dir_name(HALF), step_dir_name(STEPS)
    # In this (DeepSpeed-free) process, and through the tool given a run folder, which exports its newest checkpoint.
    export_checkpoint(z2["a"] / "checkpoints" / step3, out / "zero2_bf16", dtype="bf16", max_shard_size="100KB")
    run_script(["tools/export_hf.py", str(z3["a"]), str(out / "zero3_fp32"), "--dtype", "fp32"])
    return fresh_process_check({
        "zero2 end of run fp32": (z2["a"] / "export", z2["a"] / "checkpoints" / step6),
        "zero2 tool bf16 sharded": (out / "zero2_bf16", z2["a"] / "checkpoints" / step3),
        "zero3 tool fp32 not gathered at save": (out / "zero3_fp32", z3["a"] / "checkpoints" / step6),
        "zero3 end of run fp32 gathered at save": (z3["b"] / "export", z3["b"] / "checkpoints" / step6),
    })


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2 end of run fp32", "zero2 tool bf16 sharded", "zero3 tool fp32 not gathered at save",
                                  "zero3 end of run fp32 gathered at save"])
def test_zero_export_round_trip_in_a_fresh_process(zero_exports, name):
    result = zero_exports[name]
    print(f"{name}: max |logit difference| = {result['max_abs_diff']:.3g} (logits up to {result['logit_scale']:.3g})")
    assert_export_folder(result["path"], min_shards=3 if "sharded" in name else 1)
    assert_round_trip(result, "bfloat16" if "bf16" in name else "float32", tied=name.startswith("zero3"))


@pytest.mark.slow
def test_eval_on_1_and_2_processes_gives_the_same_perplexity(tmp_path, tmp_path_factory, tiny_data, zero_exports):
    checkpoint = zero_pair(tmp_path_factory, tiny_data, 3)["a"] / "checkpoints" / step_dir_name(STEPS)
    export = zero_exports["zero3 tool fp32 not gathered at save"]["path"]  # the same weights, exported
    args = ["--data", str(tiny_data), "--max-batches", "5", "--batch-size", "8"]
    two = run_script(["eval.py", str(checkpoint), *args, "--output", str(tmp_path / "two.json")], nproc=2)
    one = run_script(["eval.py", str(export), *args, "--generate", "def ", "--max-new-tokens", "12"])
    r2, r1 = eval_json(two), eval_json(one)
    print(f"eval perplexity: 1 process {r1['perplexity']!r}, 2 processes {r2['perplexity']!r}")
    assert json.loads((tmp_path / "two.json").read_text()) == r2
    assert r1["tokens"] == r2["tokens"] == 5 * 8 * 32
    assert r1["perplexity"] == pytest.approx(r2["perplexity"], rel=1e-6)
    assert r1["prompt"] == "def " and r1["continuation"] and (r1["prompt"] + r1["continuation"]) in one.stdout


@pytest.mark.slow
def test_export_tool_refuses_a_truncated_zero_shard(tmp_path, tmp_path_factory, tiny_data):
    source = zero_pair(tmp_path_factory, tiny_data, 2)["a"] / "checkpoints" / step_dir_name(STEPS)
    damaged = tmp_path / "ckpt"
    shutil.copytree(source, damaged)
    shard = next((damaged / "pytorch_model").glob("*optim_states.pt"))
    os.truncate(shard, shard.stat().st_size // 2)
    proc = run_script(["tools/export_hf.py", str(damaged), str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"pytorch_model/{shard.name} holds" in proc.stderr and "truncated" in proc.stderr
