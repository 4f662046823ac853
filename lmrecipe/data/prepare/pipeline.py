"""Turn a text corpus into the token files that training reads, streaming: memory does not grow with the corpus.

:func:`prepare` reads documents (``read.py``), builds or loads the tokenizer and encodes the documents in worker
processes (``tokenize.py``), and writes the folder (``write.py``, which describes its format). Documents are
tokenized in chunks of about ``_CHUNK_CHARS`` characters with at most ``2 * num_proc`` chunks in flight, and
appended to the output files in the order they were read. Peak memory is the tokenizer processes, a few chunks,
and the largest single document, not the corpus. A trained BPE is trained on a bounded sample, the first
``tokenizer_sample_mb`` MB (UTF-8) of train documents in reading order, which is one extra read of that prefix of
the corpus.

Nothing appears at the output until the whole folder is written. An interrupted preparation does not resume; run
it again and it restarts from the beginning.

With ``shard=(i, N)`` it prepares shard i of N of the corpus into a sub-folder of ``output`` (``shards.py``), and the
shard that completes the set writes the set's ``meta.json``.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmrecipe.data.format import FORMAT_VERSION, SPLITS, file_sha256, shard_name
from lmrecipe.data.prepare.read import (
    Document,
    DocumentSource,
    ReadStats,
    check_splits,
    check_val_fraction,
    split_of,
    train_sample,
)
from lmrecipe.data.prepare.tokenize import (
    TRAINED_TOKENIZER,
    ChunkEncoder,
    EncoderSpec,
    check_vocab_size,
    choose_encoder,
    encode_in_worker,
    init_worker,
    load_hf_tokenizer,
    train_bpe_tokenizer,
)
from lmrecipe.data.prepare.shards import (
    check_set_folder,
    check_shard_request,
    finish_shards,
    finished_shard,
    shard_args,
)
from lmrecipe.data.prepare.write import SplitWriter, check_output_free, warn_stale_temp_dirs, write_meta
from lmrecipe.errors import fail
from lmrecipe.fileio import building_dir, is_disk_full

logger = logging.getLogger(__name__)

# Documents are sent to tokenizer workers in chunks this large: big enough that pickling and IPC stay cheap
# next to tokenizing, small enough that the progress bar moves and both cores stay busy on a small corpus.
_CHUNK_CHARS = 256 * 1024
_CHUNK_DOCS = 1024
_SAMPLE_DOCS = 64
"""Documents a given tokenizer's two encoders must agree on (:func:`choose_encoder`)."""
# Chunks submitted but not yet written, per tokenizer process: enough to keep every worker busy while the
# parent reads the next documents, few enough that memory stays a handful of chunks.
_IN_FLIGHT_PER_PROC = 2


