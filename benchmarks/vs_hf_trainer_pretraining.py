"""Packed BERT against the Hugging Face Trainer: pre-training MiniLM's shape on Rotten Tomatoes (CPU).

``python -m bert_packed.data create`` makes BERT pre-training pairs (S=128, 15 % masking, NSP) from the same snippets (one document per movie); the
Trainer trains ``BertForPreTraining`` (MiniLM's encoder, new MLM/NSP heads) on exactly those
pairs (the masks undone, then masked again by ``DataCollatorForLanguageModeling``,
length-grouped); ours trains the file packed by ``python -m bert_packed.data pack`` (lpfhp,
depth 3) from the same initial weights. Both see every pair once (ours drops the last partial
step), so sequences/s compare at an equal number of real tokens (reported).

    python benchmarks/vs_hf_trainer_pretraining.py --repeats 3
    python benchmarks/vs_hf_trainer_pretraining.py --pretrain-snippets 3000 --rows hf-pretrain-grouped,pretrain-packed
    python benchmarks/vs_hf_trainer_pretraining.py --dry-run --output-dir /tmp/vs-hf-pretraining

What both sides share, the columns, the fetched wheels and ``--dry-run``: benchmarks/vs_hf_trainer_common.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_hf_trainer_common as shared  # noqa: E402
from benchmarks.common import ROOT  # noqa: E402

# name -> (side, description), in table order.
PRETRAIN_ROWS = {
    "hf-pretrain-grouped": ("hf", "HF Trainer BertForPreTraining, group_by_length, DataCollatorForLanguageModeling"),
    "pretrain-packed": ("ours", "packed-bert pre-training, packed (lpfhp, depth 3)"),
    "pretrain-packed-compile": ("ours", "packed-bert pre-training, packed + cpu.compile"),
    "pretrain-packed-auto": ("ours", "packed-bert pre-training, packed + model.attention_implementation=auto "
                                     "(on the CPU bucketed: attention per sequence)"),
    "pretrain-packed-torch-dropout": ("ours", "packed-bert pre-training, packed + cpu.fast_dropout=false "
                                 "(torch's bernoulli_ dropout masks)"),
}

DRY_RUN_ROWS = "hf-pretrain-grouped,pretrain-packed"


def write_pretraining_corpus(snippets, path: str) -> None:
    """``create``'s input: one snippet per line, one document (blank-line separated) per movie."""
    movies = {}
    for text, _, movie in snippets:
        movies.setdefault(movie, []).append(" ".join(text.split()))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(lines) for lines in movies.values()) + "\n")


def _unmasked_pairs(path: str):
    """The pairs of an unpacked pre-training HDF5 file with their masks undone (the Trainer's
    collator draws its own masks): input_ids, token_type_ids (unpadded) and NSP labels."""
    import h5py
    import numpy as np

    with h5py.File(path, "r") as f:
        ids = f["input_ids"][:].astype(np.int64)
        segments = f["segment_ids"][:].astype(np.int64)
        lengths = f["input_mask"][:].astype(np.int64).sum(1)
        positions, originals = f["masked_lm_positions"][:], f["masked_lm_ids"][:]
        nsp = f["next_sentence_labels"][:].reshape(-1).astype(np.int64)
    rows = np.repeat(np.arange(len(ids))[:, None], positions.shape[1], 1)
    used = originals > 0
    ids[rows[used], positions[used]] = originals[used]
    return [{"input_ids": ids[i, :n].tolist(), "token_type_ids": segments[i, :n].tolist(),
             "next_sentence_label": int(nsp[i])} for i, n in enumerate(lengths)]


