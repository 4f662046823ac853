"""Checkpoints in one process: RNG round trips, retention, ``checkpoint.resume=auto``, the state record, the extras
saved and restored by name, and a save -> resume round trip through the checkpointer with a stand-in accelerator."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmrecipe.checkpoint.rng import rng_state_tensors, set_rng_state
from lmrecipe.checkpoint.storage import (
    LATEST,
    STATE_FILE,
    find_resume_checkpoint,
    prune_checkpoints,
    step_dir_name,
)
from lmrecipe.errors import UserError

# ---------------------------------------------------------------------------------------------- unit


def test_rng_state_round_trips_through_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    random.gauss(0, 1)  # leave a cached gaussian in the python state
    np.random.standard_normal()
    tensors, metadata = rng_state_tensors()
    save_file(tensors, tmp_path / "rng.safetensors", metadata=metadata)
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], random.gauss(0, 1))
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    with safe_open(tmp_path / "rng.safetensors", framework="pt") as fh:
        set_rng_state({k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata())
    again = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2:] == again[2:]


def fake_checkpoints(root: Path, val_losses: dict[int, float | None]) -> None:
    for step, val_loss in val_losses.items():
        (root / step_dir_name(step)).mkdir(parents=True)
        (root / step_dir_name(step) / STATE_FILE).write_text(json.dumps({"val_loss": val_loss}))


def test_keep_last_prunes_oldest_but_keeps_the_best_apart(tmp_path):
    fake_checkpoints(tmp_path, {1: 5.0, 2: 3.0, 3: None, 4: 4.5, 5: 4.2})
    (tmp_path / ".tmp_step_00000006").mkdir()  # a save in progress is not a checkpoint: never counted or pruned
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == [step_dir_name(1), step_dir_name(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_step_00000006", "best", *map(step_dir_name, (2, 4, 5))]
    assert (tmp_path / "best").read_text().strip() == step_dir_name(2)


def test_resume_auto_follows_latest_or_the_newest_complete_folder(tmp_path):
    assert find_resume_checkpoint("auto", tmp_path) is None
    assert find_resume_checkpoint("none", tmp_path) is None
    fake_checkpoints(tmp_path, {2: None, 4: None})
    (tmp_path / step_dir_name(6)).mkdir()  # no train_state.json: an interrupted save
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / step_dir_name(4)
    (tmp_path / LATEST).write_text(step_dir_name(2) + "\n")
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / step_dir_name(2)
    assert find_resume_checkpoint(str(tmp_path), tmp_path) == tmp_path / step_dir_name(2)  # a checkpoints folder
    (tmp_path / LATEST).write_text(step_dir_name(99) + "\n")
    with pytest.raises(UserError, match=r"latest points to 'step_00000099', which is not a checkpoint folder"):
        find_resume_checkpoint("auto", tmp_path)


# ---------------------------------------------------------------------------------------------- the checkpointer's parts


def test_each_rank_restores_its_own_rng_file_and_a_rank_the_checkpoint_lacks_keeps_its_streams(tmp_path):
    from lmrecipe.checkpoint.rng import restore_rng, rng_file, save_rng

    (tmp_path / "rng").mkdir()
    torch.manual_seed(1)
    save_rng(tmp_path, rank=1)
    expected = torch.rand(4)
    torch.manual_seed(2)
    save_rng(tmp_path, rank=0)  # another rank's streams, in its own file
    restore_rng(tmp_path, rank=1, saved_world_size=2)
    assert torch.equal(torch.rand(4), expected) and rng_file(tmp_path, 1).is_file()
    torch.manual_seed(3)
    fresh = torch.rand(4)
    torch.manual_seed(3)
    restore_rng(tmp_path, rank=2, saved_world_size=2)  # a third process resuming a 2-process run
    assert torch.equal(torch.rand(4), fresh)


class FakeConfig:
    """The part of a transformers config the checkpoint reads."""

    def to_dict(self) -> dict:
        return {"model_type": "fake", "vocab_size": 32, "hidden_size": 8}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict())

    def to_json_file(self, path: Path) -> None:
        Path(path).write_text(self.to_json_string())


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = FakeConfig()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


class FakeAccelerator:
    """One process without DeepSpeed; its own state is the model's weights in ``model.safetensors``."""

    is_main_process, num_processes, process_index, device = True, 1, 0, torch.device("cpu")

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def wait_for_everyone(self) -> None:
        pass

    def unwrap_model(self, model):
        return model

    def save_state(self, folder: str) -> None:
        from safetensors.torch import save_file

        save_file(self.model.state_dict(), Path(folder) / "model.safetensors")

    def load_state(self, folder: str, load_kwargs=None) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(Path(folder) / "model.safetensors"))


