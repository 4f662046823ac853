"""Public benchmarks through lm-evaluation-harness (``lm-eval``) itself, on an export or a training checkpoint.

The model and tokenizer are loaded as ``eval.py`` loads them (:func:`lmrecipe.export.load_for_inference`) and handed
to lm-eval's ``HFLM``. Task names come from lm-eval's registry (their datasets are downloaded, so that needs the
network), from task folders given as include paths (lm-eval's YAML task configurations), or are this project's own
tasks: a JSON-lines task file or ``next_line`` (``lmrecipe/evaluation/tasks.py``), which are written with an lm-eval
configuration into a temporary folder so that lm-eval scores exactly the items our scorer does.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Sequence

import yaml

from lmrecipe.errors import EXIT_FAILURE, fail
from lmrecipe.export import load_for_inference
from lmrecipe.fileio import write_text_atomic
from lmrecipe.evaluation.tasks import NEXT_LINE, Task, lm_eval_task_config, resolve_tasks, write_task_file

logger = logging.getLogger(__name__)


def is_own_task(spec: str) -> bool:
    """A spec this project scores itself (``next_line``, a ``.jsonl`` task file), not an lm-eval task name."""
    return spec == NEXT_LINE or spec.endswith(".jsonl")


def check_lm_eval_arguments(specs: Sequence[str], include_paths: Sequence[str] = (), limit: int | None = None,
                            num_fewshot: int | None = None) -> None:
    """UserError, before any model is loaded, for what lm-eval would refuse only after the work before it: a
    ``limit`` below 1, a negative ``num_fewshot``, an include path that is not a folder, a task spec that is a folder,
    a task file that is missing or holds a bad item."""
    if limit is not None and limit < 1:
        raise fail(f"--limit {limit}: give the number of items to score per task, 1 or more (leave --limit out to "
                   "score them all).")
    if num_fewshot is not None and num_fewshot < 0:
        raise fail(f"--num-fewshot {num_fewshot}: give the number of solved examples before each item, 0 or more "
                   "(leave --num-fewshot out for each task's own).")
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise fail(f"--include-path {folder} is not a folder: give a folder of lm-eval task YAML files.")
    for spec in specs:
        if not is_own_task(spec) and Path(spec).is_dir():
            raise fail(f"--lm-eval {spec} is a folder, not a task: pass the folder with --include-path {spec} and its "
                       "tasks' names to --lm-eval, or give .jsonl task files, next_line or lm-eval registry names.")
    resolve_tasks([s for s in specs if is_own_task(s) and s != NEXT_LINE], None, 1, 0)  # task files are read now


def write_lm_eval_folder(tasks: Sequence[Task], folder: Path) -> list[str]:
    """Each task as ``<name>.jsonl`` plus the ``<name>.yaml`` lm-eval reads it with; returns the task names."""
    for task in tasks:
        data = write_task_file(task, folder / f"{task.name}.jsonl")
        config = lm_eval_task_config(task.name, data, folder / "datasets_cache")
        write_text_atomic(folder / f"{task.name}.yaml", yaml.safe_dump(config, sort_keys=False))
    return [task.name for task in tasks]


def run_lm_eval(path: str | Path, specs: Sequence[str], data_dir: str | Path | None = None,
                include_paths: Sequence[str] = (), batch_size: int = 8, weights: str = "raw",
                next_line_items: int = 100, seed: int = 0, limit: int | None = None,
                num_fewshot: int | None = None) -> dict:
    """lm-eval's results for ``specs`` on ``path`` (export folder or training checkpoint): ``{task: {metric:
    value}}``, metrics as lm-eval names them without its ``,none`` filter suffix. One process."""
    check_lm_eval_arguments(specs, include_paths, limit, num_fewshot)
    model, tokenizer, _ = load_for_inference(path, weights=weights)
    own = resolve_tasks([s for s in specs if is_own_task(s)], data_dir, next_line_items, seed,
                        model.config.max_position_embeddings)
    output = lm_eval_results(model, tokenizer, [s for s in specs if not is_own_task(s)], own, include_paths,
                             batch_size=batch_size, limit=limit, num_fewshot=num_fewshot)
    return {name: {key.removesuffix(",none"): value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not key.endswith("_stderr,none")}
            for name, metrics in output["results"].items()}


def lm_eval_results(model, tokenizer, names: Sequence[str], own: Sequence[Task] = (), include_paths: Sequence[str] = (),
                    batch_size: int = 8, limit: int | None = None, num_fewshot: int | None = None,
                    log_samples: bool = False) -> dict:
    """``lm_eval.simple_evaluate``'s output for ``model`` (through ``HFLM``) on the lm-eval tasks ``names`` and our
    tasks ``own`` (each written with its lm-eval configuration to a temporary folder)."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise fail("--lm-eval needs lm-evaluation-harness: pip install 'lm-eval==0.4.13' (the test extra installs "
                   "it: pip install -e '.[test]').") from None
    with tempfile.TemporaryDirectory(prefix="lmrecipe-lm-eval-") as tmp:
        own_names = write_lm_eval_folder(own, Path(tmp))
        # The registry is indexed only when a task outside our own is asked for (indexing it takes seconds).
        manager = TaskManager(include_path=[tmp, *map(str, include_paths)], include_defaults=bool(names))
        unknown = [name for name in names if name not in manager.all_tasks and name not in manager.all_groups]
        if unknown:
            raise fail(f"lm-eval knows no task {', '.join(unknown)}: name a task of its registry (lm-eval ls tasks), "
                       "a folder of task YAML files with --include-path, a .jsonl task file, or next_line.")
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        try:
            return simple_evaluate(lm, tasks=[*names, *own_names], task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=log_samples)
        except ConnectionError as err:  # a registry task's dataset, offline
            raise fail(f"lm-eval could not fetch a task's dataset: {err}. Registry tasks download their data from the "
                       "Hugging Face Hub: run with network access (or a filled datasets cache); .jsonl task files, "
                       "next_line and --include-path tasks on local files need none.", exit_code=EXIT_FAILURE) from None
