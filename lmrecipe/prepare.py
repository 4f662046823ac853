"""Turn a text corpus into the token files that training reads.

An output folder (``format_version`` 1) holds:

- ``train.bin`` / ``val.bin``: flat little-endian token ids (``uint16`` when the vocabulary has at most 65536
  entries, else ``uint32``); every document is followed by one EOS token.
- ``meta.json``: tokenizer, ``vocab_size``, ``eos_id``, ``dtype``, ``source`` and per split ``n_tokens``,
  ``n_documents`` and the ``sha256`` of the .bin file. Everything except the ``timing`` key is a pure function
  of the inputs and arguments, so two runs can be compared.
- the tokenizer files (``save_pretrained``), loadable with ``AutoTokenizer.from_pretrained(folder)``.

The train/val split is per document, by the sha256 of each document's key, so it does not depend on the
order in which documents are read or on how many processes tokenize them. The folder is built next to its
destination and renamed into place only when complete: a reader never sees a half-written folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .data import FORMAT_VERSION, SPLITS
from .errors import fail
from .fileio import building_dir

# transformers, tokenizers and datasets are imported inside the functions that need them: importing them costs
# seconds, which argument errors should not pay, nor tokenizer worker processes that only need `tokenizers`.

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TRAINED_TOKENIZER = "bpe-trained"
"""``meta.json`` ``tokenizer`` value when the tokenizer was trained here rather than given."""

#: Suffixes read as one plain-text document per file.
TEXT_SUFFIXES = frozenset(
    {".txt", ".text", ".md", ".rst", ".tex", ".html", ".htm", ".xml", ".csv", ".tsv", ".py", ".pyi",
     ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".toml", ".yaml",
     ".yml", ".ini", ".cfg"}
)
#: Suffixes read as records through the `datasets` loader named by the value.
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

_EMBEDDED_SUFFIXES = frozenset({".py", ".txt"})
_EMBEDDED_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

#: Byte-level BPE needs its 256 byte tokens and EOS, plus at least one merge to be a BPE at all.
MIN_TRAINED_VOCAB_SIZE = 256 + 1 + 1


# Documents are sent to tokenizer workers in chunks this large: big enough that pickling and IPC stay cheap
# next to tokenizing, small enough that the progress bar moves and both cores stay busy on a small corpus.
_CHUNK_CHARS = 256 * 1024
_CHUNK_DOCS = 1024


@dataclass
class Corpus:
    """Documents in reading order. ``keys[i]`` names ``texts[i]`` (relative path, or ``path:record``)."""

    keys: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    source: str = ""

    def add(self, key: str, text: str | None) -> None:
        # Whitespace-only documents are skipped too: they would train the model on bare EOS tokens.
        if text and not text.isspace():
            self.keys.append(key)
            self.texts.append(text)

    def __len__(self) -> int:
        return len(self.texts)


def embedded_corpus_files() -> list[Path]:
    """The default corpus: ``*.py`` and ``*.txt`` of the running Python's standard library.

    Third-party packages (``site-packages``, ``dist-packages``) and the test suites (``test``, ``tests``,
    ``idlelib``) are left out. Sorted by path relative to the standard library folder.
    """
    root = _stdlib_root()
    files = []
    # os.walk with pruning, not rglob: site-packages can hold gigabytes that would be walked only to be dropped.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in _EMBEDDED_EXCLUDED_DIRS]
        files.extend(
            Path(dirpath, name) for name in filenames
            if Path(name).suffix in _EMBEDDED_SUFFIXES and os.path.isfile(os.path.join(dirpath, name))
        )
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_corpus(
    inputs: Sequence[str | os.PathLike] = (),
    hub_dataset: str | None = None,
    text_field: str = "text",
    max_documents: int | None = None,
) -> Corpus:
    """Read the documents named by ``inputs`` (files or folders), or ``hub_dataset``, or the embedded default.

    Plain-text files are one document each; ``.jsonl``/``.json``/``.parquet`` files hold one document per
    record, in ``text_field``. Folders are walked recursively in sorted order, skipping hidden entries and
    files of other types. Empty documents are skipped; at most ``max_documents`` are kept.
    """
    if inputs and hub_dataset:
        raise fail("Pass either --input or --hub-dataset, not both.")
    limit = max_documents if max_documents is not None else sys.maxsize
    if hub_dataset:
        corpus = Corpus(source=f"hub:{hub_dataset}")
        _add_records(corpus, _load_hub_dataset(hub_dataset), text_field, hub_dataset, hub_dataset, limit)
    elif inputs:
        corpus = Corpus(source=", ".join(str(path) for path in inputs))
        for key, path in _input_files(inputs):
            if len(corpus) >= limit:
                break
            kind = RECORD_SUFFIXES.get(path.suffix.lower())
            if kind is None:
                corpus.add(key, _read_text(path))
            else:
                _add_records(corpus, _load_record_file(kind, path), text_field, key, str(path), limit)
    else:
        root = _stdlib_root()
        corpus = Corpus(source=f"python-stdlib-{sys.version_info.major}.{sys.version_info.minor}")
        for path in embedded_corpus_files():
            if len(corpus) >= limit:
                break
            corpus.add(path.relative_to(root).as_posix(), _read_text(path))
    if max_documents is not None and len(corpus) >= max_documents:
        corpus.source += f" (first {max_documents} documents)"
    if not corpus.texts:
        raise fail(
            f"""
            No documents found in {corpus.source}: every file or record was empty. Check --input (and
            --text-field for jsonl/parquet), or leave both out to use the embedded default corpus.
            """
        )
    return corpus


def split_documents(keys: Sequence[str], val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split documents into (train, val) index lists, each in the original order.

    Documents are ranked by sha256 of ``"<seed>:<key>"`` and the first ``max(1, round(val_fraction * n))``
    go to val; train always keeps at least one. The ranking depends only on the keys and the seed, so a
    document stays in its split when others are added or the input order changes.
    """
    _check_val_fraction(val_fraction)
    n_documents = len(keys)
    if n_documents < 2:
        raise fail(
            f"""
            Found {n_documents} document(s); need at least 2, one for train and one for val. Each plain-text
            file is one document: split a single large file into several, or use jsonl with one record per
            document.
            """
        )
    n_val = min(max(1, round(val_fraction * n_documents)), n_documents - 1)
    # Ties (the same key twice, e.g. two inputs with the same file name) keep their reading order.
    ranked = sorted(range(n_documents), key=lambda i: (hashlib.sha256(f"{seed}:{keys[i]}".encode()).digest(), i))
    val = sorted(ranked[:n_val])
    train = sorted(ranked[n_val:])
    return train, val


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` included); deterministic.

    Returns a ``transformers.PreTrainedTokenizerFast`` whose eos/bos/unk/pad token is ``<|endoftext|>``. Byte
    level with no prefix space and no clean-up makes ``decode(encode(text)) == text`` for every text.
    """
    _check_vocab_size(vocab_size)
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


def prepare(
    *,
    output: str | os.PathLike,
    inputs: Sequence[str | os.PathLike] = (),
    hub_dataset: str | None = None,
    text_field: str = "text",
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    val_fraction: float = 0.02,
    num_proc: int | None = None,
    max_documents: int | None = None,
    overwrite: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Read a corpus, build or load a tokenizer, and write a prepared data folder at ``output``.

    Args:
        output: folder to create; it must not exist unless ``overwrite``.
        inputs: files or folders (see :func:`load_corpus`); empty with no ``hub_dataset`` means the embedded
            Python standard library corpus.
        hub_dataset: Hugging Face Hub dataset name, loaded with ``datasets.load_dataset(name, split="train")``.
        text_field: record field (jsonl/json/parquet/hub) that holds the document text.
        tokenizer: Hugging Face tokenizer name or folder; None trains a byte-level BPE on the train split.
        vocab_size: entries of the trained BPE, special token included (ignored with ``tokenizer``).
        val_fraction: share of documents held out for validation, in (0, 0.5].
        num_proc: tokenizer processes; None means every CPU core. 1 tokenizes in this process, where the
            ``tokenizers`` library may still spread a batch over its own threads.
        max_documents: keep only the first N non-empty documents.
        overwrite: replace an existing ``output`` (only once the new folder is complete).
        seed: salt of the train/val split hash.

    Returns:
        The dict written to ``meta.json``.
    """
    started = time.perf_counter()
    out_dir = Path(output)
    _check_val_fraction(val_fraction)
    if tokenizer is None:
        _check_vocab_size(vocab_size)
    num_proc = (os.cpu_count() or 1) if num_proc is None else num_proc
    if num_proc < 1:
        raise fail(f"--num-proc must be at least 1, got {num_proc}.")
    if max_documents is not None and max_documents < 1:
        raise fail(f"--max-documents must be at least 1, got {max_documents}.")
    _check_output_free(out_dir, overwrite)
    # A given tokenizer is loaded before the corpus is read, so a wrong name fails in seconds.
    given_tokenizer = _load_hf_tokenizer(tokenizer) if tokenizer is not None else None

    corpus = load_corpus(inputs, hub_dataset, text_field, max_documents)
    n_bytes = sum(len(text.encode("utf-8")) for text in corpus.texts)
    logger.info("corpus %s: %d documents, %.1f MB", corpus.source, len(corpus), n_bytes / 1e6)
    train_idx, val_idx = split_documents(corpus.keys, val_fraction, seed)
    split_texts = {"train": [corpus.texts[i] for i in train_idx], "val": [corpus.texts[i] for i in val_idx]}
    logger.info(
        "split (val_fraction=%g, seed=%d): train %d documents, val %d documents",
        val_fraction, seed, len(train_idx), len(val_idx),
    )

    with building_dir(out_dir, overwrite) as tmp_dir:
        meta = _build(tmp_dir, corpus.source, split_texts, tokenizer, given_tokenizer, vocab_size, num_proc, val_fraction, seed)
        _check_output_free(out_dir, overwrite)  # again: it may have appeared while we worked
    logger.info("wrote %s in %.1fs", out_dir, time.perf_counter() - started)
    return meta


def _build(
    tmp_dir: Path,
    source: str,
    split_texts: dict[str, list[str]],
    tokenizer: str | None,
    given_tokenizer,
    vocab_size: int,
    num_proc: int,
    val_fraction: float,
    seed: int,
) -> dict[str, Any]:
    """Write tokenizer, .bin files and meta.json into ``tmp_dir``; return the meta dict.

    ``given_tokenizer`` is the loaded ``tokenizer`` (a name), or None to train a BPE on the train split.
    """
    started = time.perf_counter()
    if given_tokenizer is None:
        logger.info("training byte-level BPE, vocab_size %d, on %d train documents", vocab_size,
                    len(split_texts["train"]))
        hf_tokenizer = train_bpe_tokenizer(split_texts["train"], vocab_size, length=len(split_texts["train"]))
        if len(hf_tokenizer) < vocab_size:
            logger.warning("the corpus only supports %d BPE tokens (asked for %d)", len(hf_tokenizer), vocab_size)
    else:
        hf_tokenizer = given_tokenizer
    eos_id = hf_tokenizer.eos_token_id
    vocab_size = len(hf_tokenizer)
    hf_tokenizer.save_pretrained(tmp_dir)
    tokenizer_seconds = time.perf_counter() - started
    logger.info("tokenizer %s: %d tokens, eos_id %d (%.1fs)", tokenizer or TRAINED_TOKENIZER, vocab_size, eos_id,
                tokenizer_seconds)

    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    started = time.perf_counter()
    splits = _tokenize_to_files(
        tmp_dir, split_texts, _EncoderSpec(str(tmp_dir), given_tokenizer is None, eos_id, vocab_size, dtype), num_proc
    )
    tokenize_seconds = time.perf_counter() - started
    n_tokens = sum(split["n_tokens"] for split in splits.values())
    logger.info(
        "tokenized: train %d tokens, val %d tokens; %d tokens in %.1fs (%.0f tokens/s, %d processes)",
        splits["train"]["n_tokens"], splits["val"]["n_tokens"], n_tokens, tokenize_seconds,
        n_tokens / tokenize_seconds, num_proc,
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer or TRAINED_TOKENIZER,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": dtype,
        "source": source,
        "val_fraction": val_fraction,
        "seed": seed,
        "splits": splits,
        # Everything that differs between two identical runs lives here, so the rest can be compared.
        "timing": {
            "num_proc": num_proc,
            "tokenizer_seconds": round(tokenizer_seconds, 3),
            "tokenize_seconds": round(tokenize_seconds, 3),
            "tokens_per_sec": round(n_tokens / tokenize_seconds, 1),
        },
    }
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


@dataclass(frozen=True)
class _EncoderSpec:
    """What a tokenizer worker needs to build its encoder; small and picklable."""

    tokenizer_dir: str
    trained: bool
    eos_id: int
    vocab_size: int
    dtype: str


class _ChunkEncoder:
    """Encodes a list of documents into the bytes of one id array: each document's ids, then EOS.

    Special-token text inside a document (a literal ``<|endoftext|>``) is encoded as plain text, so EOS in
    the stream only ever marks a document boundary.
    """

    def __init__(self, spec: _EncoderSpec):
        self.spec = spec
        if spec.trained:
            # The trained tokenizer has no normalizer or post-processor, so its `tokenizers` backend encodes
            # exactly like the transformers wrapper, without importing transformers into every worker.
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_file(str(Path(spec.tokenizer_dir) / "tokenizer.json"))
            self._backend.encode_special_tokens = True
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(spec.tokenizer_dir)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.spec.trained:
            return [encoding.ids for encoding in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        # verbose=False: documents are longer than model_max_length by design, the warning would be noise.
        return self._hf(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]

    def __call__(self, texts: list[str]) -> bytes:
        flat: list[int] = []
        for ids in self.encode(texts):
            flat.extend(ids)
            flat.append(self.spec.eos_id)
        array = np.asarray(flat, dtype=np.int64)
        # A wrong id would be silently wrapped by the cast below and train on garbage.
        if array.size and (array.min() < 0 or array.max() >= self.spec.vocab_size):
            raise RuntimeError(
                f"tokenizer produced ids in [{array.min()}, {array.max()}], outside [0, {self.spec.vocab_size})"
            )
        return array.astype(np.dtype(self.spec.dtype).newbyteorder("<")).tobytes()


# Set once in each tokenizer worker process by `_init_worker`: a Pool initializer is how every worker gets
# its own tokenizer without pickling one into each task.
_worker_encoder: _ChunkEncoder | None = None


def _init_worker(spec: _EncoderSpec) -> None:
    global _worker_encoder
    # Each worker is one of num_proc processes: threads inside it would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = _ChunkEncoder(spec)


def _encode_in_worker(texts: list[str]) -> bytes:
    return _worker_encoder(texts)


def _chunks(texts: list[str]) -> Iterator[tuple[int, int]]:
    """(start, stop) ranges of consecutive documents, about `_CHUNK_CHARS` characters each."""
    start, chars = 0, 0
    for i, text in enumerate(texts):
        chars += len(text)
        if chars >= _CHUNK_CHARS or i + 1 - start >= _CHUNK_DOCS:
            yield start, i + 1
            start, chars = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def _tokenize_to_files(
    out_dir: Path, split_texts: dict[str, list[str]], spec: _EncoderSpec, num_proc: int
) -> dict[str, dict[str, Any]]:
    """Tokenize both splits into ``<split>.bin``; return their n_tokens, n_documents and sha256.

    Chunks come back in order (``imap``), so the files are the same for any ``num_proc``.
    """
    from tqdm.auto import tqdm

    plan = [(split, start, stop) for split in SPLITS for start, stop in _chunks(split_texts[split])]
    tasks = (split_texts[split][start:stop] for split, start, stop in plan)
    itemsize = np.dtype(spec.dtype).itemsize
    stats = {split: {"n_tokens": 0, "n_documents": len(split_texts[split])} for split in SPLITS}
    digests = {split: hashlib.sha256() for split in SPLITS}
    files = {split: open(out_dir / f"{split}.bin", "wb") for split in SPLITS}
    pool = None
    try:
        if num_proc == 1:
            results: Iterable[bytes] = map(_ChunkEncoder(spec), tasks)
        else:
            # spawn, not fork: the parent may already run tokenizers' thread pool (BPE training), and forking
            # a threaded process can deadlock.
            pool = multiprocessing.get_context("spawn").Pool(
                min(num_proc, len(plan)), initializer=_init_worker, initargs=(spec,)
            )
            results = pool.imap(_encode_in_worker, tasks)
        total = sum(len(texts) for texts in split_texts.values())
        with tqdm(total=total, unit="doc", desc="tokenizing") as progress:
            for (split, start, stop), data in zip(plan, results):
                files[split].write(data)
                digests[split].update(data)
                stats[split]["n_tokens"] += len(data) // itemsize
                progress.update(stop - start)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for file in files.values():
            file.close()
    return {split: {**stats[split], "sha256": digests[split].hexdigest()} for split in SPLITS}


def _load_hf_tokenizer(name: str):
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


def _check_val_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction <= 0.5:
        raise fail(f"--val-fraction must be in (0, 0.5], got {val_fraction}; 0.02 holds out 2% of documents.")


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_TRAINED_VOCAB_SIZE:
        raise fail(
            f"""
            --vocab-size {vocab_size} is too small to train a byte-level BPE: it needs 256 byte tokens,
            {EOS_TOKEN} and at least one merge, so at least {MIN_TRAINED_VOCAB_SIZE}.
            """
        )


def _check_output_free(out_dir: Path, overwrite: bool) -> None:
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise fail(f"{out_dir} already exists. Pass --overwrite to replace it, or choose another --output folder.")


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_text(path: Path) -> str:
    # Bytes then decode, not read_text: text mode would turn \r\n into \n, and the data should be the file.
    return path.read_bytes().decode("utf-8", errors="replace")


def _supported_types() -> str:
    return ", ".join(sorted(TEXT_SUFFIXES | RECORD_SUFFIXES.keys()))


def _input_files(inputs: Sequence[str | os.PathLike]) -> list[tuple[str, Path]]:
    """(key, path) of every supported file named by ``inputs``; keys are paths relative to a given folder."""
    for raw in inputs:
        if not Path(raw).exists():
            raise fail(
                f"--input {raw} does not exist. Check the path, or leave out --input to use the embedded corpus."
            )
    found: list[tuple[str, Path]] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            n_skipped = 0
            for file in sorted(path.rglob("*"), key=lambda p: p.relative_to(path).as_posix()):
                rel = file.relative_to(path)
                if any(part.startswith(".") for part in rel.parts) or not file.is_file():
                    continue
                if _is_supported(file):
                    found.append((rel.as_posix(), file))
                else:
                    n_skipped += 1
            if n_skipped:
                logger.info("%s: skipped %d files of unsupported types", path, n_skipped)
        elif _is_supported(path):
            found.append((path.name, path))
        else:
            raise fail(
                f"""
                --input {raw}: unknown file type {path.suffix or '(no suffix)'!r}. Supported: {_supported_types()}
                (plain-text types are one document per file; jsonl/json/parquet one per record).
                """
            )
    if not found:
        raise fail(
            f"No documents found: no file in {', '.join(map(str, inputs))} has a supported type "
            f"({_supported_types()})."
        )
    return found


def _is_supported(path: Path) -> bool:
    suffix = path.suffix.lower()
    return suffix in TEXT_SUFFIXES or suffix in RECORD_SUFFIXES


def _load_record_file(kind: str, path: Path):
    import datasets

    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:  # datasets wraps parse errors in several types; all mean "bad file"
        raise fail(f"Could not read {path} as {kind} records: {_describe(err)}") from err


def _describe(err: BaseException) -> str:
    """The message of ``err`` and of the errors that caused it: wrappers often hide the useful part."""
    messages = []
    while err is not None and len(messages) < 4:
        messages.append(str(err) or type(err).__name__)
        err = err.__cause__ or err.__context__
    return " <- ".join(messages)


def _load_hub_dataset(name: str):
    import datasets

    try:
        return datasets.load_dataset(name, split="train")
    except Exception as err:  # network, missing dataset, missing split: all mean "use local files instead"
        raise fail(
            f"Could not load Hub dataset {name!r}: {err}\nThis machine may be offline: pass local files with "
            "--input instead (jsonl, parquet or text)."
        ) from err


def _add_records(corpus: Corpus, dataset, text_field: str, key: str, where: str, limit: int) -> None:
    """Add ``dataset[text_field]`` records to ``corpus`` as documents ``<key>:<record index>``."""
    if text_field not in dataset.column_names:
        raise fail(
            f"""
            {where} has no field {text_field!r}; its fields are {', '.join(dataset.column_names)}. Pass
            --text-field with the name of the field that holds the document text.
            """
        )
    dtype = getattr(dataset.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string", "null"):
        raise fail(f"{where}: field {text_field!r} holds {dataset.features[text_field]}, not text. Pass --text-field.")
    for index, text in enumerate(dataset[text_field]):
        if len(corpus) >= limit:
            break
        corpus.add(f"{key}:{index}", text)
