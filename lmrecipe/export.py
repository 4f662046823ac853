"""Hugging Face exports of training checkpoints, and loading a checkpoint or an export for evaluation.

An export folder holds ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` (the index
form also for a single shard), ``config.json``, ``generation_config.json`` and the tokenizer files: what
``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` and inference servers load; and ``README.md``, a model
card (Hugging Face's YAML front matter, then the shape, data, losses and training command, from the checkpoint's
record and its run folder), written inside the folder before it is published.

Weights always come from a checkpoint on disk, never from a live engine, so one code path serves the end of
training and ``tools/export_hf.py``: DeepSpeed ZeRO-1/2/3 shards are consolidated offline by DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` (the fp32 master weights; it works for any rank count and whether
or not ZeRO-3 gathered 16-bit weights at save time), those of DeepSpeed AutoEP or tensor parallelism by this recipe's
readers (``checkpoint/readers.py``), the experts whole; checkpoints without DeepSpeed hold ``model.safetensors``.
``weights="ema"`` takes the weight EMA saved beside them instead (``lmrecipe/checkpoint/ema_files.py``; ZeRO-3
partitions are consolidated the same way, offline).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Callable, TypeVar

import torch

from lmrecipe.checkpoint.ema_files import read_ema_state_dict
from lmrecipe.checkpoint.readers import open_source
from lmrecipe.checkpoint.storage import (
    BEST,
    DS_TAG,
    HF_DIR,
    LATEST,
    complete_checkpoints,
    looks_like_checkpoint,
    no_checkpoint_message,
    read_checkpoint,
    resolve_checkpoint,
)
from lmrecipe.checkpoint.storage import follow_pointer as follow_pointer_file
from lmrecipe.checkpoint.tp_split import RECORD_KEY as TP_RECORD
from lmrecipe.config import autoep_size_of, parse_shard_size
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import building_dir, is_disk_full, write_json_atomic, write_text_atomic
from lmrecipe.model.build import MOE_ARCHS, bare_parameter_name, param_counts
from lmrecipe.observe.metrics_log import METRICS_FILE, read_metrics
from lmrecipe.observe.quiet import quiet_prints
from lmrecipe.observe.run_report import config_differences

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WEIGHTS = ("raw", "ema")
INDEX_FILE = "model.safetensors.index.json"
CARD_FILE = "README.md"
"""The export's model card: Hugging Face's YAML front matter, then what the model is and how it was trained."""
# Files of the checkpoint's hf/ folder that are not tokenizer files.
_NOT_TOKENIZER = {"config.json", "meta.json"}


def checkpoint_state_dict(ckpt: Path, dtype: torch.dtype, saved: dict | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict of a training checkpoint in ``dtype``, consolidated in this process (``saved``: its
    ``read_checkpoint`` record, read here when not given).

    Every tensor owns its storage (ZeRO-1/2 consolidation returns views of one flat buffer, which would
    bloat a safetensors file with the whole buffer or fail to save); names that DeepSpeed records as shared (tied
    embeddings) map to one tensor.
    """
    if (ckpt / DS_TAG).is_dir():
        saved = read_checkpoint(ckpt) if saved is None else saved
        tp = int(saved.get("topology", {}).get("tensor_parallel_size", 1))
        if tp > 1:
            return _tensor_parallel_state_dict(ckpt, saved, tp, dtype)
        if autoep_size_of(saved.get("config", {})) is not None:
            return autoep_state_dict(ckpt, dtype, saved["config"]["model"]["arch"])
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            # DeepSpeed reports progress on stdout, which belongs to the caller (eval.py prints JSON there).
            with quiet_prints(stdout=sys.stderr):
                lazy = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=DS_TAG, lazy_mode=True)
        except (ValueError, FileNotFoundError, RuntimeError, KeyError) as err:
            raise fail(f"Cannot consolidate the ZeRO shards of {ckpt}: {err}") from None
        out: dict[str, torch.Tensor] = {}
        first_name: dict[int, str] = {}
        for name, tensor in lazy.items():
            if id(tensor) in first_name:
                out[name] = out[first_name[id(tensor)]]
            else:
                first_name[id(tensor)] = name
                out[name] = tensor.contiguous().to(dtype, copy=True)
        return out
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise fail(f"{ckpt} has neither DeepSpeed shards ({DS_TAG}/) nor model.safetensors: it holds no model weights.")
    from safetensors.torch import load_file

    return {bare_parameter_name(name): tensor.to(dtype, copy=True) for name, tensor in load_file(weights).items()}


