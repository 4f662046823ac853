"""The trainer: optimizer steps to ``train.max_steps`` (``lmrecipe/train/step.py``'s two halves), the evaluations,
and everything else the loop does done by callbacks.

``train`` takes the run folder's lock, builds the run, its checkpointer and its callbacks, and calls
:meth:`Trainer.fit`. The hooks and their timeline are described in ``lmrecipe/train/callback.py``. The run's
callbacks are the list :func:`build_callbacks` returns, in the order they run at every hook; a callback that must run
after another names it (:attr:`Callback.follows`), and the trainer refuses a list that breaks it.

A new feature is a new :class:`Callback` in ``lmrecipe/train/callbacks/``, built from its own config section and
placed in :func:`build_callbacks`' list.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

from lmrecipe.checkpoint.checkpointer import Checkpointer
from lmrecipe.checkpoint.storage import find_resume_checkpoint, read_checkpoint
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import removing_new_empty_dirs
from lmrecipe.observe.quiet import quiet
from lmrecipe.optim import lr_at
from lmrecipe.observe.run_report import FINAL_FILE
from lmrecipe.parallel.accelerator import release_distributed
from lmrecipe.train.callback import Callback, EvalResult, Stop
from lmrecipe.train.callbacks.checkpointing import Checkpointing, ExportAtEnd, build_checkpointer
from lmrecipe.train.callbacks.ema import WeightEMA
from lmrecipe.train.callbacks.faults import FaultInjection, maybe_cap_steps
from lmrecipe.train.callbacks.goodput import GoodputLedger
from lmrecipe.train.callbacks.layer_stats import LayerStats
from lmrecipe.train.callbacks.model_states import ModelStates
from lmrecipe.train.callbacks.oom import OOMDiagnosis
from lmrecipe.train.callbacks.preemption import Preemption, PreemptionSignal
from lmrecipe.train.callbacks.profiling import StepProfiling
from lmrecipe.train.callbacks.remote import build_remote_callbacks
from lmrecipe.train.callbacks.reporting import Reporting
from lmrecipe.train.callbacks.routing_bias import RoutingBiasUpdate
from lmrecipe.train.callbacks.spikes import SpikeGuard
from lmrecipe.train.callbacks.stopping import EarlyStopping, NonFiniteStop
from lmrecipe.train.callbacks.stragglers import StragglerClock
from lmrecipe.train.callbacks.tasks import TaskEval
from lmrecipe.train.callbacks.watchdog import Watchdog
from lmrecipe.train.lock import RunLock
from lmrecipe.train.setup import Run, build_run
from lmrecipe.train.state import TrainState
from lmrecipe.train.step import SectionTimer, forward_backward, optim_step
from lmrecipe.train.validation import Validation

logger = logging.getLogger(__name__)


class Trainer:
    """Owns the run's loop and :class:`TrainState`; calls its callbacks at the points ``callback.py`` names.

    ``checkpointer``: the run's checkpoint files (saved and read by the callbacks that decide when).
    ``validation``: what an evaluation measures (None: the run evaluates nothing).
    ``timer``: receives the sections of every step (benchmarks).
    """

    def __init__(self, run: Run, out_dir: Path, checkpointer: Checkpointer, callbacks: Sequence[Callback], *,
                 validation: Validation | None = None, timer: SectionTimer | None = None):
        self.run = run
        self.validation = validation
        self.out_dir = out_dir
        self.checkpointer = checkpointer
        self.callbacks = list(callbacks)
        check_order(self.callbacks)
        stateful(self.callbacks)  # two callbacks may not share a checkpoint name
        self.state = TrainState()
        self.max_steps = run.cfg.train.max_steps
        self.timer = timer
        self.resumed_from: str | None = None
        """The checkpoint the run resumed from (set by the checkpointing callback at the start)."""
        self.running_step: int | None = None
        """The optimizer step (1-based) being computed now (its forward, backward and update); None between steps."""
        self.sync_point = False
        """Whether the step just run is a sync point (host reads allowed)."""
        self.step_time_s = 0.0
        """Seconds of the step just run, its callbacks up to the sync point included."""
        self.stop: Stop | None = None
        self._clock = time.perf_counter()
        self._closed = False
        for callback in self.callbacks:  # last: a callback may read any of the trainer's fields
            callback.attach(self)


    def call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def figures(self, hook: str, *args) -> dict:
        """The callbacks' dicts from ``hook``, merged in their order."""
        merged: dict = {}
        for callback in self.callbacks:
            merged.update(getattr(callback, hook)(self, *args))
        return merged

    # ---- the loop

    def fit(self) -> TrainState:
        """Train to ``train.max_steps`` (or until a callback stops the run), then end the run."""
        try:
            self.start()
            while self.state.step < self.max_steps and self.stop is None:
                self.step()
            self.call("on_end")
        except BaseException as err:
            # Every callback hears of the error (one may clean up or finish an upload); the first replacement wins.
            replacements = [c.on_error(self, err) for c in self.callbacks]
            replacement = next((r for r in replacements if r is not None), None)
            if replacement is None:
                raise
            raise replacement from None
        # Every rank ends the run before any tears its process group down (train() releases it after the close).
        self.run.accelerator.wait_for_everyone()
        return self.state

    def start(self) -> None:
        self.call("on_start")
        self._clock = time.perf_counter()

    def step(self) -> None:
        """One optimizer step, then what the callbacks do with it."""
        step_start = time.perf_counter()
        self.running_step = self.state.step + 1
        self.call("before_step")
        gradients = forward_backward(self.run, self.state.step, self.timer)
        self.call("pre_optim_step")
        result = optim_step(self.run, gradients, self.timer)
        self.state.record_step(result.skipped, self.run.tokens_per_step if result.tokens is None else result.tokens)
        self.running_step = None
        self.call("after_step", result)
        # Host reads happen only at sync points: a logged, evaluated or saved step.
        evaluating = self.validation is not None and self.validation.due(self.state.step)
        self.sync_point = evaluating or any(c.needs_sync(self, self.state.step) for c in self.callbacks)
        if self.sync_point and self._at_sync(self.state.sync()):
            return  # a callback moved the run back (a spike's rollback): go on from state.step
        now = time.perf_counter()
        self.step_time_s = now - step_start
        self.state.wall_time_s += now - self._clock
        self._clock = now
        self.call("on_step_end", result)
        if evaluating:
            self.evaluate()
        self.call("on_save")
        if self.stop is not None:
            self.end_early(self.stop)

    def evaluate(self) -> EvalResult:
        """The callbacks' figures (``eval_figures``), then the trained weights' validation loss, recorded in the state
        and handed to every callback (``after_eval``)."""
        validation = self.validation
        figures = self.figures("eval_figures", validation.loss)
        per_source = validation.losses()
        val_loss = validation.loss(per_source)
        figures.update(validation.generate(self.state.step))
        best_before = self.state.best_val_loss
        self.state.record_eval(val_loss)
        result = EvalResult(val_loss, best_before, per_source if validation.is_mixture else None, figures)
        self.call("after_eval", result)
        return result

    def _at_sync(self, longest_skip_run: int) -> bool:
        """True when a callback moved the run back (the later callbacks' ``at_sync`` are not called)."""
        return any(callback.at_sync(self, longest_skip_run) for callback in self.callbacks)

    # ---- what callbacks ask of the trainer

    def request_stop(self, stop: Stop) -> None:
        """End the run after this step's save point. The first request stands, except that a preemption's replaces
        it: a signalled process must save and leave with the signal's exit code."""
        if self.stop is None or (stop.exit_code is not None and self.stop.exit_code is None):
            self.stop = stop

    def end_early(self, stop: Stop) -> None:
        """Tell the callbacks, then end: exit code 2 for an error, the stop's own code, or on to ``on_end``."""
        self.stop = stop
        self.call("on_stop", stop)
        if stop.error:
            raise fail(stop.message)
        logger.info("%s", stop.message)
        if stop.exit_code is not None:
            # The launcher SIGTERMs the other ranks once one exits: leave together, after rank 0's plot.
            self.run.accelerator.wait_for_everyone()
            raise SystemExit(stop.exit_code)

    def roll_back(self, checkpoint: Path) -> None:
        """Reload ``checkpoint`` of this run in-process (weights, optimizer, state, RNG, callbacks' state) and tell
        the callbacks. The time spent training stays counted."""
        wall_time_s = self.state.wall_time_s
        self.checkpointer.restore(checkpoint, self.state)
        self.state.wall_time_s = wall_time_s
        self.call("after_rollback")

    def outcome(self) -> dict:
        """How the run ended, for ``final.json`` and ``run_meta.json``."""
        state = self.state
        return {"step": state.step, "tokens_seen": state.tokens_seen, "stopped_early": state.step < self.max_steps,
                "best_val_loss": state.best_val_loss, "last_val_loss": state.last_val_loss,
                "wall_time_s": state.wall_time_s, **self.figures("outcome")}

    def close(self, failing: bool = False) -> None:
        """Release what the run holds (the callbacks' files and threads, the batch prefetcher) without ending it:
        after :meth:`fit`, whether it returned or raised, or after a benchmark's last :meth:`step`. Once.

        Every callback closes even when one fails to (a report on a full disk). Then the first failure is raised, or,
        with ``failing`` (the run is already ending on an error, which must stay the one the user reads), logged."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for callback in self.callbacks:
            try:
                callback.on_close(self)
            except Exception as err:  # noqa: BLE001 - the other callbacks still close
                errors.append(err)
                if failing:
                    logger.warning("%s did not close cleanly: %s: %s", type(callback).__name__, type(err).__name__, err)
        prefetcher = getattr(self.run, "prefetcher", None)
        if prefetcher is not None:
            prefetcher.close()
        if errors and not failing:
            raise errors[0]


def check_order(callbacks: Sequence[Callback]) -> None:
    """ValueError when a callback comes before one it follows (:attr:`Callback.follows`)."""
    position = {type(c).__name__: i for i, c in enumerate(callbacks)}
    for i, callback in enumerate(callbacks):
        late = [name for name in callback.follows if position.get(name, -1) > i]
        if late:
            raise ValueError(f"{type(callback).__name__} must come after {', '.join(late)} in the run's callbacks "
                             f"(its follows), but comes before: {[type(c).__name__ for c in callbacks]}")


def stateful(callbacks: Sequence[Callback]) -> dict[str, Callback]:
    """The callbacks with state, by name: what every checkpoint saves and a resume restores. ValueError when two
    share a name."""
    named = [c for c in callbacks if c.name is not None]
    by_name = {c.name: c for c in named}
    if len(by_name) != len(named):
        raise ValueError(f"callbacks share a checkpoint name: {[c.name for c in named]}")
    return by_name


def build_callbacks(run: Run, out_dir: Path, signal: PreemptionSignal, recipe: str | None = None,
                    command: list[str] | None = None) -> list[Callback]:
    """The run's callbacks, each from its own config section, in the order they run at every hook."""
    cfg = run.cfg
    remote_resume, remote_upload, remote_report = build_remote_callbacks(
        cfg.checkpoint, run.accelerator, out_dir, progress=cfg.logging.progress_bar, preemption=signal)
    callbacks = [
        StepProfiling(cfg.profile),  # first: what it profiles is the step itself
        OOMDiagnosis(),  # an out-of-memory error in a step becomes one message naming the ways out
        FaultInjection.from_environment(),  # tests' injected faults (LMRECIPE_FAULT_*), only when asked for
        Preemption(signal),  # a signal stops the run after this step's checkpoint; a lost peer is named
        remote_resume,  # checkpoint.remote: a newer remote checkpoint downloaded before the resume
        Watchdog(cfg.distributed),  # every rank's phase; a rank stuck past its budget is named in hang.md (exit 3)
        StragglerClock() if cfg.distributed.stragglers else None,  # every forward timed; read at logged steps
        GoodputLedger(),  # where the session's time goes (goodput.json); before the callbacks it times
        # model.router_bias_update_rate: each MoE layer's routing bias moved toward balance after the update
        RoutingBiasUpdate(cfg.model.router_bias_update_rate) if cfg.model.router_bias_update_rate > 0 else None,
        Checkpointing(),  # resume at the start; save at the save point; wait for a background write at the end
        SpikeGuard(cfg.spike),  # a loss spike rolls the run back to the checkpoint before it
        NonFiniteStop(cfg.train),  # too many non-finite updates in a row end the run (exit 2)
        ModelStates() if cfg.logging.measure_model_states else None,  # this rank's model-state bytes
        WeightEMA(cfg.train) if cfg.train.ema_decay > 0 else None,  # the weight average and its validation loss
        TaskEval(cfg.eval) if cfg.eval.tasks else None,  # multiple-choice tasks scored at evaluations
        EarlyStopping(cfg.train),  # evaluations without improvement end the run
        ExportAtEnd(cfg.checkpoint),  # the Hugging Face export of the last (or best) checkpoint
        remote_upload,  # checkpoint.remote: each checkpoint uploaded in the background; at the end, the export
        Reporting(recipe, command),  # config.yaml, the live log, metrics and trackers, the plot, the report
        LayerStats() if cfg.logging.layer_stats else None,  # per-layer norms at logged steps; layers.png
        remote_report,  # checkpoint.remote: the run's report uploaded last
    ]
    return [callback for callback in callbacks if callback is not None]


