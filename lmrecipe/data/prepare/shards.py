"""Sharded preparation: where shard i of N goes, when a shard is already done, and the set's ``meta.json``.

``tools/prepare_data.py --shard i/N --output SET`` writes ``SET/shard-0000i-of-0000N/``, a complete prepared folder
of the files :func:`lmrecipe.data.prepare.read.assign_files` gives shard i, with a tokenizer every shard is given
(``--tokenizer``). Its ``meta.json`` carries ``shard``: the index, the count, its run of files, the sha256 of the
corpus's file listing and the arguments that shape the tokens; a shard already written with the same ``shard``
record is kept (a requeued or re-submitted task does no work twice). :func:`finish_shards` writes ``SET/meta.json``
once all N shards exist and agree (same listing, arguments, tokenizer): the sums of their splits, and ``shards``,
listing each shard with its splits' counts, largest ids and sha256 (``lmrecipe/data/format.py`` reads it). Every
shard calls it when done, so the last one to finish writes it; the file is a pure function of the shards, so two
shards that finish at the same moment write the same bytes.

What the set guarantees: its train and val token streams (the shards' splits laid end to end in index order) are
the streams one preparation of the same files with the same tokenizer, ``--val-fraction`` and ``--seed`` writes, for
any N. So are the windows cut from them and the sample order over them (it depends only on the number of windows).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from lmrecipe.data.format import (
    FORMAT_VERSION,
    SHARD_NAME,
    SPLITS,
    combine_splits,
    load_meta,
    read_meta_file,
    shard_differences,
    shard_name,
)
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import atomic_path, write_json_atomic

logger = logging.getLogger(__name__)

_SHARD_ARGS = ("tokenizer", "text_field", "val_fraction", "seed")
"""Arguments that shape a shard's tokens: every shard of a set must share them (``meta.json`` ``shard.args``)."""
_NOT_TOKENIZER = {"meta.json", "train.bin", "val.bin", "train.idx", "val.idx"}


def check_shard_request(shard: tuple[int, int], tokenizer: str | None, max_documents: int | None) -> None:
    index, count = shard
    if not (count >= 1 and 0 <= index < count and count < 10**5):
        raise fail(f"--shard {index}/{count}: the index must be in [0, N) and N in [1, 99999]; e.g. --shard 0/8 ... "
                   "--shard 7/8 (a SLURM array --array=0-7 numbers its tasks so).")
    if tokenizer is None:
        raise fail("--shard needs --tokenizer: every shard must encode with one tokenizer, and a BPE trained per shard "
                   "would differ. Train one first on a part of the corpus (`python tools/prepare_data.py --input "
                   "CORPUS --max-documents 100000 --output data/tokenizer`), then pass --tokenizer data/tokenizer "
                   "to every shard.")
    if max_documents is not None:
        raise fail("--max-documents counts documents from the start of the whole corpus, which a shard does not "
                   "read: leave it out with --shard (pass fewer --input files instead).")


def shard_args(tokenizer: str, text_field: str, val_fraction: float, seed: int) -> dict[str, Any]:
    return dict(zip(_SHARD_ARGS, (tokenizer, text_field, val_fraction, seed)))


def check_set_folder(root: Path, count: int) -> None:
    """UserError if ``root`` cannot hold shards of an N=``count`` preparation: a file, a plain prepared folder, or a
    set of another shard count."""
    if root.exists() and not root.is_dir():
        raise fail(f"--output {root} is a file; a sharded preparation writes a folder of shards there. Choose another "
                   "--output.")
    meta_file = root / "meta.json"
    if meta_file.is_file() and "shards" not in read_meta_file(root):
        raise fail(f"--output {root} is a prepared data folder, not a shard set: choose another --output for the "
                   "shards (or delete it).")
    other = sorted({n for _, n, _ in _entries(root) if n != count})
    if other:
        raise fail(f"{root} holds shards of a preparation into {', '.join(map(str, other))} shards, and this is shard "
                   f"of {count}. Give the count of the existing set (under SLURM: LMRECIPE_SHARDS=N sbatch "
                   "--array=... slurm/prepare.sbatch ..., since re-running a few array tasks changes "
                   "SLURM_ARRAY_TASK_COUNT), or delete the other shards, or choose another --output.")


def finished_shard(folder: Path, plan: dict, args: dict) -> dict | None:
    """The ``meta.json`` of ``folder`` if it is this shard already written with the same plan and arguments; None if
    absent; UserError if it is another preparation (``--overwrite`` replaces it)."""
    if not (folder / "meta.json").is_file():
        return None
    try:
        meta = load_meta(folder)
    except UserError:
        return None  # a damaged shard is written again
    recorded = meta.get("shard", {})
    if recorded.get("plan") == plan and recorded.get("args") == args:
        return meta
    differ = [k for k in sorted(set(plan) | set(args))
              if {**recorded.get("plan", {}), **recorded.get("args", {})}.get(k) != {**plan, **args}.get(k)]
    raise fail(f"{folder} exists from another preparation (it differs in {', '.join(differ)}: the corpus's files, the "
               "shard count or the arguments changed). Pass --overwrite to replace it, or choose another --output.")


