"""Hostile inputs to fine-tuning (issue 27): CSV/TSV/JSONL files, labels, SQuAD files,
checkpoint import, and the outputs of `python -m bert_packed.finetune predict/export`.

Every case asserts the exact one-line message, exit status 2, that the inputs (data files,
checkpoint) are byte-identical afterwards, and that nothing was written (the run's output
directory holds at most its lock file; predict/export wrote nothing). The cases go through
the surfaces users touch: ``run.main`` for training runs, the fine-tuning CLI's ``main``.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from bert_packed.finetune.__main__ import main as finetune_main
from finetune_fixtures import save_hf_checkpoint, tiny_pretraining_checkpoint
from hostile import assert_unchanged, main_error, snapshot

transformers = pytest.importorskip("transformers")

S = 64  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Hugging Face BertForPreTraining directory with its fast tokenizer (read-only use)."""
    return tiny_pretraining_checkpoint(transformers, tmp_path_factory.mktemp("ckpt"))


def no_output(out):
    """Nothing of a run was written: the output directory is absent or holds only its lock."""
    assert not out.exists() or sorted(os.listdir(out)) == [".lock"], sorted(os.listdir(out))


GOOD = "text,label\ngood dog,pos\nbad cat,neg\nfine tree,pos\nsad river,neg\n"


def write(path, content):
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def classify(capsys, checkpoint, out, train, validation=None, *extra):
    """(exit status, the one error line) of a classification run on ``train`` (and ``validation``)."""
    argv = ["--config", "finetune_classification", "--init-checkpoint", str(checkpoint), "--output-dir", str(out),
            "--no-progress", "--set", f"data.max_sequence_length={S}", "--set", f"finetune.train_file={train}",
            "--set", "train.num_threads=1", *extra]
    if validation is not None:
        argv += ["--set", f"finetune.validation_file={validation}"]
    return main_error(capsys, argv)


def refused(capsys, checkpoint, tmp_path, train, message, validation=None, *extra):
    """The classification run on ``train`` is refused with exactly ``message``; nothing changed."""
    data = tmp_path / "data"
    before = snapshot(data, checkpoint)
    out = tmp_path / "out"
    code, line = classify(capsys, checkpoint, out, train, validation, *extra)
    assert (code, line) == (2, f"error: {message}")
    assert_unchanged(before, data, checkpoint)
    no_output(out)


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / "dev.csv", GOOD)
    return folder


# ----------------------------------------------------------------------------- CSV / TSV / JSONL


def test_an_unquoted_delimiter_making_an_extra_field_is_refused(capsys, checkpoint, tmp_path, data):
    # csv.DictReader would file 'neg' under the key None and train on 'bad' labelled ' cat'.
    train = write(data / "train.csv", "text,label\ngood dog,pos\nbad, cat,neg\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: 3 fields but the header has 2: extra value 'neg' in ['bad', ' cat', 'neg'] (a ',' "
            f"inside an unquoted value?); quote values that hold the delimiter", data / "dev.csv")


def test_a_tab_inside_a_tsv_value_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.tsv", "text\tlabel\ngood dog\tpos\nbad\tcat\tneg\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: 3 fields but the header has 2: extra value 'neg' in ['bad', 'cat', 'neg'] (a tab "
            f"inside an unquoted value?); quote values that hold the delimiter", data / "dev.csv")


def test_a_tsv_with_literal_quotes_is_read_as_written(tmp_path):
    # GLUE's files and IANA's TSV: quotes are text. The strict CSV reading refused this line.
    from bert_packed.tasks.data import read_table

    path = write(tmp_path / "glue.tsv", 'text\tlabel\n"Quoted words," she said -- Author\tpos\n'
                                        'it \'s a "charming" film\tneg\n"Stop."\tpos\n')
    table = read_table(str(path), ["text", "label"])
    assert table["text"] == ['"Quoted words," she said -- Author', 'it \'s a "charming" film', '"Stop."']
    assert table["label"] == ["pos", "neg", "pos"] and table["text"].lines == [2, 3, 4]


def test_a_tsv_with_csv_quoting_is_read_unquoted(tmp_path):
    # pandas.to_csv(sep="\t") (csv.writer): a value with a quote, a tab or a line break quoted whole.
    import csv

    from bert_packed.tasks.data import read_table

    values = ['"Quoted words," she said -- Author', "a\tb", "two\nlines", "plain"]
    with open(tmp_path / "pandas.tsv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerows([["text", "label"]] + [[v, "pos"] for v in values])
    table = read_table(str(tmp_path / "pandas.tsv"), ["text", "label"])
    assert table["text"] == values and table["text"].lines == [2, 3, 4, 6]
    quote_all = write(tmp_path / "all.tsv", '"text"\t"label"\n"Stop."\t"pos"\n')
    assert read_table(str(quote_all), ["text", "label"]) == {"text": ["Stop."], "label": ["pos"]}


def test_a_tsv_value_both_readings_fit_differently_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.tsv", 'text\tlabel\ngood dog\tpos\n"Stop."\tneg\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: '\"Stop.\"' is the text 'Stop.' with CSV quoting and '\"Stop.\"' with literal quotes; "
            f"which is meant is ambiguous: remove the quotes if they are not part of the text, quote the value whole "
            f"with its quotes doubled if they are, or give the file as JSON lines (.jsonl)", data / "dev.csv")


def test_a_tsv_neither_reading_fits_is_refused_with_both_reasons(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.tsv", 'text\tlabel\n"Quoted," she said\tpos\n"a\tb"\tneg\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: not valid TSV read either way: with literal quotes, line 3: 3 fields but the header has 2: "
            f"extra value 'neg' in ['\"a', 'b\"', 'neg'] (a tab inside an unquoted value?); quote values that hold "
            f"the delimiter; with CSV quoting, line 2: not valid TSV ('\\t' expected after '\"'); a value holding a "
            f"quote, a tab or a line break must be quoted whole, with inner quotes doubled (\"\")", data / "dev.csv")


def test_duplicate_column_names_are_refused_naming_both(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "label,text,label\npos,good dog,neg\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 1: the header names column 'label' twice (columns 1 and 3); which one is meant is "
            f"ambiguous: rename one", data / "dev.csv")


def test_a_short_row_is_refused_naming_the_missing_column(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,pos\nbad cat\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: 1 field(s) but the header has 2: no value for column 'label' in ['bad cat']; every "
            f"row needs every column (an empty value is nothing between two delimiters)", data / "dev.csv")


