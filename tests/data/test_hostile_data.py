"""Hostile inputs to the data pipeline (`python -m bert_packed.data`) and to training on HDF5
files: output over input, invalid UTF-8, corrupt and out-of-range HDF5, interrupted writes,
orphaned temporary files, a changed micro-batch on resume. Each case: the exact one-line
message, the exit code, and inputs and previous outputs byte-identical afterwards."""
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from bert_packed.data.__main__ import main as data_main
from bert_packed.data.prepare.create_file import create_pretraining_file
from bert_packed.data.hdf5 import HDF5Source
from bert_packed.data.prepare.pack import pack_file
from bert_packed.data.prepare.vocab import train_vocab
from bert_packed.io.files import _host
from hostile import TINY, assert_unchanged, main_error, snapshot
from test_data_create import synthetic_corpus

UTF8_HINT = "save the file as UTF-8, e.g. iconv -f <encoding> -t utf-8"  # bert_packed.io.files: one message for every reader


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    corpus = synthetic_corpus(folder / "corpus.txt", num_documents=12)
    vocab = folder / "vocab.txt"
    train_vocab(corpus, 200, vocab)
    unpacked = folder / "train.h5"
    create_pretraining_file(corpus, vocab, unpacked, max_seq_length=64, max_predictions=10, dupe_factor=1, seed=1)
    packed = folder / "packed.h5"
    pack_file(unpacked, packed, algorithm="lpfhp", max_sequences_per_pack=3, show_progress=False)
    return folder, corpus, vocab, unpacked, packed


@pytest.fixture
def work(data, tmp_path):
    """A private copy of the data folder (cases damage files)."""
    shutil.copytree(data[0], tmp_path / "data")
    return tmp_path / "data"


def data_error(capsys, *argv):
    return main_error(capsys, [str(a) for a in argv], entry=data_main)


# ----------------------------------------------------------------------------- output over input


def test_pack_refuses_output_equal_to_input(work, capsys):
    before = snapshot(work)
    path = work / "train.h5"
    assert data_error(capsys, "pack", "--input", path, "--output", path) == (
        2, f"error: --output {path} is also an input ({path}); writing it would destroy the input: choose another "
           f"output path")
    assert_unchanged(before, work)


def test_pack_refuses_output_that_is_the_input_under_another_name(work, capsys):
    os.symlink(work / "train.h5", work / "alias.h5")
    before = snapshot(work)
    code, line = data_error(capsys, "pack", "--input", work / "train.h5", "--output", work / "alias.h5")
    assert code == 2 and line.startswith(f"error: --output {work / 'alias.h5'} is also an input"), line
    assert_unchanged(before, work)


@pytest.mark.parametrize("which", ["corpus", "vocab"])
def test_create_refuses_output_equal_to_an_input(work, capsys, which):
    before = snapshot(work)
    target = work / ("corpus.txt" if which == "corpus" else "vocab.txt")
    code, line = data_error(capsys, "create", "--input", work / "corpus.txt", "--vocab", work / "vocab.txt",
                            "--output", target)
    assert (code, line) == (2, f"error: --output {target} is also an input ({target}); writing it would destroy "
                               f"the input: choose another output path")
    assert_unchanged(before, work)


def test_vocab_refuses_output_equal_to_input(work, capsys):
    before = snapshot(work)
    path = work / "corpus.txt"
    code, line = data_error(capsys, "vocab", "--input", path, "--size", 100, "--output", path)
    assert (code, line) == (2, f"error: --output {path} is also an input ({path}); writing it would destroy the "
                               f"input: choose another output path")
    assert_unchanged(before, work)


@pytest.mark.parametrize("name", ["packed.h5", "alias.h5"])
def test_stats_refuses_a_plot_over_the_file_it_reads(work, capsys, name):
    # `stats FILE --plot FILE` replaced the HDF5 file with a PNG and exited 0 (issue 37).
    if name == "alias.h5":
        os.symlink(work / "packed.h5", work / name)
    before = snapshot(work)
    code, line = data_error(capsys, "stats", work / "packed.h5", "--plot", work / name)
    assert (code, line) == (2, f"error: --plot {work / name} is also an input ({work / 'packed.h5'}); writing it "
                               f"would destroy the input: choose another output path")
    assert_unchanged(before, work)


# ----------------------------------------------------------------------------- invalid UTF-8: one policy


