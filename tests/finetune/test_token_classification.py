"""Token classification (NER, issue 22 item 4): seqeval's entity scores on hand-worked cases,
the three input formats, first-sub-token labelling, packed == unpacked (and == transformers)
logits and loss, packed vs padded fine-tuning, the transformers export, and the cpu, mock (IPU
layout, one and two IPUs) and cuda-on-cpu backends running the task."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import run
from bert_packed.collate import one_per_pack
from bert_packed.tasks import data as ft_data
from bert_packed.tasks.token_classification.data import (IGNORE_INDEX, TagSet, check_sentences,
                                                            collate_token_classification, encode_sentences,
                                                            read_sentences)
from bert_packed.tasks.token_classification.metrics import entity_scores
from bert_packed.tasks.token_classification.model import BertForTokenClassification
from ner_fixtures import (TAGS, ner_checkpoint, ner_sentences, write_conll, write_dataset, write_jsonl,
                          write_ner_vocab)

transformers = pytest.importorskip("transformers")
pytest.importorskip("seqeval")

S = 64


# ----------------------------------------------------------------------------- entity scores


# (true, predicted, precision, recall, f1, accuracy), each worked by hand: entities are
# (type, first word, last word); an entity is right when type and both ends match.
HAND_WORKED = [
    # Identical: true {PER 0-1, LOC 3}, predicted the same -> 2/2, 2/2.
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-LOC"]], 1.0, 1.0, 1.0, 1.0),
    # A person cut short: predicted {PER 0, LOC 3}; right: LOC only -> P 1/2, R 1/2; 3 of 4 words.
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "O", "O", "B-LOC"]], 0.5, 0.5, 0.5, 0.75),
    # The right span with the wrong type counts for nothing: P 0/1, R 0/1; words 2 of 4.
    ([["B-PER", "I-PER", "O", "O"]], [["B-ORG", "I-ORG", "O", "O"]], 0.0, 0.0, 0.0, 0.5),
    # seqeval's default (conlleval) rule: I-PER after O starts an entity, so PER 0-1 is right
    # though its first tag is wrong; words 3 of 4.
    ([["B-PER", "I-PER", "O", "O"]], [["I-PER", "I-PER", "O", "O"]], 1.0, 1.0, 1.0, 0.75),
    # Two adjacent entities of one type split by B-: true {LOC 0, LOC 1}; predicted one LOC 0-1
    # -> P 0/1, R 0/2; words 1 of 2 (I-LOC vs B-LOC).
    ([["B-LOC", "B-LOC"]], [["B-LOC", "I-LOC"]], 0.0, 0.0, 0.0, 0.5),
    # Nothing predicted: P is 0/0 -> 0 (no warning), R 0/1.
    ([["O", "B-ORG", "O"]], [["O", "O", "O"]], 0.0, 0.0, 0.0, 2 / 3),
    # Micro-averaged over sentences: sentence 1 true {PER 0-1, LOC 3}, predicted {PER 0-1, ORG 2},
    # right 1; sentence 2 true {ORG 0}, predicted {ORG 0, PER 2}, right 1. P = 2/4, R = 2/3,
    # F1 = 2 PR / (P + R) = 4/7; words right 2 of 4 and 2 of 3 = 4/7.
    ([["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "O"]],
     [["B-PER", "I-PER", "B-ORG", "O"], ["B-ORG", "O", "B-PER"]], 0.5, 2 / 3, 4 / 7, 4 / 7),
]


@pytest.mark.parametrize("true, predicted, precision, recall, f1, accuracy", HAND_WORKED)
def test_entity_scores_match_hand_worked_cases(true, predicted, precision, recall, f1, accuracy):
    scores = entity_scores(true, predicted)
    assert scores == pytest.approx({"precision": precision, "recall": recall, "f1": f1, "accuracy": accuracy},
                                   abs=1e-12)


# ----------------------------------------------------------------------------- reading, tokens


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ner")


@pytest.fixture(scope="module")
def tokenizer(root):
    from bert_packed.io.hf_io import load_tokenizer

    return load_tokenizer(write_ner_vocab(str(root / "vocab")))


def test_the_three_formats_read_the_same_sentences(tmp_path):
    sentences = ner_sentences(12, 5)
    paths = {"jsonl": write_jsonl(tmp_path / "a.jsonl", sentences), "conll": write_conll(tmp_path / "a.conll", sentences),
             "classlabel": write_dataset(tmp_path / "ds_int", sentences),
             "strings": write_dataset(tmp_path / "ds_str", sentences, class_label=False)}
    renamed = write_jsonl(tmp_path / "b.jsonl", sentences, tokens_column="words", tags_column="labels")
    expected_words, expected_tags = [w for w, _ in sentences], [t for _, t in sentences]
    for kind, path in paths.items():
        read = read_sentences(path)
        assert read.words == expected_words and check_sentences(read) == expected_tags, kind
    assert read_sentences(paths["classlabel"]).label_names == TAGS  # integer tags named by the ClassLabel
    assert read_sentences(paths["strings"]).label_names is None
    read = read_sentences(renamed, "words", "labels")
    assert read.words == expected_words and check_sentences(read) == expected_tags
    # The ClassLabel's order gives the ids; string tags get theirs sorted.
    assert TagSet.from_training(expected_tags, TAGS, None, "x").id2label == dict(enumerate(TAGS))
    assert TagSet.from_training(expected_tags, None, None, "x").id2label == dict(enumerate(sorted(TAGS)))


def test_only_the_first_sub_token_of_a_word_is_labelled(tokenizer):
    words = [["met", "alice", "smithsonian", "in", "paris"]]
    tags = [["O", "B-PER", "I-PER", "O", "B-LOC"]]
    tag_set = TagSet(dict(enumerate(sorted(TAGS))))
    pieces = [tokenizer.encode(w, add_special_tokens=False).tokens for w in words[0]]
    assert [len(p) for p in pieces] == [1, 3, 4, 1, 4]  # the fixture's vocabulary splits the names
    first = encode_sentences(tokenizer, words, tags, tag_set, max_length=S)
    everything = encode_sentences(tokenizer, words, tags, tag_set, max_length=S, label_all_tokens=True)
    n = int(first.lengths[0])
    assert n == 2 + sum(len(p) for p in pieces)
    starts = np.cumsum([1] + [len(p) for p in pieces])[:-1]  # after [CLS]
    assert first.word_starts[0].tolist() == starts.tolist()
    expected = np.full(n, IGNORE_INDEX)
    expected[starts] = [tag_set.label2id[t] for t in tags[0]]
    assert first.labels[0, :n].tolist() == expected.tolist()  # [CLS], [SEP], later pieces: -100
    # label_all_tokens (run_ner.py's option): every piece, a B- word's later pieces as I- (as B-
    # when the tags have no I- of that type: none has I-LOC here).
    names = [tag_set.id2label[int(x)] if x >= 0 else None for x in everything.labels[0, :n]]
    assert "I-LOC" not in tag_set.label2id
    assert names == [None, "O", "B-PER", "I-PER", "I-PER", "I-PER", "I-PER", "I-PER", "I-PER", "O",
                     "B-LOC", "B-LOC", "B-LOC", "B-LOC", None]


def test_a_truncated_sentence_predicts_its_cut_words_as_o(tokenizer, capsys):
    from bert_packed.tasks.token_classification.metrics import word_predictions

    words = [["met", "alice", "smithsonian", "in", "paris", "today"], ["in", "paris"]]
    tags = [["O", "B-PER", "I-PER", "O", "B-LOC", "O"], ["O", "B-LOC"]]
    tag_set = TagSet(dict(enumerate(sorted(TAGS))))
    encoded = encode_sentences(tokenizer, words, tags, tag_set, max_length=8)  # [CLS] met a ##li ##ce sm ##ith [SEP]
    assert "1 of 2 sentences are longer than 8 tokens and were truncated (first: sentence 1)" in capsys.readouterr().err
    assert encoded.lengths.tolist() == [8, 7]
    assert encoded.input_ids[0, 7] == tokenizer.token_to_id("[SEP]")
    assert encoded.word_starts[0].tolist() == [1, 2, 5, -1, -1, -1]
    # Every token scores as B-PER: the cut words are 'O', the others what the model says.
    logits = [np.tile(np.eye(tag_set.num_labels)[tag_set.label2id["B-PER"]], (n, 1)) for n in encoded.lengths]
    assert word_predictions(logits, encoded.word_starts, tag_set.id2label) == [
        ["B-PER", "B-PER", "B-PER", "O", "O", "O"], ["B-PER", "B-PER"]]


# ----------------------------------------------------------------------------- packed == unpacked


def _tiny_hf(num_labels: int, vocab_size: int):
    from finetune_fixtures import tiny_hf_config

    torch.manual_seed(0)
    config = tiny_hf_config(transformers, vocab_size, num_labels=num_labels, attn_implementation="eager")
    return transformers.BertForTokenClassification(config).eval()


def _ours_from(hf_model):
    from bert_packed.model.modeling import BertConfig

    ours = BertForTokenClassification(BertConfig.from_hf(hf_model.config.to_dict(), max_sequences_per_pack=8)).eval()
    ours.load_hf_state_dict(hf_model.state_dict())
    return ours


def test_packed_logits_and_loss_equal_unpacked_and_transformers(tokenizer, one_thread):
    sentences = ner_sentences(40, 3)
    tag_set = TagSet(dict(enumerate(sorted(TAGS))))
    encoded = encode_sentences(tokenizer, [w for w, _ in sentences], [t for _, t in sentences], tag_set, max_length=S)
    hf = _tiny_hf(tag_set.num_labels, tokenizer.get_vocab_size())
    ours = _ours_from(hf)
    samples = {"input_ids": encoded.input_ids, "segment_ids": encoded.segment_ids, "input_mask": encoded.input_mask,
               "labels": encoded.labels}
    dataset = ft_data.PackedDataset(encoded, {"input_mask": encoded.input_mask, "labels": encoded.labels},
                                    lambda s, a: collate_token_classification(s, a, max_sequence_length=S,
                                                                              max_sequences_per_pack=8),
                                    max_sequence_length=S, max_sequences_per_pack=8, algorithm="lpfhp", seed=0)
    assert dataset.packing_factor > 3  # several sentences per row
    width = int(encoded.lengths.max())
    alone = collate_token_classification(samples, one_per_pack(np.arange(len(sentences))), max_sequence_length=width,
                                         max_sequences_per_pack=1)
    with torch.no_grad():
        unpacked = ours(**{k: torch.from_numpy(v) for k, v in alone.items()})
        mask = torch.from_numpy(alone["sequence_ids"] > 0).long()
        reference = hf(input_ids=torch.from_numpy(alone["input_ids"]), token_type_ids=torch.from_numpy(alone["segment_ids"]),
                       attention_mask=mask, labels=torch.from_numpy(alone["labels"]))
        packed_logits, packed_loss, seen = {}, [], 0
        for batch, rows in dataset.batches(4):
            out = ours(**{k: torch.from_numpy(v) for k, v in batch.items()})
            packed_loss.append((out["loss"] * out["num_labelled_tokens"]).item())
            for b, k in zip(*np.nonzero(rows >= 0)):
                start, i = int(batch["cls_positions"][b, k]), int(rows[b, k])
                packed_logits[i] = out["logits"][b, start:start + int(encoded.lengths[i])]
                seen += 1
    assert seen == len(sentences)
    worst_ours = max((packed_logits[i] - unpacked["logits"][i, :len(packed_logits[i])]).abs().max().item()
                     for i in range(len(sentences)))
    worst_hf = max((packed_logits[i] - reference.logits[i, :len(packed_logits[i])]).abs().max().item()
                   for i in range(len(sentences)))
    assert worst_ours <= 1e-5 and worst_hf <= 1e-5, (worst_ours, worst_hf)
    # The loss: Hugging Face's mean over the batch's labelled tokens, packed or not.
    labelled = int((encoded.labels != IGNORE_INDEX).sum())
    assert abs(unpacked["loss"].item() - reference.loss.item()) <= 1e-5
    assert abs(sum(packed_loss) / labelled - reference.loss.item()) <= 1e-5


def test_step_normalizers_make_the_step_loss_the_mean_over_its_labelled_tokens(tokenizer, one_thread):
    from bert_packed.model.losses import step_normalizers

    sentences = ner_sentences(24, 4)
    tag_set = TagSet(dict(enumerate(sorted(TAGS))))
    encoded = encode_sentences(tokenizer, [w for w, _ in sentences], [t for _, t in sentences], tag_set, max_length=S)
    samples = {"input_ids": encoded.input_ids, "segment_ids": encoded.segment_ids, "input_mask": encoded.input_mask,
               "labels": encoded.labels}
    hf = _tiny_hf(tag_set.num_labels, tokenizer.get_vocab_size())
    ours = _ours_from(hf)
    # Two micro-batches of very different label counts: 4 sentences and 20 sentences.
    micro = [collate_token_classification(samples, one_per_pack(np.arange(a, b)), max_sequence_length=S,
                                          max_sequences_per_pack=1) for a, b in ((0, 4), (4, 24))]
    normalised = step_normalizers(ours, micro)
    assert normalised[0]["normalizer"][0] == (encoded.labels != IGNORE_INDEX).sum()
    with torch.no_grad():
        step_loss = sum(ours(**{k: torch.from_numpy(v) for k, v in b.items()})["loss"].item() for b in normalised)
        whole = collate_token_classification(samples, one_per_pack(np.arange(24)), max_sequence_length=S,
                                             max_sequences_per_pack=1)
        reference = hf(input_ids=torch.from_numpy(whole["input_ids"]), token_type_ids=torch.from_numpy(whole["segment_ids"]),
                       attention_mask=torch.from_numpy(whole["sequence_ids"] > 0).long(),
                       labels=torch.from_numpy(whole["labels"])).loss.item()
    assert abs(step_loss - reference) <= 1e-5


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def job(root):
    """A tiny pre-trained checkpoint (transformers' save_pretrained + tokenizer) and the data."""
    checkpoint = ner_checkpoint(transformers, str(root / "ckpt"))
    dev = ner_sentences(60, 1)
    return {"ckpt": checkpoint, "train": write_jsonl(root / "train.jsonl", ner_sentences(300, 0)),
            "dev": write_conll(root / "dev.conll", dev), "dev_sentences": dev, "root": root}


def finetune(job, output, *extra, backend="cpu"):
    """run.main with the contract's flags; returns (exit status, summary or None)."""
    argv = ["--config", "finetune_token_classification", "--backend", backend, "--init-checkpoint", job["ckpt"],
            "--output-dir", str(output), "--no-progress", "--set", f"data.max_sequence_length={S}",
            "--set", "train.num_threads=1", "--set", "train.tensorboard=false", *extra]
    status = run.main(argv)
    path = os.path.join(output, "summary.json")
    return status, (json.load(open(path)) if status == 0 and os.path.exists(path) else None)


# The learnable recipe both runs share: 3 epochs, 12 sentences per step (one padded row per
# micro-batch and 12 of them, or the packed rows of about 12 sentences: the accumulation divided by
# the packing factor), the same rate and seed.
RECIPE = ("--set", "train.micro_batch_size=1", "--set", "train.gradient_accumulation=12",
          "--set", "optimizer.learning_rate=0.002", "--set", "train.eval_every=25", "--set", "train.checkpoint_every=0")


@pytest.fixture(scope="module")
def runs(job):
    out = {}
    for name, extra in (("packed", ()), ("padded", ("--set", "finetune.packing=false"))):
        directory = job["root"] / name
        status, summary = finetune(job, directory, "--set", f"finetune.train_file={job['train']}",
                                   "--set", f"finetune.validation_file={job['dev']}", *RECIPE, *extra)
        assert status == 0
        out[name] = (directory, summary)
    return out


def _predictions(directory):
    return [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]


def test_run_reports_entity_metrics_and_predictions(job, runs):
    directory, summary = runs["packed"]
    assert summary["task"] == "token_classification" and summary["packing_factor"] > 3
    assert summary["labels"] == {str(i): t for i, t in enumerate(sorted(TAGS))}
    assert set(summary["eval"]) == {"precision", "recall", "f1", "accuracy", "loss", "step"}
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "accuracy", "sequences", "tokens"} <= set(lines[-1])
    assert {"eval_f1", "eval_precision", "eval_recall", "eval_accuracy", "eval_loss"} <= set(lines[-1])
    best = max((line for line in lines if "eval_f1" in line), key=lambda line: line["eval_f1"])
    assert summary["eval"]["step"] == best["step"] and summary["eval"]["f1"] == best["eval_f1"]
    predictions = _predictions(directory)
    assert [p["tokens"] for p in predictions] == [w for w, _ in job["dev_sentences"]]
    assert [p["tags"] for p in predictions] == [t for _, t in job["dev_sentences"]]
    assert all(len(p["predicted_tags"]) == len(p["tokens"]) for p in predictions)
    # summary.json's metrics are those of the predictions written (the best evaluation's).
    again = entity_scores([p["tags"] for p in predictions], [p["predicted_tags"] for p in predictions])
    assert again == pytest.approx({k: summary["eval"][k] for k in again}, abs=1e-12)