class FakeData:
    def __init__(self, folder: Path):
        self.folder = folder
        self.train_batches = SimpleNamespace(order_version=2)

    def probe_ids(self, n_tokens: int) -> torch.Tensor:
        return torch.arange(n_tokens).reshape(1, n_tokens)

    def signature(self) -> dict:
        return {"vocab_size": 32, "tokenizer_sha256": "t" * 64, "order_version": 2}

    def tokenizer_files(self) -> list[Path]:
        return [self.folder / "tokenizer.json"]


class Counter:
    """A loop feature with JSON state and a tensor file: what the weight EMA and the spike guard hand the checkpoint."""

    def __init__(self, name: str, count: int = 0):
        self.name, self.count, self.loaded = name, count, "not called"
        self.weights = torch.full((3,), float(count))

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict | None) -> None:
        self.loaded = state
        self.count = (state or {}).get("count", -1)

    def save_files(self, folder: Path) -> None:
        from safetensors.torch import save_file

        save_file({"weights": self.weights}, folder / f"{self.name}.safetensors")

    def load_files(self, folder: Path) -> None:
        from safetensors.torch import load_file

        self.weights = load_file(folder / f"{self.name}.safetensors")["weights"]


class FilesOnly(Counter):
    """A feature whose state is all in its files (as the weight EMA): nothing of it goes in ``train_state.json``."""

    def state_dict(self) -> dict:
        return {}


def tmp_checkpointer(tmp_path: Path, model: torch.nn.Module, extras, *, resume: str = "auto", optim: dict | None = None):
    from lmrecipe.checkpoint.checkpointer import Checkpointer
    from lmrecipe.checkpoint.record import RunFacts
    from lmrecipe.config import CheckpointConfig
    from lmrecipe.parallel.topology import Topology

    (tmp_path / "tokenizer").mkdir(exist_ok=True)
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    facts = RunFacts(samples_per_step=4, max_steps=10, publish_timeout_s=10, run_config={"optim": optim or {"name": "adamw"}})
    return Checkpointer(CheckpointConfig(every_steps=2, keep_last=2, resume=resume), facts, FakeAccelerator(model),
                        tmp_path / "run", topology=Topology(1), data=FakeData(tmp_path / "tokenizer"),
                        lr_schedule=lambda step: 0.5 / (step + 1), extras=extras)


def trained_state(step: int):
    from lmrecipe.train.state import TrainState

    state = TrainState(step=step, tokens_seen=64 * step, skipped_steps=1)
    state.record_eval(2.5)
    return state


def test_the_state_record_holds_the_state_extras_layout_data_position_and_schedule(tmp_path):
    model = TinyLM()
    checkpointer = tmp_checkpointer(tmp_path, model, [Counter("counter", 7), FilesOnly("ema", 3)])
    state = trained_state(4)
    assert not checkpointer.due(3) and checkpointer.due(4) and checkpointer.due(10)
    path = checkpointer.maybe_save(model, state)
    assert path == tmp_path / "run" / "checkpoints" / step_dir_name(4) and checkpointer.latest == path
    saved = json.loads((path / STATE_FILE).read_text())
    assert saved["state"] == state.state_dict()
    assert saved["extras"] == {"counter": {"count": 7}}  # an empty state is not written
    assert saved["topology"] == {"world_size": 1, "deepspeed": False, "zero_stage": 0, "offload_optimizer": False,
                                 "offload_param": False, "sequence_parallel_size": 1, "tensor_parallel_size": 1,
                                 "expert_parallel_size": 1}
    assert saved["config"] == {"optim": {"name": "adamw"}} and saved["hf_config"] == FakeConfig().to_dict()
    assert saved["val_loss"] == 2.5  # evaluated at this step
    assert saved["data"] == {"next_sample": 16, **FakeData(tmp_path).signature()}
    assert saved["schedule"] == {"last_lr": 0.5 / 4, "next_lr": 0.5 / 5}
    assert {"rng/rank_00000.safetensors", "probe.safetensors", "hf/config.json", "hf/tokenizer.json",
            "counter.safetensors", "ema.safetensors", "model.safetensors"} <= set(saved["manifest"])
    state.step = 6  # evaluated at step 4 only
    assert json.loads((checkpointer.maybe_save(model, state) / STATE_FILE).read_text())["val_loss"] is None


