"""The trainer's callback protocol: the points of the loop a callback acts at, and how it keeps its state.

The trainer (``lmrecipe/train/trainer.py``) runs, for every optimizer step::

    before_step -> forward/backward -> pre_optim_step -> update -> after_step
        -> [sync point: host read, at_sync] -> on_step_end -> [evaluation: eval_figures, after_eval] -> on_save

after ``on_start`` and before ``on_end``; ``on_stop`` when a callback ends the run early, ``on_error`` when an
exception leaves the loop, ``on_close`` when the trainer is closed. Each hook is called on the run's callbacks in the
order of their list (``build_callbacks``), which is the run order: a callback that must run after another names it
in :attr:`Callback.follows`, and the trainer refuses a list that breaks it. A callback is built from its own config
section and receives the trainer twice: at :meth:`Callback.attach`, once, when the trainer is built (what it needs of
the run: its model, accelerator, data, folder), and at every hook. It overrides only the hooks it uses, so nothing is
wired by hand, no callback replaces another object's method, and the loop never looks a callback up by type.

- ``on_start``: once, before the first step (resume, open the logs);
- ``before_step``: before the step's first forward;
- ``pre_optim_step``: the step's gradients are complete and not yet used: every micro-batch's backward has run, the
  clip and the update have not. Without DeepSpeed they are the parameters' ``.grad``; under ZeRO-1/2 each rank's
  fp32 partitions of the reduced gradients, under ZeRO-3 its partitions (``deepspeed.utils.safe_get_local_grad``);
  device work only, like ``after_step``;
- ``after_step(result)``: the update is done; device work only (an unlogged step makes no host read);
- ``needs_sync(step) -> bool``: whether the step just run is a sync point (a logged, evaluated or saved step);
- ``at_sync(longest_skip_run) -> bool``: at a sync point, after the skip counters were read; True means the
  callback moved the run back (a rollback, through :meth:`Trainer.roll_back`): the step is neither logged,
  evaluated nor saved, and the later callbacks' ``at_sync`` are not called;
- ``on_step_end(result)``: the step stands (log it);
- ``eval_figures(evaluate) -> dict`` / ``after_eval(result)``: at an evaluation (``train.eval_every_steps`` and the
  last step), which the trainer runs after ``on_step_end``: each callback's figures first (``evaluate()`` measures
  the validation loss of the weights the model holds then), then the trained weights' validation loss, then the
  whole result to every callback;
- ``on_save``: the save point of the step (a preemption's stop, then the checkpoint);
- ``after_rollback``: the run went back to a checkpoint (``trainer.state`` is the checkpoint's);
- ``on_stop(stop)``: a callback asked the run to end (:meth:`Trainer.request_stop`), before it ends;
- ``on_end``: after the last step (wait for the checkpoint, export, close the logs, write the report);
- ``on_error(err) -> BaseException | None``: an exception left the loop; a callback may return the clear error
  that replaces it (an out-of-memory diagnosis, a lost peer);
- ``on_close``: the trainer is closed (:meth:`Trainer.close`: after ``on_end``, an error, or a benchmark's last
  step): release what the callback holds (files, threads) without ending the run; called once;
- ``outcome() -> dict``: the callback's figures for the run's end (``final.json``).

A callback with a :attr:`Callback.name` is saved in every checkpoint under that name (``state_dict`` in
``train_state.json``'s ``extras``, ``save_files`` beside it) and restored from it on resume and rollback, so a
resumed run behaves as the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lmrecipe.train.step import StepResult


@dataclass(frozen=True)
class Stop:
    """Why the run ends before ``train.max_steps``.

    ``error``: it ends with exit code 2 and ``message`` as the error. ``exit_code``: the process exits with it after
    the step's checkpoint (a preemption; ``save`` forces that checkpoint). Otherwise the run ends cleanly: the
    message is logged and the end of the run (export, report) follows.
    """

    message: str
    error: bool = False
    exit_code: int | None = None
    save: bool = False


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the validation loss, per source of a mixture (None: one source), the best loss before it,
    and the callbacks' further figures by name (``val_loss_ema``, ``acc/<task>``, ...)."""

    val_loss: float
    best_before: float | None
    per_source: dict[str, float] | None = None
    figures: dict[str, float] = field(default_factory=dict)


class Callback:
    """The hooks of the module docstring, each a no-op here; the checkpoint protocol's four methods too.

    ``trainer`` is the :class:`lmrecipe.train.trainer.Trainer` running the loop (not imported here: the trainer is
    the layer above its callbacks).
    """

    name: str | None = None
    """Its key in every checkpoint's ``extras``; None: it keeps no state across a resume."""
    follows: tuple[str, ...] = ()
    """The callback classes (by name) that, when the run has them, come before this one at every hook; the trainer
    checks the run's list against it."""

    def attach(self, trainer) -> None:
        """Take what the callback needs of the run (``trainer.run``, ``trainer.out_dir``); once, when the trainer is
        built, in the list's order, on every rank."""

    def on_start(self, trainer) -> None:
        pass

    def before_step(self, trainer) -> None:
        pass

    def pre_optim_step(self, trainer) -> None:
        pass

    def after_step(self, trainer, result: StepResult) -> None:
        pass

    def needs_sync(self, trainer, step: int) -> bool:
        return False

    def at_sync(self, trainer, longest_skip_run: int) -> bool:
        return False

    def on_step_end(self, trainer, result: StepResult) -> None:
        pass

    def eval_figures(self, trainer, evaluate: Callable[[], float]) -> dict[str, float]:
        return {}

    def after_eval(self, trainer, result: EvalResult) -> None:
        pass

    def on_save(self, trainer) -> None:
        pass

    def after_rollback(self, trainer) -> None:
        pass

    def on_stop(self, trainer, stop: Stop) -> None:
        pass

    def on_end(self, trainer) -> None:
        pass

    def on_error(self, trainer, err: BaseException) -> BaseException | None:
        return None

    def on_close(self, trainer) -> None:
        pass

    def outcome(self, trainer) -> dict:
        return {}

    # ---- the checkpoint's protocol (used when ``name`` is set)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def save_files(self, folder: Path) -> None:
        pass

    def load_files(self, folder: Path) -> None:
        pass
