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

Staged mixtures (``data.stages``): stage ``k`` starts at optimizer step ``s_k``, i.e. at global sample
``start(s_k)`` (``s_k x G``, or where the batch-size ramp puts it), and its samples follow stage ``k``'s pattern
from there, each source's own index continuing where the earlier stages left it
(:class:`~lmrecipe.data.order.StagedMixtureOrder`): still a pure function of the global sample index. A stage is
thus a range of the data order: after a spike's rollback skipped some samples, optimizer steps reach a stage's samples
a step or two earlier than ``s_k``. Metrics rows carry the ``stage`` of the step's samples; validation is unchanged
(``data.sources[].weight`` weighs its mean).

All sources must share one tokenizer (vocabulary size, EOS id, token dtype and ``tokenizer.json``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from lmrecipe.config import DataConfig, DataSource
from lmrecipe.data.batches import BatchLayout, BatchRamp, MixtureBatches, TrainBatches, ValBatches
from lmrecipe.data.format import load_meta, open_data, read_meta_file
from lmrecipe.data.order import MIX_BLOCK, StagedMixtureOrder
from lmrecipe.data.remote import staged_path
from lmrecipe.data.tokenizer import check_same_tokenizer, tokenizer_signature
from lmrecipe.errors import UserError, fail

logger = logging.getLogger(__name__)


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
    stage_starts: list[int] | None = None
    """Start step of each stage of a staged mixture (``data.stages``); None without stages."""

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
        """``tokens_seen/<name>`` after ``step`` steps, for a mixture (empty for one folder: ``tokens_seen`` says it);
        a staged mixture adds ``stage``, the stage of step ``step``'s samples (1-based ``step``: the step just run)."""
        if not self.is_mixture:
            return {}
        counts = self.train_batches.samples_seen(step)
        row = {f"tokens_seen/{n}": int(c) * self.seq_len for n, c in zip(self.names, counts)}
        if self.stage_starts:
            row["stage"] = self.train_batches.stage(max(step - 1, 0))
        return row

    def mixture_signature(self) -> list[dict] | None:
        """What a checkpoint records of a mixture (None for one folder); a resume must keep names and quotas."""
        if not self.is_mixture:
            return None
        quotas = self.train_batches.order.quotas
        return [{"name": n, "path": str(p), "weight": w, "quota": int(q), "train_sha256": sha}
                for n, p, w, q, sha in zip(self.names, self.paths, self.weights, quotas, self.train_sha256)]

    def stages_signature(self) -> list[dict] | None:
        """A staged mixture's stages as a checkpoint records them: start step, first sample, quota of each source."""
        if not self.stage_starts:
            return None
        order = self.train_batches.order
        return [{"start_step": step, "start_sample": int(first), "quotas": [int(q) for q in stage.quotas]}
                for step, first, stage in zip(self.stage_starts, order.bounds, order.stages)]


    def signature(self) -> dict:
        """What a checkpoint records of its data: the tokenizer signature (a resume must keep it), the training split's
        sha256 (a change is a warning), the sample order's version (a resume continues in it) and, for a mixture, its
        sources (a resume must keep names and quotas)."""
        meta = read_meta_file(self.tokenizer_dir)
        signature = {**tokenizer_signature(self.tokenizer_dir, meta),
                     "train_sha256": meta.get("splits", {}).get("train", {}).get("sha256"),
                     "order_version": self.train_batches.order_version}
        if not self.is_mixture:
            return signature
        stages = self.stages_signature()
        return {**signature, "mixture": self.mixture_signature(), **({"stages": stages} if stages else {})}

    def probe_ids(self, n_tokens: int):
        """A fixed input to record the model's logits on: the first ``n_tokens`` of the first validation window."""
        return next(iter(self.val_sets.values())).windows.batch([0])[0][:, :n_tokens]

    def tokenizer_files(self) -> list[Path]:
        """The tokenizer files and meta.json an export or an evaluation needs (not the tokens)."""
        return sorted(f for f in self.tokenizer_dir.iterdir() if f.is_file() and f.suffix not in (".bin", ".idx"))


def _where(data: DataConfig, i: int, source: DataSource) -> str:
    return f"data.sources[{i}] ({source.resolved_name()}, {source.path})" if data.is_mixture() else ""


def local_sources(data: DataConfig) -> list[DataSource]:
    """``data.source_list()`` with every source given as a URL replaced by its local copy in ``data.cache_dir``
    (downloaded and verified first when needed: ``lmrecipe/data/remote.py``); a source keeps its name."""
    sources = data.source_list()
    what = [f"data.sources[{i}].path" if data.is_mixture() else "data.path" for i in range(len(sources))]
    return [s if (local := staged_path(s.path, data.cache_dir, w)) == s.path else
            DataSource(path=local, weight=s.weight, name=s.resolved_name()) for s, w in zip(sources, what)]


def check_sources(data: DataConfig) -> dict:
    """Check every source folder's meta.json and that all share one tokenizer; return the first's meta.json.

    Reads only meta.json, file sizes and tokenizer.json: called before the run touches ``out_dir``.
    """
    sources = local_sources(data)
    metas = []
    for i, source in enumerate(sources):
        try:
            metas.append(load_meta(source.path))
        except UserError as err:
            raise (fail(f"{_where(data, i, source)}: {err}") if data.is_mixture() else err) from None
    first = tokenizer_signature(sources[0].path, metas[0]) if len(sources) > 1 else None
    for i, (source, meta) in enumerate(zip(sources[1:], metas[1:]), start=1):
        check_same_tokenizer(
            first, tokenizer_signature(source.path, meta),
            what=f"{_where(data, i, source)} does not share the tokenizer of {_where(data, 0, sources[0])}",
            fix=f"All sources of a mixture must be tokenized alike: re-prepare one with the other's tokenizer, e.g. "
                f"`python tools/prepare_data.py --input CORPUS --tokenizer {sources[0].path} --output {source.path} "
                "--overwrite`.")
    return metas[0]


def open_training_data(data: DataConfig, model_vocab_size: int, layout: BatchLayout, seed: int,
                       val_ranks: tuple[int, int] | None = None, ramp: BatchRamp | None = None,
                       opened_sources: list[tuple[DataSource, tuple]] | None = None) -> TrainingData:
    """Open every source (start-up checks of :func:`lmrecipe.data.format.open_data`) and build the batches.

    ``val_ranks``: (processes, this rank) the validation windows are split over, when they are not the layout's
    data-parallel ranks (sequence parallelism evaluates whole windows on every rank). ``ramp``: a batch-size ramp
    (None: every step takes ``layout.global_batch_size`` samples). ``opened_sources``: every source with what
    ``open_data`` returned for it, when the start-up checks opened them already (they are not opened again).
    """
    if opened_sources is None:
        opened_sources = []
        for i, source in enumerate(local_sources(data)):
            try:
                opened_sources.append((source, open_data(source.path, data.seq_len, model_vocab_size,
                                                         documents=data.document_masking)))
            except UserError as err:
                raise (fail(f"{_where(data, i, source)}: {err}") if data.is_mixture() else err) from None
    sources, opened = [s for s, _ in opened_sources], [o for _, o in opened_sources]
    names = [s.resolved_name() for s in sources]
    total = sum(s.weight for s in sources)
    weights = [s.weight / total for s in sources]
    val_world, val_rank = val_ranks or (layout.world_size, layout.rank)
    val_sets = {name: ValBatches(val, data.val_windows, layout.micro_batch_size, val_world, val_rank,
                                 documents=data.document_masking)
                for name, (_, _, val) in zip(names, opened)}
    train = [windows for _, windows, _ in opened]
    ramp = ramp or BatchRamp([(0, layout.global_batch_size)])
    staged = None
    if data.stages:
        starts = [step for step, _ in data.stage_weights()]
        staged = StagedMixtureOrder([ramp.start(step) for step in starts], [w for _, w in data.stage_weights()])
        logger.info("Data stages: %s", "; ".join(
            f"from step {step}: " + ", ".join(f"{n} {100 * w / sum(ws):.1f}%" for n, w in zip(names, ws) if w > 0)
            for step, ws in data.stage_weights()))
    if data.is_mixture():
        batches = MixtureBatches(train, names, weights, layout, seed, order=staged)
        stages = staged.stages if staged is not None else [batches.order]
        for (step, stage_weights), stage in zip(data.stage_weights(), stages):
            total = sum(stage_weights)
            for name, weight, quota in zip(names, (w / total for w in stage_weights), stage.quotas):
                if weight > 0 and quota == 0:
                    logger.warning("Source %s has weight %.3g%s, below 1/%d of the mixture: it gets no training "
                                   "samples.", name, weight, f" from step {step}" if staged is not None else "",
                                   MIX_BLOCK)
        logger.info("Data mixture%s: %s", " (the validation mean's weights; training follows the stages)"
                    if staged is not None else "", ", ".join(
            f"{n} {100 * w:.1f}% ({len(t):,} windows)" for n, w, t in zip(names, weights, train)))
    else:
        batches = TrainBatches(train[0], layout, seed)
    batches.documents = data.document_masking
    batches.ramp = ramp
    return TrainingData(names=names, paths=[Path(s.path) for s in sources], weights=weights, seq_len=data.seq_len,
                        train_batches=batches, val_sets=val_sets, n_train_windows=sum(len(t) for t in train),
                        train_sha256=[meta["splits"]["train"].get("sha256") for meta, _, _ in opened],
                        stage_starts=[stage.start_step for stage in data.stages] or None)
