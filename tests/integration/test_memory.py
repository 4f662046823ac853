"""Memory estimate against DeepSpeed's own estimators; model-state bytes measured from tensors; the CLI."""

import json

from helpers import run_script


def test_estimate_memory_cli(tmp_path):
    proc = run_script(["tools/estimate_memory.py", "recipes/tiny.yaml", "train.global_batch_size=64",
                       "--world-size", "8", "--nodes", "2", "--vocab-size", "1000", "--json"])
    report = json.loads(proc.stdout)
    assert report["world_size"] == 8 and report["precision"] == "bf16"
    assert list(report["configs"]) == ["none", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
    device = {name: c["model_states_device"] for name, c in report["configs"].items()}
    assert device["zero3"] < device["zero2"] < device["none"]

    with_ema = json.loads(run_script(["tools/estimate_memory.py", "recipes/tiny.yaml", "train.global_batch_size=64",
                                      "train.ema_decay=0.999", "--world-size", "8", "--vocab-size", "1000",
                                      "--json"]).stdout)["configs"]
    assert with_ema["zero2"]["ema"] == 4 * report["n_params"] and with_ema["zero3"]["ema"] == 4 * report["n_params"] / 8
    assert report["configs"]["zero2"]["ema"] == 0

    bad = run_script(["tools/estimate_memory.py", "recipes/tiny.yaml", "--world-size", "3"], check=False)
    assert bad.returncode == 2
    assert "global_batch_size" in bad.stderr and "Traceback" not in bad.stderr