def test_an_empty_text_is_refused_naming_line_and_column(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,pos\n  ,neg\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: column 'text': the text is empty; remove the row or fill it in (an empty text would "
            f"train on [CLS] [SEP] alone)", data / "dev.csv")


def test_an_empty_label_is_refused_naming_line_and_column(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,pos\nbad cat,\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: column 'label': label '' is empty; every row needs a label (remove the row or fill it "
            f"in)", data / "dev.csv")


def test_a_quote_that_is_never_closed_is_refused_not_swallowing_the_file(capsys, checkpoint, tmp_path, data):
    # Without strict quoting the rest of the file became one text value.
    train = write(data / "train.csv", 'text,label\n"good dog,pos\nbad cat,neg\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: lines 2-3: not valid CSV (unexpected end of data); a value holding a quote, a ',' or a line "
            f"break must be quoted whole, with inner quotes doubled (\"\")", data / "dev.csv")


def test_text_after_a_closing_quote_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", 'text,label\n"good" dog,pos\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: not valid CSV (',' expected after '\"'); a value holding a quote, a ',' or a line "
            f"break must be quoted whole, with inner quotes doubled (\"\")", data / "dev.csv")


def test_another_encoding_is_refused_naming_line_and_byte_offset(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,pos\ncafé noir,neg\n".encode("latin-1"))
    assert len(b"text,label\ngood dog,pos\ncaf") == 27
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: not UTF-8 (byte 0xe9 at byte offset 27, column 4); save the file as UTF-8, e.g. "
            f"iconv -f <encoding> -t utf-8", data / "dev.csv")


def test_a_utf16_file_is_refused_and_said_to_be_utf16(capsys, checkpoint, tmp_path, data):
    validation = write(data / "dev.csv", GOOD.encode("utf-16"))
    train = write(data / "train.csv", GOOD)
    refused(capsys, checkpoint, tmp_path, train,
            f"{validation}: line 1: not UTF-8 (byte 0xff at byte offset 0, column 1: a UTF-16 byte-order mark); save "
            f"the file as UTF-8, e.g. iconv -f <encoding> -t utf-8", validation)


def test_a_utf8_byte_order_mark_is_accepted_and_not_part_of_the_first_column(tmp_path):
    from bert_packed.tasks.data import read_table

    path = write(tmp_path / "bom.csv", b"\xef\xbb\xbf" + GOOD.encode())
    table = read_table(str(path), ["text", "label"])
    assert table["text"][:2] == ["good dog", "bad cat"] and table["text"].lines == [2, 3, 4, 5]
    jsonl = write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + b'{"text": "a", "label": "pos"}\n')
    assert read_table(str(jsonl), ["text", "label"]) == {"text": ["a"], "label": ["pos"]}


def test_a_long_document_is_a_text_not_a_csv_error(tmp_path):
    from bert_packed.tasks.data import read_table

    text = "word " * 60_000  # 300,000 characters: over csv's default field limit of 131,072
    path = write(tmp_path / "long.csv", f"text,label\n{text},pos\nshort,neg\n")
    assert read_table(str(path), ["text"])["text"] == [text, "short"]
    import csv

    assert csv.field_size_limit() == 131072  # the process-wide limit is restored


def test_a_json_line_with_a_key_twice_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": "pos"}\n{"text": "bad", "label": "neg", '
                                        '"label": "pos"}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: key 'label' occurs twice in one object; which value is meant is ambiguous: keep one",
            data / "dev.csv")


def test_a_json_null_label_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": "pos"}\n\n{"text": "bad", "label": null}\n')
    refused(capsys, checkpoint, tmp_path, train, f"{train}: line 3: no value in column 'label' (null)",
            data / "dev.csv")


def test_a_json_text_that_is_not_a_string_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": "pos"}\n{"text": 42, "label": "neg"}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: column 'text': the text is a number (42), not a string", data / "dev.csv")


def test_a_tsv_named_csv_gets_a_hint(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text\tlabel\ngood dog\tpos\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: no column 'text'; columns: text\tlabel (the header is one column holding a tab: name the "
            f"file .tsv?)", data / "dev.csv")


def test_spaces_around_a_header_name_get_a_hint(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text, label\ngood dog,pos\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: no column 'label'; columns: text,  label (the header has ' label': spaces around the name)",
            data / "dev.csv")


def test_lines_stay_right_through_the_held_out_split(capsys, checkpoint, tmp_path, data):
    # No validation file: 10 % of the rows are held out; a bad label in either part is still
    # reported at its line of the training file.
    rows = [f"text {i},{'pos' if i % 2 else 'neg'}" for i in range(30)]
    rows[17] = "text 17,7"
    train = write(data / "train.csv", "text,label\n" + "\n".join(rows) + "\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 19: column 'label': label '7' is not written like label 'neg' (line 2): labels mix "
            f"names, numbers or booleans; write every label the same way (all names, or all class ids)")


# ----------------------------------------------------------------------------- labels


def test_class_ids_written_as_floats_are_not_silently_regression(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,1.0\nbad cat,0.0\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: column 'label': label '1.0' is a whole number written as a decimal: a class id or a "
            f"regression target? set finetune.problem_type (single_label_classification or regression), or write "
            f"class ids as integers", data / "dev.csv")


def test_a_nan_label_among_class_ids_is_refused_not_regression(capsys, checkpoint, tmp_path, data):
    # Was: one 'nan' (pandas' missing value) made every other class id a regression target.
    train = write(data / "train.csv", "text,label\ngood dog,1\nbad cat,0\nsad river,nan\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 4: column 'label': label 'nan' is not a finite number (a missing value written as a "
            f"number?); fix or remove the row", data / "dev.csv")


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity"])
def test_a_non_finite_regression_target_is_a_data_error_not_divergence(capsys, checkpoint, tmp_path, data, value):
    # Was: trained, and the run ended "diverged" (exit 3).
    train = write(data / "train.csv", "text,label\ngood dog,0.5\nbad cat,0.25\n")
    validation = write(data / "dev.csv", f"text,label\ngood dog,0.5\nbad cat,{value}\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{validation}: line 3: column 'label': label {value!r} is not a finite number; a regression target must "
            f"be one (fix or remove the row)", validation, "--set", "finetune.problem_type=regression")


def test_a_json_nan_regression_target_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": 0.5}\n{"text": "bad cat", "label": NaN}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: column 'label': label nan is not a finite number (a missing value written as a "
            f"number?); fix or remove the row", data / "dev.csv")