def test_a_resume_restores_weights_state_rng_and_every_extra_by_name(tmp_path):
    from lmrecipe.train.state import TrainState

    model = TinyLM()
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = trained_state(4)
    tmp_checkpointer(tmp_path, model, [Counter("counter", 7), Counter("other", 5)]).maybe_save(model, state)
    after_save = torch.rand(4)
    torch.nn.init.zeros_(model.head.weight)
    counter, other = Counter("counter"), Counter("other")
    checkpointer = tmp_checkpointer(tmp_path, model, [counter, other])
    resumed = TrainState()
    path = checkpointer.maybe_resume(model, None, resumed)
    assert path == str(tmp_path / "run" / "checkpoints" / step_dir_name(4)) and checkpointer.resumed_from == Path(path)
    assert torch.equal(torch.rand(4), after_save)  # every rank's RNG as saved
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved_weights.items())
    assert resumed.state_dict() == state.state_dict()
    assert (counter.count, other.count) == (7, 5) and torch.equal(counter.weights, torch.full((3,), 7.0))
    with pytest.raises(RuntimeError, match="refusing to overwrite"):
        checkpointer.maybe_save(model, resumed)


def test_a_feature_the_checkpoint_holds_nothing_for_gets_none_and_a_checkpoint_before_extras_its_flat_state(tmp_path):
    from lmrecipe.checkpoint.record import StateRecord

    newcomer = Counter("newcomer")
    Counter("newcomer", 9).save_files(tmp_path)
    record = StateRecord(None, None, topology=None, data=None, lr_schedule=None, extras=[newcomer])
    record.restore_extras(tmp_path, {"state": {"step": 4}, "extras": {"counter": {"count": 7}}})
    assert newcomer.loaded is None and newcomer.count == -1
    assert torch.equal(newcomer.weights, torch.full((3,), 9.0))  # its files are loaded all the same
    flat = {"step": 4, "count": 3}
    record.restore_extras(tmp_path, {"state": flat})  # written before extras existed
    assert newcomer.loaded == flat and newcomer.count == 3
    with pytest.raises(ValueError, match="named 'newcomer'"):
        StateRecord(None, None, topology=None, data=None, lr_schedule=None, extras=[newcomer, Counter("newcomer")])


def test_a_resume_with_another_optimizer_is_refused_without_first_logging_it_as_allowed(tmp_path, caplog):
    from lmrecipe.train.state import TrainState

    model = TinyLM()
    tmp_checkpointer(tmp_path, model, [], optim={"name": "muon"}).maybe_save(model, trained_state(4))
    checkpointer = tmp_checkpointer(tmp_path, model, [], optim={"name": "adamw"})
    with caplog.at_level(logging.INFO), \
            pytest.raises(UserError, match="holds muon optimizer state; this run trains with optim.name=adamw"):
        checkpointer.maybe_resume(model, None, TrainState())
    assert "allowed" not in caplog.text and "optim.name" not in caplog.text
    with caplog.at_level(logging.INFO):  # a change that is allowed is still said
        tmp_checkpointer(tmp_path, model, [], optim={"name": "muon", "lr": 0.1}).maybe_resume(model, None, TrainState())
    assert "Resuming with changed settings (allowed): optim.lr: None -> 0.1" in caplog.text


SIGNATURE = {"vocab_size": 384, "dtype": "uint16", "eos_id": 0, "tokenizer_sha256": "a" * 64, "order_version": 2}


def resume_inputs(overrides: list[str]) -> tuple[dict, dict]:
    """A run's resolved config and its model's transformers config, as the checkpoint records them."""
    from lmrecipe.config import load_config
    from lmrecipe.model.build import build_hf_config

    cfg = load_config(None, overrides)
    return cfg.to_dict(), build_hf_config(cfg.model, cfg.model.vocab_size or 384, cfg.data.seq_len).to_dict()


def check_resume(tmp_path: Path, saved_overrides: list[str], overrides: list[str], signature: dict = SIGNATURE) -> None:
    from lmrecipe.checkpoint.compat import check_resume_compatible

    config, hf_config = resume_inputs(saved_overrides)
    saved = {"config": config, "hf_config": hf_config, "data": SIGNATURE, "state": {"step": 3},
             "schedule": {"next_lr": 1e-3}}
    config, hf_config = resume_inputs(overrides)
    check_resume_compatible(saved, tmp_path / "step_3", run_config=config, hf_config=hf_config,
                            data_signature=signature, lr_schedule=lambda step: 1e-3)


