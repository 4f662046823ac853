"""Sharded preparation and shard sets: 1 and 3 shards of a corpus are the one-folder preparation, byte for byte and
window for window; a set trains, mixes and resumes like a folder; missing, mixed, foreign and unfinished shards fail
with the fix."""

import importlib.util
import json
import shutil

import numpy as np
import pytest
from helpers import ROOT

from lmrecipe.config import DataConfig, DataSource
from lmrecipe.data.batches import BatchLayout, TrainBatches, ValBatches
from lmrecipe.data.format import INDEX_DTYPE, TokenWindows, combine_splits, load_meta, tokenizer_signature
from lmrecipe.data.prepare.pipeline import prepare
from lmrecipe.data.prepare.read import assign_files
from lmrecipe.data.prepare.shards import finish_shards
from lmrecipe.data.sources import check_sources, open_training_data
from lmrecipe.errors import UserError


def prepare_shard(corpus, tokenizer, output, index, count, **kwargs):
    return prepare(output=output, inputs=[corpus], tokenizer=str(tokenizer), val_fraction=0.1, num_proc=1,
                   shard=(index, count), **kwargs)


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory, corpus_dir, tiny_data, tiny_shards):
    """``corpus_dir`` (the corpus of ``tiny_data``) prepared with tiny_data's tokenizer as 1 shard and as 3 shards."""
    one = tmp_path_factory.mktemp("shards") / "one"
    prepare_shard(corpus_dir, tiny_data, one, 0, 1)
    return one, tiny_shards


def test_assign_files_cuts_contiguous_runs_of_about_equal_bytes():
    sizes = [5, 1, 1, 1, 10, 0, 2, 3]
    runs = [assign_files(sizes, i, 3) for i in range(3)]
    assert runs[0][0] == 0 and runs[-1][1] == len(sizes)
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))  # contiguous, disjoint, covering
    assert [sum(sizes[a:b]) for a, b in runs] == [8, 10, 5]
    assert [assign_files([100, 1], i, 3) for i in range(3)] == [(0, 0), (0, 1), (1, 2)]  # a large file: an empty shard
    assert assign_files([0, 0, 0], 2, 3) == (2, 3)


def test_shards_laid_end_to_end_are_the_one_folder_preparation(shard_sets, tiny_data):
    one, three = shard_sets
    whole = load_meta(tiny_data)
    for folder in shard_sets:
        meta = load_meta(folder)
        for split in ("train", "val"):
            assert {k: meta["splits"][split][k] for k in ("n_tokens", "n_documents", "max_token_id")} == \
                {k: whole["splits"][split][k] for k in ("n_tokens", "n_documents", "max_token_id")}
            shards = [folder / entry["path"] for entry in meta["shards"]]
            tokens = np.concatenate([np.fromfile(s / f"{split}.bin", dtype=np.uint16) for s in shards])
            assert tokens.tobytes() == (tiny_data / f"{split}.bin").read_bytes()
            starts = [0]
            for s in shards:
                starts.extend((np.fromfile(s / f"{split}.idx", dtype=INDEX_DTYPE)[1:] + starts[-1]).tolist())
            assert starts == np.fromfile(tiny_data / f"{split}.idx", dtype=INDEX_DTYPE).tolist()
    meta = load_meta(three)
    assert [e["path"] for e in meta["shards"]] == [f"shard-0000{i}-of-00003" for i in range(3)]
    assert [e["files"] for e in meta["shards"]] == [[0, 14], [14, 27], [27, 40]]
    assert meta["shards"][1]["splits"]["val"]["n_tokens"] == 0  # a shard's split may be empty; the set's may not
    assert tokenizer_signature(three) == tokenizer_signature(tiny_data)


