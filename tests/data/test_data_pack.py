"""`pack` and `stats`: nothing dropped or duplicated, reproducible, bounded memory, clear errors."""
import hashlib
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from bert_packed.collate import validate_batch
from bert_packed.data import DataError
from bert_packed.data.prepare.pack import pack_file, packed_digests, unpacked_digests, verify_packed_file
from bert_packed.data.stats import dataset_stats
from bert_packed.data.prepare.synthetic import write_synthetic_unpacked
from helpers import assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "bert_packed.data", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env)




def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    path = tmp_path_factory.mktemp("pack") / "train.h5"
    lengths = write_synthetic_unpacked(path, 3000, max_seq_length=128, max_predictions=20,
                                       vocab_size=1000, seed=3, chunk_rows=700)
    return path, lengths


@pytest.mark.parametrize("algorithm", ["lpfhp", "spfhp"])
def test_pack_keeps_every_sequence_exactly_once(unpacked, tmp_path, algorithm):
    source, lengths = unpacked
    output = tmp_path / "packed.h5"
    # Small chunks and blocks, so the chunk boundaries of both passes are crossed many times.
    stats = pack_file(source, output, algorithm=algorithm, max_sequences_per_pack=3, seed=1,
                      chunk_packs=97, read_rows=211, show_progress=False)
    before, after = unpacked_digests(source), packed_digests(output)
    assert len(before) == len(after) == 3000
    assert before == after
    assert stats["num_sequences"] == 3000 and stats["num_packs"] < 3000
    with h5py.File(output, "r") as handle:
        batch = {name: handle[name][:] for name in handle}
        assert handle.attrs["num_packs"] == len(batch["input_ids"])
        assert handle.attrs["max_sequences_per_pack"] == 3
    validate_batch(batch)
    # Statistics attributes agree with the file's contents.
    real_tokens = int((batch["sequence_ids"] != 0).sum())
    assert real_tokens == lengths.sum() == stats["num_tokens"]
    assert stats["efficiency"] == pytest.approx(real_tokens / batch["input_ids"].size)
    assert stats["packing_factor"] == pytest.approx(batch["nsp_weights"].sum() / len(batch["nsp_weights"]))


def test_digests_notice_a_dropped_or_duplicated_sequence(unpacked, tmp_path):
    source, _ = unpacked
    output = tmp_path / "packed.h5"
    pack_file(source, output, seed=0, show_progress=False)
    tampered = tmp_path / "tampered.h5"
    shutil.copy(output, tampered)
    with h5py.File(tampered, "r+") as handle:
        weights = handle["nsp_weights"][:]
        row = int(np.argmax(weights.sum(axis=1) >= 2))
        weights[row, 1] = 0  # the second sequence of that pack is no longer "present"
        handle["nsp_weights"][...] = weights
    with pytest.raises(DataError, match="differ"):
        verify_packed_file(source, tampered)
    shutil.copy(output, tampered)
    with h5py.File(tampered, "r+") as handle:
        labels = handle["mlm_labels"][:]
        labels[0, 0] += 1  # one label changed
        handle["mlm_labels"][...] = labels
    assert packed_digests(tampered) != unpacked_digests(source)


def test_pack_is_deterministic_for_a_seed(unpacked, tmp_path):
    source, _ = unpacked
    for name, seed in (("a.h5", 5), ("b.h5", 5), ("c.h5", 6)):
        pack_file(source, tmp_path / name, seed=seed, chunk_packs=500, show_progress=False)
    assert sha256(tmp_path / "a.h5") == sha256(tmp_path / "b.h5")
    assert sha256(tmp_path / "a.h5") != sha256(tmp_path / "c.h5")


def test_stats_of_unpacked_and_packed_files(unpacked, tmp_path):
    source, lengths = unpacked
    output = tmp_path / "packed.h5"
    pack_file(source, output, seed=0, show_progress=False)
    before, after = dataset_stats(source), dataset_stats(output)
    np.testing.assert_array_equal(before["length_counts"], np.bincount(lengths, minlength=129)[1:])
    assert after["length_counts"] == before["length_counts"]
    assert before["padding_fraction"] == pytest.approx(1 - lengths.sum() / (3000 * 128))
    assert after["num_sequences"] == 3000 and after["padding_fraction"] < before["padding_fraction"]
    assert sum(after["sequences_per_pack_counts"]) == after["num_rows"]
    plot = tmp_path / "stats.png"
    result = run_cli("stats", output, "--plot", plot)
    assert result.returncode == 0, result.stderr
    assert "packing factor" in result.stdout and plot.stat().st_size > 1000