def test_names_mixed_with_class_ids_are_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,pos\nbad cat,0\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: column 'label': label '0' is not written like label 'pos' (line 2): labels mix "
            f"names, numbers or booleans; write every label the same way (all names, or all class ids)",
            data / "dev.csv")


def test_booleans_mixed_with_names_are_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": true}\n{"text": "bad cat", "label": "no"}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: column 'label': label 'no' is not written like label True (line 1): labels mix "
            f"names, numbers or booleans; write every label the same way (all names, or all class ids)",
            data / "dev.csv")


def test_a_negative_class_id_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,1\nbad cat,-1\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: column 'label': label '-1' is a negative class id; class ids count from 0",
            data / "dev.csv")


def test_a_fractional_class_id_is_refused_when_the_task_is_classification(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", "text,label\ngood dog,1\nbad cat,0.5\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: column 'label': label '0.5' is not a class id (it has a fraction); for numeric "
            f"targets set finetune.problem_type=regression", data / "dev.csv",
            "--set", "finetune.problem_type=single_label_classification")


def test_a_validation_label_the_training_data_lacks_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.csv", GOOD)
    validation = write(data / "dev.csv", "text,label\ngood dog,pos\nbad cat,neutral\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{validation}: line 3: column 'label': label 'neutral' is not one of the training labels (neg, pos)",
            validation)


def test_a_multi_label_list_mixed_with_a_single_label_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": ["pos"]}\n{"text": "bad cat", "label": "neg"}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 2: column 'label': label 'neg' is not a list, but other rows' labels are (multi-label); "
            f"write every label as a list ([] for none)", data / "dev.csv")


def test_lists_of_labels_for_a_single_label_task_are_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": ["pos"]}\n{"text": "bad", "label": ["neg"]}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 1: column 'label': label ['pos'] is a list, not a single label (multi-label data: lists "
            f"of labels, or names joined by finetune.label_separator)", data / "dev.csv",
            "--set", "finetune.problem_type=single_label_classification")


def test_whole_numbers_as_decimals_are_class_ids_when_the_problem_type_says_so():
    from bert_packed.tasks.classification.data import Labels

    labels = Labels.from_training(["1.0", "0", "2.0"], "single_label_classification", None, ",", None, "t")
    assert labels.num_labels == 3 and labels.encode(["2.0", "1"], ",", "v").tolist() == [2, 1]
    regression = Labels.from_training(["1.0", "0.0"], "regression", None, ",", None, "t")
    assert regression.encode(["3.0"], ",", "v").tolist() == [3.0]
    multi = Labels.from_training(["a,b", "", "b"], "multi_label_classification", None, ",", None, "t")
    assert multi.encode([""], ",", "v").tolist() == [[0, 0]]  # an empty multi-label row: no labels
    booleans = Labels.from_training([True, False], None, None, ",", None, "t")
    assert booleans.id2label == {0: "False", 1: "True"}


# ----------------------------------------------------------------------------- multi-label empty values
#
# The rule (docs/finetuning.md): in a multi-label row an empty value (CSV/TSV) or [] (JSON lines)
# means "no labels", every class negative; it is the only empty label accepted. An empty name
# inside a row, data where no row has a label, and an empty label of any other problem type are
# refused; with problem_type null a name holding the separator is ambiguous and refused.

MULTI = 'text,label\ngood dog,"pos,pet"\nbad cat,\nfine tree,pos\nsad river,  \n'


def test_an_empty_multi_label_value_is_a_row_with_no_labels(capsys, checkpoint, tmp_path, data):
    import run

    train = write(data / "train.csv", MULTI)
    validation = write(data / "dev.tsv", "text\tlabel\ngood dog\tpet\nbad cat\t\n")
    before = snapshot(data, checkpoint)
    out = tmp_path / "out"
    argv = ["--config", "finetune_classification", "--init-checkpoint", str(checkpoint), "--output-dir", str(out),
            "--no-progress", "--set", f"data.max_sequence_length={S}", "--set", f"finetune.train_file={train}",
            "--set", f"finetune.validation_file={validation}", "--set", "train.num_threads=1", "--steps", "1",
            "--set", "finetune.problem_type=multi_label_classification"]
    assert run.main(argv) == 0, capsys.readouterr().err
    assert_unchanged(before, data, checkpoint)
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "completed" and "eval" in summary
    from bert_packed.tasks.classification.data import Labels

    labels = Labels.from_training(["pos,pet", "", "pos", "  "], "multi_label_classification", None, ",", None, "t")
    assert labels.id2label == {0: "pet", 1: "pos"}
    assert labels.encode(["pet", "", " ", "pos , pet"], ",", "v").tolist() == [[1, 0], [0, 0], [0, 0], [1, 1]]
    json_rows = Labels.from_training([["a"], [], ["a", "b"]], None, None, ",", None, "t")
    assert json_rows.problem_type == "multi_label_classification"
    assert json_rows.encode([[]], ",", "v").tolist() == [[0, 0]]


@pytest.mark.parametrize("content, extra, message", [
    ('text,label\ngood dog,"pos,,pet"\nbad cat,pos\n', ("--set", "finetune.problem_type=multi_label_classification"),
     "line 2: column 'label': label 'pos,,pet' has an empty label name between or around the separators (','); a "
     "label lost? join the names by single separators, or leave the value empty for a row with no labels"),
    ('text,label\ngood dog,pos\nbad cat,"neg,"\n', ("--set", "finetune.problem_type=multi_label_classification"),
     "line 3: column 'label': label 'neg,' has an empty label name between or around the separators (','); a "
     "label lost? join the names by single separators, or leave the value empty for a row with no labels"),
    ("text,label\ngood dog,\nbad cat, \n", ("--set", "finetune.problem_type=multi_label_classification"),
     "no row has a label (multi-label rows may have none, written as an empty value or [], but some row must name "
     "a class)"),
    # problem_type null: several labels or one class named 'pos,pet'? Was: silently one class.
    ('text,label\ngood dog,"pos,pet"\nbad cat,neg\n', (),
     "line 2: column 'label': label 'pos,pet' holds finetune.label_separator ',': several labels (multi-label) or "
     "one class whose name holds ','? set finetune.problem_type (multi_label_classification or "
     "single_label_classification)"),
    # Empty elsewhere: single-label (inferred or given) and regression.
    ("text,label\ngood dog,pos\nbad cat,\n", ("--set", "finetune.problem_type=single_label_classification"),
     "line 3: column 'label': label '' is empty; every row needs a label (remove the row or fill it in)"),
    ("text,label\ngood dog,0.5\nbad cat,\n", ("--set", "finetune.problem_type=regression"),
     "line 3: column 'label': label '' is empty; every row needs a label (remove the row or fill it in)"),
])
def test_empty_labels_outside_the_multi_label_convenience_are_refused(capsys, checkpoint, tmp_path, data, content,
                                                                      extra, message):
    train = write(data / "train.csv", content)
    refused(capsys, checkpoint, tmp_path, train, f"{train}: {message}", data / "dev.csv", *extra)


