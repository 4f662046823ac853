"""What running gated DeltaNet layers per document costs: tokens/s of a tiny Qwen3.5-MoE forward+backward.

    bench/run.py linear_attention_documents                        # documents of about 64 and 1,024 tokens
    bench/run.py linear_attention_documents --doc-lens 128 --seq-len 1024 --rows 4

Three sides on the same weights and batches, interleaved: ``per-document`` (data.document_masking: attention masked
and every DeltaNet layer run per document), ``attention-only`` (the DeltaNet layers over the whole row: documents
leak, which the recipe refuses) and ``plain`` (no masking). A row of --seq-len tokens is cut from a stream of
documents of exponentially distributed lengths of mean --doc-lens. The DeltaNet is transformers' torch fallback.
"""

import statistics
import time

import _common as C

PAIRS = 5
DATA = None
RECIPE = None
SIDES = ("per-document", "attention-only", "plain")


def options(parser) -> None:
    parser.add_argument("--doc-lens", default="64,1024", help="mean document lengths, comma-separated")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--block-steps", type=int, default=1, help="forward+backward passes per timed block")


def batches(seq_len: int, rows: int, mean_doc_len: int, n: int, seed: int = 0):
    """``n`` (inputs, targets, DocumentBatch) of ``rows`` windows, each cut from a stream of random documents."""
    import numpy as np
    import torch

    from lmrecipe.data.documents import document_batch

    rng = np.random.default_rng(seed)
    total = n * rows * seq_len + 1
    lengths = np.maximum(1, rng.exponential(mean_doc_len, size=total // max(1, mean_doc_len // 2) + 16)).astype(int)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    starts = np.append(starts[starts < total], total).astype("<u8")
    # window j of the stream: tokens j * seq_len to (j + 1) * seq_len, and the next one as the last target
    windows = torch.from_numpy(rng.integers(0, 4096, size=total)).unfold(0, seq_len + 1, seq_len).view(n, rows, -1)
    return [(w[:, :-1], w[:, 1:], document_batch(starts, (i * rows + np.arange(rows)) * seq_len, seq_len))
            for i, w in enumerate(windows)]


def build_side(side: str):
    """The tiny model of ``side`` (the same weights for every side) and the forward keywords of a batch."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    from lmrecipe.model.attention import build_document_attention
    from lmrecipe.model.linear_attention import KEYWORD, install_per_document

    config = Qwen3_5MoeTextConfig(
        vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=4096, use_cache=False)
    attention = None if side == "plain" else build_document_attention("sdpa", config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="sdpa" if attention is None else attention.name)
    if side == "per-document":
        install_per_document(model)

    def kwargs(batch) -> dict:
        found = {} if attention is None else attention.forward_kwargs(batch, "cpu")
        if side == "attention-only":
            del found[KEYWORD]
        return found

    return model, kwargs


def time_block(model, kwargs, batches) -> float:
    import torch.nn.functional as F

    start = time.perf_counter()
    for inputs, targets, batch in batches:
        logits = model(input_ids=inputs, **kwargs(batch)).logits
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / len(batches)


def run(args, report) -> None:
    sides, tokens, results = {side: build_side(side) for side in SIDES}, args.rows * args.seq_len, {}
    for mean in (int(x) for x in args.doc_lens.split(",")):
        work = batches(args.seq_len, args.rows, mean, args.block_steps, seed=mean)
        segments = statistics.mean(b.n_segments / args.rows for _, _, b in work)
        seconds, stats = C.interleave(
            report, args.pairs, SIDES, lambda side: time_block(*sides[side], work),
            {"per-document/plain": lambda g: g["per-document"] / g["plain"],
             "per-document/attention-only": lambda g: g["per-document"] / g["attention-only"]},
            lambda g: f"mean doc {mean}: " + ", ".join(f"{side} {tokens / s:.0f} tok/s" for side, s in g.items()),
            warm_up=True)
        row = {f"{side}_tok_s": tokens / statistics.median(s) for side, s in seconds.items()}
        results[mean] = {**row, "segments_per_row": segments, **stats}
        report.line(f"documents of mean {mean} tokens ({segments:.1f} per row of {args.seq_len}): "
                    + ", ".join(f"{side} {row[f'{side}_tok_s']:.0f} tok/s" for side in SIDES)
                    + f"; per-document / plain time {C.fmt_ratio(stats['per-document/plain'])}")
    report.figures = results