@pytest.mark.parametrize("command", ["vocab", "create"])
def test_invalid_utf8_is_refused_the_same_way_by_vocab_and_create(work, capsys, command):
    bad = work / "bad.txt"
    content = b"good line one .\nstill good .\nab\xffcd is not utf-8 .\n"
    bad.write_bytes(content)
    offset = content.index(b"\xff")
    before = snapshot(work)
    args = (["vocab", "--input", bad, "--size", 100, "--output", work / "vocab.txt"] if command == "vocab" else
            ["create", "--input", bad, "--vocab", work / "vocab.txt", "--output", work / "train.h5"])
    assert data_error(capsys, *args) == (
        2, f"error: {bad}: line 3: not UTF-8 (byte 0xff at byte offset {offset}, column 3); {UTF8_HINT}")
    assert_unchanged(before, work)  # the previous vocab.txt / train.h5 survive


# ----------------------------------------------------------------------------- corrupt HDF5


def _corrupt_a_chunk(path, name="input_mask"):
    """Overwrite bytes in the middle of one stored (compressed) chunk of ``name``."""
    with h5py.File(path, "r") as handle:
        dataset = handle[name]
        info = dataset.id.get_chunk_info(dataset.id.get_num_chunks() // 2)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + info.size // 3)
        f.write(b"\x00\xff" * 16)


@pytest.mark.parametrize("command", ["pack", "stats", "train"])
def test_corrupt_hdf5_mid_file_is_a_clean_error(work, tmp_path, capsys, command):
    path = work / "train.h5"
    _corrupt_a_chunk(path)
    before = snapshot(work)
    if command == "pack":
        code, line = data_error(capsys, "pack", "--input", path, "--output", work / "packed.h5", "--no-progress")
    elif command == "stats":
        code, line = data_error(capsys, "stats", path, "--no-plot")
    else:
        code, line = main_error(capsys, TINY + ["--steps", "1", "--set", f"data.path={path}",
                                                "--output-dir", str(tmp_path / "run")])
    assert code == 2 and line.startswith(f"error: {path}: the file is corrupt or truncated and cannot be read ("), line
    assert line.endswith("); re-create it")
    assert_unchanged(before, work)


def test_truncated_hdf5_is_a_clean_error(work, capsys):
    path = work / "train.h5"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    before = snapshot(work)
    code, line = data_error(capsys, "stats", path, "--no-plot")
    assert code == 2 and line.startswith(f"error: {path}: "), line
    assert_unchanged(before, work)


# ----------------------------------------------------------------------------- range checks when data is opened

UNPACKED_DAMAGE = [
    ("input_ids", (5, 3), 5000, "input_ids of row 5: value 5000 is outside the vocabulary [0, 256) (model.vocab_size): "
                                "the data's vocabulary is larger than the model's"),
    ("segment_ids", (7, 1), 2, "segment_ids of row 7: value 2 is outside [0, 2) (model.type_vocab_size)"),
    ("next_sentence_labels", (9,), 3, "next_sentence_labels of row 9: value 3 is not 0 or 1"),
    ("masked_lm_positions", (None, 0), 63, "masked_lm_positions of row {row}: value 63 is not a position inside its sequence "
                                        "(0 .. length - 1)"),
    ("masked_lm_ids", (6, 0), 300, "masked_lm_ids of row 6: value 300 is outside the vocabulary [0, 256) "
                                   "(model.vocab_size)"),
]


@pytest.mark.parametrize("field, where, value, message", UNPACKED_DAMAGE, ids=[d[0] for d in UNPACKED_DAMAGE])
def test_out_of_range_unpacked_data_names_file_field_row_and_value(work, tmp_path, capsys, field, where, value, message):
    path = work / "train.h5"
    with h5py.File(path, "r+") as handle:
        dataset = handle[field]
        if field == "masked_lm_positions":  # a used slot pointing past its sequence's end: a row shorter than 63
            row = int(np.flatnonzero(handle["input_mask"][...].sum(axis=1) < 63)[0])
            where, message = (row, 0), message.format(row=row)
        data = dataset[...]
        data[where] = value
        dataset[...] = data
    before = snapshot(work)
    code, line = main_error(capsys, TINY + ["--steps", "1", "--set", f"data.path={path}",
                                            "--output-dir", str(tmp_path / "run")])
    assert (code, line) == (2, f"error: {path}: {message}")
    assert_unchanged(before, work)


PACKED_DAMAGE = [
    ("input_ids", 1000, "input_ids of pack 3: value 1000 is outside [0, 256) (model.vocab_size: the data's "
                        "vocabulary is larger than the model's)"),
    ("position_ids", 64, "position_ids of pack 3: value 64 is outside [0, 64) (tokens per pack)"),
    ("nsp_labels", 2, "nsp_labels of pack 3: value 2 is outside [0, 2) (next-sentence label: 0 or 1)"),
]


@pytest.mark.parametrize("field, value, message", PACKED_DAMAGE, ids=[d[0] for d in PACKED_DAMAGE])
def test_out_of_range_packed_data_names_file_field_row_and_value(work, tmp_path, capsys, field, value, message):
    path = work / "packed.h5"
    with h5py.File(path, "r+") as handle:
        data = handle[field][...]
        data[3, 0] = value
        handle[field][...] = data
    before = snapshot(work)
    code, line = main_error(capsys, TINY + ["--steps", "1", "--set", f"data.path={path}",
                                            "--output-dir", str(tmp_path / "run")])
    assert (code, line) == (2, f"error: {path}: {message}")
    assert_unchanged(before, work)


@pytest.mark.parametrize("which", ["unpacked", "packed"])
def test_data_made_with_a_larger_vocabulary_than_the_model_says_so(data, tmp_path, capsys, which):
    folder, _, _, unpacked, packed = data
    before = snapshot(folder)
    source = unpacked if which == "unpacked" else packed
    with h5py.File(unpacked, "r") as handle:
        made_with = int(handle.attrs["vocab_size"])
    code, line = main_error(capsys, TINY + ["--steps", "1", "--set", f"data.path={source}", "--set",
                                            f"model.vocab_size={made_with - 1}", "--output-dir", str(tmp_path / "run")])
    assert (code, line) == (2, f"error: {source}: the data's vocabulary ({made_with} tokens) is larger than the "
                               f"model's (model.vocab_size={made_with - 1}); set model.vocab_size={made_with}")
    assert_unchanged(before, folder)


# ----------------------------------------------------------------------------- OSError, Ctrl-C, orphans


def test_output_below_a_file_is_one_line(work, capsys):
    before = snapshot(work)
    target = work / "corpus.txt" / "packed.h5"
    code, line = data_error(capsys, "pack", "--input", work / "train.h5", "--output", target, "--no-progress")
    assert (code, line) == (2, f"error: {work / 'corpus.txt'}: is a file, so the folder {work / 'corpus.txt'} cannot "
                               f"be made there")
    assert_unchanged(before, work)


def test_ctrl_c_during_pack_leaves_no_partial_output(work, capsys, monkeypatch):
    import bert_packed.data.prepare.pack as pack

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "_scatter_to_pack_order", interrupted)
    before = snapshot(work)
    assert data_error(capsys, "pack", "--input", work / "train.h5", "--output", work / "packed.h5",
                      "--no-progress") == (130, "interrupted: nothing was written")
    assert_unchanged(before, work)  # previous packed.h5 intact, no .tmp-* left


