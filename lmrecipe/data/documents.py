"""Document boundaries inside training windows, computed on the host from the split's document index.

A window's input tokens are ``tokens[offset : offset + seq_len]`` of the concatenated stream; the document index
(``<split>.idx``: uint64 token offsets of each document's first token, then the split's end) says where documents
start. A start ``k`` means token ``k`` opens a new document: the EOS at ``k - 1`` ends the previous one.

:func:`document_batch` turns a batch of window offsets into a :class:`DocumentBatch`: per token, the position
inside its document (0 at each document start, and 0 at the window start for the partial first document) and a
segment number; for the flattened batch (rows laid end to end, row-major), the cumulative segment lengths and the
longest segment, as flash attention's variable-length kernels take them. A pure function of (index, offsets,
seq_len), vectorised with ``np.searchsorted``; it runs in the data thread so the training step reads nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DocumentBatch:
    """Where the documents of a ``[rows, seq_len]`` batch of windows start (numpy arrays, or tensors after
    :meth:`as_tensors`).

    ``position_ids`` int64 ``[rows, seq_len]``: position inside the token's document, restarting at 0.
    ``document_ids`` int32 ``[rows, seq_len]``: segment number of the token, 0 for the row's first segment and
    increasing by one at each document start, so two tokens share a segment iff they share a row and a document.
    ``cu_seqlens`` int32 ``[n_segments + 1]``: start of each segment in the flattened batch (row-major), then
    ``rows * seq_len``. A segment never crosses a row end. ``max_seqlen``: the longest segment, in tokens.
    """

    position_ids: Any
    document_ids: Any
    cu_seqlens: Any
    max_seqlen: int

    @property
    def n_segments(self) -> int:
        return len(self.cu_seqlens) - 1

    def as_tensors(self, pin_memory: bool = False) -> DocumentBatch:
        """The same batch as CPU tensors; pinned (page-locked) if asked, so a ``non_blocking`` copy is asynchronous."""
        import torch

        def convert(array):
            tensor = torch.as_tensor(array)
            return tensor.pin_memory() if pin_memory else tensor

        return replace(self, position_ids=convert(self.position_ids), document_ids=convert(self.document_ids),
                       cu_seqlens=convert(self.cu_seqlens))


def document_batch(doc_starts: np.ndarray, offsets: np.ndarray, seq_len: int) -> DocumentBatch:
    """The :class:`DocumentBatch` of the windows whose first input tokens are at ``offsets`` (one per row).

    ``doc_starts`` is the document index as stored (a memmap of ``<split>.idx`` is read in place, not copied):
    ascending document starts, the first 0, the last the split's token count. ValueError if a window's inputs do
    not lie inside the split.
    """
    doc_starts = np.asarray(doc_starts)
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or seq_len < 1 or (offsets < 0).any() or (offsets + seq_len > int(doc_starts[-1])).any():
        raise ValueError(f"window offsets must be a 1-D array with 0 <= offset <= {int(doc_starts[-1]) - seq_len} "
                         f"(split of {int(doc_starts[-1])} tokens, seq_len={seq_len}); got {offsets!r}")
    columns = np.arange(seq_len, dtype=np.int64)
    tokens = offsets[:, None] + columns
    # side="right" finds the last start <= token: a document starting at k owns token k. The needles take the
    # index's dtype (uint64) so numpy does not compare through float64.
    documents = np.searchsorted(doc_starts, tokens.astype(doc_starts.dtype, copy=False), side="right") - 1
    is_first = np.ones(tokens.shape, dtype=bool)
    is_first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first_column = np.maximum.accumulate(np.where(is_first, columns, 0), axis=1)
    cu_seqlens = np.append(np.flatnonzero(is_first), is_first.size).astype(np.int32)
    return DocumentBatch(
        position_ids=columns - first_column,
        document_ids=(documents - documents[:, :1]).astype(np.int32),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(np.diff(cu_seqlens).max()),
    )


def stack_documents(batches: list[DocumentBatch]) -> DocumentBatch:
    """The rows of several numpy :class:`DocumentBatch` es as one batch, in order (rows of a mixture come from
    different folders, so from different indices)."""
    if len(batches) == 1:
        return batches[0]
    ends = np.cumsum([b.position_ids.size for b in batches])
    cu_seqlens = np.concatenate([batches[0].cu_seqlens[:1]] + [b.cu_seqlens[1:] + start
                                                               for b, start in zip(batches, np.append(0, ends[:-1]))])
    return DocumentBatch(
        position_ids=np.concatenate([b.position_ids for b in batches]),
        document_ids=np.concatenate([b.document_ids for b in batches]),
        cu_seqlens=cu_seqlens.astype(np.int32),
        max_seqlen=max(b.max_seqlen for b in batches),
    )


def from_positions(position_ids: np.ndarray, document_ids: np.ndarray) -> DocumentBatch:
    """The :class:`DocumentBatch` whose per-token arrays are these (rows assembled from several indices).

    A segment starts exactly where the position inside the document is 0 (each document start, and each row's
    first token), so the flattened segment starts and the longest segment follow from ``position_ids`` alone.
    """
    starts = np.flatnonzero(np.asarray(position_ids).reshape(-1) == 0)
    cu_seqlens = np.append(starts, position_ids.size).astype(np.int32)
    return DocumentBatch(position_ids=position_ids, document_ids=document_ids.astype(np.int32), cu_seqlens=cu_seqlens,
                         max_seqlen=int(np.diff(cu_seqlens).max()))