def test_packed_and_padded_fine_tuning_reach_the_same_scores(runs):
    (_, packed), (_, padded) = runs["packed"], runs["padded"]
    assert padded["packing_factor"] == 1.0 and padded["data_packing"]["num_packs"] == 300
    assert packed["data_packing"]["num_packs"] < 300 / 3
    # The same sentences per step (12 padded rows; packed: fewer, fuller rows) and about as many steps.
    assert padded["gradient_accumulation"] == 12 and packed["gradient_accumulation"] == round(12 / packed["packing_factor"])
    assert abs(packed["steps"] - padded["steps"]) <= 0.1 * padded["steps"]
    # Both learn (from 0 entity F1 at the start) to the same scores within the noise of two
    # seeds-worth of such runs (observed: f1 0.88 and 0.88, accuracy 0.96 and 0.96).
    assert packed["eval"]["f1"] > 0.75 and padded["eval"]["f1"] > 0.75
    assert abs(packed["eval"]["f1"] - padded["eval"]["f1"]) <= 0.05
    assert abs(packed["eval"]["accuracy"] - padded["eval"]["accuracy"]) <= 0.02


def test_the_export_predicts_our_tags_in_transformers(job, runs):
    directory, _ = runs["packed"]
    model = transformers.AutoModelForTokenClassification.from_pretrained(directory / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory / "hf")
    assert type(model).__name__ == "BertForTokenClassification"
    assert model.config.id2label == dict(enumerate(sorted(TAGS)))
    words = [w for w, _ in job["dev_sentences"]]
    inputs = tokenizer(words, is_split_into_words=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        best = model(**inputs).logits.argmax(dim=-1)
    theirs = []
    for i in range(len(words)):
        tags, previous = [], None
        for t, w in enumerate(inputs.word_ids(i)):
            if w is not None and w != previous:
                tags.append(model.config.id2label[int(best[i, t])])
            previous = w
        theirs.append(tags)
    assert theirs == [p["predicted_tags"] for p in _predictions(directory)]


def test_fine_tuning_an_ner_checkpoint_keeps_its_tag_ids(job, runs, tmp_path, capsys):
    """From the export (string tags sorted) on a ClassLabel dataset of another order: the
    checkpoint's ids cover the tags, so its classifier loads as it is and keeps its meaning."""
    directory, _ = runs["packed"]
    data = write_dataset(tmp_path / "ds", ner_sentences(40, 9))  # ClassLabel order TAGS, not sorted
    capsys.readouterr()
    status = run.main(["--config", "finetune_token_classification", "--init-checkpoint", str(directory / "hf"),
                       "--output-dir", str(tmp_path / "out"), "--no-progress", "--set", f"data.max_sequence_length={S}",
                       "--set", f"finetune.train_file={data}", "--set", "finetune.validation_fraction=0.25",
                       "--steps", "1", "--set", "train.tensorboard=false"])
    assert status == 0
    err = capsys.readouterr().err
    assert "init checkpoint" in err and "newly initialised" not in err and "re-initialised" not in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["labels"] == {str(i): t for i, t in enumerate(sorted(TAGS))}


# ----------------------------------------------------------------------------- formats, backends


def test_conll_and_datasets_inputs_train(job, tmp_path):
    train = ner_sentences(80, 7)
    conll = write_conll(tmp_path / "train.txt", train)
    dataset = write_dataset(tmp_path / "dev_ds", ner_sentences(20, 8))
    status, summary = finetune(job, tmp_path / "a", "--set", f"finetune.train_file={conll}",
                               "--set", f"finetune.validation_file={dataset}", "--steps", "2")
    assert status == 0 and summary["steps"] == 2 and "f1" in summary["eval"]
    # A ClassLabel training set keeps the ClassLabel's ids (0 = "O" here, as in conll2003).
    labelled = write_dataset(tmp_path / "train_ds", train)
    status, summary = finetune(job, tmp_path / "b", "--set", f"finetune.train_file={labelled}",
                               "--set", "finetune.validation_fraction=0.25", "--steps", "2")
    assert status == 0 and summary["labels"] == {str(i): t for i, t in enumerate(TAGS)}
    assert len(_predictions(tmp_path / "b")) == 20  # 25 % of 80 sentences held out
    config = json.loads((tmp_path / "b" / "hf" / "config.json").read_text())
    assert config["id2label"] == {str(i): t for i, t in enumerate(TAGS)}


MOCK = ["ipu.replication_factor=1", "ipu.available_memory_proportion=[0.6]", "ipu.embedding_serialization_factor=1",
        "ipu.half_precision=false", "ipu.enable_half_partials=false", "ipu.stochastic_rounding=false",
        "ipu.device_iterations=1"]


def _short_run(job, extra=()):
    """A 3-step config without dropout (the backends' steps compare exactly)."""
    from bert_packed.config import load_config

    return load_config("finetune_token_classification", [
        f"model.init_checkpoint={job['ckpt']}", f"finetune.train_file={job['train']}",
        f"finetune.validation_file={job['dev']}", f"data.max_sequence_length={S}", "train.steps=3",
        "train.num_threads=1", "train.tensorboard=false", "train.checkpoint_every=0",
        "train.packing_adjustment=none", "train.gradient_accumulation=3", "optimizer.learning_rate=0.002",
        "model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0", *extra])


@pytest.mark.parametrize("layers_per_ipu, stages", [("[2]", [0]), ("[1,1]", [0, 1])], ids=["one_ipu", "two_ipus"])
def test_mock_ipu_path_matches_cpu(job, tmp_path, layers_per_ipu, stages):
    """The IPU code path (mock poptorch: fixed shapes, the pipeline annotations with the head on
    the last IPU, fp32) trains the cpu run's steps and predicts its tags."""
    from backends import get_backend
    from bert_packed.loop.train import train

    cpu = train(_short_run(job), get_backend("cpu"), output_dir=str(tmp_path / "cpu"), show_progress=False)
    mock_backend = get_backend("mock")
    mock = train(_short_run(job, [f"ipu.layers_per_ipu={layers_per_ipu}", *MOCK]), mock_backend,
                 output_dir=str(tmp_path / "mock"), show_progress=False)
    blocks = mock_backend.training_model.pipeline["blocks"]
    assert blocks[0][:2] == ("Embedding", 0) and blocks[-1][:2] == ("Heads", stages[-1])  # the head on the last IPU
    assert sorted({ipu for _, ipu, _ in blocks}) == stages
    assert mock["backend"] == "mock" and mock["steps"] == cpu["steps"] == 3
    assert abs(mock["last"]["loss"] - cpu["last"]["loss"]) <= 1e-5
    assert abs(mock["eval"]["loss"] - cpu["eval"]["loss"]) <= 1e-5
    assert mock["eval"]["f1"] == cpu["eval"]["f1"]
    assert _predictions(tmp_path / "mock") == _predictions(tmp_path / "cpu")


def test_pipeline_puts_the_head_on_the_last_ipu():
    from bert_packed.model.modeling import BertConfig

    layout = BertForTokenClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                   num_attention_heads=2, intermediate_size=32)).pipeline_layout()
    assert layout.head_tied_to_embeddings is False and isinstance(layout.head, torch.nn.Linear)
    from ipu.pipeline import heads_ipu

    assert heads_ipu([1, 1], layout.head_tied_to_embeddings) == 1


