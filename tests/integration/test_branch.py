"""A decay branch from a checkpoint of another layout: ZeRO-2 on 2 processes, branched on 1 process without
DeepSpeed through the topology-free form, which is cached in the branch's folder; the source is left as it was."""

from __future__ import annotations

import json

import pytest
from helpers import HALF, LOSS_TOL, STEPS, losses, max_loss_diff, run_train, tree_digest, zero_pair

from lmrecipe.checkpoint.portable import portable_dir
from lmrecipe.checkpoint.storage import step_dir_name


@pytest.mark.slow
def test_a_branch_from_a_zero2_checkpoint_of_two_processes_trains_on_one(tmp_path, tmp_path_factory, tiny_data):
    pair = zero_pair(tmp_path_factory, tiny_data, 2)
    source = pair["a"] / "checkpoints" / step_dir_name(HALF)
    before = tree_digest(source)
    out = tmp_path / "branch"
    proc = run_train(out, tiny_data, [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}",
                                      f"checkpoint.branch_from={source}"])
    assert f"Branched from {source.resolve()} at step {HALF} on a new layout (processes 2 -> 1; ZeRO-2 -> no " \
           "DeepSpeed)" in proc.stderr
    branched = losses(out)
    assert [step for step, _ in branched] == list(range(HALF + 1, STEPS + 1))
    assert max_loss_diff(branched, losses(pair["a"])) <= LOSS_TOL
    assert tree_digest(source) == before
    assert (portable_dir(source, out / "checkpoints") / "portable.json").is_file()
    meta = json.loads((out / "run_meta.json").read_text())
    assert meta["branched_from"]["step"] == HALF and meta["branched_from"]["checkpoint"] == str(source.resolve())