def test_a_resume_that_spells_out_what_the_checkpoints_nulls_resolved_to_is_no_change(tmp_path):
    _, resolved = resume_inputs([])
    check_resume(tmp_path, [], [f"model.vocab_size={resolved['vocab_size']}",
                                f"model.num_kv_heads={resolved['num_key_value_heads']}",
                                f"model.max_position_embeddings={resolved['max_position_embeddings']}",
                                f"model.intermediate_size={resolved['intermediate_size']}"])
    check_resume(tmp_path, ["model.num_kv_heads=4"], [])  # and the other way round
    with pytest.raises(UserError, match=r"model.vocab_size: None -> 512; model config vocab_size: 384 -> 512"):
        check_resume(tmp_path, [], ["model.vocab_size=512"])
    with pytest.raises(UserError, match=r"model.num_kv_heads: None -> 2; model config num_key_value_heads: 4 -> 2"):
        check_resume(tmp_path, [], ["model.num_kv_heads=2"])


def test_a_resume_on_data_of_another_tokenizer_says_to_prepare_it_with_the_checkpoints(tmp_path):
    """Not model.init_from=EXPORT: a new run from the weights would be refused on that data too."""
    with pytest.raises(UserError) as err:
        check_resume(tmp_path, [], [], {**SIGNATURE, "tokenizer_sha256": "b" * 64})
    message = str(err.value)
    assert f"data tokenizer.json sha256: '{'a' * 64}' -> '{'b' * 64}'" in message
    assert f"--tokenizer {tmp_path / 'step_3'}/hf --output NEW_DATA, then data.path=NEW_DATA" in message
    assert "model.init_from=EXPORT" not in message


FINISHED_COSINE = ["train.max_steps=300", "optim.lr=2e-3", "optim.min_lr=2e-4", "schedule.warmup_steps=30"]
"""recipes/tiny.yaml's schedule: a cosine decay that reaches its floor, 2e-4, at its last step."""


def resume_at(tmp_path: Path, step: int, saved_overrides: list[str], overrides: list[str], branch: bool = False) -> None:
    """Check a resume at ``step`` of a checkpoint trained with ``saved_overrides`` by a run with ``overrides``, each
    side's rate from its own schedule (``lr_at``), as the checkpointer passes them."""
    from lmrecipe.checkpoint.compat import check_resume_compatible
    from lmrecipe.config import load_config
    from lmrecipe.optim import lr_at

    old, new = load_config(None, saved_overrides), load_config(None, overrides)
    config, hf_config = resume_inputs(saved_overrides)
    saved = {"config": config, "hf_config": hf_config, "data": SIGNATURE, "state": {"step": step},
             "schedule": {"next_lr": lr_at(step, old.train.max_steps, old.optim, old.schedule)}}
    config, hf_config = resume_inputs(overrides)
    check_resume_compatible(saved, tmp_path / f"step_{step}", run_config=config, hf_config=hf_config,
                            data_signature=SIGNATURE, branch=branch,
                            lr_schedule=lambda s: lr_at(s, new.train.max_steps, new.optim, new.schedule))


def test_lengthening_a_finished_cosine_run_is_refused_with_the_ways_on_and_the_key_accepts_it(tmp_path, caplog):
    longer = [*FINISHED_COSINE, "train.max_steps=600"]
    with pytest.raises(UserError) as err:
        resume_at(tmp_path, 300, FINISHED_COSINE, longer)
    message = str(err.value)
    assert "\n" not in message
    assert (f"Cannot resume from {tmp_path / 'step_300'}: this run's schedule (train.max_steps: 300 -> 600) would "
            "train its next step, 300, at learning rate 0.00117198 instead of 0.0002 (as saved, 5.86x)") in message
    assert "resume with the checkpoint's schedule (train.max_steps=300)" in message
    assert "schedule.decay=constant optim.lr=0.0002 with a longer train.max_steps" in message
    assert f"out_dir=NEW_DIR checkpoint.branch_from={tmp_path / 'step_300'})" in message
    assert message.endswith("or accept the jump with checkpoint.allow_lr_change=true.")
    with caplog.at_level(logging.WARNING):
        resume_at(tmp_path, 300, FINISHED_COSINE, [*longer, "checkpoint.allow_lr_change=true"])
    assert ("The learning rate of step 300 changes from 0.0002 (as saved) to 0.00117198 with this run's schedule "
            "(accepted by checkpoint.allow_lr_change=true)") in caplog.text


