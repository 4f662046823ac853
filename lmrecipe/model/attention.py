"""Document masking in attention: each token attends only to earlier tokens of its own document.

:func:`build_document_attention` maps ``model.attn_implementation`` to the implementation the training model is
built with, and its :meth:`~DocumentAttention.forward_kwargs` turns a :class:`~lmrecipe.data.documents.DocumentBatch`
into the keyword arguments of every forward: ``model(input_ids=inputs, **kwargs)``. transformers hands a forward's
extra keyword arguments down to the attention function (``**kwargs: TransformersKwargs``, model -> decoder layer ->
attention module -> attention function), so per-batch data reaches it without changing the model code.

- ``sdpa`` -> :data:`DOCUMENT_SDPA`: transformers' SDPA under a block-diagonal causal boolean mask that is built once
  per forward, on the device, from ``document_ids`` (keyword ``document_mask``), and turned once per forward into
  the additive mask all layers share.
- ``eager`` -> ``eager``: the model's own eager attention with that mask as an additive 4D ``attention_mask``
  (transformers passes a 4D mask through as is). Refused for models with sliding-window layers.
- ``flash_attention_2`` / ``flash_attention_3`` -> the names of :data:`DOCUMENT_FLASH`: the variable-length kernel
  with ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the host, over the batch flattened row-major.
- ``varlen`` / ``flex_attention`` -> ``varlen.VARLEN`` / ``varlen.FLEX`` (``lmrecipe/model/varlen.py``): no dense
  mask; torch's own flash variable-length kernel (a per-document stand-in without it), or FlexAttention.

Every path passes ``position_ids`` restarting at each document. A model with gated DeltaNet layers (Qwen3.5,
Qwen3-Next) also gets the keyword ``linear_attention_documents``: those layers run per document
(``lmrecipe/model/linear_attention.py``); other recurrent layers are refused. None runs transformers' mask builder or its
packed-sequence detection, which read the device (a host sync per forward): our names have no mask function, and
a 4D mask skips both. Anything else is refused with a UserError naming ``data.document_masking``.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmrecipe.errors import fail
from lmrecipe.model.linear_attention import KEYWORD as LINEAR_KEYWORD
from lmrecipe.model.linear_attention import check_linear_attention, document_segments
from lmrecipe.model.varlen import (BLOCK_MASK, FLEX, STAND_IN, VARLEN, document_block_mask, document_flex_forward,
                                   document_varlen_forward, varlen_kernel_name, varlen_kwargs)

DOCUMENT_SDPA = "lmrecipe_document_sdpa"
"""transformers' SDPA attention under the ``document_mask`` keyword argument (see :func:`document_sdpa_forward`)."""
DOCUMENT_FLASH = {"flash_attention_2": "lmrecipe_document_fa2", "flash_attention_3": "lmrecipe_document_fa3"}
"""Our name for each flash kernel. No "flash" in them: transformers would try to load a hub kernel of that name."""
_FLASH_KERNEL = {ours: kernel for kernel, ours in DOCUMENT_FLASH.items()}
NO_DENSE_MASK = {"varlen": (VARLEN, document_varlen_forward), "flex_attention": (FLEX, document_flex_forward)}
"""Our name and attention function for each implementation that masks without a dense mask (``varlen.py``)."""
SUPPORTED = ("sdpa", "eager", *DOCUMENT_FLASH, *NO_DENSE_MASK)
_OFF = "or set data.document_masking=false"


@dataclass(frozen=True)
class DocumentAttention:
    """``requested``: ``model.attn_implementation``; ``name``: the implementation to build the model with;
    ``linear_attention``: the model has linear-attention layers, run per document (``linear_attention.py``)."""

    requested: str
    name: str
    linear_attention: bool = False

    def forward_kwargs(self, batch, device: torch.device | str) -> dict:
        """Keyword arguments for ``model(input_ids=..., **kwargs)`` of the batch ``batch`` (a DocumentBatch).

        Host arrays are copied with ``non_blocking=True`` (asynchronous from pinned memory, see
        ``DocumentBatch.as_tensors``); the masks are built on ``device``. Nothing is read back to the host.
        """
        kwargs = self._attention_kwargs(batch, device)
        if self.linear_attention:  # the cut of each linear-attention layer, from the host boundaries
            kwargs[LINEAR_KEYWORD] = document_segments(batch, device)
            kwargs["use_cache"] = False  # an export's config asks for a cache, which no layer run per document fills
        return kwargs

    def _attention_kwargs(self, batch, device: torch.device | str) -> dict:
        position_ids = _to_device(batch.position_ids, device)
        if self.requested in DOCUMENT_FLASH:
            return {"position_ids": position_ids, **flash_varlen_kwargs(batch, device)}
        if self.requested == "varlen":
            return {"position_ids": position_ids, **varlen_kwargs(batch, device)}
        if self.requested == "flex_attention":
            return {"position_ids": position_ids,
                    BLOCK_MASK: document_block_mask(_to_device(batch.document_ids, device))}
        mask = block_causal_mask(_to_device(batch.document_ids, device))
        if self.requested == "eager":
            return {"position_ids": position_ids, "attention_mask": additive_mask(mask)}
        return {"position_ids": position_ids, "document_mask": mask}


