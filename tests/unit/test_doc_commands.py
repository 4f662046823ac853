"""The documentation's fenced blocks as tests/integration/test_doc_commands.py reads them: blocks, tags and the dry run
of a GPU block's training commands, on a made-up page."""

from __future__ import annotations

from doc_commands import Block, fenced_blocks, logical_lines, pages_to_run, tag_problems, train_dry_runs

PAGE = '''# A page

```bash title="CPU"
python train.py recipes/tiny.yaml out_dir=runs/a   # two steps under the test's cap
```

- A list item:

  ```bash
  python eval.py runs/a/export
  ```

```yaml
train:
  max_steps: 10
```

```text
step 1/2 | loss 9.05
```

```console title="GPU" title="CPU"
nvidia-smi
```

```sh title="TPU"
ls
```

```shell title="S3"
aws s3 ls
```
'''

GPU_BLOCK = '''COMMON="data.path=data/mine model.hidden_size=256"
export WANDB_MODE=offline
LMRECIPE_X=1 accelerate launch --multi_gpu --num_processes 8 train.py recipes/llama_1b.yaml $COMMON \\
    out_dir=runs/z   # eight GPUs
nvidia-smi && accelerate launch --num_processes=2 train.py recipes/tiny.yaml 'a=[x, y]' | tee log
python tools/estimate_memory.py recipes/llama_1b.yaml
'''


def test_blocks_are_read_with_their_line_language_tags_and_text():
    blocks = fenced_blocks(PAGE, "docs/page.md")
    assert [(b.line, b.language, b.titles) for b in blocks] == [
        (3, "bash", ("CPU",)), (9, "bash", ()), (13, "yaml", ()), (18, "text", ()), (22, "console", ("GPU", "CPU")),
        (26, "sh", ("TPU",)), (30, "shell", ("S3",))]
    assert blocks[0].text == "python train.py recipes/tiny.yaml out_dir=runs/a   # two steps under the test's cap\n"
    assert blocks[1].text == "python eval.py runs/a/export\n"  # the list item's indent removed
    assert [b.tag for b in blocks] == ["CPU", None, None, None, None, None, "S3"]


def test_a_command_block_without_exactly_one_known_tag_is_named_by_page_and_line():
    problems = tag_problems(fenced_blocks(PAGE, "docs/page.md"))
    assert [p.split(":", 2)[:2] for p in problems] == [["docs/page.md", "9"], ["docs/page.md", "22"],
                                                       ["docs/page.md", "26"]]
    assert "has no tag" in problems[0] and "(python eval.py runs/a/export)" in problems[0]
    assert "has 2 tags (GPU, CPU)" in problems[1]
    assert "the unknown tag 'TPU'" in problems[2] and 'title="CPU"' in problems[2]


def test_continued_lines_are_one_command():
    assert logical_lines("a \\\n  b \\\n    c\nd\n") == ["a b c", "d"]


def test_the_training_commands_of_a_gpu_block_become_dry_runs_with_the_launchers_world_size():
    assert train_dry_runs(GPU_BLOCK) == [
        'COMMON="data.path=data/mine model.hidden_size=256"',
        "export WANDB_MODE=offline",
        "LMRECIPE_X=1 WORLD_SIZE=8 python train.py recipes/llama_1b.yaml $COMMON out_dir=runs/z --dry-run",
        "WORLD_SIZE=2 python train.py recipes/tiny.yaml 'a=[x, y]' --dry-run",
    ]
    assert train_dry_runs("python tools/plan.py --budget 1\nA=1\n") == []  # nothing trains: bash -n alone


def test_a_slurm_job_of_train_sbatch_becomes_the_dry_run_of_its_recipe_on_its_nodes_processes():
    block = ("PYTHON=$PWD/.venv/bin/python sbatch --nodes=4 --gpus-per-node=8 --time=24:00:00 \\\n"
             "    slurm/train.sbatch recipes/llama_1b.yaml out_dir=runs/llama_1b   # one process per GPU\n"
             "JOBID=$(sbatch --parsable -N 3 --exclusive slurm/train.sbatch recipes/tiny.yaml out_dir=runs/t)\n"
             "scancel --signal=USR1 --batch \"$JOBID\"\n")
    assert train_dry_runs(block) == [
        "PYTHON=$PWD/.venv/bin/python WORLD_SIZE=32 LOCAL_WORLD_SIZE=8 python train.py recipes/llama_1b.yaml "
        "out_dir=runs/llama_1b --dry-run",
        "WORLD_SIZE=3 LOCAL_WORLD_SIZE=1 python train.py recipes/tiny.yaml out_dir=runs/t --dry-run",
    ]


def test_a_page_runs_its_blocks_in_order_less_the_last_ones_an_earlier_page_ran():
    def block(page: str, text: str) -> Block:
        return Block(page, 1, "bash", ("CPU",), text)

    a1, a2 = block("README.md", "make-data\n"), block("README.md", "train\n")
    b1, b2, b3 = block("docs/b.md", "make-data\n"), block("docs/b.md", "evaluate\n"), block("docs/b.md", "train\n")
    c1 = block("docs/c.md", "train\n")
    # b1 stays (b2 may read what it writes), b3 goes (README ran it, nothing after it); c.md has nothing new
    assert pages_to_run([a1, a2, b1, b2, b3, c1]) == {"README.md": [a1, a2], "docs/b.md": [b1, b2]}
    # The same command with its overrides in another order, over two lines, with a comment: run once
    d1 = block("docs/d.md", "train.py recipe a=1 \\\n    b=2   # the tiny run\n")
    e1 = block("docs/e.md", "train.py recipe b=2 a=1\n")
    e2 = block("docs/e.md", "train.py recipe b=2 a=3\n")
    assert pages_to_run([d1, e1]) == {"docs/d.md": [d1]}
    assert pages_to_run([d1, e2]) == {"docs/d.md": [d1], "docs/e.md": [e2]}