def test_an_empty_name_in_a_json_list_of_labels_is_refused(capsys, checkpoint, tmp_path, data):
    train = write(data / "train.jsonl", '{"text": "good dog", "label": ["pos", ""]}\n{"text": "bad", "label": []}\n')
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 1: column 'label': label ['pos', ''] has an empty label name; a label lost? remove it, or "
            f"write [] for a row with no labels", data / "dev.csv")


def test_class_ids_that_make_absurdly_many_classes_are_refused(capsys, checkpoint, tmp_path, data):
    # Was: a head of 10^12 outputs was attempted (num_labels = the largest id + 1).
    train = write(data / "train.csv", "text,label\ngood dog,0\nbad cat,999999999999\n")
    refused(capsys, checkpoint, tmp_path, train,
            f"{train}: line 3: column 'label': label '999999999999' would make 1000000000000 classes (class ids "
            f"count from 0), more than 1048576: the head alone would be num_labels x hidden_size weights",
            data / "dev.csv")


# ----------------------------------------------------------------------------- SQuAD


CONTEXT = "The cat sat on the mat. The dog sat on the log."


def squad_document(qas, version="v2.0"):
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": CONTEXT, "qas": qas}]}]}


def qa(id, answers, **extra):
    return {"id": id, "question": "Where did it sit?", "answers": answers, **extra}


GOOD_QAS = [qa("ok1", [{"text": "the mat", "answer_start": 15}]), qa("ok2", [{"text": "the log", "answer_start": 39}])]


