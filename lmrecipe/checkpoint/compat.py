"""What a resume must match: the checkpoint's model shape, data meaning, sample order and fixed config keys.

A change of any of them stops the resume with one message listing ``old -> new`` per key; allowed changes are listed
in the log. A schedule that gives the checkpoint's next step another learning rate stops the resume too, whatever
the schedule (:func:`check_lr_continues`), unless ``checkpoint.allow_lr_change`` accepts it; a warmup-stable-decay
run lengthened in its stable phase keeps its rate and continues. A branch (``checkpoint.branch_from``) may change the data sources
and the schedule: it is a new run from the checkpoint.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

from lmrecipe.config import ScheduleConfig, fixed_on_resume_keys, flatten_config, resolved_expert_layer
from lmrecipe.data.tokenizer import tokenizer_differences
from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

# Shape-defining fields of the transformers config, compared too (catches a changed model.init_from).
HF_SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "tie_word_embeddings",
)


# Fixed keys whose null the run resolves (from the data, num_heads, hidden_size, seq_len): compared as resolved, from
# each side's transformers config, so spelling out the value a null became is no change.
_RESOLVED_FROM_HF = {
    "model.vocab_size": "vocab_size", "model.num_kv_heads": "num_key_value_heads",
    "model.intermediate_size": "intermediate_size", "model.max_position_embeddings": "max_position_embeddings",
}


def _resolved(flat: dict, hf_config: dict) -> dict:
    resolved = {**flat, **{key: hf_config[hf_key] for key, hf_key in _RESOLVED_FROM_HF.items()
                           if flat.get(key) is None and hf_config.get(hf_key) is not None}}
    # A resume onto another size (auto at 2 -> autoep at 1) compares the layer each picks.
    resolved["distributed.expert_layer"] = resolved_expert_layer(flat.get("distributed.expert_layer", "auto"),
                                                                 int(flat.get("distributed.expert_parallel_size") or 1))
    return resolved


def _mixture_key(mixture: list[dict] | None) -> list[tuple] | None:
    """What fixes the order of a mixture: source names (their permutations' seeds) and quotas (the pattern)."""
    return None if mixture is None else [(s["name"], s["quota"]) for s in mixture]


def _describe_mixture(mixture: list[dict] | None) -> str:
    if mixture is None:
        return "one folder (data.path)"
    return "mixture " + ", ".join(f"{s['name']} {s['weight']:.4g}" for s in mixture)


def check_resume_compatible(saved: dict, path: Path, *, run_config: dict, hf_config: dict, data_signature: dict,
                            lr_schedule: Callable[[int], float], branch: bool = False) -> None:
    """Stop (UserError) when checkpoint ``path`` (``saved``: its ``train_state.json``) cannot continue as this run:
    ``run_config`` the resolved config, ``hf_config`` the model's transformers config, ``data_signature`` the data's.
    ``branch``: this run branches from the checkpoint (``checkpoint.branch_from``): other data sources are allowed."""
    fixed_keys = fixed_on_resume_keys()
    old_hf, new_hf = saved.get("hf_config", {}), hf_config
    old, new = flatten_config(saved["config"]), flatten_config(run_config)
    old_resolved, new_resolved = _resolved(old, old_hf), _resolved(new, new_hf)
    problems = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in fixed_keys if old_resolved.get(k) != new_resolved.get(k)]
    problems += [f"model config {k}: {old_hf[k]!r} -> {new_hf[k]!r}"
                 for k in HF_SHAPE_KEYS if k in old_hf and k in new_hf and old_hf[k] != new_hf[k]]
    old_data, new_data = saved.get("data", {}), data_signature
    tokenizer = [f"data {label}: {a!r} -> {b!r}" for label, a, b in tokenizer_differences(old_data, new_data)]
    problems += tokenizer
    old_mix, new_mix = _mixture_key(old_data.get("mixture")), _mixture_key(new_data.get("mixture"))
    if old_mix != new_mix and not branch:
        problems.append(f"data sources: {_describe_mixture(old_data.get('mixture'))} -> "
                        f"{_describe_mixture(new_data.get('mixture'))}")
    if branch and not tokenizer:
        fix = ("Branch with the source's settings for these keys (they fix its weights' shape, optimizer state or "
               f"data position), or start a new run from its weights: python tools/export_hf.py {path} EXPORT "
               "--dtype fp32, then model.init_from=EXPORT checkpoint.branch_from=null.")
    elif tokenizer:
        # Its weights learned the ids of its own tokenizer: a new run from them (model.init_from) needs that data too.
        fix = ("Resume on data prepared with the checkpoint's tokenizer, whose files it holds: python "
               f"tools/prepare_data.py --input CORPUS --tokenizer {path}/hf --output NEW_DATA, then data.path=NEW_DATA.")
    else:
        fix = ("Resume with the checkpoint's settings, or start a new run from its weights: python tools/export_hf.py "
               f"{path} EXPORT --dtype fp32, then model.init_from=EXPORT checkpoint.resume=none.")
    if problems:
        raise fail(f"Cannot {'branch' if branch else 'resume'} from {path}: this run differs in what the checkpoint's weights, optimizer state or "
                   f"data position depend on ({'; '.join(problems)}). {fix}")
    changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if k not in fixed_keys and old.get(k) != new.get(k)]
    if changed:
        logger.info("%s with changed settings (allowed): %s", "Branching" if branch else "Resuming", "; ".join(changed))
    if new_mix is None and new_data.get("train_sha256") != old_data.get("train_sha256"):
        logger.warning("The training data differs from the checkpoint's (train.bin sha256); the run continues "
                       "at the same sample index of the new data.")
    for old_source, new_source in zip(old_data.get("mixture") or [], new_data.get("mixture") or []):
        if old_source.get("train_sha256") != new_source.get("train_sha256"):
            logger.warning("The training data of source %s differs from the checkpoint's (%s -> %s, train.bin "
                           "sha256); the run continues at the same sample index of the new data.",
                           new_source["name"], old_source.get("path"), new_source.get("path"))
    check_lr_continues(saved, path, new, lr_schedule, branch)