def hf_pretrain(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, BertForPreTraining, DataCollatorForLanguageModeling, Trainer, set_seed

    torch.set_num_threads(spec["threads"])
    set_seed(spec["seed"])  # before from_pretrained draws the new MLM/NSP heads
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    pairs = _unmasked_pairs(spec["unpacked_file"])
    train = Dataset.from_list(pairs)
    model = BertForPreTraining.from_pretrained(spec["checkpoint"])  # new MLM and NSP heads
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    args = shared._training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    result = trainer.train()
    trainer.save_model(os.path.join(spec["output_dir"], "hf"))
    return {"loop_seconds": result.metrics["train_runtime"], "sequences": len(pairs) * spec["epochs"],
            "tokens": sum(len(p["input_ids"]) for p in pairs) * spec["epochs"], "steps": result.global_step,
            "train_loss": result.metrics.get("train_loss")}


def pretrain_plans(args, paths, work, snippets=None):
    """Make the pre-training files (once) and return the rows' plans. ``snippets``: (text, label,
    movie) triples (default: the fetched corpus's)."""
    import h5py

    corpus = os.path.join(work, "corpus.txt")
    unpacked, packed = os.path.join(work, "pretrain.h5"), os.path.join(work, "pretrain_packed.h5")
    if not os.path.exists(packed):
        snippets = snippets if snippets is not None else shared.read_snippets(paths["corpus"])
        write_pretraining_corpus(snippets[:args.pretrain_snippets] if args.pretrain_snippets else snippets, corpus)
        vocab = os.path.join(paths["checkpoint"], "vocab.txt")
        for command in ([sys.executable, "-m", "bert_packed.data", "create", "--input", corpus, "--vocab", vocab,
                         "--output", unpacked, "--max-seq-length", "128", "--max-predictions", "20",
                         "--dupe-factor", "1", "--seed", "0"],
                        [sys.executable, "-m", "bert_packed.data", "pack", "--input", unpacked, "--output", packed,
                         "--algorithm", "lpfhp", "--max-sequences-per-pack", "3", "--no-progress"]):
            print("$ " + " ".join(command), flush=True)
            subprocess.run(command, check=True, cwd=ROOT, env=shared._env(args.threads))
    with h5py.File(packed, "r") as f:
        num_packs = f["input_ids"].shape[0]
        packing_factor = float(f.attrs["packing_factor"])
        masked = f["mlm_positions"].shape[1]
    # The Trainer's step in one micro-batch: about batch_size sequences = batch_size / p packs
    # (more micro-batches would only write the dense [V, H] embedding gradient more often).
    micro_batch = max(1, round(args.batch_size / packing_factor))
    steps = num_packs // micro_batch
    config = os.path.join(work, "pretrain_minilm.yaml")
    with open(config, "w") as f:
        f.write("# Pre-training the checkpoint's shape on the benchmark's packed file (vs_hf_trainer_pretraining.py).\n"
                "data:\n  max_sequence_length: 128\n  max_sequences_per_pack: 3\n"
                f"  max_masked_tokens: {masked - 2}\n"
                "optimizer:\n  name: adamw\n  eps: 1.0e-8\n  max_grad_norm: 1.0\n  schedule: linear\n"
                "  warmup_from_zero: true\n"
                f"  learning_rate: {args.lr}\n  warmup_fraction: 0.1\n  weight_decay: 0.01\n"
                f"train:\n  steps: {steps}\n  micro_batch_size: {micro_batch}\n  gradient_accumulation: 1\n"
                "  packing_adjustment: none\n  seed: 0\n  log_every: 10\n  eval_every: 0\n  checkpoint_every: 0\n")
    common = dict(kind="pretrain", checkpoint=paths["checkpoint"], unpacked_file=unpacked,
                  batch_size=args.batch_size, epochs=1, lr=args.lr, warmup_fraction=0.1, seed=0,
                  threads=args.threads, grouped=True)
    return {"hf-pretrain-grouped": ("hf", common),
            "pretrain-packed": ("ours", ("config", config, [f"data.path={packed}"])),
            "pretrain-packed-compile": ("ours", ("config", config, [f"data.path={packed}", "cpu.compile=true"])),
            "pretrain-packed-auto": ("ours", ("config", config, [f"data.path={packed}",
                                                                 "model.attention_implementation=auto"])),
            "pretrain-packed-torch-dropout": ("ours", ("config", config, [f"data.path={packed}",
                                                                          "cpu.fast_dropout=false"]))}



def main(argv=None) -> int:
    parser = shared.parser(__doc__.split("\n")[0], PRETRAIN_ROWS, None, max_length=128, seeds=False)
    parser.add_argument("--pretrain-snippets", type=int, default=None,
                        help="the first N snippets of the corpus only (default: all)")
    args = shared.parse(parser, argv)
    if args.worker:
        return shared.worker(args.worker, hf_pretrain)
    if args.summarise:
        return shared.summarise_only(args.summarise, PRETRAIN_ROWS, "hf-pretrain-grouped")
    if args.dry_run:
        shared.dry_run_settings(args, None, DRY_RUN_ROWS)
    names = shared.row_names(parser, args, PRETRAIN_ROWS)
    out_dir = os.path.abspath(args.output_dir)
    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    snippets = None
    if args.dry_run:  # a tiny BERT and made-up snippets, a document per "movie"
        paths = {"checkpoint": shared.tiny_checkpoint(os.path.join(out_dir, "tiny-bert"))}
        snippets = [(text, "fresh", f"movie {i % 12}") for i, text in enumerate(shared.made_up_sentences(300, seed=3))]
    else:
        paths = shared.fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))
    plans = pretrain_plans(args, paths, data_dir, snippets)
    runs = shared.run_rows(plans, names, args.repeats, out_dir, args, paths["checkpoint"], None, script=__file__)
    summary = shared.summarise(runs, names)
    text = "\n".join([f"Pre-training {'a tiny random BERT (--dry-run)' if args.dry_run else 'MiniLM'}'s shape (new "
                      f"MLM/NSP heads) on the same snippets as BERT pairs (S=128), one pass, lr {args.lr:g}, "
                      f"~{args.batch_size} sequences per step, {shared._where(args)}; median (min-max) of "
                      f"{args.repeats} alternated runs:", "",
                      shared.table(summary, {n: d for n, (_, d) in PRETRAIN_ROWS.items()}, "hf-pretrain-grouped",
                                   finetune=False), ""])
    shared.write_report(out_dir, {"settings": vars(args), "pretrain": {"runs": runs, "summary": summary}}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