@pytest.mark.parametrize("seq_len", [7, 64, 100_000])
def test_one_and_three_shards_give_the_same_windows_in_the_same_order(shard_sets, tiny_data, seq_len):
    """Windows and their document boundaries, in training order, for 1 and 3 shards and the plain folder; at
    seq_len 100,000 every window crosses shards (the largest shard holds 85,519 training tokens)."""
    one, three = shard_sets
    layout = BatchLayout(global_batch_size=4, micro_batch_size=2, world_size=1, rank=0)
    batches = [TrainBatches(TokenWindows(folder, "train", seq_len), layout, seed=3) for folder in (tiny_data, one, three)]
    assert len({b.order.n_windows for b in batches}) == 1
    steps = range(4 if seq_len < 1000 else 2)  # at 100,000 tokens a window: 4 epochs of 2 windows
    for b in batches:
        b.documents = True
    for step in steps:
        got = [list(b.micro_batches(step)) for b in batches]
        for other in got[1:]:
            for ref, micro in zip(got[0], other):
                assert ref.inputs.equal(micro.inputs) and ref.targets.equal(micro.targets)
                assert ref.documents.position_ids.equal(micro.documents.position_ids)
                assert ref.documents.document_ids.equal(micro.documents.document_ids)
                assert ref.documents.cu_seqlens.equal(micro.documents.cu_seqlens)
                assert ref.documents.max_seqlen == micro.documents.max_seqlen
    if seq_len < 1000:
        vals = [ValBatches(TokenWindows(f, "val", seq_len), 16, 4, 1, 0, documents=True) for f in (tiny_data, three)]
        for ref, got in zip(*vals):
            assert ref[0].equal(got[0]) and ref[3].cu_seqlens.equal(got[3].cu_seqlens)


def test_a_shard_set_trains_mixes_and_signs_like_a_folder(shard_sets, tiny_data):
    _, three = shard_sets
    layout = BatchLayout(4, 2, 1, 0)
    data = open_training_data(DataConfig(path=str(three), seq_len=32), 384, layout, seed=1)
    plain = open_training_data(DataConfig(path=str(tiny_data), seq_len=32), 384, layout, seed=1)
    assert data.n_train_windows == plain.n_train_windows
    signature, plain_signature = data.signature(), plain.signature()
    assert signature.pop("train_sha256") != plain_signature.pop("train_sha256")  # of the shards' sha256s
    assert signature == plain_signature
    assert {f.name for f in data.tokenizer_files()} == {"meta.json", "tokenizer.json", "tokenizer_config.json"}
    first_tokens = [next(iter(d.val_sets.values())).windows.documents_at(np.zeros(1, dtype=np.int64), 16)
                    for d in (data, plain)]  # the checkpoints' probe input
    assert np.array_equal(first_tokens[0].position_ids, first_tokens[1].position_ids)
    mixture = DataConfig(path=None, sources=[DataSource(str(three)), DataSource(str(tiny_data))], seq_len=32)
    check_sources(mixture)  # one tokenizer
    mixed = open_training_data(mixture, 384, layout, seed=1)
    assert mixed.is_mixture and mixed.n_train_windows == 2 * plain.n_train_windows


def test_preparing_a_written_shard_again_keeps_it_and_finishing_is_idempotent(shard_sets, corpus_dir, tiny_data,
                                                                               tmp_path):
    three = tmp_path / "three"
    shutil.copytree(shard_sets[1], three)
    shard = three / "shard-00001-of-00003"
    before = {p.name: p.stat().st_mtime_ns for p in shard.iterdir()}
    set_meta = (three / "meta.json").read_bytes()
    prepare_shard(corpus_dir, tiny_data, three, 1, 3)
    assert {p.name: p.stat().st_mtime_ns for p in shard.iterdir()} == before
    finish_shards(three)
    assert (three / "meta.json").read_bytes() == set_meta  # no timings: concurrent last shards write alike


def test_missing_mixed_foreign_and_unfinished_shards_fail_with_the_fix(shard_sets, corpus_dir, tiny_data,
                                                                       prepared_documents, tmp_path):
    _, three = shard_sets
    partial = tmp_path / "partial"
    prepare_shard(corpus_dir, tiny_data, partial, 0, 3)
    assert not (partial / "meta.json").exists()
    with pytest.raises(UserError, match=r"holds shards .* no meta.json: the set is not finished.*--finish-shards"):
        load_meta(partial)
    (partial / "shard-00002-of-00003.tmp-4242").mkdir()
    with pytest.raises(UserError, match=r"missing 2 of 3 shards: 1-2 \(1 in progress or interrupted: "
                                        r"shard-00002-of-00003.tmp-4242\).*LMRECIPE_SHARDS=3 sbatch --array=1-2"):
        finish_shards(partial)
    with pytest.raises(UserError, match=r"preparation into 3 shards, and this is shard of 4.*LMRECIPE_SHARDS"):
        prepare_shard(corpus_dir, tiny_data, partial, 3, 4)

    foreign = tmp_path / "foreign"
    shutil.copytree(three, foreign)
    (foreign / "meta.json").unlink()
    mismatch = (r"shard-00001-of-00003 and shard-00000-of-00003 of the shard set .* not prepared alike \(they differ in "
                r".*tokenizer_sha256: another tokenizer\).*--overwrite.*--finish-shards")
    with pytest.raises(UserError, match=mismatch):  # the shard is written, and completes a set it does not fit
        prepare_shard(corpus_dir, prepared_documents[0], foreign, 1, 3, overwrite=True)
    assert not (foreign / "meta.json").exists()
    with pytest.raises(UserError, match=mismatch):
        finish_shards(foreign)

    moved = tmp_path / "moved"
    shutil.copytree(three, moved)
    shutil.rmtree(moved / "shard-00002-of-00003")
    with pytest.raises(UserError, match=r"Shard .*shard-00002-of-00003 of the shard set .* is missing.*--shard 2/3"):
        open_training_data(DataConfig(path=str(moved), seq_len=32), 384, BatchLayout(4, 2, 1, 0), seed=1)
    shutil.copytree(foreign / "shard-00001-of-00003", moved / "shard-00002-of-00003")
    with pytest.raises(UserError, match=r"differs from what .*meta.json records of it .*train n_tokens"):
        load_meta(moved)

    with pytest.raises(UserError, match="--shard needs --tokenizer"):
        prepare(output=tmp_path / "x", inputs=[corpus_dir], shard=(0, 2))
    with pytest.raises(UserError, match=r"--shard 2/2: the index must be in \[0, N\)"):
        prepare_shard(corpus_dir, tiny_data, tmp_path / "x", 2, 2)
    with pytest.raises(UserError, match="is a prepared data folder, not a shard set"):
        prepare_shard(corpus_dir, tiny_data, tiny_data, 0, 2)


