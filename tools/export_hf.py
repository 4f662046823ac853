"""Export a training checkpoint as a Hugging Face model folder for inference loaders.

    python tools/export_hf.py runs/tiny/checkpoints/step_00000300 exports/tiny --dtype bf16
    python tools/export_hf.py runs/tiny exports/tiny-fp32 --dtype fp32 --max-shard-size 500MB   # newest checkpoint
    python tools/export_hf.py runs/tiny exports/tiny-ema --weights ema   # the weight EMA (train.ema_decay > 0)
    python tools/export_hf.py s3://bucket/runs/tiny exports/tiny   # a run uploaded with checkpoint.remote

Writes model-0000i-of-0000n.safetensors + model.safetensors.index.json, config.json, generation_config.json,
the tokenizer files and a model card (README.md: the model, its data, losses and training command). ZeRO-1/2/3
shards are consolidated offline on this machine (no GPU, no DeepSpeed launch), whatever the number of ranks that
wrote them. A checkpoint given as a URL (s3://, gs://; the run, its checkpoints/ or one step_N) is downloaded into
~/.cache/lmrecipe/checkpoints first (pip install -e ".[remote]"). See lmrecipe/export.py.
"""

import argparse
import sys


from lmrecipe.cli import check_tool_output, cli_main, setup_logging  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint folder (out_dir/checkpoints/step_N), or a run folder for its newest; "
                        "or the URL of either in object storage (s3://..., gs://...)")
    parser.add_argument("out_dir", help="export folder to create")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weight dtype (default: %(default)s)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB (default: %(default)s)")
    parser.add_argument("--weights", choices=("raw", "ema"), default="raw",
                        help="the trained weights, or their moving average saved with train.ema_decay > 0 (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT_DIR if it exists (never a checkpoint, a run folder, or a folder that holds one)")
    args = parser.parse_args(argv)
    setup_logging()
    remote = "://" in args.checkpoint
    check_tool_output(args.out_dir, "OUT_DIR", overwrite=args.overwrite, reads=[] if remote else [args.checkpoint])
    if remote:  # downloaded into the cache first (lmrecipe/checkpoint/remote.py), then exported as a local one
        from lmrecipe.checkpoint.remote import fetch_remote

        args.checkpoint = str(fetch_remote(args.checkpoint))
    from lmrecipe.export import export_checkpoint  # heavy imports only after the arguments parsed

    export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                      overwrite=args.overwrite, weights=args.weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
