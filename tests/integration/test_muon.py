"""optim.name=muon under DeepSpeed ZeRO-3 on 2 CPU processes: the same losses as without DeepSpeed, and a resume
on another layout refused with exit code 2."""

from __future__ import annotations

import pytest
from helpers import losses, run_train

MUON = ["optim.name=muon", "optim.grad_clip=0", "train.max_steps=3", "checkpoint.every_steps=3",
        "train.eval_every_steps=0"]
# Muon's Newton-Schulz kernels are torch.compiled by DeepSpeed; eager gives the same numbers without a cold-cache
# compile of every matrix shape in every process (minutes on this CPU).
EAGER = {"TORCH_COMPILE_DISABLE": "1"}


@pytest.mark.slow
def test_muon_under_zero3_matches_no_deepspeed_and_refuses_a_layout_change(tmp_path, tiny_data):
    plain, zero3 = tmp_path / "plain", tmp_path / "zero3"
    run_train(plain, tiny_data, MUON, env_extra=EAGER)
    run_train(zero3, tiny_data, [*MUON, "distributed.deepspeed_config=zero3"], nproc=2, env_extra=EAGER)
    reference = dict(losses(plain))
    got = losses(zero3)
    assert [s for s, _ in got] == [1, 2, 3]
    # Muon's Newton-Schulz runs in fp32 on this CPU in both; the ZeRO-3 reduction order differs.
    assert max(abs(loss - reference[s]) for s, loss in got) <= 1e-4, (got, reference)

    proc = run_train(tmp_path / "moved", tiny_data, [*MUON, "train.max_steps=4",
                                                     f"checkpoint.resume={zero3}/checkpoints/step_00000003"],
                     check=False, env_extra=EAGER)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot be converted" in proc.stderr and "Traceback" not in proc.stderr
