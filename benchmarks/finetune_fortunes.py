"""Packed vs padded fine-tuning on the fortunes classification example (docs/finetuning.md).

Runs the same `run.py --config finetune_classification` job twice from one pre-trained
checkpoint, same seed and epochs: packed (several sequences per row) and padded
(`finetune.packing=false`, one sequence per row). Prints one markdown row per run (validation
accuracy, macro-F1, MCC, steps, rows trained, training seconds) and the ratios, and writes
them as JSON. Training time is `summary.json`'s `train_seconds` (the backend's steps; start-up,
tokenising and evaluation excluded). On a shared CPU, times are noisy: compare ratios.

    python benchmarks/finetune_fortunes.py --checkpoint runs/kjv/hf --data runs/fortunes \\
        --output-dir runs/fortunes-bench [--set train.num_threads=1 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    parser.add_argument("--checkpoint", required=True, help="pre-trained Hugging Face directory (e.g. runs/kjv/hf)")
    parser.add_argument("--data", required=True, help="directory with train.csv and validation.csv "
                        "(python -m bert_packed.finetune fortunes --output-dir DIR)")
    parser.add_argument("--output-dir", default=os.path.join("runs", "fortunes-bench"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    results = [run(name, args, args.output_dir) for name in ("packed", "padded")]
    packed, padded = results
    ratios = {"rows": padded["rows"] / packed["rows"], "steps": padded["steps"] / packed["steps"],
              "train_seconds": padded["train_seconds"] / packed["train_seconds"]}
    print("\n| run | accuracy | macro-F1 | MCC | steps | rows trained | sequences/row | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['accuracy']:.4f} | {r['f1_macro']:.4f} | {r['mcc']:.4f} | {r['steps']} | "
              f"{r['rows']:.0f} | {r['sequences_per_row']:.2f} | {r['train_seconds']:.1f} |")
    print(f"\npadded / packed: {ratios['rows']:.2f}x rows, {ratios['steps']:.2f}x steps, "
          f"{ratios['train_seconds']:.2f}x training time")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "fortunes_bench.json"), "w") as f:
        json.dump({"runs": results, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
