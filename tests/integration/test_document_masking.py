"""Document masking: boundaries from the index, per-document equivalence of loss and gradients, no host syncs,
and clear refusals for the attention paths that cannot mask."""

from __future__ import annotations

import json

import pytest
from helpers import HALF, LOSS_TOL, STEPS, assert_layer_norms_add_up, losses, max_loss_diff, run_script, run_train

from lmrecipe.observe.metrics_log import read_metrics

# ---------------------------------------------------------------------------------------------- whole runs
# The short_docs fixture (conftest.py): every window holds two or three document boundaries, so a run that trained
# across documents could not give the masked losses.

@pytest.fixture(scope="module")
def masked_runs(tmp_path_factory, short_docs):
    """Runs of 6 steps on the short documents, once per module: {name: (run folder, [(step, loss)])}."""
    root = tmp_path_factory.mktemp("masked_runs")
    cache = {}

    def get(name: str, overrides: tuple[str, ...] = (), nproc: int = 1, check: bool = True):
        if name not in cache:
            out = root / name
            proc = run_train(out, short_docs, [f"train.max_steps={STEPS}", *overrides], nproc=nproc, check=check)
            cache[name] = (out, losses(out) if proc.returncode == 0 else proc)
        return cache[name]

    return get


def test_a_masked_run_trains_on_documents_and_its_validation_matches_eval(masked_runs, short_docs):
    """The run masks (its losses differ from the unmasked run's from the first step on: every window holds
    boundaries), and ``eval.py`` on its export gives the run's last validation loss with masking, another without."""
    out, masked = masked_runs("masked", ("train.eval_every_steps=6", "checkpoint.export_at_end=true",
                                         "checkpoint.export_dtype=fp32"))
    _, plain = masked_runs("plain", ("data.document_masking=false",))
    assert len(masked) == STEPS and all(abs(a - b) > 1e-4 for (_, a), (_, b) in zip(masked, plain))
    val_loss = [r for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r][-1]["val_loss"]
    evaluated = {}
    for flag in ([], ["--no-document-masking"]):
        result = out / f"eval{len(flag)}.json"
        run_script(["eval.py", str(out / "export"), "--data", str(short_docs), "--seq-len", "32",
                    "--max-batches", "2", "--output", str(result), *flag])
        evaluated[bool(flag)] = json.loads(result.read_text())
    assert evaluated[False]["document_masking"] is True and evaluated[True]["document_masking"] is False
    assert abs(evaluated[False]["loss"] - val_loss) <= 1e-5 * max(1.0, val_loss)
    assert abs(evaluated[True]["loss"] - val_loss) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("ds", ["zero1", "zero3"])
def test_zero_stages_on_two_processes_agree_with_one_process_under_masking(masked_runs, ds):
    # The mask lives in the forward: ZeRO-1 (partitioned optimizer) and ZeRO-3 (partitioned, gathered parameters)
    # bracket it; ZeRO-2 differs from ZeRO-1 only in the gradients' partitioning.
    _, reference = masked_runs("masked-plain-1", ())
    # The per-layer instruments ride along: they do not change the training, and their norms add up under each stage.
    out, two = masked_runs(f"masked-{ds}-2", (f"distributed.deepspeed_config=ds_configs/{ds}.json",
                                              "logging.layer_stats=true"), nproc=2)
    assert max_loss_diff(two, reference) <= LOSS_TOL
    assert_layer_norms_add_up(out)


@pytest.mark.slow
def test_a_masked_resume_is_exact_and_masking_is_fixed_on_resume(masked_runs, tmp_path):
    out, reference = masked_runs("masked-every-3", ("checkpoint.every_steps=3",))
    source = out / "checkpoints" / "step_00000003"
    _, resumed = masked_runs("masked-resumed", (f"checkpoint.resume={source}",))
    assert [s for s, _ in resumed] == list(range(HALF + 1, STEPS + 1))
    assert max_loss_diff(resumed, reference) <= LOSS_TOL
    plain_out, _ = masked_runs("plain", ("data.document_masking=false",))
    unmasked = plain_out / "checkpoints" / f"step_{STEPS:08d}"
    _, refused = masked_runs("masking-turned-on", (f"checkpoint.resume={unmasked}", f"train.max_steps={STEPS + 2}"),
                             check=False)
    assert refused.returncode == 2 and "data.document_masking: False -> True" in refused.stderr
    assert "Traceback" not in refused.stderr