def _entries(root: Path) -> list[tuple[int, int, Path]]:
    """(index, count, path) of every shard folder in ``root``, finished or not (``.tmp-<pid>``)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = SHARD_NAME.fullmatch(re.sub(r"\.tmp-\d+$", "", path.name))
        if match and path.is_dir():
            found.append((int(match.group(1)), int(match.group(2)), path))
    return sorted(found, key=lambda e: (e[1], e[0], e[2].name))


def finish_shards(root: str | Path, required: bool = True) -> dict | None:
    """Write ``root/meta.json`` for a complete, consistent shard set; return it.

    With ``required`` False (a shard that just finished) a set still missing shards is left as it is (None);
    otherwise that, and every inconsistency, is a UserError that names the shards and the fix.
    """
    root = Path(root)
    entries = _entries(root)
    if not entries:
        raise fail(f"{root} holds no shards (folders named shard-00000-of-0000N). Prepare them with "
                   f"`python tools/prepare_data.py --input CORPUS --tokenizer TOKENIZER --output {root} --shard i/N`, "
                   "or under SLURM with slurm/prepare.sbatch.")
    counts = sorted({n for _, n, _ in entries})
    if len(counts) > 1:
        raise fail(f"{root} mixes shards of {' and '.join(map(str, counts))}-shard preparations. Delete the folders "
                   "of the one you do not want, then run the command again.")
    count = counts[0]
    done = {i: p for i, _, p in entries if p.name == shard_name(i, count)}
    missing = [i for i in range(count) if i not in done]
    if missing:
        if not required:
            logger.info("%d of %d shards are written in %s; the last shard to finish writes its meta.json", len(done),
                        count, root)
            return None
        running = sorted(p.name for i, _, p in entries if i in missing)
        raise fail(f"The shard set {root} is missing {len(missing)} of {count} shards: {_ranges(missing)}"
                   f"{f' ({len(running)} in progress or interrupted: ' + ', '.join(running) + ')' if running else ''}. "
                   f"Prepare them (`python tools/prepare_data.py ... --output {root} --shard i/{count}`, or "
                   f"`LMRECIPE_SHARDS={count} sbatch --array={_ranges(missing)} slurm/prepare.sbatch ...` with the "
                   f"same arguments), then run this again.")
    metas = [load_meta(done[i]) for i in range(count)]
    _check_agree(root, [done[i] for i in range(count)], metas)
    meta = _set_meta(root, done, metas)
    _copy_tokenizer(done[0], root)
    write_json_atomic(root / "meta.json", meta)
    logger.info("wrote %s: %d shards, train %d tokens, val %d tokens", root / "meta.json", count,
                meta["splits"]["train"]["n_tokens"], meta["splits"]["val"]["n_tokens"])
    return meta


def _ranges(indices: list[int]) -> str:
    """``0-3,7`` for [0, 1, 2, 3, 7] (SLURM's --array syntax)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _check_agree(root: Path, folders: list[Path], metas: list[dict]) -> None:
    """Every shard is the shard its name says, of one corpus listing, one tokenizer and the same arguments."""
    first = metas[0]
    for index, (folder, meta) in enumerate(zip(folders, metas)):
        recorded = meta.get("shard")
        if not isinstance(recorded, dict) or "plan" not in recorded:
            raise fail(f"{folder} is a prepared folder but not a shard (its meta.json has no shard record): move it "
                       "out of the set, and prepare the shard with --shard.")
        plan = recorded["plan"]
        if (plan["index"], plan["count"]) != (index, len(folders)):
            raise fail(f"{folder} holds shard {plan['index']}/{plan['count']}, not {index}/{len(folders)} as its name "
                       "says: it was renamed. Prepare the shard again into its own name.")
        differ = shard_differences(meta, first)
        if differ:
            why = "another tokenizer" if "tokenizer_sha256" in differ else "another corpus listing or other arguments"
            raise fail(f"{folder.name} and {folders[0].name} of the shard set {root} were not prepared alike (they "
                       f"differ in {', '.join(differ)}: {why}). Prepare the odd one again with the others' arguments "
                       f"(--overwrite), then run `python tools/prepare_data.py --output {root} --finish-shards`.")


def _set_meta(root: Path, done: dict[int, Path], metas: list[dict]) -> dict[str, Any]:
    """The set's ``meta.json``: the whole's splits, the shard list; no timings, so concurrent writers agree."""
    first = metas[0]
    splits = {}
    for split in SPLITS:
        splits[split] = combine_splits([m["splits"][split] for m in metas])
        if splits[split]["n_documents"] == 0:
            raise fail(f"The {split} split of the shard set {root} is empty: no shard holds a {split} document. Add "
                       "documents, or prepare the shards again with another --val-fraction or --seed.")
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": first["tokenizer"],
        "vocab_size": first["vocab_size"],
        "eos_id": first["eos_id"],
        "dtype": first["dtype"],
        "tokenizer_sha256": first.get("tokenizer_sha256"),
        "source": first["source"],
        "val_fraction": first["val_fraction"],
        "seed": first["seed"],
        "splits": splits,
        "skipped": {key: sum(m["skipped"][key] for m in metas) for key in first["skipped"]},
        "shards": [{"path": done[i].name, "files": m["shard"]["plan"]["files"],
                    "splits": {s: {k: m["splits"][s][k] for k in ("n_tokens", "n_documents", "max_token_id", "sha256")}
                               for s in SPLITS}}
                   for i, m in enumerate(metas)],
    }


def _copy_tokenizer(shard: Path, root: Path) -> None:
    """The tokenizer files at the set's top, where training, checkpoints and exports look for them."""
    for file in sorted(shard.iterdir()):
        if file.is_file() and file.name not in _NOT_TOKENIZER:
            with atomic_path(root / file.name) as tmp:
                shutil.copyfile(file, tmp)
