"""Same recipe, same result as the Hugging Face Trainer (issue 33).

Each test trains one tiny checkpoint twice on the same data: with ``run.py`` (packed, the
fine-tuning config's defaults; pre-training with the Trainer's AdamW recipe, see
``PRETRAINING_RECIPE``) and with the real ``transformers.Trainer`` (its own defaults;
TrainingArguments only say what must be said: batches, rate, steps, seed, the warm-up our config
uses, the weight decay our config uses so that its parameter groups are compared too). Dropout
is off, the checkpoint carries the task's head (both sides start from the same weights), and
every Trainer batch holds exactly the sentences of our packed step (a batch sampler built from
our pack order), so the loss of every step must agree to 1e-5 relative and the final weights
to ``WEIGHT_TOL``. What the comparison covers: gradient clipping, AdamW's betas/eps, which
parameters are decayed, the warm-up's rounding and first step, the linear decay, the loss's
normalisation (the Trainer's batch mean over labelled tokens or sequences equals our mean
over the step's, ``add_step_normalizers``) and the labels (-100 for non-first sub-tokens).

Each comparison is also run with one recipe drift on our side (no clipping, LayerNorm
weights decayed, one more warm-up step, the warm-up's first step not at rate 0) and must then
fail: the tests can see a drift. Evaluation: our reported NER and SQuAD scores are those of
run_ner.py (seqeval) and of the official SQuAD script (torchmetrics' port) on the same model
and predictions.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

import run
from bert_packed import optim
from bert_packed.config import load_config
from bert_packed.tasks.registry import get_task
from finetune_fixtures import classification_rows, save_hf_checkpoint, write_rows, write_vocab
from ner_fixtures import TAGS, ner_sentences, write_jsonl, write_ner_vocab
from squad_fixtures import corpus_texts, make_tokenizer, write_squad

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's requirement
pytest.importorskip("seqeval")

LOSS_RTOL = 1e-5
# Largest |ours - Trainer's| of a final weight (fp32, 32 AdamW steps). Measured: mostly <= 4e-7, up
# to 3.6e-6 on rarely trained entries (position 63, reached by one truncated text), whose gradients
# are near AdamW's epsilon, where each side's rounding is amplified; every drift moves weights >= 1.6e-4.
WEIGHT_TOL = 1e-5
S = 64  # data.max_sequence_length = the tiny checkpoint's max_position_embeddings
NUM_STEPS = 32
LEARNING_RATE = 1e-3


# ----------------------------------------------------------------------------- the two runs


def run_ours(directory, config_name: str, sets) -> dict:
    """``run.py`` on the cpu backend; the loss of every step and the exported final weights."""
    from safetensors.torch import load_file

    argv = ["--config", config_name, "--backend", "cpu", "--output-dir", str(directory), "--no-progress"]
    for item in sets:
        argv += ["--set", item]
    assert run.main(argv) == 0
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    return {"losses": [line["loss"] for line in lines], "grad_norms": [line["grad_norm"] for line in lines],
            "weights": load_file(str(directory / "hf" / "model.safetensors"))}


def common_sets(checkpoint: str, train_file: str, validation_file: str, **more) -> list:
    """The run's shape (not its recipe): tiny rows, explicit steps, one line per step, the last
    weights exported (not the best evaluation's), no accumulation adjustment (the step's
    sequences are then known from the pack order)."""
    values = {"model.init_checkpoint": json.dumps(checkpoint), "finetune.train_file": train_file,
              "finetune.validation_file": validation_file, "data.max_sequence_length": S,
              "train.steps": NUM_STEPS, "train.log_every": 1, "train.eval_every": 0, "train.checkpoint_every": 0,
              "train.tensorboard": "false", "train.num_threads": 1, "train.packing_adjustment": "none",
              "train.micro_batch_size": 1, "train.gradient_accumulation": 2,
              "finetune.load_best_model_at_end": "false", "optimizer.learning_rate": LEARNING_RATE}
    values.update(more)
    return [f"{key}={value}" for key, value in values.items()]


def step_sequences(config_name: str, sets) -> tuple:
    """(steps, task): the training sequences (indices into the training file) of every optimizer
    step of our run, and the task that packed them: the stream of ``PackedSource`` (global
    micro-batch g holds packs [gB, (g+1)B) of the epochs' pack orders, one after the other)."""
    config = load_config(config_name, list(sets))
    task = get_task(config)
    task.setup(show_progress=False)
    data, t = task.train_data, config.train
    per_step = t.micro_batch_size * t.gradient_accumulation
    steps = []
    for step in range(t.steps):
        stream = np.arange(step * per_step, (step + 1) * per_step)
        members = []
        for pack_epoch, position in zip(stream // data.num_packs, stream % data.num_packs):
            _, rows = data._batch(data.assignment(int(pack_epoch)), np.array([position]))
            members += [int(i) for i in rows[0] if i >= 0]
        steps.append(members)
    return steps, task


class StepTrainer(transformers.Trainer):
    """The Trainer, fed our steps' sequences as its batches (a batch sampler), recording the loss
    of every step in full precision (its logs round to 4 digits). Nothing else is changed."""

    def __init__(self, *args, step_batches, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_batches, self.step_losses = step_batches, []

    def get_train_dataloader(self):
        loader = torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.step_batches,
                                             collate_fn=self.data_collator)
        return self.accelerator.prepare(loader)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        self.step_losses.append(float((result[0] if return_outputs else result).detach()))
        return result


def run_trainer(directory, config_name: str, model, dataset, collator, step_batches, **arguments) -> dict:
    """``transformers.Trainer`` with its defaults but for what the comparison must fix: our
    steps, rate and seed, the warm-up ratio of our config (the Trainer's default is none; a
    ``warmup_steps`` below 1 is a ratio, rounded up as ours) and its weight decay (the
    Trainer's default is 0.0, which would leave its parameter groups untested; see
    docs/finetuning.md), and ``arguments`` where our config differs from the Trainer on purpose."""
    recipe = load_config(config_name).optimizer
    assert 0 < recipe.warmup_fraction < 1 and recipe.weight_decay > 0
    args = transformers.TrainingArguments(
        output_dir=str(directory), per_device_train_batch_size=max(len(b) for b in step_batches),
        learning_rate=LEARNING_RATE, max_steps=len(step_batches), warmup_steps=recipe.warmup_fraction,
        weight_decay=recipe.weight_decay, seed=0, report_to=[], save_strategy="no", use_cpu=True, **arguments,
        logging_strategy="no", disable_tqdm=True)
    trainer = StepTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                          step_batches=step_batches)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    moved = max(float((weights[k] - initial[k]).abs().max()) for k in compared_weights(weights))
    return {"losses": trainer.step_losses, "weights": weights, "moved": moved}


# ----------------------------------------------------------------------------- the comparison


def max_relative_loss_gap(ours: dict, theirs: dict) -> float:
    a, b = np.asarray(ours["losses"]), np.asarray(theirs["losses"])
    assert len(a) == len(b) == NUM_STEPS
    return float(np.max(np.abs(a - b) / np.abs(b)))


def compared_weights(names, shift_invariant=()) -> list:
    """The parameters whose final values are compared: all but those whose gradient is 0 in exact
    arithmetic, which each side's AdamW steps by its own rounding noise divided by that noise's
    RMS (up to the learning rate per step) and which change no output: the attention key biases
    (a key bias adds the same q.b to every score of a query, which softmax ignores) and the
    task's ``shift_invariant`` ones (QA: the span head's bias and the last LayerNorm's bias shift
    every token's span logit alike)."""
    return sorted(name for name in names
                  if not name.endswith("attention.self.key.bias") and name not in shift_invariant)


def max_weight_gap(ours: dict, theirs: dict) -> float:
    """Largest |difference| over the parameters both hold (our export has no pooler for token
    classification and QA, as transformers' own models of those tasks)."""
    shared = compared_weights(set(ours["weights"]) & set(theirs["weights"]), theirs.get("shift_invariant", ()))
    assert len(shared) >= 30
    return max(float((ours["weights"][k].float() - theirs["weights"][k].float()).abs().max()) for k in shared)


def assert_same_trajectory(ours: dict, theirs: dict) -> None:
    gap = max_relative_loss_gap(ours, theirs)
    assert gap <= LOSS_RTOL, f"loss differs by {gap:.2e} relative"
    weight_gap = max_weight_gap(ours, theirs)
    assert weight_gap <= WEIGHT_TOL, f"final weights differ by {weight_gap:.2e}"


def decayed_layer_norm(name: str, param) -> bool:
    """The drift "LayerNorm weights decayed": only biases escape weight decay."""
    return name.endswith("bias")


def one_more_warmup_step(config_name: str) -> list:
    """``optimizer.warmup_fraction`` whose rounding up gives one warm-up step more than the config's."""
    fraction = load_config(config_name).optimizer.warmup_fraction
    return [f"optimizer.warmup_fraction={(math.ceil(fraction * NUM_STEPS) + 0.5) / NUM_STEPS}"]


# drift -> (our extra settings for a config, our parameter-group rule or None)
DRIFTS = {
    "no_clipping": (lambda config_name: ["optimizer.max_grad_norm=null"], None),
    "layer_norm_decayed": (lambda config_name: [], decayed_layer_norm),
    "warmup_off_by_one": (one_more_warmup_step, None),
    "warmup_not_from_zero": (lambda config_name: ["optimizer.warmup_from_zero=false"], None),  # the earlier schedule
}


def check_drift_is_seen(tmp_path, monkeypatch, config_name, sets, theirs, drift):
    """Our run with one recipe drift: the comparison must then fail (losses or weights apart)."""
    settings, no_decay = DRIFTS[drift]
    more = settings(config_name)
    if no_decay is not None:
        monkeypatch.setattr(optim, "_no_decay", no_decay)
    ours = run_ours(tmp_path / drift, config_name, list(sets) + more)
    with pytest.raises(AssertionError):
        assert_same_trajectory(ours, theirs)
    return max_relative_loss_gap(ours, theirs), max_weight_gap(ours, theirs)


# ----------------------------------------------------------------------------- token classification


def ner_checkpoint_with_head(directory) -> str:
    """A tiny BertForTokenClassification (head included, so both sides start from it) with the
    tags in the order our string tags get (sorted)."""
    vocab = write_ner_vocab(os.path.join(directory, "vocab"))
    tags = sorted(TAGS)
    path = os.path.join(directory, "bert")
    save_hf_checkpoint(transformers, path, vocab, "BertForTokenClassification", num_labels=len(tags),
                       id2label=dict(enumerate(tags)), label2id={t: i for i, t in enumerate(tags)})
    return path


def ner_features(tokenizer, sentences, label2id):
    """run_ner.py's tokenize_and_align_labels (label_all_tokens False): the first sub-token of
    a word carries its tag, the other sub-tokens and [CLS]/[SEP] -100."""
    rows = []
    for words, tags in sentences:
        encoding = tokenizer(words, is_split_into_words=True, truncation=True, max_length=S)
        labels, previous = [], None
        for word in encoding.word_ids():
            labels.append(-100 if word is None or word == previous else label2id[tags[word]])
            previous = word
        rows.append({**encoding, "labels": labels})
    return rows


def trainer_job(root, config_name: str, sets, model, features, collator, **arguments) -> dict:
    """Our run's steps (from its pack order), the same tokens checked on both sides, and the
    Trainer's run over those steps (one thread, as ours)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches, task = step_sequences(config_name, sets)
        ours_ids = task.train_data.samples["input_ids"]
        assert len(ours_ids) == len(features)
        for i, row in enumerate(features):
            assert list(ours_ids[i][:len(row["input_ids"])]) == list(row["input_ids"])
        theirs = run_trainer(root / "trainer", config_name, model, features, collator, batches, **arguments)
    finally:
        torch.set_num_threads(previous)
    assert sum(len(b) for b in batches) > len(features)  # more than one epoch: the re-shuffle counts too
    return {"config": config_name, "sets": sets, "theirs": theirs, "batches": batches}


def check_parity(job, tmp_path, what: str) -> None:
    ours = run_ours(tmp_path / "ours", job["config"], job["sets"])
    sizes = [len(b) for b in job["batches"]]
    assert max(ours["grad_norms"]) > 1.0  # the clip (1.0) did act: the comparison covers it
    assert job["theirs"]["moved"] > 1000 * WEIGHT_TOL  # and the weights did move
    loss_gap, weight_gap = max_relative_loss_gap(ours, job["theirs"]), max_weight_gap(ours, job["theirs"])
    print(f"{what}: {min(sizes)}-{max(sizes)} sequences a step; loss gap {loss_gap:.2e} relative, "
          f"weights {weight_gap:.2e}")
    assert_same_trajectory(ours, job["theirs"])


def check_drift(job, tmp_path, monkeypatch, drift: str, what: str) -> None:
    gaps = check_drift_is_seen(tmp_path, monkeypatch, job["config"], job["sets"], job["theirs"], drift)
    print(f"{what} with {drift}: loss gap {gaps[0]:.2e}, weights {gaps[1]:.2e}")


@pytest.fixture(scope="module")
def ner_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("ner_parity")
    sentences = ner_sentences(120, 3)
    checkpoint = ner_checkpoint_with_head(str(root))
    dev = ner_sentences(60, 4)
    sets = common_sets(checkpoint, write_jsonl(root / "train.jsonl", sentences), write_jsonl(root / "dev.jsonl", dev))
    model = transformers.AutoModelForTokenClassification.from_pretrained(checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    features = ner_features(tokenizer, sentences, model.config.label2id)
    collator = transformers.DataCollatorForTokenClassification(tokenizer)
    job = trainer_job(root, "finetune_token_classification", sets, model, features, collator)
    return {**job, "dev": dev}


def test_token_classification_follows_the_trainer_step_by_step(ner_job, tmp_path, one_thread):
    check_parity(ner_job, tmp_path, "token classification")


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_token_classification_parity_sees_a_drift(ner_job, tmp_path, monkeypatch, drift, one_thread):
    check_drift(ner_job, tmp_path, monkeypatch, drift, "token classification")


def run_ner_metrics(directory, sentences) -> dict:
    """What run_ner.py reports for the model in ``directory`` (transformers' export) on
    ``sentences``: the Trainer's predictions, the argmax of every scored token (first sub-tokens),
    and ``evaluate``'s seqeval metric, i.e. seqeval's classification_report micro average
    (``overall_*``) and accuracy_score (``evaluate`` fetches its metric scripts from the Hub,
    so seqeval is called as that script calls it)."""
    from seqeval.metrics import accuracy_score, classification_report

    model = transformers.AutoModelForTokenClassification.from_pretrained(str(directory))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    features = ner_features(tokenizer, sentences, model.config.label2id)
    args = transformers.TrainingArguments(output_dir=str(directory / "run_ner"), per_device_eval_batch_size=8,
                                          report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args,
                                   data_collator=transformers.DataCollatorForTokenClassification(tokenizer))
    logits, labels, _ = trainer.predict(features)
    names = model.config.id2label
    predicted = [[names[p] for p, l in zip(row, gold) if l != -100] for row, gold in zip(logits.argmax(-1), labels)]
    true = [[names[l] for l in gold if l != -100] for gold in labels]
    overall = classification_report(true, predicted, output_dict=True, zero_division=0)["micro avg"]
    return {"precision": overall["precision"], "recall": overall["recall"], "f1": overall["f1-score"],
            "accuracy": accuracy_score(true, predicted)}


def test_token_classification_reports_run_ner_metrics(ner_job, tmp_path, one_thread):
    """Our summary.json's entity scores are run_ner.py's for the weights we export (item 4)."""
    ours = tmp_path / "ours"
    run_ours(ours, ner_job["config"], ner_job["sets"] + ["train.steps=120"])
    reported = json.loads((ours / "summary.json").read_text())["eval"]
    expected = run_ner_metrics(ours / "hf", ner_job["dev"])
    print(f"token classification: ours {reported}, run_ner.py's {expected}")
    assert 0.2 < expected["f1"] < 1.0  # entities found and missed: the scores say something
    assert {k: reported[k] for k in expected} == pytest.approx(expected, abs=1e-12)


# ----------------------------------------------------------------------------- sequence classification, regression


def classification_job(root, problem_type: str, pairs: bool) -> dict:
    """A tiny BertForSequenceClassification checkpoint (head included; labels named as ours name
    them, sorted) and rows of ``finetune_fixtures``: sentence pairs for classification, single
    texts with a score for regression."""
    rows = classification_rows(100, 5, problem_type)
    if problem_type == "regression":  # scores 0-10: gradients large enough to be clipped
        rows = [{**row, "label": round(10 * row["label"], 4)} for row in rows]
    columns = ["text", "pair", "label"]
    vocab = write_vocab(os.path.join(root, "vocab"))
    path = os.path.join(root, "bert")
    if problem_type == "regression":
        head = dict(num_labels=1, problem_type="regression")
    else:
        names = sorted({row["label"] for row in rows})
        head = dict(num_labels=len(names), id2label=dict(enumerate(names)),
                    label2id={name: i for i, name in enumerate(names)})
    # Weights drawn wider than BERT's 0.02: gradient norms around the clip of 1.0 (clipped in some steps).
    save_hf_checkpoint(transformers, path, vocab, "BertForSequenceClassification", initializer_range=0.2, **head)
    more = {"finetune.problem_type": problem_type, "train.gradient_accumulation": 4}
    if pairs:
        more["finetune.text_pair_column"] = "pair"
    sets = common_sets(path, write_rows(os.path.join(root, "train.csv"), rows, columns),
                       write_rows(os.path.join(root, "dev.csv"), classification_rows(10, 6, problem_type), columns),
                       **more)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    features = []
    for row in rows:
        encoding = tokenizer(row["text"], row["pair"] if pairs else None, truncation=True, max_length=S)
        label = float(row["label"]) if problem_type == "regression" else model.config.label2id[row["label"]]
        features.append({**encoding, "labels": label})
    collator = transformers.DataCollatorWithPadding(tokenizer)
    return trainer_job(root, "finetune_classification", sets, model, features, collator)


@pytest.fixture(scope="module")
def classification(tmp_path_factory):
    return classification_job(tmp_path_factory.mktemp("classification_parity"), "single_label_classification", True)


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    return classification_job(tmp_path_factory.mktemp("regression_parity"), "regression", False)


def test_sequence_classification_follows_the_trainer_step_by_step(classification, tmp_path, one_thread):
    check_parity(classification, tmp_path, "sequence-pair classification")


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_sequence_classification_parity_sees_a_drift(classification, tmp_path, monkeypatch, drift, one_thread):
    check_drift(classification, tmp_path, monkeypatch, drift, "sequence-pair classification")


def test_regression_follows_the_trainer_step_by_step(regression, tmp_path, one_thread):
    check_parity(regression, tmp_path, "regression")


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_regression_parity_sees_a_drift(regression, tmp_path, monkeypatch, drift, one_thread):
    check_drift(regression, tmp_path, monkeypatch, drift, "regression")


# ----------------------------------------------------------------------------- question answering

QA_S, QA_LENGTH = 128, 42  # every window exactly 42 tokens: three to a row of 128, no padding


def qa_document(tokenizer, seed: int, num_questions: int) -> dict:
    """SQuAD v2.0 of one fact sentence per paragraph (a fifth of the questions unanswerable),
    each context lengthened by filler words to exactly ``QA_LENGTH`` tokens with its question.

    Why equal lengths: transformers' BertForQuestionAnswering takes its softmax over every
    column of the padded batch, padding included, ours over the window's own tokens; without
    padding (every Trainer batch of equal-length windows) the two losses are the same, and the
    comparison is of the recipe alone (the padding difference is in docs/finetuning.md)."""
    import random

    from squad_fixtures import _fact, _impossible, _questions

    rng, data = random.Random(seed), []
    while len(data) < num_questions:
        used = {"person": set(), "year": set(), "pair": set()}
        fact = _fact(rng, used)
        context = f"{fact['person']} {fact['past']} the {fact['thing']} of {fact['town']} in {fact['year']}."
        qa = _impossible(rng, used) if len(data) % 5 == 4 else _questions(rng, context, fact)[0]
        qa["answers"] = qa["answers"][:1]
        count = len(tokenizer(qa["question"], context)["input_ids"])
        if count > QA_LENGTH:
            continue
        context += " the" * (QA_LENGTH - count)
        qa["id"] = f"q{seed}-{len(data)}"
        data.append({"title": qa["id"], "paragraphs": [{"context": context, "qas": [qa]}]})
    return {"version": "v2.0", "data": data}


def qa_features(tokenizer, document) -> list:
    """run_qa.py's prepare_train_features: question + context windows, the first answer's
    token start / end where the window holds it whole, else the [CLS] (0)."""
    rows = []
    for article in document["data"]:
        paragraph = article["paragraphs"][0]
        qa = paragraph["qas"][0]
        encoding = tokenizer(qa["question"].lstrip(), paragraph["context"], truncation="only_second",
                             max_length=QA_S, stride=32, return_overflowing_tokens=True, return_offsets_mapping=True)
        assert len(encoding["input_ids"]) == 1  # one window each
        ids, offsets, sequence = encoding["input_ids"][0], encoding["offset_mapping"][0], encoding.sequence_ids(0)
        start = end = 0
        if qa["answers"]:
            first_char = qa["answers"][0]["answer_start"]
            last_char = first_char + len(qa["answers"][0]["text"])
            first = sequence.index(1)
            last = len(ids) - 1 - sequence[::-1].index(1)
            if offsets[first][0] <= first_char and offsets[last][1] >= last_char:
                while first < len(offsets) and offsets[first][0] <= first_char:
                    first += 1
                while offsets[last][1] >= last_char:
                    last -= 1
                start, end = first - 1, last + 1
        rows.append({"input_ids": ids, "token_type_ids": encoding["token_type_ids"][0],
                     "attention_mask": encoding["attention_mask"][0], "start_positions": start, "end_positions": end})
    return rows


@pytest.fixture(scope="module")
def qa_job(tmp_path_factory):
    from squad_fixtures import make_squad_v2

    root = tmp_path_factory.mktemp("qa_parity")
    vocab_tokenizer = make_tokenizer(corpus_texts(make_squad_v2(seed=0, num_paragraphs=30)))
    vocab = os.path.join(root, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(token for token, _ in sorted(vocab_tokenizer.get_vocab().items(), key=lambda kv: kv[1])))
    path = os.path.join(root, "bert")
    save_hf_checkpoint(transformers, path, vocab, "BertForQuestionAnswering", max_position_embeddings=QA_S,
                       initializer_range=0.1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    document, dev = qa_document(tokenizer, 0, 90), qa_document(tokenizer, 1, 40)
    sets = common_sets(path, write_squad(root / "train.json", document),
                       write_squad(root / "dev.json", dev),
                       **{"data.max_sequence_length": QA_S, "train.global_batch_size": "null",
                          "finetune.doc_stride": 32, "finetune.max_query_length": 24})
    features = qa_features(tokenizer, document)
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(path)
    # The squad configs keep Graphcore's AdamW epsilon 1e-6 (docs/finetuning.md); the Trainer is told.
    job = trainer_job(root, "finetune_squad", sets, model, features, transformers.default_data_collator,
                      adam_epsilon=load_config("finetune_squad").optimizer.eps)
    job["theirs"]["shift_invariant"] = ("qa_outputs.bias", "bert.encoder.layer.1.output.LayerNorm.bias")
    samples = step_sequences("finetune_squad", sets)[1].train_data.samples
    assert [f["start_positions"] for f in features] == list(samples["start_positions"])  # the same answers
    assert [f["end_positions"] for f in features] == list(samples["end_positions"])
    assert sum(f["start_positions"] > 0 for f in features) > 60
    return {**job, "dev": dev}


def test_question_answering_follows_the_trainer_step_by_step(qa_job, tmp_path, one_thread):
    assert min(len(b) for b in qa_job["batches"]) == 6  # three windows to a row, two rows a step
    check_parity(qa_job, tmp_path, "question answering")


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_question_answering_parity_sees_a_drift(qa_job, tmp_path, monkeypatch, drift, one_thread):
    check_drift(qa_job, tmp_path, monkeypatch, drift, "question answering")


def official_squad_scores(predictions: dict, document: dict) -> dict:
    """EM and F1 of the official SQuAD scripts by torchmetrics' ``squad`` (its port of the
    official v1.1 script; ``evaluate`` fetches its metric scripts from the Hub): over the
    answerable questions as v1.1 scores them, and over all with v2.0's rule for unanswerable
    ones (the only gold answer is "", so only the empty prediction scores; torchmetrics' F1
    already follows v2.0 for empty strings)."""
    from torchmetrics.functional.text.squad import squad

    answerable, everything = [], []
    for article in document["data"]:
        for qa in (qa for paragraph in article["paragraphs"] for qa in paragraph["qas"]):
            gold = [answer["text"] for answer in qa["answers"]]
            target = {"id": qa["id"], "answers": {"text": gold or [""], "answer_start": [0] * max(1, len(gold))}}
            everything.append(target)
            if gold:
                answerable.append(target)
    out = {}
    for name, targets in (("has_ans_", answerable), ("", everything)):
        preds = [{"id": t["id"], "prediction_text": predictions[t["id"]]} for t in targets]
        scores = squad(preds, targets)
        out[f"{name}exact_match"], out[f"{name}f1"] = float(scores["exact_match"]), float(scores["f1"])
    return out


def test_question_answering_reports_official_squad_scores(qa_job, tmp_path, one_thread):
    """Our summary.json's EM / F1 are the official scripts' for the predictions we write (item 4)."""
    ours = tmp_path / "ours"
    run_ours(ours, qa_job["config"], qa_job["sets"] + ["train.steps=200"])
    reported = json.loads((ours / "summary.json").read_text())["eval"]
    predictions = json.loads((ours / "predictions.json").read_text())
    expected = official_squad_scores(predictions, qa_job["dev"])
    print(f"question answering: ours {reported}, official {expected}")
    assert 0.0 < expected["has_ans_f1"] < 100.0 and sum(text == "" for text in predictions.values()) > 0
    assert {k: reported[k] for k in expected} == pytest.approx(expected, abs=1e-9)


# ----------------------------------------------------------------------------- MLM/NSP pre-training

# Pre-training's own defaults are LAMB (Graphcore's recipe), which the Trainer has no equal of:
# our side is given the Trainer's AdamW recipe, the rest (masking, packing, MLM over the step's
# masked tokens, NSP over its sequences, two micro-batches a step) is the tiny config's.
PRETRAINING_RECIPE = ["optimizer.name=adamw", "optimizer.eps=1e-8", "optimizer.max_grad_norm=1.0",
                      "optimizer.warmup_from_zero=true", "optimizer.weight_decay=0.01"]


def unpacked_sequences(batch) -> list:
    """Every sequence of a packed pre-training micro-batch as transformers takes it alone: its
    tokens in position order (already masked), labels -100 but at its masked tokens, its NSP label."""
    rows = []
    for b in range(batch["input_ids"].shape[0]):
        for k in range(batch["nsp_labels"].shape[1]):
            columns = np.nonzero(batch["sequence_ids"][b] == k + 1)[0]
            if len(columns) == 0:
                continue
            columns = columns[np.argsort(batch["position_ids"][b, columns])]
            labels = np.full(len(columns), -100, dtype=np.int64)
            mine = batch["mlm_sequence_ids"][b] == k + 1
            for position, label in zip(batch["mlm_positions"][b][mine], batch["mlm_labels"][b][mine]):
                labels[int(np.nonzero(columns == position)[0][0])] = label
            assert batch["nsp_weights"][b, k] > 0 and labels.max() >= 0
            rows.append({"input_ids": batch["input_ids"][b, columns].astype(np.int64),
                         "token_type_ids": batch["segment_ids"][b, columns].astype(np.int64),
                         "labels": labels, "next_sentence_label": int(batch["nsp_labels"][b, k])})
    return rows


def pad_pretraining(rows) -> dict:
    """Right-padded batch of ``unpacked_sequences`` rows (padding: id 0, type 0, label -100, masked out)."""
    width = max(len(row["input_ids"]) for row in rows)
    out = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
           "token_type_ids": torch.zeros(len(rows), width, dtype=torch.long),
           "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
           "labels": torch.full((len(rows), width), -100, dtype=torch.long),
           "next_sentence_label": torch.tensor([row["next_sentence_label"] for row in rows])}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        out["input_ids"][i, :n], out["token_type_ids"][i, :n] = torch.from_numpy(row["input_ids"]), \
            torch.from_numpy(row["token_type_ids"])
        out["attention_mask"][i, :n] = 1
        out["labels"][i, :n] = torch.from_numpy(row["labels"])
    return out


@pytest.fixture(scope="module")
def pretraining_job(tmp_path_factory):
    """Our tiny pre-training run's micro-batches, recorded as the cpu backend trains on them, and
    the Trainer's run over the same sequences, one batch a step."""
    from backends.cpu import CPUBackend

    root = tmp_path_factory.mktemp("pretraining_parity")
    config = transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    transformers.BertForPreTraining(config).save_pretrained(root / "bert")
    sets = [f"model.init_checkpoint={json.dumps(str(root / 'bert'))}", f"train.steps={NUM_STEPS}",
            "train.micro_batch_size=4", "train.gradient_accumulation=2", "train.eval_every=0",
            f"optimizer.learning_rate={LEARNING_RATE}", *PRETRAINING_RECIPE]
    steps, train_step = [], CPUBackend.train_step

    def recording(backend, micro_batches):
        steps.append([{k: np.array(v) for k, v in batch.items()} for batch in micro_batches])
        return train_step(backend, micro_batches)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CPUBackend, "train_step", recording)
        first = run_ours(root / "recorded", "tiny", sets)
    rows, batches = [], []
    for step in steps:
        sequences = [row for batch in step for row in unpacked_sequences(batch)]
        batches.append(list(range(len(rows), len(rows) + len(sequences))))
        rows += sequences
    model = transformers.BertForPreTraining.from_pretrained(str(root / "bert"))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theirs = run_trainer(root / "trainer", "tiny", model, rows, pad_pretraining, batches)
    finally:
        torch.set_num_threads(previous)
    return {"config": "tiny", "sets": sets, "theirs": theirs, "batches": batches, "first": first}


def test_pretraining_follows_the_trainer_step_by_step(pretraining_job, tmp_path, one_thread):
    assert max(len(row) for row in pretraining_job["batches"]) > 8  # several sequences a pack, two packs a step
    check_parity(pretraining_job, tmp_path, "MLM/NSP pre-training")


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_pretraining_parity_sees_a_drift(pretraining_job, tmp_path, monkeypatch, drift, one_thread):
    check_drift(pretraining_job, tmp_path, monkeypatch, drift, "MLM/NSP pre-training")
