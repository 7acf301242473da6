"""Packed vs unpacked pre-training on real text: convergence per sequence seen, and speed.

    python benchmarks/convergence.py                       # the quick run (~11-15 min, 2 shared cores)
    python benchmarks/convergence.py --preset full         # 4 layers, hidden 256, 1500 steps
    python benchmarks/convergence.py --preset dry --workdir /tmp/conv --plot /tmp/conv.png   # the plumbing

Corpus: the King James Bible (Debian bible-kjv): Genesis..Jude for training, Revelation
held out for evaluation; chapters are documents. Pipeline: `vocab` -> `create` (S=128,
20 predictions, Google's algorithm) -> `pack` (lpfhp, depth 3).

Two runs of `run.py` from the same initial weights (same seed; the packing depth K
changes no parameter, which the script checks): unpacked (K=1, micro-batch B) and packed
(K=3, micro-batch round(B / p), p = sequences per pack of the packed file), so both take
about B sequences per optimizer update; same optimizer, schedule and steps. Both are
evaluated on the same held-out unpacked file. The two runs go side by side, one thread
each, so they share the machine's load equally; their sequences/s ratio is the packed
run's wall-time speed-up. Output: WORKDIR/results.json, a PNG (default
docs/convergence.png) of eval MLM and NSP accuracy against sequences seen, and a
Markdown table on stdout.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)

from benchmarks.common import markdown_table  # noqa: E402

PRESETS = {
    # Fits ~15 minutes on a busy 2-core machine: a 2-layer, hidden-128 BERT.
    "quick": dict(layers=2, hidden=128, heads=2, steps=900, micro_batch_size=16, eval_every=50,
                  vocab_size=2048, learning_rate=0.01),
    # The model: 4 layers, hidden 256 (hours on a laptop CPU, minutes on a GPU).
    "full": dict(layers=4, hidden=256, heads=4, steps=1500, micro_batch_size=32, eval_every=100,
                 vocab_size=4096, learning_rate=0.006),
    # The plumbing only (--preset dry): Genesis 1-10 and Revelation 1-5, 1 layer, hidden 32, 4 steps.
    "dry": dict(layers=1, hidden=32, heads=2, steps=4, micro_batch_size=8, eval_every=2, vocab_size=400,
                learning_rate=0.01, train=("Gen1:1", "Gen10:32"), eval=("Rev1:1", "Rev5:14")),
}


def sh(*args, **kwargs):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True,
                            text=True, **kwargs)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, args))}\n{result.stderr}")
    return result.stdout.strip()


def prepare_data(workdir, vocab_size, dupe_factor, seed, train=("Gen1:1", "Jude1:25"), held_out=("Rev1:1", "Rev22:21")):
    """Corpus -> vocab -> create -> pack (skipped where the file exists); ``train`` and ``held_out``:
    the KJV's (first, last) verses of each."""
    paths = {name: os.path.join(workdir, name) for name in
             ("train.txt", "eval.txt", "vocab.txt", "train.h5", "eval.h5", "packed.h5")}
    steps = [
        ("train.txt", ["-m", "bert_packed.data", "kjv", "--output", paths["train.txt"],
                       "--first", train[0], "--last", train[1]]),
        ("eval.txt", ["-m", "bert_packed.data", "kjv", "--output", paths["eval.txt"],
                      "--first", held_out[0], "--last", held_out[1]]),
        ("vocab.txt", ["-m", "bert_packed.data", "vocab", "--input", paths["train.txt"],
                       "--size", vocab_size, "--output", paths["vocab.txt"]]),
        ("train.h5", ["-m", "bert_packed.data", "create", "--input", paths["train.txt"],
                      "--vocab", paths["vocab.txt"], "--output", paths["train.h5"],
                      "--max-seq-length", 128, "--max-predictions", 20,
                      "--dupe-factor", dupe_factor, "--seed", seed]),
        ("eval.h5", ["-m", "bert_packed.data", "create", "--input", paths["eval.txt"],
                     "--vocab", paths["vocab.txt"], "--output", paths["eval.h5"],
                     "--max-seq-length", 128, "--max-predictions", 20, "--dupe-factor", 6,
                     "--seed", seed + 1]),
        ("packed.h5", ["-m", "bert_packed.data", "pack", "--input", paths["train.h5"],
                       "--output", paths["packed.h5"], "--algorithm", "lpfhp",
                       "--max-sequences-per-pack", 3, "--seed", seed]),
    ]
    for name, args in steps:
        if not os.path.exists(paths[name]):
            print(sh(*args), file=sys.stderr)
    return paths


