"""The run doctor: the standard symptoms of a sick run, found in the run's own figures.

:func:`diagnose` reads a run's ``metrics.jsonl`` rows and ``run_meta.json`` (its resolved configuration, its
sessions and their events) and returns :class:`Finding` s, each with its evidence (steps, values), the likely
cause and the fix as recipe keys. A healthy run returns none. Per-layer figures (``grad_norm/<part>``,
``update_ratio/<part>``), the largest logit and ``z_loss`` are used when the rows carry them (``logging.layer_stats``)
and never mentioned otherwise. The loss checks judge the smoothed loss (means of consecutive logged rows, against the
steps' own scatter), one step's loss only where it passes the untrained model's; no finding advises a lower rate for
what shows at the schedule's floor (``optim.min_lr``). :func:`diagnose_run` reads a run folder, also while the run
writes it: a last line of ``metrics.jsonl`` still being written is left out. ``tools/doctor.py`` prints the
findings; the run report holds them under "Doctor".

The thresholds are module constants, each with the reason for its value.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from lmrecipe.errors import fail
from lmrecipe.observe.findings import METRICS_FILE, RUN_META_FILE, Finding, RunFigures, finite, read_rows
from lmrecipe.observe.smoothing import SMOOTH_ROWS, loss_scatter, smoothed

RATE_TOO_HIGH = ("frequent_clipping", "grad_norm_rising")
"""Findings whose fix is a lower rate, left out when the loss does not fall at all."""
LR_FLOOR = 3e-4
"""The rate suggested for a loss that does not fall when ten times the peak would still be below it: the default
``optim.lr`` (AdamW at the scales of the shipped recipes)."""
MIN_ROWS = 4
"""Fewer logged training rows than this (after warmup, for the trends) say nothing about a trend."""
NOISE_Z = 4.0
"""A rise of the smoothed loss counts when it is this many times its standard error: the step-to-step scatter
(estimated from second differences of the logged losses, which a smooth trend leaves at zero) over the rows
averaged. The lowest of several smoothed points is itself low by one or two standard errors; four is beyond that."""
TREND_POINTS = 3
"""Points of the smoothed loss (of :data:`SMOOTH_ROWS` rows each) that "the loss does not fall" needs after warmup:
fewer cannot tell a flat run from the plateau a healthy one crosses early (a warmup-stable-decay tiny run held 6.5
nats for 25 steps after its warmup, then fell to 4.8)."""
LOSS_FALL_MIN = 0.02
"""After warmup the smoothed loss must fall below its first point (the end of warmup) by this fraction; a run that
learns falls by far more (a tiny model on the embedded corpus: 9.05 to 6.26 nats in 60 steps)."""
LOSS_DIVERGE_NATS = 0.5
"""The smoothed loss at the end of the run above its lowest earlier point by this much, by
:data:`LOSS_DIVERGE_FRACTION` and by :data:`NOISE_Z` standard errors: the run is climbing away from where it was,
not wobbling. A single logged loss counts only above the untrained model's (the first logged), by the same margin."""
LOSS_DIVERGE_FRACTION = 0.1
TAIL_ROWS = 3
"""Rows whose median stands for "the end of the run" for the largest logit, and rows before a resume."""
LR_FLOOR_SHARE = 0.1
"""A logged rate within this share of the way from ``optim.min_lr`` to ``optim.lr`` is at the schedule's floor (the
last fifth of a cosine decay, a warmup-stable-decay run's last steps): a symptom seen there is not cured by a lower
peak rate, so no finding advises one."""
GRAD_NORM_RISE = 4.0
"""Median gradient norm of the last third of the rows over that of the first third: a healthy run's norm falls
early and may drift up late (weight decay), by well under this factor."""
CLIP_FRACTION = 0.5
"""Logged steps after warmup with ``grad_norm`` above ``optim.grad_clip``: above this share, clipping is the rule
rather than a guard, and the update is the clip norm times the rate, whatever the gradient says."""
BLOCK_PREFIX = "block_"
"""Per-layer figures name the transformer blocks ``block_NN``; the other parts are ``embed``, ``final_norm``, ``head``."""
LAYER_OUTLIER = 10.0
"""A block's median ``grad_norm/<part>`` (or ``update_ratio/<part>``) over the median of the other blocks': an order
of magnitude, where the blocks of one model stay within a few times each other."""
EDGE_OUTLIER = 30.0
"""The same for the embedding, the final norm and the output layer against the blocks: their shapes differ, and the
output layer's gradient norm is already 10x a block's in a healthy tiny model (0.66 against 0.069 and 0.15)."""
QK_NORM = "model.arch=qwen3 as in recipes/tiny_qknorm.yaml, a fresh run"
"""The fix for attention logits that grow: an architecture whose attention normalises queries and keys."""
LOGIT_KEYS = ("max_abs_logit", "max_logit")
"""The largest logit's name in the rows (``logging.layer_stats``), the first present is used."""
MAX_LOGIT_GROWTH = 2.0
MAX_LOGIT_FLOOR = 30.0
"""A largest logit that doubled from the first logged row after warmup to the end and ended above this: logits this
large saturate the softmax (and bf16 resolves them coarsely); growth below the floor is the model growing
confident."""
DATA_WAIT_FRACTION = 0.05
"""Data wait over the time in training steps, the first logged interval (start-up) left out: above 5 % the input
pipeline holds the accelerator back."""
DATA_WAIT_MIN_SECONDS = 30.0
"""Time in training steps needed to judge the data wait, as for a throughput drop: over a few seconds of
millisecond steps (a tiny model on a CPU) a wait of one millisecond, the prefetch thread's turn on busy cores,
already reads as 2-5 % (measured: 2.4-4.5 % in tiny runs on a loaded 2-core machine)."""
VAL_RISE_FRACTION = 0.02
"""The last validation loss above the best one by this fraction while the training loss kept falling: beyond
evaluation noise (a fixed set of windows, the same at every evaluation)."""
MIN_EVALS = 3
"""Evaluations needed before "validation rises" can be told from one noisy evaluation."""
THROUGHPUT_DROP = 0.5
"""A logged interval below this share of the median throughput of the intervals before it counts as slow."""
THROUGHPUT_MIN_ROWS = 3
THROUGHPUT_MIN_SECONDS = 30.0
"""A sustained fall: at least this many slow intervals in a row, lasting at least this long in training steps; a
shorter dip is a neighbour on a shared machine, a checkpoint write or the allocator, not the pipeline."""
RESUME_JUMP_FRACTION = 0.1
"""The first logged loss after a resume above the highest of the :data:`TAIL_ROWS` logged before it by this fraction:
a restored state continues the curve (the same data order, the same moments); a jump means part of it was not
restored."""
FREQUENT_ROLLBACKS = 3
"""Rollbacks (the spike guard, ``spike.enabled``) in the kept history from which spikes are frequent, not bad luck."""
Z_LOSS_LARGE = 1e-2
"""A ``train.z_loss`` coefficient above this is blamed for non-finite steps: the usual values are 1e-5 to 1e-3, and
the run's own stop message names it from the same value on."""
SKIPPED_SHARE = 0.5
"""Updates skipped (non-finite) in this share of the steps after warmup explain a loss that does not fall: the weights
did not move, and a higher rate is not the fix."""


