"""Decay branches (``checkpoint.branch_from``): a branch from a stable checkpoint trains exactly as the run that
started its decay there, reads its source without writing to it, records where it came from, resumes from its own
checkpoints, and is refused with the fix where it cannot be one.

Run A (WSD, 16 steps, decay from step 10) and run B (24 steps, decay from step 18) are shared with
test_schedule_wsd.py (``build_once``). The topology-free path of a branch (a source of another layout) is tested
here in-process at the level of its cache location; a branch from a 2-process ZeRO-2 checkpoint runs in
tests/integration/test_branch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import metric_rows, script_module, train_wsd, tree_digest, wsd_run

from lmrecipe.config import load_config
from lmrecipe.errors import UserError

def test_a_branch_from_the_stable_phase_trains_exactly_as_the_run_that_decayed_there(
        tmp_path, tmp_path_factory, tiny_data, monkeypatch):
    a, b = wsd_run(tmp_path_factory, tiny_data, 16), wsd_run(tmp_path_factory, tiny_data, 24)
    source = b / "checkpoints" / "step_00000010"
    before = tree_digest(b)
    branch = ["train.max_steps=16", f"checkpoint.branch_from={source}", "checkpoint.export_at_end=true",
              "checkpoint.export_dtype=fp32"]
    # Interrupted at step 16 (after its checkpoint of step 15), then the same command again: it resumes from its own
    # step 15, not from the source.
    monkeypatch.setenv("LMRECIPE_FAULT_OOM_AT_STEP", "16")
    with pytest.raises(UserError, match="out of memory"):
        train_wsd(tmp_path / "c", tiny_data, *branch)
    monkeypatch.delenv("LMRECIPE_FAULT_OOM_AT_STEP")
    c = train_wsd(tmp_path / "c", tiny_data, *branch)

    for key in ("loss", "lr"):
        got, want = metric_rows(c, key), metric_rows(a, key)
        assert sorted(got) == list(range(11, 17))
        assert {s: got[s] for s in got} == {s: want[s] for s in got}, key  # exactly: Δ 0 in fp32
    assert tree_digest(b) == before  # the source run is only read: no file added, changed or pruned
    meta = json.loads((c / "run_meta.json").read_text())
    expected = {"checkpoint": str(source.resolve()), "step": 10, "out_dir": str(b.resolve())}
    assert meta["branched_from"] == expected
    assert [launch["resumed_from"] for launch in meta["launches"]] == [
        str(source.resolve()), str(c / "checkpoints" / "step_00000015")]
    own = json.loads((c / "checkpoints" / "step_00000016" / "train_state.json").read_text())
    assert own["branched_from"] == expected and own["config"]["schedule"]["decay_steps"] == 6
    assert f"branched from: `{source.resolve()}` (step 10 of the run `{b.resolve()}`)" in (c / "report.md").read_text()
    assert f"Branched at step 10 from checkpoint `{source.resolve()}`" in (c / "export" / "README.md").read_text()


def test_a_branch_that_cannot_be_one_is_refused_before_its_first_step(tmp_path, tmp_path_factory, tiny_data):
    b = wsd_run(tmp_path_factory, tiny_data, 24)
    source = b / "checkpoints" / "step_00000010"
    branch = ["train.max_steps=16", f"checkpoint.branch_from={source}"]
    before = tree_digest(b)
    with pytest.raises(UserError, match="model.hidden_size: 64 -> 32.*Branch with the source's settings"):
        train_wsd(tmp_path / "wide", tiny_data, *branch, "model.hidden_size=32")
    with pytest.raises(UserError, match="lies in this run's out_dir.*Choose a new out_dir"):
        train_wsd(b, tiny_data, *branch)
    # A shorter run than the source's step: an earlier checkpoint of the source (before this run's decay) is its fix.
    with pytest.raises(UserError) as err:
        train_wsd(tmp_path / "short", tiny_data, "train.max_steps=10", "schedule.decay_steps=4",
                  f"checkpoint.branch_from={source}")
    assert str(err.value) == (
        f"checkpoint.branch_from={source.resolve()} is at step 10, and the branch's train.max_steps=10 leaves nothing "
        "to train. For a run of 10 steps, branch from a checkpoint of the source at step 6 or earlier (its decay starts "
        f"at step 6): {source.resolve().parent / 'step_00000005'} is one. To train on past step 10, set "
        "train.max_steps above 10 (e.g. 14, the step plus the decay).")
    with pytest.raises(UserError, match="^checkpoint.branch_from=s3://bucket/run/checkpoints/step_00000010 is a URL: "
                                        "a branch reads its source checkpoint from a local folder. Copy the checkpoint"):
        train_wsd(tmp_path / "url", tiny_data, "train.max_steps=16",
                  "checkpoint.branch_from=s3://bucket/run/checkpoints/step_00000010")
    assert not (tmp_path / "url").exists()
    with pytest.raises(UserError, match="does not exist. Pass a checkpoint folder of the run to branch from"):
        train_wsd(tmp_path / "none", tiny_data, "train.max_steps=16", f"checkpoint.branch_from={tmp_path / 'no'}")
    with pytest.raises(UserError, match="a branch starts from its source, then resumes from its own"):
        load_config(None, [f"checkpoint.branch_from={source}", "checkpoint.resume=none"])
    other = train_wsd(tmp_path / "other", tiny_data, "train.max_steps=5", "schedule.decay_steps=2")
    with pytest.raises(UserError, match=r"already holds checkpoints \(step_00000005\) of a run that is not a branch"):
        train_wsd(other, tiny_data, *branch)
    assert tree_digest(b) == before


@pytest.mark.parametrize("names", ["checkpoint", "run"])
def test_a_requeued_branch_resumes_its_own_checkpoints_after_its_source_was_pruned_or_moved_on(
        tmp_path, tmp_path_factory, tiny_data, monkeypatch, names):
    """The source run (a copy of step 10 of run B) prunes that checkpoint and saves step 15 while the branch is
    interrupted; the same command then resumes the branch from its own step 11, whether ``branch_from`` names the
    pruned checkpoint or the source's run folder (whose newest is now step 15)."""
    import shutil

    b = wsd_run(tmp_path_factory, tiny_data, 24)
    source_run = tmp_path / "stable"
    shutil.copytree(b / "checkpoints" / "step_00000010", source_run / "checkpoints" / "step_00000010")
    (source_run / "checkpoints" / "latest").write_text("step_00000010\n")
    named = source_run / "checkpoints" / "step_00000010" if names == "checkpoint" else source_run
    branch = ["train.max_steps=13", "schedule.decay_steps=3", "checkpoint.every_steps=1",
              f"checkpoint.branch_from={named}"]
    monkeypatch.setenv("LMRECIPE_FAULT_OOM_AT_STEP", "12")
    with pytest.raises(UserError, match="out of memory"):
        train_wsd(tmp_path / "decay", tiny_data, *branch)
    monkeypatch.delenv("LMRECIPE_FAULT_OOM_AT_STEP")
    shutil.copytree(b / "checkpoints" / "step_00000015", source_run / "checkpoints" / "step_00000015")
    (source_run / "checkpoints" / "latest").write_text("step_00000015\n")
    shutil.rmtree(source_run / "checkpoints" / "step_00000010")
    c = train_wsd(tmp_path / "decay", tiny_data, *branch)
    meta = json.loads((c / "run_meta.json").read_text())
    assert [launch["resumed_from"] for launch in meta["launches"]] == [
        str((source_run / "checkpoints" / "step_00000010").resolve()), str(c / "checkpoints" / "step_00000011")]
    assert sorted(metric_rows(c, "loss")) == [11, 12, 13]


