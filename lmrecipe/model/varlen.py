"""Document masking without a dense mask: attention run per document from the batch's document offsets.

- ``model.attn_implementation=varlen`` -> :data:`VARLEN` (:func:`document_varlen_forward`): the batch flattened
  row-major to ``[rows * seq, heads, dim]`` and cut at ``cu_seqlens`` (the :class:`~lmrecipe.data.documents.DocumentBatch`
  offsets, on the device for the kernel and on the host for the stand-in: nothing is read back). Grouped-query
  attention hands the kernel the key/value heads as they are, never repeated. :func:`varlen_kernel` is the one place
  that chooses what runs: on CUDA in fp16/bf16, torch's flash variable-length kernel (the ATen pair
  ``_flash_attention_forward`` / ``_flash_attention_backward`` in :class:`FlashVarlen`); elsewhere
  :func:`per_document_sdpa`, a stand-in with the kernel's positional signature that runs each document through causal
  SDPA. ``max_q = max_k`` = the window length, so a compiled layer sees the same integers for every batch.
- ``model.attn_implementation=flex_attention`` -> :data:`FLEX` (:func:`document_flex_forward`): FlexAttention under a
  block mask built once per forward from ``document_ids`` (:func:`document_block_mask`). torch 2.13 has no FlexAttention
  backward on a CPU, so training with it needs CUDA (``attention.check_attention_kernel``); its forward runs anywhere.

Both refuse sliding-window layers, logit soft-capping and attention sinks at start-up (``attention._check_model``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

VARLEN = "lmrecipe_document_varlen"
"""Our AttentionInterface name for ``model.attn_implementation=varlen``."""
FLEX = "lmrecipe_document_flex"
"""Our AttentionInterface name for ``model.attn_implementation=flex_attention`` with document masking."""
CU_SEQLENS = "varlen_cu_seqlens"
"""Forward keyword: int32 ``[segments + 1]`` segment starts of the flattened batch, on the model's device."""
HOST_CU_SEQLENS = "varlen_host_cu_seqlens"
"""Forward keyword: the same offsets as an int64 CPU tensor, which the stand-in cuts with (no device read)."""
BLOCK_MASK = "flex_block_mask"
"""Forward keyword: the FlexAttention ``BlockMask`` of the batch's documents."""

FLASH_KERNEL = "aten._flash_attention_forward/_backward (flash varlen)"
STAND_IN = "per-document SDPA stand-in"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_kwargs(batch, device: torch.device | str) -> dict:
    """The offsets of ``batch`` (a DocumentBatch) for :func:`document_varlen_forward`: on ``device`` (copied with
    ``non_blocking=True``) and on the host."""
    host = torch.as_tensor(batch.cu_seqlens)
    offsets = {CU_SEQLENS: host.to(device, dtype=torch.int32, non_blocking=True), HOST_CU_SEQLENS: host.to(torch.int64)}
    for tensor in offsets.values():  # a compiled layer takes any document count without recompiling
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return offsets


def varlen_kernel_name(device: torch.device | str, dtype: torch.dtype) -> str:
    """What ``varlen`` runs for queries of ``dtype`` on ``device``: :data:`FLASH_KERNEL` or :data:`STAND_IN`."""
    flash = (torch.device(device).type == "cuda" and dtype in _FLASH_DTYPES
             and torch.backends.cuda.is_flash_attention_available())
    return FLASH_KERNEL if flash else STAND_IN


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> Callable:
    """The kernel for ``device`` and ``dtype`` (see :func:`varlen_kernel_name`); both take the same arguments."""
    return flash_varlen if varlen_kernel_name(device, dtype) == FLASH_KERNEL else per_document_sdpa


