"""Tokenizing for preparation: train a byte-level BPE or load a given tokenizer, and encode chunks of documents.

A trained BPE learns from a bounded sample (the first ``tokenizer_sample_mb`` MB of train documents, see
:func:`lmrecipe.data.prepare.read.train_sample`). :class:`ChunkEncoder` turns a list of documents into the bytes
of one id array, each document followed by EOS; the worker processes of the pipeline each build one
(:func:`init_worker`) and encode with :func:`encode_in_worker`. A worker encodes with the ``tokenizers`` library
alone (transformers and torch stay out of it) for a trained BPE, and for a given fast tokenizer (one with a
``tokenizer.json``) once :func:`choose_encoder` has seen it encode a sample exactly as its transformers wrapper does.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TRAINED_TOKENIZER = "bpe-trained"
"""``meta.json`` ``tokenizer`` value when the tokenizer was trained here rather than given."""

#: Byte-level BPE needs its 256 byte tokens and EOS, plus at least one merge to be a BPE at all.
MIN_TRAINED_VOCAB_SIZE = 256 + 1 + 1
#: The largest BPE vocabulary trained here. The trainer's memory grows with the size asked for, not the corpus
#: (a process peak of 330 MB at 2**27 entries on a 12 KB corpus), and 10**9 aborts the process inside the library.
MAX_TRAINED_VOCAB_SIZE = 2**24


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size > MAX_TRAINED_VOCAB_SIZE:
        raise fail(f"--vocab-size {vocab_size} is too large: a trained BPE here holds at most {MAX_TRAINED_VOCAB_SIZE} "
                   "entries (the trainer's memory grows with the size asked for). Pass a smaller --vocab-size (e.g. "
                   "32768 or 65536), or --tokenizer with an existing tokenizer.")
    if vocab_size < MIN_TRAINED_VOCAB_SIZE:
        raise fail(
            f"""
            --vocab-size {vocab_size} is too small to train a byte-level BPE: it needs 256 byte tokens,
            {EOS_TOKEN} and at least one merge, so at least {MIN_TRAINED_VOCAB_SIZE}.
            """
        )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` included); deterministic.

    ``texts`` is consumed once, as it comes: it may be a generator. Returns a
    ``transformers.PreTrainedTokenizerFast`` whose eos/bos/unk/pad token is ``<|endoftext|>``. Byte level with
    no prefix space and no clean-up makes ``decode(encode(text)) == text`` for every text.
    """
    check_vocab_size(vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # The full byte alphabet, not only bytes seen in training, so any text can be encoded later.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=length)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def load_hf_tokenizer(name: str):
    """The Hugging Face tokenizer ``name`` (a Hub name or a folder); UserError if it cannot load or has no EOS."""
    # A Hub id is "name" or "org/name"; anything else is a folder, and a missing one deserves a plain message.
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1
    if looks_like_path and not Path(name).expanduser().exists():
        raise fail(f"--tokenizer {name}: no such folder. Pass an existing tokenizer folder or a Hub tokenizer name.")
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(Path(name).expanduser() if looks_like_path else name)
    except Exception as err:  # transformers raises OSError, ValueError, HTTP errors... all mean "not loadable"
        # Not a dedented template: the library's message may span lines with its own indentation.
        raise fail(
            f"Could not load tokenizer {name!r}: {err}\nPass a local tokenizer folder (this machine may be "
            "offline), or leave out --tokenizer to train a byte-level BPE on the corpus."
        ) from err
    if hf_tokenizer.eos_token_id is None:
        raise fail(
            f"""
            Tokenizer {name!r} has no EOS token, which marks document boundaries in the token stream. Use a
            tokenizer with an eos_token, or leave out --tokenizer to train one.
            """
        )
    return hf_tokenizer


@dataclass(frozen=True)
class EncoderSpec:
    """What a tokenizer worker needs to build its encoder; small and picklable."""

    tokenizer_dir: str
    backend: bool
    """Encode with the ``tokenizers`` library from ``tokenizer.json``; else with transformers' ``__call__``."""
    eos_id: int
    vocab_size: int
    dtype: str


class ChunkEncoder:
    """Encodes a list of documents into the bytes of one id array: each document's ids, then EOS.

    Special-token text inside a document (a literal ``<|endoftext|>``) is encoded as plain text, so EOS in
    the stream only ever marks a document boundary.
    """

    def __init__(self, spec: EncoderSpec):
        self.spec = spec
        if spec.backend:
            # What transformers' fast tokenizers call underneath (`encode_batch` with the same flags; the `_fast`
            # variant only skips the offsets), without importing transformers into every worker.
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_file(str(Path(spec.tokenizer_dir) / "tokenizer.json"))
            self._backend.encode_special_tokens = True
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(spec.tokenizer_dir)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.spec.backend:
            return [encoding.ids for encoding in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        # verbose=False: documents are longer than model_max_length by design, the warning would be noise.
        return self._hf(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]

    def __call__(self, texts: list[str]) -> tuple[bytes, np.ndarray, int]:
        """(the ids' bytes, each document's length in tokens with its EOS, the largest id)."""
        flat: list[int] = []
        lengths = np.empty(len(texts), dtype=np.int64)
        for i, ids in enumerate(self.encode(texts)):
            flat.extend(ids)
            flat.append(self.spec.eos_id)
            lengths[i] = len(ids) + 1
        array = np.asarray(flat, dtype=np.int64)
        top = int(array.max())  # never empty: every document adds its EOS
        # A wrong id would be silently wrapped by the cast below and train on garbage.
        if array.min() < 0 or top >= self.spec.vocab_size:
            raise RuntimeError(
                f"tokenizer produced ids in [{array.min()}, {top}], outside [0, {self.spec.vocab_size})"
            )
        return array.astype(np.dtype(self.spec.dtype).newbyteorder("<")).tobytes(), lengths, top


def choose_encoder(spec: EncoderSpec, texts: list[str]) -> EncoderSpec:
    """For a given tokenizer: the ``tokenizers``-library path (1.7x faster on one core, BENCHMARKS.md section 4) when
    the folder has a ``tokenizer.json`` and it encodes ``texts``, plus every special token written as text, exactly
    as transformers' wrapper does; else transformers. A tokenizer class may override ``__call__`` in Python, which
    the backend would skip: the comparison catches it."""
    slow = replace(spec, backend=False)
    if not (Path(spec.tokenizer_dir) / "tokenizer.json").is_file():
        logger.info("encoding with transformers: the tokenizer has no tokenizer.json")
        return slow
    reference = ChunkEncoder(slow)
    specials = " ".join(reference._hf.all_special_tokens)
    probe = [*texts, f"a {specials} b", specials]
    try:
        same = ChunkEncoder(replace(spec, backend=True)).encode(probe) == reference.encode(probe)
    except Exception as err:  # noqa: BLE001 - a tokenizer.json this tokenizers version cannot read (it raises plain Exception)
        logger.info("encoding with transformers: tokenizer.json does not load in the tokenizers library (%s)", err)
        return slow
    if not same:
        logger.info("encoding with transformers: the tokenizers library encodes a sample of %d documents differently "
                    "(the tokenizer class changes the encoding in Python)", len(texts))
        return slow
    logger.info("encoding with the tokenizers library (tokenizer.json): same ids as transformers on a sample of %d "
                "documents", len(texts))
    return replace(spec, backend=True)


# Set once in each tokenizer worker process by `init_worker`: a Pool initializer is how every worker gets
# its own tokenizer without pickling one into each task.
_worker_encoder: ChunkEncoder | None = None


def init_worker(spec: EncoderSpec) -> None:
    """Pool initializer: build this worker process's encoder."""
    global _worker_encoder
    # Ctrl-C reaches the whole process group: the parent stops the pool and removes its folder; a worker's own
    # KeyboardInterrupt would only print a traceback per process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Each worker is one of num_proc processes: threads inside it would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = ChunkEncoder(spec)


def encode_in_worker(texts: list[str]) -> tuple[bytes, np.ndarray, int]:
    """A Pool task: encode one chunk with the encoder :func:`init_worker` built."""
    return _worker_encoder(texts)
