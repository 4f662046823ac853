"""Checkpoint averaging: a weighted mean of several checkpoints' weights, written as a Hugging Face export.

The checkpoints are a run's last K (``--last K``) or any list of checkpoint folders of one model (same shape); the
weights are uniform or given, normalised to sum to 1. Each parameter is accumulated in fp32 from every checkpoint in
turn, read through ``checkpoint/readers.py`` (ZeRO-1/2/3 and tensor-parallel shards, memory-mapped, their pages
released once read) or from ``model.safetensors``: this process holds the average being built (one model, in the
export's dtype), one fp32 accumulator and one checkpoint's tensor, never the checkpoints' full states. The export
(``export.write_export``: sharded safetensors, config, tokenizer, model card) takes the config and tokenizer of the
last checkpoint and is built in a temporary folder, then renamed into place.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from lmrecipe.checkpoint.compat import HF_SHAPE_KEYS
from lmrecipe.checkpoint.readers import open_source
from lmrecipe.checkpoint.storage import (
    DS_TAG,
    complete_checkpoints,
    looks_like_checkpoint,
    no_checkpoint_message,
    read_checkpoint,
)
from lmrecipe.checkpoint.tp_split import RECORD_KEY as TP_RECORD
from lmrecipe.config import autoep_size_of, parse_shard_size
from lmrecipe.errors import fail
from lmrecipe.export import DTYPES, check_export_target, model_card, write_export
from lmrecipe.model.build import bare_parameter_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Averaged:
    """What :func:`average_checkpoints` wrote: the export folder, the checkpoints and their weights."""

    out: Path
    checkpoints: list[Path]
    weights: list[float]


def select_checkpoints(paths: Sequence[str | Path], last: int | None) -> list[Path]:
    """The checkpoints to average: with ``last``, the ``last`` newest complete checkpoints of the one run folder
    ``paths`` names; else ``paths`` themselves, each a checkpoint folder. Oldest first."""
    if last is not None:
        if len(paths) != 1:
            raise fail(f"--last {last} takes one run folder, not {len(paths)} paths: pass RUN --last K, or list the "
                       "checkpoint folders without --last.")
        if last < 1:
            raise fail(f"--last {last} must be 1 or more (the number of newest checkpoints to average).")
        run = Path(paths[0])
        found = complete_checkpoints(run / "checkpoints") or complete_checkpoints(run)
        if len(found) < last:
            raise fail(f"{run} holds {len(found)} complete checkpoint(s), fewer than --last {last}: lower --last, or "
                       "train with a larger checkpoint.keep_last so that the run keeps more of them.")
        return [c.path for c in found[-last:]]
    if not paths:
        raise fail("No checkpoints to average: pass a run folder with --last K, or two or more checkpoint folders.")
    chosen = []
    for path in map(Path, paths):
        if not looks_like_checkpoint(path):
            raise fail(f"{no_checkpoint_message(path)} List checkpoint folders (RUN/checkpoints/step_N), or pass one "
                       "run folder with --last K.")
        chosen.append(path)
    if len({p.resolve() for p in chosen}) != len(chosen):
        raise fail("A checkpoint is listed twice: list each once, and give it a larger share with --weights.")
    return chosen


def parse_weights(text: str | None, count: int) -> list[float]:
    """The averaging weights, normalised to sum to 1: uniform when ``text`` is None, else ``count`` comma-separated
    numbers >= 0 (``0.2,0.3,0.5``)."""
    if text is None:
        return [1.0 / count] * count
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != count or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise fail(f"--weights {text} must be {count} comma-separated numbers >= 0, not all 0, one per checkpoint "
                   "in the order listed (oldest first with --last), e.g. --weights "
                   f"{','.join(['1'] * count)}.")
    total = sum(values)
    return [v / total for v in values]


class _Weights:
    """One checkpoint's weights, readable one parameter at a time as full fp32 tensors."""

    def __init__(self, ckpt: Path, saved: dict):
        self.ckpt = ckpt
        self.source = None
        if (ckpt / DS_TAG).is_dir():
            tp = int(saved.get("topology", {}).get("tensor_parallel_size", 1))
            self.source = open_source(ckpt, deepspeed_dir=ckpt / DS_TAG, param_names=[],
                                      tensor_parallel=(tp, saved.get(TP_RECORD, {})))
            self.shapes = dict(self.source.shapes)
            return
        from safetensors import safe_open

        self.file = ckpt / "model.safetensors"
        if not self.file.is_file():
            raise fail(f"{ckpt} has neither DeepSpeed shards ({DS_TAG}/) nor model.safetensors: it holds no weights.")
        with safe_open(self.file, framework="pt") as fh:
            self.stored = {bare_parameter_name(name): name for name in fh.keys()}
            self.shapes = {bare: tuple(fh.get_slice(name).get_shape()) for bare, name in self.stored.items()}

    def read(self, name: str) -> torch.Tensor:
        if self.source is not None:
            return self.source.read("fp32", name)
        from safetensors import safe_open

        with safe_open(self.file, framework="pt") as fh:  # closed: its pages leave this process
            return fh.get_tensor(self.stored[name]).float()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def _refuse_autoep(checkpoints: list[Path], records: list[dict]) -> None:
    """UserError for a checkpoint of DeepSpeed AutoEP's MoE layers: its experts are stored under AutoEP's names and
    shapes (experts.w1/w2/w3), which only the export maps to the model class's; the averager reads the class's."""
    for ckpt, saved in zip(checkpoints, records):
        size = autoep_size_of(saved.get("config", {}))
        if size is not None:
            raise fail(f"{ckpt} was saved with DeepSpeed AutoEP's MoE layers (distributed.expert_layer=autoep, "
                       f"expert_parallel_size={size}), whose experts are stored as experts.w1/w2/w3, not the model "
                       "class's fused experts: tools/average_checkpoints.py does not average AutoEP checkpoints. "
                       f"Export one checkpoint instead (python tools/export_hf.py {ckpt} EXPORT --dtype fp32, which "
                       "maps AutoEP's names), or train with distributed.expert_layer=hf to average its checkpoints.")


