"""The training data of a run: one prepared folder (``data.path``) or a weighted mixture of them (``data.sources``).

Order of a mixture. Global sample ``g`` (step ``s`` reads ``[s*G, (s+1)*G)``, split over ranks and micro-steps by
position, as for one folder) is assigned to a source by a fixed pattern of :data:`MIX_BLOCK` positions repeated
forever: source ``k`` holds ``q_k`` positions of each block, ``q_k`` the largest-remainder rounding of
``weight_k / sum(weights) x MIX_BLOCK``, and the pattern spreads them evenly (the ``j``-th position of source ``k``
sits near ``(j + 0.5) x MIX_BLOCK / q_k``). So any run of consecutive samples, a step included, holds each source
within a sample or two of its share. Sample ``g`` at position ``p`` of block ``b`` is then the
``b x q_k + (positions of k before p in the pattern)``-th sample of source ``k``, read through that source's own
permutation (seeded by the run's seed, a hash of the source's name and the source's epoch). Every step is thus a
pure function of the global sample index, computed in constant time: independent of the number of processes and
of the micro-batch split, and a resume needs no skipping. Tokens seen per source come from the same arithmetic.

Validation: each source keeps its own fixed ``data.val_windows`` windows (``ValBatches``, padded per rank as for
one folder); a mixture's ``val_loss`` is the weight-averaged mean of the sources' losses (sources of weight 0 are
evaluated, reported, and left out of the mean), i.e. the expected loss on the training mixture.

All sources must share one tokenizer (vocabulary size, EOS id, token dtype and ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import DataConfig, DataSource
from .data import (BatchLayout, SampleOrder, TokenWindows, TrainBatches, ValBatches, data_step, file_sha256, load_meta,
                   open_data)
from .errors import UserError, fail

logger = logging.getLogger(__name__)

MIX_BLOCK = 1 << 16
"""Positions of the repeating source pattern: weights are realised to the nearest 1/65,536 of the samples."""


def source_quotas(weights: list[float], block: int = MIX_BLOCK) -> np.ndarray:
    """Positions per block of each source: ``weight / sum x block``, rounded by largest remainder (sums to block)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    quotas = np.floor(exact).astype(np.int64)
    remainders = exact - quotas
    extra = np.argsort(-remainders, kind="stable")[: block - int(quotas.sum())]
    quotas[extra] += 1
    return quotas


class MixtureOrder:
    """Global sample index -> (source, that source's own sample index); see the module docstring."""

    def __init__(self, weights: list[float], block: int = MIX_BLOCK):
        self.block = block
        self.quotas = source_quotas(weights, block)
        # Ideal spots of each source's positions, merged by sorting; ties go to the earlier source.
        keys = np.concatenate([(np.arange(q) + 0.5) / q for q in self.quotas if q])
        sources = np.concatenate([np.full(q, k) for k, q in enumerate(self.quotas) if q])
        ranks = np.concatenate([np.arange(q) for q in self.quotas if q])
        order = np.argsort(keys, kind="stable")
        self.pattern = sources[order].astype(np.int64)
        """Source of each position of a block."""
        self.rank = ranks[order].astype(np.int64)
        """How many positions of the same source precede each position within its block."""

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, per-source sample index) of each global sample index."""
        blocks, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.block)
        sources = self.pattern[positions]
        return sources, blocks * self.quotas[sources] + self.rank[positions]

    def counts(self, n_samples: int) -> np.ndarray:
        """Samples of each source among global samples ``[0, n_samples)``."""
        blocks, rest = divmod(n_samples, self.block)
        return blocks * self.quotas + np.bincount(self.pattern[:rest], minlength=len(self.quotas))


def name_stream(name: str) -> int:
    """The seed stream of a source's permutation: stable across machines and Python versions (not ``hash()``)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


