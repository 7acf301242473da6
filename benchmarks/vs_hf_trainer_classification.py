"""Packed BERT against the Hugging Face Trainer: fine-tuning a real BERT on Rotten Tomatoes (CPU).

Fine-tuning a real pre-trained BERT (all-MiniLM-L6-v2: 6 layers, hidden 384) on Rotten Tomatoes
snippets (fresh / rotten), ``--train-size`` training and ``--dev-size`` dev snippets split by a
seeded shuffle, once with the Hugging Face Trainer the way its users run it (random order,
``group_by_length``, padding to max_length, ``torch_compile``) and once with this project's own
command line (padded, packed, with each attention). What both sides share, the columns, the
fetched wheels and ``--dry-run``: benchmarks/vs_hf_trainer_common.py.

    python benchmarks/vs_hf_trainer_classification.py                  # fine-tuning table, 3 repeats
    python benchmarks/vs_hf_trainer_classification.py --rows hf-grouped,packed --repeats 5 --threads 2
    python benchmarks/vs_hf_trainer_classification.py --dry-run --output-dir /tmp/vs-hf
"""
from __future__ import annotations

import csv
import os
import random
import sys

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_hf_trainer_common as shared  # noqa: E402

# name -> (side, description); the fine-tuning rows in table order.
FINETUNE_ROWS = {
    "hf-random": ("hf", "HF Trainer, random order, dynamic padding"),
    "hf-grouped": ("hf", 'HF Trainer, train_sampling_strategy="group_by_length", dynamic padding'),
    "hf-max-length": ("hf", "HF Trainer, random order, padding to max_length"),
    "hf-compile": ("hf", "HF Trainer, group_by_length + torch_compile=True"),
    "padded": ("ours", "packed-bert, padded (finetune.packing=false)"),
    "packed": ("ours", "packed-bert, packed (the shipped config: attention auto, on the CPU bucketed)"),
    "packed-dense": ("ours", "packed-bert, packed + model.attention_implementation=dense (the block-diagonal mask)"),
    "packed-baseline": ("ours", "packed-bert, packed, at --baseline-root (e.g. before a change)"),
    "packed-compile": ("ours", "packed-bert, packed + cpu.compile (torch.compile of the fixed-shape step)"),
    "packed-bucketed": ("ours", "packed-bert, packed + model.attention_implementation=bucketed (attention per "
                                "sequence in length buckets)"),
    "packed-torch-dropout": ("ours", "packed-bert, packed + cpu.fast_dropout=false "
                                 "(torch's bernoulli_ dropout masks)"),
}

ROWS_DEFAULT = "hf-random,hf-grouped,hf-max-length,hf-compile,padded,packed,packed-compile"
DRY_RUN_ROWS = "hf-random,packed"
LABELS = ["fresh", "rotten"]


def write_splits(snippets, data_dir: str, train_size: int, dev_size: int, seed: int) -> dict:
    """Seeded shuffle; the first ``train_size`` snippets train, the next ``dev_size`` are the dev set."""
    rows = list(snippets)
    random.Random(seed).shuffle(rows)
    if train_size + dev_size > len(rows):
        raise SystemExit(f"error: --train-size + --dev-size > {len(rows)} snippets")
    os.makedirs(data_dir, exist_ok=True)
    paths = {}
    for split, part in (("train", rows[:train_size]), ("dev", rows[train_size:train_size + dev_size])):
        paths[split] = os.path.join(data_dir, f"{split}.csv")
        with open(paths[split], "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows((text, label) for text, label, _ in part)
    return paths


def hf_finetune(spec: dict) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              set_seed)

    torch.set_num_threads(spec["threads"])
    set_seed(spec["seed"])  # before from_pretrained draws the new head, as run_glue.py does
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    labels = LABELS

    def load(path):
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        data = Dataset.from_dict({"text": [r["text"] for r in rows], "label": [labels.index(r["label"]) for r in rows]})
        return data.map(lambda b: tokenizer(b["text"], truncation=True, max_length=spec["max_length"]),
                        batched=True, remove_columns=["text"])

    train, dev = load(spec["train_file"]), load(spec["dev_file"])
    model = AutoModelForSequenceClassification.from_pretrained(spec["checkpoint"], num_labels=2)
    padding = "max_length" if spec.get("max_length_padding") else "longest"
    collator = DataCollatorWithPadding(tokenizer, padding=padding, max_length=spec["max_length"])
    args = shared._training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    result = trainer.train()
    predictions = trainer.predict(dev)
    accuracy = float((np.argmax(predictions.predictions, axis=-1) == predictions.label_ids).mean())
    trainer.save_model(os.path.join(spec["output_dir"], "hf"))
    tokens = int(sum(len(ids) for ids in train["input_ids"])) * spec["epochs"]
    return {"loop_seconds": result.metrics["train_runtime"], "sequences": len(train) * spec["epochs"],
            "tokens": tokens, "steps": result.global_step, "dev_accuracy": accuracy,
            "train_loss": result.metrics.get("train_loss")}


