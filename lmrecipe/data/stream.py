"""One split of a shard set read as one token stream: the shards' token files laid end to end, in manifest order.

Nothing is copied or concatenated on disk: each piece stays a memory map of its shard's ``<split>.bin`` (and
``<split>.idx``). Windows are cut from the stream as from one file (window ``i`` is tokens
``[i*seq_len, i*seq_len + seq_len + 1)`` of the whole), so a window may cross from one shard into the next; the
document boundaries of a span come from the pieces' indices, shifted by each piece's start. A window inside one
piece is read through a strided view of that piece (one index per batch, as for one folder); a window that crosses
pieces (at most one per piece boundary) is assembled from slices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmrecipe.data.documents import DocumentBatch, document_batch, from_positions


class TokenStream:
    """Token files laid end to end: ``paths`` (each piece's ``<split>.bin``, its index the ``.idx`` beside it) of
    ``lengths`` tokens of ``dtype``. Empty pieces are skipped; a piece's files are mapped when first read, so opening
    a stream of many shards costs no system call per shard."""

    def __init__(self, paths: list[Path], lengths: list[int], dtype, seq_len: int):
        kept = [k for k, n in enumerate(lengths) if n]
        self.paths = [Path(paths[k]) for k in kept]
        self.kept = kept
        """Position of each kept piece in the list given (empty pieces are left out)."""
        self.dtype = np.dtype(dtype)
        self.seq_len = seq_len
        self.starts = np.concatenate([[0], np.cumsum([int(lengths[k]) for k in kept])]).astype(np.int64)
        """Stream offset of each piece's first token, then the stream's length."""
        # Windows wholly inside piece k start at stream offsets that are multiples of seq_len: in piece k at
        # first[k] + j*seq_len. One strided view of rows per piece (:meth:`_piece_rows`), as TokenWindows keeps for
        # one file.
        self._first = (-self.starts[:-1]) % seq_len
        self._tokens: dict[int, np.ndarray] = {}
        self._rows: dict[int, np.ndarray] = {}
        self._indices: dict[int, np.ndarray] = {}

    def piece(self, k: int) -> np.ndarray:
        """Tokens of kept piece ``k``, memory-mapped read-only."""
        if k not in self._tokens:
            self._tokens[k] = np.memmap(self.paths[k], dtype=self.dtype, mode="r").view(np.ndarray)
        return self._tokens[k]

    def _piece_rows(self, k: int) -> np.ndarray:
        if k not in self._rows:
            L, piece, first = self.seq_len, self.piece(k), int(self._first[k])
            n_rows = max(0, (len(piece) - first - L - 1) // L + 1)
            self._rows[k] = np.lib.stride_tricks.as_strided(piece[first:], shape=(n_rows, L + 1),
                                                            strides=(L * piece.itemsize, piece.itemsize),
                                                            writeable=False)
        return self._rows[k]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, span: slice) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (a copy, in the pieces' dtype); only unit-step slices."""
        start, stop, step = span.indices(len(self))
        if step != 1:
            raise ValueError("a token stream is read in contiguous spans")
        parts = []
        for k in self._pieces_of(start, max(stop, start)):
            lo, hi = max(start, self.starts[k]), min(stop, self.starts[k + 1])
            parts.append(self.piece(k)[lo - self.starts[k]:hi - self.starts[k]])
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def piece_of(self, offset: int) -> int:
        """The kept piece that holds stream token ``offset``."""
        return int(np.searchsorted(self.starts, offset, side="right")) - 1

    def _pieces_of(self, start: int, stop: int) -> range:
        """Kept pieces that hold a token of ``[start, stop)``."""
        if stop <= start:
            return range(0)
        return range(self.piece_of(start), self.piece_of(stop - 1) + 1)

    def rows(self, window_ids: np.ndarray) -> np.ndarray:
        """Windows of ``seq_len + 1`` tokens, ``[len(window_ids), seq_len + 1]`` int64: one gather per piece."""
        L = self.seq_len
        ids = np.asarray(window_ids, dtype=np.int64).reshape(-1)
        begins = ids * L
        pieces = np.searchsorted(self.starts, begins, side="right") - 1
        inside = begins + L + 1 <= self.starts[pieces + 1]
        rows = np.empty((len(ids), L + 1), dtype=np.int64)
        for k in np.unique(pieces[inside]):
            chosen = inside & (pieces == k)
            rows[chosen] = self._piece_rows(k)[(begins[chosen] - self.starts[k] - self._first[k]) // L]
        for j in np.flatnonzero(~inside):
            rows[j] = self[int(begins[j]):int(begins[j]) + L + 1]
        return rows

    def index(self, k: int) -> np.ndarray:
        """Document index of kept piece ``k`` (memory-mapped)."""
        if k not in self._indices:
            self._indices[k] = np.memmap(self.paths[k].with_suffix(".idx"), dtype=np.dtype("<u8"), mode="r")
        return self._indices[k]

    def documents(self, offsets: np.ndarray, n_tokens: int) -> DocumentBatch:
        """Document boundaries of the spans ``[offset, offset + n_tokens)`` of the stream, one row per offset.

        The same batch :func:`~lmrecipe.data.documents.document_batch` gives for one file holding the whole stream:
        every piece starts with a document (a shard's first token opens its first document).
        """
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if (offsets < 0).any() or (offsets + n_tokens > len(self)).any():
            raise ValueError(f"spans of {n_tokens} tokens at {offsets!r} do not lie inside the stream of {len(self)} "
                             "tokens")
        position_ids = np.empty((len(offsets), n_tokens), dtype=np.int64)
        document_ids = np.empty((len(offsets), n_tokens), dtype=np.int32)
        pieces = np.searchsorted(self.starts, offsets, side="right") - 1
        inside = offsets + n_tokens <= self.starts[pieces + 1]
        for k in np.unique(pieces[inside]):
            chosen = inside & (pieces == k)
            batch = document_batch(self.index(k), offsets[chosen] - self.starts[k], n_tokens)
            position_ids[chosen], document_ids[chosen] = batch.position_ids, batch.document_ids
        for j in np.flatnonzero(~inside):
            batch = self._crossing(int(offsets[j]), n_tokens)
            position_ids[j], document_ids[j] = batch.position_ids[0], batch.document_ids[0]
        return from_positions(position_ids, document_ids)

    def _crossing(self, offset: int, n_tokens: int) -> DocumentBatch:
        """One span over several pieces: its document starts gathered from each piece into a small index."""
        stop = offset + n_tokens
        found = []
        for k in self._pieces_of(offset, stop):
            index, base = self.index(k), int(self.starts[k])
            first = int(np.searchsorted(index, np.uint64(max(offset - base, 0)), side="right")) - 1
            last = int(np.searchsorted(index, np.uint64(stop - base), side="left"))
            found.append(index[max(first, 0):last].astype(np.int64) + base)
        starts = np.unique(np.concatenate(found))
        local = np.append(starts[starts < stop], stop) - starts[0]
        return document_batch(local.astype(np.uint64), np.asarray([offset - starts[0]]), n_tokens)