def build_document_attention(attn_implementation: str, hf_config) -> DocumentAttention:
    """Check that ``attn_implementation`` can mask documents for the causal LM of ``hf_config``; register our
    attention functions. UserError naming the fix for what cannot (flex attention, a missing flash kernel, a model
    without ``position_ids`` or whose attention does not go through transformers' ``AttentionInterface``)."""
    _check_supported(attn_implementation)
    model_class = _causal_lm_class(hf_config)
    linear = check_linear_attention(hf_config)
    _check_model(model_class, attn_implementation, hf_config, linear)
    from transformers import AttentionInterface

    if attn_implementation in DOCUMENT_FLASH:
        _load_flash_kernel(attn_implementation)
        AttentionInterface.register(DOCUMENT_FLASH[attn_implementation], document_flash_forward)
        return DocumentAttention(attn_implementation, DOCUMENT_FLASH[attn_implementation], linear)
    if attn_implementation == "eager":
        return DocumentAttention("eager", "eager", linear)
    if attn_implementation in NO_DENSE_MASK:
        name, function = NO_DENSE_MASK[attn_implementation]
        AttentionInterface.register(name, function)
        return DocumentAttention(attn_implementation, name, linear)
    AttentionInterface.register(DOCUMENT_SDPA, document_sdpa_forward)
    return DocumentAttention("sdpa", DOCUMENT_SDPA, linear)


FLASH_MODULES = {"flash_attention_2": ("flash_attn", "flash-attn"),
                 "flash_attention_3": ("flash_attn_interface", "flash-attn-3")}
"""The module each flash kernel is imported from, and the package that installs it."""


def check_attention_kernel(attn_implementation: str) -> None:
    """UserError naming the fix when the training attention cannot run here: FlexAttention without CUDA (torch 2.13
    has no FlexAttention backward on a CPU), or a flash kernel (``flash_attention_2/3``) without CUDA or without its
    package or the ``kernels`` library (transformers' fallback that fetches a built kernel). Called at start-up, with
    or without document masking, before anything is built."""
    if attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise fail("""
            model.attn_implementation=flex_attention cannot train on this machine: it has no CUDA GPU, and torch has
            no FlexAttention backward on a CPU (torch 2.13: "FlexAttention does not support backward on CPU", eager
            or compiled). Train with model.attn_implementation=varlen (document masking without a dense mask: a
            per-document stand-in here, torch's flash variable-length kernel on a GPU) or sdpa, or run on a CUDA
            GPU.""")
    if attn_implementation not in FLASH_MODULES:
        return
    module, package = FLASH_MODULES[attn_implementation]
    fix = "or set model.attn_implementation=sdpa (any device, the same model)."
    if not torch.cuda.is_available():
        raise fail(f"model.attn_implementation={attn_implementation} needs a CUDA GPU and this machine has none: "
                   f"run on a GPU machine with the {package} package installed, {fix}")
    if not (_installed(module) or _installed("kernels")):
        raise fail(f"model.attn_implementation={attn_implementation} needs the {package} package (module {module}), "
                   f"which is not installed in this environment: install it on this GPU machine, {fix}")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _check_supported(attn_implementation: str) -> None:
    if attn_implementation not in SUPPORTED:
        raise fail(f"""
            data.document_masking=true supports model.attn_implementation in {', '.join(SUPPORTED)}; got
            {attn_implementation!r}. Choose one of them, {_OFF}.""")


def _causal_lm_class(hf_config) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise fail(f"data.document_masking=true: {type(hf_config).__name__} has no causal LM class in transformers; "
                   f"choose another model.arch, {_OFF}.") from None


