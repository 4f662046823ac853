"""Resuming a run from a checkpoint, and rolling back to one: weights, optimizer, training state, RNG and extras.

A resume takes the checkpoint ``checkpoint.resume`` names and stops (UserError) when it cannot continue as this
run: a step past ``train.max_steps``, a change of what the weights, optimizer state or data position depend on
(``compat.py``), another optimizer. A checkpoint saved on another layout (process count under DeepSpeed, ZeRO
stage, offload, DeepSpeed or not, sequence, tensor or AutoEP expert parallelism) is converted once to its topology-free form
(``portable.py``), every rank writing its share, and loaded by parameter name; the form is cached beside the
checkpoint (never modified), or in this run's ``checkpoints/`` when the checkpoint's folder is read-only. A
rollback loads the same way without the compatibility check. Every function is called on every rank.

A branch (``checkpoint.branch_from``) is a resume from another run's checkpoint into a new ``out_dir``, with this
run's schedule and data: the source is only read (its topology-free form, when one is needed, is cached in this run's
``checkpoints/``; its lock and its checkpoints are not touched). Once the branch has checkpoints of its own it
resumes from them, as any run does.
"""

from __future__ import annotations

import errno
import logging
import pickle
import time
from pathlib import Path

from safetensors import SafetensorError

from lmrecipe.checkpoint.compat import check_resume_compatible
from lmrecipe.checkpoint.portable import (
    cached_portable,
    finish,
    load_portable,
    plan_shards,
    portable_dir,
    stale_form,
    state_sha256,
    write_share,
)
from lmrecipe.checkpoint.readers import open_source
from lmrecipe.checkpoint.record import LoopState, RunFacts, StateRecord
from lmrecipe.checkpoint.rng import restore_rng
from lmrecipe.checkpoint.storage import (
    DS_TAG,
    STATE_FILE,
    complete_checkpoints,
    find_resume_checkpoint,
    looks_like_checkpoint,
    no_checkpoint_message,
    read_checkpoint,
    resolve_checkpoint,
    use_earlier,
)
from lmrecipe.checkpoint.tp_split import RECORD_KEY as TP_RECORD
from lmrecipe.config import ScheduleConfig, autoep_size_of
from lmrecipe.data.sources import TrainingData
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.parallel.topology import Topology
from lmrecipe.errors import UserError, fail
from lmrecipe.objstore import is_remote
from lmrecipe.fileio import install_dir, remove_path, temp_dir_for
from lmrecipe.optim import optimizer_param_names

logger = logging.getLogger(__name__)


def continue_sample_order(batches, saved: dict) -> None:
    """A checkpoint written with an earlier sample order (no ``order_version``: version 1) continues in it."""
    version = int(saved.get("data", {}).get("order_version", 1))
    if version != batches.order_version:
        logger.info("The checkpoint was written with sample order version %d; this run continues in it (new runs use "
                    "version %d, constant in memory).", version, batches.order_version)
        batches.use_order_version(version)


def _uses_deepspeed(value) -> bool:
    return value not in (None, "none", "null")


def saved_layout(saved: dict) -> Topology:
    """The topology a checkpoint (``saved``: its ``train_state.json``) was cut in; a record from before the AutoEP
    size was part of it takes the size from its config."""
    return Topology.from_record({"expert_parallel_size": autoep_size_of(saved["config"]) or 1, **saved["topology"]})


def forgotten_settings(saved_config: dict, run_config: dict) -> list[str]:
    """The parallel settings of a checkpoint's run (``saved_config``) that this run (``run_config``) leaves at their
    default, each as the ``key=value`` override that restores it: a DeepSpeed config, sequence or tensor parallelism.
    A change to another value is a choice, not listed."""
    old, new = saved_config.get("distributed", {}), run_config.get("distributed", {})
    forgotten = []
    deepspeed = old.get("deepspeed_config")
    if _uses_deepspeed(deepspeed) and not _uses_deepspeed(new.get("deepspeed_config")):
        forgotten.append(f"distributed.deepspeed_config={deepspeed}")
    for key in ("sequence_parallel_size", "tensor_parallel_size"):
        if int(old.get(key, 1)) > 1 and int(new.get(key, 1)) == 1:
            forgotten.append(f"distributed.{key}={old[key]}")
    return forgotten


