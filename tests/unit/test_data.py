"""The memmap loader: order determinism, rank disjointness, invariance to the batch split, start-up checks.

Data folders here are synthetic (random ids, documents of ``doc_len`` tokens ending in EOS 0), written straight
in the prepared-folder format, so each test controls exactly what the files and meta.json say.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SEQ_LEN, write_data

from lmrecipe.data.batches import BatchLayout, TrainBatches, ValBatches
from lmrecipe.data.format import INDEX_DTYPE, TokenWindows, check_model_vocab, load_meta, open_data, sample_blocks
from lmrecipe.data.order import ORDER_VERSION, SampleOrder
from lmrecipe.errors import UserError


def edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def data_dir(tmp_path) -> Path:
    return write_data(tmp_path / "data")


def step_windows(batches: TrainBatches, step: int) -> list[int]:
    return [int(i) for m in range(batches.layout.accum_steps) for i in batches.window_ids(step, m)]


def test_windows_read_the_memmap_without_copying(data_dir):
    windows = TokenWindows(data_dir, "train", SEQ_LEN)
    assert isinstance(windows.tokens, np.memmap)
    assert len(windows) == (4001 - 1) // SEQ_LEN
    raw = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    inputs, targets = windows.batch(np.array([0, 7]))
    assert inputs.shape == targets.shape == (2, SEQ_LEN) and inputs.dtype == torch.int64
    assert inputs[1].tolist() == raw[7 * SEQ_LEN : 8 * SEQ_LEN].tolist()
    assert targets[1].tolist() == raw[7 * SEQ_LEN + 1 : 8 * SEQ_LEN + 1].tolist()


@pytest.mark.parametrize("version", [1, 2])
def test_order_is_a_seeded_permutation_per_epoch(version):
    order = SampleOrder(n_windows=50, seed=3, version=version)
    first_epoch = order.windows(0, 50)
    assert sorted(first_epoch.tolist()) == list(range(50))
    assert (SampleOrder(50, 3, version=version).windows(0, 120) == order.windows(0, 120)).all()
    assert not (SampleOrder(50, 4, version=version).windows(0, 50) == first_epoch).all()
    second_epoch = order.windows(50, 50)
    assert sorted(second_epoch.tolist()) == list(range(50)) and not (second_epoch == first_epoch).all()
    # Reading across the epoch boundary is the same as reading each epoch separately.
    assert order.windows(45, 10).tolist() == first_epoch[45:].tolist() + second_epoch[:5].tolist()


@pytest.mark.parametrize("n_windows", [1, 2, 3, 4, 5, 255, 256, 257, 1023, 4097, 65_537])
def test_the_feistel_order_is_a_bijection_for_any_window_count(n_windows):
    order = SampleOrder(n_windows, seed=11)
    for epoch in (0, 1, 7):
        assert sorted(order.windows(epoch * n_windows, n_windows).tolist()) == list(range(n_windows))
    mixed = SampleOrder(n_windows, seed=11, stream=123)  # a mixture source's own stream
    assert sorted(mixed.windows(0, n_windows).tolist()) == list(range(n_windows))


def test_the_feistel_order_looks_random_and_costs_nothing_per_window():
    n = 100_000
    order = SampleOrder(n, seed=1)
    windows = order.windows(0, n)
    assert abs(np.corrcoef(np.arange(n), windows)[0, 1]) < 0.02  # no trace of the input order
    assert abs(np.abs(np.diff(windows)).mean() / (n / 3) - 1) < 0.02  # a random permutation's mean step is n/3
    assert (windows != SampleOrder(n, seed=1, stream=5).windows(0, n)).mean() > 0.99
    # 15T tokens at seq_len 2,048: 7.3e9 windows; a step's samples come back at once, nothing materialised.
    huge = SampleOrder(7_300_000_000, seed=1)
    start = time.perf_counter()
    picked = huge.windows(3_000_000_000, 1024)
    assert time.perf_counter() - start < 1.0 and len(set(picked.tolist())) == 1024
    assert (picked >= 0).all() and (picked < huge.n_windows).all() and huge.version == 2


def test_a_checkpoint_of_the_earlier_order_continues_in_it(tiny_data):
    from lmrecipe.checkpoint.resume import continue_sample_order

    windows = TokenWindows(tiny_data, "train", 16)
    layout = BatchLayout(global_batch_size=8, micro_batch_size=4, world_size=1, rank=0)
    batches = TrainBatches(windows, layout, seed=5)
    assert batches.order_version == ORDER_VERSION == 2
    continue_sample_order(batches, {"data": {"order_version": 2}})
    assert batches.order_version == 2
    continue_sample_order(batches, {"data": {"next_sample": 16}})  # written before the key existed
    assert batches.order_version == 1
    legacy = np.random.default_rng([5, 0]).permutation(len(windows))  # version 1: numpy's permutation
    assert batches.window_ids(2, 0).tolist() == legacy[16:20].tolist()


@pytest.mark.parametrize("world_size, micro", [(1, 24), (1, 4), (2, 4), (3, 8), (4, 2), (6, 1)])
def test_step_contents_do_not_depend_on_the_split(data_dir, world_size, micro):
    windows = TokenWindows(data_dir, "train", SEQ_LEN)
    reference = TrainBatches(windows, BatchLayout(24, 24, 1, 0), seed=11)
    for step in (0, 1, 9, 30):  # 30 crosses an epoch boundary (250 windows / 24 per step)
        expected = Counter(step_windows(reference, step))
        got = Counter()
        per_rank = []
        for rank in range(world_size):
            batches = TrainBatches(windows, BatchLayout(24, micro, world_size, rank), seed=11)
            ids = step_windows(batches, step)
            per_rank.append(set(ids))
            got.update(ids)
        assert got == expected
        # Ranks never share a sample within a step (an epoch holds more windows than a step).
        assert sum(len(s) for s in per_rank) == len(set().union(*per_rank))


def test_resume_needs_no_skipping(data_dir):
    windows = TokenWindows(data_dir, "train", SEQ_LEN)
    a = TrainBatches(windows, BatchLayout(8, 4, 1, 0), seed=5)
    b = TrainBatches(TokenWindows(data_dir, "train", SEQ_LEN), BatchLayout(8, 4, 1, 0), seed=5)
    for (xa, ya, _), (xb, yb, _) in zip(a.micro_batches(17), b.micro_batches(17)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_set_is_fixed_and_balanced(data_dir, world_size):
    windows = TokenWindows(data_dir, "val", SEQ_LEN)
    reference = ValBatches(windows, 10, 4, 1, 0).all_ids
    seen = []
    batch_counts = set()
    for rank in range(world_size):
        val = ValBatches(windows, 10, 4, world_size, rank)
        assert (val.all_ids == reference).all()
        rows = list(val)
        batch_counts.add(len(rows))
        seen += [int(i) for i, v in zip(val.rank_ids, val.valid) if v]
    assert sorted(seen) == sorted(reference.tolist())
    assert len(batch_counts) == 1  # every rank runs the same number of forward passes


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(UserError, match="does not exist.*prepare_data.py"):
        load_meta(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is empty"):
        load_meta(tmp_path / "empty")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(UserError, match="not a prepared data folder"):
        load_meta(tmp_path / "junk")


def test_meta_inconsistent_with_files(data_dir):
    with open(data_dir / "train.bin", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(UserError, match="holds 1000 bytes but meta.json says 4001 uint16 tokens"):
        load_meta(data_dir)


def test_invalid_meta(data_dir):
    (data_dir / "meta.json").write_text('{"dtype": "float32"}')
    with pytest.raises(UserError, match="lacks .*format_version"):
        load_meta(data_dir)


def test_token_id_beyond_model_vocab_names_both_numbers(tmp_path):
    folder = write_data(tmp_path / "d", vocab=1000)
    with pytest.raises(UserError, match="vocab_size=1000 but the model's vocab size is 500"):
        open_data(folder, SEQ_LEN, model_vocab_size=500)
    # meta claims a small vocab, but its max_token_id (the file's largest id) is larger: that is caught.
    edit_meta(folder, lambda meta: meta.update(vocab_size=10))
    top = int(np.fromfile(folder / "train.bin", dtype=np.uint16).max())
    with pytest.raises(UserError, match=rf"contains token id {top} \(meta.json max_token_id\), which is >= the model's vocab size 900"):
        open_data(folder, SEQ_LEN, model_vocab_size=900)


def test_a_model_vocabulary_beyond_the_datas_by_more_than_padding_is_refused(tmp_path):
    meta = load_meta(write_data(tmp_path / "d", vocab=1000))
    for padded in (None, 1000, 1024):  # 1,024: the next multiple of 128
        check_model_vocab(padded, meta, tmp_path / "d")
    with pytest.raises(UserError, match=r"model.vocab_size=1,025 but .* tokenizer of 1,000 tokens"):
        check_model_vocab(1025, meta, tmp_path / "d")


def test_start_up_reads_meta_json_and_a_sample_not_every_token(tmp_path):
    n_train = 64 * 4096  # the sample reads 16 blocks of 4,096 tokens: a quarter of this split
    folder = write_data(tmp_path / "d", n_train=n_train, vocab=1000)
    blocks = sample_blocks(n_train)
    assert len(blocks) == 16 and blocks[0][0] == 0 and blocks[-1][1] == n_train
    # An id past the vocabulary between two sampled blocks (not at a document end): start-up does not read it, so
    # open_data trusts meta.json. A start-up that scanned every token would fail here.
    unsampled = blocks[5][1] + 101
    assert not any(a <= unsampled < b for a, b in blocks) and unsampled % 50 != 49
    tokens = np.memmap(folder / "train.bin", dtype=np.uint16, mode="r+")
    tokens[unsampled] = 5000
    tokens.flush()
    _, train, _ = open_data(folder, SEQ_LEN, model_vocab_size=1000)
    assert int(train.tokens[unsampled]) == 5000
    # The same id inside a sampled block: the sampled check catches the file that disagrees with meta.json.
    tokens[blocks[7][0] + 101] = 5000
    tokens.flush()
    with pytest.raises(UserError, match="holds token id 5000 .* says the largest id is 999"):
        open_data(folder, SEQ_LEN, model_vocab_size=1000)


def test_document_index_is_checked_against_the_tokens(tmp_path):
    folder = write_data(tmp_path / "d")
    index = np.fromfile(folder / "train.idx", dtype=INDEX_DTYPE)
    index[1:-1] += 1  # every document end off by one: no longer on an EOS
    index.tofile(folder / "train.idx")
    with pytest.raises(UserError, match="train.idx does not match .*train.bin.*EOS"):
        open_data(folder, SEQ_LEN, model_vocab_size=None)
    index[:-1].tofile(folder / "train.idx")  # one entry short
    with pytest.raises(UserError, match="train.idx holds 648 bytes but meta.json says 81 documents"):
        load_meta(folder)
    (folder / "val.idx").unlink()
    edit_meta(folder, lambda meta: meta["splits"]["train"].update(n_documents=80))
    with pytest.raises(UserError, match="val.idx is missing"):
        load_meta(folder)


def test_a_document_index_out_of_order_is_refused_before_training(tmp_path):
    """Two document starts swapped: the same size, every offset on a document start and its EOS, so the sampled
    checks pass; under document masking every window over them would get wrong boundaries."""
    from helpers import TINY_OVERRIDES

    from lmrecipe.config import load_config
    from lmrecipe.train.trainer import train

    folder = write_data(tmp_path / "d")
    index = np.fromfile(folder / "train.idx", dtype=INDEX_DTYPE)
    index[[40, 41]] = index[[41, 40]]
    index.tofile(folder / "train.idx")
    with pytest.raises(UserError, match=rf"{folder / 'train.idx'} is not in ascending order: entry 41 \(token 2000\) "
                                        r"comes after entry 40 \(token 2050\).*document_masking.*--overwrite"):
        open_data(folder, SEQ_LEN, model_vocab_size=None)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="is not in ascending order"):
        train(load_config("recipes/tiny.yaml", [f"out_dir={out}", f"data.path={folder}", *TINY_OVERRIDES]))
    assert not out.exists()


def test_without_document_masking_start_up_does_not_read_the_index_whole(tmp_path):
    """The order of the index matters to document masking only: without it, start-up stays constant-time."""
    folder = write_data(tmp_path / "d")
    index = np.fromfile(folder / "train.idx", dtype=INDEX_DTYPE)
    index[[40, 41]] = index[[41, 40]]
    index.tofile(folder / "train.idx")
    open_data(folder, SEQ_LEN, model_vocab_size=None, documents=False)
    with pytest.raises(UserError, match="is not in ascending order"):
        open_data(folder, SEQ_LEN, model_vocab_size=None, documents=True)


def test_a_document_index_that_ends_past_its_split_is_named_as_such(tmp_path):
    folder = write_data(tmp_path / "d")
    index = np.fromfile(folder / "val.idx", dtype=INDEX_DTYPE)
    index[-1] += 7
    index.tofile(folder / "val.idx")
    with pytest.raises(UserError, match=r"val.idx runs from token 0 to token 808, but its split holds tokens 0 to 801"):
        open_data(folder, SEQ_LEN, model_vocab_size=None)


def test_version_1_folder_is_rejected_with_the_command_that_fixes_it(tmp_path):
    folder = write_data(tmp_path / "d")
    (folder / "train.idx").unlink()
    (folder / "val.idx").unlink()

    def as_version_1(meta):
        meta["format_version"] = 1
        for split in meta["splits"].values():
            del split["max_token_id"]

    edit_meta(folder, as_version_1)
    with pytest.raises(UserError, match=r"data format version 1.*Re-prepare it .*prepare_data.py --output .* --overwrite"):
        open_data(folder, SEQ_LEN, model_vocab_size=None)


def test_empty_split_names_the_fix(tmp_path):
    folder = write_data(tmp_path / "d", n_val=0)
    assert (folder / "val.bin").stat().st_size == 0
    with pytest.raises(UserError, match=r"The val split of .* is empty \(0 tokens.*--val-fraction.*prepare_data.py"):
        open_data(folder, SEQ_LEN, model_vocab_size=1000)


def test_seq_len_longer_than_split(tmp_path):
    folder = write_data(tmp_path / "d", n_val=10)
    with pytest.raises(UserError, match=r"data.seq_len=16 is longer than the val split \(10 tokens"):
        open_data(folder, SEQ_LEN, model_vocab_size=None)


def test_uint32_data(tmp_path):
    folder = write_data(tmp_path / "d", vocab=70000, dtype=np.uint32)
    meta, train, _ = open_data(folder, SEQ_LEN, model_vocab_size=70000)
    assert train.tokens.dtype == np.uint32 and int(train.tokens.max()) == meta["splits"]["train"]["max_token_id"] > 65535