def _autoep_router_buffers(ds_dir: Path) -> dict[str, torch.Tensor]:
    """The AutoEP routers' buffers (DeepSeek-V3's ``e_score_correction_bias``, which AutoEP copies from the class's
    gate) under the class's names (``mlp.gate.``), in fp32 as the class keeps them. A buffer is not a parameter, so
    the optimizer shards lack it; every rank's model-states file holds it whole (rank 0's is read)."""
    files = sorted(p for p in ds_dir.glob("*model_states.pt") if not p.name.startswith("layer_"))
    if not files:
        return {}
    states = torch.load(files[0], map_location="cpu", weights_only=False)
    module = states.get("module") or {}
    return {bare_parameter_name(name).replace(".router.", ".gate."): module[name].float().clone()
            for name in states.get("buffer_names") or () if ".router." in name and name in module}


def autoep_state_dict(ckpt: Path, dtype: torch.dtype, arch: str) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of a ZeRO-1/2/3 checkpoint of DeepSpeed AutoEP layers of model class ``arch``, in
    ``dtype``: the fp32 master weights (``readers.py``: every expert whole, whatever the expert-parallel size), each
    MoE layer's router and shared expert under the class's names (``mlp.gate.weight``, ``model.MOE_ARCHS``), and its
    experts' gate ``w1`` and up ``w3`` (``[experts, ffn, hidden]``) stacked into the class's fused ``gate_up_proj
    [experts, 2 ffn, hidden]``, down ``w2`` as ``down_proj``."""
    source = open_source(ckpt, deepspeed_dir=ckpt / DS_TAG, param_names=[])
    try:
        layers = [name.removesuffix(".experts.w1") for name in source.shapes if name.endswith(".experts.w1")]
        if not layers:
            raise fail(f"{ckpt} holds no DeepSpeed AutoEP experts (experts.w1/w2/w3), though its run trained with "
                       "distributed.expert_layer=autoep: it was written by different code.")
        shared = dict(zip(("shared_experts", "shared_experts_gate"), MOE_ARCHS[arch].shared_modules))
        out = {}
        for name in source.shapes:
            layer = next((p for p in layers if name.startswith(f"{p}.")), None)
            if layer is None:
                out[name] = source.read("fp32", name).to(dtype)
                continue
            module, _, rest = name[len(layer) + 1:].partition(".")
            if module == "router":  # AutoEP's router holds the class's gate as its own linear: router.gate.weight
                out[f"{layer}.gate.{rest.removeprefix('gate.')}"] = source.read("fp32", name).to(dtype)
            elif module in shared:
                out[f"{layer}.{shared[module]}.{rest}"] = source.read("fp32", name).to(dtype)
        for layer in layers:
            w1, w2, w3 = (source.read("fp32", f"{layer}.experts.{w}") for w in ("w1", "w2", "w3"))
            out[f"{layer}.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1).to(dtype)
            out[f"{layer}.experts.down_proj"] = w2.to(dtype)
        out.update(_autoep_router_buffers(ckpt / DS_TAG))
        return out
    finally:
        source.close()


def _tensor_parallel_state_dict(ckpt: Path, saved: dict, tp: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The fp32 masters of a tensor-parallel checkpoint, each split parameter's slices concatenated
    (``checkpoint/tp_split.py``): DeepSpeed's ``zero_to_fp32`` reads one tensor-parallel rank only."""
    source = open_source(ckpt, deepspeed_dir=ckpt / DS_TAG, param_names=[],
                         tensor_parallel=(tp, saved.get(TP_RECORD, {})))
    try:
        return {name: source.read("fp32", name).to(dtype, copy=True) for name in source.shapes}
    finally:
        source.close()