class Resumer:
    """Loads checkpoints into this run: the resume at its start and the rollbacks during it."""

    def __init__(self, accelerator, facts: RunFacts, record: StateRecord, *, resume: str, root: Path,
                 data: TrainingData, branch_from: str | None = None):
        """``resume``: ``checkpoint.resume``; ``root``: this run's ``checkpoints/`` folder; ``branch_from``:
        ``checkpoint.branch_from``."""
        self.accelerator = accelerator
        self.facts = facts
        self.record = record
        self.resume = resume
        self.root = root
        self.data = data
        self.branch_from = branch_from
        self.source: Path | None = None
        """The other run's checkpoint this branch started from (read only), once loaded."""
        self.model = self.optimizer = None

    def maybe_resume(self, model, optimizer, state: LoopState) -> Path | None:
        """Restore the checkpoint ``checkpoint.resume`` names into ``model``, ``optimizer`` and ``state``; return it,
        or None when there is none. ``model`` and ``optimizer`` are also what a later :meth:`restore` reloads."""
        self.model, self.optimizer = model, optimizer
        path = find_resume_checkpoint(self.resume, self.root)
        branch = False
        if self.branch_from is not None:
            path, branch = self._branch_start(path)
        if path is None:
            return None
        saved = read_checkpoint(path)
        max_steps = self.facts.max_steps
        if branch and saved["state"]["step"] >= max_steps:
            raise fail(branch_too_short(path, int(saved["state"]["step"]), max_steps,
                                        self.facts.run_config.get("schedule", {})))
        if saved["state"]["step"] > max_steps:  # the loop would not run, and the end of the run would re-export
            raise fail(f"{path} is at step {saved['state']['step']}, past train.max_steps={max_steps}: there is "
                       "nothing to train. Raise train.max_steps to train on, pass checkpoint.resume=PATH of an earlier "
                       "checkpoint, or export this one with tools/export_hf.py.")
        self.check_compatible(saved, path, model, branch=branch)
        continue_sample_order(self.data.train_batches, saved)
        if branch:
            self.source = path
        self._load(path, saved, state)
        self.record.branched_from = (branch_record(path, saved) if branch else saved.get("branched_from"))
        self._log_resume(path, saved, state, branch)
        return path

    def check_compatible(self, saved: dict, path: Path | str, model, branch: bool = False) -> None:
        """Stop (UserError) when checkpoint ``path`` (``saved``: its ``train_state.json``; ``path`` may be the URL
        of a remote one, checked before it is downloaded) cannot continue as this run: another optimizer or MoE
        layer, or a change of what its weights, optimizer state or data position depend on."""
        self._check_optimizer(path, saved)  # before the compatibility check logs the allowed changes
        check_resume_compatible(saved, path, run_config=self.facts.run_config,
                                hf_config=unwrap_model(self.accelerator, model).config.to_dict(),
                                data_signature=self.data.signature(), lr_schedule=self.record.lr_schedule,
                                branch=branch)

    def _log_resume(self, path: Path, saved: dict, state: LoopState, branch: bool) -> None:
        changes = self.record.topology.changes_from(saved_layout(saved))
        verb = "Branched" if branch else "Resumed"
        if forgotten := forgotten_settings(saved["config"], self.facts.run_config):
            logger.warning("%s from %s at step %d on a new layout (%s): the checkpoint's run trained with %s, this "
                           "run without. The state was converted exactly, but if the setting was left out by mistake, "
                           "stop and run again with %s.", verb, path, state.step, "; ".join(changes),
                           ", ".join(forgotten), " ".join(forgotten))
        elif changes:
            logger.info("%s from %s at step %d (%d tokens seen) on a new layout: %s. Weights, AdamW moments and "
                        "step counts were loaded by parameter name; the data continues at sample %d.", verb, path,
                        state.step, state.tokens_seen, "; ".join(changes), saved["data"]["next_sample"])
        else:
            logger.info("%s from %s at step %d (%d tokens seen)", verb, path, state.step, state.tokens_seen)
        if branch:
            logger.info("The branch's source run is only read; this run's checkpoints go to %s", self.root)

    def _branch_start(self, own: Path | None) -> tuple[Path | None, bool]:
        """The checkpoint a run with ``checkpoint.branch_from`` starts from, and whether it is the source (a branch)
        rather than the branch's own newest checkpoint ``own``. Stops when the branch would write into the source
        run, or when ``out_dir`` holds checkpoints of another run. A branch with checkpoints of its own resumes from
        them whatever became of its source since: pruned, or (``branch_from`` naming the source's run folder) moved
        on to newer checkpoints."""
        check_branch_out_dir(self.branch_from, self.root.parent)
        if own is not None:
            return self._own_branch(own), False
        source = resolve_checkpoint(self.branch_from)
        if not looks_like_checkpoint(source):
            raise fail(f"checkpoint.branch_from={self.branch_from}: {no_checkpoint_message(Path(self.branch_from))} "
                       "Pass a checkpoint folder of the run to branch from (OTHER_RUN/checkpoints/step_N), or its run "
                       "folder for its newest checkpoint.")
        return source.resolve(), True

    def _own_branch(self, own: Path) -> Path:
        """``own``, when it is a checkpoint of a branch from what ``checkpoint.branch_from`` names; else the refusal."""
        recorded = read_checkpoint(own).get("branched_from") or {}
        if branched_from_this(recorded, self.branch_from):
            logger.info("%s holds checkpoints of this branch: resuming the branch from %s (not from its source %s)",
                        self.root.parent, own, recorded["checkpoint"])
            return own
        origin = f"a branch from {recorded['checkpoint']}" if recorded.get("checkpoint") else \
            "a run that is not a branch"
        raise fail(f"out_dir={self.root.parent} already holds checkpoints ({own.name}) of {origin}, not of a branch "
                   f"from checkpoint.branch_from={resolve_checkpoint(self.branch_from).resolve()}. Choose a new "
                   "out_dir for the branch, or set checkpoint.branch_from=null to resume the run in that folder.")

    def restore(self, path: Path, state: LoopState) -> None:
        """Reload a checkpoint of this run in-process (a rollback), as a resume loads it, without the compatibility
        check (the checkpoint is this run's, or the one it resumed from, possibly on another layout)."""
        self._load(path, read_checkpoint(path), state)
        logger.info("Reloaded %s (step %d)", path, state.step)

    def _load(self, path: Path, saved: dict, state: LoopState) -> None:
        """Weights, optimizer, training state, this rank's RNG and the extras, from checkpoint ``path``."""
        saved_on = saved_layout(saved)
        converted = self.record.topology.needs_conversion_from(saved_on)
        try:
            if converted:
                folder = portable_form(self.accelerator, path, saved, self.model, self.root,
                                       beside=path != self.source)
                load_portable(folder, self.model, self.optimizer, deepspeed=self.record.topology.zero.deepspeed,
                              step=saved["state"]["step"], samples_per_step=self.facts.samples_per_step,
                              tensor_parallel=self.record.tensor_parallel(self.model))
            else:
                # load_kwargs: the non-DeepSpeed optimizer and RNG pickles are read with the tensors-only unpickler.
                self.accelerator.load_state(str(path), load_kwargs={"weights_only": True})
        except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as err:
            # The manifest checked names, sizes and safetensors headers; a file damaged inside fails only here.
            raise fail(f"Loading checkpoint {path} failed: {type(err).__name__}: {str(err)[:300]}. A file of it is "
                       f"damaged, or was written by different code. {use_earlier(path)}") from None
        state.load_state_dict(saved["state"])
        restore_rng(path, self.accelerator.process_index, saved_on.world_size)
        self.record.restore_extras(path, saved)

    def _check_optimizer(self, path: Path, saved: dict) -> None:
        """Stop when the checkpoint's optimizer state cannot be loaded into this run's optimizer."""
        saved_on = saved_layout(saved)
        converted = self.record.topology.needs_conversion_from(saved_on)
        optimizer_name = saved["config"]["optim"].get("name", "adamw")  # checkpoints from before optim.name: AdamW
        ours = self.facts.run_config["optim"]["name"]
        if optimizer_name != ours:
            raise fail(f"{path} holds {optimizer_name} optimizer state; this run trains with optim.name={ours}. Resume "
                       f"with optim.name={optimizer_name}, or start a new run from its weights: python "
                       f"tools/export_hf.py {path} EXPORT --dtype fp32, then model.init_from=EXPORT checkpoint.resume=none.")
        _check_expert_layer(path, saved["config"], self.facts.run_config)
        if optimizer_name != "adamw" and converted:
            # The topology-free form holds AdamW's moments only.
            raise fail(f"{path} holds {optimizer_name} optimizer state saved on another layout "
                       f"({'; '.join(self.record.topology.changes_from(saved_on))}), which cannot be converted. "
                       "Resume on the checkpoint's layout, or start a new run from its weights: python "
                       f"tools/export_hf.py {path} EXPORT --dtype fp32, then model.init_from=EXPORT checkpoint.resume=none.")


