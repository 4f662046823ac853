"""Tokenize a corpus into a data folder for training: train/val .bin and .idx, meta.json and the tokenizer.

    python tools/prepare_data.py --output data/stdlib                       # embedded Python stdlib corpus
    python tools/prepare_data.py --input corpus/ --output data/mine --vocab-size 16384
    python tools/prepare_data.py --input docs.jsonl --text-field body --tokenizer gpt2 --output data/docs

    # Sharded, e.g. one task of a SLURM array each (slurm/prepare.sbatch): shard i of 8 of the corpus's files
    python tools/prepare_data.py --input corpus/ --tokenizer data/tok --output data/big --shard 3/8
    python tools/prepare_data.py --output data/big --finish-shards     # by hand; the last shard does it itself

The corpus is streamed: memory does not grow with its size. See lmrecipe/data/prepare/ for the folder format
(write.py), the split rule (read.py), shard sets (shards.py) and what happens after an interruption (run the command
again; it starts over).
"""

import argparse
import inspect
import sys
from pathlib import Path


from lmrecipe.cli import check_tool_output, cli_main, setup_logging  # noqa: E402
from lmrecipe.data.prepare.pipeline import prepare  # noqa: E402
from lmrecipe.data.prepare.shards import finish_shards  # noqa: E402

# The defaults live once, in prepare()'s signature.
DEFAULTS = {name: param.default for name, param in inspect.signature(prepare).parameters.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("input (default: the running Python's standard library)")
    source.add_argument("--input", nargs="+", action="extend", default=[], metavar="PATH",
                        help="text files (one document each), jsonl/json/parquet files (one per record), or "
                             "folders of them, read recursively; may be repeated")
    source.add_argument("--hub-dataset", default=DEFAULTS["hub_dataset"], metavar="NAME",
                        help="Hugging Face Hub dataset (train split); needs network access")
    source.add_argument("--text-field", default=DEFAULTS["text_field"],
                        help="record field holding the text (default: %(default)s)")
    source.add_argument("--max-documents", type=int, default=DEFAULTS["max_documents"], metavar="N",
                        help="keep only the first N non-empty documents")
    tok = parser.add_argument_group("tokenizer (default: train a byte-level BPE on the train split)")
    tok.add_argument("--tokenizer", default=DEFAULTS["tokenizer"], metavar="NAME_OR_PATH",
                     help="Hugging Face tokenizer name or local folder instead of training one")
    tok.add_argument("--vocab-size", type=int, default=DEFAULTS["vocab_size"],
                     help="size of the trained BPE vocabulary, <|endoftext|> included (default: %(default)s)")
    tok.add_argument("--tokenizer-sample-mb", type=float, default=DEFAULTS["tokenizer_sample_mb"], metavar="MB",
                     help="train the BPE on the first MB megabytes of train documents, in reading order; bounds its "
                          "memory on a large corpus (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=DEFAULTS["val_fraction"],
                        help="share of documents held out for validation, in (0, 0.5] (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                        help="salt of the train/val split (default: %(default)s)")
    parser.add_argument("--num-proc", type=int, default=DEFAULTS["num_proc"], metavar="N",
                        help="tokenizer processes (default: all CPU cores)")
    parser.add_argument("--output", required=True, metavar="OUT_DIR", help="folder to create")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    shards = parser.add_argument_group("sharded preparation (many processes or SLURM array tasks, one shard each)")
    shards.add_argument("--shard", type=shard_arg, default=DEFAULTS["shard"], metavar="I/N",
                        help="prepare only shard I of N (0 <= I < N) of the corpus's files into "
                             "OUT_DIR/shard-0000I-of-0000N (needs --tokenizer); the shard that completes the set "
                             "writes OUT_DIR/meta.json, and training reads OUT_DIR as one folder")
    shards.add_argument("--finish-shards", action="store_true",
                        help="check the shards in OUT_DIR (all N there, one corpus, one tokenizer) and write "
                             "OUT_DIR/meta.json; names any missing shard")
    return parser


def shard_arg(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not (sep and index.strip().isdigit() and count.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 3/8: shard 3 of 8, counted from 0)")
    return int(index), int(count)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    # A shard set is filled shard by shard: prepare() itself decides what an existing one may take.
    overwrite = None if args.shard is not None or args.finish_shards else args.overwrite
    local_tokenizer = [args.tokenizer] if args.tokenizer and Path(args.tokenizer).exists() else []
    check_tool_output(args.output, "--output", overwrite=overwrite, reads=[*args.input, *local_tokenizer])
    if args.finish_shards:
        finish_shards(args.output)
        return 0
    prepare(
        output=args.output,
        inputs=args.input,
        hub_dataset=args.hub_dataset,
        text_field=args.text_field,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        tokenizer_sample_mb=args.tokenizer_sample_mb,
        val_fraction=args.val_fraction,
        num_proc=args.num_proc,
        max_documents=args.max_documents,
        overwrite=args.overwrite,
        seed=args.seed,
        shard=args.shard,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