def weights_state_dict(ckpt: Path, dtype: torch.dtype, weights: str = "raw",
                       saved: dict | None = None) -> dict[str, torch.Tensor]:
    """The trained weights (``raw``) or their moving average (``ema``) of a checkpoint, full, by name, in ``dtype``
    (``saved``: the checkpoint's ``read_checkpoint`` record, if the caller has it)."""
    if weights not in WEIGHTS:
        raise fail(f"Weights {weights!r} are not known. Choose one of: {', '.join(WEIGHTS)}.")
    return checkpoint_state_dict(ckpt, dtype, saved) if weights == "raw" else read_ema_state_dict(ckpt, dtype)


def _match_model_keys(state_dict: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Fill tied names left out at save time and check the names are exactly the model's."""
    expected = set(model.state_dict().keys())
    state_dict = dict(state_dict)
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target not in state_dict and source in state_dict:
            state_dict[target] = state_dict[source]
        elif source not in state_dict and target in state_dict:
            state_dict[source] = state_dict[target]
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise fail(
            f"The checkpoint's weights do not fit its model config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}. The checkpoint was written by different code or is damaged."
        )
    return state_dict


def _hf_config_and_tokenizer(ckpt: Path):
    from transformers import AutoConfig, AutoTokenizer

    hf_dir = ckpt / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise fail(f"{ckpt} has no {HF_DIR}/config.json: it was not written by this recipe's checkpointer.")
    return AutoConfig.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir)


T = TypeVar("T")
_MAX_VANISHED = 8
"""Checkpoints that may disappear under one reader (a run saving and pruning fast) before it gives up."""


def follow_pointer(path: Path) -> Path:
    """The checkpoint a ``checkpoints/latest`` or ``checkpoints/best`` pointer file names, when given that file
    instead of a folder; any other path as it is."""
    if not (path.is_file() and path.name in (LATEST, BEST)):
        return path
    return follow_pointer_file(path, f"Pass a checkpoint folder ({path.parent}/step_N) or the run folder for its "
                                     "newest checkpoint.")


def _next_checkpoint(path: Path, tried: list[Path]) -> Path | None:
    """The checkpoint to read for ``path`` (a checkpoint, or a run or ``checkpoints`` folder: the one ``latest``
    names, else the newest complete one) that is not in ``tried``; None when there is none."""
    if not tried:
        ckpt = resolve_checkpoint(path)  # a damaged pointer is the user's to know of, as on resume
        return ckpt if looks_like_checkpoint(ckpt) else None
    if path in tried:
        return None  # a checkpoint given itself has no next
    try:
        ckpt = resolve_checkpoint(path)
    except UserError:
        ckpt = None  # the pointer moves while the run saves
    if ckpt is not None and ckpt not in tried and looks_like_checkpoint(ckpt):
        return ckpt
    for root in (path, path / "checkpoints"):
        left = [c.path for c in complete_checkpoints(root) if c.path not in tried]
        if left:
            return left[-1]
    return None


def read_newest(path: str | Path, read: Callable[[Path], T]) -> tuple[Path, T] | None:
    """``(checkpoint, read(checkpoint))`` for the checkpoint ``path`` names (see :func:`_next_checkpoint`; a pointer
    file too), or None when it names none.

    A running run deletes old checkpoints as it saves (``checkpoint.keep_last``): one that disappears while ``read``
    reads it gives way to the newest left. Errors of a checkpoint that is still there are raised as they are.
    """
    path = follow_pointer(Path(path))
    tried: list[Path] = []
    while len(tried) <= _MAX_VANISHED:
        ckpt = _next_checkpoint(path, tried)
        if ckpt is None:
            break
        try:
            return ckpt, read(ckpt)
        except Exception:
            if ckpt.exists():
                raise
            logger.warning("%s was deleted while it was read (its run prunes old checkpoints as it saves); reading "
                           "the newest one left", ckpt)
            tried.append(ckpt)
    if not tried:
        return None
    if tried == [path]:
        raise fail(f"Checkpoint {path} was deleted while it was read: its run deletes old checkpoints as it saves new "
                   "ones (checkpoint.keep_last). Pass the run folder for its newest checkpoint, or copy the checkpoint "
                   "out of the run first.")
    raise fail(f"{path}: checkpoint {', '.join(c.name for c in tried)} {'was' if len(tried) == 1 else 'were'} deleted "
               "while being read (the run saves and prunes, checkpoint.keep_last), and no complete one is left. Run "
               "the command again, or copy a checkpoint out of the run first.")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = "bf16",
                      max_shard_size: str | int = "2GB", overwrite: bool = False, weights: str = "raw") -> Path:
    """Write a Hugging Face model folder from a training checkpoint (or a run folder: its newest checkpoint).

    ``weights``: ``raw`` (the trained weights) or ``ema`` (their moving average; UserError if the checkpoint has none).

    Runs in one process. Inside a training process, unset transformers' ZeRO-3 config first, or model
    construction enters ``zero.Init`` and waits for every rank.
    """
    if dtype not in DTYPES:
        raise fail(f"Export dtype {dtype!r} is not supported. Choose one of: {', '.join(DTYPES)}.")
    done = read_newest(checkpoint, lambda ckpt: _export(ckpt, Path(out_dir), dtype, max_shard_size, overwrite, weights))
    if done is None:
        raise fail(f"{no_checkpoint_message(Path(checkpoint))} Pass a checkpoint folder (out_dir/checkpoints/step_N), "
                   "or a run folder that saved one.")
    return done[1]


