"""Packed vs padded fine-tuning on the fortunes classification example (docs/finetuning.md).

Runs the same `run.py --config finetune_classification` job twice from one pre-trained
checkpoint, same seed and epochs: packed (several sequences per row) and padded
(`finetune.packing=false`, one sequence per row). Prints one markdown row per run (validation
accuracy, macro-F1, MCC, steps, rows trained, training seconds) and the ratios, and writes
them as JSON. Training time is `summary.json`'s `train_seconds` (the backend's steps; start-up,
tokenising and evaluation excluded). On a shared CPU, times are noisy: compare ratios.

    python benchmarks/finetune_fortunes.py --checkpoint runs/kjv/hf --data runs/fortunes \\
        --output-dir runs/fortunes-bench [--set train.num_threads=1 ...]
    python benchmarks/finetune_fortunes.py --dry-run --output-dir /tmp/fortunes-bench

``--dry-run``: a tiny random BERT (benchmarks/vs_hf_trainer_common.py's) and the two smallest
categories (pets, kids) written into ``OUT/data``, one epoch: the plumbing, not the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, markdown_table  # noqa: E402

DRY_RUN_CATEGORIES = ("pets", "kids")


def dry_run_inputs(args) -> None:
    """``--dry-run``: ``args.checkpoint`` a tiny random BERT, ``args.data`` two small fortune categories."""
    from benchmarks.vs_hf_trainer_common import tiny_checkpoint
    from bert_packed.finetune.fortunes import write_fortunes_dataset

    out = os.path.abspath(args.output_dir)
    args.checkpoint = tiny_checkpoint(os.path.join(out, "tiny-bert"))
    args.data = os.path.join(out, "data")
    os.makedirs(args.data, exist_ok=True)
    write_fortunes_dataset(args.data, categories=DRY_RUN_CATEGORIES, validation_fraction=0.2)
    args.overrides = ["finetune.epochs=1", "train.num_threads=1"] + args.overrides


def run(name, args, output_dir):
    out = os.path.join(output_dir, name)
    command = [sys.executable, os.path.join(ROOT, "run.py"), "--config", "finetune_classification",
               "--init-checkpoint", args.checkpoint, "--output-dir", out, "--no-progress",
               "--set", f"finetune.train_file={os.path.join(args.data, 'train.csv')}",
               "--set", f"finetune.validation_file={os.path.join(args.data, 'validation.csv')}"]
    for override in args.overrides + (["finetune.packing=false"] if name == "padded" else []):
        command += ["--set", override]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return {"run": name, "accuracy": summary["eval"]["accuracy"], "f1_macro": summary["eval"]["f1_macro"],
            "mcc": summary["eval"]["mcc"], "best_step": summary["eval"]["step"], "steps": summary["steps"],
            "rows": summary["total_packs"], "sequences": summary["total_sequences"],
            "sequences_per_row": summary["packing_factor"], "train_seconds": summary["train_seconds"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="pre-trained Hugging Face directory (e.g. runs/kjv/hf)")
    parser.add_argument("--data", help="directory with train.csv and validation.csv "
                        "(python -m bert_packed.finetune fortunes --output-dir DIR)")
    parser.add_argument("--output-dir", default=os.path.join("runs", "fortunes-bench"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--dry-run", action="store_true", help="a tiny random BERT on two small categories, one "
                        "epoch (the plumbing, not the figures)")
    args = parser.parse_args(argv)
    if args.dry_run:
        dry_run_inputs(args)
    elif not (args.checkpoint and args.data):
        parser.error("--checkpoint and --data are required (or --dry-run)")
    results = [run(name, args, args.output_dir) for name in ("packed", "padded")]
    packed, padded = results
    ratios = {"rows": padded["rows"] / packed["rows"], "steps": padded["steps"] / packed["steps"],
              "train_seconds": padded["train_seconds"] / packed["train_seconds"]}
    print("\n" + markdown_table(["run", "accuracy", "macro-F1", "MCC", "steps", "rows trained", "sequences/row",
                                 "train s"],
                                [[r["run"], f"{r['accuracy']:.4f}", f"{r['f1_macro']:.4f}", f"{r['mcc']:.4f}", r["steps"],
                                  f"{r['rows']:.0f}", f"{r['sequences_per_row']:.2f}", f"{r['train_seconds']:.1f}"]
                                 for r in results]))
    print(f"\npadded / packed: {ratios['rows']:.2f}x rows, {ratios['steps']:.2f}x steps, "
          f"{ratios['train_seconds']:.2f}x training time")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "fortunes_bench.json"), "w") as f:
        json.dump({"runs": results, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
