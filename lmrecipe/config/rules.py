"""Every refusal of a combination of settings that the configuration alone decides: one row per rule.

A row names the rule, says when it is broken (``applies``), what is wrong (``message``) and how to fix it (``fix``);
:func:`check_rules` reports every broken row at once (exit code 2). A refusal of one field on its own (a range, a name)
is that section's ``validate`` (``sections/``). What only the launch knows stays where it is known:
the process count, the GPU, the installed libraries (``lmrecipe/parallel/``: ``build_runtime``,
``check_*_topology``), what a DeepSpeed JSON file says (its ZeRO stage and offload: ``check_*_stage``,
``load_deepspeed_config``), and the shape of a model continued from ``model.init_from`` (its own ``config.json``:
``check_*_model``, and the position limit in ``train/setup.py``).

What each parallel split supports, at a glance (the rows below are the contract):

- Tensor parallelism (``distributed.tensor_parallel_size`` > 1, DeepSpeed AutoTP): needs a DeepSpeed config of ZeRO
  stage 0-2 (ZeRO-3 is refused once the JSON is read); the split must divide the attention heads, the key/value heads
  and the MLP width; not with sequence parallelism, a weight EMA, ``eval.tasks``, ``eval.samples``, Muon, fp8,
  ``train.compile`` or ``logging.layer_stats``.
- Mixture of experts (``model.num_experts`` > 0, ``docs/moe.md``): ``model.arch`` qwen3_moe, qwen2_moe, mixtral,
  deepseek_v3 or qwen3_5_moe_text (``model.shared_experts``: 1 for qwen2_moe, deepseek_v3 and qwen3_5_moe_text, 0 for
  the others; the DeepSeek-V3 and Qwen3.5-MoE keys only on their architecture); not with tensor or sequence parallelism, fp8, Muon, ``train.compile`` or
  ``logging.layer_stats``. DeepSpeed AutoEP (``distributed.expert_parallel_size`` > 1, or ``distributed.expert_layer``
  autoep) needs DeepSpeed (ZeRO 1-3) and a split that divides the experts (and the process count: checked at launch);
  not with ``model.init_from``, a weight EMA, ``eval.tasks``, ``eval.samples`` or activation checkpointing.
- Sequence parallelism (``distributed.sequence_parallel_size`` > 1, Ulysses): needs a DeepSpeed config (any stage,
  but not ZeRO-1 in bf16 or fp8: refused once the JSON is read); the split must divide the attention heads, divide or
  be a multiple of the key/value heads (fewer key/value heads than the split are replicated), and divide
  ``data.seq_len``; needs sdpa or a flash kernel (not ``eager``, ``varlen`` or ``flex_attention``); not with ``eval.tasks``,
  ``eval.samples`` or ``logging.layer_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Union

from lmrecipe.config.sections import MOE_ARCHS, SHARED_EXPERT_ARCHS, Config, TrainConfig, fail_all
from lmrecipe.config.sections.model import DEEPSEEK_V3_KEYS, QWEN3_5_MOE_KEYS, ModelConfig

Text = Union[str, Callable[[Config], str]]


@dataclass(frozen=True)
class Rule:
    """One refused combination: ``applies(cfg)`` is true when ``cfg`` breaks it."""

    name: str
    """Names the rule in tests and in this table (``tensor_parallel_without_fp8``)."""
    applies: Callable[[Config], bool]
    """True when the config breaks the rule; it may assume every section passed its own ``validate``."""
    message: Text
    """What is wrong, naming the keys and their values."""
    fix: Text = ""
    """What to set instead (may be empty when the message says it)."""

    def text(self, cfg: Config) -> str:
        """The message and the fix for ``cfg``, as the user reads them."""
        parts = [part(cfg) if callable(part) else part for part in (self.message, self.fix)]
        return " ".join(part for part in parts if part)


SizedText = Union[str, Callable[[int, Config], str]]

_ARCH_KEYS = {"deepseek_v3": DEEPSEEK_V3_KEYS, "qwen3_5_moe_text": QWEN3_5_MOE_KEYS}
"""The ``model`` keys that only one architecture builds."""


def _foreign_keys(m: ModelConfig) -> list[str]:
    """The architecture-only keys a recipe sets for another ``model.arch`` than theirs (built from scratch)."""
    return [f"model.{key}={getattr(m, key)} ({arch})" for arch, keys in _ARCH_KEYS.items()
            if m.arch != arch and m.init_from is None for key in keys if getattr(m, key) is not None]


def _deepseek(m: ModelConfig, key: str, default: int) -> int:
    """A DeepSeek-V3 key's value, the class's default where null."""
    value = getattr(m, key)
    return default if value is None else value


def _group_problem(m: ModelConfig) -> str:
    """What is wrong with DeepSeek-V3's expert groups (empty when nothing): ``n_group`` divides the experts, the
    groups chosen are among them, each group holds the 2 experts its score sums, and the chosen groups hold the
    token's experts."""
    if m.arch != "deepseek_v3" or not m.is_moe() or m.init_from is not None:
        return ""
    groups, chosen = _deepseek(m, "expert_groups", 8), _deepseek(m, "expert_groups_per_token", 4)
    if m.num_experts % groups or m.num_experts // groups < 2:
        return (f"model.expert_groups={groups} must divide model.num_experts={m.num_experts} into groups of at least 2 "
                "experts (a group's score is the sum of its 2 best experts' scores).")
    if chosen > groups:
        return f"model.expert_groups_per_token={chosen} cannot exceed model.expert_groups={groups}."
    if m.experts_per_token > chosen * (m.num_experts // groups):
        return (f"model.experts_per_token={m.experts_per_token} exceeds the experts of the model.expert_groups_per_token"
                f"={chosen} chosen groups ({chosen} x {m.num_experts // groups}).")
    return ""


def _split_rule(key: str, name: str, applies: Callable[[int, Config], bool], message: SizedText, fix: SizedText) -> Rule:
    """A rule of a parallel split that is on (``distributed.<key>`` > 1), named ``<split>_<name>``: ``applies``,
    ``message`` and ``fix`` take the split's size first, then the config."""
    size = attrgetter(f"distributed.{key}")

    def sized(text: SizedText) -> Text:
        return text if isinstance(text, str) else lambda c: text(size(c), c)

    return Rule(f"{key.removesuffix('_size')}_{name}", lambda c: size(c) > 1 and applies(size(c), c), sized(message),
                sized(fix))


def _sequence_parallel(name: str, applies: Callable[[int, Config], bool], message: SizedText, fix: SizedText) -> Rule:
    return _split_rule("sequence_parallel_size", name, applies, message, fix)


def _tensor_parallel(name: str, applies: Callable[[int, Config], bool], message: SizedText, fix: SizedText) -> Rule:
    return _split_rule("tensor_parallel_size", name, applies, message, fix)


def _tp_refuses(name: str, applies: Callable[[Config], bool], setting: Callable[[Config], str], fix: str) -> Rule:
    """A setting that tensor parallelism does not support."""
    return _tensor_parallel(
        name, lambda tp, c: applies(c),
        lambda tp, c: f"distributed.tensor_parallel_size={tp} cannot be combined with {setting(c)} in this recipe.",
        f"Choose {fix}, or set distributed.tensor_parallel_size=1.")


def _moe_refuses(name: str, applies: Callable[[Config], bool], setting: Callable[[Config], str], fix: str) -> Rule:
    """A setting that mixture-of-experts models (``model.num_experts`` > 0) do not support in this recipe."""
    return Rule(f"moe_{name}", lambda c: c.model.is_moe() and applies(c),
                lambda c: f"model.num_experts={c.model.num_experts} (a mixture-of-experts model) cannot be combined "
                          f"with {setting(c)} in this recipe.",
                f"Choose {fix}, or train a dense model (model.num_experts=0).")


def _autoep_refuses(name: str, applies: Callable[[Config], bool], setting: Callable[[Config], str], fix: str) -> Rule:
    """A setting that DeepSpeed AutoEP's MoE layers (``distributed.expert_layer``) do not support in this recipe."""
    return Rule(f"autoep_{name}", lambda c: c.distributed.uses_autoep() and applies(c),
                lambda c: f"DeepSpeed AutoEP's MoE layers (distributed.expert_parallel_size="
                          f"{c.distributed.expert_parallel_size}, distributed.expert_layer="
                          f"{c.distributed.expert_layer}) cannot be combined with {setting(c)} in this recipe.",
                f"Choose {fix}, or train the model class's own MoE block (distributed.expert_parallel_size=1, "
                "distributed.expert_layer=hf).")


def _uneven_ramp_sizes(train: TrainConfig) -> list[int]:
    """The batch-size ramp's step sizes that are not whole micro-batches."""
    return [size for _, size in train.ramp_points() if size % train.micro_batch_size]


def _multiple_below(value: int, unit: int) -> int:
    """The largest multiple of ``unit`` not above ``value``, at least ``unit``."""
    return max(unit, value // unit * unit)


RULES: tuple[Rule, ...] = (
    # --- The model's shape
    Rule("heads_divide_hidden_size",
         lambda c: c.model.hidden_size % c.model.num_heads != 0,
         lambda c: f"model.hidden_size={c.model.hidden_size} must be divisible by model.num_heads={c.model.num_heads}."),
    Rule("kv_heads_divide_heads",
         lambda c: c.model.num_heads % c.model.kv_heads() != 0,
         lambda c: f"model.num_kv_heads={c.model.kv_heads()} must be a positive divisor of model.num_heads="
                   f"{c.model.num_heads}."),
    Rule("window_within_positions",
         lambda c: (c.model.init_from is None and c.model.max_position_embeddings is not None
                    and c.data.seq_len > c.model.max_position_embeddings),
         lambda c: f"data.seq_len={c.data.seq_len} exceeds the model's max_position_embeddings="
                   f"{c.model.max_position_embeddings}.",
         "Lower data.seq_len or raise model.max_position_embeddings."),
    Rule("varlen_needs_document_masking",
         lambda c: c.model.attn_implementation == "varlen" and not c.data.document_masking,
         "model.attn_implementation=varlen runs attention per document, from the boundaries data.document_masking "
         "provides, and data.document_masking=false.",
         "Set data.document_masking=true, or model.attn_implementation=sdpa for causal attention over whole windows."),

    # --- Mixture of experts (docs/moe.md)
    Rule("qwen3_5_moe_is_multimodal",
         lambda c: c.model.arch == "qwen3_5_moe" and c.model.init_from is None,
         "model.arch=qwen3_5_moe is Qwen3.5-MoE's multimodal config (a vision tower around a text model whose shape "
         "keys are its own: the model.* keys would not reach it, and its width would stay 2048).",
         "Set model.arch=qwen3_5_moe_text, the text model (its DeepSpeed AutoEP preset is the same)."),
    Rule("architecture_keys_of_another_architecture",
         lambda c: bool(_foreign_keys(c.model)),
         lambda c: f"{', '.join(_foreign_keys(c.model))}: these keys build only the architecture named in brackets, and "
                   f"model.arch={c.model.arch}.",
         "Remove them (null), or set model.arch to their architecture."),
    Rule("deepseek_v3_has_no_auxiliary_loss",
         lambda c: c.model.arch == "deepseek_v3" and c.model.is_moe() and c.model.router_aux_loss_coef > 0,
         lambda c: f"model.router_aux_loss_coef={c.model.router_aux_loss_coef} with model.arch=deepseek_v3: "
                   "DeepSeek-V3's model class computes no load-balancing loss, so the coefficient would do nothing.",
         "Set model.router_aux_loss_coef=0."),
    Rule("deepseek_v3_has_no_grouped_query_attention",
         lambda c: c.model.arch == "deepseek_v3" and c.model.kv_heads() != c.model.num_heads,
         lambda c: f"model.num_kv_heads={c.model.num_kv_heads} with model.arch=deepseek_v3: latent attention expands "
                   f"keys and values for every one of the model.num_heads={c.model.num_heads} heads from one latent "
                   "(model.kv_lora_rank); it has no key/value head count of its own.",
         "Set model.num_kv_heads=null."),
    Rule("deepseek_v3_expert_groups", lambda c: bool(_group_problem(c.model)), lambda c: _group_problem(c.model),
         "Choose model.expert_groups, model.expert_groups_per_token and model.experts_per_token that fit (DeepSeek-V3: "
         "256 experts, 8 groups, 4 chosen, 8 per token)."),
    Rule("deepseek_v3_dense_layers_within_layers",
         lambda c: c.model.arch == "deepseek_v3" and _deepseek(c.model, "dense_layers", 3) >= c.model.num_layers,
         lambda c: f"model.dense_layers={_deepseek(c.model, 'dense_layers', 3)} (the first layers with a dense MLP; null is "
                   f"3) leaves none of the model.num_layers={c.model.num_layers} layers with experts.",
         "Lower model.dense_layers (0: every layer has experts) or raise model.num_layers."),
    Rule("qwen3_5_moe_linear_heads",
         lambda c: (c.model.arch == "qwen3_5_moe_text"
                    and (c.model.linear_value_heads or 32) % (c.model.linear_key_heads or 16) != 0),
         lambda c: f"model.linear_value_heads={c.model.linear_value_heads or 32} must be a multiple of "
                   f"model.linear_key_heads={c.model.linear_key_heads or 16} (each key head serves as many value "
                   "heads; null: 32 and 16).",
         "Choose value heads that the key heads divide."),
    Rule("moe_architecture",
         lambda c: (c.model.is_moe() and c.model.init_from is None and c.model.arch not in MOE_ARCHS
                    and c.model.arch != "qwen3_5_moe"),
         lambda c: f"model.num_experts={c.model.num_experts} needs a mixture-of-experts architecture, not "
                   f"model.arch={c.model.arch}.",
         f"Choose model.arch from {', '.join(MOE_ARCHS)}, or set model.num_experts=0 for a dense model."),
    Rule("moe_architecture_needs_experts",
         lambda c: c.model.arch in MOE_ARCHS and c.model.init_from is None and not c.model.is_moe(),
         lambda c: f"model.arch={c.model.arch} is a mixture-of-experts architecture but model.num_experts=0 (the "
                   "class's default of 128 experts would be built silently).",
         "Set model.num_experts (e.g. 8) and model.experts_per_token, or choose a dense model.arch (llama)."),
    Rule("moe_shared_experts",
         lambda c: (c.model.is_moe() and c.model.init_from is None
                    and c.model.shared_experts != SHARED_EXPERT_ARCHS.get(c.model.arch, 0)),
         lambda c: f"model.shared_experts={c.model.shared_experts}: model.arch={c.model.arch} has "
                   f"{SHARED_EXPERT_ARCHS.get(c.model.arch, 0) or 'no'} shared expert(s) per layer.",
         lambda c: f"Set model.shared_experts={SHARED_EXPERT_ARCHS.get(c.model.arch, 0)}" + (
             "" if c.model.arch in SHARED_EXPERT_ARCHS else ", or model.arch=qwen2_moe (one shared expert)") + "."),
    Rule("experts_need_a_moe_model",
         lambda c: c.model.init_from is None and not c.model.is_moe() and (
             c.distributed.uses_autoep() or c.distributed.expert_layer != "auto"),
         lambda c: f"distributed.expert_parallel_size={c.distributed.expert_parallel_size} / "
                   f"distributed.expert_layer={c.distributed.expert_layer} split or replace MoE layers, and this model "
                   "has none (model.num_experts=0).",
         "Set model.num_experts (with an MoE model.arch), or distributed.expert_parallel_size=1 and "
         "distributed.expert_layer=auto."),
    Rule("expert_parallel_needs_autoep",
         lambda c: c.distributed.expert_parallel_size > 1 and c.distributed.expert_layer == "hf",
         lambda c: f"distributed.expert_parallel_size={c.distributed.expert_parallel_size} splits the experts "
                   "through DeepSpeed AutoEP, but distributed.expert_layer=hf keeps the model class's own block.",
         "Set distributed.expert_layer=auto (or autoep), or distributed.expert_parallel_size=1."),
    Rule("autoep_needs_deepspeed",
         lambda c: c.distributed.uses_autoep() and not c.distributed.uses_deepspeed(),
         lambda c: f"DeepSpeed AutoEP (distributed.expert_parallel_size={c.distributed.expert_parallel_size}, "
                   f"distributed.expert_layer={c.distributed.expert_layer}) runs inside DeepSpeed's engine:",
         "choose a DeepSpeed config, e.g. distributed.deepspeed_config=zero1 (ZeRO 1, 2 and 3 work), or set "
         "distributed.expert_parallel_size=1 and distributed.expert_layer=hf."),
    Rule("expert_parallel_divides_experts",
         lambda c: c.model.is_moe() and c.model.num_experts % c.distributed.expert_parallel_size != 0,
         lambda c: f"distributed.expert_parallel_size={c.distributed.expert_parallel_size} must divide "
                   f"model.num_experts={c.model.num_experts}: each rank of a group holds an equal share of the experts.",
         "Choose an expert_parallel_size that divides the expert count."),
    Rule("autoep_from_init",
         lambda c: c.distributed.uses_autoep() and c.model.init_from is not None,
         lambda c: f"model.init_from={c.model.init_from} with DeepSpeed AutoEP: continuing a Hugging Face MoE "
                   "checkpoint under AutoEP is not tested in this recipe.",
         "Set model.init_from=null, or distributed.expert_parallel_size=1 and distributed.expert_layer=hf."),
    _moe_refuses("without_tensor_parallel", lambda c: c.distributed.tensor_parallel_size > 1,
                 lambda c: f"distributed.tensor_parallel_size={c.distributed.tensor_parallel_size}",
                 "distributed.tensor_parallel_size=1 (split the experts with distributed.expert_parallel_size)"),
    _moe_refuses("without_sequence_parallel", lambda c: c.distributed.sequence_parallel_size > 1,
                 lambda c: f"distributed.sequence_parallel_size={c.distributed.sequence_parallel_size}",
                 "distributed.sequence_parallel_size=1"),
    _moe_refuses("without_fp8", lambda c: c.train.precision == "fp8", lambda c: "train.precision=fp8",
                 "train.precision=bf16 (or auto)"),
    _moe_refuses("without_muon", lambda c: c.optim.name == "muon", lambda c: "optim.name=muon", "optim.name=adamw"),
    _moe_refuses("without_compile", lambda c: c.train.compile, lambda c: f"train.compile={c.train.compile}",
                 "train.compile=none"),
    _moe_refuses("without_layer_stats", lambda c: c.logging.layer_stats, lambda c: "logging.layer_stats=true",
                 "logging.layer_stats=false (the global grad_norm and the experts' load balance are still logged)"),
    _autoep_refuses("without_ema", lambda c: c.train.ema_decay > 0, lambda c: f"train.ema_decay={c.train.ema_decay}",
                    "train.ema_decay=0 (each rank holds only its share of the experts)"),
    _autoep_refuses("without_tasks", lambda c: bool(c.eval.tasks), lambda c: f"eval.tasks={c.eval.tasks}",
                    "eval.tasks=[] and score the export with eval.py --tasks"),
    _autoep_refuses("without_samples", lambda c: bool(c.eval.samples), lambda c: f"eval.samples={c.eval.samples}",
                    "eval.samples=[] and continue prompts on the export with eval.py --generate"),
    _autoep_refuses("without_gradient_checkpointing", lambda c: c.train.gradient_checkpointing,
                    lambda c: "train.gradient_checkpointing=true", "train.gradient_checkpointing=false"),

    # --- The data
    Rule("one_data_choice",
         lambda c: bool(c.data.sources) and c.data.path is not None,
         lambda c: f"data.path={c.data.path!r} and data.sources are both set: train either on one folder (data.path) "
                   "or on a mixture (data.sources).",
         "Remove one of them, or set data.path=null to use the mixture."),
    Rule("some_data",
         lambda c: not c.data.sources and not c.data.path,
         "No training data:",
         "set data.path to a prepared folder, or data.sources to a list of them "
         "(e.g. data.sources='[{path: data/code, weight: 0.7}, {path: data/prose, weight: 0.3}]')."),

    # --- Optimizer, batch and schedule
    Rule("min_lr_within_lr",
         lambda c: c.optim.min_lr > c.optim.lr,
         lambda c: f"optim.min_lr={c.optim.min_lr} must not exceed optim.lr={c.optim.lr}."),
    Rule("one_decay_length",
         lambda c: c.schedule.decay_steps is not None and c.schedule.decay_fraction is not None,
         lambda c: f"schedule.decay_steps={c.schedule.decay_steps} and schedule.decay_fraction="
                   f"{c.schedule.decay_fraction} both set the length of the decay.",
         "Keep one of them (set the other to null)."),
    Rule("decay_after_warmup",
         lambda c: c.schedule.is_wsd() and c.schedule.decay_length(c.train.max_steps) > (
             c.train.max_steps - c.schedule.warmup_steps),
         lambda c: f"The decay of {c.schedule.decay_length(c.train.max_steps)} steps (schedule.decay_steps / "
                   f"decay_fraction) does not fit after the warmup: train.max_steps={c.train.max_steps} leaves "
                   f"{c.train.max_steps - c.schedule.warmup_steps} steps after schedule.warmup_steps="
                   f"{c.schedule.warmup_steps}.",
         "Shorten the decay or the warmup, or raise train.max_steps."),
    Rule("whole_micro_batches",
         lambda c: c.train.global_batch_size % c.train.micro_batch_size != 0,
         lambda c: f"train.global_batch_size={c.train.global_batch_size} must be a multiple of "
                   f"train.micro_batch_size={c.train.micro_batch_size}."),
    Rule("ramp_whole_micro_batches",
         lambda c: len(c.train.ramp_points()) > 1 and bool(_uneven_ramp_sizes(c.train)),
         lambda c: f"The batch-size ramp has step sizes ({', '.join(str(s) for s in _uneven_ramp_sizes(c.train))}) that are "
                   f"not multiples of train.micro_batch_size={c.train.micro_batch_size}: a ramp changes the "
                   "accumulation count, never the micro-batch.",
         lambda c: f"Choose sizes that are multiples of {c.train.micro_batch_size} x the data-parallel processes (for "
                   "a linear ramp: train.batch_ramp_start_size and train.batch_ramp_increment)."),
    Rule("muon_under_deepspeed_without_clipping",
         lambda c: c.optim.name == "muon" and c.optim.grad_clip > 0 and c.distributed.uses_deepspeed(),
         lambda c: f"optim.name=muon with optim.grad_clip={c.optim.grad_clip} under DeepSpeed: DeepSpeed's ZeRO writes "
                   "Muon's orthogonalised update into the gradient before it clips, so the clip would scale Muon's "
                   "step down by the norm of those updates, not bound the gradients.",
         "Set optim.grad_clip=0 (Muon normalises its own update), or train without DeepSpeed, where the raw gradients "
         "are clipped."),

    # --- Evaluation, checkpoints, spikes, profiling
    Rule("early_stopping_checkpoints_every_evaluation",
         lambda c: bool(c.train.early_stopping_patience) and (
             c.train.eval_every_steps == 0 or c.checkpoint.every_steps == 0
             or c.train.eval_every_steps % c.checkpoint.every_steps != 0),
         lambda c: f"train.early_stopping_patience={c.train.early_stopping_patience} needs a checkpoint at every "
                   f"evaluation (the export is taken from the best one): train.eval_every_steps="
                   f"{c.train.eval_every_steps} must be a positive multiple of checkpoint.every_steps="
                   f"{c.checkpoint.every_steps}.",
         lambda c: f"Set checkpoint.every_steps={c.train.eval_every_steps or 100} (and train.eval_every_steps to the "
                   "same if it is 0)."),
    Rule("tasks_with_the_validation",
         lambda c: (bool(c.eval.tasks) and c.eval.every_steps is not None and c.train.eval_every_steps > 0
                    and c.eval.every_steps % c.train.eval_every_steps != 0),
         lambda c: f"eval.every_steps={c.eval.every_steps} must be a multiple of train.eval_every_steps="
                   f"{c.train.eval_every_steps}: the tasks are scored with the validation.",
         lambda c: f"Set eval.every_steps={_multiple_below(c.eval.every_steps, c.train.eval_every_steps)}, or null for "
                   "every validation."),
    Rule("branch_resumes_its_own",
         lambda c: c.checkpoint.branch_from is not None and c.checkpoint.resume != "auto",
         lambda c: f"checkpoint.branch_from={c.checkpoint.branch_from} with checkpoint.resume={c.checkpoint.resume}: "
                   "a branch starts from its source, then resumes from its own checkpoints (resume=auto).",
         "Set checkpoint.resume=auto, or checkpoint.branch_from=null to resume from another checkpoint."),
    Rule("ema_export_needs_ema",
         lambda c: c.checkpoint.export_weights == "ema" and c.train.ema_decay == 0,
         "checkpoint.export_weights=ema needs a weight EMA:",
         "set train.ema_decay (e.g. 0.999), or checkpoint.export_weights=raw."),
    Rule("spike_history_within_window",
         lambda c: c.spike.min_history > c.spike.window,
         lambda c: f"spike.min_history={c.spike.min_history} exceeds spike.window={c.spike.window}: the window never "
                   "holds that many steps.",
         "Lower spike.min_history or raise spike.window."),
    Rule("profile_steps_in_order",
         lambda c: c.profile.first_step is not None and c.profile.last() < c.profile.first_step,
         lambda c: f"profile.first_step={c.profile.first_step}, profile.last_step={c.profile.last_step}: need "
                   "1 <= first_step <= last_step (optimizer steps, 1-based)."),
    Rule("profile_within_the_run",
         lambda c: c.profile.first_step is not None and c.profile.last() > c.train.max_steps,
         lambda c: f"profile.last_step={c.profile.last()} is beyond train.max_steps={c.train.max_steps}: the profile "
                   "would never be written.",
         "Choose steps within the run."),

    # --- Sequence parallelism (Ulysses through DeepSpeed)
    _sequence_parallel(
        "needs_deepspeed", lambda sp, c: not c.distributed.uses_deepspeed(),
        lambda sp, c: f"distributed.sequence_parallel_size={sp} runs through DeepSpeed (Ulysses):",
        "choose a DeepSpeed config, e.g. distributed.deepspeed_config=zero1 (any ZeRO stage works), or set "
        "distributed.sequence_parallel_size=1."),
    _sequence_parallel(
        "divides_heads",  # a model from init_from: its checkpoint's heads, checked by distributed.check_*_model
        lambda sp, c: c.model.init_from is None and (
            c.model.num_heads % sp != 0 or (c.model.kv_heads() % sp != 0 and sp % c.model.kv_heads() != 0)),
        lambda sp, c: f"distributed.sequence_parallel_size={sp} must divide the attention heads (model.num_heads="
                      f"{c.model.num_heads}) and divide or be a multiple of the key/value heads ({c.model.kv_heads()}): "
                      "the all-to-all splits heads over the group.",
        "Choose a sequence_parallel_size that does."),
    _sequence_parallel(
        "divides_window", lambda sp, c: c.data.seq_len % sp != 0,
        lambda sp, c: f"data.seq_len={c.data.seq_len} is not divisible by distributed.sequence_parallel_size={sp}: "
                      "every rank of a group holds an equal share of each window.",
        lambda sp, c: f"Choose a seq_len that is a multiple of {sp}."),
    _sequence_parallel(
        "attention", lambda sp, c: c.model.attn_implementation in ("eager", "varlen", "flex_attention"),
        lambda sp, c: f"model.attn_implementation={c.model.attn_implementation} cannot run under sequence parallelism "
                      + ("(eager needs the full 4D mask, and DeepSpeed's Ulysses wrapper drops it)." if
                         c.model.attn_implementation == "eager" else "(its document offsets or block mask are built "
                         "for the whole window, which Ulysses' all-to-all does not hand on)."),
        "Use model.attn_implementation=sdpa, flash_attention_2 or flash_attention_3, or set "
        "distributed.sequence_parallel_size=1."),
    _sequence_parallel(
        "without_tasks", lambda sp, c: bool(c.eval.tasks),
        lambda sp, c: f"eval.tasks={c.eval.tasks} is not supported with distributed.sequence_parallel_size={sp}:",
        "score the tasks on the export with eval.py --tasks, or set eval.tasks=[]."),
    _sequence_parallel(
        "without_samples", lambda sp, c: bool(c.eval.samples),
        lambda sp, c: f"eval.samples is not supported with distributed.sequence_parallel_size={sp}: a prompt is not "
                      "split over the group's ranks.",
        "Set eval.samples=[] and continue prompts on the export with eval.py --generate."),
    _sequence_parallel(
        "without_layer_stats", lambda sp, c: c.logging.layer_stats,
        lambda sp, c: f"logging.layer_stats=true is not supported with distributed.sequence_parallel_size={sp}: its "
                      "gradient norms are checked against DeepSpeed's on whole sequences only.",
        "Set logging.layer_stats=false (the global grad_norm is still logged), or distributed.sequence_parallel_size=1."),

    # --- Tensor parallelism (DeepSpeed AutoTP; its ZeRO stage 0-2 is checked when the JSON is read)
    _tensor_parallel(
        "needs_deepspeed", lambda tp, c: not c.distributed.uses_deepspeed(),
        lambda tp, c: f"distributed.tensor_parallel_size={tp} runs through DeepSpeed AutoTP:",
        "choose a DeepSpeed config with ZeRO 0-2, e.g. distributed.deepspeed_config=zero1, or set "
        "distributed.tensor_parallel_size=1."),
    _tensor_parallel(
        "divides_model",  # a model from init_from: its checkpoint's shape, checked by distributed.check_*_model
        lambda tp, c: c.model.init_from is None and any(
            n % tp != 0 for n in (c.model.num_heads, c.model.kv_heads(), c.model.mlp_size())),
        lambda tp, c: f"distributed.tensor_parallel_size={tp} must divide the attention heads (model.num_heads="
                      f"{c.model.num_heads}), the key/value heads ({c.model.kv_heads()}) and model.intermediate_size="
                      f"{c.model.mlp_size()}: each rank holds an equal share of every split matrix.",
        "Choose a tensor_parallel_size that divides all three."),
    _tp_refuses("without_sequence_parallel", lambda c: c.distributed.sequence_parallel_size > 1,
                lambda c: f"distributed.sequence_parallel_size={c.distributed.sequence_parallel_size}",
                "one of the two splits"),
    _tp_refuses("without_ema", lambda c: c.train.ema_decay > 0, lambda c: f"train.ema_decay={c.train.ema_decay}",
                "train.ema_decay=0 (the EMA would average each rank's slice, not the model)"),
    _tp_refuses("without_tasks", lambda c: bool(c.eval.tasks), lambda c: f"eval.tasks={c.eval.tasks}",
                "eval.tasks=[] and score the export with eval.py --tasks"),
    _tp_refuses("without_samples", lambda c: bool(c.eval.samples), lambda c: f"eval.samples={c.eval.samples}",
                "eval.samples=[] and continue prompts on the export with eval.py --generate"),
    _tp_refuses("without_muon", lambda c: c.optim.name == "muon", lambda c: "optim.name=muon", "optim.name=adamw"),
    _tp_refuses("without_fp8", lambda c: c.train.precision == "fp8", lambda c: "train.precision=fp8",
                "train.precision=bf16"),
    _tp_refuses("without_compile", lambda c: c.train.compile, lambda c: f"train.compile={c.train.compile}",
                "train.compile=none"),
    _tp_refuses("without_layer_stats", lambda c: c.logging.layer_stats, lambda c: "logging.layer_stats=true",
                "logging.layer_stats=false (a split matrix's norm would need its slices from every rank)"),
)


def check_rules(cfg: Config) -> None:
    """UserError (exit code 2) naming every rule of :data:`RULES` that ``cfg`` breaks, in table order, each with its
    fix; nothing when none is. ``cfg``'s sections must each be valid (their own ``validate``)."""
    problems = [rule.text(cfg) for rule in RULES if rule.applies(cfg)]
    if problems:
        raise fail_all(problems, "settings of this recipe cannot be combined")
