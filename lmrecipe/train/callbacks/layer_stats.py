"""Per-layer instruments (``logging.layer_stats``): at every logged step, per part of the model, the gradient norm
before clipping, the parameter norm and the update/parameter ratio; each block's output RMS and the largest absolute
logit on the step's first micro-batch. An unlogged step does nothing here.

**Where the gradients are read.** At the trainer's ``pre_optim_step`` of a logged step: every micro-batch's backward
has run, the clip and the update have not (``lmrecipe/train/step.py``). Each rank reads what it owns:

- without DeepSpeed: every parameter's ``.grad`` and weight (the same on every rank after DDP's all-reduce: no
  collective is needed);
- ZeRO-1/2: the fp32 gradient and master-weight fragments of this rank's optimizer partition (the ``_hp_mapping``
  fragments from which DeepSpeed's ``safe_get_full_grad`` assembles a gradient);
- ZeRO-3: this rank's fp32 gradient and master-weight partitions (``safe_get_local_grad``,
  ``safe_get_local_fp32_param``).

Each rank sums squares over the elements it owns, and one all-reduce per logged step combines every part's figures.
The parts (:func:`parameter_parts`) partition the parameters, so the squares of the parts' gradient norms add up to
the square of the logged ``grad_norm``. The update is the change of the (local) master weights over the step, against
a copy taken before it: one copy of the weights a rank owns, at a logged step only. Tensor and sequence parallelism
are refused with this instrument (``lmrecipe/config/rules.py``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from lmrecipe.model.loss import ChunkedLossHead
from lmrecipe.observe.console import log_due
from lmrecipe.observe.metrics_log import METRICS_FILE, read_metrics
from lmrecipe.train.callback import Callback
from lmrecipe.train.setup import Run
from lmrecipe.train.step import StepResult

logger = logging.getLogger(__name__)

LAYERS_PLOT = "layers.png"


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside the DDP / DeepSpeed (``module``) and torch.compile (``_orig_mod``) wrappers."""
    for attr in ("module", "_orig_mod", "module"):
        model = getattr(model, attr, model)
    return model


def find_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's transformer blocks: its first ModuleList of ``config.num_hidden_layers`` modules."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return next((m for _, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), None)


def block_name(index: int, count: int) -> str:
    return f"block_{index:0{max(2, len(str(count - 1)))}d}"