def overrides(args, preset, paths, depth, micro_batch_size, num_eval_batches, num_vocab):
    values = {
        "model.vocab_size": num_vocab, "model.hidden_size": preset["hidden"],
        "model.num_hidden_layers": preset["layers"], "model.num_attention_heads": preset["heads"],
        "model.intermediate_size": 4 * preset["hidden"], "model.max_position_embeddings": 128,
        "model.hidden_dropout_prob": 0.1, "model.attention_probs_dropout_prob": 0.1,
        "data.path": paths["packed.h5"] if depth > 1 else paths["train.h5"],
        "data.eval_path": paths["eval.h5"], "data.max_sequence_length": 128,
        "data.max_sequences_per_pack": depth, "data.max_masked_tokens": 20,
        "optimizer.learning_rate": preset["learning_rate"],
        "train.steps": preset["steps"], "train.micro_batch_size": micro_batch_size,
        "train.gradient_accumulation": 1, "train.packing_adjustment": "none",
        "train.seed": args.seed, "train.eval_every": preset["eval_every"],
        "train.eval_batches": num_eval_batches, "train.checkpoint_every": 0,
        "train.tensorboard": False, "train.num_threads": args.threads, "train.log_every": 1,
    }
    return [f"{key}={value}" for key, value in values.items()]


def check_same_initial_weights(sets):
    """Both configs build bit-identical models under the training loop's seeding."""
    import torch

    from bert_packed.config import load_config
    from run import register_config_sections

    register_config_sections()
    from bert_packed.tasks.pretraining.model import build_model

    states = []
    for values in sets:
        config = load_config("demo", values)
        torch.manual_seed(config.train.seed)
        states.append(build_model(config).state_dict())
    return all(torch.equal(states[0][name], states[1][name]) for name in states[0])


def read_run(output_dir):
    lines = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(output_dir, "summary.json")))
    seen, evals, train = 0, [], []
    for line in lines:
        seen += line["sequences"]
        train.append((seen, line["mlm_accuracy"], line["nsp_accuracy"]))
        if "eval_mlm_accuracy" in line:
            evals.append((seen, line["eval_mlm_accuracy"], line["eval_nsp_accuracy"],
                          line["eval_mlm_loss"]))
    return {"evals": evals, "train": train, "summary": summary}