def _export(ckpt: Path, out: Path, dtype: str, max_shard_size: str | int, overwrite: bool, weights: str) -> Path:
    saved = read_checkpoint(ckpt)
    check_export_target(out, [ckpt], overwrite)
    shard_bytes = parse_shard_size(max_shard_size)
    state_dict = weights_state_dict(ckpt, DTYPES[dtype], weights, saved)
    write_export(out, state_dict, ckpt, dtype=dtype, max_shard_size=shard_bytes,
                 card=lambda n_params, n_active: model_card(ckpt, saved, n_params, dtype, weights, n_active=n_active),
                 what=f"exporting {ckpt}",
                 retry=f"python tools/export_hf.py {ckpt} {out} --dtype {dtype} --weights {weights} --overwrite")
    logger.info("Exported %s to %s (%s, %s weights)", ckpt, out, dtype, weights)
    return out


def check_export_target(out: Path, checkpoints: list[Path], overwrite: bool) -> None:
    """UserError when export folder ``out`` lies inside one of ``checkpoints`` (what it is made from), or exists and
    is not empty without ``overwrite``."""
    for ckpt in checkpoints:
        if out.resolve() == ckpt.resolve() or ckpt.resolve() in out.resolve().parents:
            raise fail(f"Export folder {out} lies inside the checkpoint {ckpt}; choose a folder outside it.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise fail(f"{out} already exists and is not empty. Choose another folder or pass --overwrite to replace it.")


def write_export(out: Path, state_dict: dict[str, torch.Tensor], ckpt: Path, *, dtype: str, max_shard_size: int,
                 card: Callable[[int, int], str], what: str, retry: str) -> Path:
    """Write the Hugging Face folder ``out`` (replacing it) from ``state_dict`` (in ``dtype``) with the transformers
    config and tokenizer of checkpoint ``ckpt``, and the model card ``card(n_params, n_active)`` (the parameters, and
    those one token passes through: fewer for an MoE model): built in a temporary folder that is renamed into place.
    ``what`` and ``retry``: the work and the command to name when the disk is full."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = DTYPES[dtype]
    hf_config, tokenizer = _hf_config_and_tokenizer(ckpt)
    hf_config.use_cache = True  # training turns the KV cache off; generation wants it
    hf_config.bos_token_id, hf_config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    hf_config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):  # only the class, config and names are needed; the weights are state_dict
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
    state_dict = _match_model_keys(state_dict, model)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    existed = out.exists()
    tensors = {id(t): t for t in state_dict.values()}.values()  # tied weights once
    size, n_params = sum(t.numel() * t.element_size() for t in tensors), sum(t.numel() for t in tensors)
    counts = param_counts(model)
    n_active = n_params - (counts["total"] - counts["active"])  # the routed experts a token does not pass through
    try:
        with building_dir(out, overwrite=True) as tmp:
            with quiet_prints():
                model.save_pretrained(tmp, state_dict=state_dict, max_shard_size=max_shard_size)
            _index_single_shard(tmp)
            for file in (ckpt / HF_DIR).iterdir():
                if file.is_file() and file.name not in _NOT_TOKENIZER:
                    shutil.copy2(file, tmp / file.name)
            # Inside the temporary folder: the card is published with the weights it describes, or not at all.
            write_text_atomic(tmp / CARD_FILE, card(n_params, n_active))
    except Exception as err:  # safetensors reports a full disk as its own error type, torch as a RuntimeError
        if not is_disk_full(err):
            raise
        kept = f"{out} is unchanged" if existed else f"nothing was left at {out}"
        raise fail(
            f"No space left on the device while {what} to {out} ({err}). The partial export was removed and "
            f"{kept}; what it is made from is intact. Free about {size / 1e6:.1f} MB (the weights in {dtype}) or choose a "
            f"folder on a larger disk, then run: {retry}"
        ) from None
    return out


def _run_folder(ckpt: Path) -> Path | None:
    """The run folder a checkpoint lies in (``out_dir/checkpoints/step_N``), when it is still there."""
    run = ckpt.parent.parent
    return run if ckpt.parent.name == "checkpoints" and (run / "config.yaml").is_file() else None


def _data_sources(config: dict) -> list[tuple[str, str, float | None]]:
    """(name, folder, mixture weight) of each training data source; the name is the corpus its folder's
    ``meta.json`` names (``source``), else the folder's name."""
    data = config.get("data", {})
    listed = data.get("sources") or [{"name": None, "path": data.get("path"), "weight": None}]
    sources = []
    for source in listed:
        folder = str(source.get("path"))
        name = source.get("name")
        try:
            name = name or json.loads((Path(folder) / "meta.json").read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            pass
        sources.append((str(name or Path(folder).name), folder, source.get("weight")))
    return sources


def _training_data(config: dict, step: int) -> list[str]:
    """The card's "Training data" lines: the sources, and for a staged mixture (``data.stages``) its stages, the
    sources' own weights then being the validation mean's; the stages a checkpoint at ``step`` has not reached are
    marked."""
    stages = config.get("data", {}).get("stages") or []
    label = "validation weight" if stages else "weight"
    lines = [f"- {name} (`{folder}`)" + (f", {label} {weight:.4g}" if weight is not None else "")
             for name, folder, weight in _data_sources(config)]
    if not stages:
        return lines
    lines += ["", "Staged mixture: the training weights from each stage's first step on."]
    for stage in stages:
        weights = ", ".join(f"{name} {weight:.4g}" for name, weight in stage.get("weights", {}).items())
        reached = "" if int(stage["start_step"]) < step else f" (not reached: the weights are of step {step})"
        lines.append(f"- from step {stage['start_step']}: {weights}{reached}")
    return lines


def _mlp_shape(hf: dict, arch: str) -> str:
    """The MLP part of the card's shape line: for an MoE model its experts, how many route each token, an expert's
    width and the shared expert's."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    if not experts:
        return f"MLP {hf.get('intermediate_size')}"
    keys = MOE_ARCHS.get(arch)
    width = hf.get(keys.expert_width if keys else "moe_intermediate_size") or hf.get("intermediate_size")
    shared = hf.get(keys.shared_width) if keys and keys.shared_width else None
    if shared and keys.shared_count:  # DeepSeek-V3 counts its shared experts, each of one expert's width
        shared *= width
    return (f"MoE MLP: {experts} experts of width {width}, each token routed to the top "
            f"{hf.get('num_experts_per_tok')}{f', and a shared expert of width {shared}' if shared else ''}")


def _final_figures(run: Path | None, step: int, saved: dict) -> dict:
    """The last training loss, validation loss and task scores logged at or before ``step`` (metrics.jsonl of the
    run folder; without it, the checkpoint's own validation loss)."""
    figures = {"val_loss": saved.get("val_loss"), "val_step": step if saved.get("val_loss") is not None else None}
    rows = [r for r in read_metrics(run / METRICS_FILE) if r.get("step", 0) <= step] if run else []
    train_rows, val_rows = [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]
    if train_rows:
        figures.update(loss=train_rows[-1]["loss"], loss_step=train_rows[-1]["step"])
    if val_rows:
        figures.update(val_loss=val_rows[-1]["val_loss"], val_step=val_rows[-1]["step"],
                       tasks={k.split("/", 1)[1]: v for k, v in val_rows[-1].items() if k.startswith("acc/")})
    return figures


def _training_command(run: Path | None, config: dict) -> str:
    """The command that trained the run: its recipe and the overrides that differ from it (``run_meta.json``);
    without the recipe file, the run's own resolved ``config.yaml`` as the recipe."""
    import shlex

    meta = {}
    if run is not None and (run / "run_meta.json").is_file():
        meta = json.loads((run / "run_meta.json").read_text())
    recipe = meta.get("recipe")
    if recipe and Path(recipe).is_file():
        changed, _ = config_differences(config, recipe)
        overrides = [f"{key}={'null' if value is None else value if isinstance(value, str) else json.dumps(value)}"
                     for key, _, value in changed]
        command = ["train.py", recipe, *overrides]
    else:
        command = ["train.py", str(run / "config.yaml") if run else "CONFIG.yaml"]
    world_size = int(meta.get("world_size") or 1)
    launcher = (["accelerate", "launch", "--multi_gpu", "--num_processes", str(world_size)] if world_size > 1
                else ["python"])
    return " ".join(shlex.quote(part) for part in launcher + command)


def model_card(ckpt: Path, saved: dict, n_params: int, dtype: str, weights: str, described: str | None = None,
               n_active: int | None = None) -> str:
    """The export's ``README.md``, from the checkpoint's record (``saved``) and its run folder (``config.yaml``,
    ``run_meta.json``, ``metrics.jsonl``) when it is still beside it. ``described``: what the weights are, when
    not ``weights`` of ``ckpt`` (an average of checkpoints); ``n_active``: the parameters one token passes through,
    named when fewer than ``n_params`` (an MoE model)."""
    import yaml

    config, hf, state = saved["config"], saved.get("hf_config", {}), saved["state"]
    run, step = _run_folder(ckpt), int(state["step"])
    arch = hf.get("model_type") or config.get("model", {}).get("arch", "causal-lm")
    sources = _data_sources(config)
    front = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["causal-lm", arch, "lmrecipe"]}
    # The Hub reads ``datasets`` as dataset names: a corpus named by its local folder is listed in the body only.
    if named := [name for name, _, _ in sources if not name.startswith(("/", ".", "~"))]:
        front["datasets"] = named
    figures = _final_figures(run, step, saved)
    init_from = config.get("model", {}).get("init_from")

    def fmt(value, digits=4):
        return "n/a" if value is None else f"{value:.{digits}f}"

    shape = (f"{hf.get('num_hidden_layers')} layers, hidden size {hf.get('hidden_size')}, "
             f"{hf.get('num_attention_heads')} attention heads ({hf.get('num_key_value_heads')} key/value), "
             f"{_mlp_shape(hf, arch)}, vocabulary {hf.get('vocab_size')}, context "
             f"{config.get('data', {}).get('seq_len')} tokens (positions up to {hf.get('max_position_embeddings')})")
    active = f"; {n_active:,} active per token" if n_active is not None and n_active < n_params else ""
    rows = [f"| training loss (step {figures.get('loss_step')}) | {fmt(figures.get('loss'))} |",
            f"| validation loss (step {figures.get('val_step')}) | {fmt(figures.get('val_loss'))} |"]
    rows += [f"| {task} accuracy | {fmt(score)} |" for task, score in sorted(figures.get("tasks", {}).items())]
    name = run.name if run else ckpt.name
    branch = saved.get("branched_from")
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {name}", "",
        f"A {arch} causal language model with {n_params:,} parameters ({n_params / 1e6:.2f}M{active}), trained "
        f"{f'from {init_from} ' if init_from else 'from scratch '}by lmrecipe for {step:,} optimizer steps on "
        f"{int(state.get('tokens_seen', 0)):,} tokens. The weights are "
        f"{described or ('the trained weights' if weights == 'raw' else 'the moving average of the trained weights')}"
        f"{'' if described else f' of checkpoint `{ckpt.name}`'}, stored in {dtype}.", "",
        *([f"Branched at step {branch.get('step')} from checkpoint `{branch.get('checkpoint')}` of the run "
           f"`{branch.get('out_dir')}`.", ""] if branch else []),
        "## Model", "", f"{shape}.", "",
        "## Training data", "", *_training_data(config, step), "",
        "## Results", "", "| figure | value |", "|---|---|", *rows, "",
        "## Training command", "", "```", _training_command(run, config), "```", "",
        "## Use", "", "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_TO_THIS_FOLDER")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_TO_THIS_FOLDER")',
        'inputs = tokenizer("def main():", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=32)[0]))", "```", "",
    ])


