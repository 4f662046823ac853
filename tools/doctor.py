"""The run doctor: the playbook's symptoms found in a run folder's own figures, with their evidence and fix.

    python tools/doctor.py runs/tiny
    python tools/doctor.py runs/tiny --strict    # exit 1 when there are findings

Reads ``metrics.jsonl`` and ``run_meta.json`` (also while the run writes them) and prints each finding: the symptom,
the steps and values that show it, the likely cause and the fix as recipe keys (``lmrecipe/observe/doctor.py``,
where the thresholds are). A healthy run prints that there is none. Exit 0, or 1 with ``--strict`` and findings;
2 for a folder that is not a run.
"""

import argparse
import sys
from pathlib import Path


from lmrecipe.cli import cli_main  # noqa: E402
from lmrecipe.errors import fail  # noqa: E402
from lmrecipe.observe.doctor import diagnose_run, is_run_folder, read_rows  # noqa: E402


@cli_main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run folder (the out_dir of train.py)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there are findings")
    args = parser.parse_args()
    run = Path(args.run)
    if not run.is_dir() or not is_run_folder(run):
        hint = (f" It looks like a checkpoint: name the run folder that holds it, {run.parents[1]}."
                if (run / "train_state.json").is_file() and len(run.parents) > 1 else "")
        raise fail(f"{run} is not a run folder: it holds neither metrics.jsonl nor run_meta.json.{hint} Name the "
                   "out_dir of a run of train.py (e.g. runs/tiny).")
    findings = diagnose_run(run)
    train_rows = [r for r in read_rows(run / "metrics.jsonl") if "loss" in r]
    upto = f", up to step {train_rows[-1]['step']}" if train_rows else ""
    print(f"{run}: {len(train_rows)} logged training steps{upto}; "
          f"{len(findings) or 'no'} finding{'' if len(findings) == 1 else 's'}")
    for finding in findings:
        print("\n".join(finding.lines()))
    return 1 if args.strict and findings else 0


if __name__ == "__main__":
    sys.exit(main())