def test_a_resume_that_keeps_the_rate_continues_and_a_branch_may_change_it(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        # On at the floor the decay reached: a constant schedule at that rate gives step 300 the saved rate.
        resume_at(tmp_path, 300, FINISHED_COSINE,
                  [*FINISHED_COSINE, "train.max_steps=600", "schedule.decay=constant", "optim.lr=2e-4"])
        resume_at(tmp_path, 300, FINISHED_COSINE, [*FINISHED_COSINE, "train.max_steps=301"])  # the floor again
        resume_at(tmp_path, 150, FINISHED_COSINE, FINISHED_COSINE)  # an interrupted run, its own schedule
        resume_at(tmp_path, 300, FINISHED_COSINE, [*FINISHED_COSINE, "train.max_steps=600"], branch=True)
    assert caplog.text == ""
    with pytest.raises(UserError, match=r"\(optim.lr: 0.002 -> 0.001\) would train .*schedule \(optim.lr=0.002\)"):
        resume_at(tmp_path, 150, FINISHED_COSINE, [*FINISHED_COSINE, "optim.lr=1e-3"])  # a new peak mid-decay


def test_a_wsd_run_is_lengthened_in_its_stable_phase_and_refused_in_its_decay_unless_accepted(tmp_path):
    wsd = [*FINISHED_COSINE, "schedule.decay_fraction=0.2"]  # decays over steps 240-299
    resume_at(tmp_path, 200, wsd, [*wsd, "train.max_steps=600"])  # stable: the decay moves to 480-599
    resume_at(tmp_path, 240, wsd, [*wsd, "train.max_steps=600"])  # step 240 not trained yet: still stable
    with pytest.raises(UserError) as err:
        resume_at(tmp_path, 260, wsd, [*wsd, "train.max_steps=600"])
    message = str(err.value)
    assert ("it has trained 20 step(s) of the decay of its warmup-stable-decay schedule (steps 240..299 of "
            "train.max_steps=300), and this run's schedule (train.max_steps: 300 -> 600)") in message
    assert "(train.max_steps=300) to finish the decay, or branch a new run" in message
    assert "from a checkpoint of its stable phase, step 240 or earlier" in message
    assert "schedule.decay=constant" not in message  # a constant rate is no way on for a decay that is to come
    resume_at(tmp_path, 260, wsd, [*wsd, "train.max_steps=600", "checkpoint.allow_lr_change=true"])


def test_a_full_disk_under_safetensors_writer_is_a_user_error_and_the_partial_folder_goes(tmp_path):
    """safetensors reports a full disk as its own SafetensorError (no errno, not an OSError), as Accelerate's
    ``model.safetensors`` of a run without DeepSpeed does: the same message as torch.save's, the folder removed."""
    from safetensors import SafetensorError

    from lmrecipe.checkpoint.saving import Saver
    from lmrecipe.checkpoint.storage import CheckpointStore

    accelerator = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1,
                                  wait_for_everyone=lambda: None)
    store = CheckpointStore(accelerator, tmp_path / "checkpoints", keep_last=2, background=False, deepspeed=False,
                            publish_timeout_s=60)

    def write(model, tmp, final, record):
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    store.write = write
    saver = object.__new__(Saver)
    saver.section, saver.max_steps, saver.store = SimpleNamespace(every_steps=1), 4, store
    saver.record = SimpleNamespace(build=lambda state, model: {})
    saver._probe_logits = lambda model: None
    saver._write_small_files = lambda model, tmp, probe: None
    with pytest.raises(UserError, match="No space left on the device while writing checkpoint step_00000002"):
        saver.maybe_save(None, SimpleNamespace(step=2))
    assert list((tmp_path / "checkpoints").iterdir()) == []
    # another safetensors error (not a full disk, space to spare) stays what it is
    other = SafetensorError("Error while serializing: tensor invalid")
    assert store.disk_full_error(other, tmp_path / "checkpoints" / ".tmp_step_00000003", tmp_path) is None


def test_a_read_only_checkpoints_folder_on_resume_is_refused_before_any_step(tmp_path, monkeypatch):
    """out_dir itself is checked at start-up (cli.check_output_path); a resumed run's checkpoints/ that this user
    cannot write would otherwise fail at the first save, after the steps before it were trained."""
    import lmrecipe.checkpoint.storage as storage

    root = tmp_path / "checkpoints"
    (root / ".tmp_step_00000004").mkdir(parents=True)  # a leftover the store would remove
    real_access = storage.os.access
    monkeypatch.setattr(storage.os, "access", lambda p, mode: False if Path(p) == root else real_access(p, mode))
    accelerator = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1,
                                  wait_for_everyone=lambda: None)
    with pytest.raises(UserError, match=r"checkpoints cannot be written: that folder is read-only.*chmod u\+w"):
        storage.CheckpointStore(accelerator, root, keep_last=2, background=False, deepspeed=False,
                                publish_timeout_s=60)
    assert [p.name for p in root.iterdir()] == [".tmp_step_00000004"]
