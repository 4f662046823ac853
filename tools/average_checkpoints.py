"""Average the weights of several training checkpoints into a Hugging Face model folder.

    python tools/average_checkpoints.py runs/tiny --last 3 --out exports/tiny-avg3
    python tools/average_checkpoints.py runs/tiny/checkpoints/step_00000200 runs/tiny/checkpoints/step_00000300 \
        --weights 1,2 --out exports/tiny-avg --dtype bf16

The average is accumulated in fp32, one parameter at a time (ZeRO-1/2/3 and tensor-parallel shards are read in
place), and written as tools/export_hf.py writes an export: sharded safetensors, config, tokenizer and a model card,
built in a temporary folder and renamed into place. Averaging helps most over the last checkpoints of a stable
(constant learning rate) phase. See lmrecipe/average.py.
"""

import argparse
import sys


from lmrecipe.cli import check_tool_output, cli_main, setup_logging  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="checkpoint folders (out_dir/checkpoints/step_N), or one run folder "
                                                 "with --last K")
    parser.add_argument("--last", type=int, default=None, help="average the K newest checkpoints of the run folder")
    parser.add_argument("--weights", default=None,
                        help="comma-separated shares, one per checkpoint, oldest first (default: uniform)")
    parser.add_argument("--out", required=True, help="export folder to create")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32", help="weight dtype (default: %(default)s)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists (never a checkpoint, a run folder, or a folder that holds one)")
    args = parser.parse_args(argv)
    setup_logging()
    check_tool_output(args.out, "--out", overwrite=args.overwrite, reads=args.paths)
    from lmrecipe.average import average_checkpoints, parse_weights, select_checkpoints  # heavy imports after parsing

    checkpoints = select_checkpoints(args.paths, args.last)
    weights = parse_weights(args.weights, len(checkpoints))
    average_checkpoints(checkpoints, args.out, weights=weights, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        overwrite=args.overwrite, progress=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
