"""Fine-tuning data: file reading (CSV, TSV, JSONL, saved Hugging Face datasets), labels, the
packed training stream's contract, and the fortunes corpus."""
from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from bert_packed.data import DataError
from bert_packed.tasks import data as ft_data
from bert_packed.finetune import fortunes
from bert_packed.tasks.classification.data import Labels, collate_classification, infer_problem_type
from finetune_fixtures import classification_rows, write_rows


@pytest.mark.parametrize("ext", [".csv", ".tsv", ".jsonl"])
def test_read_table_reads_every_format(tmp_path, ext):
    rows = classification_rows(5, 0)
    path = write_rows(str(tmp_path / f"data{ext}"), rows, ["text", "pair", "label"])
    table = ft_data.read_table(path, ["text", "label"])
    assert table["text"] == [r["text"] for r in rows] and table["label"] == [r["label"] for r in rows]


def test_read_table_reads_a_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="reading saved datasets needs the datasets package")
    rows = classification_rows(6, 0)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                                   "validation": datasets.Dataset.from_list(rows[4:])})
    splits.save_to_disk(str(tmp_path / "ds"))
    table = ft_data.read_table(str(tmp_path / "ds" / "validation"), ["text", "label"])
    assert table == {"text": [r["text"] for r in rows[4:]], "label": [r["label"] for r in rows[4:]]}
    with pytest.raises(DataError, match="holds the splits train, validation; give one of them"):
        ft_data.read_table(str(tmp_path / "ds"), ["text"])
    with pytest.raises(DataError, match="no column 'sentence'; columns: text, pair, label"):
        ft_data.read_table(str(tmp_path / "ds" / "train"), ["sentence"])


