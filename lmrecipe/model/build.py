"""Building the Hugging Face causal LM, its deterministic initialisation, and its FLOPs per token."""

from __future__ import annotations

import contextlib
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lmrecipe.model.attention import DocumentAttention, build_document_attention, check_attention_kernel
from lmrecipe.model.kernels import maybe_apply_kernels
from lmrecipe.model.linear_attention import install_per_document
from lmrecipe.config import DataConfig, ModelConfig, TrainConfig
from lmrecipe.data.tokenizer import check_same_tokenizer, tokenizer_name
from lmrecipe.errors import fail
from lmrecipe.optim import expert_params, moe_blocks

logger = logging.getLogger(__name__)


# Prefixes that wrappers (DDP, DeepSpeed's engine, torch.compile) add to parameter names.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def bare_parameter_name(name: str) -> str:
    """A parameter's name in the bare model (as the Hugging Face export names it), wrapper prefixes removed."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


@dataclass(frozen=True)
class MoeKeys:
    """The ``transformers`` config keys an MoE architecture takes the ``model.num_experts`` ... keys under."""

    experts: str
    """The routed expert count."""
    expert_width: str
    """One expert's MLP width."""
    shared_width: str | None = None
    """The shared expert's width (None: the architecture has no shared experts)."""
    shared_modules: tuple = ()
    """The MoE block's shared expert and its gate, as the class names them (DeepSpeed AutoEP names them
    ``shared_experts`` and ``shared_experts_gate``)."""
    extra: tuple = ()
    """Further fixed keys: (name, value) pairs."""
    shared_count: bool = False
    """``shared_width`` takes the number of shared experts (each of one expert's width), not their total width."""


