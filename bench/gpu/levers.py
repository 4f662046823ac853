"""The ``levers`` stage in one worker process: the 1B run built once, a preamble, then timing windows that switch the
speed levers in place, each on top of the best so far; the ones that cannot be undone (Liger's patches, regional
compile) last; a second engine build for fused AdamW, then the best set at a larger accumulation.

The learning rate is held at 0, so the weights stay at their initial values and the loss of one held micro-batch
(``held_loss``) compares the levers' numerics directly (``held_loss_agrees``: within 1 % of the baseline's, bf16's
tolerance). A window records tokens/s, MFU, the step peak and reserved memory, allocator retries and the attention;
the result is saved after every window.
"""

import contextlib
import gc
import importlib.util
import sys
import time
import traceback
import weakref
from pathlib import Path
from unittest import mock

import _common as C  # bench/, on the PYTHONPATH run.py gives the workers
import table  # beside this file
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

import lmrecipe.train.setup as setup
from lmrecipe.errors import UserError
from lmrecipe.model.attention import SUPPORTED, build_document_attention
from lmrecipe.model.build import compile_layers
from lmrecipe.model.kernels import check_kernels, maybe_apply_kernels
from lmrecipe.model.loss import chunked_head, forward_kwargs, training_loss, use_chunked_loss
from lmrecipe.observe.device import device_peak_tflops, mfu
from lmrecipe.train.step import train_step

GIB = 1024**3
BIG_ACCUM = 16  # micro-batches per step of the last window (the recipe accumulates 64 at 8 GPUs' worth)
CATEGORIES = (  # the first category whose words a kernel's name or its operator's stack (on a CPU: the operator) holds
    ("loss", ("loss_head", "cross_entropy", "log_softmax", "nll_loss", "chunked")),
    ("optimizer", ("lmrecipe/optimizer", "adam", "multi_tensor", "foreach")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("copies", ("memcpy", "memset", "copy_", "aten::cat", "lmrecipe/data")),
    ("matmuls", ("gemm", "cutlass", "nvjet", "cublas", "aten::mm", "addmm", "bmm", "matmul", "linear")),
)


def _cuda(run) -> bool:
    return run.accelerator.device.type == "cuda"


def _bare(run):
    return run.accelerator.unwrap_model(run.model)


def preamble(run) -> dict:
    """cuDNN, the SDPA backend of the masked and causal shapes, one large bf16 GEMM's TFLOP/s, the flash ATen schemas."""
    device, cfg, hf = run.accelerator.device, run.cfg, _bare(run).config
    info = {"cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    q = torch.randn(cfg.train.micro_batch_size, hf.num_attention_heads, cfg.data.seq_len,
                    hf.hidden_size // hf.num_attention_heads, device=device, dtype=torch.bfloat16)
    mask = torch.ones(cfg.data.seq_len, cfg.data.seq_len, dtype=torch.bool, device=device).tril()[None, None]
    for shape, kwargs in (("masked", {"attn_mask": mask.expand(q.shape[0], 1, -1, -1)}), ("causal", {"is_causal": True})):
        with contextlib.suppress(Exception):
            info[f"sdp_choice_{shape}"] = torch.nn.attention.SDPBackend(torch._fused_sdp_choice(q, q, q, **kwargs)).name
    n = 8192 if _cuda(run) else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for repeats in (2, 10):  # a warm-up, then the timed products
        C.sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ a
        C.sync(device)
    info.update(gemm_bf16_tflops=10 * 2 * n**3 / (time.perf_counter() - start) / 1e12, gemm_n=n)
    for op in ("_flash_attention_forward", "_flash_attention_backward"):
        with contextlib.suppress(Exception):
            info[f"schema{op}"] = str(getattr(torch.ops.aten, op).default._schema)
    info["init_std"] = _init_stats(_bare(run))
    return info


def _init_stats(model) -> dict:
    """Mean std of the initial weights per tensor kind (matrices by name, norm gains): the recipe's distribution."""
    kinds: dict[str, list[float]] = {}
    for name, param in model.named_parameters():
        kind = "norm" if param.ndim == 1 else "embedding" if "embed" in name else "head" if "lm_head" in name else \
            "attention" if "attn" in name else "mlp"
        kinds.setdefault(kind, []).append(float(param.detach().float().std()) if param.ndim > 1 else
                                          float(param.detach().float().mean()))
    return {kind: sum(v) / len(v) for kind, v in kinds.items()}


def held_loss(run, batch) -> float:
    """The language-model loss of one held micro-batch with the levers as they are: a training forward (grad mode, so
    compiled layers reuse their graph) without its backward; the weights do not change."""
    inputs, targets, documents = batch
    device = run.accelerator.device
    terms = training_loss(run.model, inputs.to(device), targets.to(device), run.cfg.train.z_loss,
                          forward_kwargs(run.attention, documents, device))
    return float(terms.lm.detach())


def window(run, step: int, warmup: int, steps: int) -> tuple[dict, int]:
    """``warmup`` then ``steps`` optimizer steps from ``step``, timed between two device syncs: the figures (tokens/s,
    MFU, the step peak: ``max_memory_allocated`` less what was held before, ...), and the next step."""
    device, cuda, first = run.accelerator.device, _cuda(run), step + warmup
    for warm in range(step, first):
        train_step(run, warm)
    C.sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device) if cuda else None
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0
    tokens, data_s, start = 0, 0.0, time.perf_counter()
    for timed in range(first, first + steps):
        last = train_step(run, timed)
        tokens, data_s = tokens + last.tokens, data_s + last.data_time_s
    C.sync(device)
    seconds = time.perf_counter() - start
    # On a CPU the peak is a matmul probe, slow and kept up to 16 times per machine: the caller probes if it needs it.
    peak_tflops, peak_source = device_peak_tflops(device, run.runtime.precision, None) if cuda else (None, None)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {"tokens_per_sec": tokens / seconds, "step_time_s": seconds / steps, "tokens_per_step": tokens // steps,
            "mfu": mfu(tokens / seconds, run.flops_per_token, 1, peak_tflops) if cuda else None,
            "peak_tflops": peak_tflops, "peak_source": peak_source, "step_peak_gib": (peak - held) / GIB if cuda else None,
            "peak_gib": peak / GIB if cuda else None, "held_gib": held / GIB if cuda else None,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB if cuda else None,
            "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries if cuda else None,
            "data_wait_s_per_step": data_s / steps, "data_share": data_s / seconds, "loss": float(last.loss)}, first + steps


def profile(run, step: int) -> dict:
    """:func:`profile_by_category`, or the profiler's error (the windows' figures stand without it)."""
    try:
        return profile_by_category(run, step)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}