LR_KEYS = ("train.max_steps", "optim.lr", "optim.min_lr", "schedule.warmup_steps", "schedule.decay",
           "schedule.decay_steps", "schedule.decay_fraction", "train.batch_ramp_lr_scaling")
"""The keys that give a step its learning rate, named when a resume would change it."""


def check_lr_continues(saved: dict, path: Path, new: dict, lr_schedule: Callable[[int], float], branch: bool) -> None:
    """Stop when this run's schedule (``lr_schedule``; ``new``: its flat config) trains the next step of checkpoint
    ``path`` at another rate than the checkpoint's own schedule gave it (``saved["schedule"]["next_lr"]``), whatever
    the schedule: the optimizer state continues at a rate it was not trained for. Allowed: a branch (a new run with
    its own schedule), a warmup-stable-decay run lengthened in its stable phase (its decay moves, the rate does not
    jump), and any change with ``checkpoint.allow_lr_change=true`` (logged as a warning)."""
    step = int(saved["state"]["step"])
    lr_now, lr_saved = lr_schedule(step), saved["schedule"]["next_lr"]
    if math.isclose(lr_now, lr_saved, rel_tol=1e-9, abs_tol=1e-15):
        return
    if branch:
        logger.info("The branch's schedule trains step %d at learning rate %.6g (the source's at %.6g).", step,
                    lr_now, lr_saved)
        return
    if _stable_decay_moved(saved, lr_now):
        logger.info("Step %d is in the stable phase of the checkpoint's warmup-stable-decay schedule: with this "
                    "run's schedule it trains at %.6g (the decay moved with train.max_steps).", step, lr_now)
        return
    if new.get("checkpoint.allow_lr_change"):
        logger.warning("The learning rate of step %d changes from %.6g (as saved) to %.6g with this run's schedule "
                       "(accepted by checkpoint.allow_lr_change=true).", step, lr_saved, lr_now)
        return
    raise fail(_lr_refusal(saved, path, new, lr_now))


