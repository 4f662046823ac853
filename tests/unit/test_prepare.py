"""Data preparation: tokenizer round trip, .bin/.idx contents, streaming, determinism, inputs, atomic output, CLI errors."""

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from helpers import DOCUMENTS, VOCAB, siblings

from lmrecipe.data.format import FORMAT_VERSION, INDEX_DTYPE, load_meta, read_meta_file  # noqa: E402
from lmrecipe.data.prepare import pipeline as prep  # noqa: E402
from lmrecipe.data.prepare import read as reading  # noqa: E402
from lmrecipe.data.prepare.read import (  # noqa: E402
    DocumentSource,
    ReadStats,
    check_val_fraction,
    embedded_corpus_files,
    no_documents,
    split_of,
    stdlib_root,
)
from lmrecipe.data.prepare.tokenize import EOS_TOKEN, ChunkEncoder, EncoderSpec, train_bpe_tokenizer  # noqa: E402
from lmrecipe.errors import UserError  # noqa: E402


@dataclass
class Corpus:
    """Documents in reading order, held in memory. ``keys[i]`` names ``texts[i]`` (relative path, or ``path:record``)."""

    keys: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.texts)


def load_corpus(inputs: Sequence[str | os.PathLike] = (), hub_dataset: str | None = None, text_field: str = "text",
                max_documents: int | None = None) -> Corpus:
    """The documents that preparation streams, in the same order, held in memory: the reference the tests compare to."""
    source = DocumentSource(inputs, hub_dataset, text_field, max_documents)
    stats = ReadStats()
    corpus = Corpus()
    for doc in source.documents(stats):
        corpus.keys.append(doc.key)
        corpus.texts.append(doc.text)
    corpus.source = source.describe(stats)
    if not corpus.texts:
        raise no_documents(corpus.source)
    return corpus


def split_documents(keys: Sequence[str], val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """(train, val) index lists of ``keys``, each in the original order, by the preparation's hash rule."""
    check_val_fraction(val_fraction)
    splits = [split_of(key, val_fraction, seed) for key in keys]
    return ([i for i, s in enumerate(splits) if s == "train"], [i for i, s in enumerate(splits) if s == "val"])


def read_ids(out_dir: Path, split: str, meta: dict) -> np.ndarray:
    return np.fromfile(out_dir / f"{split}.bin", dtype=np.dtype(meta["dtype"]).newbyteorder("<"))


def read_index(out_dir: Path, split: str) -> np.ndarray:
    return np.fromfile(out_dir / f"{split}.idx", dtype=INDEX_DTYPE)


def reference_files(texts: list[str], tokenizer, eos_id: int, dtype: str) -> tuple[bytes, np.ndarray]:
    """What a split's .bin and .idx must hold, computed the simple way: every document in memory, one at a time."""
    ids, starts = [], [0]
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) + [eos_id]
        starts.append(len(ids))
    return np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<")).tobytes(), np.asarray(starts, dtype=INDEX_DTYPE)


