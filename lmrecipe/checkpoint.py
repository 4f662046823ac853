"""Resumable checkpoints, preemption and the end-of-run export."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from dataclasses import asdict, fields
from pathlib import Path

import torch

from .config import Config
from .errors import fail

logger = logging.getLogger(__name__)

#: Exit code after a SIGTERM/SIGUSR1 stop with a checkpoint saved; slurm/ requeues the job on it.
EXIT_PREEMPTED = 124
STATE_FILE = "train_state.json"


class PreemptionSignal:
    """Records SIGTERM / SIGUSR1 so the loop can finish its step, save and exit."""

    def __init__(self):
        self.name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def requested(self, accelerator) -> bool:
        """True on every rank when any rank got the signal (one tiny all-reduce)."""
        flag = torch.tensor([1.0 if self.name else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


class Checkpointer:
    def __init__(self, cfg: Config, accelerator, out_dir: Path):
        self.cfg = cfg
        self.accelerator = accelerator
        self.root = out_dir / "checkpoints"

    def _latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not path.is_dir():
            raise fail(f"{pointer} points to {path}, which does not exist. Delete {pointer} or pass checkpoint.resume=PATH.")
        return path

    def maybe_resume(self, model, state) -> str | None:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            return None
        path = self._latest() if resume == "auto" else Path(resume)
        if path is None:
            return None
        if not (path / STATE_FILE).is_file():
            raise fail(f"{path} has no {STATE_FILE}: it is not a complete checkpoint of this recipe.")
        self.accelerator.load_state(str(path))
        saved = json.loads((path / STATE_FILE).read_text())
        for f in fields(state):
            setattr(state, f.name, saved["state"][f.name])
        logger.info("Resumed from %s at step %d", path, state.step)
        return str(path)

    def maybe_save(self, model, state, force: bool = False) -> Path | None:
        every = self.cfg.checkpoint.every_steps
        if not (force or state.step == self.cfg.train.max_steps or (every > 0 and state.step % every == 0)):
            return None
        name = f"step_{state.step:08d}"
        final = self.root / name
        tmp = self.root / f".tmp_{name}"
        if self.accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))  # every rank: DeepSpeed's save has collectives
        if self.accelerator.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps({"state": asdict(state), "config": self.cfg.to_dict()}, indent=2))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            pointer_tmp = self.root / "latest.tmp"
            pointer_tmp.write_text(name)
            os.replace(pointer_tmp, self.root / "latest")
            logger.info("Saved checkpoint %s", final)
        self.accelerator.wait_for_everyone()
        return final

    def maybe_export(self, model, meta: dict) -> Path | None:
        if not self.cfg.checkpoint.export_at_end:
            return None
        out = Path(self.cfg.out_dir) / "export"
        state_dict = self.accelerator.get_state_dict(model)  # every rank: gathers ZeRO-3 shards
        if self.accelerator.is_main_process:
            dtype = torch.bfloat16 if self.cfg.checkpoint.export_dtype == "bf16" else torch.float32
            unwrapped = self.accelerator.unwrap_model(model)
            state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
            unwrapped.save_pretrained(out, state_dict=state_dict, max_shard_size=self.cfg.checkpoint.max_shard_size)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.cfg.data.path).save_pretrained(out)
            logger.info("Exported Hugging Face model to %s", out)
        self.accelerator.wait_for_everyone()
        return out
