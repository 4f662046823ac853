"""Tokenize a corpus into a data folder for training: train/val .bin and .idx, meta.json and the tokenizer.

    python tools/prepare_data.py --output data/stdlib                       # embedded Python stdlib corpus
    python tools/prepare_data.py --input corpus/ --output data/mine --vocab-size 16384
    python tools/prepare_data.py --input docs.jsonl --text-field body --tokenizer gpt2 --output data/docs

The corpus is streamed: memory does not grow with its size. See lmrecipe/data/prepare/ for the folder format
(write.py), the split rule (read.py) and what happens after an interruption (run the command again; it starts over).
"""

import argparse
import inspect
import sys
from pathlib import Path

# Run as `python tools/prepare_data.py` from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmrecipe.cli import check_output_path, cli_main, setup_logging  # noqa: E402
from lmrecipe.data.prepare.pipeline import prepare  # noqa: E402

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
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    check_output_path(args.output, "--output")
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
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
