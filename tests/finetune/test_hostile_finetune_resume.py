"""A fine-tuning resume records what it read (issue 37, kind 3).

The checkpoint's data state names the input files (size, SHA-256) and hashes the training
sequences; a resume on changed data is refused in one line (exit 2, nothing changed) unless
``--resume-force``, which starts a new epoch of the new data. With ``--resume-force`` and another
micro-batch size the stream continues at the same pack: nothing skipped or read twice.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from finetune_fixtures import classification_rows, tiny_pretraining_checkpoint, write_rows
from hostile import assert_unchanged, snapshot

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_pretraining_checkpoint(transformers, tmp_path_factory.mktemp("ckpt"))


def argv(checkpoint, out, train, dev, *extra):
    return ["--config", "finetune_classification", "--init-checkpoint", str(checkpoint), "--output-dir", str(out),
            "--no-progress", "--set", "data.max_sequence_length=64", "--set", f"finetune.train_file={train}",
            "--set", f"finetune.validation_file={dev}", "--set", "train.num_threads=1", "--set", "train.steps=2",
            "--set", "train.checkpoint_every=1", "--set", "train.eval_every=0", *extra]


@pytest.fixture
def run_dir(checkpoint, tmp_path, capsys):
    import run

    data = tmp_path / "data"
    data.mkdir()
    train = write_rows(str(data / "train.csv"), classification_rows(40, 1), ["text", "label"])
    dev = write_rows(str(data / "dev.csv"), classification_rows(10, 2), ["text", "label"])
    out = tmp_path / "out"
    assert run.main(argv(checkpoint, out, train, dev)) == 0, capsys.readouterr().err
    capsys.readouterr()
    return data, out, train, dev


def test_a_resume_on_an_edited_training_file_is_refused(capsys, checkpoint, run_dir):
    data, out, train, dev = run_dir
    with open(train, "a") as f:
        f.write("an added row,pos\n")
    size = os.path.getsize(train)
    before = snapshot(data, out, checkpoint)
    code, line = main_error(capsys, argv(checkpoint, out, train, dev, "--set", "train.steps=3", "--resume"))
    assert code == 2
    assert line.startswith(f"error: the fine-tuning data changed since the checkpoint: {train}: ")
    assert line.endswith(f" bytes then, {size:,} now; resume with the data the run started on, or pass "
                         f"--resume-force to continue on this data (from a new epoch)")
    assert_unchanged(before, data, out, checkpoint)


def test_a_resume_on_a_same_size_edit_of_the_validation_file_is_refused(capsys, checkpoint, run_dir):
    data, out, train, dev = run_dir
    text = open(dev, "rb").read()
    first = text.index(b"\n") + 1  # swap two letters of the first row: same size, other content
    edited = text[:first] + text[first + 1:first + 2] + text[first:first + 1] + text[first + 2:]
    assert edited != text and len(edited) == len(text)
    open(dev, "wb").write(edited)
    before = snapshot(data, out, checkpoint)
    code, line = main_error(capsys, argv(checkpoint, out, train, dev, "--set", "train.steps=3", "--resume"))
    assert code == 2
    assert line.startswith(f"error: the fine-tuning data changed since the checkpoint: {dev}: same size, other "
                           f"content: sha256 ")
    assert_unchanged(before, data, out, checkpoint)


def test_resume_force_continues_on_changed_data_and_says_so(capsys, checkpoint, run_dir):
    import run

    data, out, train, dev = run_dir
    with open(train, "a") as f:
        f.write("an added row,pos\n")
    assert run.main(argv(checkpoint, out, train, dev, "--set", "train.steps=3", "--resume-force")) == 0
    err = capsys.readouterr().err
    assert f"note: --resume-force: the fine-tuning data changed since the checkpoint ({train}: " in err


def test_an_unchanged_resume_is_not_refused(capsys, checkpoint, run_dir):
    import run

    data, out, train, dev = run_dir
    os.utime(train)  # touched, not changed
    assert run.main(argv(checkpoint, out, train, dev, "--set", "train.steps=3", "--resume")) == 0, \
        capsys.readouterr().err


def main_error(capsys, args):
    """(exit code, the one error line): the run's setup notes come first (it read the data to compare it)."""
    import run

    code = run.main(args)
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith(("error", "Traceback"))]
    assert len(errors) == 1, errors
    return code, errors[0]


def _dataset(num_rows=60):
    from functools import partial

    from bert_packed.tasks import data as ft_data
    from bert_packed.tasks.classification.data import collate_classification

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 30, num_rows)
    ids = np.zeros((num_rows, 32), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, 50, n)  # id 0 among the tokens: lengths come from the mask
    encoded = ft_data.Encoded(ids, np.zeros_like(ids), lengths, 0)
    collate = partial(collate_classification, max_sequence_length=64, max_sequences_per_pack=4)
    return ft_data.PackedDataset(encoded, {"labels": np.arange(num_rows) % 2}, collate, max_sequence_length=64,
                                 max_sequences_per_pack=4, algorithm="lpfhp", seed=0)


def _packs(source, count):
    """The packs of ``count`` micro-batches of ``source``, as rows of input ids."""
    return [row for _ in range(count) for row in next(source)["input_ids"]]


@pytest.mark.parametrize("old, new", [(4, 3), (3, 5), (5, 1)])
def test_another_micro_batch_size_continues_at_the_same_pack(old, new):
    dataset = _dataset()
    assert 10 < dataset.num_packs < 40  # the streams below cross epochs
    reference = _packs(dataset.source(1), 80)
    first = dataset.source(old)
    served = _packs(first, 7)
    resumed = dataset.source(new)
    resumed.load_state_dict(first.state_dict(), force=True)
    served += _packs(resumed, (60 - len(served)) // new)
    assert len(served) >= 45
    assert all(np.array_equal(a, b) for a, b in zip(served, reference))
    # and once more, from the converted state
    again = dataset.source(old)
    again.load_state_dict(resumed.state_dict(), force=True)
    assert np.array_equal(next(again)["input_ids"][0], reference[len(served)])


def test_resume_force_with_another_micro_batch_size_runs_on(capsys, checkpoint, run_dir):
    # The loop hands the converted position to the stream (unit-tested above); end to end it trains on.
    import json

    import run
    from bert_packed.io.checkpoint import load_checkpoint

    data, out, train, dev = run_dir
    saved = load_checkpoint(str(out / "checkpoint.pt"))["data"][0]
    assert run.main(argv(checkpoint, out, train, dev, "--set", "train.steps=3", "--set", "train.micro_batch_size=3",
                         "--resume-force")) == 0, capsys.readouterr().err
    state = load_checkpoint(str(out / "checkpoint.pt"))["data"][0]
    assert state["micro_batch_size"] == 3 and state["base_global"] == saved["next_global"]
    assert state["base_pack"] == saved["next_global"] * saved["micro_batch_size"]  # the same pack, not 3 * g
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f][-1] == 3