def plot(results, output_path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"unpacked": "tab:blue", "packed": "tab:orange"}
    for name, run in results.items():
        train = np.array(run["train"])
        window = max(1, len(train) // 30)
        smooth = np.convolve(train[:, 1], np.ones(window) / window, mode="valid")
        axes[0].plot(train[window - 1:, 0], smooth, color=colors[name], alpha=0.3, lw=1,
                     label=f"{name} (train, running mean)")
        evals = np.array(run["evals"])
        axes[0].plot(evals[:, 0], evals[:, 1], "o-", color=colors[name], label=f"{name} (held-out)")
        axes[1].plot(evals[:, 0], evals[:, 2], "o-", color=colors[name], label=f"{name} (held-out)")
    axes[0].set_ylabel("MLM accuracy")
    axes[1].set_ylabel("NSP accuracy")
    for axis in axes:
        axis.set_xlabel("sequences seen")
        axis.grid(alpha=0.3)
        axis.ticklabel_format(axis="y", useOffset=False)
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    from bert_packed.io.files import atomic_path

    with atomic_path(output_path) as tmp:
        figure.savefig(tmp, dpi=110, format="png")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--steps", type=int, help="override the preset's optimizer steps")
    parser.add_argument("--workdir", default=os.path.join("runs", "convergence"))
    parser.add_argument("--plot", default=os.path.join("docs", "convergence.png"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dupe-factor", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--sequential", action="store_true",
                        help="run one after the other (default: side by side)")
    args = parser.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    if args.steps:
        preset["steps"] = args.steps
    workdir = os.path.join(args.workdir, args.preset)
    os.makedirs(workdir, exist_ok=True)
    paths = prepare_data(workdir, preset["vocab_size"], args.dupe_factor, args.seed,
                         **({"train": preset["train"], "held_out": preset["eval"]} if "train" in preset else {}))

    import h5py

    with h5py.File(paths["packed.h5"], "r") as handle:
        packing_factor = float(handle.attrs["packing_factor"])
    with h5py.File(paths["eval.h5"], "r") as handle:
        num_eval = len(handle["input_ids"])
    num_vocab = sum(1 for _ in open(paths["vocab.txt"]))
    batch = preset["micro_batch_size"]
    packed_batch = max(1, round(batch / packing_factor))
    # Both runs evaluate the same first num_eval_used held-out sequences (in file order),
    # a multiple of both micro-batch sizes.
    common = math.lcm(batch, packed_batch)
    num_eval_used = num_eval // common * common
    if num_eval_used == 0:
        sys.exit(f"the eval file has {num_eval} sequences, fewer than lcm({batch}, {packed_batch})")
    runs = {"unpacked": (1, batch), "packed": (3, packed_batch)}
    sets = {name: overrides(args, preset, paths, depth, size, num_eval_used // size, num_vocab)
            for name, (depth, size) in runs.items()}
    same_init = check_same_initial_weights(list(sets.values()))
    print(f"packing factor {packing_factor:.3f}: unpacked micro-batch {batch}, packed {packed_batch} "
          f"(~{packed_batch * packing_factor:.1f} sequences); same initial weights: {same_init}",
          file=sys.stderr)

    processes, started = {}, time.time()
    for name in runs:
        command = [sys.executable, "run.py", "--backend", "cpu", "--config", "demo", "--output-dir",
                   os.path.join(workdir, name), "--no-progress"]
        for value in sets[name]:
            command += ["--set", value]
        log = open(os.path.join(workdir, f"{name}.log"), "w")
        processes[name] = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if args.sequential:
            processes[name].wait()
    for name, process in processes.items():
        if process.wait() != 0:
            sys.exit(f"{name} run failed; see {os.path.join(workdir, name + '.log')}")
    print(f"both runs done in {time.time() - started:.0f} s", file=sys.stderr)

    results = {name: read_run(os.path.join(workdir, name)) for name in runs}
    speed = {name: results[name]["summary"]["sequences_per_second"] for name in runs}
    final = {name: results[name]["evals"][-1] for name in runs}
    gaps = [abs(a[1] - b[1]) for a, b in zip(results["unpacked"]["evals"], results["packed"]["evals"])]
    report = {
        "preset": args.preset, "model": {k: preset[k] for k in ("layers", "hidden", "heads")},
        "steps": preset["steps"], "packing_factor": packing_factor,
        "micro_batch_size": {"unpacked": batch, "packed": packed_batch},
        "same_initial_weights": same_init, "num_eval_sequences": num_eval_used,
        "sequences_seen": {name: final[name][0] for name in runs},
        "eval_mlm_accuracy": {name: final[name][1] for name in runs},
        "eval_nsp_accuracy": {name: final[name][2] for name in runs},
        "eval_mlm_loss": {name: final[name][3] for name in runs},
        "max_eval_mlm_accuracy_gap": max(gaps),
        "sequences_per_second": speed, "speedup": speed["packed"] / speed["unpacked"],
        "side_by_side": not args.sequential, "threads_per_run": args.threads,
    }
    with open(os.path.join(workdir, "results.json"), "w") as handle:
        json.dump({"report": report, "runs": results}, handle, indent=1)
    plot(results, args.plot, f"KJV Bible, S=128, {preset['layers']} layers, hidden {preset['hidden']}: "
         f"packed (p={packing_factor:.2f}) vs unpacked, ~{batch} sequences per update")
    print(markdown_table(["run", "micro-batch", "sequences seen", "eval MLM acc", "eval NSP acc", "eval MLM loss",
                          "sequences/s"],
                         [[name, report["micro_batch_size"][name], f"{final[name][0]:.0f}", f"{final[name][1]:.4f}",
                           f"{final[name][2]:.4f}", f"{final[name][3]:.4f}", f"{speed[name]:.2f}"] for name in runs]))
    print(f"\nlargest eval MLM accuracy gap at equal steps: {100 * max(gaps):.2f} points; "
          f"wall-time speed-up of the packed run: {report['speedup']:.3f}x "
          f"(packing factor {packing_factor:.3f})")


if __name__ == "__main__":
    main()