def parameter_parts(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Every trainable parameter (a tied one once) in exactly one part, in the model's order: ``embed`` (the input
    embeddings), ``block_NN`` (one per transformer block), ``final_norm``, ``head`` (an untied output layer) and
    ``other`` (anything else, e.g. learned positions; absent when empty)."""
    model = unwrapped(model)
    owner: dict[int, str] = {}
    for part, module in (("embed", model.get_input_embeddings()), ("head", model.get_output_embeddings())):
        for p in module.parameters() if module is not None else ():
            owner.setdefault(id(p), part)
    blocks = find_blocks(model)
    for index, block in enumerate(blocks if blocks is not None else ()):
        for p in block.parameters():
            owner.setdefault(id(p), block_name(index, len(blocks)))
    names = ["embed", *(block_name(i, len(blocks)) for i in range(len(blocks or ()))), "final_norm", "head", "other"]
    parts: dict[str, list] = {name: [] for name in names}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = owner.get(id(p)) or ("final_norm" if "norm" in name or "ln_f" in name else "other")
        parts[part].append((name, p))
    return {name: params for name, params in parts.items() if params}


class OwnedTensors:
    """The gradient and master-weight elements this rank owns, per parameter (None: owns none), as fp32 tensors,
    and the factor of the gradients' loss scale. Read before the update (gradients) and around it (weights)."""

    def __init__(self, run: Run):
        self.run = run
        self.stage = run.runtime.topology.zero.stage if run.runtime.topology.zero.deepspeed else None

    def grads(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
        if self.stage is None:
            return [p.grad for p in params]
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_grad

            return [safe_get_local_grad(p) for p in params]
        return [_fragment_grad(p) for p in params]

    def weights(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
        if self.stage is None:
            return [p.detach() for p in params]
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_fp32_param

            return [safe_get_local_fp32_param(p) for p in params]
        return [None if (m := getattr(p, "_hp_mapping", None)) is None else m.get_hp_fragment() for p in params]

    def loss_scale(self) -> float:
        """The factor the gradients carry before the step unscales them (fp16; 1 otherwise). A host read, at a logged
        step."""
        if self.stage is None:
            scaler = self.run.accelerator.scaler
            return 1.0 if scaler is None else float(scaler.get_scale())
        return float(getattr(self.run.accelerator.deepspeed_engine_wrapped.engine.optimizer, "loss_scale", 1.0))


def _fragment_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of a ZeRO-1/2 parameter's reduced gradient, as ``deepspeed.utils.tensor_fragment.
    get_full_hp_grad`` takes it before its all-reduce (a buffer the size of the parameter holds only its fragment)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    fragment = mapping.get_lp_grad_fragment(p._index_in_param_group).flatten()
    address = mapping.lp_fragment_address
    if fragment.numel() == p.numel():
        fragment = fragment.narrow(0, address.start, address.numel)
    return fragment


def _squares(tensors: list[torch.Tensor | None], index: torch.Tensor, n_parts: int, device) -> torch.Tensor:
    """Per part, the sum of squares of ``tensors`` (fp64 ``[n_parts]``; None counts 0). Device work only."""
    total = torch.zeros(n_parts, dtype=torch.float64, device=device)
    kept = [(i, t) for i, t in enumerate(tensors) if t is not None and t.numel()]
    if kept:
        sums = torch.stack([t.float().square().sum() for _, t in kept]).double()
        total.index_add_(0, index[[i for i, _ in kept]].to(device), sums)
    return total


@dataclass
class _Armed:
    """What a logged step's probe collects before the update."""

    grad_squares: torch.Tensor | None = None
    weights_before: list[torch.Tensor | None] | None = None
    loss_scale: float = 1.0


class LayerStats(Callback):
    """The instruments of the module docstring, at the logged steps (``logging.log_every_steps``, the first, the
    last); ``layers.png`` at the end (main process)."""

    follows = ("Reporting",)  # Reporting's on_end closes metrics.jsonl: the heat map reads the whole file

    def attach(self, trainer) -> None:
        run = self.run = trainer.run
        self.out_dir = trainer.out_dir
        self.parts = parameter_parts(run.model)
        self.params = [p for params in self.parts.values() for _, p in params]
        self.index = torch.tensor([i for i, params in enumerate(self.parts.values()) for _ in params])
        self.owned = OwnedTensors(run)
        self.armed: _Armed | None = None
        self._hooks: list = []
        self._acts: dict[str, torch.Tensor] = {}
        model = unwrapped(run.model)
        self.blocks = find_blocks(model)
        self.head = model.get_output_embeddings()
        # Hooks on a compiled model's modules would recompile it at every logged step: the activations are skipped.
        self.measure_activations = not run.cfg.train.compile
        if not self.measure_activations:
            logger.info("logging.layer_stats under train.compile: the block output RMS and the largest logit are not "
                        "measured (the gradient, weight and update figures are)")

    # ---- a logged step

    def before_step(self, trainer) -> None:
        if not log_due(self.run.cfg.logging, trainer.state.step + 1, trainer.max_steps):
            return
        self.armed = _Armed(weights_before=[None if w is None else w.detach().clone()
                                            for w in self.owned.weights(self.params)])
        if self.measure_activations:
            self._hook_activations()

    def pre_optim_step(self, trainer) -> None:
        armed = self.armed
        if armed is None:
            return
        armed.loss_scale = self.owned.loss_scale()
        armed.grad_squares = _squares(self.owned.grads(self.params), self.index, len(self.parts),
                                      self.run.accelerator.device)

    def _hook_activations(self) -> None:
        acts = self._acts

        def on_block(name):
            def hook(module, inputs, output):
                if name not in acts:  # the first forward: a recomputation (activation checkpointing) is not counted
                    hidden = output[0] if isinstance(output, tuple) else output
                    acts[name] = torch.linalg.vector_norm(hidden.detach(), dtype=torch.float32) / math.sqrt(hidden.numel())
            return hook

        def on_head(module, inputs, output):
            if "max_abs_logit" in acts:
                return
            if isinstance(module, ChunkedLossHead) and module.targets is not None:
                acts["max_abs_logit"], module.max_abs_logit = module.max_abs_logit, None
            else:
                logits = output.detach()  # two reductions, no copy of the logits
                acts["max_abs_logit"] = torch.maximum(logits.amax(), -logits.amin()).float()

        for index, block in enumerate(self.blocks if self.blocks is not None else ()):
            self._hooks.append(block.register_forward_hook(on_block(f"act_rms/{block_name(index, len(self.blocks))}")))
        if self.head is not None:
            if isinstance(self.head, ChunkedLossHead):
                self.head.max_abs_logit = torch.zeros((), device=self.run.accelerator.device)
            self._hooks.append(self.head.register_forward_hook(on_head))

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if isinstance(self.head, ChunkedLossHead):
            self.head.max_abs_logit = None

    def after_step(self, trainer, result: StepResult) -> None:
        armed, self.armed = self.armed, None
        acts, self._acts = self._acts, {}
        self._disarm()
        if armed is None:
            return
        if armed.grad_squares is None:
            raise RuntimeError("logging.layer_stats: the step ended without its pre_optim_step")
        result.figures.update(self.figures(armed))
        result.figures.update(acts)

    def figures(self, armed: _Armed) -> dict[str, torch.Tensor]:
        """Every part's norms and ratio from the probe's squares and the weights now (one all-reduce under DeepSpeed)."""
        device = self.run.accelerator.device
        after = self.owned.weights(self.params)
        updates = [None if a is None else a.float() - b.float() for a, b in zip(after, armed.weights_before)]
        squares = torch.stack([armed.grad_squares, _squares(after, self.index, len(self.parts), device),
                               _squares(updates, self.index, len(self.parts), device),
                               _squares(armed.weights_before, self.index, len(self.parts), device)])
        if self.run.runtime.topology.zero.deepspeed:  # each rank holds its own elements: sum them over the ranks
            squares = self.run.accelerator.reduce(squares, reduction="sum")
        grad, weight, update, weight_before = squares.sqrt()
        grad = grad / armed.loss_scale
        ratio = update / weight_before.clamp_min(1e-30)
        out: dict[str, torch.Tensor] = {}
        for i, part in enumerate(self.parts):
            out[f"grad_norm/{part}"] = grad[i]
            out[f"param_norm/{part}"] = weight[i]
            out[f"update_ratio/{part}"] = ratio[i]
        return out

    def on_error(self, trainer, err: BaseException) -> BaseException | None:
        self.armed = None
        self._disarm()
        return None

    # ---- the heat map

    def on_end(self, trainer) -> None:
        self.maybe_plot()

    def on_stop(self, trainer, stop) -> None:
        if stop.error or stop.exit_code is not None:
            self.maybe_plot()

    def maybe_plot(self) -> None:
        if not (self.run.accelerator.is_main_process and self.run.cfg.logging.plots):
            return
        rows = read_metrics(self.out_dir / METRICS_FILE)
        if any(key.startswith("grad_norm/") for row in rows for key in row):
            from lmrecipe.observe.layer_plots import plot_layers  # matplotlib only when the plot is drawn

            plot_layers(rows, self.out_dir / LAYERS_PLOT, title=self.run.cfg.logging.run_name or self.out_dir.name)
