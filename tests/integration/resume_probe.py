"""Resume a run the way ``train.py`` does, then write one parameter's fp32 weight, AdamW moments and step count.

Usage, under any launcher: ``resume_probe.py OUT.safetensors PARAM_NAME RECIPE [key=value ...]``. Every rank takes
part (ZeRO gathers collectively); the main process writes ``OUT``. The values are read back through the
optimizer itself (DeepSpeed's ``safe_get_full_*`` or the torch optimizer's state), not through the loader.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmrecipe.cli import setup_logging
from lmrecipe.config import load_config
from lmrecipe.train.callbacks.checkpointing import build_checkpointer
from lmrecipe.train.setup import build_run
from lmrecipe.train.state import TrainState


def main() -> None:
    out, name, recipe, *overrides = sys.argv[1:]
    setup_logging()
    cfg = load_config(recipe, overrides)
    run = build_run(cfg, Path(cfg.out_dir))
    build_checkpointer(run, Path(cfg.out_dir)).maybe_resume(run.model, run.optimizer, TrainState())
    param = dict(run.accelerator.unwrap_model(run.model).named_parameters())[name]
    if run.runtime.topology.zero.deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        values = {"fp32": safe_get_full_fp32_param(param), "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
                  "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq")}
        zero = run.model.optimizer
        flats = zero.fp32_partitioned_groups_flat if run.runtime.topology.zero.stage == 3 else zero.single_partition_of_fp32_groups
        steps = [float(zero.optimizer.state[flat]["step"]) for flat in flats]
    else:
        state = run.optimizer.optimizer.state[param]
        values = {"fp32": param, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        steps = [float(s["step"]) for s in run.optimizer.optimizer.state.values()]
    values["steps"] = torch.tensor(steps)
    if run.accelerator.is_main_process:
        save_file({k: v.detach().float().cpu().contiguous() for k, v in values.items()}, out)
    run.prefetcher.close()
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()  # every rank tears the process group down after the barrier


if __name__ == "__main__":
    main()