def _safetensors_layout(path: Path) -> tuple[dict, int]:
    """The header of a safetensors file and the size the file must have; UserError if unreadable."""
    try:
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as err:
        raise fail(f"{path} is not a readable safetensors file ({err!r}); it is truncated or damaged.") from None
    return header, 8 + header_len + end


def _index_single_shard(folder: Path) -> None:
    """Give a one-file export the same sharded names and index as a multi-file one."""
    single = folder / "model.safetensors"
    if not single.is_file() or (folder / INDEX_FILE).exists():
        return
    header, _ = _safetensors_layout(single)
    name = "model-00001-of-00001.safetensors"
    os.rename(single, folder / name)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    index = {
        "metadata": {"total_size": sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors.values())},
        "weight_map": {k: name for k in sorted(tensors)},
    }
    write_json_atomic(folder / INDEX_FILE, index)


def check_export(path: Path) -> None:
    """UserError unless ``path`` is a complete Hugging Face model folder (config and every weight shard)."""
    if not (path / "config.json").is_file():
        raise fail(
            f"{path} is neither a training checkpoint (no train_state.json) nor a Hugging Face export (no config.json). "
            "Pass an export folder (e.g. out_dir/export) or a checkpoint (e.g. out_dir/checkpoints/step_00001000)."
        )
    index = path / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as err:
            raise fail(f"{index} is not a valid safetensors index ({err!r}).") from None
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise fail(f"{path} has config.json but no model.safetensors or {INDEX_FILE}: the export has no weights.")
    for shard in shards:
        file = path / shard
        if not file.is_file():
            raise fail(f"Export {path} is incomplete: {shard}, listed in {INDEX_FILE}, is missing. Export it again.")
        _, size = _safetensors_layout(file)
        if file.stat().st_size != size:
            raise fail(f"Export {path} is damaged: {shard} holds {file.stat().st_size} bytes but its header "
                       f"describes {size} (truncated). Export it again.")