def build_trainer(run: Run, out_dir: Path, signal: PreemptionSignal | None = None, recipe: str | None = None,
                  timer: SectionTimer | None = None, extra: Sequence[Callback] = (),
                  command: list[str] | None = None) -> Trainer:
    """The trainer of ``run`` with the run's callbacks, then ``extra`` ones (saved by name like the others)."""
    callbacks = [*build_callbacks(run, out_dir, signal or PreemptionSignal(), recipe, command), *extra]
    batches = run.train_batches  # a checkpoint's data position: where the next step's sample range starts
    checkpointer = build_checkpointer(run, out_dir, stateful(callbacks), next_sample=batches.next_sample)
    return Trainer(run, out_dir, checkpointer, callbacks, validation=Validation(run), timer=timer)


def finished_state(cfg, out_dir: Path) -> TrainState | None:
    """The state of ``out_dir``'s run when it already ended at ``train.max_steps`` (its newest checkpoint, the one
    ``checkpoint.resume=auto`` takes, is at that step and the run's end was recorded in ``final.json``); else None.
    Reads files only: every rank answers alike."""
    if cfg.checkpoint.resume != "auto" or not (out_dir / FINAL_FILE).is_file():
        return None  # without final.json the end of the run (export, report) did not complete: it runs again
    try:
        checkpoint = find_resume_checkpoint("auto", out_dir / "checkpoints")
        saved = read_checkpoint(checkpoint) if checkpoint is not None else None
    except UserError:
        return None  # a damaged checkpoint: the resume names it with its fix
    if saved is None or int(saved["state"]["step"]) != cfg.train.max_steps:
        return None
    state = TrainState()
    state.load_state_dict(saved["state"])
    return state