def branched_from_this(recorded: dict, branch_from: str) -> bool:
    """Whether a branch's record of its source (``branched_from``: checkpoint, step, the source's run folder) is of a
    branch from what ``branch_from`` names: that checkpoint (also once pruned), or the run folder (or its
    ``checkpoints/``) it was the newest of (also once the run has moved on)."""
    if not recorded.get("checkpoint"):
        return False
    named = Path(branch_from).resolve()
    if Path(recorded["checkpoint"]).resolve() in (named, resolve_checkpoint(branch_from).resolve()):
        return True
    run = Path(recorded.get("out_dir") or recorded["checkpoint"]).resolve()
    return named in (run, run / "checkpoints")


def branch_too_short(path: Path, step: int, max_steps: int, schedule: dict) -> str:
    """The refusal of a branch from ``path`` (at ``step``) whose ``train.max_steps`` is not past it: for this
    shorter schedule, an earlier checkpoint of the source (the newest before the branch's decay, when one is left);
    or a longer ``train.max_steps`` to train on past the source."""
    decay = ScheduleConfig(decay_steps=schedule.get("decay_steps"), decay_fraction=schedule.get("decay_fraction"))
    start = decay.decay_start(max_steps)
    latest = start if start is not None else max_steps - 1
    earlier = [c.path for c in complete_checkpoints(path.parent) if c.step <= latest]
    found = f"{earlier[-1]} is one" if earlier else f"none is left in {path.parent}"
    what = f"its decay starts at step {start}" if start is not None else "its last step is the step before"
    longer = f" (e.g. {step + decay.decay_length(max_steps)}, the step plus the decay)" if start is not None else ""
    return (f"checkpoint.branch_from={path} is at step {step}, and the branch's train.max_steps={max_steps} leaves "
            f"nothing to train. For a run of {max_steps} steps, branch from a checkpoint of the source at step "
            f"{latest} or earlier ({what}): {found}. To train on past step {step}, set train.max_steps above {step}"
            f"{longer}.")