def prepare(
    *,
    output: str | os.PathLike,
    inputs: Sequence[str | os.PathLike] = (),
    hub_dataset: str | None = None,
    text_field: str = "text",
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    tokenizer_sample_mb: float = 256.0,
    val_fraction: float = 0.02,
    num_proc: int | None = None,
    max_documents: int | None = None,
    overwrite: bool = False,
    seed: int = 0,
    shard: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Stream a corpus, build or load a tokenizer, and write a prepared data folder at ``output``.

    Memory stays bounded whatever the corpus size (see the module docstring). Nothing appears at ``output``
    unless the whole preparation succeeds; after an interruption, run it again: it starts over.

    Args:
        output: folder to create; it must not exist unless ``overwrite``.
        inputs: files or folders (see :class:`lmrecipe.data.prepare.read.DocumentSource`); empty with no ``hub_dataset`` means the embedded
            Python standard library corpus.
        hub_dataset: Hugging Face Hub dataset name, streamed with
            ``datasets.load_dataset(name, split="train", streaming=True)``.
        text_field: record field (jsonl/json/parquet/hub) that holds the document text.
        tokenizer: Hugging Face tokenizer name or folder; None trains a byte-level BPE on the train split.
        vocab_size: entries of the trained BPE, special token included (ignored with ``tokenizer``).
        tokenizer_sample_mb: a trained BPE learns from the first this many MB (10**6 bytes of UTF-8) of train
            documents, in reading order (whole documents; the last one may cross the limit). Ignored with
            ``tokenizer``.
        val_fraction: share of documents held out for validation, in (0, 0.5].
        num_proc: tokenizer processes; None means every CPU core. 1 tokenizes in this process, where the
            ``tokenizers`` library may still spread a batch over its own threads.
        max_documents: keep only the first N non-empty documents.
        overwrite: replace an existing ``output`` (only once the new folder is complete).
        seed: salt of the train/val split hash.
        shard: ``(i, N)``: prepare only shard i of N of the corpus's files into ``output/shard-0000i-of-0000N``
            (needs ``tokenizer``; see ``shards.py``); the shard that completes the set writes ``output/meta.json``.

    Returns:
        The dict written to ``meta.json`` (the shard's, with ``shard``).
    """
    started = time.perf_counter()
    out_dir = Path(output)
    check_val_fraction(val_fraction)
    if shard is not None:
        check_shard_request(shard, tokenizer, max_documents)
    if tokenizer is None:
        check_vocab_size(vocab_size)
        if not tokenizer_sample_mb > 0:
            raise fail(f"--tokenizer-sample-mb must be positive, got {tokenizer_sample_mb}.")
    num_proc = (os.cpu_count() or 1) if num_proc is None else num_proc
    if num_proc < 1:
        raise fail(f"--num-proc must be at least 1, got {num_proc}.")
    source = DocumentSource(inputs, hub_dataset, text_field, max_documents, shard)
    shard_record = None
    if shard is not None:
        set_dir, out_dir = out_dir, out_dir / shard_name(*shard)
        check_set_folder(set_dir, shard[1])
        shard_record = {"plan": source.shard_plan()[0], "args": shard_args(tokenizer, text_field, val_fraction, seed)}
        done = None if overwrite else finished_shard(out_dir, **shard_record)
        if done is not None:
            logger.info("%s is already prepared (same files and arguments): kept", out_dir)
            finish_shards(set_dir, required=False)
            return done
    check_output_free(out_dir, overwrite)
    warn_stale_temp_dirs(out_dir)
    # A given tokenizer is loaded before the corpus is read, so a wrong name fails in seconds.
    given_tokenizer = load_hf_tokenizer(tokenizer) if tokenizer is not None else None

    existed = out_dir.exists()
    try:
        with building_dir(out_dir, overwrite) as tmp_dir:
            meta = _build(tmp_dir, source, tokenizer, given_tokenizer, vocab_size, tokenizer_sample_mb, num_proc,
                          val_fraction, seed, shard_record)
            check_output_free(out_dir, overwrite)  # again: it may have appeared while we worked
    except OSError as err:
        if not is_disk_full(err):
            raise
        kept = f"{out_dir} is unchanged" if existed else f"nothing was left at {out_dir}"
        raise fail(f"No space left on the device while writing {out_dir} ({err}). The partial folder was removed and "
                   f"{kept}. Free some space (the folder takes about 2 bytes per token with a vocabulary of up to "
                   f"65536, 4 above) or choose an --output on a larger disk, then run the command again.") from None
    logger.info("wrote %s in %.1fs", out_dir, time.perf_counter() - started)
    if shard is not None:
        finish_shards(out_dir.parent, required=False)
    return meta


def _build(
    tmp_dir: Path,
    source: DocumentSource,
    tokenizer: str | None,
    given_tokenizer,
    vocab_size: int,
    tokenizer_sample_mb: float,
    num_proc: int,
    val_fraction: float,
    seed: int,
    shard_record: dict | None = None,
) -> dict[str, Any]:
    """Write tokenizer, .bin/.idx files and, last, meta.json into ``tmp_dir``; return the meta dict.

    ``given_tokenizer`` is the loaded ``tokenizer`` (a name), or None to train a BPE on a sample of the train split.
    ``shard_record``: the ``shard`` entry of a shard's ``meta.json`` (a shard's split may be empty; the set's may not).
    """
    started = time.perf_counter()
    sample = None
    if given_tokenizer is None:
        sample = {"max_mb": tokenizer_sample_mb, "n_documents": 0, "n_bytes": 0}
        hf_tokenizer = _train_bpe(source, vocab_size, val_fraction, seed, sample)
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
    stats = ReadStats()
    spec = EncoderSpec(str(tmp_dir), True, eos_id, vocab_size, dtype)
    documents = source.documents(stats)
    if given_tokenizer is not None:
        first = list(itertools.islice(documents, _SAMPLE_DOCS))
        spec = choose_encoder(spec, [doc.text for doc in first])
        documents = itertools.chain(first, documents)
    splits, inputs = _tokenize_to_files(tmp_dir, documents, spec, num_proc, val_fraction, seed, len(source.names))
    tokenize_seconds = time.perf_counter() - started
    described = source.describe(stats)
    if shard_record is None:
        check_splits(splits, stats, described, val_fraction)
    n_tokens = sum(split["n_tokens"] for split in splits.values())
    logger.info(
        "read %d documents (%.1fM characters) from %s; skipped %d empty documents and %d files that are not "
        "UTF-8 text", stats.n_documents, stats.n_chars / 1e6, described, stats.empty_documents, stats.not_text_files,
    )
    logger.info(
        "tokenized: train %d documents, %d tokens; val %d documents, %d tokens; %d tokens in %.1fs "
        "(%.0f tokens/s, reading included, %d processes)",
        splits["train"]["n_documents"], splits["train"]["n_tokens"], splits["val"]["n_documents"],
        splits["val"]["n_tokens"], n_tokens, tokenize_seconds, n_tokens / tokenize_seconds, num_proc,
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer or TRAINED_TOKENIZER,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": dtype,
        "source": described,
        "val_fraction": val_fraction,
        "seed": seed,
        "splits": splits,
        "inputs": [{"name": name, **per_split} for name, per_split in zip(source.names, inputs)],
        "skipped": {"empty_documents": stats.empty_documents, "not_text_files": stats.not_text_files},
        "tokenizer_sample": sample,
        **({} if shard_record is None else {"shard": shard_record, "tokenizer_sha256": _tokenizer_sha256(tmp_dir)}),
        # Everything that differs between two identical runs lives here, so the rest can be compared.
        "timing": {
            "num_proc": num_proc,
            "tokenizer_seconds": round(tokenizer_seconds, 3),
            "tokenize_seconds": round(tokenize_seconds, 3),
            "tokens_per_sec": round(n_tokens / tokenize_seconds, 1),
        },
    }
    write_meta(tmp_dir, meta)
    return meta


def _tokenizer_sha256(folder: Path) -> str | None:
    """sha256 of the folder's ``tokenizer.json`` (None without one): the shards of a set must agree on it."""
    return file_sha256(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else None


def _train_bpe(source: DocumentSource, vocab_size: int, val_fraction: float, seed: int, sample: dict):
    """A byte-level BPE trained on the first ``sample["max_mb"]`` MB of train documents; counts go into ``sample``."""
    texts = train_sample(source, val_fraction, seed, sample)
    logger.info("training byte-level BPE, vocab_size %d, on the first %g MB of train documents", vocab_size,
                sample["max_mb"])
    hf_tokenizer = train_bpe_tokenizer(texts, vocab_size)
    logger.info("BPE sample: %d train documents, %.1f MB", sample["n_documents"], sample["n_bytes"] / 1e6)
    if len(hf_tokenizer) < vocab_size:
        logger.warning("the corpus only supports %d BPE tokens (asked for %d)", len(hf_tokenizer), vocab_size)
    return hf_tokenizer


def _tokenize_to_files(
    out_dir: Path,
    documents: Iterator[Document],
    spec: EncoderSpec,
    num_proc: int,
    val_fraction: float,
    seed: int,
    n_inputs: int,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Tokenize the documents into ``<split>.bin`` and ``<split>.idx``, streaming.

    Returns per split its n_tokens, n_documents, max_token_id and sha256, and per input its document range and
    tokens in each split. Chunks are written in the order they were submitted, so the files are the same for
    any ``num_proc`` and any chunk size.
    """
    from tqdm.auto import tqdm

    writers = {split: SplitWriter(out_dir, split, spec.dtype, n_inputs) for split in SPLITS}
    pending: dict[str, tuple[list[str], list[int]]] = {split: ([], []) for split in SPLITS}
    pending_chars = dict.fromkeys(SPLITS, 0)
    in_flight: deque = deque()
    max_in_flight = _IN_FLIGHT_PER_PROC * num_proc
    pool = None
    encoder = None
    progress = tqdm(unit="doc", desc="tokenizing")

    def write(split: str, input_indices: list[int], result) -> None:
        data, lengths, top = result
        writers[split].append(data, lengths, top, input_indices)
        progress.update(len(lengths))

    def submit(split: str) -> None:
        texts, input_indices = pending[split]
        pending[split], pending_chars[split] = ([], []), 0
        if pool is None:
            write(split, input_indices, encoder(texts))
            return
        while len(in_flight) >= max_in_flight:
            write(*in_flight[0][:2], in_flight[0][2].get())
            in_flight.popleft()
        in_flight.append((split, input_indices, pool.apply_async(encode_in_worker, (texts,))))

    try:
        if num_proc == 1:
            encoder = ChunkEncoder(spec)
        else:
            # spawn, not fork: the parent may already run tokenizers' thread pool (BPE training), and forking
            # a threaded process can deadlock.
            pool = multiprocessing.get_context("spawn").Pool(num_proc, initializer=init_worker, initargs=(spec,))
        for doc in documents:
            split = split_of(doc.key, val_fraction, seed)
            texts, input_indices = pending[split]
            texts.append(doc.text)
            input_indices.append(doc.input_index)
            pending_chars[split] += len(doc.text)
            if pending_chars[split] >= _CHUNK_CHARS or len(texts) >= _CHUNK_DOCS:
                submit(split)
        for split in SPLITS:
            if pending[split][0]:
                submit(split)
        while in_flight:
            write(*in_flight[0][:2], in_flight[0][2].get())
            in_flight.popleft()
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        for writer in writers.values():
            writer.close()
    inputs = [{split: writers[split].inputs[i] for split in SPLITS} for i in range(n_inputs)]
    return {split: writer.stats() for split, writer in writers.items()}, inputs