def test_orphaned_temp_files_of_a_killed_pack_are_removed_by_the_next(work, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphans = [work / f".tmp-pack-{_host()}.{dead}.x1.bin", work / f".tmp-{_host()}.{dead}.x2packed.h5"]
    for orphan in orphans:
        orphan.write_bytes(b"left by a SIGKILL")
    assert data_main(["pack", "--input", str(work / "train.h5"), "--output", str(work / "packed.h5"),
                      "--no-progress"]) == 0
    capsys.readouterr()
    assert not any(orphan.exists() for orphan in orphans)
    assert not [name for name in os.listdir(work) if name.startswith(".tmp")]


# ----------------------------------------------------------------------------- resume with another micro-batch


@pytest.mark.parametrize("name", ["train.h5", "packed.h5"])
def test_hdf5_resume_with_a_changed_micro_batch_neither_skips_nor_repeats(data, name):
    path = data[0] / name
    dims = dict(max_sequence_length=64, max_sequences_per_pack=3, max_masked_tokens_per_pack=12, seed=3)

    def rows(batch):
        return [row.tobytes() for row in np.concatenate([batch["input_ids"], batch["mlm_labels"]], axis=1)]

    first = HDF5Source(path, micro_batch_size=8, **dims)
    iterator = iter(first)
    seen = [r for _ in range(3) for r in rows(next(iterator))]
    resumed = HDF5Source(path, micro_batch_size=5, **dims)
    resumed.load_state_dict(first.state_dict())
    iterator = iter(resumed)
    while resumed.epoch == 0:
        seen += rows(next(iterator))
    # Epoch 0 served every item at most once, and all but the last partial micro-batch's.
    assert len(seen) == len(set(seen)) and first.num_items - 5 < len(seen) <= first.num_items
    assert resumed.state_dict()["cursor"] == {"base_global": 3, "base_epoch": 0, "base_offset": 24}


SIZE_FLAGS = {  # was: a Rust panic, OverflowError tracebacks, numpy's memory error, hours of work
    "vocab --size": (["vocab", "--input", "{corpus}", "--output", "{out}/vocab.txt", "--size", "99999999999"],
                     "--size must be <= 4194304 (16 times the largest BERT-family vocabulary (about 250000)), got "
                     "99999999999"),
    "vocab --size beyond 64 bits": (["vocab", "--input", "{corpus}", "--output", "{out}/vocab.txt", "--size",
                                     "99999999999999999999999"],
                                    "--size must be <= 4194304 (16 times the largest BERT-family vocabulary (about "
                                    "250000)), got 99999999999999999999999"),
    "vocab --min-frequency": (["vocab", "--input", "{corpus}", "--output", "{out}/vocab.txt", "--size", "100",
                               "--min-frequency", "-3"], "--min-frequency must be >= 0, got -3"),
    "create --max-seq-length": (["create", "--input", "{corpus}", "--vocab", "{vocab}", "--output", "{out}/c.h5",
                                 "--max-seq-length", "9999999999"],
                                "--max-seq-length must be <= 65536 (one head's dense attention scores are 16 GiB at "
                                "65536 tokens; BERT checkpoints hold at most 8192 positions), got 9999999999"),
    "create --max-predictions": (["create", "--input", "{corpus}", "--vocab", "{vocab}", "--output", "{out}/shards",
                                  "--max-predictions", "9999999999"],
                                 "--max-predictions must be <= 65536 (more masked tokens than the longest sequence "
                                 "(65536 tokens) holds), got 9999999999"),
    "create --dupe-factor": (["create", "--input", "{corpus}", "--vocab", "{vocab}", "--output", "{out}/c.h5",
                              "--dupe-factor", "99999999"],
                             "--dupe-factor must be <= 1000 (each pass writes the whole corpus again; BERT used 10), "
                             "got 99999999"),
    "create --seed": (["create", "--input", "{corpus}", "--vocab", "{vocab}", "--output", "{out}/c.h5", "--seed",
                       "99999999999999999999999"],
                      "--seed must be <= 18446744073709551615 (the output file records the seed as an unsigned 64-bit "
                      "integer), got 99999999999999999999999"),
    "pack --max-sequence-length": (["pack", "--input", "{unpacked}", "--output", "{out}/p.h5",
                                    "--max-sequence-length", "0"], "--max-sequence-length must be >= 1, got 0"),
    "pack --max-masked-tokens-per-pack": (["pack", "--input", "{unpacked}", "--output", "{out}/p.h5",
                                           "--max-masked-tokens-per-pack", "99999999"],
                                          "--max-masked-tokens-per-pack must be <= 65536 (more masked tokens than the "
                                          "longest sequence (65536 tokens) holds), got 99999999"),
    "pack --chunk-packs": (["pack", "--input", "{unpacked}", "--output", "{out}/p.h5", "--chunk-packs",
                            "999999999999"],
                           "--chunk-packs must be <= 1048576 (a chunk is built in memory: 2^20 packs of 512 tokens are "
                           "GiBs per field), got 999999999999"),
}


@pytest.mark.parametrize("case", list(SIZE_FLAGS))
def test_every_size_flag_has_a_maximum_with_its_reason(work, tmp_path, capsys, case):
    argv, message = SIZE_FLAGS[case]
    out = tmp_path / "out"
    names = {"corpus": work / "corpus.txt", "vocab": work / "vocab.txt", "unpacked": work / "train.h5", "out": out}
    before = snapshot(work)
    code, line = data_error(capsys, *[a.format(**names) for a in argv])
    assert (code, line) == (2, f"error: {message}")
    assert_unchanged(before, work)
    assert not out.exists()