def test_read_table_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match="bad.jsonl: line 2: expected a JSON object per line, got a JSON array"):
        ft_data.read_table(str(tmp_path / "bad.jsonl"), ["text"])
    (tmp_path / "short.jsonl").write_text('{"text": "a", "label": 1}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=r"short.jsonl: line 2: no value in column 'label' \(no such key\)"):
        ft_data.read_table(str(tmp_path / "short.jsonl"), ["text", "label"])
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(DataError, match="unknown file type .txt"):
        ft_data.read_table(str(tmp_path / "x.txt"), ["text"])
    with pytest.raises(DataError, match="file not found"):
        ft_data.read_table(str(tmp_path / "missing.csv"), ["text"])


def test_labels_follow_hugging_face_rules():
    assert infer_problem_type(["a", "b"], None) == "single_label_classification"
    assert infer_problem_type(["0", "2"], None) == "single_label_classification"
    assert infer_problem_type([0.5, "1.25"], None) == "regression"
    assert infer_problem_type([1, 0], 1) == "regression"  # num_labels 1 is regression
    assert infer_problem_type([["a"], []], None) == "multi_label_classification"
    labels = Labels.from_training(["b", "a", "b"], None, None, ",", None, "t")
    assert labels.id2label == {0: "a", 1: "b"} and labels.encode(["b", "a"], ",", "t").tolist() == [1, 0]
    with pytest.raises(DataError, match="row 1: label 'c' is not one of the training labels"):
        labels.encode(["c"], ",", "dev")
    multi = Labels.from_training(["x,y", "", "y"], "multi_label_classification", None, ",", None, "t")
    assert multi.encode(["y,x", ""], ",", "t").tolist() == [[1, 1], [0, 0]]
    regression = Labels.from_training(["0.5", "2"], "regression", None, ",", None, "t")
    assert regression.num_labels == 1 and regression.encode(["1.5"], ",", "t").tolist() == [1.5]
    with pytest.raises(DataError, match="is not 1 number"):
        regression.encode(["high"], ",", "t")
    kept = Labels.from_training(["pos", "neg"], None, None, ",", {0: "pos", 1: "neg", 2: "mixed"}, "t")
    assert kept.id2label == {0: "pos", 1: "neg", 2: "mixed"}  # a fine-tuned checkpoint's label ids stay


def _dataset(n=50, K=4, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 30, n)
    ids = np.zeros((n, 30), np.int32)
    for i, length in enumerate(lengths):
        ids[i, :length] = 10 + i  # every token names its sequence
    encoded = ft_data.Encoded(ids, np.zeros_like(ids), lengths, 0)
    collate = partial(collate_classification, max_sequence_length=64, max_sequences_per_pack=K)
    return ft_data.PackedDataset(encoded, {"labels": np.arange(n) % 3}, collate, max_sequence_length=64,
                                 max_sequences_per_pack=K, algorithm="lpfhp", seed=seed)


def _sequences(batch):
    """Sequence ids (token value - 10) of every present slot of a batch."""
    present = batch["label_weights"] > 0
    return (np.take_along_axis(batch["input_ids"], batch["cls_positions"] + 1, axis=1)[present] - 10).tolist()


def test_training_stream_sees_every_sequence_once_per_epoch_and_shards_and_resumes():
    dataset = _dataset()
    assert dataset.packing_factor > 1.5
    B = 3
    source = dataset.source(B)
    num_micro_batches = -(-2 * dataset.num_packs // B)  # two epochs (the last micro-batch may spill over)
    seen = [_sequences(next(source)) for _ in range(num_micro_batches)]
    flat = [s for batch in seen for s in batch]
    first_epoch = flat[:50]
    assert sorted(first_epoch) == list(range(50))  # each sequence exactly once per epoch
    assert sorted(flat[50:100]) == list(range(50)) and flat[50:100] != first_epoch  # re-drawn per epoch
    # Two ranks together serve the same global stream.
    rank0, rank1 = dataset.source(B, 0, 2), dataset.source(B, 1, 2)
    interleaved = []
    for _ in range(4):
        interleaved += [_sequences(next(rank0)), _sequences(next(rank1))]
    assert interleaved == seen[:8]
    # state_dict resumes at exactly the next micro-batch.
    resumed = dataset.source(B)
    resumed.load_state_dict(json.loads(json.dumps(rank0.state_dict())))  # JSON-able
    state = resumed.state_dict()  # the position, and what was read (issue 37: a changed dataset is refused)
    assert state["next_global"] == 8 and state["num_sequences"] == 50 and state["micro_batch_size"] == B
    assert _sequences(next(resumed)) == seen[8]
    # Evaluation batches: every pack once, fixed order, rows map slots back to sequences.
    rows = np.concatenate([r[r >= 0] for _, r in dataset.batches(B)])
    assert sorted(rows.tolist()) == list(range(50))


@pytest.mark.skipif(not fortunes.fortunes_available(), reason="needs Debian's fortunes and fortunes-min packages "
                    "(apt-get install fortunes fortunes-min)")
def test_fortunes_dataset_is_a_stratified_split(tmp_path):
    counts = fortunes.write_fortunes_dataset(str(tmp_path), categories=("science", "politics"), seed=0)
    assert counts["train"] + counts["validation"] == counts["science"] + counts["politics"] > 1000
    table = ft_data.read_table(str(tmp_path / "validation.csv"), ["text", "label"])
    assert {"science", "politics"} == set(table["label"])
    assert all("\n" not in t and "  " not in t and t for t in table["text"])
    train = ft_data.read_table(str(tmp_path / "train.csv"), ["text"])["text"]
    assert not set(train) & set(table["text"])  # no fortune in both


def test_fortune_file_format(tmp_path):
    (tmp_path / "cat").write_text("one\n  line\n%\n%\ntwo\n%\nthree")
    assert fortunes.read_fortunes(str(tmp_path / "cat")) == ["one line", "two", "three"]
    with pytest.raises(DataError, match="no fortune file"):
        fortunes.fortunes_dataset(str(tmp_path), ["cat", "dog"])


def test_a_saved_dataset_directory_is_recognised_by_its_content(tmp_path):
    """A directory input (a dataset saved with ``save_to_disk``) is recorded by its files' sizes and
    SHA-256: copied elsewhere with new modification times it resumes; the same bytes count with
    other content is refused. A checkpoint that recorded modification times (before checksums)
    still resumes on the same names and sizes."""
    import os
    import shutil

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "data.arrow").write_bytes(b"0123456789" * 10)
    (folder / "state.json").write_text('{"split": "train"}')
    dataset = _dataset()
    saved = dataset.source(3, inputs=[str(folder)]).state_dict()
    assert all(len(f[2]) == 64 for f in saved["inputs"][0]["files"])  # sha256, not a time

    later = tmp_path / "later"
    shutil.copytree(folder, later)  # new modification times
    os.utime(later / "data.arrow", (1, 1))
    shutil.rmtree(folder)
    os.rename(later, folder)
    dataset.source(3, inputs=[str(folder)]).load_state_dict(saved)  # the same content: no refusal

    (folder / "data.arrow").write_bytes(b"9876543210" * 10)  # same size, other bytes
    with pytest.raises(DataError, match=r"ds: its files differ \(names, sizes or content\)"):
        dataset.source(3, inputs=[str(folder)]).load_state_dict(saved)

    legacy = json.loads(json.dumps(saved))
    old_time = 1_700_000_000_000_000_000  # st_mtime_ns, as recorded before checksums
    legacy["inputs"][0]["files"] = [[name, size, old_time] for name, size, _ in saved["inputs"][0]["files"]]
    dataset.source(3, inputs=[str(folder)]).load_state_dict(legacy)  # names and sizes as recorded
    (folder / "state.json").write_text('{"split": "validation"}')
    with pytest.raises(DataError, match="its files differ"):
        dataset.source(3, inputs=[str(folder)]).load_state_dict(legacy)