def test_the_topology_free_form_of_a_branch_source_is_cached_in_the_branch_only(tmp_path):
    from lmrecipe.checkpoint.resume import _portable_target

    source = tmp_path / "run" / "checkpoints" / "step_00000010"
    source.mkdir(parents=True)
    root = tmp_path / "branch" / "checkpoints"
    dest, building, error = _portable_target(source, "digest", root, beside=False)
    assert error is None and Path(dest) == root / "step_00000010.portable" and Path(building).parent == root
    assert sorted(p.name for p in source.parent.iterdir()) == ["step_00000010"]  # nothing written beside the source
    dest, _, _ = _portable_target(source, "digest", tmp_path / "resumed" / "checkpoints")
    assert Path(dest) == source.parent / "step_00000010.portable"  # a resume caches it beside the checkpoint


def test_a_branch_inside_its_source_run_is_refused_before_anything_is_written(tmp_path, capsys):
    """The source run's folder (the parent of its checkpoints/) and everything under it are only read: an out_dir in
    the source checkpoint or beside its checkpoints/ is refused by the run and by the dry run, and nothing is made."""
    source_run = tmp_path / "src"
    checkpoint = source_run / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text("{}")
    (source_run / "checkpoints" / "latest").write_text("step_00000002\n")
    before = sorted(source_run.rglob("*"))
    train_py = script_module("train.py")
    for out, branch_from in ((checkpoint / "mybranch", checkpoint), (source_run / "branch", source_run)):
        refusal = f"out_dir={out} lies inside {source_run.resolve()}, the run folder of checkpoint.branch_from="
        with pytest.raises(UserError, match="Choose an out_dir outside it") as err:
            train_wsd(out, tmp_path / "data", "train.max_steps=16", f"checkpoint.branch_from={branch_from}")
        assert refusal in str(err.value) and f"out_dir={source_run.resolve()}_branch" in str(err.value)
        code = train_py.main(["recipes/tiny.yaml", "--dry-run", f"out_dir={out}", f"data.path={tmp_path / 'data'}",
                              f"checkpoint.branch_from={branch_from}"])
        assert code == 2 and refusal in capsys.readouterr().err
    assert sorted(source_run.rglob("*")) == before
