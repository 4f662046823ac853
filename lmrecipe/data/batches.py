"""The batches a rank trains and validates on: the batch layout, training micro-batches, the prefetcher, validation.

Samples are split into accumulation micro-steps and ranks by position only (:class:`BatchLayout`), so the
order of ``lmrecipe/data/order.py`` is the same on any number of processes. A batch-size ramp (:class:`BatchRamp`)
gives each data step its own consecutive range of samples; the micro-batch stays and the accumulation count follows.
One folder (:class:`TrainBatches`) and
a mixture (:class:`MixtureBatches`) share :class:`StepBatches` and differ only in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lmrecipe.config import TrainConfig
from lmrecipe.data.documents import DocumentBatch, stack_documents
from lmrecipe.data.format import TokenWindows, split_rows
from lmrecipe.data.order import MixtureOrder, SampleOrder, StagedMixtureOrder, data_step, name_stream
from lmrecipe.errors import fail

# torch is imported where tensors are built, not here: the tokenizer workers of data preparation import the format
# module for its constants, and torch would cost each of them about 200 MB of memory and a second or two.
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's G sequences are split: G = micro_batch_size x world_size x accum_steps.

    The one place the accumulation steps are derived; the Accelerator, DeepSpeed's config, the loader and the
    logs all read them from here. Construction fails with a UserError if G does not split evenly.
    """

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int

    def __post_init__(self):
        per_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_step:
            raise fail(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size} x {self.world_size} processes = {per_step}. "
                "Change one of them so the global batch splits evenly over processes."
            )

    @classmethod
    def from_config(cls, train: TrainConfig, world_size: int, rank: int = 0) -> "BatchLayout":
        return cls(train.global_batch_size, train.micro_batch_size, world_size, rank)

    @property
    def accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def first_sample(self, step: int, micro_step: int) -> int:
        """Global sample index of this rank's first sequence in micro-step ``micro_step`` of ``step``."""
        offset = (micro_step * self.world_size + self.rank) * self.micro_batch_size
        return step * self.global_batch_size + offset


class BatchRamp:
    """Data step ``d`` -> its samples ``[start(d), start(d) + size(d))``: consecutive ranges, none skipped or repeated.

    ``points``: (first data step, size) pairs, the first at step 0, steps increasing; the last size holds from its step
    on (``train.ramp_points()``). One point ``(0, G)`` is the ramp-free run: ``start(d) = d x G``.
    """

    def __init__(self, points: list[tuple[int, int]]):
        if not points or points[0][0] != 0:
            raise ValueError(f"a ramp starts at step 0: {points}")
        self.steps = np.array([step for step, _ in points], dtype=np.int64)
        self.sizes = np.array([size for _, size in points], dtype=np.int64)
        lengths = np.diff(self.steps)
        self.starts = np.concatenate([[0], np.cumsum(lengths * self.sizes[:-1])]).astype(np.int64)
        """First sample of each point's first step."""

    @classmethod
    def from_config(cls, train: TrainConfig, layout: BatchLayout) -> "BatchRamp":
        """The run's ramp; a UserError naming the fix when a size does not split over ``layout``'s processes."""
        ramp = cls(train.ramp_points())
        per_step = layout.micro_batch_size * layout.world_size
        uneven = [int(size) for size in ramp.sizes if size % per_step]
        if uneven:
            raise fail(f"The batch-size ramp has step sizes ({', '.join(map(str, uneven))}) that are not multiples of "
                       f"train.micro_batch_size={layout.micro_batch_size} x {layout.world_size} data-parallel processes "
                       f"= {per_step}: the ramp changes the accumulation count, never the micro-batch. Choose sizes "
                       f"(train.batch_ramp, or train.batch_ramp_start_size and _increment) that are multiples of "
                       f"{per_step}, or change the micro-batch size.")
        return ramp

    @property
    def is_constant(self) -> bool:
        return len(self.sizes) == 1

    def _point(self, step: int) -> int:
        return int(np.searchsorted(self.steps, step, side="right")) - 1

    def size(self, step: int) -> int:
        """Samples of data step ``step`` (over all ranks)."""
        return int(self.sizes[self._point(step)])

    def start(self, step: int) -> int:
        """Global sample index of data step ``step``'s first sample (= samples of the steps before it)."""
        k = self._point(step)
        return int(self.starts[k] + (step - self.steps[k]) * self.sizes[k])

    def range(self, step: int) -> tuple[int, int]:
        """``[first, end)`` global sample indices of data step ``step``."""
        first = self.start(step)
        return first, first + self.size(step)


