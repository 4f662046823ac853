"""train.py's own flags, run in this process: --print-config, --list-keys, --dry-run, --help, and the message for
Hugging Face style options (``--max_steps 10``)."""

from __future__ import annotations


import pytest
import yaml
from helpers import ROOT, script_main, tree_digest, write_data

from lmrecipe.config import load_config, save_config

RECIPE = str(ROOT / "recipes" / "tiny.yaml")


@pytest.fixture(scope="module")
def train_main():
    return script_main("train.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A folder of 4,001 training and 801 validation tokens (vocabulary 384): 31 windows of data.seq_len=128."""
    return write_data(tmp_path_factory.mktemp("cli") / "data", vocab=384)


def run(train_main, capsys, *argv: str) -> tuple[int, str, str]:
    code = train_main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_print_config_prints_what_the_run_folder_would_hold(train_main, capsys, tmp_path):
    code, out, _ = run(train_main, capsys, "--print-config", RECIPE, "train.max_steps=7", "optim.lr=1e-3")
    cfg = load_config(RECIPE, ["train.max_steps=7", "optim.lr=1e-3"])
    save_config(cfg, tmp_path / "config.yaml")
    assert code == 0 and out == (tmp_path / "config.yaml").read_text()
    assert yaml.safe_load(out)["train"]["max_steps"] == 7


def test_list_keys_groups_by_section_with_defaults(train_main, capsys):
    code, out, _ = run(train_main, capsys, "--list-keys")
    assert code == 0 and out.index("top-level keys:") < out.index("model: ") < out.index("profile: ")
    assert "  optim.lr=0.0003" in out and "Peak learning rate (after warmup)." in out
    code, out, _ = run(train_main, capsys, "--list-keys", "schedule")
    assert code == 0 and out.startswith("schedule: ") and "schedule.warmup_steps=100" in out and "  optim.lr=" not in out


def test_list_keys_of_an_unknown_section_names_the_sections(train_main, capsys):
    code, out, err = run(train_main, capsys, "--list-keys", "optimizer")
    assert code == 2 and out == ""
    assert "no section 'optimizer'" in err and "Did you mean optim?" in err and "model, data, optim," in err


def test_help_lists_the_sections_and_where_the_keys_are(train_main, capsys):
    code, out, _ = run(train_main, capsys, "--help")
    assert code == 0
    for text in ("--print-config", "--dry-run", "--list-keys [SECTION]", "docs/reference/keys.md",
                 "model, data, optim, schedule, train, eval"):
        assert text in out


@pytest.mark.parametrize("argv, expected", [
    (["--max_steps", "10"], "Did you mean train.max_steps=10? Write it after the recipe: python train.py RECIPE "
                            "train.max_steps=10."),
    (["--max-steps=10"], "Did you mean train.max_steps=10?"),
    (["--lr", "3e-4"], "Did you mean optim.lr=3e-4?"),
    (["--learning_rate", "3e-4"], "Did you mean optim.lr=3e-4?"),
    (["--seed", "1"], "It matches several keys: train.seed=1 or eval.seed=1"),
    (["--gradient-checkpointing"], "Did you mean train.gradient_checkpointing=true?"),
    (["--frobnicate", "2"], "No key is named 'frobnicate'; train.py --list-keys lists the keys"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_hugging_face_style_options_are_spelled_as_overrides(train_main, capsys, argv, expected):
    code, out, err = run(train_main, capsys, RECIPE, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "is not an option of train.py" in err  # one paragraph
    assert expected.replace("RECIPE", RECIPE) in err


def test_every_stray_option_is_reported_at_once(train_main, capsys):
    code, _, err = run(train_main, capsys, RECIPE, "--max_steps", "10", "train.micro_batch_size=4", "--lr=1e-3")
    assert code == 2 and err.startswith("error: 2 options that train.py does not take")
    assert "'--max_steps 10': did you mean train.max_steps=10?" in err and "'--lr=1e-3': did you mean optim.lr=1e-3?" in err


def test_dry_run_of_a_good_recipe_prints_the_start_up_line_and_writes_nothing(train_main, capsys, data, tmp_path,
                                                                           monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = tree_digest(data)
    out_dir = tmp_path / "run"
    code, out, _ = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={out_dir}")
    assert code == 0, out
    assert (f"start-up line: model 0.95M params | 1 processes x micro-batch 8 x accumulation 2 = 16 sequences of 128 "
            "tokens | precision fp32 | no DeepSpeed") in out
    assert f"data {data}: 31 training windows and 6 validation windows of 128 tokens" in out
    assert "fewer than data.val_windows=64" in out and "memory per rank (estimate" in out
    assert out.rstrip().endswith("dry run: no problem found; nothing was trained or written")
    assert not out_dir.exists() and tree_digest(data) == before


def test_dry_run_reports_every_problem_at_once(train_main, capsys, data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    (tmp_path / "taken").write_text("a file")
    code, out, err = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={tmp_path / 'taken'}",
                         "data.seq_len=8192", "model.attn_implementation=flash_attention_3")
    assert code == 2 and "dry run: 4 problem(s)" in out
    assert err.startswith("error: 4 problems found by the dry run")
    for problem in ("out_dir", "train.global_batch_size=16 is not a multiple of train.micro_batch_size=8 x 3 processes",
                    "flash_attention_3 needs a CUDA GPU", "data.seq_len=8192 is longer than the train split"):
        assert problem in err


def test_dry_run_reads_the_deepspeed_config(train_main, capsys, data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 2},')
    code, _, err = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={tmp_path / 'run'}",
                       f"distributed.deepspeed_config={broken}")
    assert code == 2 and "is not valid JSON" in err
    code, out, _ = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={tmp_path / 'run'}",
                       "distributed.deepspeed_config=zero3")
    assert code == 0 and "2 processes x micro-batch 8 x accumulation 1" in out and "DeepSpeed ZeRO-3" in out
    assert "ZeRO-3 gathered" in out and not (tmp_path / "run").exists()


def test_dry_run_of_a_missing_data_folder_says_how_to_make_it(train_main, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _, err = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={tmp_path / 'none'}",
                       f"out_dir={tmp_path / 'run'}")
    assert code == 2 and "does not exist" in err
    # the hint names the corpus and the tokenizer: a bare --output would prepare the embedded demo corpus there
    assert f"tools/prepare_data.py --input CORPUS --tokenizer TOKENIZER --output {tmp_path / 'none'}`" in err
    assert "Without --input it prepares the embedded demo corpus" in err


def test_dry_run_of_a_model_vocabulary_beyond_the_datas_tokenizer_is_a_problem(train_main, capsys, data, tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={tmp_path / 'run'}",
                         "model.vocab_size=128256")
    assert code == 2 and "dry run: 1 problem(s)" in out
    assert "model.vocab_size=128,256 but" in err and "model.vocab_size=null" in err and "Traceback" not in err


def test_list_keys_lists_every_section_named_after_it(train_main, capsys):
    code, out, _ = run(train_main, capsys, "--list-keys", "schedule", "train")
    assert code == 0 and out.startswith("schedule: ") and out.index("schedule.warmup_steps=") < out.index("\ntrain: ")
    assert "  train.max_steps=" in out and "  optim.lr=" not in out
    code, out, err = run(train_main, capsys, "--list-keys", "schedule", "trian")
    assert code == 2 and out == "" and "no section 'trian'" in err and "Did you mean train?" in err


def test_dry_run_with_print_config_prints_the_config_then_the_dry_runs_report(train_main, capsys, data, tmp_path,
                                                                            monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out_dir = tmp_path / "run"
    code, out, _ = run(train_main, capsys, "--dry-run", "--print-config", RECIPE, f"data.path={data}",
                       f"out_dir={out_dir}")
    assert code == 0 and out.startswith(f"out_dir: {out_dir}\n") and "start-up line:" in out
    assert out.rstrip().endswith("dry run: no problem found; nothing was trained or written")
    assert out.index("  max_steps: ") < out.index("start-up line:")  # the configuration, then the report
    assert not out_dir.exists()


def test_an_out_dir_this_user_cannot_write_is_a_problem_for_the_dry_run_and_the_run(train_main, capsys, data,
                                                                                  tmp_path, monkeypatch):
    import os
    import stat

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # Permissions as any user but root sees them (root may write anywhere but on a read-only file system).
    monkeypatch.setattr(os, "access", lambda path, mode: bool(os.stat(path).st_mode & stat.S_IWUSR))
    readonly = tmp_path / "readonly"
    (readonly / "old_run").mkdir(parents=True)
    readonly.chmod(0o555)
    (readonly / "old_run").chmod(0o555)
    try:
        for out_dir, where in ((readonly / "new_run", f" ({readonly}, where it would be created)"),
                               (readonly / "old_run", "")):
            code, out, err = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={out_dir}")
            assert code == 2 and "dry run: 1 problem(s)" in out
            assert f"out_dir {out_dir} cannot be written{where}: that folder is read-only for this user" in err
            code, out, err = run(train_main, capsys, RECIPE, f"data.path={data}", f"out_dir={out_dir}")
            assert code == 2 and err.startswith(f"error: out_dir {out_dir} cannot be written")
        assert sorted(p.name for p in readonly.iterdir()) == ["old_run"] and not any((readonly / "old_run").iterdir())
    finally:
        readonly.chmod(0o755)


@pytest.mark.parametrize("world_size", ["two", "0", "-1"])
def test_a_world_size_that_is_no_number_of_processes_is_named(train_main, capsys, data, tmp_path, monkeypatch,
                                                              world_size):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    out_dir = tmp_path / "run"
    for flags in (["--dry-run"], []):
        code, out, err = run(train_main, capsys, *flags, RECIPE, f"data.path={data}", f"out_dir={out_dir}")
        assert code == 2 and f"WORLD_SIZE='{world_size}' is not a number of processes" in err
        assert "Unset it for one process" in err and not out_dir.exists()
    assert "dry run: 1 problem(s)" in run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}",
                                          f"out_dir={out_dir}")[1]


def test_dry_run_notes_a_stage_and_a_ramp_point_past_the_last_step(train_main, capsys, data, tmp_path, monkeypatch):
    """Valid (a short run of a long recipe), but neither ever takes effect: each note names the key, its step and
    train.max_steps."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, _ = run(train_main, capsys, "--dry-run", RECIPE, f"out_dir={tmp_path / 'run'}", "train.max_steps=5",
                       f"data.sources=[{{path: {data}, name: a}}, {{path: {data}, name: b}}]",
                       "data.stages=[{start_step: 0, weights: {a: 1}}, {start_step: 5, weights: {b: 1}}]",
                       "train.batch_ramp=[{step: 0, size: 8}, {step: 4, size: 16}]")
    assert code == 0, out
    assert ("note: data.stages[1] (start_step 5) starts at or after train.max_steps=5 (the last optimizer step is 4), "
            "so it never takes effect") in out
    assert "train.batch_ramp" not in out  # step 4 is the last step: the point is reached
    code, out, _ = run(train_main, capsys, "--dry-run", RECIPE, f"data.path={data}", f"out_dir={tmp_path / 'run'}",
                       "train.max_steps=4", "train.batch_ramp=[{step: 0, size: 8}, {step: 4, size: 16}]")
    assert code == 0 and ("note: train.batch_ramp[1] (step 4, size 16) starts at or after train.max_steps=4 (the last "
                          "optimizer step is 3), so it never takes effect: the run ends at 8 sequences per step") in out
