"""The order in which training reads samples: a pure function of the global sample index.

The samples of optimizer step ``s`` are samples ``[s*G, (s+1)*G)`` of a permutation of window indices seeded by
``(seed, epoch)`` (:class:`SampleOrder`); under a batch-size ramp, the consecutive range ``[start(s), start(s) +
size(s))`` the ramp assigns (``lmrecipe/data/batches.py``, :class:`~lmrecipe.data.batches.BatchRamp`). A mixture
first assigns each global sample to a source by a fixed pattern (:class:`MixtureOrder`, see
``lmrecipe/data/sources.py``); a staged mixture by the pattern of the stage the sample falls in
(:class:`StagedMixtureOrder`). So what a step trains on does not depend on how G is split (processes x micro-batch x
accumulation), and resuming at step ``s`` needs no skipping.

The permutation (order version 2) is a keyed Feistel network over the smallest power of four at least the number
of windows, with cycle walking (a position that lands outside is encrypted again until it lands inside): a
bijection of ``[0, n_windows)`` computed per position, in constant time and memory whatever the corpus size.
Version 1, a ``numpy`` permutation materialised per epoch (memory and time linear in the windows: 58 GB per rank at
15T tokens), is kept for runs whose checkpoints were written with it; they continue in it.

Skipped batches. A run that rolled back from a loss spike (``lmrecipe/train/callbacks/spikes.py``) never trains on the samples
of the offending steps again: it lists their *data steps* (the sample ranges ``[start(d), start(d) + size(d))`` of
the order above, blocks of G without a ramp) as skipped, and optimizer step ``s`` then reads the ``s``-th data step
that is not skipped (:func:`data_step`). Without skips the two are equal; with them the order stays a pure function of (step, skipped list), so a resume is still exact.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

ORDER_VERSION = 2
"""The sample order new runs use (recorded in every checkpoint as ``data.order_version``)."""
FEISTEL_ROUNDS = 6
_MASK64 = (1 << 64) - 1


class SampleOrder:
    """Sample index -> window index: a permutation per epoch, seeded by (seed, epoch).

    ``stream`` (a source of a mixture) seeds by (seed, stream, epoch) instead, so each source of a mixture has its own
    permutation; None keeps the single-folder order. ``version``: see the module docstring.
    """

    def __init__(self, n_windows: int, seed: int, stream: int | None = None, version: int = ORDER_VERSION):
        if version not in (1, 2):
            raise ValueError(f"unknown sample order version {version}")
        self.n_windows = n_windows
        self.seed = seed
        self.stream = stream
        self.version = version
        self.half_bits = max(1, ((max(n_windows, 2) - 1).bit_length() + 1) // 2)
        """Each Feistel half has this many bits: the network permutes [0, 4^half_bits), at most 4x the windows."""

    def _entropy(self, epoch: int) -> list[int]:
        return [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]

    @lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> np.ndarray:
        """Version 1: the whole epoch's permutation, materialised."""
        return np.random.default_rng(self._entropy(epoch)).permutation(self.n_windows)

    @lru_cache(maxsize=8)
    def round_keys(self, epoch: int) -> np.ndarray:
        """Version 2: one 64-bit key per Feistel round of ``epoch``."""
        return np.random.default_rng(self._entropy(epoch)).integers(0, 2**63, size=FEISTEL_ROUNDS, dtype=np.uint64)

    def windows(self, first_sample: int, count: int) -> np.ndarray:
        return self.at(np.arange(first_sample, first_sample + count))

    def at(self, samples: np.ndarray) -> np.ndarray:
        """Window indices of the given sample indices (any order, repeats allowed)."""
        epochs, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.n_windows)
        if self.version == 1:
            return np.array([self.permutation(int(e))[p] for e, p in zip(epochs, positions)], dtype=np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.permute(positions[chosen], int(epoch))
        return out

    def permute(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        """Version 2: the permutation of ``epoch`` at ``positions`` (each in ``[0, n_windows)``)."""
        x = np.asarray(positions, dtype=np.uint64).copy()
        keys = self.round_keys(epoch)
        outside = np.ones(len(x), dtype=bool)
        while outside.any():  # cycle walking: expected under 4 rounds trips, as the domain is under 4x
            x[outside] = _feistel(x[outside], keys, self.half_bits)
            outside = x >= np.uint64(self.n_windows)
        return x.astype(np.int64)


def _feistel(x: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
    """One pass of the balanced Feistel network over ``[0, 4^half_bits)`` (a bijection there)."""
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> np.uint64(half_bits), x & mask
    for key in keys:
        left, right = right, left ^ (_mix64(right ^ key) & mask)
    return (left << np.uint64(half_bits)) | right


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: every input bit reaches every output bit (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def data_step(step: int, skipped: tuple[int, ...] | list[int] = ()) -> int:
    """The data step (sample range of the original order) that optimizer step ``step`` (0-based) trains on.

    ``skipped``: data steps never trained on, ascending. Step ``s`` reads the ``s``-th data step not in it, so the
    batches of skipped steps are replaced by the next unused samples and every later step moves up alike.
    """
    position = step
    for skip in skipped:
        if skip > position:
            break
        position += 1
    return position




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


class StagedMixtureOrder:
    """A mixture whose weights change at stage boundaries: global sample -> (source, that source's own sample index).

    ``bounds``: the first global sample of each stage (0 first, increasing); ``stage_weights``: each stage's weights,
    one per source. Samples of stage ``k`` follow stage ``k``'s :class:`MixtureOrder` from the stage's first sample,
    and each source's own index continues where the earlier stages left it (a source that leaves and comes back
    resumes its permutation), so the order stays a pure function of the global sample index.
    """

    def __init__(self, bounds: list[int], stage_weights: list[list[float]], block: int = MIX_BLOCK):
        if not bounds or bounds[0] != 0 or any(after <= before for before, after in zip(bounds, bounds[1:])):
            raise ValueError(f"stage bounds must start at 0 and increase: {bounds}")
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.stages = [MixtureOrder(w, block) for w in stage_weights]
        offsets = [np.zeros(len(stage_weights[0]), dtype=np.int64)]
        for k, stage in enumerate(self.stages[:-1]):
            offsets.append(offsets[-1] + stage.counts(int(self.bounds[k + 1] - self.bounds[k])))
        self.offsets = np.stack(offsets)
        """Samples of each source (columns) drawn before each stage (rows)."""

    @property
    def quotas(self) -> np.ndarray:
        """The first stage's quotas (what a checkpoint's mixture record names; the stages are recorded apart)."""
        return self.stages[0].quotas

    def stage_of(self, samples: np.ndarray) -> np.ndarray:
        """The stage index of each global sample index."""
        return np.searchsorted(self.bounds, np.asarray(samples, dtype=np.int64), side="right") - 1

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, per-source sample index) of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        stages = self.stage_of(samples)
        sources = np.zeros_like(samples)
        counters = np.zeros_like(samples)
        for k in np.unique(stages):
            chosen = stages == k
            src, local = self.stages[k].assign(samples[chosen] - self.bounds[k])
            sources[chosen], counters[chosen] = src, local + self.offsets[k][src]
        return sources, counters

    def counts(self, n_samples: int) -> np.ndarray:
        """Samples of each source among global samples ``[0, n_samples)``."""
        k = int(self.stage_of(np.array([n_samples]))[0]) if n_samples > 0 else 0
        return self.offsets[k] + self.stages[k].counts(int(n_samples - self.bounds[k]))