@pytest.mark.slow
def test_pack_streams_with_bounded_memory_and_shows_progress(tmp_path):
    """100 k sequences (the benchmark does 1 M): peak RSS of the whole process stays small."""
    source = tmp_path / "big.h5"
    write_synthetic_unpacked(source, 100_000, max_seq_length=128, max_predictions=20, seed=0)
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork + exec, so a
    # child of a big pytest process would report its parent's peak.
    code = ("import re, sys\n"
            "from bert_packed.data.__main__ import main\n"
            "status = main(sys.argv[1:])\n"
            "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
            "print('peak_kib', hwm)\n"
            "sys.exit(status)\n")
    result = subprocess.run([sys.executable, "-c", code, "pack", "--input", source, "--output",
                             tmp_path / "big_packed.h5", "--chunk-packs", "4096", "--progress"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    peak_mib = int(result.stdout.split("peak_kib")[1]) / 1024
    assert peak_mib < 700, peak_mib
    assert "pack: write" in result.stderr and "100%" in result.stderr  # tqdm progress
    with h5py.File(tmp_path / "big_packed.h5", "r") as handle:
        assert int(handle["nsp_weights"][:].sum()) == 100_000


# -- bad data: one line, exit status 2 -----------------------------------------------------

def test_missing_and_corrupt_files(tmp_path):
    assert_one_line_error(run_cli("pack", "--input", tmp_path / "nope.h5", "--output",
                                  tmp_path / "out.h5"), "not found")
    corrupt = tmp_path / "corrupt.h5"
    corrupt.write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(4000))
    assert_one_line_error(run_cli("pack", "--input", corrupt, "--output", tmp_path / "out.h5"),
                          "HDF5")
    assert_one_line_error(run_cli("stats", corrupt), "HDF5")
    assert not (tmp_path / "out.h5").exists()


def test_missing_fields(unpacked, tmp_path):
    source, _ = unpacked
    partial = tmp_path / "partial.h5"
    with h5py.File(source, "r") as src, h5py.File(partial, "w") as dst:
        for name in ("input_ids", "input_mask", "segment_ids"):
            dst[name] = src[name][:10]
    assert_one_line_error(run_cli("pack", "--input", partial, "--output", tmp_path / "o.h5"),
                          "masked_lm_positions")
    assert_one_line_error(run_cli("stats", partial), "masked_lm_positions")


def test_sequence_longer_than_the_configured_length(unpacked, tmp_path):
    source, lengths = unpacked
    result = run_cli("pack", "--input", source, "--output", tmp_path / "o.h5",
                     "--max-sequence-length", 64)
    assert_one_line_error(result, "longer than --max-sequence-length 64")
    # Packing into shorter rows works when every sequence fits.
    short = tmp_path / "short.h5"
    write_synthetic_unpacked(short, 200, max_seq_length=48, seed=1)
    with h5py.File(short, "r") as handle, h5py.File(tmp_path / "wide.h5", "w") as wide:
        for name in handle:
            data = handle[name][:]
            if name in ("input_ids", "input_mask", "segment_ids"):
                data = np.pad(data, ((0, 0), (0, 80)))
            wide[name] = data
    stats = pack_file(tmp_path / "wide.h5", tmp_path / "packed48.h5", max_sequence_length=48,
                      show_progress=False)
    assert stats["max_sequence_length"] == 48
    assert unpacked_digests(tmp_path / "wide.h5") == packed_digests(tmp_path / "packed48.h5")


def test_a_depth_beyond_int8_sequence_ids_is_refused(unpacked, tmp_path):
    # Was: written (depth <= 200), a file no run can read (data.max_sequences_per_pack <= 127).
    source, _ = unpacked
    before = sha256(source)
    assert_one_line_error(run_cli("pack", "--input", source, "--output", tmp_path / "o.h5", "--max-sequences-per-pack",
                                  200),
                          "--max-sequences-per-pack must be <= 127 (packed files store sequence ids as int8), got 200")
    assert not (tmp_path / "o.h5").exists() and sha256(source) == before


def test_packing_a_packed_file_is_refused(unpacked, tmp_path):
    source, _ = unpacked
    pack_file(source, tmp_path / "p.h5", show_progress=False)
    assert_one_line_error(run_cli("pack", "--input", tmp_path / "p.h5", "--output",
                                  tmp_path / "pp.h5"), "already packed")