def check_branch_out_dir(branch_from: str, out_dir: str | Path) -> None:
    """Stop (exit 2) when ``out_dir`` and the run that ``checkpoint.branch_from`` names overlap: the source run's
    folder (the parent of its ``checkpoints/``; the checkpoint folder itself when it lies elsewhere) and everything
    under it are only read, and the source run prunes its old checkpoints as it trains on (a branch inside one would
    go with it); and when it is a URL (a branch reads its source from a local folder). Reads files only, writes
    nothing: called before ``out_dir`` is made, and by the dry run."""
    if is_remote(branch_from):
        raise fail(f"checkpoint.branch_from={branch_from} is a URL: a branch reads its source checkpoint from a local "
                   "folder. Copy the checkpoint down first (e.g. `aws s3 sync URL/checkpoints/step_N "
                   "runs/SOURCE/checkpoints/step_N`), then pass checkpoint.branch_from=runs/SOURCE/checkpoints/step_N.")
    source = resolve_checkpoint(branch_from).resolve()
    source_run = source.parent.parent if source.parent.name == "checkpoints" else (
        source.parent if source.name == "checkpoints" else source)
    out = Path(out_dir).resolve()
    if source_run in out.parents:
        what = ("checkpoint.branch_from" if source_run == source else
                f"the run folder of checkpoint.branch_from={branch_from}")
        raise fail(f"out_dir={out_dir} lies inside {source_run}, {what}: a branch only reads its source run, whose "
                   "folder holds that run's files alone, and a run prunes its old checkpoints as it trains on (a "
                   "branch inside one would go with it). Choose an out_dir outside it, e.g. "
                   f"out_dir={source_run.parent / source_run.name}_branch.")
    if out == source_run or out in source_run.parents:
        raise fail(f"checkpoint.branch_from={source} lies in this run's out_dir={out_dir}: a branch writes its own "
                   "checkpoints and must not write into the run it branches from. Choose a new out_dir for the "
                   "branch (e.g. out_dir=runs/NAME_decay).")