def finetune_plans(args, paths, splits):
    common = dict(kind="finetune", checkpoint=paths["checkpoint"], train_file=splits["train"], dev_file=splits["dev"],
                  batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, warmup_fraction=0.1, seed=0,
                  max_length=args.max_length, threads=args.threads)
    ours = [f"finetune.train_file={splits['train']}", f"finetune.validation_file={splits['dev']}",
            "finetune.text_column=text", "finetune.label_column=label", f"finetune.epochs={args.epochs}",
            f"optimizer.learning_rate={args.lr}", "optimizer.warmup_fraction=0.1", "optimizer.schedule=linear",
            "optimizer.eps=1e-8", "optimizer.max_grad_norm=1.0", f"data.max_sequence_length={args.max_length}",
            "train.eval_every=0", "train.checkpoint_every=0", "train.log_every=10", "train.seed=0"]
    # Padded: one sequence per row, `batch_size` rows in one micro-batch (the Trainer's step).
    # Packed: the shipped config's recipe, 4 packs per micro-batch and accumulation divided by the
    # packing factor p (train.packing_adjustment=gradient_accumulation), so a step sees about
    # batch_size sequences: round(batch_size / 4 / p) micro-batches of 4 packs.
    padded = ours + ["finetune.packing=false", f"train.micro_batch_size={args.batch_size}",
                     "train.gradient_accumulation=1"]
    packed = ours + ["train.micro_batch_size=4", f"train.gradient_accumulation={max(1, args.batch_size // 4)}",
                     "train.packing_adjustment=gradient_accumulation"]
    return {
        "hf-random": ("hf", dict(common)),
        "hf-grouped": ("hf", dict(common, grouped=True)),
        "hf-max-length": ("hf", dict(common, max_length_padding=True)),
        "hf-compile": ("hf", dict(common, grouped=True, compile=True)),
        "padded": ("ours", padded),
        "packed": ("ours", packed),
        "packed-compile": ("ours", packed + ["cpu.compile=true"]),
        "packed-bucketed": ("ours", packed + ["model.attention_implementation=bucketed"]),
        "packed-dense": ("ours", packed + ["model.attention_implementation=dense"]),
        "packed-torch-dropout": ("ours", packed + ["cpu.fast_dropout=false"]),
        "packed-baseline": ("ours", ("root", args.baseline_root, packed)),
    }



def _inputs(args, data_dir: str):
    """The checkpoint and the train / dev CSV files: fetched (``--dry-run``: a tiny BERT, made-up snippets)."""
    if args.dry_run:
        paths = {"checkpoint": shared.tiny_checkpoint(os.path.join(os.path.dirname(data_dir), "tiny-bert"))}
        rng = random.Random(0)
        snippets = [(text, rng.choice(LABELS), f"movie {i % 7}")
                    for i, text in enumerate(shared.made_up_sentences(args.train_size + args.dev_size))]
    else:
        paths = shared.fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))
        snippets = shared.read_snippets(paths["corpus"])
    return paths, write_splits(snippets, data_dir, args.train_size, args.dev_size, seed=0)


def main(argv=None) -> int:
    parser = shared.parser(__doc__.split("\n")[0], FINETUNE_ROWS, ROWS_DEFAULT, max_length=128)
    parser.add_argument("--baseline-root", help="a second checkout of this project (e.g. `git archive` of an "
                        "older commit) for the packed-baseline row")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--dev-size", type=int, default=1000)
    args = shared.parse(parser, argv)
    if args.worker:
        return shared.worker(args.worker, hf_finetune)
    if args.summarise:
        return shared.summarise_only(args.summarise, FINETUNE_ROWS, "hf-grouped", ("dev_accuracy", "dev acc"))
    if args.dry_run:
        shared.dry_run_settings(args, ROWS_DEFAULT, DRY_RUN_ROWS)
    names = shared.row_names(parser, args, FINETUNE_ROWS)
    if "packed-baseline" in names and not args.baseline_root:
        parser.error("the packed-baseline row needs --baseline-root")
    out_dir = os.path.abspath(args.output_dir)
    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    paths, splits = _inputs(args, data_dir)
    once = shared.once_names(args)
    runs = shared.run_rows(finetune_plans(args, paths, splits), names, args.repeats, out_dir, args,
                           paths["checkpoint"], "finetune_classification", once, args.seed_list, script=__file__)
    summary = shared.summarise(runs, names)
    reference = "hf-grouped" if "hf-grouped" in summary else names[0]
    descriptions = {n: d for n, (_, d) in FINETUNE_ROWS.items() if n in names}
    markdown = [f"Fine-tuning {'a tiny random BERT (--dry-run)' if args.dry_run else 'all-MiniLM-L6-v2'} on "
                f"{args.train_size} {'made-up' if args.dry_run else 'Rotten Tomatoes'} snippets ({args.epochs} epoch(s), lr {args.lr:g}, "
                f"~{args.batch_size} sequences per step, {shared._where(args)}; dev: {args.dev_size} snippets); "
                f"median (min-max) of {args.repeats} alternated runs" + (f" ({', '.join(once)}: one run)" if once else "")
                + ":", "", shared.table(summary, descriptions, reference), ""]
    if args.seed_list:
        markdown += ["Dev accuracy per training seed (the same split each time):", "",
                     shared.quality_table(runs, descriptions), ""]
    shared.write_report(out_dir, {"settings": vars(args), "finetune": {"runs": runs, "summary": summary}},
                        "\n".join(markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
