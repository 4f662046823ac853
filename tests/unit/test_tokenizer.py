"""One tokenizer check (``lmrecipe/data/tokenizer.py``) wherever ids meet weights or other ids: ``model.init_from``
and ``eval.py`` against the data, a shard against its set. Another vocabulary of the same size is refused before
anything runs; the same tokenizer saved in other bytes by another ``tokenizers`` version is accepted."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES

from lmrecipe.config import ModelConfig, load_config
from lmrecipe.data.format import combine_splits, load_meta
from lmrecipe.data.prepare.pipeline import prepare
from lmrecipe.errors import UserError
from lmrecipe.model.build import check_init_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(source: Path, folder: Path, edit=None) -> Path:
    """``source``'s tokenizer files in ``folder``; ``edit(tokenizer_json)`` changes the tokenizer before it is saved."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    if edit is not None:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        edit(tokenizer)
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def swap_two_tokens(tokenizer: dict) -> None:
    """Another tokenizer of the same vocabulary size: two ordinary tokens trade ids."""
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: token for token, i in vocab.items()}
    vocab[by_id[100]], vocab[by_id[101]] = 101, 100


@pytest.fixture(scope="module")
def swapped(tmp_path_factory, tiny_data) -> Path:
    return copy_tokenizer(tiny_data, tmp_path_factory.mktemp("swapped") / "tokenizer", swap_two_tokens)


@pytest.fixture(scope="module")
def other_data(tmp_path_factory, corpus_dir, swapped) -> Path:
    """Part of tiny_data's corpus prepared with the swapped tokenizer: same vocabulary size, EOS and dtype."""
    out = tmp_path_factory.mktemp("other") / "data"
    prepare(output=out, inputs=sorted(corpus_dir.iterdir())[:10], tokenizer=str(swapped), val_fraction=0.2,
            num_proc=1)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_data) -> Path:
    """A Hugging Face model folder with tiny_data's tokenizer (what an export of a run on tiny_data holds)."""
    from transformers import AutoModelForCausalLM

    from lmrecipe.model.build import build_hf_config

    folder = copy_tokenizer(tiny_data, tmp_path_factory.mktemp("model") / "export")
    cfg = load_config("recipes/tiny.yaml", TINY_OVERRIDES)
    AutoModelForCausalLM.from_config(build_hf_config(cfg.model, 384, cfg.data.seq_len)).save_pretrained(folder)
    return folder


def test_init_from_a_model_of_another_tokenizer_of_the_same_vocabulary_size_is_refused_before_training(
        tmp_path, model_dir, other_data, swapped, tiny_data):
    from lmrecipe.train.trainer import train

    assert {k: load_meta(other_data)[k] for k in ("vocab_size", "eos_id", "dtype")} == \
        {k: load_meta(tiny_data)[k] for k in ("vocab_size", "eos_id", "dtype")}
    out = tmp_path / "run"
    cfg = load_config("recipes/tiny.yaml", [f"out_dir={out}", f"data.path={other_data}", f"model.init_from={model_dir}",
                                            *TINY_OVERRIDES])
    with pytest.raises(UserError) as err:
        train(cfg)
    message = str(err.value)
    assert f"model.init_from={model_dir} was trained with another tokenizer than the one {other_data} (tokenizer " \
           f"{swapped}) was prepared with" in message
    assert "2 ids that both define name other tokens" in message
    assert f"--tokenizer {model_dir} --output NEW_DATA" in message and "model.init_from=null" in message
    assert not out.exists()  # refused before the run folder was made


def test_eval_refuses_the_same_pairing_and_allows_it_when_asked(model_dir, other_data, tiny_data, caplog):
    from lmrecipe.evaluation.evaluate import evaluate_path

    with pytest.raises(UserError, match=r"prepared with another tokenizer than the model's, .*export \(tokenizer.json "
                                         r"sha256 .* 2 ids that both define name other tokens\).*--allow-other-tokenizer"):
        evaluate_path(model_dir, other_data, max_batches=1)
    with caplog.at_level(logging.WARNING):
        result, _ = evaluate_path(model_dir, other_data, max_batches=1, allow_other_tokenizer=True)
    assert result["tokens"] > 0 and "allowed: the results mean something only if" in caplog.text
    evaluate_path(model_dir, tiny_data, max_batches=1)  # its own tokenizer


def test_a_model_folder_holding_its_tokenizer_in_other_bytes_is_the_same_tokenizer(tmp_path, tiny_data, swapped):
    """A tokenizer.json as older tokenizers versions wrote it (merges as strings, one line, no ignore_merges): what a
    downloaded model holds, while data prepared with --tokenizer MODEL holds it re-saved."""
    def as_published(tokenizer: dict) -> None:
        tokenizer["model"]["merges"] = [" ".join(pair) for pair in tokenizer["model"]["merges"]]
        del tokenizer["model"]["ignore_merges"]

    published = copy_tokenizer(tiny_data, tmp_path / "published", as_published)
    assert (published / "tokenizer.json").read_bytes() != (tiny_data / "tokenizer.json").read_bytes()
    check_init_tokenizer(ModelConfig(init_from=str(published)), tiny_data)
    check_init_tokenizer(ModelConfig(init_from=None), tiny_data)
    published_swapped = copy_tokenizer(swapped, tmp_path / "published_swapped", as_published)
    with pytest.raises(UserError, match="2 ids that both define name other tokens"):
        check_init_tokenizer(ModelConfig(init_from=str(published_swapped)), tiny_data)


def test_a_shard_prepared_again_with_another_tokenizer_and_its_entry_edited_is_refused(tmp_path, tiny_shards,
                                                                                          corpus_dir, swapped):
    shards = tmp_path / "set"
    shutil.copytree(tiny_shards, shards)
    with pytest.raises(UserError, match="not prepared alike"):  # the shard is written; the set's meta.json stays
        prepare(output=shards, inputs=[corpus_dir], tokenizer=str(swapped), val_fraction=0.1, num_proc=1,
                shard=(1, 3), overwrite=True)
    meta = json.loads((shards / "meta.json").read_text())
    shard = json.loads((shards / "shard-00001-of-00003" / "meta.json").read_text())
    meta["shards"][1]["splits"] = {s: {k: shard["splits"][s][k] for k in meta["shards"][1]["splits"][s]}
                                   for s in ("train", "val")}
    meta["splits"] = {s: combine_splits([e["splits"][s] for e in meta["shards"]]) for s in ("train", "val")}
    (shards / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as err:
        load_meta(shards)
    message = str(err.value)
    assert f"Shard {shards / 'shard-00001-of-00003'} was prepared with another tokenizer ({swapped}) than the shard " \
           f"set {shards} records (" in message
    assert "tokenizer.json sha256" in message and f"--tokenizer {shards} --output {shards} --shard 1/3 --overwrite" \
        in message


def test_a_shard_sets_tokenizer_replaced_after_it_was_finished_is_refused(tmp_path, tiny_shards, swapped):
    shards = tmp_path / "set"
    shutil.copytree(tiny_shards, shards)
    shutil.copy(swapped / "tokenizer.json", shards / "tokenizer.json")
    with pytest.raises(UserError, match=r"tokenizer.json is not the tokenizer .*meta.json records .*--finish-shards"):
        load_meta(shards)
