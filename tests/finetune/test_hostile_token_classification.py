"""Hostile input for token classification: every mistake in the data is found before the first
step and reported in one line naming the file, the line or row, the column and the value; exit
status 2, the inputs byte-identical afterwards, and no output file written (the run directory
holds at most the loop's lock, ``.lock``, which the loop takes before any task reads its data)."""
from __future__ import annotations

import json
import os

import pytest

from hostile import assert_unchanged, main_error, snapshot
from ner_fixtures import ner_checkpoint, ner_sentences, write_conll, write_dataset, write_jsonl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ner_checkpoint(transformers, str(tmp_path_factory.mktemp("ckpt")))


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _text(path, text, encoding="utf-8"):
    with open(path, "wb") as f:
        f.write(text.encode(encoding) if isinstance(text, str) else text)
    return str(path)


GOOD = [{"tokens": ["met", "alice", "smithsonian"], "ner_tags": ["O", "B-PER", "I-PER"]},
        {"tokens": ["in", "paris"], "ner_tags": ["O", "B-LOC"]}]


def _with_row(row):
    return GOOD[:1] + [row] + GOOD[1:]


# (case id, data maker (dir -> {train, dev}), extra --set, expected message with {train} / {dev})
CASES = [
    ("length_mismatch", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["a", "b", "c"], "ner_tags": ["O", "O"]}))},
     [], "{train}: row 2: 3 words (column 'tokens') but 2 tags (column 'ner_tags')"),
    ("empty_sentence", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": [], "ner_tags": []}))},
     [], "{train}: row 2, column 'tokens': the sentence is empty (no words)"),
    ("not_iob2", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["bob"], "ner_tags": ["B_PER"]}))},
     [], "{train}: row 2, column 'ner_tags', word 1: tag 'B_PER' is not an IOB2 tag (O, B-TYPE or I-TYPE)"),
    ("no_type", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["x", "bob"], "ner_tags": ["O", "B-"]}))},
     [], "{train}: row 2, column 'ner_tags', word 2: tag 'B-' is not an IOB2 tag (O, B-TYPE or I-TYPE)"),
    ("iob1_start", lambda d: {"train": _text(d / "t.conll", "met O\nalice B-PER\n\nin O\nparis I-LOC\n")},
     [], "{train}:5: tag 'I-LOC' follows 'O': in IOB2 an entity starts with B-LOC (IOB1 data? convert it to IOB2)"),
    ("type_switch", lambda d: {"train": _text(d / "t.conll", "alice B-PER\nsmithsonian I-ORG\n")},
     [], "{train}:2: tag 'I-ORG' follows 'B-PER': in IOB2 an entity starts with B-ORG (IOB1 data? convert it to IOB2)"),
    ("unseen_validation_tag", lambda d: {"train": _jsonl(d / "t.jsonl", GOOD),
                                         "dev": _text(d / "dev.conll", "-DOCSTART- -X- O\n\nin O\nacme B-ORG\n")},
     [], "{dev}:4: tag 'B-ORG' appears only in the validation file, not in the training file {train}, so the model "
         "cannot learn it (training tags: B-LOC, B-PER, I-PER, O)"),
    ("conll_one_column", lambda d: {"train": _text(d / "t.conll", "met O\nalice\n")},
     [], "{train}:2: expected a word and its tag separated by whitespace (CoNLL), got 'alice'"),
    ("conll_empty", lambda d: {"train": _text(d / "t.conll", "-DOCSTART- -X- O\n\n\n")},
     [], "{train}: no sentences (a CoNLL file holds a word and its tag per line)"),
    ("conll_not_utf8", lambda d: {"train": _text(d / "t.conll", "met O\n\ncaf\xe9 O\n", encoding="latin-1")},
     [], "{train}: line 3: not UTF-8 (byte 0xe9 at byte offset 10, column 4); save the file as UTF-8, e.g. iconv -f "
         "<encoding> -t utf-8"),
    ("conll_long_line", lambda d: {"train": _text(d / "t.conll", "met O\n" + "x" * 100_000 + "\n")},
     [], "{train}:2: expected a word and its tag separated by whitespace (CoNLL), got '" + "x" * 37 + "...'"),
    ("tokens_not_a_list", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": "in paris", "ner_tags": ["O", "B-LOC"]}))},
     [], "{train}: row 2, column 'tokens': expected a list of words, got str 'in paris'"),
    ("word_not_a_string", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["in", 7], "ner_tags": ["O", "B-LOC"]}))},
     [], "{train}: row 2, column 'tokens', word 2: 7 is not a word (a non-empty string)"),
    ("empty_word", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["in", " "], "ner_tags": ["O", "B-LOC"]}))},
     [], "{train}: row 2, column 'tokens', word 2: ' ' is not a word (a non-empty string)"),
    ("integer_tags_without_names", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["in", "paris"], "ner_tags": [0, 3]}))},
     [], "{train}: row 2, column 'ner_tags', word 1: tag 0 is an integer but nothing names it; give IOB2 tag strings, "
         "or a datasets directory whose tag column is a ClassLabel"),
    ("dataset_integers_without_classlabel", lambda d: {"train": _dataset_of_integers(d / "ds")},
     [], "{train}: row 1, column 'ner_tags', word 1: tag 0 is an integer but nothing names it; give IOB2 tag strings, "
         "or a datasets directory whose tag column is a ClassLabel"),
    ("missing_column", lambda d: {"train": _jsonl(d / "t.jsonl", GOOD)},
     ["--set", "finetune.tags_column=labels"], "{train}: no column 'labels'; columns: ner_tags, tokens"),
    ("only_o", lambda d: {"train": _jsonl(d / "t.jsonl", [{"tokens": ["a", "b"], "ner_tags": ["O", "O"]}] * 3)},
     [], "{train}: every tag is 'O' (no entity to learn)"),
    ("too_long_with_truncation_error", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row(
        {"tokens": ["the"] * 80, "ner_tags": ["O"] * 79 + ["B-LOC"]}))},
     ["--set", "finetune.truncation=error"],
     "{train}: row 2: the sentence has 82 tokens, more than the maximum 64 (data.max_sequence_length); shorten it, "
     "raise the maximum, or set finetune.truncation=truncate"),
    ("tag_not_a_string", lambda d: {"train": _jsonl(d / "t.jsonl", _with_row({"tokens": ["in"], "ner_tags": [["O"]]}))},
     [], "{train}: row 2, column 'ner_tags', word 1: tag ['O'] is not a string"),
]