def squad_refused(capsys, checkpoint, tmp_path, document, message, *extra, raw=None):
    """A SQuAD run on a training file holding ``document`` (or the bytes ``raw``) is refused."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    train = data / "train.json"
    train.write_bytes(raw if raw is not None else json.dumps(document).encode())
    dev = data / "dev.json"
    dev.write_text(json.dumps(squad_document(GOOD_QAS)))
    before = snapshot(data, checkpoint)
    out = tmp_path / "out"
    argv = ["--config", "finetune_squad", "--init-checkpoint", str(checkpoint), "--output-dir", str(out),
            "--no-progress", "--set", f"finetune.train_file={train}", "--set", f"finetune.validation_file={dev}",
            "--set", f"data.max_sequence_length={S}", "--set", "finetune.doc_stride=8",
            "--set", "finetune.max_query_length=16", "--set", "train.num_threads=1", *extra]
    code, line = main_error(capsys, argv)
    assert (code, line) == (2, "error: " + message.replace("{train}", str(train)))
    assert_unchanged(before, data, checkpoint)
    no_output(out)


@pytest.mark.parametrize("start, message", [
    (-5, "{train}: question 'q': answer_start -5 is negative (answer 'the log'); it is the answer's character offset "
         "in the context, from 0"),
    (400, "{train}: question 'q': answer_start 400 is past the end of its 47-character context (answer 'the log')"),
    (10, "{train}: question 'q': answer_start 10 does not point at its answer 'the log', which occurs 29 characters "
         "away (at 39); a start at most 8 characters off is moved to the text, one further off is refused: fix "
         "answer_start"),
], ids=["negative", "past-the-end", "far-off"])
def test_an_answer_start_off_its_text_is_refused(capsys, checkpoint, tmp_path, start, message):
    # Was: silently moved to the nearest occurrence (a negative start even slicing from the end).
    document = squad_document(GOOD_QAS + [qa("q", [{"text": "the log", "answer_start": start}])])
    squad_refused(capsys, checkpoint, tmp_path, document, message)


def test_an_answer_start_a_few_characters_off_is_moved_and_counted(tmp_path, capsys):
    from bert_packed.tasks.squad.data import Moved, read_squad

    document = squad_document([qa("a", [{"text": "the mat", "answer_start": 13}]),
                               qa("b", [{"text": "the log", "answer_start": 39}]),
                               qa("c", [{"text": "the log", "answer_start": 44}])])
    path = tmp_path / "train.json"
    path.write_text(json.dumps(document))
    examples = read_squad(str(path))
    assert [ex.answers for ex in examples] == [[("the mat", 15)], [("the log", 39)], [("the log", 39)]]
    assert capsys.readouterr().err.strip() == (
        f"note: {path}: moved 2 answer_start(s) to their answer text, at most 8 characters away (first: question "
        f"'a', 13 -> 15)")
    moved = Moved()
    assert read_squad(str(path), notes=False, moved=moved) == examples
    assert capsys.readouterr().err == "" and (moved.count, moved.first) == (2, ("a", 13, 15))


@pytest.mark.parametrize("question, message", [
    (qa("q", [{"text": "the log", "answer_start": 39}], is_impossible=True),
     "{train}: question 'q': is_impossible is true but it has 1 answer(s) (first 'the log'); an unanswerable question "
     "has answers [] (SQuAD v2.0 keeps the others as plausible_answers)"),
    (qa("q", [], is_impossible=False),
     "{train}: question 'q': is_impossible is false but it has no answers; give its answers, or set is_impossible to "
     "true"),
    (qa("q", [{"text": "the log", "answer_start": 39}], is_impossible="false"),
     "{train}: question 'q': is_impossible must be true or false, got 'false'"),
    ({"id": "q", "question": "Where?"}, "{train}: question 'q' has no 'answers' field"),
    (qa("q", [{"text": "", "answer_start": 0}]), "{train}: question 'q' has an answer without text (answer text '')"),
    (qa("q", [{"text": "the log", "answer_start": "39"}]),
     "{train}: question 'q': answer_start must be an integer, got '39' (answer 'the log')"),
], ids=["impossible-with-answers", "possible-without-answers", "string-flag", "no-answers", "empty-text",
        "string-start"])
def test_contradictory_or_malformed_questions_are_refused(capsys, checkpoint, tmp_path, question, message):
    squad_refused(capsys, checkpoint, tmp_path, squad_document(GOOD_QAS + [question]), message)


def test_a_v1_document_with_an_unanswerable_question_is_refused(capsys, checkpoint, tmp_path):
    squad_refused(capsys, checkpoint, tmp_path, squad_document(GOOD_QAS + [qa("q", [])], version="1.1"),
                  "{train}: question 'q' is unanswerable (no answers) but the document's version is '1.1'; SQuAD v1.x "
                  "has no unanswerable questions: give its answers, or mark the file v2.0")


def test_answer_texts_and_starts_that_do_not_pair_up_are_refused(capsys, checkpoint, tmp_path):
    row = {"id": "q", "context": CONTEXT, "question": "Where?", "answers": {"text": ["the mat", "the log"],
                                                                             "answer_start": [15]}}
    squad_refused(capsys, checkpoint, tmp_path, None, "{train}: question 'q': answers.text has 2 entries but "
                  "answers.answer_start has 1; they pair up, one start per text", raw=(json.dumps(row) + "\n").encode())


def test_a_squad_row_without_answers_is_refused(capsys, checkpoint, tmp_path):
    rows = [{"id": "a", "context": CONTEXT, "question": "Where?", "answers": {"text": ["the mat"], "answer_start": [15]}},
            {"id": "b", "context": CONTEXT, "question": "Where?", "answer": {"text": ["the log"], "answer_start": [39]}}]
    squad_refused(capsys, checkpoint, tmp_path, None, "{train}: line 2 (question 'b') has no 'answers' field",
                  raw="".join(json.dumps(r) + "\n" for r in rows).encode())


def test_a_key_twice_in_a_squad_object_is_refused(capsys, checkpoint, tmp_path):
    text = json.dumps(squad_document(GOOD_QAS)).replace('"answer_start": 39}', '"answer_start": 39, '
                                                                                '"answer_start": 3}')
    squad_refused(capsys, checkpoint, tmp_path, None, "{train}: key 'answer_start' occurs twice in one object; which "
                  "value is meant is ambiguous: keep one", raw=text.encode())


def test_a_non_utf8_squad_file_is_refused_naming_line_and_byte(capsys, checkpoint, tmp_path):
    text = json.dumps(squad_document(GOOD_QAS), indent=1).replace("The dog", "The d\xf6g")
    raw = text.encode("latin-1")
    offset = raw.index(b"\xf6")
    line = raw[:offset].count(b"\n") + 1
    column = offset - raw.rfind(b"\n", 0, offset)
    squad_refused(capsys, checkpoint, tmp_path, None, f"{{train}}: line {line}: not UTF-8 (byte 0xf6 at byte offset "
                  f"{offset}, column {column}); save the file as UTF-8, e.g. iconv -f <encoding> -t utf-8", raw=raw)


def test_version_2_false_with_unanswerable_training_questions_is_refused():
    from bert_packed.data import DataError
    from bert_packed.tasks.squad.data import SquadExample, squad_version

    answered = SquadExample("a", "q", CONTEXT, [("the mat", 15)])
    unanswerable = SquadExample("b", "q", CONTEXT, [])
    assert squad_version([answered, unanswerable], [answered], None, train_where="t", validation_where="v") is True
    assert squad_version([answered], [answered], None, train_where="t", validation_where="v") is False
    assert squad_version([answered], [answered], True, train_where="t", validation_where="v") is True
    with pytest.raises(DataError) as info:
        squad_version([answered, unanswerable], [answered], False, train_where="train.json", validation_where="v")
    assert str(info.value) == ("train.json: question 'b' is unanswerable (no answers), and 1 in all, but "
                               "finetune.version_2_with_negative is false (SQuAD v1.1); set it to true (or null), or "
                               "remove them")


def test_version_2_false_with_unanswerable_training_questions_is_refused_by_the_run(capsys, checkpoint, tmp_path):
    squad_refused(capsys, checkpoint, tmp_path, squad_document(GOOD_QAS + [qa("q", [])]),
                  "{train}: question 'q' is unanswerable (no answers), and 1 in all, but "
                  "finetune.version_2_with_negative is false (SQuAD v1.1); set it to true (or null), or remove them",
                  "--set", "finetune.version_2_with_negative=false")


# ----------------------------------------------------------------------------- checkpoint import


def edited_checkpoint(source, target, edit_config=None, drop=()):
    """A copy of the checkpoint ``source`` with config.json edited and tensors ``drop``-ped."""
    shutil.copytree(source, target)
    if edit_config is not None:
        path = target / "config.json"
        config = json.loads(path.read_text())
        edit_config(config)
        path.write_text(json.dumps(config))
    if drop:
        from safetensors.torch import load_file, save_file

        state = load_file(str(target / "model.safetensors"))
        for name in [k for k in state if k.startswith(drop)]:
            del state[name]
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def import_refused(capsys, checkpoint, tmp_path, message, edit_config=None, drop=()):
    broken = edited_checkpoint(checkpoint, tmp_path / "broken", edit_config, drop)
    data = tmp_path / "data"
    data.mkdir()
    train = write(data / "train.csv", GOOD)
    before = snapshot(data, broken)
    out = tmp_path / "out"
    code, line = classify(capsys, broken, out, train, train)
    message = message.replace("{config}", str(broken / "config.json")).replace("{ckpt}", str(broken))
    assert (code, line) == (2, "error: " + message)
    assert_unchanged(before, data, broken)
    no_output(out)


def test_a_layer_config_json_names_but_the_weights_lack_is_an_error(capsys, checkpoint, tmp_path):
    # Was: layer 2 trained from random weights, with one info line.
    import_refused(capsys, checkpoint, tmp_path,
                   "{config}: num_hidden_layers is 3 but the weights hold layers 0-1: layer(s) 2 would start from "
                   "random weights; fix num_hidden_layers, or use the weights this config.json belongs to",
                   edit_config=lambda c: c.update(num_hidden_layers=3))


def test_weights_with_more_layers_than_config_json_are_an_error(capsys, checkpoint, tmp_path):
    import_refused(capsys, checkpoint, tmp_path,
                   "{config}: num_hidden_layers is 1 but the weights hold layers 0-1: layer(s) 1 would be dropped; "
                   "fix num_hidden_layers, or use the weights this config.json belongs to",
                   edit_config=lambda c: c.update(num_hidden_layers=1))


def test_weights_lacking_part_of_a_layer_are_an_error(capsys, checkpoint, tmp_path):
    import_refused(capsys, checkpoint, tmp_path,
                   "{config}: the weights lack 10 tensor(s) of the BERT it describes (first: "
                   "encoder.layer.1.attention.self.query.weight); they would start from random weights: use the "
                   "weights this config.json belongs to", drop=("bert.encoder.layer.1.attention.",))


def test_weights_lacking_the_embeddings_are_an_error(capsys, checkpoint, tmp_path):
    import_refused(capsys, checkpoint, tmp_path,
                   "{config}: the weights lack 3 tensor(s) of the BERT it describes (first: "
                   "embeddings.word_embeddings.weight); they would start from random weights: use the weights this "
                   "config.json belongs to", drop=("bert.embeddings.word_", "bert.embeddings.LayerNorm"))


def test_load_weights_refuses_a_missing_body_tensor_and_allows_a_new_head(checkpoint):
    # The backstop for what read_pretrained does not see (our own checkpoints, state dicts from code).
    from bert_packed.io import hf_io
    from bert_packed.tasks.classification.model import BertForSequenceClassification
    from bert_packed.model.modeling import BertConfig

    pretrained = hf_io.read_pretrained(str(checkpoint))
    model = BertForSequenceClassification(BertConfig.from_hf(pretrained.hf_config, num_labels=3))
    summary = hf_io.load_weights(model, pretrained.state_dict, source="ckpt")
    assert summary.startswith("init checkpoint ckpt: loaded ") and "newly initialised: classifier.bias, " \
        "classifier.weight; not used: cls.predictions.* (5), cls.seq_relationship.* (2)" in summary, summary
    state = {k: v for k, v in pretrained.state_dict.items() if "layer.1.output.dense" not in k}
    with pytest.raises(hf_io.CheckpointError) as info:
        hf_io.load_weights(model, state, source="ckpt")
    assert str(info.value) == ("ckpt: the weights lack bert.encoder.* (2), which the model needs (only a task head "
                               "may start fresh); the checkpoint's config.json does not match its weights")


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", "32", 'hidden_size must be a positive integer, got "32" (a string)'),
    ("num_hidden_layers", 2.5, "num_hidden_layers must be a positive integer, got 2.5 (a number)"),
    ("vocab_size", None, "vocab_size must be a positive integer, got null (null)"),
    ("num_attention_heads", True, "num_attention_heads must be a positive integer, got true (a boolean)"),
    ("intermediate_size", 0, "intermediate_size must be a positive integer, got 0 (an integer)"),
    ("hidden_dropout_prob", "0.1", 'hidden_dropout_prob must be a number in [0, 1), got "0.1" (a string)'),
    ("layer_norm_eps", -1e-12, "layer_norm_eps must be a positive number, got -1e-12 (a number)"),
    ("tie_word_embeddings", "true", 'tie_word_embeddings must be true or false, got "true" (a string)'),
    ("hidden_act", 7, 'hidden_act must be the name of an activation (e.g. "gelu"), got 7 (an integer)'),
    ("problem_type", "classification", "problem_type must be null or one of single_label_classification, "
                                       'multi_label_classification, regression, got "classification" (a string)'),
    ("id2label", {"neg": 0, "pos": 1}, "id2label must map class ids to names, but it has the key 'neg' (keyed by "
                                       'names, like label2id?): write {"0": "neg", ...}'),
    ("id2label", ["neg", "pos"], 'id2label must map class ids to names (e.g. {"0": "neg", "1": "pos"}), got a list'),
    ("id2label", {"0": "neg", "2": "pos"}, "id2label's class ids must be 0..1, got 0, 2"),
    ("id2label", {"0": "pos", "1": "pos"}, "id2label names 'pos' twice (ids 0 and 1); which class a prediction of "
                                           "'pos' means is ambiguous"),
    ("id2label", {"0": 1, "1": 0}, 'id2label["0"] must be a label name (a string), got 1'),
], ids=lambda v: str(v)[:20])
def test_wrongly_typed_config_fields_are_one_line_errors(capsys, checkpoint, tmp_path, field, value, expected):
    # Were tracebacks (or a string hidden_size reaching the model).
    import_refused(capsys, checkpoint, tmp_path, "{config}: " + expected, edit_config=lambda c: c.update({field: value}))


# ----------------------------------------------------------------------------- predict / export outputs


@pytest.fixture(scope="module")
def finished(tmp_path_factory, checkpoint):
    """A finished one-step classification run (checkpoint.pt, metrics.jsonl, hf/), and a CSV to predict."""
    import run

    root = tmp_path_factory.mktemp("finished")
    train = write(root / "train.csv", GOOD)
    out = root / "run"
    assert run.main(["--config", "finetune_classification", "--init-checkpoint", str(checkpoint), "--output-dir",
                     str(out), "--no-progress", "--set", f"data.max_sequence_length={S}", "--set",
                     f"finetune.train_file={train}", "--set", f"finetune.validation_file={train}", "--steps", "1",
                     "--set", "train.checkpoint_every=1", "--set", "train.num_threads=1"]) == 0
    return root, out


def cli_refused(capsys, argv, message, *roots):
    before = snapshot(*roots)
    code, line = main_error(capsys, [str(a) for a in argv], entry=finetune_main)
    assert (code, line) == (2, f"error: {message}")
    assert_unchanged(before, *roots)


def test_predict_refuses_to_overwrite_its_input(capsys, finished, checkpoint):
    root, out = finished
    data = root / "train.csv"
    cli_refused(capsys, ["predict", "--model", out / "hf", "--input", data, "--output", data],
                f"--output {data} is the --input file {data}; writing it would destroy the input: choose another "
                f"output path", root, checkpoint)


def test_predict_refuses_its_input_under_another_name(capsys, finished, tmp_path, checkpoint):
    root, out = finished
    alias = tmp_path / "alias.csv"
    os.symlink(root / "train.csv", alias)
    cli_refused(capsys, ["predict", "--model", out / "hf", "--input", root / "train.csv", "--output", alias],
                f"--output {alias} is the --input file {root / 'train.csv'}; writing it would destroy the input: "
                f"choose another output path", root, checkpoint, tmp_path)


def test_predict_refuses_to_write_into_the_model_directory(capsys, finished, tmp_path, checkpoint):
    root, out = finished
    target = out / "hf" / "config.json"
    cli_refused(capsys, ["predict", "--model", out / "hf", "--input", root / "train.csv", "--output", target],
                f"--output {target} is inside the --model directory {out / 'hf'}; writing there would change that "
                f"input: choose a path outside it", root, checkpoint)


def test_predict_refuses_to_write_into_a_run_directory(capsys, finished, tmp_path, checkpoint):
    root, out = finished
    model = tmp_path / "model"
    shutil.copytree(out / "hf", model)
    target = out / "predictions.jsonl"  # the run's own predictions
    cli_refused(capsys, ["predict", "--model", model, "--input", root / "train.csv", "--output", target],
                f"--output {target} is inside the run directory {out} (it holds checkpoint.pt, metrics.jsonl); a "
                f"run's directory is for that run's own outputs: choose a path outside it", root, checkpoint, tmp_path)


def test_predict_refuses_an_output_that_is_a_directory(capsys, finished, tmp_path, checkpoint):
    root, out = finished
    (tmp_path / "folder").mkdir()
    cli_refused(capsys, ["predict", "--model", out / "hf", "--input", root / "train.csv", "--output",
                         tmp_path / "folder"],
                f"--output {tmp_path / 'folder'} is a directory; give the path of a file to write", root, checkpoint,
                tmp_path)


def test_predict_refuses_a_model_with_ambiguous_labels(capsys, finished, tmp_path, checkpoint):
    root, out = finished
    model = edited_checkpoint(out / "hf", tmp_path / "model",
                              lambda c: c.update(id2label={"0": "neg", "1": "neg"}, label2id={"neg": 1}))
    cli_refused(capsys, ["predict", "--model", model, "--input", root / "train.csv", "--output", tmp_path / "p.jsonl"],
                f"{model / 'config.json'}: id2label names 'neg' twice (ids 0 and 1); which class a prediction of "
                f"'neg' means is ambiguous", root, checkpoint, tmp_path)
    assert not (tmp_path / "p.jsonl").exists()


def test_predict_refuses_a_token_classification_model(capsys, finished, tmp_path, checkpoint):
    # It has id2label too: predict loaded it and classified through a randomly initialised pooler.
    root, out = finished
    model = tmp_path / "ner"
    save_hf_checkpoint(transformers, str(model), str(checkpoint.parent / "vocab" / "vocab.txt"), "BertForTokenClassification",
                       num_labels=3, id2label={0: "O", 1: "B-PER", 2: "I-PER"}, label2id={"O": 0, "B-PER": 1, "I-PER": 2})
    capsys.readouterr()  # transformers' progress bar
    cli_refused(capsys, ["predict", "--model", model, "--input", root / "train.csv", "--output", tmp_path / "p.jsonl"],
                f"{model}: config.json's architectures is BertForTokenClassification (token classification); predict "
                f"classifies sequences and needs a sequence-classification model (BertForSequenceClassification)",
                root, checkpoint, model)
    assert not (tmp_path / "p.jsonl").exists()
    # Without architectures in config.json the weights tell: no pooler.
    bare = edited_checkpoint(model, tmp_path / "bare", lambda c: c.pop("architectures"))
    cli_refused(capsys, ["predict", "--model", bare, "--input", root / "train.csv", "--output", tmp_path / "p.jsonl"],
                f"{bare}: not a trained sequence-classification model: newly initialised: bert.pooler.* (2) (predict "
                f"would classify through random weights); give a model fine-tuned for sequence classification (a "
                f"run's OUT/hf)", root, checkpoint, bare)
    assert not (tmp_path / "p.jsonl").exists()


def test_predict_refuses_a_label_count_the_classifier_does_not_have(capsys, finished, tmp_path, checkpoint):
    root, out = finished
    model = edited_checkpoint(out / "hf", tmp_path / "model", lambda c: c.update(
        id2label={"0": "neg", "1": "pos", "2": "meh"}, label2id={"neg": 0, "pos": 1, "meh": 2}))
    cli_refused(capsys, ["predict", "--model", model, "--input", root / "train.csv", "--output", tmp_path / "p.jsonl"],
                f"{model}: config.json's id2label names 3 labels but the classifier has 2 outputs; the config does not "
                f"belong to these weights", root, checkpoint, model)
    assert not (tmp_path / "p.jsonl").exists()


def test_predict_refuses_a_tokenizer_larger_than_the_vocabulary(capsys, finished, tmp_path, checkpoint):
    # Was: accepted; the first text with an id past the vocabulary ended in an IndexError traceback.
    root, out = finished
    model = edited_checkpoint(out / "hf", tmp_path / "model")
    (model / "tokenizer.json").unlink()
    words = (checkpoint.parent / "vocab" / "vocab.txt").read_text().split()
    (model / "vocab.txt").write_text("\n".join(words + [f"extra{i}" for i in range(10)]) + "\n")
    cli_refused(capsys, ["predict", "--model", model, "--input", root / "train.csv", "--output", tmp_path / "p.jsonl"],
                f"{model}: the tokenizer has {len(words) + 10:,} tokens but the model's vocabulary (vocab_size) has "
                f"{len(words):,}; the tokenizer does not belong to this model", root, checkpoint, model)
    assert not (tmp_path / "p.jsonl").exists()


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary(capsys, finished, checkpoint, tmp_path):
    root, out = finished
    words = (checkpoint.parent / "vocab" / "vocab.txt").read_text().split()
    big = tmp_path / "big" / "vocab.txt"
    big.parent.mkdir()
    big.write_text("\n".join(words + [f"extra{i}" for i in range(10)]) + "\n")
    cli_refused(capsys, ["export", out, "--output", tmp_path / "export", "--tokenizer", big],
                f"the tokenizer has {len(words) + 10:,} tokens but the model's vocabulary (vocab_size) has "
                f"{len(words):,}; an export with it would index past the word embeddings: ship the tokenizer the "
                f"model was trained with", root, checkpoint, big)
    assert not (tmp_path / "export").exists()


class _Payload:
    """What a malicious pickle holds: unpickling it calls a function (here: writes a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_runs_code_is_refused_in_one_line_and_never_run(capsys, finished, checkpoint, tmp_path):
    # Was: torch's multi-line advice to load with weights_only=False (pytorch_model.bin), and a
    # checkpoint.pt was unpickled with weights_only=False: its code ran (a checksum trailer is
    # no proof of who wrote the file).
    import torch

    from bert_packed.io.checkpoint import save_checkpoint

    root, out = finished
    marker = tmp_path / "ran"
    model = edited_checkpoint(out / "hf", tmp_path / "model")
    (model / "model.safetensors").unlink()
    torch.save({"bert.embeddings.word_embeddings.weight": _Payload(str(marker))}, model / "pytorch_model.bin")
    cli_refused(capsys, ["predict", "--model", model, "--input", root / "train.csv", "--output", tmp_path / "p.jsonl"],
                f"{model / 'pytorch_model.bin'}: not loaded: it holds Python objects beyond tensors and plain data "
                f"(io.open), and unpickling them could run any code; use a checkpoint this project wrote or "
                f"weights in safetensors from a source you trust", root, checkpoint, model)
    bad_run = tmp_path / "bad_run"
    bad_run.mkdir()
    save_checkpoint(str(bad_run / "checkpoint.pt"), {"model": _Payload(str(marker)), "config": {}})
    cli_refused(capsys, ["export", bad_run, "--output", tmp_path / "export"],
                f"{bad_run / 'checkpoint.pt'}: not loaded: it holds Python objects beyond tensors and plain data "
                f"(io.open), and unpickling them could run any code; use a checkpoint this project wrote or "
                f"weights in safetensors from a source you trust", root, checkpoint, bad_run)
    assert not marker.exists() and not (tmp_path / "p.jsonl").exists() and not (tmp_path / "export").exists()


@pytest.mark.parametrize("where", ["run", "run/hf", "checkpoint"])
def test_export_refuses_the_run_directory_and_the_checkpoint(capsys, finished, checkpoint, where):
    root, out = finished
    target = {"run": out, "run/hf": out / "hf", "checkpoint": out / "checkpoint.pt"}[where]
    message = (f"--output {target} is the checkpoint {out / 'checkpoint.pt'}; writing it would destroy the input: "
               f"choose another output path" if where == "checkpoint" else
               f"--output {target} is inside the run directory {out} (it holds checkpoint.pt, metrics.jsonl); a "
               f"run's directory is for that run's own outputs: choose a path outside it")
    cli_refused(capsys, ["export", out, "--output", target], message, root, checkpoint)


def test_export_refuses_the_checkpoint_it_started_from_and_its_tokenizer(capsys, finished, checkpoint, tmp_path):
    root, out = finished
    cli_refused(capsys, ["export", out, "--output", checkpoint],
                f"--output {checkpoint} is inside the init checkpoint (model.init_checkpoint) {checkpoint}; writing "
                f"there would change that input: choose a path outside it", root, checkpoint)
    tokenizer = tmp_path / "tok"
    shutil.copytree(checkpoint, tokenizer)
    cli_refused(capsys, ["export", out, "--output", tokenizer, "--tokenizer", tokenizer],
                f"--output {tokenizer} is inside the --tokenizer {tokenizer}; writing there would change that input: "
                f"choose a path outside it", root, checkpoint, tmp_path)


def test_export_and_predict_still_write_outside_inputs(capsys, finished, checkpoint, tmp_path):
    root, out = finished
    before = snapshot(root, checkpoint)
    assert finetune_main(["export", str(out), "--output", str(tmp_path / "export")]) == 0
    assert finetune_main(["predict", "--model", str(tmp_path / "export"), "--input", str(root / "train.csv"),
                          "--output", str(tmp_path / "p.jsonl"), "--max-sequence-length", str(S)]) == 0
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 4
    assert_unchanged(before, root, checkpoint)


def test_epochs_that_come_to_more_steps_than_the_maximum_are_refused():
    # finetune.epochs is within its own maximum, but over the data it comes to more optimizer
    # steps than train.steps may be: refused when the steps are derived, naming both.
    import types

    from bert_packed.config import ConfigError, load_config
    from bert_packed.tasks.classification.task import ClassificationTask

    task = ClassificationTask(load_config("finetune_classification", ["finetune.epochs=1000000"]))
    task.train_data = types.SimpleNamespace(num_packs=5000)
    with pytest.raises(ConfigError) as error:
        task.num_steps(4)
    assert str(error.value) == (
        "finetune.epochs=1e+06 over 5000 training packs, 4 per step, come to 1250000000 optimizer steps, more than "
        "train.steps' maximum 1000000000 (more optimizer steps than any run takes; BERT-Large pre-training takes "
        "10^4 to 10^6); lower finetune.epochs")
    assert task.num_steps(5000) == 1000000  # within the maximum: the derived steps


# ----------------------------------------------------------------------------- data smaller than one step (issue 38)

def test_epochs_over_data_smaller_than_one_step_are_refused(capsys, checkpoint, tmp_path):
    """4 rows make 1 pack, a step is 4: "3 epochs" would train the pack 4 times per update. Was
    a silent "1 steps" run; now one line naming the numbers and the fix, nothing written."""
    import run

    (tmp_path / "data").mkdir()
    train = write(tmp_path / "data" / "train.csv", GOOD)
    before = snapshot(tmp_path / "data", checkpoint)
    out = tmp_path / "out"
    code = run.main(["--config", "finetune_classification", "--init-checkpoint", str(checkpoint), "--output-dir",
                     str(out), "--no-progress", "--set", f"data.max_sequence_length={S}", "--set",
                     f"finetune.train_file={train}", "--set", f"finetune.validation_file={train}",
                     "--set", "train.num_threads=1"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert (code, errors) == (2, [
        f"error: {train}: 4 training sequences make 1 packs, fewer than the 4 packs of one optimizer step, so "
        f"finetune.epochs=3 cannot be kept; lower train.micro_batch_size=4 or train.gradient_accumulation (or "
        f"train.global_batch_size) to at most 1 packs per step, or give more training data"])
    assert_unchanged(before, tmp_path / "data", checkpoint)
    no_output(out)


def test_steps_over_data_smaller_than_one_step_train_with_a_note(capsys, checkpoint, tmp_path):
    """--steps chooses the passes; the repetition inside each step is said, not silent."""
    import run

    train = write(tmp_path / "train.csv", GOOD)
    assert run.main(["--config", "finetune_classification", "--init-checkpoint", str(checkpoint), "--output-dir",
                     str(tmp_path / "out"), "--no-progress", "--set", f"data.max_sequence_length={S}", "--set",
                     f"finetune.train_file={train}", "--set", f"finetune.validation_file={train}", "--steps", "1",
                     "--set", "train.num_threads=1"]) == 0
    assert (f"note: {train}: 4 training sequences make 1 packs, fewer than the 4 packs of one optimizer step: "
            f"every step repeats them (~4 passes)") in capsys.readouterr().err.splitlines()
