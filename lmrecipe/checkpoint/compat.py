"""What a resume must match: the checkpoint's model shape, data meaning, sample order and fixed config keys.

A change of any of them stops the resume with one message listing ``old -> new`` per key; allowed changes are listed
in the log, and a learning rate that changes with the new schedule is a warning, or a refusal when the checkpoint
is in the decay of a warmup-stable-decay schedule (a jump back up). A branch (``checkpoint.branch_from``) may change
the data sources and the schedule: it is a new run from the checkpoint.
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
    step = saved["state"]["step"]
    lr_now = lr_schedule(step)
    lr_saved = saved["schedule"]["next_lr"]
    if math.isclose(lr_now, lr_saved, rel_tol=1e-9, abs_tol=1e-15):
        return
    if branch:
        logger.info("The branch's schedule trains step %d at learning rate %.6g (the source's at %.6g).", step,
                    lr_now, lr_saved)
        return
    if check_decay_continues(saved, path, new, lr_now):
        logger.info("Step %d is in the stable phase of the checkpoint's warmup-stable-decay schedule: with this "
                    "run's schedule it trains at %.6g (the decay moved with train.max_steps).", step, lr_now)
        return
    logger.warning("The learning rate of step %d changes from %.6g (as saved) to %.6g with this recipe's "
                   "schedule.", step, lr_saved, lr_now)


def check_decay_continues(saved: dict, path: Path, new: dict, lr_now: float) -> bool:
    """Stop when checkpoint ``path`` has trained steps of the decay of its warmup-stable-decay schedule and this
    run's schedule (``new``: its flat config) gives its next step another rate ``lr_now``: the rate would jump (a
    longer run moves the decay only while the run is in its stable phase). True when the checkpoint is in its
    stable phase and the new rate is its stable rate (the decay moved), else False."""
    old_config = saved["config"]
    old_schedule = old_config.get("schedule", {})
    schedule = ScheduleConfig(decay_steps=old_schedule.get("decay_steps"),
                              decay_fraction=old_schedule.get("decay_fraction"))
    old_max = int(old_config["train"]["max_steps"])
    start = schedule.decay_start(old_max)
    step = int(saved["state"]["step"])
    if start is None:
        return False
    if step <= start:  # no step of the decay trained yet: the rates so far are the stable ones
        return math.isclose(lr_now, float(old_config["optim"]["lr"]), rel_tol=1e-9)
    raise fail(f"Cannot resume from {path}: it has trained {step - start} step(s) of the decay of its "
               f"warmup-stable-decay schedule (steps {start}..{old_max - 1} of train.max_steps={old_max}), and this "
               f"run's schedule (train.max_steps={new.get('train.max_steps')}, schedule.decay_steps="
               f"{_yaml(new.get('schedule.decay_steps'))}, schedule.decay_fraction="
               f"{_yaml(new.get('schedule.decay_fraction'))}) would move its learning rate from "
               f"{saved['schedule']['next_lr']:.6g} to {lr_now:.6g}. Resume with the checkpoint's schedule "
               f"(train.max_steps={old_max}) to finish the decay, or branch a longer run from a checkpoint of the "
               f"stable phase (step {start} or earlier): out_dir=NEW_DIR checkpoint.branch_from=CHECKPOINT "
               "train.max_steps=... with the new schedule.")


def _yaml(value) -> str:
    return "null" if value is None else str(value)
