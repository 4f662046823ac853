"""The sections of a run's configuration: one dataclass each, every field documented with its units.

Each section's ``validate`` checks its fields one at a time (ranges, names); a refusal that depends on two or more
fields lives in ``rules.py``. Derived values (accumulation steps, ...) are methods, never mutated fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from lmrecipe.errors import UserError, fail

Precision = Literal["auto", "bf16", "fp16", "fp32", "fp8"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DS_CONFIG_DIR = REPO_ROOT / "ds_configs"

_FIXED = {"fixed_on_resume": True}
"""Field metadata: a resume may not change this value (the saved weights, shards or data position depend on it)."""


def _fixed(default: Any = dataclasses.MISSING, **kwargs) -> Any:
    return field(default=default, metadata=_FIXED, **kwargs)


MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
"""The mixture-of-experts architectures (``model.arch``) a recipe builds with ``model.num_experts`` > 0."""
SHARED_EXPERT_ARCHS = {"qwen2_moe": 1}
"""The MoE architectures with shared experts, and how many each layer has (the others have none)."""


@dataclass
class ModelConfig:
    arch: str = _fixed("llama")
    """Hugging Face ``model_type`` for a model built from scratch (any ``AutoConfig`` architecture)."""
    init_from: Optional[str] = None
    """Local Hugging Face checkpoint folder to continue pretraining from; null builds from scratch."""
    hidden_size: int = _fixed(256)
    """Width of the residual stream (features)."""
    num_layers: int = _fixed(4)
    """Number of transformer blocks."""
    num_heads: int = _fixed(4)
    """Attention heads (query heads)."""
    num_kv_heads: Optional[int] = _fixed(None)
    """Key/value heads for grouped-query attention; null means equal to ``num_heads``."""
    intermediate_size: Optional[int] = _fixed(None)
    """MLP hidden width (features); null means 8/3 of ``hidden_size`` rounded up to a multiple of 64."""
    vocab_size: Optional[int] = _fixed(None)
    """Vocabulary size (tokens); null takes the data's ``meta.json`` vocab size."""
    max_position_embeddings: Optional[int] = _fixed(None)
    """Longest position the model supports (tokens); null means ``data.seq_len``."""
    rope_theta: float = _fixed(10000.0)
    """RoPE base frequency."""
    tie_embeddings: bool = _fixed(False)
    """Share the input embedding and the output projection."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """Attention kernel passed to transformers: sdpa (any device), eager, or a flash kernel on a CUDA GPU where its
    package is installed (flash_attention_2: flash-attn; flash_attention_3: flash-attn-3, Hopper GPUs), checked at
    start-up."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    extra: dict = field(default_factory=dict, metadata=_FIXED)
    """Further keyword arguments for the architecture's ``AutoConfig`` (e.g. ``rms_norm_eps``)."""
    num_experts: int = _fixed(0)
    """Routed experts in each mixture-of-experts layer (``model.arch`` qwen3_moe, qwen2_moe or mixtral,
    ``docs/moe.md``); 0 = a dense model (any other architecture)."""
    experts_per_token: int = _fixed(2)
    """Experts each token is routed to (top-k) in an MoE layer."""
    expert_intermediate_size: Optional[int] = _fixed(None)
    """Hidden width of one expert's MLP (features); null means ``intermediate_size``'s value."""
    shared_experts: int = _fixed(0)
    """Experts every token passes through besides its routed ones, of width ``expert_intermediate_size``: qwen2_moe
    has 1 (set it), qwen3_moe and mixtral have none (0)."""
    router_aux_loss_coef: float = 0.001
    """Coefficient of the router's load-balancing loss (Switch Transformer's, as the model class computes it), added
    to the training objective and logged as ``aux_loss`` apart from ``loss``; validation, perplexity and
    ``eval.py`` report the language-model loss alone. 0 = off."""

    def validate(self) -> None:
        _positive(self, "hidden_size", "num_layers", "num_heads")
        kv = self.kv_heads()
        if kv <= 0:
            raise fail(f"model.num_kv_heads={kv} must be a positive divisor of model.num_heads={self.num_heads}.")
        for key in ("intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise fail(f"model.{key}={value} must be positive (or null for the default).")
        _non_negative(self, "num_experts", "shared_experts")
        if not math.isfinite(self.router_aux_loss_coef) or self.router_aux_loss_coef < 0:
            raise fail(f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be a finite number >= 0 "
                       "(0.001 is Qwen's and Mixtral's value; 0 turns the router's auxiliary loss off).")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise fail(f"model.experts_per_token={self.experts_per_token} must be in [1, model.num_experts="
                       f"{self.num_experts}] (each token's routed experts are chosen among them).")
        if self.expert_intermediate_size is not None and self.expert_intermediate_size <= 0:
            raise fail(f"model.expert_intermediate_size={self.expert_intermediate_size} must be positive (or null "
                       "for model.intermediate_size).")

    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    def mlp_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers (``num_experts`` > 0)."""
        return self.num_experts > 0

    def expert_size(self) -> int:
        """Hidden width of one expert's MLP (features)."""
        return self.expert_intermediate_size if self.expert_intermediate_size is not None else self.mlp_size()


_SOURCE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class DataSource:
    """One prepared folder of a weighted mixture (``data.sources``)."""

    path: str
    """Folder written by ``tools/prepare_data.py``."""
    weight: float = 1.0
    """Share of training samples drawn from this folder, relative to the other sources' weights (0 = evaluated only)."""
    name: Optional[str] = None
    """Name in metrics (``val_loss/<name>``, ``tokens_seen/<name>``); null means the folder's name."""

    def resolved_name(self) -> str:
        return self.name if self.name is not None else Path(self.path).name


@dataclass
class DataStage:
    """One stage of a staged mixture (``data.stages``): from optimizer step ``start_step`` on, these weights."""

    start_step: int
    """Optimizer step (0-based) the stage starts at; the first stage starts at 0, the others at increasing steps."""
    weights: dict = field(default_factory=dict)
    """Weight of each source by name (``data.sources[].name``), relative to the others; a source left out has weight
    0 in this stage (it leaves, or has not entered yet), e.g. ``{web: 0.3, code: 0.7}``."""


@dataclass
class DataConfig:
    path: Optional[str] = "data/stdlib"
    """Folder written by ``tools/prepare_data.py`` (train.bin, val.bin, meta.json, tokenizer); null with ``sources``."""
    sources: list[DataSource] = field(default_factory=list)
    """A weighted mixture of prepared folders, e.g. ``[{path: data/code, weight: 0.7}, {path: data/prose, weight: 0.3}]``,
    used instead of ``path``. All must share one tokenizer. Setting one of ``path`` / ``sources`` in a recipe or on the
    command line clears the other one from lower layers; setting both in the same layer is an error."""
    stages: list[DataStage] = field(default_factory=list, metadata=_FIXED)
    """A staged mixture: ``[{start_step: 0, weights: {web: 1.0}}, {start_step: 9000, weights: {web: 0.5, code: 0.5}}]``
    over the sources of ``sources`` (by name). Each stage's weights replace the sources' ``weight`` for training from
    its ``start_step``; ``sources[].weight`` then only weighs the validation mean. Empty = the sources' weights
    throughout. Fixed on resume."""
    seq_len: int = _fixed(256)
    """Tokens per training sequence (each window reads ``seq_len + 1`` tokens)."""
    val_windows: int = 64
    """Validation sequences evaluated each time (a fixed set, spread over val.bin), per source for a mixture."""
    cache_dir: str = "~/.cache/lmrecipe/data"
    """Local folder that data folders given as object-storage URLs (``data.path`` or ``data.sources[].path`` =
    ``s3://...``, ``gs://...``) are downloaded into before the first step (one process per node, verified against
    the sha256 in meta.json), reused by later runs and memory-mapped from there."""
    document_masking: bool = _fixed(True)
    """Train packed documents as documents: each token attends only to earlier tokens of its own document and position
    ids restart at each document start (boundaries from the folder's ``train.idx`` / ``val.idx``). Needs a model whose
    attention can mask (``model.attn_implementation`` sdpa, eager, flash_attention_2/3); false attends across the
    whole window. Fixed on resume."""

    def validate(self) -> None:
        _positive(self, "seq_len", "val_windows")
        names: dict[str, int] = {}
        for i, source in enumerate(self.sources):
            where = f"data.sources[{i}]"
            if not source.path:
                raise fail(f"{where}.path is empty: name a folder written by tools/prepare_data.py.")
            if not math.isfinite(source.weight) or source.weight < 0:
                raise fail(f"{where}.weight={source.weight} ({source.path}) must be a finite number >= 0 (weights are "
                           "relative shares of the training samples; 0 evaluates a source without training on it).")
            name = source.resolved_name()
            if not _SOURCE_NAME.match(name):
                raise fail(f"{where} has the name {name!r}, which cannot label metrics: set {where}.name to letters, "
                           "digits, '_', '-' or '.' (e.g. name: code).")
            if name in names:
                raise fail(f"data.sources[{names[name]}] and {where} are both named {name!r} (names default to the "
                           f"folder's name): give each source a distinct name, e.g. {{path: {source.path}, name: "
                           f"{name}_2}}.")
            names[name] = i
        if self.sources and sum(s.weight for s in self.sources) <= 0:
            raise fail(f"The weights of data.sources sum to zero ({', '.join(str(s.weight) for s in self.sources)}): "
                       "give at least one source a positive weight.")
        self._validate_stages(names)

    def _validate_stages(self, names: dict[str, int]) -> None:
        """The stages' steps start at 0 and increase; their weights name sources and are not all 0."""
        if not self.stages:
            return
        if not self.sources:
            raise fail("data.stages needs a mixture: list the folders in data.sources (each with a name) and give "
                       "each stage weights by those names.")
        if self.stages[0].start_step != 0:
            raise fail(f"data.stages[0].start_step={self.stages[0].start_step}: the first stage must start at step 0 "
                       "(set it to 0, or add a first stage {start_step: 0, weights: {...}}).")
        for i, (before, stage) in enumerate(zip(self.stages, self.stages[1:]), start=1):
            if stage.start_step <= before.start_step:
                raise fail(f"data.stages[{i}].start_step={stage.start_step} is not after data.stages[{i - 1}]."
                           f"start_step={before.start_step}: list the stages in increasing start_step order, each "
                           "step once.")
        for i, stage in enumerate(self.stages):
            where = f"data.stages[{i}].weights"
            for name, weight in stage.weights.items():
                if str(name) not in names:
                    close = difflib.get_close_matches(str(name), list(names), n=1)
                    raise fail(f"{where} names the source {name!r}, which is not in data.sources"
                               f"{f' (did you mean {close[0]!r}?)' if close else ''}: the sources are "
                               f"{', '.join(names)}. Name a source of data.sources, or add the folder there.")
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                        or weight < 0:
                    raise fail(f"{where}.{name}={weight!r} must be a finite number >= 0 (0: the source takes no "
                               "training samples in this stage).")
            if sum(stage.weights.values()) <= 0:
                raise fail(f"{where} are all 0 (or empty): stage {i} (from step {stage.start_step}) would draw no "
                           "samples. Give at least one source a positive weight.")

    def stage_weights(self) -> list[tuple[int, list[float]]]:
        """(start step, weight of each source in ``sources`` order) of each stage; without stages, one stage of the
        sources' own weights."""
        if not self.stages:
            return [(0, [s.weight for s in self.source_list()])]
        return [(stage.start_step, [float(stage.weights.get(s.resolved_name(), 0.0)) for s in self.sources])
                for stage in self.stages]

    def source_list(self) -> list[DataSource]:
        """The training data as sources: ``sources``, or ``path`` as one source of weight 1."""
        return list(self.sources) if self.sources else [DataSource(path=self.path)]

    def is_mixture(self) -> bool:
        return bool(self.sources)


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw; or muon: DeepSpeed's Muon (momentum orthogonalised by Newton-Schulz) for the hidden 2-D matrices, AdamW
    (``lr``, betas, eps) for embeddings, norms, biases and the output layer. A resume keeps the checkpoint's (its
    state differs; checked when the checkpoint is loaded, so that checkpoints from before this key load as AdamW)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (``name=muon``); the schedule moves it in proportion to ``lr``."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled AdamW weight decay, applied to matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the embedding matrices."""

    def validate(self) -> None:
        for key in ("lr", "eps", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2", "muon_lr", "muon_momentum"):
            if not math.isfinite(getattr(self, key)):  # nan passes every comparison below; inf trains NaN weights
                raise fail(f"optim.{key}={getattr(self, key)} must be a finite number.")
        _positive(self, "lr", "eps", "muon_lr")
        _non_negative(self, "min_lr", "weight_decay", "grad_clip")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise fail(f"optim.muon_momentum={self.muon_momentum} must be in [0, 1) (0.95 is Muon's usual value).")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise fail(f"optim.{key}={getattr(self, key)} must be in [0, 1).")


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    """Optimizer steps of linear warmup: step s < warmup_steps trains at ``optim.lr x (s+1) / warmup_steps``."""
    decay: Literal["cosine", "linear", "1-sqrt", "constant"] = "cosine"
    """Shape of the decay from ``optim.lr`` to ``optim.min_lr``, reached at the last step (``train.max_steps - 1``).
    1-sqrt: ``1 - sqrt(progress)``. constant: no decay; with ``decay_steps`` / ``decay_fraction``, a drop to
    ``min_lr`` for the decay's steps."""
    decay_steps: Optional[int] = None
    """Warmup-stable-decay: hold ``optim.lr`` after warmup and decay only over the last this many optimizer steps
    (steps ``max_steps - decay_steps`` .. ``max_steps - 1``; the first of them already below ``lr``); null = decay
    over the whole run after warmup. A resume may raise ``train.max_steps`` while the run is in its stable phase:
    the decay moves with it."""
    decay_fraction: Optional[float] = None
    """Warmup-stable-decay with the decay as a fraction of ``train.max_steps`` (rounded to whole steps, at least 1),
    in (0, 1]; instead of ``decay_steps``."""

    def validate(self) -> None:
        _non_negative(self, "warmup_steps")
        if self.decay_steps is not None:
            _positive(self, "decay_steps")
        if self.decay_fraction is not None and not 0.0 < self.decay_fraction <= 1.0:
            raise fail(f"schedule.decay_fraction={self.decay_fraction} must be in (0, 1] (e.g. 0.2: the last 20 % "
                       "of train.max_steps).")

    def is_wsd(self) -> bool:
        """Warmup-stable-decay: the decay covers only the last steps (``decay_steps`` or ``decay_fraction``)."""
        return self.decay_steps is not None or self.decay_fraction is not None

    def decay_length(self, max_steps: int) -> int | None:
        """Optimizer steps of a warmup-stable-decay run's decay for a run of ``max_steps``; None without one."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.decay_fraction is not None:
            return max(1, round(self.decay_fraction * max_steps))
        return None

    def decay_start(self, max_steps: int) -> int | None:
        """The first optimizer step (0-based) of a warmup-stable-decay run's decay; None without one."""
        length = self.decay_length(max_steps)
        return None if length is None else max_steps - length


AUTO_LOSS_CHUNK_TOKENS = 1024
AUTO_LOSS_CHUNK_MIN_VOCAB = 65_536


CompileMode = Literal["none", "model", "layers"]
"""The choices of ``train.compile``."""
COMPILE_FROM_BOOL = {True: "model", False: "none"}
"""``train.compile`` written as the switch it was before it became a choice."""


class Compile(str):
    """A ``train.compile`` value (:data:`CompileMode`) whose truth is "is anything compiled": false for ``none``
    alone, so ``if cfg.train.compile:`` reads as it did when the key was a switch."""

    def __bool__(self) -> bool:
        return self != "none"


@dataclass
class BatchSize:
    """One point of a batch-size ramp (``train.batch_ramp``)."""

    step: int
    """Optimizer step (0-based) from which the size holds."""
    size: int
    """Sequences per optimizer step over all processes, from ``step`` on."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps of the whole run."""
    global_batch_size: int = _fixed(32)
    """Sequences per optimizer step, over all processes and accumulation micro-steps."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one process."""
    seed: int = _fixed(1337)
    """Seed of the initialisation and of the data order."""
    precision: Precision = "auto"
    """auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPUs; or an explicit value. fp8 = bf16 mixed
    precision with torchao's float8 matmuls in the linear layers (all but the first and last, and those with a
    dimension not divisible by 16): H100/H200/Ada GPUs; on a CPU the float8 matmuls are emulated (slow, for tests)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    checkpointing_reentrant: bool = True
    """Use reentrant activation checkpointing (the variant that works under ZeRO-3)."""
    compile: CompileMode = field(default=Compile("none"), metadata={"from_bool": COMPILE_FROM_BOOL})
    """``torch.compile`` (inductor): none = eager; model = the whole model (under DeepSpeed the engine's
    ``compile()``); layers = each decoder layer compiled in place (regional compile: the layers share one graph, so
    compiling takes about one layer's time at any depth). true and false, from when the key was a switch, read as
    model and none."""
    eval_every_steps: int = 100
    """Evaluate on the validation windows every this many optimizer steps (and at the end); 0 = end only."""
    max_consecutive_skips: int = 5
    """Stop the run after this many consecutive updates skipped for a non-finite loss or gradient norm."""
    early_stopping_patience: int = 0
    """Stop after this many evaluations in a row without improvement of the validation loss; 0 = never."""
    early_stopping_min_delta: float = 0.0
    """An evaluation improves when its loss is below the best so far by more than this (loss units)."""
    deterministic: bool = False
    """Deterministic kernels (``torch.use_deterministic_algorithms``, ``CUBLAS_WORKSPACE_CONFIG``) for debugging."""
    loss_chunk_tokens: Optional[int] = None
    """The chunked loss (``lmrecipe/model/loss.py``): logits and their gradient are computed this many tokens at a time and
    never held whole. 0 = off (full logits); null = auto: 1,024 when the vocabulary has at least 65,536 tokens
    (Llama-3, Qwen, Gemma), off below (there the logits of a micro-batch are small next to the activations and the
    recomputation would cost more than it saves)."""
    ema_decay: float = 0.0
    """Decay per applied optimizer step of an exponential moving average of the weights (bias-corrected, fp32; an
    average over about ``1 / (1 - ema_decay)`` steps, e.g. 0.999: 1,000 steps), evaluated as ``val_loss_ema`` and
    saved in checkpoints (``lmrecipe/train/callbacks/ema.py``); 0 = off. In [0, 1)."""
    z_loss: float = 0.0
    """Coefficient of the z-loss, ``z_loss * logsumexp(logits)^2`` averaged over the target tokens and added to the
    training objective (it keeps the logits' log-partition near 0; PaLM used 1e-4); logged as ``z_loss``, apart from
    ``loss``. Validation, perplexity and ``eval.py`` report the language-model loss alone. 0 = off."""

    batch_ramp: list[BatchSize] = field(default_factory=list, metadata=_FIXED)
    """A batch-size ramp as points ``[{step: 0, size: 64}, {step: 500, size: 128}, {step: 1000, size: 256}]``: from
    optimizer step ``step`` on, ``size`` sequences per step. The first point is at step 0, steps increase, and the last
    size is ``global_batch_size`` (the run's size from there on). Sizes must be multiples of ``micro_batch_size`` x
    the data-parallel processes: the micro-batch stays, the accumulation count changes. Empty = no ramp (or the
    linear form ``batch_ramp_start_size``). Fixed on resume."""
    batch_ramp_start_size: int = _fixed(0)
    """A linear ramp: the first step's size in sequences, raised by ``batch_ramp_increment`` every
    ``batch_ramp_steps_per_increment`` optimizer steps until it reaches ``global_batch_size``; 0 = off."""
    batch_ramp_increment: int = _fixed(0)
    """Sequences added to the step size at each increment of the linear ramp."""
    batch_ramp_steps_per_increment: int = _fixed(0)
    """Optimizer steps between two increments of the linear ramp."""
    batch_ramp_lr_scaling: Literal["none", "sqrt"] = "none"
    """During a batch-size ramp: none = the schedule's learning rate as it is; sqrt = scaled by
    sqrt(step size / global_batch_size) (the rate is the schedule's at the full size)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "compile":  # every writer alike (the loader, a saved config, a test's TrainConfig(compile=True))
            value = Compile(COMPILE_FROM_BOOL[value] if isinstance(value, bool) else value)
        super().__setattr__(name, value)

    def _validate_ramp(self) -> None:
        _non_negative(self, "batch_ramp_start_size", "batch_ramp_increment", "batch_ramp_steps_per_increment")
        if self.batch_ramp and self.batch_ramp_start_size:
            raise fail("train.batch_ramp and train.batch_ramp_start_size are both set: describe the ramp one way, as "
                       "points (train.batch_ramp) or linearly (train.batch_ramp_start_size, _increment, "
                       "_steps_per_increment); set the other to [] or 0.")
        if self.batch_ramp_start_size and (self.batch_ramp_increment <= 0 or self.batch_ramp_steps_per_increment <= 0):
            raise fail(f"train.batch_ramp_start_size={self.batch_ramp_start_size} needs train.batch_ramp_increment and "
                       "train.batch_ramp_steps_per_increment > 0, e.g. batch_ramp_increment=8 and "
                       "batch_ramp_steps_per_increment=100.")
        if self.batch_ramp_start_size > self.global_batch_size:
            raise fail(f"train.batch_ramp_start_size={self.batch_ramp_start_size} exceeds train.global_batch_size="
                       f"{self.global_batch_size}, the size the ramp ends at: start below it.")
        points = self.batch_ramp
        if not points:
            return
        half, full = max(1, self.global_batch_size // 2), self.global_batch_size
        example = f"e.g. [{{step: 0, size: {half}}}, {{step: 100, size: {full}}}]"
        if points[0].step != 0:
            raise fail(f"train.batch_ramp[0].step={points[0].step}: the ramp must start at step 0 ({example}).")
        for i, (before, point) in enumerate(zip(points, points[1:]), start=1):
            if point.step <= before.step:
                raise fail(f"train.batch_ramp[{i}].step={point.step} is not after train.batch_ramp[{i - 1}].step="
                           f"{before.step}: list the points in increasing step order ({example}).")
        for i, point in enumerate(points):
            if not 0 < point.size <= self.global_batch_size:
                raise fail(f"train.batch_ramp[{i}].size={point.size} must be in [1, train.global_batch_size="
                           f"{self.global_batch_size}] ({example}).")
        if points[-1].size != self.global_batch_size:
            raise fail(f"train.batch_ramp ends at size {points[-1].size}, not at train.global_batch_size="
                       f"{self.global_batch_size} (the run's final size): add a last point "
                       f"{{step: N, size: {self.global_batch_size}}} ({example}).")

    def chunk_tokens(self, vocab_size: int) -> int:
        """Tokens per chunk of the chunked loss for a vocabulary of ``vocab_size``; 0 = the full-logits path."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        return AUTO_LOSS_CHUNK_TOKENS if vocab_size >= AUTO_LOSS_CHUNK_MIN_VOCAB else 0

    def ramp_points(self) -> list[tuple[int, int]]:
        """The step size as (first optimizer step, sequences) points, the last at ``global_batch_size``; one point
        (0, ``global_batch_size``) without a ramp."""
        if self.batch_ramp:
            return [(p.step, p.size) for p in self.batch_ramp]
        if self.batch_ramp_start_size <= 0 or self.batch_ramp_start_size >= self.global_batch_size:
            return [(0, self.global_batch_size)]
        sizes = range(self.batch_ramp_start_size, self.global_batch_size, max(self.batch_ramp_increment, 1))
        points = [(k * self.batch_ramp_steps_per_increment, size) for k, size in enumerate(sizes)]
        return points + [(len(points) * self.batch_ramp_steps_per_increment, self.global_batch_size)]

    def validate(self) -> None:
        _positive(self, "max_steps", "global_batch_size", "micro_batch_size", "max_consecutive_skips")
        self._validate_ramp()
        _non_negative(self, "eval_every_steps", "early_stopping_patience", "early_stopping_min_delta")
        if self.loss_chunk_tokens is not None:
            _non_negative(self, "loss_chunk_tokens")
        _non_negative(self, "z_loss")
        if self.compile not in typing.get_args(CompileMode):
            raise fail(f"train.compile={self.compile!r} is not allowed. Choose one of: "
                       f"{', '.join(typing.get_args(CompileMode))}.")
        if not 0.0 <= self.ema_decay < 1.0:
            raise fail(f"train.ema_decay={self.ema_decay} must be in [0, 1): e.g. 0.999 averages over about 1,000 "
                       "optimizer steps; 0 turns the weight EMA off.")


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """Multiple-choice tasks scored by log-likelihood on the live model at evaluations (``lmrecipe/evaluation/tasks.py``):
    JSON-lines task files, or ``next_line`` (the true next line of a held-out document against lines of other
    documents, built from the validation split of ``data.path``, or of the first of ``data.sources``). Logged as
    ``acc/<task>``, ``acc_norm/<task>`` and ``chance/<task>``. [] = none."""
    every_steps: Optional[int] = None
    """Score the tasks every this many optimizer steps (and at the end): a multiple of ``train.eval_every_steps``,
    since they run with the validation; null = at every validation."""
    next_line_items: int = 100
    """Items of the ``next_line`` task (4 choices each: chance is 25 %)."""
    seed: int = 0
    """Seed of the ``next_line`` task's items and distractors."""
    samples: list[str] = field(default_factory=list)
    """Prompts continued at every evaluation by greedy decoding of the live model, e.g. ``["def main(", "import "]``:
    the texts go to ``metrics.jsonl`` (a ``samples`` row) and the last evaluation's to ``report.md``. [] = none."""
    sample_tokens: int = 16
    """Tokens generated for each of ``samples`` (fewer when the continuation reaches the end-of-text token)."""

    def validate(self) -> None:
        _positive(self, "next_line_items", "sample_tokens")
        for i, prompt in enumerate(self.samples):
            if not isinstance(prompt, str) or not prompt.strip():
                raise fail(f"eval.samples[{i}]={prompt!r} is not a prompt: give each sample a non-empty string, e.g. "
                           "eval.samples='[\"def main(\"]'.")
        if self.every_steps is not None:
            _positive(self, "every_steps")
        names = [Path(spec).stem for spec in self.tasks]
        if len(set(names)) != len(names):
            raise fail(f"eval.tasks={self.tasks} names two tasks of one name (a task is named after its file's stem): "
                       "rename one of the files.")

    def due(self, step: int, eval_every_steps: int, max_steps: int) -> bool:
        """Whether the tasks are scored at the evaluation after ``step``."""
        return bool(self.tasks) and due_at(step, self.every_steps or eval_every_steps, max_steps)


@dataclass
class CheckpointConfig:
    every_steps: int = 500
    """Save a resumable checkpoint every this many optimizer steps (and at the end); 0 = end only."""
    keep_last: int = 3
    """Newest checkpoints kept; older ones are deleted (the best by validation loss is kept apart)."""
    resume: str = "auto"
    """auto = newest complete checkpoint in out_dir if any; none = start fresh; or a checkpoint folder."""
    branch_from: Optional[str] = None
    """Start this run (its own ``out_dir``) from a checkpoint of another run: weights, optimizer, step, data
    position and RNG, as a resume takes them, with this recipe's schedule and data (a new mixture continues at the
    same global sample index). The source is only read. Once this run has checkpoints of its own, it resumes from
    them. Needs ``resume=auto``; null = no branch."""
    allow_lr_change: bool = False
    """Let a resume train the checkpoint's next step at another learning rate than its own schedule gave it (a
    finished cosine run lengthened with ``train.max_steps`` restarts near its peak); false = such a resume stops with
    the ways on (docs/checkpoints.md). A branch (``branch_from``) has a schedule of its own and needs no permission."""
    export_at_end: bool = True
    """Write a Hugging Face export (sharded safetensors + tokenizer) to ``out_dir/export`` at the end."""
    export_dtype: Literal["bf16", "fp32"] = "bf16"
    """Weight dtype of the export."""
    max_shard_size: str = "2GB"
    """Largest safetensors shard of the export (e.g. 500MB, 5GB)."""
    export_weights: Literal["raw", "ema"] = "raw"
    """Weights of the end-of-run export: the trained ones, or their moving average (needs ``train.ema_decay`` > 0)."""
    background_save: bool = False
    """Write checkpoints on a background thread: the loop waits only while the state is copied to CPU memory (the
    YAML key ``async`` would be a Python keyword, hence the name). At most one write is in flight; ``latest`` moves
    once every rank's files are written. Under DeepSpeed the collective part of the save (ZeRO-3's gathers) still
    runs at the step; the files are written in the background."""
    remote: Optional[str] = None
    """Object storage the checkpoints are mirrored to, as an fsspec URL (``s3://BUCKET/PREFIX``, ``gs://...``,
    ``file:///...``; S3 reads ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``): each published checkpoint is uploaded in the background (its ``latest`` written
    last, ``keep_last`` applied there too), the export and report at the end; ``resume=auto`` downloads a newer
    remote checkpoint onto a fresh node. Needs ``pip install -e ".[remote]"``. null = local only."""
    remote_wait_s: float = 600.0
    """Seconds the end of a run (or a crash) waits for uploads to ``remote`` still in flight; what is not uploaded by
    then is named, and a later session of this run that trains (a resume) uploads it."""

    def validate(self) -> None:
        _non_negative(self, "every_steps")
        _positive(self, "keep_last")
        _non_negative(self, "remote_wait_s")
        try:
            parse_shard_size(self.max_shard_size)
        except UserError as err:
            raise fail(f"checkpoint.max_shard_size: {err}") from None


@dataclass
class SpikeConfig:
    """Loss-spike detection and rollback (``lmrecipe/train/callbacks/spikes.py``): off by default."""

    enabled: bool = False
    """Watch every step's loss (mean over ranks) and gradient norm; on a spike, reload the last checkpoint, skip the
    samples of the flagged steps for good, and continue. A spike is acted on at the next sync point (a logged,
    evaluated or saved step), so within ``logging.log_every_steps`` steps."""
    window: int = 100
    """Trailing optimizer steps (those not flagged) whose loss mean and standard deviation a step is compared with."""
    min_history: int = 20
    """Steps the window must hold before the z-score rule applies (non-finite values count from the first step)."""
    z_threshold: float = 6.0
    """A step whose loss is more than this many standard deviations above the window's mean is a spike."""
    grad_norm_z_threshold: Optional[float] = None
    """The same rule on the pre-clip gradient norm; null = the gradient norm only counts when not finite."""
    max_rollbacks: int = 5
    """Rollbacks allowed over the run; the next spike stops it with exit code 2."""

    def validate(self) -> None:
        _positive(self, "window", "min_history", "z_threshold", "max_rollbacks")
        if self.min_history < 2:
            raise fail(f"spike.min_history={self.min_history} must be at least 2 (a standard deviation needs two steps).")
        if self.grad_norm_z_threshold is not None and self.grad_norm_z_threshold <= 0:
            raise fail(f"spike.grad_norm_z_threshold={self.grad_norm_z_threshold} must be positive (or null).")


TrackerName = Literal["wandb", "tensorboard", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"]


@dataclass
class LoggingConfig:
    log_every_steps: int = 10
    """Write a metrics row and a log line every this many optimizer steps (and at the first and last)."""
    trackers: list[TrackerName] = field(default_factory=list)
    """Experiment trackers, any of wandb, tensorboard, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio
    (Accelerate's tracker classes; each tool's own login and environment variables apply, see
    ``lmrecipe/observe/trackers.py``); [] = none. metrics.jsonl is always written."""
    project: str = "lmrecipe"
    """Tracker project (wandb project, MLflow experiment) unless the tool's own variable sets it."""
    run_name: Optional[str] = None
    """Tracker run name; null uses the out_dir's name."""
    progress_bar: bool = True
    """Show a progress bar on the main process."""
    plots: bool = True
    """Draw ``training.png`` (and with ``layer_stats``, ``layers.png``) when the run ends or stops; false leaves
    matplotlib out (about 1.3 s of CPU at the end of each run on a 2-core CPU) and ``report.md`` without the curves."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s per device for MFU; null looks the GPU up in a table or probes the CPU with a matmul."""
    cost_per_device_hour: Optional[float] = None
    """Price of one device (GPU, or CPU process) for one hour, for the cost line of ``out_dir/report.md``."""
    measure_model_states: bool = False
    """Measure the bytes of weights, gradients and optimizer states each rank holds, during the second optimizer
    step, into ``out_dir/memory_rank{N}.json`` (``tools/compare_zero.py`` turns it on)."""
    verbose: bool = False
    """Show the start-up and per-checkpoint lines of third-party libraries (torchao, DeepSpeed, Accelerate, torch)
    that are filtered by default; the filtered lines are listed in ``lmrecipe/observe/quiet.py``."""
    layer_stats: bool = False
    """At every logged step, per part of the model (embeddings, each block, the final norm, the output layer): the
    gradient norm before clipping, the parameter norm and the update/parameter ratio (``grad_norm/<part>``,
    ``param_norm/<part>``, ``update_ratio/<part>``), each block's output RMS and the largest absolute logit on one
    micro-batch (``act_rms/<block>``, ``max_abs_logit``); a heat map ``out_dir/layers.png``. Costs one copy of the
    weights a rank owns and (DeepSpeed) one all-reduce at a logged step, nothing at the others
    (``lmrecipe/train/callbacks/layer_stats.py``)."""

    def validate(self) -> None:
        _positive(self, "log_every_steps")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise fail(f"logging.peak_tflops={self.peak_tflops} must be positive (or null).")
        if self.cost_per_device_hour is not None and self.cost_per_device_hour < 0:
            raise fail(f"logging.cost_per_device_hour={self.cost_per_device_hour} must be zero or positive (or null).")


@dataclass
class DistributedConfig:
    deepspeed_config: Optional[str] = None
    """JSON in ds_configs/ choosing the ZeRO stage and offload; null trains without DeepSpeed (DDP)."""
    timeout_s: int = 1800
    """Collective-operation timeout (seconds) before a hung rank fails the job."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (DeepSpeed ALST through Accelerate): each window is split over this many
    consecutive ranks, which attend over the whole window through all-to-alls; the data-parallel ranks are
    ``world_size / sequence_parallel_size``. 1 = off. Needs DeepSpeed; must divide the process count, the attention
    heads and ``data.seq_len``."""
    tensor_parallel_size: int = 1
    """DeepSpeed AutoTP tensor parallelism: the attention and MLP matrices of each layer are split over this many
    consecutive ranks, which read the same samples; the data-parallel ranks are ``world_size /
    tensor_parallel_size``. 1 = off. Needs DeepSpeed ZeRO 0-2 (ZeRO-3 is refused); must divide the process count,
    the attention and key/value heads and ``model.intermediate_size``."""

    expert_parallel_size: int = 1
    """Expert parallelism (DeepSpeed AutoEP, ``docs/moe.md``): the experts of each MoE layer are split over this many
    consecutive ranks, which exchange tokens through all-to-alls; every rank still reads its own samples (the
    data-parallel ranks stay ``world_size``). 1 = each rank holds every expert. Needs DeepSpeed and
    ``model.num_experts`` > 0; must divide the process count and ``model.num_experts``."""
    expert_layer: Literal["auto", "autoep", "hf"] = _fixed("auto")
    """Which MoE layer trains: ``hf`` = the model class's own block (under ZeRO-3 made a leaf module, so its
    experts are gathered together); ``autoep`` = DeepSpeed AutoEP's layer (needs DeepSpeed; also at
    ``expert_parallel_size=1``); ``auto`` = ``autoep`` when ``expert_parallel_size`` > 1, else ``hf``."""
    hang_watchdog: bool = True
    """A watchdog thread on every rank of a multi-process run (``docs/hangs.md``): when a rank makes no progress for
    longer than its phase's budget (the ``hang_*_s`` keys, each below ``timeout_s``), the live ranks write
    ``hang.md`` naming the stuck rank, dump their stacks and end the run with exit code 3. false = only ``timeout_s``
    bounds a wait."""
    hang_step_s: str = "auto"
    """Budget (seconds) of each phase of a training step (data and forward/backward, optimizer, the step's end): a
    number, or auto = max(10 x the median step time after the session's first 2 steps, ``hang_step_floor_s``), at
    most 0.9 x ``timeout_s``."""
    hang_step_floor_s: float = 120.0
    """The least budget (seconds) ``hang_step_s=auto`` gives."""
    hang_first_step_s: float = 900.0
    """Budget (seconds) of the start (the resume) and of the session's first step; with ``hang_step_s=auto``, of
    every step until one after the first 2 was measured."""
    hang_checkpoint_s: float = 900.0
    """Budget (seconds) of a checkpoint's save, and of the end of the run (the last write's wait, the export)."""
    hang_eval_s: float = 900.0
    """Budget (seconds) of an evaluation (validation loss, tasks, samples)."""

    # Stragglers (docs/hangs.md, "Stragglers"; lmrecipe/observe/stragglers.py)
    stragglers: bool = True
    """Time each micro-batch's forward on every rank (CUDA events on a GPU, the host's clock on a CPU), read at logged
    steps only and compared across ranks in the logged step's reduction: ``compute_s_median``, ``compute_s_max``,
    ``compute_slowest_rank`` and ``stragglers`` in every ``metrics.jsonl`` row. false = not timed."""
    straggler_margin: float = 0.2
    """A rank is named when its forward seconds per step exceed the median rank's by more than this fraction (0.2 =
    20 %) at ``straggler_logged_steps`` logged steps in a row."""
    straggler_logged_steps: int = 3
    """Logged steps in a row a rank must stay slower than the median by ``straggler_margin`` to be named with its host
    (in the log, the row's ``stragglers``, the doctor's findings and ``report.md``)."""

    def validate(self) -> None:
        _positive(self, "timeout_s", "sequence_parallel_size", "tensor_parallel_size", "expert_parallel_size",
                  "hang_step_floor_s", "hang_first_step_s", "hang_checkpoint_s", "hang_eval_s", "straggler_margin",
                  "straggler_logged_steps")
        self.fixed_hang_step_s()
        if self.hang_watchdog:
            self._check_hang_budgets()
        self.deepspeed_config_path()

    def _check_hang_budgets(self) -> None:
        """Every watchdog budget below ``timeout_s`` (the section's own keys: checked here, not in rules.py)."""
        budgets = {"hang_step_s": self.fixed_hang_step_s(), "hang_step_floor_s": self.hang_step_floor_s,
                   "hang_first_step_s": self.hang_first_step_s, "hang_checkpoint_s": self.hang_checkpoint_s,
                   "hang_eval_s": self.hang_eval_s}
        over = [f"distributed.{key}={value:g}" for key, value in budgets.items()
                if value is not None and value >= self.timeout_s]
        if over:
            raise fail(f"{', '.join(over)} must each be below distributed.timeout_s={self.timeout_s}: the collective's "
                       "timeout would end a hung run first, naming nobody. Lower the budget, or raise "
                       "distributed.timeout_s above it (docs/hangs.md).")

    def fixed_hang_step_s(self) -> Optional[float]:
        """``hang_step_s`` in seconds, or None for auto."""
        if self.hang_step_s.strip().lower() == "auto":
            return None
        try:
            value = float(self.hang_step_s)
        except ValueError:
            value = math.nan
        if not value > 0:
            raise fail(f"distributed.hang_step_s={self.hang_step_s!r} must be auto or a positive number of seconds.")
        return value

    def deepspeed_config_path(self) -> Optional[Path]:
        """The DeepSpeed JSON file, or None: see :func:`resolve_deepspeed_config`."""
        return resolve_deepspeed_config(self.deepspeed_config)

    def uses_autoep(self) -> bool:
        """Whether the MoE layers are DeepSpeed AutoEP's (:attr:`expert_layer`)."""
        return resolved_expert_layer(self.expert_layer, self.expert_parallel_size) == "autoep"

    def uses_deepspeed(self) -> bool:
        """Whether the run trains under DeepSpeed (``deepspeed_config`` names a file), without reading the file."""
        return self.deepspeed_config not in (None, "none", "null")


@dataclass
class ProfileConfig:
    first_step: Optional[int] = None
    """First optimizer step (1-based, as numbered in metrics.jsonl) run under ``torch.profiler``; null = off."""
    last_step: Optional[int] = None
    """Last profiled step (inclusive); null = ``first_step``."""
    ranks: Literal["all", "main"] = "all"
    """Processes that profile: every rank, or the main process only."""

    def validate(self) -> None:
        if self.first_step is not None and self.first_step < 1:
            raise fail(f"profile.first_step={self.first_step}, profile.last_step={self.last_step}: need "
                       "1 <= first_step <= last_step (optimizer steps, 1-based).")

    def last(self) -> int:
        return self.first_step if self.last_step is None else self.last_step


@dataclass(frozen=True)
class Workload:
    """What each rank computes and holds, as a view of the sections that fix it: the model, the windows, the batch,
    the optimizer and the parallel splits. Memory estimates and throughput predictions take this, not a Config."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    optim: OptimConfig
    distributed: DistributedConfig


@dataclass
class Config:
    out_dir: str = "runs/default"
    """Run folder: resolved config, metrics, checkpoints, export and plots."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture and its initialisation, or the checkpoint to continue from."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prepared token folders and the training window (tokens)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and its hyperparameters."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule (optimizer steps)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length (optimizer steps), batch sizes (sequences), precision and the loop's features."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Multiple-choice tasks scored during training."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are saved and kept, resuming, and the end-of-run export."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """Loss-spike detection and rollback."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics, experiment trackers and cost figures."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """DeepSpeed, timeouts and the sequence / tensor parallel splits (ranks)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Optimizer steps run under ``torch.profiler``."""

    def validate(self) -> None:
        """Every section's own checks; UserError listing all that fail (the cross-field rules: ``rules.py``)."""
        problems = []
        if not self.out_dir:
            problems.append("out_dir must be a non-empty folder path.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                try:
                    value.validate()
                except UserError as err:
                    problems.append(str(err))
        if problems:
            raise fail_all(problems)

    def to_dict(self) -> dict:
        """Plain values only (a :class:`Compile` as its string), as YAML and JSON write them."""
        return dataclasses.asdict(self, dict_factory=lambda items: {k: str(v) if isinstance(v, Compile) else v
                                                                     for k, v in items})

    def workload(self) -> Workload:
        return Workload(self.model, self.data, self.train, self.optim, self.distributed)


def due_at(step: int, every_steps: int, last_step: int) -> bool:
    """Whether an every-``every_steps`` action (0 = never) is due after optimizer step ``step`` (1-based); the last
    step ``last_step`` always is."""
    return step == last_step or (every_steps > 0 and step % every_steps == 0)


def autoep_size_of(run_config: dict) -> Optional[int]:
    """The DeepSpeed AutoEP size of a resolved config as saved (``Config.to_dict()``, a checkpoint's ``config``);
    None when its MoE layers are not AutoEP's (or it has none): :meth:`DistributedConfig.uses_autoep` on a dict."""
    dist = run_config.get("distributed", {})
    size, layer = int(dist.get("expert_parallel_size", 1)), dist.get("expert_layer", "auto")
    return size if resolved_expert_layer(layer, size) == "autoep" else None


def resolved_expert_layer(layer: str, expert_parallel_size: int) -> str:
    """``distributed.expert_layer`` as the layer it picks: ``auto`` is AutoEP's above ``expert_parallel_size`` 1 and
    the class's own block (``hf``) at 1."""
    return ("autoep" if expert_parallel_size > 1 else "hf") if layer == "auto" else layer


def flatten_config(data: dict, prefix: str = "") -> dict[str, Any]:
    """A ``Config.to_dict()`` as ``{"section.key": value}`` (``model.extra`` stays one value)."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "extra":
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def fixed_on_resume_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Dotted keys whose value a resume may not change (fields declared with ``_fixed``)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += fixed_on_resume_keys(hint, f"{prefix}{f.name}.")
        elif f.metadata.get("fixed_on_resume"):
            keys.append(prefix + f.name)
    return keys


def resolve_deepspeed_config(value: str | None) -> Optional[Path]:
    """Where ``distributed.deepspeed_config`` points: None for no DeepSpeed.

    A name without ``.json`` (``zero2``) is a file of the repository's ``ds_configs/``; a path is taken as
    given, relative to the working directory, and else relative to the repository root (so a job started
    from another folder finds ``ds_configs/zero2.json``). UserError naming the choices if there is no file.
    """
    if value is None or value in ("none", "null"):
        return None
    candidates = [DS_CONFIG_DIR / f"{value}.json"] if not value.endswith(".json") else [Path(value)]
    if value.endswith(".json") and not Path(value).is_absolute():
        candidates.append(REPO_ROOT / value)
    for path in candidates:
        if path.is_file():
            return path
    names = sorted(f"ds_configs/{p.name}" for p in DS_CONFIG_DIR.glob("*.json"))
    raise fail(
        f"distributed.deepspeed_config={value!r} is not a file. Choose one of {', '.join(names) or 'the files in ds_configs/'} "
        "(or its name alone, e.g. zero2), a path to another DeepSpeed JSON file, or null for no DeepSpeed."
    )


def parse_shard_size(size: str | int) -> int:
    """Bytes in a shard size such as ``"2GB"`` or ``"500MB"`` (decimal units, as huggingface_hub reads them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip().upper()
        try:
            value = int(float(text[:-2]) * units[text[-2:]]) if text[-2:] in units else int(text)
        except ValueError:
            value = 0
    if value <= 0:
        raise fail(f"Shard size {size!r} is not a size: write a number with KB, MB, GB or TB, e.g. 2GB or 500MB.")
    return value


def fail_all(problems: list[str], heading: str = "problems in the configuration") -> UserError:
    """One UserError for every problem found: the message itself when there is one, else a numbered heading and a
    line per problem (each keeps its own key, choices and fix)."""
    if len(problems) == 1:
        return fail(problems[0])
    lines = "\n".join(f"- {problem}" for problem in problems)
    return UserError(f"{len(problems)} {heading}:\n{lines}")


def _positive(section: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(section, key)
        if value <= 0:
            raise fail(f"{_section_name(section)}.{key}={value} must be positive.")


def _non_negative(section: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(section, key)
        if not math.isfinite(value) or value < 0:  # nan passes every comparison; inf overflows what it scales
            raise fail(f"{_section_name(section)}.{key}={value} must be a finite number, zero or positive.")


def _section_name(section: Any) -> str:
    return {type(f.default_factory()): f.name for f in dataclasses.fields(Config) if f.name != "out_dir"}[type(section)]
