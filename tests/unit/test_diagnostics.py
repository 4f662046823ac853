"""Diagnosing a run: profiler, early stopping, determinism, OOM diagnosis, the run report, the container files."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import tomllib
import torch
from helpers import ROOT

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.observe.device import device_utilisation
from lmrecipe.observe.profiler import PREFIX, step_breakdown
from lmrecipe.observe.run_meta import IMAGE_ENV, container_info


def test_breakdown_takes_communication_out_of_its_section():
    def event(name, start, end, thread=1):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                               device_type=torch.autograd.DeviceType.CPU)

    events = [event(PREFIX + "step", 0, 100), event(PREFIX + "forward", 0, 30), event(PREFIX + "backward", 30, 80),
              event("c10d::allreduce_", 70, 90), event("gloo:all_reduce", 40, 60, thread=2),
              event(PREFIX + "optimizer", 85, 95)]
    got = step_breakdown(events)["seconds"]
    micro = {k: round(v * 1e6, 6) for k, v in got.items()}
    # comm 70-90 comes out of backward (70-80) and optimizer (85-90); other = 100 - everything else
    assert micro == {"communication": 20, "forward": 30, "backward": 40, "optimizer": 5, "data": 0, "other": 5}
    assert step_breakdown(events)["overlapped_communication_s"] == pytest.approx(20e-6)


def test_nvml_figures_are_null_off_gpu():
    assert device_utilisation(torch.device("cpu")) == {"gpu_util_pct": None, "gpu_mem_used_gb": None}


def test_early_stopping_needs_a_checkpoint_at_every_evaluation():
    with pytest.raises(UserError, match="checkpoint.every_steps"):
        load_config(ROOT / "recipes" / "tiny.yaml", ["train.early_stopping_patience=2", "train.eval_every_steps=50",
                                                     "checkpoint.every_steps=100"])


# ---------------------------------------------------------------------------------------------- container


def _pins() -> dict:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {name: version for name, _, version in (d.partition("==") for d in deps) if version}
    pins["torch"] = re.search(r"TORCH_SPEC \?= torch==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    return pins


@pytest.mark.parametrize("path", ["Dockerfile", "containers/lmrecipe.def"])
def test_container_files_pin_the_project_versions(path):
    text = (ROOT / path).read_text()
    pins = _pins()
    declared = dict(re.findall(r"^\s*(?:ARG |export )?([A-Z_]+)_VERSION=\"?([\w.]+)\"?", text, re.MULTILINE))
    assert declared["TORCH"] == pins["torch"]
    assert declared["DEEPSPEED"] == pins["deepspeed"]
    assert declared["ACCELERATE"] == pins["accelerate"] and declared["TRANSFORMERS"] == pins["transformers"]
    assert re.fullmatch(r"3\.\d+\.\d+", declared["PYTHON"])  # an exact Python release
    assert re.search(r"(FROM|From:)\s*\S*nvidia/cuda:\d+\.\d+\.\d+-\S+", text)  # a pinned CUDA base image
    assert IMAGE_ENV in text  # the image names itself to run_meta.json
    assert "pip install" in text and "-e ." not in text  # the project itself is installed, not linked


def test_run_meta_records_the_image(monkeypatch):
    monkeypatch.delenv("APPTAINER_CONTAINER", raising=False)
    monkeypatch.delenv("SINGULARITY_CONTAINER", raising=False)
    monkeypatch.setenv(IMAGE_ENV, "lmrecipe:test")
    assert container_info()["image"] == "lmrecipe:test"
    monkeypatch.setenv("APPTAINER_CONTAINER", "/images/lmrecipe.sif")
    assert container_info() == {"image": "lmrecipe:test", "runtime": "apptainer", "sif": "/images/lmrecipe.sif"}