def _lr_refusal(saved: dict, path: Path, new: dict, lr_now: float) -> str:
    """The refusal of a resume whose schedule moves the rate of the checkpoint's next step to ``lr_now``: the keys
    that moved it, and the ways on."""
    step, lr_saved = int(saved["state"]["step"]), saved["schedule"]["next_lr"]
    old = flatten_config(saved["config"])
    keys = [k for k in LR_KEYS if old.get(k) != new.get(k)]
    cause = "; ".join(f"{k}: {_yaml(old.get(k))} -> {_yaml(new.get(k))}" for k in keys) or "no schedule key changed"
    ratio = f", {lr_now / lr_saved:.3g}x" if lr_saved > 0 else ""
    decay = _decay_message(saved, step)
    restore = " ".join(f"{k}={_yaml(old.get(k))}" for k in keys) or "its recipe"
    ways = [f"resume with the checkpoint's schedule ({restore}){' to finish the decay' if decay else ''}"]
    if step >= int(new.get("schedule.warmup_steps") or 0) and not _is_wsd(new):
        ways.append(f"train on at the rate it reached (schedule.decay=constant optim.lr={lr_saved:.6g} with a longer "
                    "train.max_steps)")
    ways.append(f"branch a new run with the new schedule into its own folder (out_dir=NEW_DIR "
                f"checkpoint.branch_from={path}{_stable_hint(saved)})")
    return (f"Cannot resume from {path}: {decay}this run's schedule ({cause}) would train its next step, {step}, at "
            f"learning rate {lr_now:.6g} instead of {lr_saved:.6g} (as saved{ratio}), a jump the optimizer state was "
            f"not trained for. To go on, {', '.join(ways[:-1])}, or {ways[-1]}; or accept the jump with "
            "checkpoint.allow_lr_change=true.")


def _is_wsd(flat: dict) -> bool:
    return flat.get("schedule.decay_steps") is not None or flat.get("schedule.decay_fraction") is not None


def _saved_schedule(saved: dict) -> tuple[ScheduleConfig, int]:
    """The checkpoint's schedule section (its warmup-stable-decay keys) and its ``train.max_steps``."""
    old_schedule = saved["config"].get("schedule", {})
    schedule = ScheduleConfig(decay_steps=old_schedule.get("decay_steps"),
                              decay_fraction=old_schedule.get("decay_fraction"))
    return schedule, int(saved["config"]["train"]["max_steps"])


def _stable_decay_moved(saved: dict, lr_now: float) -> bool:
    """Whether the checkpoint is in the stable phase of its warmup-stable-decay schedule (no step of its decay
    trained) and ``lr_now`` is its stable rate: a longer run moved the decay, the rate does not jump."""
    schedule, old_max = _saved_schedule(saved)
    start = schedule.decay_start(old_max)
    if start is None or int(saved["state"]["step"]) > start:
        return False
    return math.isclose(lr_now, float(saved["config"]["optim"]["lr"]), rel_tol=1e-9)


def _decay_message(saved: dict, step: int) -> str:
    """For a checkpoint in the decay of its warmup-stable-decay schedule: how far in, to open the refusal."""
    schedule, old_max = _saved_schedule(saved)
    start = schedule.decay_start(old_max)
    if start is None or step <= start:
        return ""
    return (f"it has trained {step - start} step(s) of the decay of its warmup-stable-decay schedule (steps "
            f"{start}..{old_max - 1} of train.max_steps={old_max}), and ")


def _stable_hint(saved: dict) -> str:
    """Where a warmup-stable-decay checkpoint's branch should start: a checkpoint of the stable phase."""
    schedule, old_max = _saved_schedule(saved)
    start = schedule.decay_start(old_max)
    if start is None or int(saved["state"]["step"]) <= start:
        return ""
    return f", or better from a checkpoint of its stable phase, step {start} or earlier"


def _yaml(value) -> str:
    return "null" if value is None else str(value)