def _check_model(model_class: type, attn_implementation: str, hf_config, linear: bool = False) -> None:
    """``linear``: the model's linear-attention layers run per document (``check_linear_attention``); transformers
    calls such a model not backend-compatible for them, while its full-attention layers use AttentionInterface."""
    name = f"{model_class.__name__} (model.arch={hf_config.model_type})"
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        raise fail(f"""
            data.document_masking=true needs position ids that restart at each document, but {name} takes no
            position_ids in its forward. Use an architecture that does (llama, mistral, qwen2, gpt2, ...), {_OFF}.""")
    if not (linear or model_class.is_backend_compatible()):
        raise fail(f"""
            data.document_masking=true: {name} does not route its attention through transformers'
            AttentionInterface, so the document boundaries cannot reach it. Use an architecture that does (llama,
            mistral, qwen2, gpt2, ...), {_OFF}.""")
    if attn_implementation in DOCUMENT_FLASH and not model_class._supports_flash_attn:
        raise fail(f"data.document_masking=true: {name} does not support flash attention. Use "
                   f"model.attn_implementation=sdpa, {_OFF}.")
    if attn_implementation in NO_DENSE_MASK:
        _check_no_dense_mask(attn_implementation, name, hf_config)
    if attn_implementation == "eager" and getattr(hf_config, "sliding_window", None) is not None:
        raise fail(f"""
            data.document_masking=true with model.attn_implementation=eager would drop the sliding window of {name}
            (sliding_window={hf_config.sliding_window}): its mask is passed whole to every layer. Use
            model.attn_implementation=sdpa (which applies the window per layer), {_OFF}.""")


def _check_no_dense_mask(attn_implementation: str, name: str, hf_config) -> None:
    """varlen and flex_attention run plain causal attention per document: no sliding window, soft-capping or sinks."""
    extras = {key: getattr(hf_config, key, None) for key in ("sliding_window", "attn_logit_softcapping")}
    extras = {key: value for key, value in extras.items() if value is not None}
    if hf_config.model_type == "gpt_oss":
        extras["attention sinks"] = True
    if extras:
        raise fail(f"""
            data.document_masking=true with model.attn_implementation={attn_implementation} runs plain causal
            attention per document, and {name} has {', '.join(f'{k}={v}' for k, v in extras.items())}. Use
            model.attn_implementation=sdpa (which applies them per layer), {_OFF}.""")


def _load_flash_kernel(attn_implementation: str) -> None:
    """Load the kernel now, as transformers does when it builds a flash model, so a missing one fails at start-up."""
    from transformers import modeling_flash_attention_utils as flash_utils

    try:
        flash_utils.lazy_import_flash_attention(attn_implementation)
    except (ImportError, ValueError, OSError, RuntimeError) as err:  # not installed, or the hub fallback failed
        raise fail(f"""
            data.document_masking=true with model.attn_implementation={attn_implementation}: the flash kernel cannot
            be loaded here ({type(err).__name__}: {err}). Install flash-attn on a GPU machine, or use
            model.attn_implementation=sdpa, {_OFF}.""") from None


def _to_device(array, device) -> torch.Tensor:
    return torch.as_tensor(array).to(device, non_blocking=True)


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[rows, 1, seq, seq]`` mask, True where query i may attend key j: same segment and j <= i."""
    seq_len = document_ids.shape[-1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """The boolean mask as eager attention adds it to the scores: 0 where allowed, the float32 minimum elsewhere."""
    blocked = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return blocked.masked_fill_(~mask, torch.finfo(torch.float32).min)


def flash_varlen_kwargs(batch, device: torch.device | str) -> dict:
    """The variable-length keywords of transformers' flash path, for the batch flattened row-major.

    transformers reshapes ``[rows, seq, heads, dim]`` to ``[rows * seq, heads, dim]`` before the varlen kernel, so
    ``input_ids`` stay ``[rows, seq]``. With all four keywords present it never derives them from position_ids.
    """
    cu_seqlens = _to_device(batch.cu_seqlens, device)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
            "max_length_q": batch.max_seqlen, "max_length_k": batch.max_seqlen}


def _missing(keyword: str, name: str) -> ValueError:
    return ValueError(f"attention {name!r} needs the forward keyword {keyword!r} (DocumentAttention.forward_kwargs); "
                      "without it documents would attend to each other. Pass it to every forward of this model.")


def document_sdpa_forward(module, query, key, value, attention_mask, document_mask=None, sliding_window=None,
                          **kwargs):
    """transformers' ``sdpa_attention_forward`` under ``document_mask`` (True = attend), which already holds the
    causal part: with a mask, the stock function runs SDPA with ``is_causal=False`` and repeats the key/value
    heads for grouped-query attention itself. ``attention_mask`` is always None here (no mask builder)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if document_mask is None:
        raise _missing("document_mask", DOCUMENT_SDPA)
    if sliding_window is not None:  # this layer only sees the last sliding_window keys (transformers' convention)
        positions = torch.arange(document_mask.shape[-1], device=document_mask.device)
        document_mask = document_mask & (positions[:, None] - positions[None, :] < sliding_window)
    else:
        document_mask = _shared_additive(document_mask, query.dtype)
    return sdpa_attention_forward(module, query, key, value, document_mask, **kwargs)