def _dataset_of_integers(path):
    import datasets

    datasets.Dataset.from_dict({"tokens": [["in", "paris"]], "ner_tags": [[0, 1]]}).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("make, extra, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_data_is_one_line_before_the_first_step(checkpoint, tmp_path, capsys, make, extra, message):
    data = tmp_path / "data"
    data.mkdir()
    files = make(data)
    if "dev" not in files:
        files["dev"] = write_jsonl(data / "dev.jsonl", [(["in", "paris"], ["O", "B-LOC"])])
    before = snapshot(data, checkpoint)
    capsys.readouterr()  # datasets' progress bars while writing the data
    out = tmp_path / "run"
    code, line = main_error(capsys, ["--config", "finetune_token_classification", "--init-checkpoint", checkpoint,
                                     "--output-dir", str(out), "--no-progress", "--set", "data.max_sequence_length=64",
                                     "--set", f"finetune.train_file={files['train']}",
                                     "--set", f"finetune.validation_file={files['dev']}", *extra])
    assert (code, line) == (2, "error: " + message.format(**files))
    assert_unchanged(before, data, checkpoint)
    assert not out.exists() or os.listdir(out) == [".lock"], os.listdir(out)


def test_a_byte_order_mark_does_not_make_the_docstart_line_a_sentence(tmp_path):
    # Was: '\ufeff-DOCSTART-' was a word tagged O, a sentence of its own.
    from bert_packed.tasks.token_classification.data import read_sentences

    text = "-DOCSTART- -X- -X- O\n\nmet O\nalice B-PER\n"
    plain = read_sentences(_text(tmp_path / "plain.conll", text))
    marked = read_sentences(_text(tmp_path / "bom.conll", b"\xef\xbb\xbf" + text.encode()))
    assert marked.words == plain.words == [["met", "alice"]] and marked.tags == [["O", "B-PER"]]


def test_messages_name_the_files_own_rows(checkpoint, tmp_path, capsys):
    """A validation part held out of a JSONL training file (finetune.validation_fraction) still
    names the file's own rows, and a datasets directory's ClassLabel-named tags are checked like
    strings, by row."""
    import numpy as np

    held = int(np.random.default_rng(0).permutation(10)[0])  # the seeded split's held-out row (train.seed 0)
    rows = [{"tokens": ["in", "paris"], "ner_tags": ["O", "B-LOC"]}] * 10
    rows[held] = {"tokens": ["at", "acme"], "ner_tags": ["O", "B-ORG"]}  # a tag only the held-out row has
    train = _jsonl(tmp_path / "t.jsonl", rows)
    argv = ["--config", "finetune_token_classification", "--init-checkpoint", checkpoint, "--no-progress",
            "--set", "data.max_sequence_length=64"]
    code, line = main_error(capsys, argv + ["--output-dir", str(tmp_path / "run"), "--set", f"finetune.train_file={train}",
                                            "--set", "finetune.validation_fraction=0.1"])
    assert (code, line) == (2, f"error: {train}: row {held + 1}, column 'ner_tags', word 2: tag 'B-ORG' appears only "
                               f"in the held-out validation split (finetune.validation_fraction=0.1 of {train}), not "
                               f"in the sentences trained on, so the model cannot learn it (training tags: B-LOC, O)")
    sentences = ner_sentences(10, 0)
    bad = write_dataset(tmp_path / "ds", sentences[:9] + [(["in", "acme"], ["O", "I-ORG"])])
    dev = write_conll(tmp_path / "dev.conll", sentences)
    capsys.readouterr()  # datasets' progress bars while writing the data
    code, line = main_error(capsys, argv + ["--output-dir", str(tmp_path / "run2"), "--set", f"finetune.train_file={bad}",
                                            "--set", f"finetune.validation_file={dev}"])
    assert (code, line) == (2, f"error: {bad}: row 10, column 'ner_tags', word 2: tag 'I-ORG' follows 'O': in IOB2 an "
                               f"entity starts with B-ORG (IOB1 data? convert it to IOB2)")


@pytest.mark.parametrize("inside", ["the datasets directory", "the folder of the JSON lines file"])
def test_an_output_dir_that_is_where_the_data_is_is_refused(checkpoint, tmp_path, capsys, inside):
    # Was: the run wrote checkpoint.pt, best/, hf/, predictions.jsonl ... into the saved dataset
    # (or next to train.jsonl, where a file of one of those names would be replaced).
    data = tmp_path / "data"
    data.mkdir()
    sentences = ner_sentences(12, 0)
    dataset = write_dataset(data / "ds", sentences)
    jsonl = write_jsonl(data / "train.jsonl", sentences)
    capsys.readouterr()  # datasets' progress bars while writing the data
    train, out = (dataset, dataset) if inside.startswith("the datasets") else (jsonl, str(data))
    before = snapshot(data, checkpoint)
    code, line = main_error(capsys, ["--config", "finetune_token_classification", "--init-checkpoint", checkpoint,
                                     "--output-dir", out, "--no-progress", "--set", "data.max_sequence_length=64",
                                     "--set", f"finetune.train_file={train}", "--steps", "1"])
    assert (code, line) == (2, f"error: --output-dir {out} is finetune.train_file's directory ({train}); choose "
                               f"another --output-dir so the input stays as it is")
    assert_unchanged(before, data, checkpoint)


def test_validating_on_the_training_file_is_warned(checkpoint, tmp_path):
    from backends import get_backend_class
    from bert_packed.config import load_config, validate

    train = write_jsonl(tmp_path / "train.jsonl", ner_sentences(4, 0))
    config = load_config("finetune_token_classification", [f"finetune.train_file={train}",
                                                           f"finetune.validation_file={train}"])
    assert validate(config, get_backend_class("cpu")) == [
        f"finetune.validation_file is finetune.train_file ({train}): the evaluations, and the best model chosen by "
        f"them, measure the training data"]
    config.finetune.validation_file = None
    assert validate(config, get_backend_class("cpu")) == []


def test_a_tag_only_in_the_held_out_split_is_said_to_be_there(checkpoint, tmp_path, capsys):
    # Was: "tag 'B-ORG' is not among the training tags" while the place named the training file
    # itself (the tag is in it, but only in the sentence validation_fraction held out).
    from bert_packed.tasks.data import held_out

    data = tmp_path / "data"
    data.mkdir()
    rows = [GOOD[i % 2] for i in range(10)]
    held = held_out(10, 0.1, 7, what="sentences", where="")[1]
    assert len(held) == 1
    rows[held[0]] = {"tokens": ["at", "acme"], "ner_tags": ["O", "B-ORG"]}
    train = _jsonl(data / "t.jsonl", rows)
    before = snapshot(data, checkpoint)
    out = tmp_path / "run"
    code, line = main_error(capsys, ["--config", "finetune_token_classification", "--init-checkpoint", checkpoint,
                                     "--output-dir", str(out), "--no-progress", "--set", "data.max_sequence_length=64",
                                     "--set", f"finetune.train_file={train}", "--set", "finetune.validation_fraction=0.1",
                                     "--set", "train.seed=7"])
    assert (code, line) == (2, f"error: {train}: row {held[0] + 1}, column 'ner_tags', word 2: tag 'B-ORG' appears only "
                               f"in the held-out validation split (finetune.validation_fraction=0.1 of {train}), not "
                               f"in the sentences trained on, so the model cannot learn it (training tags: B-LOC, "
                               f"B-PER, I-PER, O)")
    assert_unchanged(before, data, checkpoint)
    assert not out.exists() or os.listdir(out) == [".lock"], os.listdir(out)