def train(cfg, recipe: str | None = None, command: list[str] | None = None) -> TrainState:
    """Train ``cfg`` to ``train.max_steps`` (resuming as ``checkpoint.resume`` says); one run per ``out_dir``.

    A run that already ended at ``train.max_steps`` is left as it is (nothing is written, not even the lock): the
    same command run again has nothing to do.

    ``recipe``: the recipe file ``cfg`` was loaded from, which the run report compares the configuration with.
    ``command``: the script's command line, which ``run_meta.json`` records for every session of the run.
    """
    quiet(cfg.logging.verbose)
    out_dir = Path(cfg.out_dir)
    if (finished := finished_state(cfg, out_dir)) is not None:
        logger.info("nothing to do: %s already finished at step %d (train.max_steps=%d). To train further, raise "
                    "train.max_steps and keep the rate the run ended at (schedule.decay=constant optim.lr=%.6g), or "
                    "branch a new run from one of its checkpoints (out_dir=NEW_DIR checkpoint.branch_from=CHECKPOINT): "
                    "docs/checkpoints.md, 'Longer runs'", out_dir, finished.step, cfg.train.max_steps,
                    lr_at(cfg.train.max_steps, cfg.train.max_steps, cfg.optim, cfg.schedule))
        return finished
    cfg = maybe_cap_steps(cfg, out_dir)  # tests' step cap (LMRECIPE_MAX_STEPS), after the finished run's check
    with removing_new_empty_dirs(out_dir, out_dir / "checkpoints"):  # a failed start leaves no empty folders
        run = build_run(cfg, out_dir)
        lock = RunLock(out_dir)
        if run.accelerator.is_main_process:
            lock.acquire()  # before anything in out_dir is cleaned up or written
        run.accelerator.wait_for_everyone()
        signal = PreemptionSignal()
        trainer, failing = None, True
        try:
            trainer = build_trainer(run, out_dir, signal, recipe, command=command)
            state = trainer.fit()
            failing = False
        finally:
            try:
                if trainer is not None:
                    trainer.close(failing)
                else:
                    run.prefetcher.close()
                lock.release()
            finally:
                # Last: a launcher SIGTERMs the survivors as soon as one rank dies, and a survivor that still closes
                # its files with the default handler back would die of it before printing which rank was lost.
                signal.close()
        release_distributed(run.accelerator)
        return state
