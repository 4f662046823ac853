"""The trainer's callback protocol: the order of the hooks, stops, rollbacks, errors, and state saved by name.

The protocol tests drive :class:`Trainer` with a fake step (its two halves, no model, no process); the last tests
train a tiny model in-process: a callback's state and files go into the real checkpoint and come back on resume, and
``pre_optim_step`` sees the step's gradients whole, before the update.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.train import trainer as trainer_module
from lmrecipe.train.callback import Callback, Stop
from lmrecipe.train.step import Gradients, StepResult
from lmrecipe.train.trainer import Trainer

HOOKS = ("on_start", "before_step", "pre_optim_step", "after_step", "at_sync", "on_step_end", "eval_figures",
         "after_eval", "on_save", "after_rollback", "on_stop", "on_end", "on_close")


class Recorder(Callback):
    """Writes (its name, the hook, the step) into a shared log at every hook; the sync points are ``sync_steps``."""

    def __init__(self, name: str, log: list, sync_steps=()):
        self.label, self.log, self.sync_steps = name, log, set(sync_steps)

    def needs_sync(self, trainer, step):
        return step in self.sync_steps

    def __getattribute__(self, attr):
        if attr in HOOKS:
            def hook(trainer, *args):
                self.log.append((self.label, attr, trainer.state.step))
                return {"at_sync": False, "eval_figures": {}}.get(attr)
            return hook
        return super().__getattribute__(attr)


class FakeAccelerator:
    num_processes, is_main_process, process_index = 1, True, 0

    def __init__(self):
        self.ended = False
        """Every rank met at the end of the run (the barrier before the process groups go)."""

    def wait_for_everyone(self):
        self.ended = True


class FakeCheckpointer:
    """Keeps the training state per step in memory; ``restore`` loads one back."""

    def __init__(self):
        self.saved: dict[str, dict] = {}

    def restore(self, path, state):
        state.load_state_dict(self.saved[path])


@pytest.fixture
def steps(monkeypatch):
    """The optimizer steps the fake step ran (0-based), in order; ``fail_at`` makes one raise."""
    ran: list[int] = []
    ran_info = SimpleNamespace(ran=ran, fail_at=None)

    def fake_forward_backward(run, step, timer=None):
        if ran_info.fail_at == step + 1:
            raise RuntimeError("the step broke")
        ran.append(step)
        return Gradients(0.1, 1, 1, torch.tensor(1.0), None, None, None, 0.0)

    def fake_optim_step(run, gradients, timer=None):
        return StepResult(gradients.loss_sum, gradients.lr, torch.tensor(1.0), torch.tensor(False), 0.0)

    monkeypatch.setattr(trainer_module, "forward_backward", fake_forward_backward)
    monkeypatch.setattr(trainer_module, "optim_step", fake_optim_step)
    return ran_info


class FakeValidation:
    """Due at ``eval_steps``; every measurement returns 2.0 and is logged."""

    def __init__(self, eval_steps, log):
        self.eval_steps, self.log, self.is_mixture = set(eval_steps), log, False

    def due(self, step):
        return step in self.eval_steps

    def losses(self):
        self.log.append(("validation", "losses", None))
        return {"data": 2.0}

    def loss(self, per_source=None):
        return 2.0

    def generate(self, step):
        return {}


def make_trainer(callbacks, max_steps=3, checkpointer=None, validation=None) -> Trainer:
    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(max_steps=max_steps)), tokens_per_step=10,
                          accelerator=FakeAccelerator())
    return Trainer(run, Path("unused"), checkpointer or FakeCheckpointer(), callbacks, validation=validation)


def test_hooks_run_in_timeline_order_and_callbacks_in_their_order(steps):
    log: list = []
    early, late = Recorder("early", log, sync_steps={2}), Recorder("late", log)
    trainer = make_trainer([early, late], max_steps=2)
    state = trainer.fit()
    assert state.step == 2 and steps.ran == [0, 1] and trainer.run.accelerator.ended
    both = lambda hook, step: [("early", hook, step), ("late", hook, step)]  # noqa: E731
    assert log == [
        *both("on_start", 0),
        *both("before_step", 0), *both("pre_optim_step", 0), *both("after_step", 1), *both("on_step_end", 1),
        *both("on_save", 1),
        # step 2 is a sync point (one callback asked): at_sync runs between after_step and on_step_end
        *both("before_step", 1), *both("pre_optim_step", 1), *both("after_step", 2), *both("at_sync", 2),
        *both("on_step_end", 2), *both("on_save", 2),
        *both("on_end", 2),
    ]
    trainer.close()
    trainer.close()
    assert log[-2:] == both("on_close", 2)  # once


def test_the_trainer_runs_each_evaluation_after_the_log_line_and_before_the_save(steps):
    """An evaluation is a sync point the trainer decides (no callback asked for one): the callbacks' figures first,
    then the validation loss, then ``after_eval``, between ``on_step_end`` and ``on_save``."""
    log: list = []
    trainer = make_trainer([Recorder("r", log)], max_steps=2, validation=FakeValidation({2}, log))
    state = trainer.fit()
    step2 = [(who, hook) for who, hook, step in log if step == 2 or who == "validation"]
    assert step2 == [("r", "after_step"), ("r", "at_sync"), ("r", "on_step_end"), ("r", "eval_figures"),
                     ("validation", "losses"), ("r", "after_eval"), ("r", "on_save"), ("r", "on_end")]
    assert state.last_val_loss == 2.0 and state.last_val_step == 2 and state.best_val_loss == 2.0


class StopAt(Callback):
    def __init__(self, step: int, stop: Stop, hook: str = "on_step_end"):
        self.step, self.stop = step, stop
        setattr(self, hook, self._maybe_stop)

    def _maybe_stop(self, trainer, *args):
        if trainer.state.step == self.step:
            trainer.request_stop(self.stop)


def test_a_clean_stop_ends_the_run_after_the_save_point_and_runs_the_end(steps):
    log: list = []
    trainer = make_trainer([StopAt(2, Stop("enough")), Recorder("r", log)], max_steps=5)
    state = trainer.fit()
    assert state.step == 2 and steps.ran == [0, 1]
    hooks = [(hook, step) for _, hook, step in log]
    assert hooks[-4:] == [("on_step_end", 2), ("on_save", 2), ("on_stop", 2), ("on_end", 2)]


def test_an_error_stop_exits_2_without_the_end(steps):
    log: list = []
    trainer = make_trainer([StopAt(1, Stop("diverged", error=True)), Recorder("r", log)], max_steps=5)
    with pytest.raises(UserError, match="diverged") as caught:
        trainer.fit()
    assert caught.value.exit_code == 2 and steps.ran == [0]
    assert ("r", "on_stop", 1) in log and ("r", "on_end", 1) not in log and not trainer.run.accelerator.ended


def test_a_preemption_replaces_an_earlier_stop_and_exits_with_its_code(steps):
    early = StopAt(1, Stop("enough"), hook="on_step_end")
    signal = StopAt(1, Stop("SIGTERM", exit_code=124, save=True), hook="on_save")
    later = StopAt(1, Stop("also enough"), hook="on_save")
    with pytest.raises(SystemExit) as caught:
        make_trainer([early, signal, later], max_steps=5).fit()
    assert caught.value.code == 124


class RollBackAt(Callback):
    """At the sync point of step ``at`` (once), rolls the run back to the checkpoint of step ``to``."""

    def __init__(self, at: int, to: int):
        self.at, self.to, self.done = at, to, False

    def needs_sync(self, trainer, step):
        return True

    def on_save(self, trainer):
        trainer.checkpointer.saved[f"step_{trainer.state.step}"] = trainer.state.state_dict()

    def at_sync(self, trainer, longest_skip_run):
        if trainer.state.step != self.at or self.done:
            return False
        self.done = True
        trainer.roll_back(f"step_{self.to}")
        return True


def test_a_rollback_skips_the_rest_of_the_step_and_goes_on_from_the_checkpoint(steps):
    log: list = []
    trainer = make_trainer([RollBackAt(at=3, to=1), Recorder("r", log)], max_steps=4)
    state = trainer.fit()
    assert steps.ran == [0, 1, 2, 1, 2, 3]  # steps 2 and 3 (1-based) ran again after going back to step 1
    assert state.step == 4 and state.tokens_seen == 40
    step3 = [hook for _, hook, step in log if step == 3]
    # The rolled-back step 3 reached after_step only; the later callbacks' at_sync and the log were not called.
    assert ("r", "after_rollback", 1) in log
    first_rollback = log.index(("r", "after_rollback", 1))
    assert [entry for entry in log[:first_rollback] if entry[2] == 3] == [("r", "after_step", 3)]
    assert step3.count("on_step_end") == 1  # only the second time through


class Explains(Callback):
    def on_error(self, trainer, err):
        if isinstance(err, RuntimeError):
            return UserError(f"step {trainer.running_step} failed: {err}")
        return None


def test_a_callback_replaces_an_error_with_its_explanation(steps):
    steps.fail_at = 2
    with pytest.raises(UserError, match="step 2 failed: the step broke"):
        make_trainer([Explains()], max_steps=3).fit()


class Second(Callback):
    follows = ("Recorder",)


def test_a_callback_listed_before_one_it_follows_is_refused_and_one_attached_once_in_order():
    log: list = []
    with pytest.raises(ValueError, match="Second must come after Recorder"):
        make_trainer([Second(), Recorder("r", log)])
    attached = []
    first, second = Recorder("r", log), Second()
    first.attach = lambda trainer: attached.append("first")
    second.attach = lambda trainer: attached.append("second")
    make_trainer([first, second])
    assert attached == ["first", "second"]


def test_two_callbacks_may_not_share_a_checkpoint_name():
    one, two = Callback(), Callback()
    one.name = two.name = "same"
    with pytest.raises(ValueError, match="share a checkpoint name"):
        make_trainer([one, two])


class CountSteps(Callback):
    """A stateful callback: the steps it saw, in ``train_state.json`` and in a file of its own."""

    name = "count_steps"

    def __init__(self):
        self.count = 0
        self.loaded_from_file: int | None = None

    def after_step(self, trainer, result):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = (state or {}).get("count", 0)

    def save_files(self, folder):
        (folder / "count_steps.json").write_text(json.dumps(self.count))

    def load_files(self, folder):
        self.loaded_from_file = json.loads((folder / "count_steps.json").read_text())


def test_a_stateful_callback_is_saved_and_restored_by_name(tmp_path, tiny_data):
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.trainer import build_trainer

    def fit(max_steps: int) -> CountSteps:
        cfg = load_config("recipes/tiny.yaml", [
            f"out_dir={tmp_path / 'run'}", f"data.path={tiny_data}", *TINY_OVERRIDES, f"train.max_steps={max_steps}",
            "train.eval_every_steps=0", "checkpoint.every_steps=2", "checkpoint.export_at_end=false"])
        run = build_run(cfg, Path(cfg.out_dir))
        counter = CountSteps()
        try:
            build_trainer(run, Path(cfg.out_dir), extra=[counter]).fit()
        finally:
            run.prefetcher.close()
        return counter

    first = fit(2)
    saved = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert json.loads((saved / "train_state.json").read_text())["extras"]["count_steps"] == {"count": 2}
    assert (saved / "count_steps.json").read_text() == "2"
    assert first.count == 2 and first.loaded_from_file is None
    resumed = fit(4)  # resumes at step 2: the count continues from the checkpoint's, not from 0
    assert resumed.loaded_from_file == 2 and resumed.count == 4


class GradientsBeforeUpdate(Callback):
    """Records, at ``pre_optim_step``, the gradient of every parameter and the weights (as the step left them)."""

    def __init__(self):
        self.seen: list[tuple[dict, dict]] = []

    def pre_optim_step(self, trainer):
        model = trainer.run.model
        self.seen.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                          {n: p.detach().clone() for n, p in model.named_parameters()}))


def test_pre_optim_step_sees_the_whole_steps_gradients_before_the_update(tmp_path, tiny_data):
    """Accumulation 2 on one process: at ``pre_optim_step`` every parameter holds its gradient (both micro-batches
    accumulated: the clip and update then use exactly these) and the weights are those before the update."""
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.trainer import build_trainer

    cfg = load_config("recipes/tiny.yaml", [
        f"out_dir={tmp_path / 'run'}", f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=2",
        "train.micro_batch_size=4", "train.global_batch_size=8", "train.eval_every_steps=0",
        "checkpoint.every_steps=0", "optim.grad_clip=0", "optim.weight_decay=0"])
    run = build_run(cfg, Path(cfg.out_dir))
    probe = GradientsBeforeUpdate()
    trainer = build_trainer(run, Path(cfg.out_dir), extra=[probe])
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert len(probe.seen) == 2 and run.runtime.batch.accum_steps == 2
    (grads, before), (_, after) = probe.seen
    assert set(grads) == set(before) and all(torch.isfinite(g).all() for g in grads.values())
    # The weights moved by the first update, and only through it: AdamW's first step moves each element by lr
    # (sign of its gradient).
    lr = run.lr_at(0)
    for name, grad in grads.items():
        moved = after[name] - before[name]
        big = grad.abs() > 1e-4  # where AdamW's eps (1e-8) is negligible
        torch.testing.assert_close(moved[big], -lr * grad[big].sign(), rtol=1e-3, atol=lr * 1e-3)


class FailsToClose(Callback):
    def on_close(self, trainer):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failing", [False, True])
def test_every_callback_closes_and_a_close_error_never_replaces_the_runs_own(failing, caplog):
    log: list = []
    trainer = make_trainer([FailsToClose(), Recorder("after", log)])
    if failing:  # the run is ending on its own error: the close's is logged, and the caller re-raises the run's
        trainer.close(failing=True)
        assert "FailsToClose did not close cleanly: OSError" in caplog.text
    else:  # a run that ended well fails on it
        with pytest.raises(OSError, match="No space left"):
            trainer.close()
    assert ("after", "on_close", 0) in log