def test_trained_tokenizer_round_trips_every_document(prepared_documents):
    from transformers import AutoTokenizer

    out_dir, meta = prepared_documents
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert len(tokenizer) == meta["vocab_size"]
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == meta["eos_id"]
    for text in DOCUMENTS.values():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_bin_files_hold_each_split_documents_followed_by_eos(prepared_documents, documents_dir):
    from transformers import AutoTokenizer

    out_dir, meta = prepared_documents
    assert meta == {**read_meta_file(out_dir), "timing": meta["timing"]}
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    corpus = load_corpus([documents_dir])
    # Files are read byte-exact (CRLF kept); empty, hidden and unsupported files are skipped.
    assert dict(zip(corpus.keys, corpus.texts)) == DOCUMENTS
    train_idx, val_idx = split_documents(corpus.keys, 0.2)
    assert meta["dtype"] == "uint16" and meta["format_version"] == FORMAT_VERSION == 2
    for split, indices in (("train", train_idx), ("val", val_idx)):
        info = meta["splits"][split]
        ids = read_ids(out_dir, split, meta)
        raw = (out_dir / f"{split}.bin").read_bytes()
        assert len(raw) == info["n_tokens"] * 2 and ids.size == info["n_tokens"]
        assert hashlib.sha256(raw).hexdigest() == info["sha256"]
        assert info["max_token_id"] == int(ids.max()) < meta["vocab_size"]
        assert int((ids == meta["eos_id"]).sum()) == info["n_documents"] == len(indices)
        assert ids[-1] == meta["eos_id"]
        pieces = np.split(ids, np.flatnonzero(ids == meta["eos_id"]) + 1)[:-1]
        decoded = [tokenizer.decode(piece[:-1].tolist()) for piece in pieces]
        assert decoded == [corpus.texts[i] for i in indices]
        # The index: n_documents + 1 offsets, each document's start, then the split's end.
        index = read_index(out_dir, split)
        assert index.tolist() == [0] + (np.flatnonzero(ids == meta["eos_id"]) + 1).tolist()
        assert [tokenizer.decode(ids[a : b - 1].tolist()) for a, b in zip(index[:-1], index[1:])] == decoded
    # The literal "<|endoftext|>" inside e.txt is text, not a document boundary (checked by the EOS count above).
    assert "e.txt" in corpus.keys


def test_output_is_identical_for_any_num_proc_and_tokenizer_path(prepared_documents, documents_dir, tmp_path, monkeypatch):
    out_1, meta_1 = prepared_documents
    # Many small chunks, so two workers really interleave and chunk order matters.
    monkeypatch.setattr(prep, "_CHUNK_CHARS", 100)
    out_2 = tmp_path / "two_procs"
    meta_2 = prep.prepare(output=out_2, inputs=[documents_dir], vocab_size=VOCAB, val_fraction=0.2, num_proc=2)
    for name in ("train.bin", "val.bin", "train.idx", "val.idx", "tokenizer.json", "tokenizer_config.json"):
        assert (out_1 / name).read_bytes() == (out_2 / name).read_bytes(), name
    assert meta_2["timing"]["num_proc"] == 2
    strip = lambda meta: {k: v for k, v in meta.items() if k != "timing"}  # noqa: E731
    assert strip(meta_1) == strip(meta_2) == strip(json.loads((out_2 / "meta.json").read_text()))

    # The saved tokenizer given back as a Hugging Face tokenizer must produce the same token stream as the trained
    # one (both encode with the tokenizers library; the next test covers the transformers path).
    out_3 = tmp_path / "given_tokenizer"
    meta_3 = prep.prepare(output=out_3, inputs=[documents_dir], tokenizer=str(out_1), val_fraction=0.2, num_proc=1)
    assert meta_3["tokenizer"] == str(out_1) and meta_3["splits"] == meta_1["splits"]
    assert (out_3 / "train.bin").read_bytes() == (out_1 / "train.bin").read_bytes()


def test_a_given_fast_tokenizer_encodes_with_the_tokenizers_library_unless_its_class_changes_the_encoding(
        prepared_documents, documents_dir, tmp_path, monkeypatch, caplog):
    import transformers

    out_1, meta_1 = prepared_documents
    texts = load_corpus([documents_dir]).texts
    spec = EncoderSpec(str(out_1), True, meta_1["eos_id"], meta_1["vocab_size"], meta_1["dtype"])
    # The two encoders agree on every document, special-token text included.
    assert ChunkEncoder(spec)([*texts, f"x {EOS_TOKEN} y"])[0] == \
        ChunkEncoder(replace(spec, backend=False))([*texts, f"x {EOS_TOKEN} y"])[0]
    with caplog.at_level(logging.INFO, logger="lmrecipe.data.prepare.tokenize"):
        prep.prepare(output=tmp_path / "fast", inputs=[documents_dir], tokenizer=str(out_1), val_fraction=0.2,
                     num_proc=1)
    assert "encoding with the tokenizers library" in caplog.text
    assert (tmp_path / "fast" / "train.bin").read_bytes() == (out_1 / "train.bin").read_bytes()

    # A tokenizer class whose __call__ changes the text in Python (here: lower-cases it) is seen on the sample and
    # keeps the transformers path, so the data holds what that class encodes.
    original = transformers.PreTrainedTokenizerFast.__call__

    def lower_casing(self, text, *args, **kwargs):
        return original(self, [t.lower() for t in text], *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "__call__", lower_casing)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmrecipe.data.prepare.tokenize"):
        prep.prepare(output=tmp_path / "slow", inputs=[documents_dir], tokenizer=str(out_1), val_fraction=0.2,
                     num_proc=1)
    assert "encoding with transformers: the tokenizers library encodes a sample" in caplog.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_1)
    ids = np.fromfile(tmp_path / "slow" / "train.bin", dtype=meta_1["dtype"]).tolist()
    decoded = tokenizer.decode(ids)
    assert decoded == decoded.lower() and decoded != tokenizer.decode(np.fromfile(out_1 / "train.bin", dtype=meta_1["dtype"]).tolist())