class MixtureBatches:
    """The micro-batches each rank trains on at each optimizer step, drawn from several sources (``TrainBatches`` API)."""

    def __init__(self, windows: list[TokenWindows], names: list[str], weights: list[float], layout: BatchLayout,
                 seed: int):
        self.sources = windows
        self.names = names
        self.layout = layout
        self.order = MixtureOrder(weights)
        self.orders = [SampleOrder(len(w), seed, stream=name_stream(n)) for w, n in zip(windows, names)]
        self.skipped: tuple[int, ...] = ()
        """Data steps never trained on (ascending), see :func:`lmrecipe.data.data_step`; replaced whole."""

    def sample_ids(self, first_sample: int, count: int) -> np.ndarray:
        """``[count, 2]``: (source, window) of global samples ``[first_sample, first_sample + count)``."""
        sources, counters = self.order.assign(np.arange(first_sample, first_sample + count))
        windows = np.zeros_like(counters)
        for k in np.unique(sources):
            mask = sources == k
            windows[mask] = self.orders[k].at(counters[mask])
        return np.stack([sources, windows], axis=1)

    def window_ids(self, step: int, micro_step: int) -> np.ndarray:
        return self.data_window_ids(data_step(step, self.skipped), micro_step)

    def data_window_ids(self, position: int, micro_step: int) -> np.ndarray:
        """This rank's (source, window) pairs in micro-step ``micro_step`` of data step ``position``."""
        return self.sample_ids(self.layout.first_sample(position, micro_step), self.layout.micro_batch_size)

    def _rows(self, ids: np.ndarray):
        import torch

        L = self.sources[0].seq_len
        rows = np.stack([self.sources[k].tokens[w * L : w * L + L + 1] for k, w in ids]).astype(np.int64)
        return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])

    def micro_batches(self, step: int):
        """Yield ``(inputs, targets)`` for each accumulation micro-step of ``step`` on this rank."""
        for micro_step in range(self.layout.accum_steps):
            yield self._rows(self.window_ids(step, micro_step))

    def data_step_samples(self, position: int) -> list:
        """Every (source name, window) of data step ``position`` over all ranks, in global sample order."""
        G = self.layout.global_batch_size
        return [[self.names[k], int(w)] for k, w in self.sample_ids(position * G, G)]

    def data_step_inputs(self, position: int) -> list:
        """This rank's micro-batch inputs of data step ``position`` (the spike fault injection matches on them)."""
        return [self._rows(self.data_window_ids(position, m))[0] for m in range(self.layout.accum_steps)]

    def samples_seen(self, step: int) -> np.ndarray:
        """Samples of each source trained on in steps ``[0, step)``, over all ranks (skipped data steps left out)."""
        G = self.layout.global_batch_size
        end = data_step(step, self.skipped)
        seen = self.order.counts(end * G)
        for skip in self.skipped:
            if skip < end:
                seen -= self.order.counts((skip + 1) * G) - self.order.counts(skip * G)
        return seen


@dataclass
class TrainingData:
    """What ``build_run`` needs from the data: batches, validation sets, names and the per-source accounting."""

    names: list[str]
    paths: list[Path]
    weights: list[float]
    """Normalised to sum to 1."""
    seq_len: int
    train_batches: TrainBatches | MixtureBatches
    val_sets: dict[str, ValBatches]
    n_train_windows: int
    train_sha256: list[str | None]

    @property
    def is_mixture(self) -> bool:
        return isinstance(self.train_batches, MixtureBatches)

    @property
    def tokenizer_dir(self) -> Path:
        """The folder whose tokenizer and meta.json a checkpoint carries (all sources share the tokenizer)."""
        return self.paths[0]

    def val_loss(self, per_source: dict[str, float]) -> float:
        """One folder: its loss. A mixture: the weight-averaged mean of the sources' losses (weight 0 left out)."""
        if not self.is_mixture:
            return per_source[self.names[0]]
        return sum(w * per_source[n] for n, w in zip(self.names, self.weights) if w > 0)

    def tokens_seen(self, step: int) -> dict[str, int]:
        """``tokens_seen/<name>`` after ``step`` steps, for a mixture (empty for one folder: ``tokens_seen`` says it)."""
        if not self.is_mixture:
            return {}
        counts = self.train_batches.samples_seen(step)
        return {f"tokens_seen/{n}": int(c) * self.seq_len for n, c in zip(self.names, counts)}

    def mixture_signature(self) -> list[dict] | None:
        """What a checkpoint records of a mixture (None for one folder); a resume must keep names and quotas."""
        if not self.is_mixture:
            return None
        quotas = self.train_batches.order.quotas
        return [{"name": n, "path": str(p), "weight": w, "quota": int(q), "train_sha256": sha}
                for n, p, w, q, sha in zip(self.names, self.paths, self.weights, quotas, self.train_sha256)]


