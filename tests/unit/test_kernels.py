"""``model.kernels=liger`` is refused at start-up, with the fix, where Liger-Kernel cannot run (a run and its dry
run alike, exit 2, nothing written); where it can, the architecture's patch is called with the rotary, RMSNorm and
SwiGLU kernels on and Liger's loss kernels off; ``auto`` (the default) is Liger only there, for a dense model. TF32
is allowed on a GPU unless ``train.deterministic``. A model created on a device is initialised as on the CPU: the
same weights there, the same distribution per tensor kind."""

from __future__ import annotations

import runpy
import sys

import pytest
import torch
from helpers import ROOT, write_data

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.model import kernels
from lmrecipe.parallel.precision import maybe_allow_tf32

RECIPE = str(ROOT / "recipes" / "tiny.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("kernels") / "data", vocab=384)


@pytest.mark.parametrize("dry", [True, False])
def test_liger_without_a_gpu_exits_2_naming_the_fix_and_writes_nothing(tmp_path, data, monkeypatch, capsys, dry):
    out = tmp_path / "run"
    argv = ["train.py", RECIPE, f"out_dir={out}", f"data.path={data}", "train.max_steps=1", "model.kernels=liger"]
    monkeypatch.setattr(sys, "argv", argv + (["--dry-run"] if dry else []))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "model.kernels=liger runs Liger-Kernel's Triton kernels" in err and "lacks a CUDA GPU" in err
    assert "pip install 'lmrecipe[liger]'" in err and "model.kernels=auto" in err and "model.kernels=none" in err and "Traceback" not in err
    assert not out.exists()


def test_the_refusal_names_only_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_installed", lambda module: module == "triton")
    with pytest.raises(UserError) as err:
        kernels.check_kernels("liger")
    assert "lacks the liger-kernel package (module liger_kernel):" in str(err.value)
    assert "CUDA" not in str(err.value).split("lacks")[1] and "Triton (the" not in str(err.value)
    kernels.check_kernels("none")  # nothing asked, nothing checked


def test_liger_patches_the_architecture_it_has_kernels_for_and_refuses_the_others(monkeypatch):
    calls = []

    def apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=False,
                                    swiglu=False, model=None):
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                          rms_norm=rms_norm, swiglu=swiglu, model=model))

    monkeypatch.setattr(kernels, "_liger_table", lambda: {"llama": apply_liger_kernel_to_llama})
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"model_type": "llama"})()
    assert kernels.maybe_apply_kernels(model, "liger") == ["rope", "rms_norm", "swiglu"]
    assert calls == [dict(rope=True, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True,
                          model=model)]
    assert kernels.maybe_apply_kernels(model, "none") == [] and len(calls) == 1
    with pytest.raises(UserError, match="no kernels for the architecture 'gpt2' \\(it has: llama\\)"):
        kernels.check_kernel_arch("liger", type("Config", (), {"model_type": "gpt2"})())


