"""Evaluate an export or a training checkpoint: validation loss, perplexity, and optionally a sample.

    python eval.py runs/tiny/export --data data/stdlib
    python eval.py runs/mix/export --data data/code data/prose --source-weights 0.7 0.3   # per source and weighted
    python eval.py runs/tiny/checkpoints/step_00000300 --data data/stdlib --max-batches 20 --output result.json
    accelerate launch --multi_gpu --num_processes 2 eval.py runs/tiny/export --data data/stdlib --generate "def "
    python eval.py runs/tiny/export --tasks next_line my_task.jsonl --data data/stdlib     # multiple choice, ours
    python eval.py runs/tiny/export --lm-eval next_line hellaswag --data data/stdlib       # through lm-eval's HFLM
    python eval.py s3://bucket/runs/tiny --data s3://bucket/data/stdlib   # object storage: downloaded to ~/.cache first

Prints one JSON line {"loss": ..., "perplexity": ..., "tokens": ..., "document_masking": ...} (plus "prompt" and
"continuation" with --generate, whose text follows on the next lines; with several --data folders, "sources":
each folder's loss, perplexity, tokens and weight). The result is the same on any number of processes. Each token attends only to its own document, as in training with data.document_masking;
--no-document-masking evaluates each window as one stream.

--tasks scores multiple-choice tasks by log-likelihood (lmrecipe/evaluation/tasks.py: JSON-lines task files, or next_line, built
from the validation split of the first --data folder) and adds "tasks": {task: {"acc", "acc_norm", "items", "chance"}},
the same on any number of processes; --data alone adds the loss, as above. --lm-eval runs lm-evaluation-harness
itself on the model (one process): tasks of its registry (downloaded), of --include-path folders, or ours (a .jsonl
task file, next_line), and adds "lm_eval": {task: {metric: value}}.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from lmrecipe.cli import check_tool_output, cli_main, setup_logging
from lmrecipe.errors import fail
from lmrecipe.fileio import write_text_atomic


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="export folder (config.json + safetensors) or training checkpoint folder; or the URL "
                        "of one, or of a run uploaded with checkpoint.remote (s3://..., gs://...)")
    parser.add_argument("--data", nargs="+", metavar="DATA_DIR",
                        help="prepared data folder(s); the val split of each is evaluated. Several folders are a "
                             "mixture: each is reported by its folder name, and the loss is their weighted mean. "
                             "Needed unless --tasks or --lm-eval is given")
    parser.add_argument("--tasks", nargs="+", metavar="TASK", default=[],
                        help="multiple-choice tasks to score: JSON-lines task files ({\"context\", \"choices\", "
                             "\"gold\"} per line) or next_line (built from the first --data folder's val split)")
    parser.add_argument("--lm-eval", nargs="+", metavar="TASK", default=[], dest="lm_eval",
                        help="tasks to run through lm-evaluation-harness: its registry's names, tasks of "
                             "--include-path folders, .jsonl task files or next_line")
    parser.add_argument("--include-path", nargs="+", metavar="DIR", default=[],
                        help="folders of lm-eval task YAML files for --lm-eval")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="--lm-eval: at most N items per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                        help="--lm-eval: few-shot examples per item (default: each task's own)")
    parser.add_argument("--next-line-items", type=int, default=100, metavar="N",
                        help="items of the next_line task (default: %(default)s)")
    parser.add_argument("--task-seed", type=int, default=0, help="seed of the next_line task (default: %(default)s)")
    parser.add_argument("--source-weights", type=float, nargs="+", metavar="W",
                        help="a mixture's weights, one per --data folder, in the same order (default: equal); "
                             "normalised, and a folder of weight 0 is reported but left out of the mean, as in training")
    parser.add_argument("--max-batches", type=int, default=None, metavar="N",
                        help="evaluate at most N batches of --batch-size windows (default: the whole val split)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass and process (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the training seq_len)")
    parser.add_argument("--output", metavar="FILE", help="also write the result JSON to FILE (never into a checkpoint, "
                        "nor over a run's own files)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --output file if it exists")
    parser.add_argument("--generate", metavar="PROMPT", help="sample a continuation of PROMPT")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--weights", choices=("raw", "ema"), default="raw",
                        help="a checkpoint's trained weights or their moving average (train.ema_decay) (default: %(default)s)")
    parser.add_argument("--no-document-masking", dest="document_masking", action="store_false",
                        help="let every token attend to the whole window, across documents (default: each token "
                             "attends only to its own document, as training with data.document_masking does)")
    parser.add_argument("--allow-other-tokenizer", action="store_true",
                        help="evaluate data whose tokenizer.json differs from the model's (refused by default: the "
                             "ids would mean other text, and the loss would be meaningless)")
    args = parser.parse_args(argv)
    if not (args.data or args.tasks or args.lm_eval):
        parser.error("give --data (validation loss), --tasks or --lm-eval")
    if args.generate is not None and not args.data:
        parser.error("--generate runs with the validation loss: give --data too")
    if args.lm_eval and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--lm-eval runs in one process: start eval.py with python, not a multi-process launcher")
    setup_logging()
    check_arguments(args)  # all of it before the evaluation, whose result would otherwise be lost
    if "://" in args.path:  # a checkpoint or export in object storage: downloaded into the cache, then read as today
        from lmrecipe.checkpoint.remote import fetch_remote

        args.path = str(fetch_remote(args.path))
    if any("://" in d for d in args.data or []):  # data folders in object storage: staged as training stages them
        from lmrecipe.config import DataConfig
        from lmrecipe.data.remote import staged_path

        args.data = [staged_path(d, DataConfig.cache_dir, "--data") for d in args.data]
    from lmrecipe.evaluation.evaluate import evaluate_path, evaluate_tasks  # heavy imports only after the arguments parsed

    result, is_main = {}, True
    first_data = args.data[0] if args.data else None
    task_options = dict(batch_size=args.batch_size, weights=args.weights, next_line_items=args.next_line_items,
                        seed=args.task_seed)
    if args.tasks:
        result["tasks"], is_main = evaluate_tasks(args.path, args.tasks, first_data, **task_options)
    if args.data:
        loss, is_main = evaluate_path(
            args.path, args.data, max_batches=args.max_batches, batch_size=args.batch_size, seq_len=args.seq_len,
            generate=args.generate, max_new_tokens=args.max_new_tokens, seed=args.seed, weights=args.weights,
            document_masking=args.document_masking, allow_other_tokenizer=args.allow_other_tokenizer,
            source_weights=args.source_weights,
        )
        result = {**loss, **result}
    if args.lm_eval and is_main:
        from lmrecipe.evaluation.lm_eval import run_lm_eval

        result["lm_eval"] = run_lm_eval(args.path, args.lm_eval, first_data, args.include_path, limit=args.limit,
                                        num_fewshot=args.num_fewshot, **task_options)
    if is_main:
        print(json.dumps(result), flush=True)
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
        if "continuation" in result:
            print(result["prompt"] + result["continuation"], flush=True)
    return 0


def check_arguments(args) -> None:
    """UserError for every number out of range, every task that cannot be read and an --output that cannot be written
    safely, before any work (a wrong --limit would otherwise stop the run after the loss computation)."""
    for name in ("batch_size", "max_batches", "seq_len", "max_new_tokens", "next_line_items"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise fail(f"--{name.replace('_', '-')}={value} must be positive.")
    from lmrecipe.evaluation.lm_eval import check_lm_eval_arguments
    from lmrecipe.evaluation.tasks import NEXT_LINE, resolve_tasks

    resolve_tasks([spec for spec in args.tasks if spec != NEXT_LINE], None, 1, 0)
    if args.lm_eval:
        check_lm_eval_arguments(args.lm_eval, args.include_path, args.limit, args.num_fewshot)
    if args.output:
        reads = [args.path, *(args.data or []), *args.tasks, *args.lm_eval, *args.include_path]
        check_tool_output(args.output, "--output", folder=False, overwrite=args.overwrite,
                          reads=[r for r in reads if os.path.exists(r)])


if __name__ == "__main__":
    sys.exit(main())