def is_run_folder(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() or (path / RUN_META_FILE).is_file()


def diagnose_run(out_dir: str | Path) -> list[Finding]:
    """The findings of the run in ``out_dir`` (its ``metrics.jsonl`` and ``run_meta.json``)."""
    out_dir = Path(out_dir)
    meta_path = out_dir / RUN_META_FILE
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except ValueError:
        raise fail(f"{meta_path} is not valid JSON: the file was edited or damaged. Restore it, or move it away to "
                   "diagnose the run from metrics.jsonl alone.") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
        what = f"a JSON {type(meta).__name__}" if not isinstance(meta, dict) else "a \"config\" that is no object"
        raise fail(f"{meta_path} holds {what}, not the object "
                   "train.py writes: the file was edited or damaged. Restore it, or move it away to diagnose the run "
                   "from metrics.jsonl alone.")
    return diagnose(read_rows(out_dir / METRICS_FILE), meta)


def diagnose(rows: list[dict], meta: dict) -> list[Finding]:
    """Every check of this module on ``rows`` (``metrics.jsonl``) and ``meta`` (``run_meta.json``), in the order of
    the standard playbook: divergence first, then the rate, the layers, the data and the validation."""
    run = RunFigures(train=[r for r in rows if "loss" in r], val=[r for r in rows if "val_loss" in r],
                     config=meta.get("config", {}), meta=meta)
    checks = (non_finite, loss_diverging, loss_not_falling, grad_norm_rising, frequent_clipping, layer_outlier,
              max_logit_growing, frequent_rollbacks, data_wait, val_rising, throughput_drop, resume_jump, straggler)
    findings = [finding for check in checks if (finding := check(run)) is not None]
    if any(f.name == "loss_not_falling" for f in findings):
        # A flat loss says the updates do not move the model: the clip (at the untrained model's gradient norm)
        # is not what holds it back, and "lower the rate" would contradict the fix that matters.
        findings = [f for f in findings if f.name not in RATE_TOO_HIGH]
    return findings


def report_lines(findings: list[Finding]) -> list[str]:
    """The run report's "Doctor" section."""
    lines = ["## Doctor", ""]
    if not findings:
        return lines + ["No findings: none of the playbook's symptoms shows in the logged figures "
                        "(`tools/doctor.py RUN` checks a run at any time).", ""]
    for finding in findings:
        lines += [f"- **{finding.symptom}** (`{finding.name}`). {finding.evidence}. Likely cause: {finding.cause}. "
                  f"Fix: {finding.fix}."]
    return lines + [""]


# ---------------------------------------------------------------------------------------------- the checks


def _median(values) -> float:
    return statistics.median(values)


def _g(value: float) -> str:
    return f"{value:.3g}"


def _longer_warmup(run: RunFigures) -> str:
    """Twice the warmup, and at least a twentieth of the run (the key alone when the run's configuration is not at
    hand: a copied ``metrics.jsonl`` without ``run_meta.json``)."""
    if run.key("schedule.warmup_steps") is None and run.key("train.max_steps") is None:
        return "schedule.warmup_steps raised"
    return f"schedule.warmup_steps={max(2 * run.warmup_steps, int(run.key('train.max_steps', 0) or 0) // 20, 1)}"


def _lower_rate(run: RunFigures, factor: float) -> str:
    lr = run.key("optim.lr")
    return f"optim.lr={_g(lr / factor)}" if finite(lr) else "a lower optim.lr"


def non_finite(run: RunFigures) -> Finding | None:
    """Steps skipped for a non-finite loss or gradient norm, or a non-finite loss logged; blamed on the z-loss when
    its coefficient is large (:func:`_z_loss_overflow`)."""
    skipped = [r for r in run.train if (r.get("skipped_steps") or 0) > 0]
    bad = [r for r in run.train if not finite(r.get("loss")) or ("grad_norm" in r and not finite(r["grad_norm"]))]
    if not skipped and not bad:
        return None
    first = min([r["step"] for r in skipped + bad])
    count = max((r.get("skipped_steps") or 0 for r in run.train), default=0)
    early = first <= max(run.warmup_steps, 1)
    evidence = (f"{count} step(s) skipped for a non-finite loss or gradient norm by step {run.train[-1]['step']}, "
                f"the first by step {first}" if count else f"a non-finite loss or gradient norm logged at step {first}")
    if (z_loss := _z_loss_overflow(run)) is not None:
        return Finding("non_finite", "non-finite loss or gradients", evidence + z_loss[0], z_loss[1],
                       "train.z_loss=1e-4 (PaLM's), or train.z_loss=0 to turn it off")
    cause = ("the rate is too high for the start, or a gradient-norm spike at the first steps" if early else
             "a bad batch (ids out of the vocabulary's range, a broken mask) or a rate too high for this phase")
    fix = (f"{_lower_rate(run, 10)} and {_longer_warmup(run)}; check the data (token ids below "
           "the vocabulary size, documents ending in EOS)")
    return Finding("non_finite", "non-finite loss or gradients", evidence, cause, fix)


def _z_loss_overflow(run: RunFigures) -> tuple[str, str] | None:
    """(evidence, cause) when ``train.z_loss`` is above :data:`Z_LOSS_LARGE`, or the logged z-loss is not finite or
    outweighs the loss itself; else None."""
    weight = run.key("train.z_loss")
    logged = next((r for r in run.train if "z_loss" in r and (not finite(r["z_loss"]) or (
        finite(r.get("loss")) and r["z_loss"] > r["loss"]))), None)
    if not (finite(weight) and weight > Z_LOSS_LARGE) and logged is None:
        return None
    evidence = f"; z_loss {_g(logged['z_loss'])} at step {logged['step']}" if logged is not None else ""
    if logged is not None and finite(logged.get("loss")):
        evidence += f" (the loss {logged['loss']:.4f})"
    named = f"train.z_loss={_g(weight)}" if finite(weight) else "the z-loss (train.z_loss)"
    return evidence, (f"{named} is too large: z_loss * logsumexp(logits)^2 added to the loss overflows, whatever "
                      "the rate")


def _rose(loss: float, reference: float) -> bool:
    return loss - reference >= max(LOSS_DIVERGE_NATS, LOSS_DIVERGE_FRACTION * reference)


def _significant(rise: float, scatter: float, *counts: int) -> bool:
    """A difference ``rise`` of means over ``counts`` rows each beyond :data:`NOISE_Z` standard errors."""
    return rise > NOISE_Z * scatter * math.sqrt(sum(1 / n for n in counts))


def at_floor(run: RunFigures, rows: list[dict]) -> bool:
    """Whether the rows' logged learning rate (their median) is at the schedule's floor (:data:`LR_FLOOR_SHARE`)."""
    peak, floor = run.key("optim.lr"), run.key("optim.min_lr")
    lrs = [r["lr"] for r in rows if finite(r.get("lr"))]
    if not (finite(peak) and finite(floor) and peak > floor and lrs):
        return False
    return _median(lrs) - floor <= LR_FLOOR_SHARE * (peak - floor)


def loss_diverging(run: RunFigures) -> Finding | None:
    """A logged loss climbs above the untrained model's (the first logged row), or the smoothed loss ends well
    above its lowest earlier point (:func:`smoothed`, :data:`LOSS_DIVERGE_NATS`, :data:`NOISE_Z`)."""
    rows = [r for r in run.train if finite(r["loss"])]
    if len(rows) < MIN_ROWS:
        return None
    first, peak = rows[0], max(rows[1:], key=lambda r: r["loss"])
    if _rose(peak["loss"], first["loss"]):
        evidence = (f"loss {first['loss']:.4f} at step {first['step']}, {peak['loss']:.4f} at step {peak['step']} "
                    f"(learning rate {_g(peak.get('lr', float('nan')))}, gradient norm "
                    f"{_g(peak.get('grad_norm', float('nan')))}): above where training started")
        return _diverging(run, evidence, [peak])
    points = smoothed(rows, from_end=True)
    if len(points) < 2:
        return None
    last, best = points[-1], min(points[:-1], key=lambda p: p.loss)
    scatter = loss_scatter(rows)
    if not _rose(last.loss, best.loss) or not _significant(last.loss - best.loss, scatter, len(last.rows),
                                                              len(best.rows)):
        return None
    return _diverging(run, f"mean loss {best.loss:.4f} over {best.span()}, then {last.loss:.4f} over {last.span()} "
                           f"(one step's loss scatters by {scatter:.2f} around the trend; learning rate {_g(last.lr)})",
                      last.rows)


def _diverging(run: RunFigures, evidence: str, rows: list[dict]) -> Finding:
    if at_floor(run, rows):
        return Finding("loss_diverging", "training loss diverging", evidence,
                       f"not the rate, which is at the schedule's floor there (optim.min_lr={_g(run.key('optim.min_lr'))}"
                       "): the data of those steps (another kind of text, a new data stage or mixture, data seen "
                       "again) or the state a resume restored",
                       "check what the run read from those steps on (data.stages, data.sources, tokens_seen/<source>, "
                       "the epochs) and the sessions of run_meta.json; the validation loss says whether the model "
                       "got worse or the batches harder")
    return Finding("loss_diverging", "training loss diverging", evidence,
                   "the learning rate is too high for this model and batch",
                   f"{_lower_rate(run, 3)} (a third), or a longer warmup ({_longer_warmup(run)})")


def loss_not_falling(run: RunFigures) -> Finding | None:
    """After warmup the smoothed loss (:func:`smoothed`, at least :data:`TREND_POINTS` points) never falls below its
    first point by :data:`LOSS_FALL_MIN`, and neither because the updates were skipped (:data:`SKIPPED_SHARE`: that
    is :func:`non_finite`'s finding) nor because it climbs (:func:`loss_diverging`'s): their fixes are the opposite of
    a higher rate."""
    rows = [r for r in run.after_warmup() if finite(r["loss"])]
    if len(rows) < TREND_POINTS * SMOOTH_ROWS or _mostly_skipped(rows) or loss_diverging(run) is not None:
        return None
    points = smoothed(rows, from_end=False)
    start, best = points[0], min(points[1:], key=lambda p: p.loss)
    if best.loss < start.loss * (1 - LOSS_FALL_MIN):
        return None
    last = rows[-1]
    evidence = (f"mean loss {start.loss:.4f} over {start.span()} (end of warmup), lowest {best.loss:.4f} "
                f"over {best.span()}, {last['loss']:.4f} at step {last['step']}")
    rates = [f"learning rate {_g(last['lr'])}" if finite(last.get("lr")) else "",
             f"peak optim.lr={_g(run.key('optim.lr'))}" if finite(run.key("optim.lr")) else ""]
    if any(rates):  # a run folder without run_meta.json has no configuration to quote
        evidence += "; " + (f"{rates[0]} ({rates[1]})" if all(rates) else rates[0] or rates[1])
    epochs = run.epochs(last["step"])
    cause = "the learning rate is too low, or the schedule never reaches it"
    lr = run.key("optim.lr")
    raised = (f"optim.lr={_g(10 * lr)} (ten times the peak)" if finite(lr) and 10 * lr >= LR_FLOOR else
              f"optim.lr={_g(LR_FLOOR)} (the default peak)")
    fix = raised + "; check schedule.warmup_steps and schedule.decay against train.max_steps"
    if epochs is not None and epochs > 1:
        evidence += f"; {epochs:.1f} epochs of the training data by step {last['step']}"
        cause += ", or the same batches seen again (more than one epoch: the model has learned what they hold)"
        fix += "; more training data (data.path, data.sources)"
    return Finding("loss_not_falling", "loss not falling after warmup", evidence, cause, fix)


def _mostly_skipped(rows: list[dict]) -> bool:
    """Whether the updates skipped (``skipped_steps``, a running count) over ``rows`` reach :data:`SKIPPED_SHARE` of
    their steps."""
    counts = [r.get("skipped_steps") or 0 for r in rows]
    steps = rows[-1]["step"] - rows[0]["step"]
    return steps > 0 and counts[-1] - counts[0] >= SKIPPED_SHARE * steps


def grad_norm_rising(run: RunFigures) -> Finding | None:
    """The gradient norm of the last third of the run over that of the first third exceeds :data:`GRAD_NORM_RISE`,
    and the last third is not at the schedule's floor (:func:`at_floor`)."""
    rows = [r for r in run.train[1:] if finite(r.get("grad_norm"))]
    if len(rows) < 3 * 2:
        return None
    third = len(rows) // 3
    first, last = _median(r["grad_norm"] for r in rows[:third]), _median(r["grad_norm"] for r in rows[-third:])
    if first <= 0 or last / first < GRAD_NORM_RISE or at_floor(run, rows[-third:]):
        # At the floor the norm does not rise with the rate: a norm that grows as the rate decays is common at the
        # end of a decay (weight decay against smaller updates), and a lower peak would not change it.
        return None
    evidence = (f"median gradient norm {first:.3g} over steps {rows[0]['step']}-{rows[third - 1]['step']}, "
                f"{last:.3g} over steps {rows[-third]['step']}-{rows[-1]['step']} ({last / first:.1f}x), learning rate "
                f"up to {_g(max(r.get('lr', 0.0) for r in rows))}")
    return Finding("grad_norm_rising", "gradient norm rising with the rate", evidence,
                   "the learning rate is too high: each update moves the weights to where the gradients are larger",
                   f"{_lower_rate(run, 3)} (a third)")


def frequent_clipping(run: RunFigures) -> Finding | None:
    """``grad_norm`` above ``optim.grad_clip`` in more than :data:`CLIP_FRACTION` of the logged steps after warmup."""
    clip = run.key("optim.grad_clip", 0.0)
    rows = [r for r in run.after_warmup() if finite(r.get("grad_norm"))]
    if not clip or len(rows) < MIN_ROWS:
        return None
    clipped = [r for r in rows if r["grad_norm"] > clip]
    if len(clipped) <= CLIP_FRACTION * len(rows):
        return None
    median = _median(r["grad_norm"] for r in rows)
    evidence = (f"grad_norm above optim.grad_clip={_g(clip)} at {len(clipped)} of {len(rows)} logged steps after "
                f"warmup (steps {rows[0]['step']}-{rows[-1]['step']}), median {median:.3g}")
    if at_floor(run, clipped):
        return Finding("frequent_clipping", "gradients constantly at the clip norm", evidence,
                       "the clip is below the norm this model keeps at the schedule's floor, where the rate is not "
                       "the cause", f"optim.grad_clip={_g(2 * median)} (above the norm's median) if the loss falls")
    return Finding("frequent_clipping", "gradients constantly at the clip norm", evidence,
                   "the learning rate is too high for this phase of the run",
                   f"{_lower_rate(run, 2)} (half), or a shorter schedule.warmup_steps if it happens only early; "
                   "raise optim.grad_clip only if the norm is steady and the loss falls")


def _parts(rows: list[dict], prefix: str) -> dict[str, float]:
    """Median over the rows of each ``<prefix>/<part>`` figure the rows carry."""
    values: dict[str, list[float]] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith(prefix + "/") and finite(value):
                values.setdefault(key[len(prefix) + 1:], []).append(value)
    return {part: _median(v) for part, v in values.items()}


def layer_outlier(run: RunFigures) -> Finding | None:
    """A block's gradient norm (or update ratio) :data:`LAYER_OUTLIER` times the median of the other blocks, or
    another part's :data:`EDGE_OUTLIER` times the median of the blocks."""
    for prefix, what in (("grad_norm", "gradient norm"), ("update_ratio", "update / weight ratio")):
        parts = _parts(run.train[1:] or run.train, prefix)
        blocks = {part: value for part, value in parts.items() if part.startswith(BLOCK_PREFIX)}
        for part, value in sorted(parts.items(), key=lambda kv: -kv[1]):
            others = [v for p, v in blocks.items() if p != part]
            factor = LAYER_OUTLIER if part in blocks else EDGE_OUTLIER
            if not others or _median(others) <= 0 or value < factor * _median(others):
                continue
            typical = _median(others)
            evidence = (f"{prefix}/{part} {value:.3g} against {typical:.3g} for the {'other ' if part in blocks else ''}"
                        f"blocks ({value / typical:.0f}x; medians over the logged steps)")
            return Finding("layer_outlier", f"one layer's {what} an order above the others", evidence,
                           f"{part} is scaled unlike the rest (its initialisation, or activations that grew there); "
                           "the global clip then holds back every other layer",
                           f"check the initialisation (model.init_std); {_lower_rate(run, 3)}; for attention logits "
                           f"that grow, QK-norm ({QK_NORM})")
    return None


def _logit_fix(run: RunFigures) -> str:
    z_loss = None
    if "z_loss" in run.config.get("train", {}):  # a run of a version with the key
        weight = run.key("train.z_loss") or 0.0
        z_loss = (f"a stronger train.z_loss={_g(10 * weight)}" if weight > 0 else
                  "train.z_loss=1e-4 (a penalty on the log-partition function)")
    qk = f"QK-norm in attention ({QK_NORM})"
    return "; or ".join(x for x in (z_loss, qk) if x)


def max_logit_growing(run: RunFigures) -> Finding | None:
    """The largest logit (``max_abs_logit``, or ``max_logit``) grew :data:`MAX_LOGIT_GROWTH` times after warmup and
    ended above :data:`MAX_LOGIT_FLOOR`."""
    key = next((k for k in LOGIT_KEYS if any(finite(r.get(k)) for r in run.train)), None)
    rows = [r for r in run.after_warmup() if key and finite(r.get(key))]
    if len(rows) < MIN_ROWS:
        return None
    first, last = rows[0][key], _median(r[key] for r in rows[-TAIL_ROWS:])
    if last < MAX_LOGIT_FLOOR or first <= 0 or last / first < MAX_LOGIT_GROWTH:
        return None
    evidence = f"{key} {first:.3g} at step {rows[0]['step']}, {last:.3g} at the end (step {rows[-1]['step']})"
    z = [r["z_loss"] for r in rows if finite(r.get("z_loss"))]
    if z:
        evidence += f"; z_loss {z[0]:.3g} -> {z[-1]:.3g}"
    return Finding("max_logit_growing", "largest logit growing", evidence,
                   "logits growing without bound: the softmax saturates and the loss spikes follow", _logit_fix(run))


def frequent_rollbacks(run: RunFigures) -> Finding | None:
    """:data:`FREQUENT_ROLLBACKS` or more rollbacks of the spike guard in the run's sessions."""
    steps = [e["step"] for launch in run.meta.get("launches", []) for e in launch.get("events", [])
             if e.get("kind") == "rollback"]
    if len(steps) < FREQUENT_ROLLBACKS:
        return None
    evidence = f"{len(steps)} rollbacks, to steps {', '.join(map(str, steps))}"
    if at_floor(run, [r for r in run.train if r["step"] >= min(steps)]):
        return Finding("frequent_spikes", "loss spikes, frequently", evidence,
                       "bad batches: the rate is at the schedule's floor from the first of them on",
                       "check the data those steps read (the skipped samples are in spikes.jsonl)")
    return Finding("frequent_spikes", "loss spikes, frequently", evidence,
                   "an isolated spike is a bad batch; frequent ones, a rate too high", _lower_rate(run, 2) + " (half)")


def data_wait(run: RunFigures) -> Finding | None:
    """Data wait above :data:`DATA_WAIT_FRACTION` of the time in training steps (the first interval left out)."""
    rows = [r for r in run.train[1:] if finite(r.get("data_time_s")) and finite(r.get("interval_time_s"))]
    total = sum(r["interval_time_s"] for r in rows)
    if not rows or total < DATA_WAIT_MIN_SECONDS:
        return None
    waited = sum(r["data_time_s"] * (r.get("interval_steps") or 1) for r in rows)
    if waited <= DATA_WAIT_FRACTION * total:
        return None
    worst = max(rows, key=lambda r: r["data_time_s"] / max(r.get("step_time_s") or 1e-12, 1e-12))
    evidence = (f"data wait {100 * waited / total:.1f} % of {total:,.1f} s in training steps over steps "
                f"{rows[0]['step']}-{rows[-1]['step']}; the most at step {worst['step']}: "
                f"{1000 * worst['data_time_s']:.1f} ms of {1000 * (worst.get('step_time_s') or 0):.1f} ms per step")
    return Finding("data_wait", "steps waiting for data", evidence,
                   "the input pipeline falls behind the step",
                   "keep the data pre-tokenized and memory-mapped (tools/prepare_data.py) on a local disk rather than a "
                   "network file system, and leave the data loading's cores free of other work")


def val_rising(run: RunFigures) -> Finding | None:
    """The validation loss rises :data:`VAL_RISE_FRACTION` above its best while the training loss falls."""
    if len(run.val) < MIN_EVALS:
        return None
    best, last = min(run.val, key=lambda r: r["val_loss"]), run.val[-1]
    if last is best or last["val_loss"] < best["val_loss"] * (1 + VAL_RISE_FRACTION):
        return None
    train_at = {r["step"]: r["loss"] for r in run.train if finite(r["loss"])}
    before, after = _loss_near(train_at, best["step"]), _loss_near(train_at, last["step"])
    if before is None or after is None or after >= before:
        return None
    evidence = (f"val_loss {best['val_loss']:.4f} at step {best['step']} (best), {last['val_loss']:.4f} at step "
                f"{last['step']}, while the training loss went {before:.4f} -> {after:.4f}")
    epochs = run.epochs(last["step"])
    if epochs is not None:
        evidence += f"; {epochs:.1f} epochs of the training data by step {last['step']}"
    cause = "overfitting: the model is large for the data" + (
        ", which it has seen more than once" if epochs is not None and epochs > 1 else "")
    weight_decay = run.key("optim.weight_decay")
    fix = (f"more training data (data.path, data.sources); a stronger optim.weight_decay="
           f"{_g(2 * weight_decay) if finite(weight_decay) and weight_decay else 0.1}; or stop at the best "
           f"evaluation (train.max_steps={best['step']}, or train.early_stopping_patience=2)")
    return Finding("val_rising", "validation loss rising while training loss falls", evidence, cause, fix)


def _loss_near(train_at: dict[int, float], step: int) -> float | None:
    """The training loss logged at ``step``, else at the nearest logged step before it."""
    earlier = [s for s in train_at if s <= step]
    return train_at[max(earlier)] if earlier else None


def throughput_drop(run: RunFigures) -> Finding | None:
    """A run of slow intervals (:data:`THROUGHPUT_DROP` of the median before them), sustained as
    :data:`THROUGHPUT_MIN_ROWS` and :data:`THROUGHPUT_MIN_SECONDS` say."""
    rows = [r for r in run.train[1:] if finite(r.get("tokens_per_sec")) and r["tokens_per_sec"] > 0]
    streak: list[dict] = []
    for i in range(THROUGHPUT_MIN_ROWS, len(rows)):
        baseline = _median(r["tokens_per_sec"] for r in rows[:i - len(streak)])
        if rows[i]["tokens_per_sec"] < THROUGHPUT_DROP * baseline:
            streak.append(rows[i])
            if len(streak) >= THROUGHPUT_MIN_ROWS and \
                    sum(r.get("interval_time_s") or 0.0 for r in streak) >= THROUGHPUT_MIN_SECONDS:
                return _drop_finding(streak, baseline, rows, i)
        else:
            streak = []
    return None


def _drop_finding(streak: list[dict], baseline: float, rows: list[dict], end: int) -> Finding:
    while end + 1 < len(rows) and rows[end + 1]["tokens_per_sec"] < THROUGHPUT_DROP * baseline:
        end += 1
        streak.append(rows[end])
    slow = _median(r["tokens_per_sec"] for r in streak)
    share = [r["data_time_s"] / r["step_time_s"] for r in streak if finite(r.get("data_time_s")) and r.get("step_time_s")]
    evidence = (f"{baseline:,.0f} tokens/s before step {streak[0]['step']}, then {slow:,.0f} (median) over steps "
                f"{streak[0]['step']}-{streak[-1]['step']}")
    cause = "the input pipeline falls behind" if share and _median(share) > DATA_WAIT_FRACTION else \
        "the steps themselves slowed (another job on the device or host, thermal limits, memory pressure)"
    if share:
        evidence += f"; data wait {100 * _median(share):.1f} % of those steps"
    return Finding("throughput_drop", "throughput dropped mid-run", evidence, cause,
                   "pre-tokenized memory-mapped data on a local disk; check what else runs on the machine "
                   "(nvidia-smi, top) at those steps")


def resume_jump(run: RunFigures) -> Finding | None:
    """The first loss logged after a resume above the last :data:`TAIL_ROWS` before it by :data:`RESUME_JUMP_FRACTION`
    and by :data:`NOISE_Z` times one step's scatter (:func:`loss_scatter`)."""
    for launch in run.meta.get("launches", [])[1:]:
        start = launch.get("start_step")
        if not launch.get("resumed_from") or start is None:
            continue
        before = [r for r in run.train if r["step"] <= start and finite(r["loss"])][-TAIL_ROWS:]
        after = next((r for r in run.train if r["step"] > start), None)
        if not before or after is None or not finite(after["loss"]):
            continue
        highest = max(r["loss"] for r in before)
        if after["loss"] > highest * (1 + RESUME_JUMP_FRACTION) and \
                _significant(after["loss"] - highest, loss_scatter([r for r in run.train if finite(r["loss"])]), 1):
            evidence = (f"loss {highest:.4f} at most over steps {before[0]['step']}-{before[-1]['step']}, "
                        f"{after['loss']:.4f} at step {after['step']}, after the resume at step {start} from "
                        f"{launch['resumed_from']}")
            return Finding("resume_jump", "loss jumps after a resume", evidence,
                           "part of the training state was not restored (optimizer moments, loss scaler, the data "
                           "order), or the configuration changed at the resume",
                           "resume from a complete checkpoint with its full state (checkpoint.resume=auto, or the "
                           "checkpoint folder), not from weights alone (model.init_from); compare config.yaml of "
                           "the sessions")
    return None


def straggler(run: RunFigures) -> Finding | None:
    """Each rank the straggler instrument named (``distributed.stragglers``), with its host, steps and largest ratio."""
    named: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for row, entry in ((row, entry) for row in run.train for entry in row.get("stragglers") or ()):
        named.setdefault((entry["rank"], entry["host"]), []).append((row["step"], entry["ratio"]))
    hosts = ",".join(sorted({host for _, host in named}))
    evidence = "; ".join(f"rank {rank} on {host}: up to {max(r for _, r in seen):.2f}x the median rank's forward time "
                         f"(steps {seen[0][0]}-{seen[-1][0]})" for (rank, host), seen in sorted(named.items()))
    cause = "a slow device or host (another job on its GPU or cores, a power or thermal limit); every rank waits for it"
    fix = f"check {hosts} (nvidia-smi -q -d PERFORMANCE,CLOCK; top), or resume without it (sbatch --exclude={hosts})"
    return Finding("straggler", "a rank computes slower than the others", evidence, cause, fix) if named else None
