"""Linear-attention layers under document masking: each document of a packed window runs on its own.

A gated DeltaNet layer (Qwen3.5, Qwen3-Next: ``layer_types`` entry ``linear_attention``) carries a recurrent state
and a short causal convolution (kernel 4) along the whole sequence, so the position ids and attention masks that
keep the full-attention layers to their documents do not reach it, and transformers' torch code refuses the
variable-length boundaries (``cu_seq_lens_q``) outright. Under ``data.document_masking`` the recipe therefore runs
every such layer per document: :func:`install_per_document` gives each layer module, once at build time, a subclass
of its own class whose forward cuts the batch at the document boundaries, runs the class's own forward on the
documents (a fresh state and fresh convolution padding each) and lays the outputs back in place. Names, parameters,
hooks and the state dict stay the module's; the library's class itself is not changed.

The cut comes from the host: :func:`document_segments` turns the batch's ``cu_seqlens`` (known on the host before
the forward) into gather indices, once per forward, shared by every layer, so no layer reads the device. Documents of
similar length run together, right-padded to the longest of their group: the layer is causal and works per token
outside its time mixing, so padding after a document's last token cannot change its outputs, which are all that is
kept. Groups are lengths up to :data:`MIN_GROUP_LEN` and then each power of two: at most twice the tokens, in about
log2(seq_len / 64) + 1 forwards per layer.

:func:`check_linear_attention` is the start-up check: a layer pattern with recurrent layers this module cannot run
per document is refused with ``data.document_masking`` named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lmrecipe.errors import fail

KEYWORD = "linear_attention_documents"
"""The forward keyword that carries :class:`DocumentSegments` down to the linear-attention layers."""

SPLITTABLE = {"qwen3_5_moe_text": "linear_attn", "qwen3_5_text": "linear_attn", "qwen3_next": "linear_attn"}
"""The architectures whose linear-attention layers run per document: model type -> the decoder layer's attribute
holding the gated DeltaNet module. Their forwards share one contract: ``(hidden_states, cache_params=None,
attention_mask=None, **kwargs) -> [batch, seq, hidden]``, causal along the sequence, per token elsewhere; their
full-attention layers go through transformers' AttentionInterface like any other model's."""

RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")
"""``layer_types`` entries of layers that carry something along the sequence besides attention (mamba, gated DeltaNet,
lightning attention, short convolutions), which the document masks of attention do not reach."""

MIN_GROUP_LEN = 64
"""Documents up to this many tokens run as one group: the torch gated delta rule pads to chunks of 64 tokens anyway."""

_DOCUMENT_KEYWORDS = frozenset({KEYWORD, "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                                "document_mask"})
"""Keywords of the document-masking paths (``attention.py``) a linear-attention layer must not see: the torch
kernels refuse ``cu_seq_lens_q``, and each document runs as its own sequence."""


def layer_kinds(hf_config) -> list[str]:
    """Each layer's kind (``layer_types``, or the older ``layers_block_type``); empty when the config has neither."""
    return list(getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type", None) or [])


def recurrent_layers(hf_config) -> list[int]:
    """Indices of the layers of ``hf_config`` that carry a state along the sequence (``RECURRENT_LAYER_TYPES``)."""
    return [i for i, kind in enumerate(layer_kinds(hf_config)) if kind in RECURRENT_LAYER_TYPES]


def check_linear_attention(hf_config) -> bool:
    """Whether the model of ``hf_config`` has linear-attention layers that must run per document (True), or none
    (False). UserError naming ``data.document_masking`` and the fix for recurrent layers this module cannot split."""
    layers = recurrent_layers(hf_config)
    if not layers:
        return False
    model_type = getattr(hf_config, "model_type", None)
    kinds = sorted({layer_kinds(hf_config)[i] for i in layers})
    if model_type in SPLITTABLE and kinds == ["linear_attention"]:
        return True
    raise fail(f"""
        data.document_masking=true: model.arch={model_type} has {len(layers)} layers of kind {', '.join(kinds)}
        (layers {', '.join(map(str, layers))}) that carry a state along the whole packed window, where the document
        masks of attention do not reach: every document would see the ones before it in its window. The recipe runs
        such layers per document only for the gated DeltaNet layers of model.arch {', '.join(sorted(SPLITTABLE))}.
        Set data.document_masking=false (documents then see their window's earlier documents in every layer), or
        choose one of those architectures or one whose layers are all attention.""")


@dataclass(frozen=True)
class DocumentSegments:
    """Where each document of a ``[rows, seq_len]`` batch goes in the per-document forwards, as device tensors.

    ``groups``: per group of documents, ``[documents, length]`` indices into the flattened batch (row-major), each
    document's tokens then its last token repeated up to the group's length. ``inverse``: ``[rows * seq_len]``, the
    place of each token of the batch in the groups' outputs laid end to end. ``groups`` empty: every row is one
    document, and the layer runs on the batch as it is.
    """

    groups: tuple[torch.Tensor, ...]
    inverse: torch.Tensor | None


def segment_plan(cu_seqlens, min_group_len: int = MIN_GROUP_LEN) -> tuple[list[np.ndarray], np.ndarray]:
    """The host arrays of :class:`DocumentSegments` for the flattened segment starts ``cu_seqlens`` (a numpy array or
    CPU tensor: the segment starts, then the token count): (groups, inverse)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    starts, lengths = cu[:-1], np.diff(cu)
    keys = np.ceil(np.log2(np.maximum(lengths, min_group_len) / min_group_len)).astype(np.int64)
    groups, inverse, placed = [], np.empty(int(cu[-1]), dtype=np.int64), 0
    for key in np.unique(keys):
        members = np.flatnonzero(keys == key)
        width = int(lengths[members].max())
        steps = np.arange(width)
        group = starts[members, None] + np.minimum(steps, lengths[members, None] - 1)
        real = steps < lengths[members, None]
        inverse[group[real]] = (placed + np.arange(group.size).reshape(group.shape))[real]
        groups.append(group)
        placed += group.size
    return groups, inverse


def document_segments(batch, device: torch.device | str) -> DocumentSegments:
    """The :class:`DocumentSegments` of the batch ``batch`` (a DocumentBatch), computed on the host from its
    ``cu_seqlens`` and copied to ``device`` without waiting (pinned memory on a GPU)."""
    rows, seq_len = batch.position_ids.shape
    cu = np.asarray(batch.cu_seqlens, dtype=np.int64)
    if len(cu) == rows + 1:  # one document per row: the rows are the documents
        return DocumentSegments((), None)
    groups, inverse = segment_plan(cu, MIN_GROUP_LEN)
    pin = torch.device(device).type == "cuda"

    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return (tensor.pin_memory() if pin else tensor).to(device, non_blocking=True)

    return DocumentSegments(tuple(to_device(g) for g in groups), to_device(inverse))


class PerDocumentLinearAttention(nn.Module):
    """Mixed in before a linear-attention class (:func:`install_per_document`): its forward runs the class's own
    forward once per group of documents (:class:`DocumentSegments`, keyword :data:`KEYWORD`)."""

    @torch.compiler.disable  # the groups' shapes change with every batch: a compiled layer would recompile each step
    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
        segments = kwargs.pop(KEYWORD, None)
        if segments is None:
            raise ValueError(f"{type(self).__name__} runs per document and needs the forward keyword {KEYWORD!r} "
                             "(DocumentAttention.forward_kwargs); without it documents would leak into each other "
                             "through its recurrent state. Pass it to every forward of this model.")
        if cache_params is not None:
            raise ValueError(f"{type(self).__name__} runs per document, for training: it keeps no cache.")
        kwargs = {k: v for k, v in kwargs.items() if k not in _DOCUMENT_KEYWORDS}
        run = super().forward
        if not segments.groups:
            return run(hidden_states, **kwargs)
        rows, seq_len, width = hidden_states.shape
        flat = hidden_states.reshape(rows * seq_len, width)
        outputs = [run(flat.index_select(0, group.reshape(-1)).view(*group.shape, width), **kwargs)
                   for group in segments.groups]
        laid = torch.cat([out.reshape(-1, out.shape[-1]) for out in outputs])
        return laid.index_select(0, segments.inverse).view(rows, seq_len, -1)


_CLASSES: dict[type, type] = {}


def _per_document_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"PerDocument{cls.__name__}", (PerDocumentLinearAttention, cls),
                             {"__module__": __name__, "__doc__": f"{cls.__name__}, run per document."})
    return _CLASSES[cls]


def install_per_document(model: nn.Module) -> int:
    """Make every linear-attention layer of ``model`` (an architecture of :data:`SPLITTABLE`) run per document:
    its module's class becomes :class:`PerDocumentLinearAttention` mixed into its own. Returns how many layers.
    UserError if a layer the config calls linear attention holds no such module (a model from ``model.init_from``
    whose classes differ)."""
    config = model.config
    attribute = SPLITTABLE[config.model_type]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = recurrent_layers(config)
    for i in layers:
        module = getattr(decoder.layers[i], attribute, None)
        if not isinstance(module, nn.Module):
            raise fail(f"data.document_masking=true: layer {i} of {type(model).__name__} is a linear-attention layer "
                       f"in its config but holds no {attribute!r} module to run per document. Set "
                       "data.document_masking=false, or use a model built by transformers' own classes.")
        if not isinstance(module, PerDocumentLinearAttention):
            module.__class__ = _per_document_class(type(module))
    return len(layers)


def remove_per_document(model: nn.Module) -> None:
    """Undo :func:`install_per_document`: every per-document layer of ``model`` gets its own class back (e.g. to
    generate with a cache after a masked evaluation)."""
    for module in model.modules():
        if isinstance(module, PerDocumentLinearAttention):
            module.__class__ = module.__class__.__bases__[1]