def profile_by_category(run, step: int) -> dict:
    """One step under ``torch.profiler``: milliseconds per category (:data:`CATEGORIES`, else elementwise) of the GPU
    kernels (on a CPU: the operators' self time), and the five longest names. The output head's forward is marked
    ``loss_head`` (the chunked head forms its gradients there)."""
    cuda, head, marker = _cuda(run), _bare(run).get_output_embeddings(), record_function("loss_head")
    hooks = [head.register_forward_pre_hook(lambda *_: None if marker.__enter__() else None),  # None: inputs kept
             head.register_forward_hook(lambda *_: None if marker.__exit__(None, None, None) else None)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    C.sync(run.accelerator.device)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            train_step(run, step)
            C.sync(run.accelerator.device)
    finally:
        for hook in hooks:
            hook.remove()
    ms, by_name = dict.fromkeys([*(category for category, _ in CATEGORIES), "elementwise"], 0.0), {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        stack, parent = e.name, e.cpu_parent
        while parent is not None:
            stack, parent = f"{stack} {parent.name}", parent.cpu_parent
        for name, us in [(k.name, k.duration) for k in e.kernels] if cuda else [(e.name, e.self_cpu_time_total)]:
            text = f"{name} {stack}".lower()
            ms[next((c for c, words in CATEGORIES if any(w in text for w in words)), "elementwise")] += us / 1e3
            by_name[name] = by_name.get(name, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {"ms": ms, "timed": "GPU kernels" if cuda else "CPU operators (self time)",
            "top": [{"name": name[:120], "ms": us / 1e3} for name, us in top]}


def use_loss_head(run, chunk_tokens: int) -> None:
    """Chunked loss head (``train.loss_chunk_tokens``) or, at 0, the model's own Linear over the same weight."""
    model, head = _bare(run), chunked_head(run.model)
    if chunk_tokens:
        use_chunked_loss(model, chunk_tokens)
    elif head is not None:
        linear = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=head.bias is not None, device="meta")
        linear.weight, linear.bias = head.weight, head.bias
        model.set_output_embeddings(linear)


def use_attention(run, name: str) -> None:
    """Switch the built model's attention implementation (and the keywords each forward gets) to ``name``."""
    model = _bare(run)
    attention = build_document_attention(name, model.config)
    model.config._attn_implementation = attention.name  # the layers share the model's config and read it per forward
    run.attention = attention


def unavailable(lever: str, run) -> str | None:
    """Why ``lever`` cannot be measured here, or None."""
    if lever in ("varlen", "flex_attention"):
        if lever not in SUPPORTED:
            return "not available in this build (lmrecipe.model.attention.SUPPORTED does not list it)"
        return None if _cuda(run) else "needs a CUDA GPU"
    if lever == "full logits" and _cuda(run):
        # bf16 logits, their fp32 copy and its gradient, the bf16 gradient: 12 bytes a logit beyond the baseline's peak
        need = 12 * run.cfg.train.micro_batch_size * run.cfg.data.seq_len * _bare(run).config.vocab_size
        device = run.accelerator.device
        free = torch.cuda.get_device_properties(device).total_memory - torch.cuda.max_memory_allocated(device)
        return None if need < free else f"full logits need about {need / GIB:.1f} GiB beyond the baseline's peak; " \
            f"{free / GIB:.1f} GiB are left"
    if lever == "liger":
        try:
            check_kernels("liger")
        except UserError as err:
            return str(err)
        return None
    if lever == "compile" and not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
        return "needs a CUDA GPU and Triton (inductor's GPU kernels)"
    return None


def free(run) -> None:
    """Drop the gradients and collect the cycles a failed step left (its traceback's frames hold activations), then
    return the allocator's cached blocks: the next window starts from the run's own memory."""
    _bare(run).zero_grad(set_to_none=True)
    zero = getattr(run.model, "optimizer", None)  # DeepSpeed's ZeRO optimizer keeps its own reference to the grads
    if hasattr(zero, "zero_grad"):
        zero.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _build(cfg, out_dir: Path, foreach: bool):
    """build_run, with foreach AdamW under DeepSpeed where asked (the configuration of the recorded 28.5 % MFU)."""
    real, start = setup.build_optimizer, time.perf_counter()
    with mock.patch.object(setup, "build_optimizer", lambda *args, **kwargs: real(*args, **{**kwargs, "fused": False})
                           if foreach else real(*args, **kwargs)):
        run = setup.build_run(cfg, out_dir)
    run.lr_at = lambda step: 0.0  # the weights stay as initialised: the held batch's loss compares the levers
    C.sync(run.accelerator.device)  # the initialisation's kernels are asynchronous: without it, the host's share only
    return run, time.perf_counter() - start


class Sweep:
    """The windows measured so far on one run, the levers kept (the fastest so far) and the result to save."""

    def __init__(self, run, result: dict, save, warmup: int, steps: int):
        self.run, self.result, self.save, self.warmup, self.steps = run, result, save, warmup, steps
        self.step, self.best = 0, 0.0
        self.batch = next(iter(run.train_batches.micro_batches(0)))

    def measure(self, name: str, levers: dict, warmup: int | None = None, steps: int | None = None) -> dict:
        figures, self.step = window(self.run, self.step, self.warmup if warmup is None else warmup,
                                    self.steps if steps is None else steps)
        windows = self.result["windows"]
        loss = held_loss(self.run, self.batch)
        base = windows.get("baseline", {}).get("held_loss", loss)
        masked = "masked" if self.run.cfg.data.document_masking else "causal"
        backend = self.result["preamble"].get(f"sdp_choice_{masked}") if levers["attention"] == "sdpa" else \
            levers["attention"]
        windows[name] = {**figures, "levers": dict(levers), "held_loss": loss, "held_loss_diff": loss - base,
                         "held_loss_agrees": abs(loss - base) <= 1e-2 * abs(base), "attention_backend": backend}
        self.save(self.result)
        return windows[name]

    def try_lever(self, name: str, state: dict, change: dict, apply, undo=None) -> bool:
        """Measure with ``change`` applied on top of ``state``; True when faster than the best so far (then kept). A
        slower or failed lever is undone where it can be; one that cannot stays in ``state`` for the later windows."""
        if (why := unavailable(name, self.run)) is not None:
            self.result["skipped"][name] = why
            self.save(self.result)
            return False
        tokens_per_sec = self.measure_or_record(name, {**state, **change}, apply).get("tokens_per_sec", 0.0)
        faster, self.best = tokens_per_sec > self.best, max(self.best, tokens_per_sec)
        if faster or undo is None:
            state.update(change)
        else:
            undo()
        return faster

    def measure_or_record(self, name: str, levers: dict, apply=lambda: None, **kwargs) -> dict:
        """:meth:`measure`, its failure (an out-of-memory window) recorded as the window's figure instead: this
        exception's text and where it was raised; the next window starts from freed memory (:func:`free`)."""
        try:
            apply()
            return self.measure(name, levers, **kwargs)
        except Exception as exc:  # one window's failure is a figure too: the others go on
            where = next(reversed(traceback.extract_tb(exc.__traceback__)), None)
            error = {"error": f"{type(exc).__name__}: {exc}"[:1000], "levers": dict(levers),
                     "raised_at": where and f"{Path(where.filename).name}:{where.lineno} ({where.name})"}
        free(self.run)  # after the except block: the traceback's frames (activations, gradients) are gone
        self.result["windows"][name] = error
        self.save(self.result)
        return error

    def profile(self, when: str) -> None:
        self.result["profile"][when] = profile(self.run, self.step)
        self.step += 1
        self.save(self.result)


def measure_levers(config_of, out_dir: Path, side: dict, warmup: int, steps: int, save, forget) -> dict:
    """The stage's windows (module docstring). ``config_of(overrides)``: the kit's config with further overrides;
    ``forget()``: drop the first run's Accelerator before the second build."""
    cfg = config_of([])
    run, build_s = _build(cfg, out_dir / "first", foreach=True)
    chunk = cfg.train.chunk_tokens(_bare(run).config.vocab_size)
    state = {"attention": cfg.model.attn_implementation, "loss_chunk_tokens": chunk, "kernels": "none",
             "compile": "none", "optimizer": "foreach AdamW", "accum_steps": run.runtime.batch.accum_steps}
    result = {"label": side["label"], "overrides": side["overrides"], "build_s": build_s, "windows": {}, "skipped": {},
              "profile": {}, "notes": [], "preamble": preamble(run), "n_params": run.n_params,
              "device": str(run.accelerator.device), "zero": run.runtime.topology.zero.describe(),
              "micro_batch_size": cfg.train.micro_batch_size}
    sweep, kept = Sweep(run, result, save, warmup, steps), {"kernels": "none", "compile": "none"}
    # Liger also patches the architecture's module (its classes, apply_rotary_pos_emb): restored for the second build
    modeling = sys.modules[type(_bare(run)).__module__]
    module_names = dict(vars(modeling))
    try:
        sweep.best = sweep.measure("baseline", state)["tokens_per_sec"]
        result["baseline_vs_recorded"] = _against_recorded(result["windows"]["baseline"]["mfu"])
        sweep.profile("baseline")
        if chunk:
            sweep.try_lever("full logits", state, {"loss_chunk_tokens": 0}, lambda: use_loss_head(run, 0),
                            lambda: use_loss_head(run, chunk))
        for name in ("varlen", "flex_attention"):
            previous = state["attention"]
            sweep.try_lever(name, state, {"attention": name}, lambda name=name: use_attention(run, name),
                            lambda: use_attention(run, previous))
        if sweep.try_lever("liger", state, {"kernels": "liger"}, lambda: maybe_apply_kernels(_bare(run), "liger")):
            kept["kernels"] = "liger"
        if sweep.try_lever("compile", state, {"compile": "layers"}, lambda: compile_layers(_bare(run))):
            kept["compile"] = "layers"
        first_profile = profile(run, sweep.step)  # the first build's last levers: used if the second build's fails
        first_profile["levers"] = dict(state)
    finally:
        run.prefetcher.close()
    result["skipped"]["fp8 compiled"] = "not measured (its own build: torchao's float8 layers are chosen at prepare)"
    first = {"model": _bare(run), "engine": run.model, "optimizer": getattr(run.model, "optimizer", run.optimizer)}
    first = {what: weakref.ref(each) for what, each in first.items()}
    # DeepSpeed's engine.destroy(): each parameter's post-accumulate-grad hook (ZeRO's grad_handling_hook) holds the
    # ZeRO optimizer, which holds the engine and the model; the hook lives in the parameter's C++ autograd metadata,
    # which the cycle collector cannot see, so without removing it the first run is never freed.
    run.accelerator.free_memory()
    del run, sweep
    forget()
    for name, value in module_names.items():
        setattr(modeling, name, value)
    gc.collect()  # the first run's reference cycles (engine, optimizer, hooks) hold its GPU memory until collected
    result["first_run_alive"] = [what for what, ref in first.items() if ref() is not None]  # [] : all of it freed
    state = {**state, **kept, "optimizer": "fused AdamW"}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        held = result["held_after_first_build_gib"] = torch.cuda.memory_allocated() / GIB  # what the first run left
        if note := keep_chunked_loss(result["windows"], state, chunk, held,
                                     torch.cuda.get_device_properties(0).total_memory / GIB):
            result["notes"].append(note)
    result["best_overrides"] = [f"model.attn_implementation={state['attention']}", f"model.kernels={state['kernels']}",
                                f"train.loss_chunk_tokens={state['loss_chunk_tokens']}", f"train.compile={state['compile']}"]
    run, result["second_build_s"] = _build(config_of(result["best_overrides"]), out_dir / "second", foreach=False)
    try:
        sweep = Sweep(run, result, save, warmup, steps)
        if "error" not in sweep.measure_or_record("fused AdamW", state):
            sweep.profile("best")
        else:  # the second build's best window failed: the profile of the first build's best levers instead
            result["profile"]["best (first build, foreach AdamW: the fused AdamW window failed)"] = first_profile
            save(result)
        samples = BIG_ACCUM * run.runtime.batch.micro_batch_size * run.runtime.batch.world_size
        run.train_batches.ramp.size = lambda position: samples  # every later step accumulates BIG_ACCUM micro-batches
        run.prefetcher.reset()
        sweep.measure_or_record(f"accumulation {BIG_ACCUM}", {**state, "accum_steps": BIG_ACCUM}, warmup=1,
                                steps=max(1, steps // 4))
    finally:
        run.prefetcher.close()
    return result


def keep_chunked_loss(windows: dict, state: dict, chunk: int, held_gib: float, total_gib: float) -> str | None:
    """Where the kept levers drop the chunked loss and their measured step peak (the largest of the windows with that
    loss head), the run's own memory (the baseline's ``held_gib``) and ``held_gib`` (what the first run left) would
    exceed ``total_gib``: keep the chunked loss in ``state`` for the second build and say why; else None."""
    if not chunk or state["loss_chunk_tokens"]:
        return None
    peak = max((w["step_peak_gib"] for w in windows.values() if w.get("step_peak_gib") is not None
                and w["levers"]["loss_chunk_tokens"] == 0), default=0.0)
    need = peak + windows.get("baseline", {}).get("held_gib", 0.0) + held_gib
    if need <= total_gib:
        return None
    state["loss_chunk_tokens"] = chunk
    return (f"the second build keeps the chunked loss (train.loss_chunk_tokens={chunk}): full logits' step peak "
            f"{peak:.1f} GiB + the run's {need - peak - held_gib:.1f} GiB + {held_gib:.1f} GiB the first run left = "
            f"{need:.1f} GiB, more than the device's {total_gib:.1f} GiB")


def _against_recorded(mfu: float | None) -> dict:
    """The baseline's MFU against the committed ``mfu_zero2`` figure (bench/gpu/results): the difference in points."""
    rows = table.latest_rows(table.load_runs(sorted(table.RESULTS.glob("*.json"))))
    recorded = rows["mfu_zero2"][0]["sides"]["bf16 ZeRO-2"]["mfu"] if "mfu_zero2" in rows else None
    points = None if mfu is None or recorded is None else 100 * (mfu - recorded)
    return {"recorded_mfu": recorded, "mfu": mfu, "points": points,
            "within_3_points": None if points is None else abs(points) <= 3}