class MicroBatch(NamedTuple):
    """One forward's rows: inputs and next-token targets ``[rows, seq_len]`` int64, and with document masking the rows'
    document boundaries (a :class:`~lmrecipe.data.documents.DocumentBatch` of CPU tensors; None without)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: DocumentBatch | None = None

    def pinned(self) -> MicroBatch:
        """In page-locked memory, so the copy to a GPU with ``non_blocking=True`` is asynchronous."""
        documents = None if self.documents is None else self.documents.as_tensors(pin_memory=True)
        return MicroBatch(self.inputs.pin_memory(), self.targets.pin_memory(), documents)


class StepBatches:
    """The micro-batches each rank trains on at each optimizer step, drawn from one or more sources of windows.

    Subclasses differ only in the order, :meth:`locate` (global sample index -> source and window); which samples
    a rank reads at a micro-step (:class:`BatchLayout`), skipped data steps and the rows of a batch are shared.
    Ids name windows: bare window indices for one folder (``names`` None), (source, window) rows for named sources.
    """

    names: list[str] | None = None
    """Source names, which the spike log writes with each window; None for one folder."""

    def __init__(self, sources: list[TokenWindows], layout: BatchLayout):
        self.sources = sources
        self.layout = layout
        self.documents = False
        """Also assemble each micro-batch's document boundaries (``data.document_masking``)."""
        self.skipped: tuple[int, ...] = ()
        """Data steps never trained on (ascending), see :func:`data_step`; replaced whole, never mutated."""
        self.ramp = BatchRamp([(0, layout.global_batch_size)])
        """The sample range of each data step (a batch-size ramp, or blocks of ``global_batch_size``)."""

    def data_position(self, step: int) -> int:
        """The data step optimizer step ``step`` (0-based) reads, skipped data steps left out."""
        return data_step(step, self.skipped)

    def step_size(self, step: int) -> int:
        """Samples optimizer step ``step`` (0-based) trains on, over all ranks."""
        return self.ramp.size(self.data_position(step))

    def accum_steps(self, position: int) -> int:
        """Accumulation micro-steps of data step ``position`` on each rank."""
        return self.ramp.size(position) // (self.layout.micro_batch_size * self.layout.world_size)

    def next_sample(self, step: int) -> int:
        """The global sample index optimizer step ``step`` (0-based) starts at: a checkpoint's data position."""
        return self.ramp.start(self.data_position(step))

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) index arrays of the given global sample indices: the order."""
        raise NotImplementedError

    def window_ids(self, step: int, micro_step: int) -> np.ndarray:
        return self.data_window_ids(self.data_position(step), micro_step)

    def data_window_ids(self, position: int, micro_step: int) -> np.ndarray:
        """This rank's windows in micro-step ``micro_step`` of data step ``position`` (ids: see the class)."""
        sources, windows = self._micro_step(position, micro_step)
        return windows if self.names is None else np.stack([sources, windows], axis=1)

    def micro_batches(self, step: int):
        """Yield a :class:`MicroBatch` for each accumulation micro-step of ``step`` on this rank."""
        position = self.data_position(step)
        for micro_step in range(self.accum_steps(position)):
            yield self._batch(*self._micro_step(position, micro_step))

    def data_step_samples(self, position: int) -> list:
        """Every window of data step ``position`` over all ranks, in global sample order (for the spike log).

        Window indices for one folder, ``[source name, window]`` pairs for named sources.
        """
        first, end = self.ramp.range(position)
        sources, windows = self._samples(first, end - first)
        if self.names is None:
            return windows.tolist()
        return [[self.names[k], int(w)] for k, w in zip(sources, windows)]

    def data_step_inputs(self, position: int) -> list:
        """This rank's micro-batch inputs of data step ``position`` (the spike fault injection matches on them)."""
        return [self._batch(*self._micro_step(position, m))[0] for m in range(self.accum_steps(position))]

    def _samples(self, first_sample: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self.locate(np.arange(first_sample, first_sample + count))

    def _micro_step(self, position: int, micro_step: int) -> tuple[np.ndarray, np.ndarray]:
        layout = self.layout
        offset = (micro_step * layout.world_size + layout.rank) * layout.micro_batch_size
        return self._samples(self.ramp.start(position) + offset, layout.micro_batch_size)

    def _batch(self, sources: np.ndarray, windows: np.ndarray) -> MicroBatch:
        if len(self.sources) == 1:
            rows = self.sources[0].rows(windows)
        else:  # one gather per source present, placed at its samples' positions
            rows = np.empty((len(windows), self.sources[0].seq_len + 1), dtype=np.int64)
            for k in np.unique(sources):
                rows[sources == k] = self.sources[k].rows(windows[sources == k])
        inputs, targets = split_rows(rows)
        if not self.documents:
            return MicroBatch(inputs, targets)
        if len(self.sources) == 1:
            documents = self.sources[0].documents(windows)
        else:
            documents = stack_documents([self.sources[k].documents([w]) for k, w in zip(sources, windows)])
        return MicroBatch(inputs, targets, documents.as_tensors())


class TrainBatches(StepBatches):
    """One folder: global sample ``g`` is window ``order.at(g)``, a permutation of the windows per epoch."""

    def __init__(self, windows: TokenWindows, layout: BatchLayout, seed: int):
        super().__init__([windows], layout)
        self.seed = seed
        self.order = SampleOrder(len(windows), seed)

    @property
    def order_version(self) -> int:
        return self.order.version

    def use_order_version(self, version: int) -> None:
        """Read in the sample order of ``version`` (a checkpoint written with an earlier one continues in it)."""
        self.order = SampleOrder(len(self.windows), self.seed, version=version)

    @property
    def windows(self) -> TokenWindows:
        return self.sources[0]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(len(samples), dtype=np.int64), self.order.at(samples)


class MixtureBatches(StepBatches):
    """Several folders: global sample ``g`` goes to a source by :class:`MixtureOrder`, then through its own permutation."""

    def __init__(self, windows: list[TokenWindows], names: list[str], weights: list[float], layout: BatchLayout,
                 seed: int, order: StagedMixtureOrder | None = None):
        super().__init__(windows, layout)
        self.names = names
        self.seed = seed
        self.order = order if order is not None else MixtureOrder(weights)
        """The source of each global sample: :class:`MixtureOrder` by ``weights``, or a staged mixture's ``order``."""
        self.orders = [SampleOrder(len(w), seed, stream=name_stream(n)) for w, n in zip(windows, names)]

    @property
    def order_version(self) -> int:
        return self.orders[0].version

    def use_order_version(self, version: int) -> None:
        """Read every source in the sample order of ``version`` (see :meth:`TrainBatches.use_order_version`)."""
        self.orders = [SampleOrder(len(w), self.seed, stream=name_stream(n), version=version)
                       for w, n in zip(self.sources, self.names)]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sources, counters = self.order.assign(samples)
        windows = np.zeros_like(counters)
        for k in np.unique(sources):
            mask = sources == k
            windows[mask] = self.orders[k].at(counters[mask])
        return sources, windows

    def samples_seen(self, step: int) -> np.ndarray:
        """Samples of each source trained on in steps ``[0, step)``, over all ranks (skipped data steps left out)."""
        end = self.data_position(step)
        seen = self.order.counts(self.ramp.start(end))
        for skip in self.skipped:
            if skip < end:
                first, last = self.ramp.range(skip)
                seen -= self.order.counts(last) - self.order.counts(first)
        return seen

    def stage(self, step: int) -> int:
        """The stage (of a staged mixture; 0 otherwise) of the samples optimizer step ``step`` (0-based) trains on."""
        if not isinstance(self.order, StagedMixtureOrder):
            return 0
        return int(self.order.stage_of(np.array([self.next_sample(step)]))[0])


class Prefetcher:
    """Assembles the micro-batches of step ``s + 1`` on a background thread while step ``s`` computes.

    The batches are exactly ``batches.micro_batches(step)`` (same order, same resume behaviour); only where
    they are built changes. With ``pin_memory`` (CUDA) they land in page-locked memory, so the copy to the
    device with ``non_blocking=True`` is asynchronous (from pageable memory it is synchronous). Memory-map
    reads and the numpy/torch copies release the GIL, so the thread overlaps with the training step.
    """

    def __init__(self, batches: StepBatches, pin_memory: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self.batches = batches
        self.pin_memory = pin_memory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._next: tuple[int, object] | None = None

    def reset(self) -> None:
        """Drop the batches assembled ahead (the order changed: a rollback skipped some data steps)."""
        if self._next is not None:
            self._next[1].cancel()
        self._next = None

    def _load(self, step: int) -> list[MicroBatch]:
        loaded = list(self.batches.micro_batches(step))
        return [batch.pinned() for batch in loaded] if self.pin_memory else loaded

    def get(self, step: int) -> list[MicroBatch]:
        """The micro-batches of ``step``; starts assembling those of ``step + 1``."""
        if self._next is not None and self._next[0] == step:
            loaded = self._next[1].result()
        else:  # the first step, or a jump (resume): load in this thread
            loaded = self._load(step)
        self._next = (step + 1, self._executor.submit(self._load, step + 1))
        return loaded

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._next = None


class ValBatches:
    """A fixed set of validation windows spread over val.bin, the same on every run and rank split.

    Each rank takes a stride of the set, padded so every rank runs the same number of forward passes
    (ZeRO-3 gathers parameters collectively in forward); padded rows carry weight 0.
    """

    def __init__(self, windows: TokenWindows, n_windows: int, micro_batch_size: int, world_size: int, rank: int,
                 documents: bool = False):
        self.documents = documents
        """Also yield each batch's document boundaries (``data.document_masking``)."""
        count = min(n_windows, len(windows))
        self.all_ids = np.unique(np.linspace(0, len(windows) - 1, num=count).round().astype(np.int64))
        self.windows = windows
        self.micro_batch_size = micro_batch_size
        per_rank = -(-len(self.all_ids) // world_size)
        ids = self.all_ids[rank::world_size]
        self.valid = np.zeros(per_rank, dtype=np.float64)
        self.valid[: len(ids)] = 1.0
        self.rank_ids = np.concatenate([ids, np.full(per_rank - len(ids), self.all_ids[0], dtype=np.int64)])

    def __iter__(self):
        """Yield ``(inputs, targets, valid, documents)``: ``valid`` 1.0 for real rows and 0.0 for padding, ``documents``
        the rows' :class:`~lmrecipe.data.documents.DocumentBatch` as tensors (None without ``documents``)."""
        import torch

        for i in range(0, len(self.rank_ids), self.micro_batch_size):
            ids = self.rank_ids[i : i + self.micro_batch_size]
            inputs, targets = self.windows.batch(ids)
            documents = self.windows.documents(ids).as_tensors() if self.documents else None
            yield inputs, targets, torch.from_numpy(self.valid[i : i + self.micro_batch_size]), documents