def test_split_is_deterministic_order_independent_and_seeded():
    keys = [f"doc{i}.txt" for i in range(4000)]
    train, val = split_documents(keys, 0.05)
    assert 160 <= len(val) <= 240 and sorted(train + val) == list(range(4000))  # 200 expected, +-4.5 sigma
    assert (train, val) == split_documents(keys, 0.05)
    reversed_keys = keys[::-1]
    _, val_rev = split_documents(reversed_keys, 0.05)
    assert {reversed_keys[i] for i in val_rev} == {keys[i] for i in val}
    assert split_documents(keys, 0.05, seed=1)[1] != val
    # A document's split is its own: the first 100 keep theirs when 3,900 others are dropped.
    assert split_documents(keys[:100], 0.05)[1] == [i for i in val if i < 100]
    assert {split_of(keys[i], 0.05) for i in val} == {"val"}


def test_jsonl_and_parquet_records_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"body": f"record {i}: текст\twith tabs  and  spaces\n", "id": i} for i in range(6)]
    records.insert(2, {"body": "", "id": -1})  # empty record: skipped
    data = tmp_path / "data"
    data.mkdir()
    (data / "part1.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist([{"body": f"parquet row {i} ✓\n"} for i in range(5)]), data / "part2.parquet")
    expected = [r["body"] for r in records if r["body"]] + [f"parquet row {i} ✓\n" for i in range(5)]

    corpus = load_corpus([data], text_field="body")
    assert corpus.texts == expected
    assert corpus.keys[0] == "part1.jsonl:0" and corpus.keys[-1] == "part2.parquet:4"

    out_dir = tmp_path / "out"
    meta = prep.prepare(output=out_dir, inputs=[data], text_field="body", vocab_size=VOCAB, val_fraction=0.2,
                        num_proc=1)
    assert meta["splits"]["train"]["n_documents"] + meta["splits"]["val"]["n_documents"] == len(expected)
    assert meta["splits"]["val"]["n_documents"] == len(split_documents(corpus.keys, 0.2)[1]) > 0
    assert meta["skipped"] == {"empty_documents": 1, "not_text_files": 0}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = np.concatenate([read_ids(out_dir, s, meta) for s in ("train", "val")])
    pieces = np.split(ids, np.flatnonzero(ids == meta["eos_id"]) + 1)[:-1]
    assert sorted(tokenizer.decode(p[:-1].tolist()) for p in pieces) == sorted(expected)

    assert len(load_corpus([data], text_field="body", max_documents=3)) == 3


@pytest.mark.parametrize("value, found", [(5, "int 5"), (["a", "b"], "list ['a', 'b']"), ({"t": 1}, "dict {'t': 1}")])
def test_a_record_whose_text_is_not_a_string_is_named_by_file_and_line(tmp_path, value, found):
    """A column of strings and other values is typed Json by datasets: the message names the record instead. A null
    text is an empty document, skipped and counted."""
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"text": "first document\n"}, {"text": None}, {"text": "third\n"}, {"text": value}, {"text": "fifth\n"}]
    (data / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(UserError) as err:
        prep.prepare(output=tmp_path / "out", inputs=[data], vocab_size=VOCAB, val_fraction=0.2, num_proc=1)
    assert str(err.value).startswith(f"{data / 'part.jsonl'}, line 4: field 'text' holds {found}, not text.")
    assert "--text-field" in str(err.value) and not (tmp_path / "out").exists()
    (data / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:3]))
    assert [d.text for d in DocumentSource([data]).documents()] == ["first document\n", "third\n"]