def load_for_inference(path: str | Path, dtype: torch.dtype = torch.float32, weights: str = "raw"):
    """Model (eval mode), tokenizer and training seq_len from an export folder or a training checkpoint (or a run
    folder, or its ``checkpoints/latest`` pointer file: the newest checkpoint, read as :func:`read_newest` reads).

    A checkpoint is consolidated in memory exactly as the export would be, so evaluation needs no DeepSpeed
    engine and no export step; ``weights`` picks its trained weights or their EMA (an export has one set).
    Returns ``(model, tokenizer, seq_len)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = follow_pointer(Path(path))
    if not path.is_dir():
        raise fail(f"{str(path)!r} does not exist or is not a folder. Pass an export folder or a training checkpoint.")
    loaded = read_newest(path, lambda ckpt: _load_checkpoint(ckpt, dtype, weights))
    if loaded is not None:
        model, tokenizer, seq_len = loaded[1]
    else:
        if weights != "raw":
            raise fail(f"{path} is an export, which holds one set of weights: --weights {weights} applies to a "
                       "training checkpoint.")
        check_export(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise fail(f"Cannot load the export {path}: {err}") from None
        seq_len = int(model.config.max_position_embeddings)
    model.config.use_cache = True
    return model.eval(), tokenizer, seq_len


def _load_checkpoint(ckpt: Path, dtype: torch.dtype, weights: str):
    from transformers import AutoModelForCausalLM

    saved = read_checkpoint(ckpt)
    hf_config, tokenizer = _hf_config_and_tokenizer(ckpt)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.load_state_dict(_match_model_keys(weights_state_dict(ckpt, dtype, weights, saved), model), strict=True)
    return model, tokenizer, int(saved["config"]["data"]["seq_len"])