def _check_expert_layer(path: Path, saved_config: dict, run_config: dict) -> None:
    """A checkpoint of DeepSpeed AutoEP's MoE layers resumes into AutoEP's layers (at any size, process count and
    ZeRO stage: through the topology-free form), one of the model class's own block into that block: the two name
    and shape their parameters differently, so a change between them is refused."""
    saved, ours = autoep_size_of(saved_config), autoep_size_of(run_config)
    if (saved is None) == (ours is None):
        return
    if saved is not None:
        raise fail(f"{path} was saved with DeepSpeed AutoEP's MoE layers (distributed.expert_parallel_size={saved}), "
                   "and this run uses the model class's own MoE block, whose parameters are named and shaped "
                   "differently (fused experts.gate_up_proj/down_proj, not AutoEP's experts.w1/w2/w3). Resume with "
                   "distributed.expert_layer=autoep (any distributed.expert_parallel_size that divides the experts and "
                   "the process count), or start a new run from its weights: python tools/export_hf.py "
                   f"{path} EXPORT --dtype fp32, then model.init_from=EXPORT checkpoint.resume=none "
                   "distributed.expert_layer=hf.")
    raise fail(f"{path} was saved with the model class's own MoE block, and this run uses DeepSpeed AutoEP's MoE "
               f"layers (distributed.expert_parallel_size={ours}), whose parameters are named and shaped differently "
               "(AutoEP's experts.w1/w2/w3, not the fused experts.gate_up_proj/down_proj). Resume with "
               "distributed.expert_layer=hf and distributed.expert_parallel_size=1 (any process count and ZeRO "
               "stage).")


# --------------------------------------------------------------------------------------------------
# Converting a checkpoint to its topology-free form (every rank its share)


def branch_record(path: Path, saved: dict) -> dict:
    """What a branch records of its source checkpoint ``path`` (``saved``: its ``train_state.json``): the folder,
    its step, and the source run's ``out_dir``."""
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return {"checkpoint": str(path), "step": int(saved["state"]["step"]), "out_dir": str(run)}


