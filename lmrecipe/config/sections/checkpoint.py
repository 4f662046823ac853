"""The ``checkpoint`` section: when checkpoints are saved and kept, resuming, mirroring and the end-of-run export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from lmrecipe.config.sections.common import non_negative, positive
from lmrecipe.errors import UserError, fail


@dataclass
class CheckpointConfig:
    every_steps: int = 500
    """Save a resumable checkpoint every this many optimizer steps (and at the end); 0 = end only."""
    keep_last: int = 3
    """Newest checkpoints kept; older ones are deleted (the best by validation loss is kept apart)."""
    resume: str = "auto"
    """auto = newest complete checkpoint in out_dir if any; none = start fresh; or a checkpoint folder."""
    branch_from: Optional[str] = None
    """Start this run (its own ``out_dir``) from a checkpoint of another run: weights, optimizer, step, data
    position and RNG, as a resume takes them, with this recipe's schedule and data (a new mixture continues at the
    same global sample index). The source is only read. Once this run has checkpoints of its own, it resumes from
    them. Needs ``resume=auto``; null = no branch."""
    allow_lr_change: bool = False
    """Let a resume train the checkpoint's next step at another learning rate than its own schedule gave it (a
    finished cosine run lengthened with ``train.max_steps`` restarts near its peak); false = such a resume stops with
    the ways on (docs/checkpoints.md). A branch (``branch_from``) has a schedule of its own and needs no permission."""
    export_at_end: bool = True
    """Write a Hugging Face export (sharded safetensors + tokenizer) to ``out_dir/export`` at the end."""
    export_dtype: Literal["bf16", "fp32"] = "bf16"
    """Weight dtype of the export."""
    max_shard_size: str = "2GB"
    """Largest safetensors shard of the export (e.g. 500MB, 5GB)."""
    export_weights: Literal["raw", "ema"] = "raw"
    """Weights of the end-of-run export: the trained ones, or their moving average (needs ``train.ema_decay`` > 0)."""
    background_save: bool = False
    """Write checkpoints on a background thread: the loop waits only while the state is copied to CPU memory (the
    YAML key ``async`` would be a Python keyword, hence the name). At most one write is in flight; ``latest`` moves
    once every rank's files are written. Under DeepSpeed the collective part of the save (ZeRO-3's gathers) still
    runs at the step; the files are written in the background."""
    remote: Optional[str] = None
    """Object storage the checkpoints are mirrored to, as an fsspec URL (``s3://BUCKET/PREFIX``, ``gs://...``,
    ``file:///...``; S3 reads ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``): each published checkpoint is uploaded in the background (its ``latest`` written
    last, ``keep_last`` applied there too), the export and report at the end; ``resume=auto`` downloads a newer
    remote checkpoint onto a fresh node. Needs ``pip install -e ".[remote]"``. null = local only."""
    remote_wait_s: float = 600.0
    """Seconds the end of a run (or a crash) waits for uploads to ``remote`` still in flight; what is not uploaded by
    then is named, and a later session of this run that trains (a resume) uploads it."""

    def validate(self) -> None:
        non_negative(self, "every_steps")
        positive(self, "keep_last")
        non_negative(self, "remote_wait_s")
        try:
            parse_shard_size(self.max_shard_size)
        except UserError as err:
            raise fail(f"checkpoint.max_shard_size: {err}") from None


def parse_shard_size(size: str | int) -> int:
    """Bytes in a shard size such as ``"2GB"`` or ``"500MB"`` (decimal units, as huggingface_hub reads them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip().upper()
        try:
            value = int(float(text[:-2]) * units[text[-2:]]) if text[-2:] in units else int(text)
        except ValueError:
            value = 0
    if value <= 0:
        raise fail(f"Shard size {size!r} is not a size: write a number with KB, MB, GB or TB, e.g. 2GB or 500MB.")
    return value