def test_tf32_is_allowed_on_a_gpu_unless_the_run_is_deterministic(monkeypatch):
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    assert maybe_allow_tf32(False) is False  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        torch.set_float32_matmul_precision("highest")
        assert maybe_allow_tf32(True) is False and torch.get_float32_matmul_precision() == "highest"
        assert maybe_allow_tf32(False) is True and torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_a_model_created_on_a_device_is_initialised_as_on_the_cpu(tmp_path, data):
    from lmrecipe.model.build import build_hf_config, build_model

    cfg = load_config(RECIPE, [f"out_dir={tmp_path}", f"data.path={data}", "model.hidden_size=128",
                               "model.intermediate_size=256", "model.init_std=0.05"])
    hf_config = build_hf_config(cfg.model, 384, cfg.data.seq_len)
    on_cpu = build_model(cfg.model, cfg.train, hf_config)
    on_device = build_model(cfg.model, cfg.train, hf_config, device="cpu")  # the GPU's path, on the device we have
    for (name, a), (_, b) in zip(on_cpu.named_parameters(), on_device.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    kinds = {"matrix": [], "norm": []}
    for name, param in on_device.named_parameters():
        kinds["matrix" if param.ndim == 2 else "norm"].append(param.detach().flatten())
    matrices, norms = torch.cat(kinds["matrix"]), torch.cat(kinds["norm"])
    assert abs(matrices.std().item() - 0.05) < 1e-3 and abs(matrices.mean().item()) < 1e-3
    assert torch.equal(norms, torch.ones_like(norms))


@pytest.mark.parametrize("device, stage, tensor_parallel, autoep, expected", [
    ("cuda:0", 2, 1, False, "cuda:0"), ("cuda:0", 0, 1, False, "cuda:0"), ("cuda:0", 3, 1, False, None),
    ("cuda:0", 1, 2, False, None), ("cuda:0", 2, 1, True, None), ("cpu", 2, 1, False, None)])
def test_the_model_is_created_on_the_gpu_only_where_it_goes_whole(device, stage, tensor_parallel, autoep, expected):
    from types import SimpleNamespace

    from lmrecipe.train.setup import init_device

    topology = SimpleNamespace(zero=SimpleNamespace(stage=stage), tensor_parallel_size=tensor_parallel, autoep=autoep)
    chosen = init_device(torch.device(device), topology)
    assert (None if chosen is None else str(chosen)) == expected


@pytest.mark.parametrize("cuda, installed, model_type, chosen", [
    (True, {"triton", "liger_kernel"}, "llama", "liger"),
    (False, {"triton", "liger_kernel"}, "llama", "none"),
    (True, {"triton"}, "llama", "none"),
    (True, {"liger_kernel"}, "llama", "none"),
    (True, {"triton", "liger_kernel"}, "gpt2", "none"),  # Liger has no kernels for it
])
def test_auto_is_liger_only_where_it_can_run_and_a_hard_request_stays_refused(monkeypatch, cuda, installed,
                                                                                model_type, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(kernels, "_installed", lambda module: module in installed)
    monkeypatch.setattr(kernels, "_liger_table", lambda: {"llama": lambda **kwargs: None})
    assert kernels.resolve_kernels("auto", model_type) == chosen
    assert kernels.resolve_kernels("none", model_type) == "none" and kernels.resolve_kernels("liger", "gpt2") == "liger"
    kernels.check_kernels("auto")  # auto is never refused
    kernels.check_kernel_arch("auto", type("Config", (), {"model_type": model_type})())
    if len(installed) < 2 or not cuda:
        with pytest.raises(UserError, match="model.kernels=liger runs Liger-Kernel"):
            kernels.check_kernels("liger")


def test_auto_patches_the_model_where_liger_runs_and_leaves_it_elsewhere(monkeypatch):
    calls = []

    def apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, model=None):
        calls.append((rope, rms_norm, swiglu))

    monkeypatch.setattr(kernels, "_liger_table", lambda: {"llama": apply_liger_kernel_to_llama})
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"model_type": "llama"})()
    assert kernels.maybe_apply_kernels(model, "auto") == [] and calls == []  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_installed", lambda module: True)
    assert kernels.maybe_apply_kernels(model, "auto") == ["rope", "rms_norm", "swiglu"] and len(calls) == 1


def test_the_default_is_auto():
    assert load_config(RECIPE, []).model.kernels == "auto"
    assert load_config(str(ROOT / "recipes" / "llama_1b.yaml"), []).model.kernels == "auto"


def test_auto_leaves_a_mixture_of_experts_to_transformers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_installed", lambda module: True)
    monkeypatch.setattr(kernels, "_liger_table", lambda: {"qwen3_moe": lambda **kwargs: None})
    assert kernels.resolve_kernels("auto", "qwen3_moe", moe=True) == "none"
    assert kernels.resolve_kernels("auto", "qwen3_moe") == "liger"
