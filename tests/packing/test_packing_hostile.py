"""Hostile input to ``python -m packing`` (issue 13's packing bullets): every user mistake
exits 2 with exactly one line ``error: ...`` (asserted in full), prints nothing on stdout,
and leaves every input and earlier output byte-identical, with no temporary files."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from packing import Histogram, PackingError, pack
from packing.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, cwd=ROOT):
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "packing", *map(str, args)], capture_output=True, text=True,
                          env=environment, cwd=cwd, timeout=300)


def snapshot(directory):
    """{relative path: sha256} of every file under ``directory``."""
    found = {}
    for parent, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(parent, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def assert_clean_failure(completed, expected_line, before, directory):
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr == expected_line + "\n", completed.stderr
    assert completed.stdout == ""
    assert snapshot(directory) == before  # inputs and earlier outputs untouched, no temporary files


def _json_histogram(tmp_path, payload, name="hist.json"):
    path = tmp_path / name
    path.write_text(json.dumps(payload) if not isinstance(payload, str) else payload)
    return path


# (case id) -> (histogram file payload, extra arguments, the exact error line)
HISTOGRAM_CASES = {
    "token sum overflows int64": (
        {"max_sequence_length": 2, "counts": [2**62, 2**62]}, [],
        "error: histogram has 1.384e+19 tokens, beyond what 64-bit arithmetic holds exactly (2**62); "
        "split the data or check the counts"),
    "count beyond int64": (
        {"max_sequence_length": 2, "counts": [2**70, 1]}, [],
        "error: histogram counts must be at most 2**53, found 1180591620717411303424"),
    "huge float count": (
        '{"max_sequence_length": 2, "counts": [1e30, 1]}', [],
        "error: histogram counts must be at most 2**53, found 1e+30"),
    "fractional max_sequence_length": (
        {"max_sequence_length": 2.5, "counts": [1, 2]}, [],
        "error: max_sequence_length must be a positive integer, got 2.5"),
    "zero max_sequence_length": (
        {"max_sequence_length": 0, "counts": [1]}, [],
        "error: max_sequence_length must be a positive integer, got 0"),
    "negative seed": (
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--seed", "-1"],
        "error: --seed must be a non-negative integer, got -1"),
    "zero --max-sequence-length": (
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--max-sequence-length", "0"],
        "error: --max-sequence-length must be a positive integer, got 0"),
    "fractional --max-sequence-length": (
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--max-sequence-length", "2.5"],
        "error: argument --max-sequence-length: invalid int value: '2.5' (see python -m packing report --help)"),
    "zero time limit": (
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--algorithm", "lp", "--time-limit", "0"],
        "error: --time-limit must be a positive number of seconds, got 0.0"),
    "infinite time limit": (  # refused up front, lp row or not (lp itself refuses inf too)
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--algorithm", "lpfhp", "--time-limit", "inf"],
        "error: --time-limit must be a positive number of seconds, got inf"),
    "absurd --max-sequence-length": (  # was: the histogram's mismatch, after reading it
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--max-sequence-length", "99999999999"],
        "error: --max-sequence-length must be <= 65536 (one head's dense attention scores are 16 GiB at 65536 "
        "tokens; BERT checkpoints hold at most 8192 positions), got 99999999999"),
    "absurd --batch-size": (  # was: ran for hours
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--batch-size", "99999999999999"],
        "error: --batch-size must be <= 1048576 (16 times the largest published BERT batch (65536 sequences)), "
        "got 99999999999999"),
    "absurd --time-limit": (
        {"max_sequence_length": 4, "counts": [1, 2, 3, 4]}, ["--algorithm", "lp", "--time-limit", "1e300"],
        "error: --time-limit must be <= 604800 (a week; lp finds its plan in seconds to minutes), got 1e+300"),
    "nnlshp too large to build": (
        {"max_sequence_length": 8192, "counts": [0] * 8191 + [5]}, ["--algorithm", "nnlshp"],
        "error: nnlshp at max_sequence_length 8192, depth 3 needs a dense 8,192 x 5,596,502 matrix "
        "(341.6 GiB, limit 1.0 GiB); use lp (the same problem, solved exactly with column generation) or lpfhp "
        "instead"),
    "ennlshp too large to build": (
        {"max_sequence_length": 2048, "counts": [0] * 2047 + [5]}, ["--algorithm", "ennlshp"],
        "error: ennlshp at max_sequence_length 2048, depth 3 needs a dense 4,096 x 352,598 matrix "
        "(10.8 GiB, limit 1.0 GiB); use lp (the same problem, solved exactly with column generation) or lpfhp "
        "instead"),
}


@pytest.mark.parametrize("case", list(HISTOGRAM_CASES))
def test_bad_histograms_and_arguments(tmp_path, case):
    payload, extra, expected = HISTOGRAM_CASES[case]
    path = _json_histogram(tmp_path, payload)
    before = snapshot(tmp_path)
    completed = run_cli("report", "--histogram", path, *extra)
    assert_clean_failure(completed, expected, before, tmp_path)


def test_histogram_path_is_a_directory(tmp_path):
    directory = tmp_path / "histogram.json"
    directory.mkdir()
    before = snapshot(tmp_path)
    completed = run_cli("report", "--histogram", directory)
    assert_clean_failure(
        completed, f"error: cannot read {directory} as JSON: [Errno 21] Is a directory: '{directory}'", before,
        tmp_path)


def test_plot_output_is_a_file(tmp_path):
    histogram = _json_histogram(tmp_path, {"max_sequence_length": 8, "counts": [1, 2, 3, 4, 5, 6, 7, 8]})
    output = tmp_path / "figures"
    output.write_text("an earlier result, not a directory\n")
    before = snapshot(tmp_path)
    completed = run_cli("plot", "--histogram", histogram, "--output", output)
    assert_clean_failure(completed, f"error: cannot write {output}: File exists", before, tmp_path)


def test_plot_output_below_a_file(tmp_path):
    histogram = _json_histogram(tmp_path, {"max_sequence_length": 8, "counts": [1, 2, 3, 4, 5, 6, 7, 8]})
    blocker = tmp_path / "results.txt"
    blocker.write_text("keep me\n")
    before = snapshot(tmp_path)
    completed = run_cli("plot", "--histogram", histogram, "--output", blocker / "figures")
    assert_clean_failure(completed, f"error: cannot write {blocker / 'figures'}: Not a directory", before, tmp_path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_plot_output_unwritable(tmp_path):
    histogram = _json_histogram(tmp_path, {"max_sequence_length": 8, "counts": [1, 2, 3, 4, 5, 6, 7, 8]})
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        before = snapshot(tmp_path)
        completed = run_cli("plot", "--histogram", histogram, "--output", locked)
        assert completed.returncode == 2 and completed.stderr.startswith("error: cannot write ")
        assert "Permission denied" in completed.stderr and completed.stderr.count("\n") == 1
        assert snapshot(tmp_path) == before
    finally:
        locked.chmod(0o700)


def test_plot_write_failure_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    # A failing write (here: the PNG encoder raising OSError, as a full disk would) leaves the
    # earlier figure intact and no .tmp-*.png behind.
    import matplotlib.figure

    histogram = _json_histogram(tmp_path, {"max_sequence_length": 8, "counts": [1, 2, 3, 4, 5, 6, 7, 8]})
    output = tmp_path / "figures"
    output.mkdir()
    (output / "histogram.png").write_bytes(b"an earlier figure")
    before = snapshot(tmp_path)

    def no_space(self, path, **kwargs):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", no_space)
    assert main(["plot", "--histogram", str(histogram), "--output", str(output)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {output}{os.sep}.tmp-")
    assert lines[0].endswith(".png: No space left on device")
    assert captured.out == ""
    assert snapshot(tmp_path) == before


def test_keyboard_interrupt_in_process(tmp_path, monkeypatch, capsys):
    import packing.cli

    histogram = _json_histogram(tmp_path, {"max_sequence_length": 8, "counts": [1, 2, 3, 4, 5, 6, 7, 8]})
    before = snapshot(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(packing.cli, "pack", interrupted)
    assert main(["report", "--histogram", str(histogram), "--algorithm", "lp"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: interrupted; nothing was written that is not complete\n"
    assert captured.out == ""
    assert snapshot(tmp_path) == before


def _sigint_as_in_a_terminal():
    """A foreground process's SIGINT disposition for the child: a test run started in the
    background (``cmd &``, nohup, some CI runners) has SIGINT ignored, and an ignored signal is
    inherited across exec, so the child would never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_long_solve(tmp_path):
    # A real SIGINT while lp works on a large LLM-like histogram (minutes of work).
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(900), 1.0, 300_000).astype(np.int64) + 1, 1, 8192)
    histogram = Histogram.from_lengths(lengths, 8192)
    path = _json_histogram(tmp_path, {"max_sequence_length": 8192, "counts": histogram.counts.tolist()})
    before = snapshot(tmp_path)
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.Popen([sys.executable, "-m", "packing", "report", "--histogram", str(path), "--algorithm",
                                "lp", "--max-sequences-per-pack", "8"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT,
                               preexec_fn=_sigint_as_in_a_terminal)
    time.sleep(4.0)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 2, stderr
    assert stderr == "error: interrupted; nothing was written that is not complete\n"
    assert stdout == ""
    assert snapshot(tmp_path) == before


def test_library_refuses_the_same_cases():
    with pytest.raises(PackingError, match=r"^seed must be a non-negative integer, got -3$"):
        pack(Histogram([1, 2, 3]), "greedy", 2, seed=-3)
    with pytest.raises(PackingError, match=r"^seed must be a non-negative integer, got -1$"):
        Histogram([1, 2, 3]).sample_lengths(seed=-1)
    with pytest.raises(PackingError, match=r"^max_sequence_length must be a positive integer, got 0$"):
        Histogram.from_lengths([1], 0)
    with pytest.raises(PackingError, match=r"^max_sequence_length must be a positive integer, got 7.5$"):
        Histogram([1, 2], 7.5)
    with pytest.raises(PackingError, match=r"beyond what 64-bit arithmetic holds exactly"):
        Histogram(np.full(4, 2**61, dtype=np.int64))


@pytest.mark.parametrize("extra, expected", [
    (["--repeats", "99999999999"], "error: --repeats must be <= 1000 (a median of more runs is no more accurate, "
                                   "and greedy takes seconds a run), got 99999999999"),
    (["--num-sequences", "99999999999999"], "error: --num-sequences must be <= 2147483648 (the assignment keeps "
                                            "several int64 arrays per sequence: tens of GiB beyond that), got "
                                            "99999999999999"),
    (["--num-sequences", "-5"], "error: --num-sequences must be 'all' or a positive integer, got '-5'"),
])
def test_bench_size_flags_have_maximums(tmp_path, capsys, extra, expected):
    # Was: --repeats ran forever, --num-sequences failed in a subprocess's memory.
    before = snapshot(tmp_path)
    assert main(["bench", "--quick", *extra]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [expected]
    assert snapshot(tmp_path) == before