def portable_form(accelerator, path: Path, saved: dict, model, root: Path, beside: bool = True) -> Path:
    """The topology-free form of checkpoint ``path`` (``saved``: its ``train_state.json``), cached beside it
    (``step_XXXXXXXX.portable``) or else in ``root`` (only there when not ``beside``: a branch's source is only
    read): reused when cached, else converted once, every rank writing its share of the parameters."""
    from accelerate.utils import broadcast_object_list

    digest = state_sha256(path, STATE_FILE)
    outcome = [None, None, None]  # (folder, the temporary folder to fill or None when cached, error)
    if accelerator.is_main_process:
        outcome = _portable_target(path, digest, root, beside)
    broadcast_object_list(outcome)
    folder, building, error = outcome
    if error is not None:
        raise fail(error)
    if building is not None:
        _convert(accelerator, path, saved, model, Path(building), Path(folder), digest)
    return Path(folder)


def _portable_target(path: Path, digest: str, root: Path, beside: bool = True) -> list:
    """Main process: [cache folder, temporary folder to build it in (None: cached), error]."""
    error = None
    places = (portable_dir(path), portable_dir(path, root)) if beside else (portable_dir(path, root),)
    for dest in dict.fromkeys(places):
        if cached_portable(dest, digest):
            logger.info("Using the topology-free form of %s cached in %s", path, dest)
            return [str(dest), None, None]
        if stale_form(dest):
            logger.info("%s holds the topology-free form of earlier code (format 1); converting %s again", dest, path)
        try:
            return [str(dest), str(temp_dir_for(dest)), None]
        except OSError as err:  # read-only checkpoint storage: try the run's own folder
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            error = f"Cannot write the topology-free form of {path} to {dest}: {err}."
    return [None, None, error]


def _convert(accelerator, path: Path, saved: dict, model, tmp: Path, dest: Path, digest: str) -> None:
    """Every rank writes its files of the topology-free form into ``tmp``; then the main process writes the indexes
    and renames ``tmp`` to ``dest``. A failure on any rank stops every rank with its message."""
    from accelerate.utils import gather_object

    acc = accelerator
    start = time.perf_counter()
    saved_on = saved_layout(saved)
    names = optimizer_param_names(unwrap_model(acc, model), bool(saved["config"]["optim"].get("decay_embeddings")))
    source = plan = error = None
    try:
        source = open_source(path, deepspeed_dir=path / DS_TAG if saved_on.zero.deepspeed else None, param_names=names,
                             tensor_parallel=(saved_on.tensor_parallel_size, saved.get(TP_RECORD, {})))
        plan = plan_shards(source.shapes, acc.num_processes)
        write_share(source, plan, tmp, acc.process_index, progress=acc.is_main_process)
    except UserError as err:
        error = str(err)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        error = (f"Converting checkpoint {path} to its topology-free form failed: {type(err).__name__}: "
                 f"{str(err)[:300]}. A file of it is damaged, or was written by different code, or {tmp.parent} "
                 f"is full. {use_earlier(path)}")
    errors = [e for e in gather_object([error]) if e is not None]
    try:
        if not errors and acc.is_main_process:
            finish(tmp, plan, source.steps, source_layout=saved_on, source_sha256=digest)
            install_dir(tmp, dest, overwrite=True)
            logger.info("Converted %s to its topology-free form %s on %d processes (%d parameters, %.1f MB, %.1f s)",
                        path, dest, acc.num_processes, len(plan.shapes),
                        sum(f.stat().st_size for f in dest.iterdir()) / 1e6, time.perf_counter() - start)
    finally:
        if source is not None:
            source.close()
        if errors and acc.is_main_process:
            remove_path(tmp)
    if errors:
        raise fail(errors[0])
    acc.wait_for_everyone()