class FlashVarlen(torch.autograd.Function):
    """torch's flash variable-length kernel with its backward. The ATen ops are called by position with ``scale`` as
    the only keyword: the positions are the same in torch 2.11-2.13, the keywords after them moved."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, max_seqlen: int, dropout_p: float, is_causal: bool, scale):
        output, logsumexp, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, is_causal, False,
            scale=scale)
        # rng_state/unused: the philox seed and offset of the dropout, which the backward replays
        ctx.save_for_backward(query, key, value, cu_seqlens, output, logsumexp, rng_state, unused)
        ctx.args = (max_seqlen, dropout_p, is_causal, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, cu_seqlens, output, logsumexp, rng_state, unused = ctx.saved_tensors
        max_seqlen, dropout_p, is_causal, scale = ctx.args
        grad_query, grad_key, grad_value = torch.ops.aten._flash_attention_backward(
            grad_output.contiguous(), query, key, value, output, logsumexp, cu_seqlens, cu_seqlens, max_seqlen,
            max_seqlen, dropout_p, is_causal, rng_state, unused, scale=scale)
        return grad_query, grad_key, grad_value, None, None, None, None, None


def flash_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                 scale=None, host_cum_seq=None) -> torch.Tensor:
    """``aten::_flash_attention_forward``'s positional arguments (query and key offsets the same, no debug mask),
    differentiable; returns the output ``[tokens, heads, dim]``. ``host_cum_seq`` is not used."""
    assert cum_seq_q is cum_seq_k and max_q == max_k and not return_debug_mask
    return FlashVarlen.apply(query, key, value, cum_seq_q, max_q, dropout_p, is_causal, scale)


@torch.compiler.disable  # a loop over host offsets: traced, it would recompile for each document layout
def per_document_sdpa(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                      scale=None, host_cum_seq=None) -> torch.Tensor:
    """:func:`flash_varlen`'s contract in plain torch, for machines without the kernel: each segment of the flattened
    ``[tokens, heads, dim]`` batch through ``F.scaled_dot_product_attention`` with ``enable_gqa=True``, cut at the
    host offsets ``host_cum_seq`` (an int64 CPU tensor, so cutting reads no device memory)."""
    cuts = host_cum_seq[1:-1]
    outputs = [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=True)
               for q, k, v in zip(query.tensor_split(cuts), key.tensor_split(cuts), value.tensor_split(cuts))]
    return torch.cat(outputs, dim=1).transpose(0, 1)


def _missing(keyword: str, name: str) -> ValueError:
    return ValueError(f"attention {name!r} needs the forward keyword {keyword!r} (DocumentAttention.forward_kwargs); "
                      "without it documents would attend to each other. Pass it to every forward of this model.")


def _refuse_extras(name: str, sliding_window, softcap, s_aux) -> None:
    """What the start-up checks refuse for these paths, kept from running silently wrong if a model slips by."""
    if sliding_window is not None or softcap is not None or s_aux is not None:
        raise ValueError(f"attention {name!r} runs no sliding window, logit soft-capping or attention sinks; got "
                         f"sliding_window={sliding_window}, softcap={softcap}, sinks={s_aux is not None}.")


def document_varlen_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                            softcap=None, s_aux=None, varlen_cu_seqlens=None, varlen_host_cu_seqlens=None, **kwargs):
    """The AttentionInterface function of :data:`VARLEN`: ``query`` ``[rows, heads, seq, dim]`` and ``key``/``value``
    ``[rows, kv_heads, seq, dim]`` flattened row-major to tokens, attended per segment, returned as
    ``[rows, seq, heads, dim]`` (transformers' layout after attention). ``attention_mask`` is None (no mask builder)."""
    if varlen_cu_seqlens is None or varlen_host_cu_seqlens is None:
        raise _missing(CU_SEQLENS, VARLEN)
    _refuse_extras(VARLEN, sliding_window, softcap, s_aux)
    rows, heads, seq_len, head_dim = query.shape
    value_dim = value.shape[-1]
    if value_dim != head_dim:  # flash needs equal head dims (e.g. MLA): pad the values, crop the output
        value = F.pad(value, [0, head_dim - value_dim])
    query, key, value = (x.transpose(1, 2).reshape(rows * seq_len, x.shape[1], head_dim) for x in (query, key, value))
    kernel = varlen_kernel(query.device, query.dtype)
    output = kernel(query, key, value, varlen_cu_seqlens, varlen_cu_seqlens, seq_len, seq_len, dropout, True, False,
                    scale=scaling, host_cum_seq=varlen_host_cu_seqlens)
    return output.reshape(rows, seq_len, heads, head_dim)[..., :value_dim], None


def document_block_mask(document_ids: torch.Tensor):
    """The FlexAttention ``BlockMask`` of ``document_ids`` ``[rows, seq]`` (on the device): query i attends key j
    when both are in the same segment and j <= i. Shared by every head and layer of one forward."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(batch, head, q_idx, kv_idx):
        return (document_ids[batch, q_idx] == document_ids[batch, kv_idx]) & (kv_idx <= q_idx)

    rows, seq_len = document_ids.shape
    return create_block_mask(same_document_causal, B=rows, H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                             device=document_ids.device)


_compiled_flex: dict = {}


def _flex_kernel(device: torch.device) -> Callable:
    """FlexAttention compiled once on CUDA (uncompiled, it computes every score); as it is elsewhere (the CPU's
    forward, which tests use)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if "cuda" not in _compiled_flex:
        _compiled_flex["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex["cuda"]


def document_flex_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                          softcap=None, s_aux=None, flex_block_mask=None, **kwargs):
    """The AttentionInterface function of :data:`FLEX`: FlexAttention under ``flex_block_mask``, key/value heads
    not repeated; returns ``[rows, seq, heads, dim]``."""
    if flex_block_mask is None:
        raise _missing(BLOCK_MASK, FLEX)
    _refuse_extras(FLEX, sliding_window, softcap, s_aux)
    if dropout:
        raise ValueError(f"attention {FLEX!r} has no dropout; set the model's attention dropout to 0.")
    output = _flex_kernel(query.device)(query, key, value, block_mask=flex_block_mask, scale=scaling,
                                        enable_gqa=key.shape[1] != query.shape[1])
    return output.transpose(1, 2), None
