"""Writing a prepared data folder: the split files, ``meta.json`` last, and the output folder's checks.

A folder (``format_version`` 2, :data:`lmrecipe.data.format.FORMAT_VERSION`, read by ``lmrecipe/data/format.py``)
holds:

- ``train.bin`` / ``val.bin``: flat little-endian token ids (``uint16`` when the vocabulary has at most 65536
  entries, else ``uint32``); every document is followed by one EOS token.
- ``train.idx`` / ``val.idx``: the document index, little-endian ``uint64`` token offsets into the split's
  ``.bin``: ``n_documents + 1`` entries, ``idx[0] == 0``, document ``i`` (its EOS included) is tokens
  ``[idx[i], idx[i + 1])`` and ``idx[-1] == n_tokens``. Documents are in reading order.
- ``meta.json``: tokenizer, ``vocab_size``, ``eos_id``, ``dtype``, ``source``, ``val_fraction``, ``seed`` and per
  split ``n_tokens``, ``n_documents``, ``max_token_id`` (the largest id in the split, so start-up checks need not
  read the tokens) and the ``sha256`` of the .bin file. ``inputs`` lists each ``--input`` (or the Hub dataset, or
  the embedded corpus) with, per split, its contiguous range of documents ``[first, stop)`` and its token count,
  so that tokens can be attributed to their input without re-tokenizing. ``skipped`` counts empty documents and
  files that are not UTF-8 text; ``tokenizer_sample`` says what a trained BPE was trained on. Everything except
  the ``timing`` key is a pure function of the inputs and arguments, so two runs can be compared. A shard of a
  shard set also records ``shard`` (its files and arguments) and ``tokenizer_sha256`` (see ``shards.py``).
- the tokenizer files (``save_pretrained``), loadable with ``AutoTokenizer.from_pretrained(folder)``.

The folder is built next to its destination (``<output>.tmp-<pid>``) and renamed into place only when complete,
with ``meta.json`` written last: a reader never sees a half-written folder. A killed process (SIGKILL, power loss)
can leave its ``.tmp-<pid>`` folder behind; it has no ``meta.json``, so training refuses it, and it can be deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from lmrecipe.data.format import INDEX_DTYPE
from lmrecipe.errors import fail

logger = logging.getLogger(__name__)


class SplitWriter:
    """Appends encoded chunks of one split to ``<split>.bin`` and their document ends to ``<split>.idx``.

    Also attributes documents and tokens to inputs: the documents of one input are consecutive in reading
    order, so each input holds one range of the split's documents.
    """

    def __init__(self, folder: Path, split: str, dtype: str, n_inputs: int):
        self.itemsize = np.dtype(dtype).itemsize
        self.bin = open(folder / f"{split}.bin", "wb")
        self.idx = open(folder / f"{split}.idx", "wb")
        self.idx.write(np.zeros(1, dtype=INDEX_DTYPE).tobytes())
        self.digest = hashlib.sha256()
        self.n_tokens = 0
        self.n_documents = 0
        self.max_token_id: int | None = None
        self.inputs = [{"documents": [0, 0], "n_tokens": 0} for _ in range(n_inputs)]

    def append(self, data: bytes, lengths: np.ndarray, top: int, input_indices: list[int]) -> None:
        """One encoded chunk: its bytes, each document's length in tokens, its largest id, each document's input."""
        self.bin.write(data)
        self.digest.update(data)
        self.idx.write((self.n_tokens + np.cumsum(lengths)).astype(INDEX_DTYPE).tobytes())
        inputs = np.asarray(input_indices)
        for index in np.unique(inputs):
            positions = np.flatnonzero(inputs == index)
            entry = self.inputs[index]
            if entry["documents"][1] == 0:
                entry["documents"][0] = self.n_documents + int(positions[0])
            entry["documents"][1] = self.n_documents + int(positions[-1]) + 1
            entry["n_tokens"] += int(lengths[positions].sum())
        self.n_tokens += len(data) // self.itemsize
        self.n_documents += len(lengths)
        self.max_token_id = top if self.max_token_id is None else max(self.max_token_id, top)

    def close(self) -> None:
        self.bin.close()
        self.idx.close()

    def stats(self) -> dict[str, Any]:
        """The split's entry of ``meta.json`` ``splits``."""
        return {"n_tokens": self.n_tokens, "n_documents": self.n_documents, "max_token_id": self.max_token_id,
                "sha256": self.digest.hexdigest()}


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Write ``meta.json``: call it last, since a folder without meta.json is not a data folder, whatever it holds."""
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def check_output_free(out_dir: Path, overwrite: bool) -> None:
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise fail(f"{out_dir} already exists. Pass --overwrite to replace it, or choose another --output folder.")


def warn_stale_temp_dirs(out_dir: Path) -> None:
    """Name the ``<output>.tmp-*`` folders that interrupted preparations left next to ``out_dir``."""
    # Not deleted here: another preparation into the same output may be running right now.
    stale = sorted(out_dir.parent.glob(f"{out_dir.name}.tmp-*")) if out_dir.parent.is_dir() else []
    if stale:
        logger.warning(
            "%s: left by an interrupted preparation (no meta.json, so training refuses them); delete them "
            "unless another preparation into %s is running", ", ".join(map(str, stale)), out_dir,
        )