def test_the_cuda_backend_on_cpu_trains_the_cpu_steps(job, tmp_path):
    from backends.cpu import CPUBackend
    from backends.cuda import CUDABackend
    from bert_packed.loop.train import train

    # cuda.device=cpu: the config says where the backend runs (its defaults, attention "auto"
    # included, are resolved for that device)
    config = _short_run(job, ["cuda.precision=fp32", "cuda.device=cpu"])
    cuda = train(config, CUDABackend(device="cpu"), output_dir=str(tmp_path / "cuda"), show_progress=False)
    cpu = train(config, CPUBackend(), output_dir=str(tmp_path / "cpu"), show_progress=False)
    assert cuda["backend"] == "cuda" and cuda["status"] == "completed" and cuda["steps"] == 3
    assert abs(cuda["last"]["loss"] - cpu["last"]["loss"]) <= 1e-5
    assert abs(cuda["eval"]["loss"] - cpu["eval"]["loss"]) <= 1e-5
    assert _predictions(tmp_path / "cuda") == _predictions(tmp_path / "cpu")


def test_export_of_a_run_checkpoint_keeps_the_tags(job, tmp_path):
    from bert_packed.finetune.__main__ import export

    status, _ = finetune(job, tmp_path / "run", "--set", f"finetune.train_file={job['train']}",
                         "--set", f"finetune.validation_file={job['dev']}", "--steps", "1",
                         "--set", "train.checkpoint_every=1")
    assert status == 0
    export(str(tmp_path / "run"), str(tmp_path / "exported"))
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"]
    assert config["id2label"] == {str(i): t for i, t in enumerate(sorted(TAGS))}