def _check_one_model(checkpoints: list[Path], records: list[dict], readers: list[_Weights]) -> None:
    """UserError unless every checkpoint holds the same model: transformers shape and parameter names and shapes."""
    first_hf, first = records[0].get("hf_config", {}), readers[0]
    for ckpt, saved, reader in zip(checkpoints[1:], records[1:], readers[1:]):
        differs = [f"{k}: {first_hf.get(k)!r} -> {saved.get('hf_config', {}).get(k)!r}" for k in HF_SHAPE_KEYS
                   if first_hf.get(k) != saved.get("hf_config", {}).get(k)]
        if not differs and reader.shapes != first.shapes:
            names = sorted(set(reader.shapes) ^ set(first.shapes)) or sorted(
                n for n in first.shapes if reader.shapes[n] != first.shapes[n])
            differs = [f"parameters {', '.join(names[:5])}"]
        if differs:
            raise fail(f"{ckpt} holds another model than {checkpoints[0]} ({'; '.join(differs)}): only checkpoints of "
                       "one model can be averaged. List checkpoints of one run (or of its branches).")


def average_state_dict(checkpoints: list[Path], weights: list[float], dtype: torch.dtype = torch.float32,
                       records: list[dict] | None = None, progress: bool = False) -> dict[str, torch.Tensor]:
    """``sum_i weights[i] x checkpoint_i`` for every parameter, accumulated in fp32 in the order listed, returned in
    ``dtype``; one parameter of one checkpoint read at a time. ``records``: the checkpoints' ``train_state.json``
    (read when not given)."""
    from tqdm.auto import tqdm

    records = records or [read_checkpoint(c) for c in checkpoints]
    _refuse_autoep(checkpoints, records)
    readers: list[_Weights] = []
    try:
        readers = [_Weights(c, saved) for c, saved in zip(checkpoints, records)]
        _check_one_model(checkpoints, records, readers)
        shapes = readers[0].shapes
        bar = tqdm(total=sum(math.prod(s) for s in shapes.values()) * len(readers) * 4, unit="B", unit_scale=True,
                   desc="average", disable=not (progress and sys.stderr.isatty()))
        out = {}
        for name, shape in shapes.items():
            total = torch.zeros(shape, dtype=torch.float32)
            for weight, reader in zip(weights, readers):
                total.add_(reader.read(name), alpha=weight)
                bar.update(total.numel() * 4)
            out[name] = total if dtype == torch.float32 else total.to(dtype)
        bar.close()
        return out
    finally:
        for reader in readers:
            reader.close()


def average_checkpoints(checkpoints: list[Path], out: str | Path, *, weights: list[float] | None = None,
                        dtype: str = "fp32", max_shard_size: str | int = "2GB", overwrite: bool = False,
                        progress: bool = False) -> Averaged:
    """Average ``checkpoints`` (``weights``: normalised shares, uniform when None) into the Hugging Face export
    folder ``out``, with the config and tokenizer of the last checkpoint; UserError before any work when ``out``
    exists (without ``overwrite``), lies in a checkpoint, or the checkpoints hold different models."""
    out = Path(out)
    if dtype not in DTYPES:
        raise fail(f"Export dtype {dtype!r} is not supported. Choose one of: {', '.join(DTYPES)}.")
    weights = weights or parse_weights(None, len(checkpoints))
    records = [read_checkpoint(c) for c in checkpoints]
    _refuse_autoep(checkpoints, records)
    check_export_target(out, checkpoints, overwrite)
    shard_bytes = parse_shard_size(max_shard_size)
    state_dict = average_state_dict(checkpoints, weights, DTYPES[dtype], records, progress=progress)
    last, saved = checkpoints[-1], records[-1]
    steps = ", ".join(f"{c.name} ({w:.4g})" for c, w in zip(checkpoints, weights))
    described = (f"the average of {len(checkpoints)} checkpoints (folder and weight: {steps}; accumulated in fp32 by "
                 "tools/average_checkpoints.py), with the config and tokenizer of the last")
    command = " ".join(["python tools/average_checkpoints.py", *map(str, checkpoints), "--out", str(out),
                        "--weights", ",".join(f"{w:.6g}" for w in weights), "--dtype", dtype, "--overwrite"])
    write_export(out, state_dict, last, dtype=dtype, max_shard_size=shard_bytes,
                 card=lambda n_params, n_active: model_card(last, saved, n_params, dtype, "raw", described=described,
                                                            n_active=n_active),
                 what=f"averaging {len(checkpoints)} checkpoints", retry=command)
    logger.info("Averaged %d checkpoints (%s) into %s (%s)", len(checkpoints), steps, out, dtype)
    return Averaged(out, list(checkpoints), list(weights))