def reorder(root, meta):
    meta["shards"][0], meta["shards"][1] = meta["shards"][1], meta["shards"][0]


def drop_last(root, meta):
    """The last shard deleted, and its entry, and the totals made to add up."""
    shutil.rmtree(root / meta["shards"].pop()["path"])
    meta["splits"] = {split: combine_splits([e["splits"][split] for e in meta["shards"]]) for split in ("train", "val")}


def lower_max_token_id(root, meta):
    meta["splits"]["train"]["max_token_id"] -= 10


def add_a_stray(root, meta):
    """A shard of a 2-shard preparation in the finished 3-shard set (the name says which; the check reads no more)."""
    shutil.copytree(root / "shard-00000-of-00003", root / "shard-00000-of-00002")


def unsort_an_index(root, meta):
    """A shard's train.idx with two document starts swapped: same size, every offset still a document start."""
    path = root / "shard-00002-of-00003" / "train.idx"
    index = np.fromfile(path, dtype=INDEX_DTYPE)
    index[[3, 4]] = index[[4, 3]]
    index.tofile(path)


HAND_EDITS = {
    "reordered": (reorder, r"lists shard-00001-of-00003 as shard 0 of 3, but it is shard 1 of 3 \(its own meta.json\): "
                           r"the list was reordered or shortened by hand.*--finish-shards"),
    "shard_dropped": (drop_last, r"lists shard-00000-of-00003 as shard 0 of 2, but it is shard 0 of 3"),
    "stray_of_another_count": (add_a_stray, r"holds shard folders its meta.json does not list \(shard-00000-of-00002\): "
                                            r"a shard of another preparation was added.*--finish-shards"),
    "totals_edited": (lower_max_token_id, r"describes its train split with max_token_id \d+ where its shards add up "
                                          r"to \d+: the file was edited by hand"),
    "index_out_of_order": (unsort_an_index, r"shard-00002-of-00003/train.idx is not in ascending order: entry 4"),
}


@pytest.mark.parametrize("case", sorted(HAND_EDITS))
def test_a_set_edited_by_hand_is_refused_at_start_up(shard_sets, tmp_path, case):
    """Each of these trained before, on a token stream that is not the corpus's (or with boundaries that are not its
    documents'), or left a shard out; now start-up refuses them with the fix."""
    edit, message = HAND_EDITS[case]
    root = tmp_path / "set"
    shutil.copytree(shard_sets[1], root)
    meta = json.loads((root / "meta.json").read_text())
    edit(root, meta)
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=message):  # what build_run does first: meta.json checks, then both splits
        check_sources(DataConfig(path=str(root), seq_len=32))
        open_training_data(DataConfig(path=str(root), seq_len=32), 384, BatchLayout(4, 2, 1, 0), seed=1)


def test_prepare_data_cli_exits_2_on_a_bad_shard(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("prepare_data_tool", ROOT / "tools" / "prepare_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--output", str(tmp_path / "set"), "--finish-shards"]) == 2
    assert "holds no shards" in capsys.readouterr().err
    assert tool.main(["--output", str(tmp_path / "set"), "--shard", "3"]) == 2
    assert "is not I/N" in capsys.readouterr().err