def test_failure_midway_leaves_no_temp_folder_and_keeps_old_output(documents_dir, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("precious")

    def broken_encoder(self, texts):
        raise RuntimeError("tokenizer crashed")

    monkeypatch.setattr(ChunkEncoder, "__call__", broken_encoder)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prep.prepare(output=out_dir, inputs=[documents_dir], vocab_size=VOCAB, overwrite=True, num_proc=1)
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"] and siblings(out_dir) == []

    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prep.prepare(output=fresh, inputs=[documents_dir], vocab_size=VOCAB, num_proc=1)
    assert not fresh.exists() and siblings(fresh) == []


def test_embedded_corpus_is_the_stdlib_without_tests_or_packages():
    files = embedded_corpus_files()
    root = stdlib_root()
    rels = [f.relative_to(root) for f in files]
    assert len(files) > 100
    assert rels == sorted(rels, key=lambda p: p.as_posix())
    assert {f.suffix for f in files} == {".py", ".txt"}
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    assert not any(excluded & set(rel.parts[:-1]) for rel in rels)
    assert Path("os.py") in rels and Path("json/decoder.py") in rels


def test_read_meta_file_rejects_missing_and_invalid(tmp_path, prepared_documents):
    with pytest.raises(UserError, match="not a prepared data folder"):
        read_meta_file(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        read_meta_file(tmp_path)
    meta = json.loads((prepared_documents[0] / "meta.json").read_text())
    del meta["eos_id"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="eos_id"):
        read_meta_file(tmp_path)


def write_mixed_inputs(root: Path, documents_dir: Path) -> list[Path]:
    """Three inputs of three kinds: a folder of text files, a jsonl file and a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = root / "records.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"record {i}: {'word ' * i}\n"}) + "\n" for i in range(12)))
    parquet = root / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": f"row {i} ✓ {'x' * i}"} for i in range(9)]), parquet)
    return [documents_dir, jsonl, parquet]


def test_streaming_writes_what_an_in_memory_reference_computes(prepared_documents, documents_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    inputs = write_mixed_inputs(tmp_path, documents_dir)
    # Chunks of one or two documents, in flight on two processes: chunking and workers must not show in the output.
    monkeypatch.setattr(prep, "_CHUNK_CHARS", 50)
    monkeypatch.setattr(prep, "_CHUNK_DOCS", 2)
    tokenizer_dir = prepared_documents[0]
    out_dir = tmp_path / "out"
    meta = prep.prepare(output=out_dir, inputs=inputs, tokenizer=str(tokenizer_dir), val_fraction=0.2, num_proc=2)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    per_input = [load_corpus([path]) for path in inputs]
    for split, position in (("train", 0), ("val", 1)):
        texts, first = [], 0
        for path, corpus, entry in zip(inputs, per_input, meta["inputs"]):
            chosen = [corpus.texts[i] for i in split_documents(corpus.keys, 0.2)[position]]
            texts += chosen
            assert entry["name"] == str(path)
            assert entry[split]["documents"] == ([first, first + len(chosen)] if chosen else [0, 0])
            first += len(chosen)
        expected_bin, expected_index = reference_files(texts, tokenizer, meta["eos_id"], meta["dtype"])
        assert (out_dir / f"{split}.bin").read_bytes() == expected_bin
        index = read_index(out_dir, split)
        assert index.tolist() == expected_index.tolist()
        for entry in meta["inputs"]:
            start, stop = entry[split]["documents"]
            assert entry[split]["n_tokens"] == int(index[stop] - index[start])
        assert meta["splits"][split]["max_token_id"] == int(read_ids(out_dir, split, meta).max())
    assert load_meta(out_dir) == meta


def test_trained_bpe_learns_from_the_first_megabytes_of_train_documents(documents_dir, tmp_path):
    out_dir = tmp_path / "out"
    limit_mb = 0.0004  # 400 bytes: a few of the small documents
    meta = prep.prepare(output=out_dir, inputs=[documents_dir], vocab_size=VOCAB, val_fraction=0.2,
                        tokenizer_sample_mb=limit_mb, num_proc=1)
    corpus = load_corpus([documents_dir])
    sample, n_bytes = [], 0
    for i in split_documents(corpus.keys, 0.2)[0]:
        if n_bytes >= limit_mb * 1e6:
            break
        sample.append(corpus.texts[i])
        n_bytes += len(corpus.texts[i].encode())
    assert 1 < len(sample) < len(corpus.texts) - 2
    assert meta["tokenizer_sample"] == {"max_mb": limit_mb, "n_documents": len(sample), "n_bytes": n_bytes}
    expected = train_bpe_tokenizer(sample, VOCAB)
    assert json.loads((out_dir / "tokenizer.json").read_text()) == json.loads(expected.backend_tokenizer.to_str())
    # Everything is still tokenized with it.
    assert meta["splits"]["train"]["n_documents"] + meta["splits"]["val"]["n_documents"] == len(corpus.texts)


def test_files_that_are_not_text_are_skipped_and_counted(tmp_path, caplog):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"ok{i}.txt").write_text(f"a real document number {i}\n")
    (docs / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))  # not UTF-8
    (docs / "compiled.py").write_bytes(b"x = 1\n\x00\x00\x00\x01binary")  # UTF-8, but NUL bytes
    assert [p.name for p in docs.iterdir() if p.name.startswith("ok")] and len(list(docs.iterdir())) == 8

    corpus = load_corpus([docs])
    assert corpus.keys == [f"ok{i}.txt" for i in range(6)]
    with caplog.at_level(logging.WARNING, logger=reading.__name__):
        meta = prep.prepare(output=tmp_path / "out", inputs=[docs], vocab_size=VOCAB, val_fraction=0.3, num_proc=1)
    assert meta["skipped"] == {"empty_documents": 0, "not_text_files": 2}
    assert meta["splits"]["train"]["n_documents"] + meta["splits"]["val"]["n_documents"] == 6
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "latin1.txt" in warned and "compiled.py" in warned and "not UTF-8 text" in warned
    # No replacement characters reached the tokens: the tokenizer never saw U+FFFD.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = read_ids(tmp_path / "out", "train", meta)
    assert "\ufffd" not in tokenizer.decode(ids.tolist())


def test_hub_datasets_are_streamed_as_records(tmp_path, monkeypatch):
    import datasets

    records = tmp_path / "hub.jsonl"
    records.write_text("".join(json.dumps({"text": f"hub record {i}\n" * (i + 1)}) + "\n" for i in range(20)))
    requested = []

    def fake_hub(name):
        requested.append(name)
        return datasets.load_dataset("json", data_files=str(records), split="train", streaming=True)

    monkeypatch.setattr(reading, "_load_hub_dataset", fake_hub)
    corpus = load_corpus(hub_dataset="org/name")
    assert corpus.keys == [f"org/name:{i}" for i in range(20)] and corpus.source == "hub:org/name"
    meta = prep.prepare(output=tmp_path / "out", hub_dataset="org/name", vocab_size=VOCAB, val_fraction=0.2,
                        num_proc=1)
    assert meta["source"] == "hub:org/name" and meta["inputs"][0]["name"] == "hub:org/name"
    assert meta["splits"]["val"]["n_documents"] == len(split_documents(corpus.keys, 0.2)[1]) > 0
    assert requested == ["org/name"] * 3  # the in-memory reference, the BPE sample, the tokenizing pass
