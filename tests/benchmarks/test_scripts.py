"""Dry runs (tiny shapes, seconds) of the benchmark scripts that share benchmarks/common.py, imported
as the ``benchmarks`` package; and the helper is what they share."""
import glob
import os
import re

import pytest

from benchmarks.common import ROOT


def test_the_helper_is_shared_and_the_cuda_benchmark_fits_the_size_rule():
    scripts = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
    users = [os.path.basename(p) for p in scripts
             if re.search(r"^from benchmarks\.common import", open(p).read(), re.MULTILINE)]
    assert len(users) >= 5, users
    for name in ("cuda_throughput.py", "cuda_setups.py", "cuda_profile.py"):
        with open(os.path.join(ROOT, "benchmarks", name)) as f:
            assert sum(1 for _ in f) <= 600, name


def test_ipu_mock_cycles_prints_one_row_per_depth(capsys):
    from benchmarks import ipu_mock_cycles

    assert ipu_mock_cycles.main(["--config", "tiny", "--depths", "1", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| K | est. cycles") and [row.split(" | ")[0] for row in table[1:]] == ["| 1", "| 3"]
    per_micro = [int(row.split(" | ")[1].replace(",", "")) for row in table[1:]]
    assert 0 < per_micro[0] < per_micro[1]  # deeper packs: the mask and loss unpacking cost cycles


def test_ipu_mock_cycles_bad_config_is_one_line(capsys):
    from benchmarks import ipu_mock_cycles

    assert ipu_mock_cycles.main(["--config", "tiny", "--set", "model.hidden_size=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_data_task_times_tables_every_phase_of_create(tmp_path, capsys):
    from benchmarks import data_task_times
    from bert_packed.data.vocab import train_vocab
    from test_data_create import synthetic_corpus

    text = synthetic_corpus(tmp_path / "corpus.txt", num_documents=12)
    vocab = tmp_path / "vocab.txt"
    train_vocab(text, 200, vocab)
    status = data_task_times.main(["create", "--input", str(text), "--vocab", str(vocab), "--output",
                                   str(tmp_path / "out"), "--max-seq-length", "64", "--max-predictions", "8",
                                   "--dupe-factor", "1", "--seed", "1", "--workers", "1"])
    assert status in (0, None)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| phase | wall s | tasks")
    assert len(table) >= 2 and all(int(row.split(" | ")[2]) >= 1 for row in table[1:])


@pytest.mark.slow
def test_data_engine_overhead_reports_the_median_of_its_calls(capsys):
    from benchmarks import data_engine_overhead

    assert data_engine_overhead.main(["--tasks", "10", "--workers", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"10 empty tasks on 2 local workers: [\d.]+ s \([\d.]+-[\d.]+ over 2 call\(s\)\)", out), out