def _shared_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as one additive mask in the attention's dtype, made by the first layer of a forward and
    reused by the others (kept on the mask tensor, which lives for one forward). Handed a boolean mask, SDPA would
    convert it in every layer and keep each copy for the backward: measured on CPU, 32 MiB per layer for 2 x 2,048
    tokens. The results are the same: the allowed scores get 0 added, the others the dtype's minimum.

    Inside a compiled layer (``train.compile=layers``) each layer makes its own: the cache would give the first layer
    a graph of its own (it writes the attribute the others read), and the compiled backward recomputes the additive
    mask from the boolean one instead of keeping a copy per layer."""
    if torch.compiler.is_compiling():
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    cached = getattr(mask, "_lmrecipe_additive", None)
    if cached is None or cached.dtype != dtype:
        cached = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        mask._lmrecipe_additive = cached
    return cached


def document_flash_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                           softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' ``flash_attention_forward``, but telling the kernel loader the real kernel name (the stock
    function passes the model's, which is ours) and requiring the precomputed varlen keywords."""
    from transformers.integrations.flash_attention import _use_top_left_mask, get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    if kwargs.get("cu_seq_lens_q") is None:
        raise _missing("cu_seq_lens_q", module.config._attn_implementation)
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))  # flash layout: [batch, seq, heads, dim]
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if value_dim != head_dim:  # flash needs equal head dims (e.g. MLA): pad the values, crop the output
        value = F.pad(value, [0, head_dim - value_dim])
    output = _flash_attention_forward(
        query, key, value, None,
        query_length=query.shape[1],
        is_causal=module.is_causal if is_causal is None else is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        use_top_left_mask=_use_top_left_mask,
        target_dtype=get_target_dtype(query, module),
        attn_implementation=_FLASH_KERNEL[module.config._attn_implementation],
        layer_idx=getattr(module, "layer_idx", None),
        s_aux=None if s_aux is None else s_aux.to(query.dtype),
        **kwargs,
    )
    return output[..., :value_dim], None


PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}
"""The dtype the attention computes in under ``train.precision`` (fp8 runs its attention in bf16); fp32 otherwise."""


PROBE_TOKENS = 4096
"""The longest window the start-up's SDPA probe allocates (a longer run's backend is the one for this length): a
dense mask of a 131,072-token window would take 32 GiB of the device for the probe alone."""


def attention_record(requested: str, document_masking: bool, hf_config, seq_len: int, precision: str,
                     device: torch.device | str) -> dict:
    """What the training attention runs, for ``run_meta.json`` and the start-up log: the implementation, its kernel,
    and the SDPA backend torch picks (``torch._fused_sdp_choice``, None where no SDPA runs) for a one-row dummy of
    the run's query/key heads, head size, window (at most :data:`PROBE_TOKENS`), dtype and device, with the mask kind
    the path passes. Called once at start-up: nothing is read back in the loop."""
    seq_len = min(seq_len, PROBE_TOKENS)
    dtype = PRECISION_DTYPES.get(precision, torch.float32)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    sdpa, kernel = None, requested
    if requested == "varlen":  # the stand-in runs causal SDPA per document, key/value heads as they are
        kernel = varlen_kernel_name(device, dtype)
        sdpa = _sdpa_backend(heads, kv_heads, head_dim, seq_len, dtype, device, None) if kernel == STAND_IN else None
    elif requested == "sdpa" and document_masking:  # one additive mask; transformers repeats the key/value heads
        kernel = "sdpa under a dense block-causal mask"
        mask = torch.zeros(1, 1, seq_len, seq_len, dtype=dtype, device=device)
        sdpa = _sdpa_backend(heads, heads, head_dim, seq_len, dtype, device, mask)
    elif requested == "sdpa":
        kernel = "sdpa, causal"
        sdpa = _sdpa_backend(heads, kv_heads, head_dim, seq_len, dtype, device, None)
    return {"implementation": requested, "kernel": kernel, "sdpa_backend": sdpa}


def _sdpa_backend(heads: int, kv_heads: int, head_dim: int, seq_len: int, dtype, device, mask) -> str:
    from torch.nn.attention import SDPBackend

    query = torch.zeros(1, heads, seq_len, head_dim, dtype=dtype, device=device)
    key = torch.zeros(1, kv_heads, seq_len, head_dim, dtype=dtype, device=device)
    choice = torch._fused_sdp_choice(query, key, key, attn_mask=mask, is_causal=mask is None,
                                     enable_gqa=kv_heads != heads)
    return SDPBackend(choice).name