MOE_ARCHS: dict[str, MoeKeys] = {
    # Every layer an MoE layer (decoder_sparse_step 1, no MLP-only layers), as in Qwen3-30B-A3B.
    "qwen3_moe": MoeKeys("num_experts", "moe_intermediate_size", extra=(("decoder_sparse_step", 1),
                                                                       ("mlp_only_layers", []))),
    "qwen2_moe": MoeKeys("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                         ("shared_expert", "shared_expert_gate"),
                         extra=(("decoder_sparse_step", 1), ("mlp_only_layers", []))),
    "mixtral": MoeKeys("num_local_experts", "intermediate_size"),
    # DeepSeek-V3: the first model.dense_layers layers have a dense MLP of model.intermediate_size (arch_config_kwargs).
    "deepseek_v3": MoeKeys("n_routed_experts", "moe_intermediate_size", "n_shared_experts", ("shared_experts",),
                           shared_count=True),
    "qwen3_5_moe_text": MoeKeys("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                                ("shared_expert", "shared_expert_gate")),
}
"""The MoE architectures a recipe can build (``model.num_experts`` > 0), each with a DeepSpeed AutoEP preset."""


def moe_config_kwargs(m: ModelConfig) -> dict:
    """The ``AutoConfig`` keywords of the ``model`` section's MoE keys (none for a dense model). The router's logits
    are returned so that its auxiliary loss and the load balance can be read (``output_router_logits``)."""
    if not m.is_moe():
        return {}
    keys = MOE_ARCHS[m.arch]
    kwargs = {keys.experts: m.num_experts, "num_experts_per_tok": m.experts_per_token,
              keys.expert_width: m.expert_size(), "router_aux_loss_coef": m.router_aux_loss_coef,
              "output_router_logits": True, **dict(keys.extra)}
    if keys.shared_width is not None:
        kwargs[keys.shared_width] = m.shared_experts if keys.shared_count else m.shared_experts * m.expert_size()
    return kwargs


_DEEPSEEK_V3_CONFIG = {"q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
                       "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
                       "v_head_dim": "v_head_dim", "expert_groups": "n_group", "expert_groups_per_token": "topk_group",
                       "routed_scaling_factor": "routed_scaling_factor", "dense_layers": "first_k_dense_replace"}
"""DeepSeek-V3's recipe keys and the ``DeepseekV3Config`` fields they set."""
_QWEN3_5_MOE_CONFIG = {"linear_key_heads": "linear_num_key_heads", "linear_value_heads": "linear_num_value_heads",
                       "linear_key_head_dim": "linear_key_head_dim", "linear_value_head_dim": "linear_value_head_dim"}
"""Qwen3.5-MoE's recipe keys and the ``Qwen3_5MoeTextConfig`` fields they set (the layer pattern apart)."""


def arch_config_kwargs(m: ModelConfig) -> dict:
    """The ``AutoConfig`` keywords of the keys only DeepSeek-V3 or Qwen3.5-MoE have; a null key keeps the class's
    default. ``q_lora_rank=0`` is the class's None (queries projected directly). Qwen3.5-MoE's attention heads are
    ``hidden_size / num_heads`` wide as in the other architectures (its class's default is 256 whatever the width;
    ``model.extra.head_dim`` sets another), and ``full_attention_every`` becomes its ``layer_types``."""
    if m.arch == "deepseek_v3":
        kwargs = {field: getattr(m, key) for key, field in _DEEPSEEK_V3_CONFIG.items() if getattr(m, key) is not None}
        if kwargs.get("q_lora_rank") == 0:
            kwargs["q_lora_rank"] = None
        return kwargs
    if m.arch == "qwen3_5_moe_text":
        kwargs = {field: getattr(m, key) for key, field in _QWEN3_5_MOE_CONFIG.items() if getattr(m, key) is not None}
        every = m.full_attention_every or 4
        kwargs["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                 for i in range(m.num_layers)]
        return {"head_dim": m.hidden_size // m.num_heads, **kwargs}
    return {}


def build_hf_config(m: ModelConfig, vocab_size: int, seq_len: int):
    """The ``transformers`` config of the model: from ``model.init_from`` or built from the recipe's ``model``
    section (``seq_len``, ``data.seq_len``: the position limit when ``model.max_position_embeddings`` is null)."""
    from transformers import AutoConfig

    if m.init_from is not None:
        if not (Path(m.init_from) / "config.json").is_file():
            raise fail(
                f"model.init_from={m.init_from!r} has no config.json: it must be a local Hugging Face checkpoint "
                "folder (e.g. an export of this recipe, or a downloaded model). Set model.init_from=null to train from scratch."
            )
        hf_config = AutoConfig.from_pretrained(m.init_from)
        check_init_from_experts(m, hf_config)
        return hf_config
    kwargs = dict(
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.kv_heads(),
        intermediate_size=m.mlp_size(),
        vocab_size=vocab_size,
        max_position_embeddings=m.max_position_embeddings or seq_len,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_std,
        use_cache=False,
    )
    try:
        return AutoConfig.for_model(m.arch, **{**kwargs, **moe_config_kwargs(m), **arch_config_kwargs(m), **m.extra})
    except ValueError as err:
        raise fail(f"model.arch={m.arch!r} is not a transformers architecture ({err}).") from None


def exported_experts(hf_config) -> tuple[str | None, int]:
    """(config key, routed experts per MoE layer) of a ``transformers`` config; (None, 0) for a dense model."""
    keys = MOE_ARCHS.get(getattr(hf_config, "model_type", None))
    for key in (keys.experts,) if keys is not None else ("num_experts", "num_local_experts", "n_routed_experts"):
        if int(getattr(hf_config, key, 0) or 0) > 0:
            return key, int(getattr(hf_config, key))
    return None, 0


def check_init_from_experts(m: ModelConfig, hf_config) -> None:
    """UserError when ``model.num_experts`` or ``model.experts_per_token`` contradict the model ``model.init_from``
    holds (``hf_config``, its config.json), naming each key, the model's value and the fix.

    A model continued from ``init_from`` is the folder's: its shape keys (``hidden_size`` ...) are used only to build a
    model from scratch. These two are read by the run itself (the router's loss, each expert's token count, the
    mixture-of-experts rules) and recorded in ``config.yaml``, so they must describe the model. They are not applied
    to it instead: the config cannot tell a key the user set from a default (``experts_per_token`` is 2 unless set),
    and a default silently re-routing a top-8 model would be worse than the refusal."""
    key, experts = exported_experts(hf_config)
    per_token = int(getattr(hf_config, "num_experts_per_tok", 0) or 0) if experts else 0
    wrong = {}
    if m.num_experts != experts:
        wrong["num_experts"] = (m.num_experts, experts)
    if experts and m.experts_per_token != per_token:
        wrong["experts_per_token"] = (m.experts_per_token, per_token)
    if not wrong:
        return
    model = (f"an MoE model of {experts} routed experts per layer, {per_token} per token ({key}={experts}, "
             f"num_experts_per_tok={per_token} in its config.json)" if experts else
             "a dense model (no experts in its config.json)")
    keys = ", ".join(f"model.{k}={ours} (the model's: {theirs})" for k, (ours, theirs) in wrong.items())
    fix = " ".join(f"model.{k}={theirs}" for k, (_, theirs) in wrong.items())
    reroute = (f" (to route each token to another number of experts, edit num_experts_per_tok in {m.init_from}/"
               "config.json: the weights do not depend on it)" if "experts_per_token" in wrong else "")
    raise fail(f"model.init_from={m.init_from} is {model}, and this run says {keys}. A model continued from "
               "model.init_from is the folder's, and the run reads these keys (the router's loss, the expert load) and "
               f"records them in config.yaml. Set {fix}{reroute}, "
               "or model.init_from=null to build the recipe's model from scratch.")


def check_init_tokenizer(m: ModelConfig, data_dir: str | Path) -> None:
    """UserError when ``model.init_from`` holds another tokenizer than the one ``data_dir`` was prepared with: its
    weights learned what its own ids stand for (``lmrecipe/data/tokenizer.py`` compares them)."""
    if m.init_from is None:
        return
    check_same_tokenizer(
        m.init_from, data_dir,
        what=f"model.init_from={m.init_from} was trained with another tokenizer than the one "
             f"{tokenizer_name(data_dir)} was prepared with",
        fix=f"Prepare the data with the model's tokenizer (python tools/prepare_data.py --input CORPUS --tokenizer "
            f"{m.init_from} --output NEW_DATA, then data.path=NEW_DATA), or set model.init_from=null to train from "
            "scratch on this data.")


CAUSAL_SDPA = "lmrecipe_causal_sdpa"
"""transformers' SDPA attention, registered under a name that has no mask builder (see :func:`training_attention`)."""


def training_attention(name: str) -> str:
    """The attention implementation the training model runs for ``model.attn_implementation=name``.

    Training windows are contiguous token windows without padding, so the mask is plain causal. For "sdpa",
    transformers' mask builder would still inspect the position ids on every forward for packed sequences,
    which reads a tensor on the host (``Tensor.__bool__``: a GPU sync per forward). Registered under a name
    with no mask function, the same SDPA function gets no mask and runs with ``is_causal=True``: the kernel
    the stock path picks for such a batch, without the sync. Exports and evaluation keep the stock "sdpa".
    """
    if name != "sdpa":
        return name
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def build_attention(model: ModelConfig, data: DataConfig, hf_config) -> DocumentAttention | None:
    """The document-masking attention of ``data.document_masking`` (``lmrecipe/model/attention.py``), or None when off
    (plain causal windows). A model or attention implementation that cannot mask is refused here, at start-up, as is
    a flash kernel that cannot run on this machine."""
    check_attention_kernel(model.attn_implementation)
    if not data.document_masking:
        return None
    return build_document_attention(model.attn_implementation, hf_config)


def build_model(m: ModelConfig, train: TrainConfig, hf_config, attention: DocumentAttention | None = None,
                device: torch.device | str | None = None) -> nn.Module:
    """Create (or load) the model of the ``model`` section, initialised from ``train.seed``, with ``train``'s
    activation checkpointing and ``model.kernels``. Call after the Accelerator exists, so ZeRO-3 partitions at
    construction.

    ``attention``: the document-masking attention (:func:`build_attention`); every forward then needs its
    ``forward_kwargs``. None builds the plain causal attention of :func:`training_attention`. ``device``: where a
    model built from scratch is created and initialised (None: the CPU); on a GPU a 1B model takes seconds instead
    of the CPU's half minute.
    """
    from transformers import AutoModelForCausalLM

    implementation = attention.name if attention is not None else training_attention(m.attn_implementation)
    if m.init_from is not None:
        # The router's logits, which its auxiliary loss is computed from (a model from elsewhere may not return
        # them; the expert load is counted from the routers' choices, model/routing.py); num_experts and experts_per_token agree with the folder's (check_init_from_experts).
        router = {"output_router_logits": True} if m.is_moe() else {}
        model = AutoModelForCausalLM.from_pretrained(m.init_from, attn_implementation=implementation, dtype=torch.float32,
                                                     **router)
    else:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=implementation, dtype=torch.float32)
        init_weights_(model, std=m.init_std, seed=train.seed)
    model.config.use_cache = False
    if attention is not None and attention.linear_attention:
        install_per_document(model)
    maybe_apply_kernels(model, m.kernels, m.is_moe())
    if train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": train.checkpointing_reentrant})
    return model


FP8_DIVISOR = 16
"""torchao's float8 matmuls need both dimensions of a weight divisible by this."""


def fp8_layer_filter(model: nn.Module) -> tuple[Callable[[nn.Module, str], bool], dict[str, str]]:
    """Which linear layers ``train.precision=fp8`` swaps for torchao's ``Float8Linear``: the filter Accelerate calls
    with each module and its name, and the linear layers that stay in bf16, each with the reason. The first and the
    last linear layer stay (Accelerate's rule: quantising them hurts stability) and so does every layer with a
    dimension not divisible by 16. The dimensions are read from ``in_features``/``out_features``, which survive a
    ZeRO-3 partition."""
    modules = {bare_parameter_name(name): m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    linears = list(modules)
    kept: dict[str, str] = {}
    for i, name in enumerate(linears):
        module = modules[name]
        if i == 0 or i == len(linears) - 1:
            kept[name] = "first linear layer" if i == 0 else "last linear layer"
        elif module.in_features % FP8_DIVISOR or module.out_features % FP8_DIVISOR:
            kept[name] = f"{module.out_features}x{module.in_features} not divisible by {FP8_DIVISOR}"

    def converts(module: nn.Module, name: str) -> bool:
        name = bare_parameter_name(name)  # a compiled model's names carry _orig_mod.
        return isinstance(module, nn.Linear) and name in modules and name not in kept

    return converts, kept


def _gathered(param: nn.Parameter):
    """Context in which a ZeRO-3 partitioned parameter is whole and rank 0's writes are broadcast."""
    if hasattr(param, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=0)
    return contextlib.nullcontext()


@torch.no_grad()
def init_weights_(model: nn.Module, std: float, seed: int) -> None:
    """Initialise every parameter from a generator seeded by (seed, parameter name), on the parameter's device.

    Construction order and RNG use differ between plain, ZeRO-3 (``zero.Init``) and multi-process models;
    seeding per name makes the initial weights identical in all of them, so their losses can be compared. The
    values depend on the device kind they are drawn on (CPU or CUDA: another generator), not on their distribution.
    """
    for name, param in model.named_parameters():
        with _gathered(param):
            if param.numel() == 0:
                continue  # ZeRO-3 ranks other than the modifier see an empty tensor here
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)  # norm gains
            else:
                gen = torch.Generator(param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                param.copy_(torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, std, generator=gen))


def numel(param: nn.Parameter) -> int:
    """Elements of a parameter, also when ZeRO-3 has partitioned it away."""
    return int(getattr(param, "ds_numel", param.numel()))


def param_counts(model: nn.Module) -> dict[str, int]:
    """Total parameters (tied weights counted once), ``active``: those one token passes through (an MoE model's
    routed experts count ``num_experts_per_tok`` of ``num_experts``; equal to the total for a dense model) and
    ``lookup``: those used only as an embedding lookup.

    ``lookup`` is the input embedding unless it is tied to the output projection, which is a real matmul.
    """
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += numel(param)
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and outputs.weight is inputs.weight
    lookup = 0 if tied else sum(numel(p) for p in inputs.parameters())
    experts = sum(numel(p) for p in expert_params(model))
    return {"total": total, "active": total - experts + round(experts * active_expert_share(model.config)),
            "lookup": lookup}


def active_expert_share(hf_config) -> float:
    """The share of the routed experts one token passes through: ``num_experts_per_tok / num_experts`` (1 for a
    dense model)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or getattr(
        hf_config, "n_routed_experts", None)
    if not experts:
        return 1.0
    return hf_config.num_experts_per_tok / experts


def set_moe_leaf_modules(model: nn.Module) -> list[str]:
    """Make every MoE block a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_modules``): its parameters are
    gathered together, before its forward, on every rank. Without it, a rank fetches only the experts its tokens
    chose, ranks disagree on the order of the gathers, and the run hangs (DeepSpeed#4808). Returns the block classes'
    names (none for a dense model)."""
    classes = sorted({type(block) for block in moe_blocks(model)}, key=lambda c: c.__name__)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def compile_layers(model: nn.Module) -> int:
    """``train.compile=layers``: each decoder layer compiled in place (``Module.compile``, torchtitan's regional
    compile): the module objects, their names, hooks and state dict stay as they are, only their ``__call__`` runs
    compiled. The layers of a model share one graph (their code and shapes are the same), so a model compiles about
    one layer's worth whatever its depth. Returns the number of layers compiled."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise fail(f"train.compile=layers: {type(model).__name__} has no decoder layers where transformers keeps them "
                   "(get_decoder().layers). Choose train.compile=model (the whole model) or none.")
    for layer in layers:
        layer.compile()
    return len(layers)


def count_params_from_config(hf_config) -> dict[str, int]:
    """Parameter counts without materialising weights (meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return param_counts(model)


def attention_width(hf_config) -> int:
    """The width the attention's S^2 matmuls run at, summed over the layers: each softmax-attention layer adds its
    query/key width and its value width over all heads (QK^T, then the probabilities times V); a linear-attention
    layer (Qwen3.5-MoE's gated DeltaNet, ``layer_types``) adds none: its cost grows with the window, not its square,
    and its projections are parameters. DeepSeek-V3's latent attention counts its real head widths (``qk_nope_head_dim
    + qk_rope_head_dim`` for QK^T, ``v_head_dim`` for AV). Other architectures count ``hidden_size`` for each, as
    before (Llama's heads are ``hidden_size / heads`` wide)."""
    c, layers = hf_config, hf_config.num_hidden_layers
    if c.model_type == "deepseek_v3":
        return layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    if c.model_type == "qwen3_5_moe_text":
        full = sum(1 for kind in c.layer_types[:layers] if kind == "full_attention")
        return full * 2 * c.num_attention_heads * c.head_dim
    return layers * 2 * c.hidden_size


def flops_per_token(n_params: int, n_lookup: int, num_layers: int, hidden_size: int, seq_len: int,
                    attention_width: int | None = None) -> float:
    """Training FLOPs per token: 6 x (non-embedding params, output projection included) + attention.

    The attention term 12 * layers * hidden * seq_len counts QK^T and AV forward and backward (PaLM, App. B);
    the input embedding is a lookup, not a matmul, so its parameters (``n_lookup``) are left out.
    ``attention_width`` (:func:`attention_width`): the query/key plus value widths summed over the softmax-attention
    layers, for an architecture whose heads are not ``hidden_size`` wide in all (the term is then 6 * width *
    seq_len); None: 2 * layers * hidden.
    """
    width = 2 * num_layers * hidden_size if attention_width is None else attention_width
    return 6.0 * (n_params - n_lookup) + 6.0 * width * seq_len