def _where(data: DataConfig, i: int, source: DataSource) -> str:
    return f"data.sources[{i}] ({source.resolved_name()}, {source.path})" if data.is_mixture() else ""


def _tokenizer_signature(folder: Path, meta: dict) -> dict:
    tokenizer = folder / "tokenizer.json"
    return {"vocab_size": meta["vocab_size"], "eos_id": meta["eos_id"], "dtype": meta["dtype"],
            "tokenizer.json sha256": file_sha256(tokenizer) if tokenizer.is_file() else None}


def check_sources(data: DataConfig) -> dict:
    """Check every source folder's meta.json and that all share one tokenizer; return the first's meta.json.

    Reads only meta.json, file sizes and tokenizer.json: called before the run touches ``out_dir``.
    """
    sources = data.source_list()
    metas = []
    for i, source in enumerate(sources):
        try:
            metas.append(load_meta(source.path))
        except UserError as err:
            raise (fail(f"{_where(data, i, source)}: {err}") if data.is_mixture() else err) from None
    if len(sources) > 1:
        first = _tokenizer_signature(Path(sources[0].path), metas[0])
        for i, (source, meta) in enumerate(zip(sources[1:], metas[1:]), start=1):
            other = _tokenizer_signature(Path(source.path), meta)
            differ = [f"{k} {first[k]} vs {other[k]}" for k in first if first[k] != other[k]]
            if differ:
                raise fail(
                    f"{_where(data, i, source)} does not share the tokenizer of {_where(data, 0, sources[0])}: "
                    f"{'; '.join(differ)}. All sources of a mixture must be tokenized alike: re-prepare one with the "
                    f"other's tokenizer, e.g. `python tools/prepare_data.py --input CORPUS --tokenizer {sources[0].path} "
                    f"--output {source.path} --overwrite`."
                )
    return metas[0]


def open_training_data(data: DataConfig, model_vocab_size: int, layout: BatchLayout, seed: int) -> TrainingData:
    """Open every source (start-up checks of :func:`lmrecipe.data.open_data`) and build the batches."""
    sources = data.source_list()
    opened = []
    for i, source in enumerate(sources):
        try:
            opened.append(open_data(source.path, data.seq_len, model_vocab_size))
        except UserError as err:
            raise (fail(f"{_where(data, i, source)}: {err}") if data.is_mixture() else err) from None
    names = [s.resolved_name() for s in sources]
    total = sum(s.weight for s in sources)
    weights = [s.weight / total for s in sources]
    val_sets = {name: ValBatches(val, data.val_windows, layout.micro_batch_size, layout.world_size, layout.rank)
                for name, (_, _, val) in zip(names, opened)}
    train = [windows for _, windows, _ in opened]
    if data.is_mixture():
        batches = MixtureBatches(train, names, weights, layout, seed)
        for name, weight, quota in zip(names, weights, batches.order.quotas):
            if weight > 0 and quota == 0:
                logger.warning("Source %s has weight %.3g, below 1/%d of the mixture: it gets no training samples.",
                               name, weight, MIX_BLOCK)
        logger.info("Data mixture: %s", ", ".join(
            f"{n} {100 * w:.1f}% ({len(t):,} windows)" for n, w, t in zip(names, weights, train)))
    else:
        batches = TrainBatches(train[0], layout, seed)
    return TrainingData(names=names, paths=[Path(s.path) for s in sources], weights=weights, seq_len=data.seq_len,
                        train_batches=batches, val_sets=val_sets, n_train_windows=sum(len(t) for t in train),
                        train_sha256=[meta["splits"]["train"].get("sha256") for meta, _, _ in opened])
