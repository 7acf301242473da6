"""``python -m packing``: output contracts and one-line errors for bad input (subprocess)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from packing import Histogram, PackingError, pack
from packing.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = ["algorithm", "max_sequence_length", "max_sequences_per_pack", "num_sequences", "num_packs", "num_tokens",
          "num_padding_tokens", "efficiency", "packing_factor", "theoretical_speedup", "max_depth_used",
          "num_strategies_used", "seconds", "lp_bound_packs", "gap"]


def run_cli(*args):
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "packing", *map(str, args)], capture_output=True, text=True,
                          env=environment, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def small_histogram(tmp_path_factory):
    counts = np.zeros(64, dtype=int)
    counts[[4, 9, 20, 31, 40, 63]] = [30, 12, 25, 8, 17, 5]
    path = tmp_path_factory.mktemp("hist") / "small.json"
    path.write_text(json.dumps({"max_sequence_length": 64, "counts": counts.tolist()}))
    return path


def _write(tmp_path, name, content):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, content)
    else:
        path.write_text(content)
    return path


BAD_INPUTS = {
    "negative count": ("bad.json", json.dumps({"max_sequence_length": 3, "counts": [1, -2, 3]}), [],
                       "non-negative"),
    "non-integer count": ("bad.json", json.dumps({"max_sequence_length": 3, "counts": [1, 2.5, 3]}), [],
                          "integers"),
    "string count": ("bad.json", json.dumps({"max_sequence_length": 3, "counts": [1, "x", 3]}), [], "integers"),
    "sequence longer than L": ("bad.json", json.dumps({"max_sequence_length": 2, "counts": [1, 2, 3]}), [],
                               "max_sequence_length"),
    "wrong shape json": ("bad.json", json.dumps({"max_sequence_length": 2, "counts": [[1, 2], [3, 4]]}), [],
                         "one-dimensional"),
    "not an object": ("bad.json", json.dumps([1, 2, 3]), [], "JSON object"),
    "broken json": ("bad.json", "{not json", [], "cannot read"),
    "wrong shape npy": ("bad.npy", np.ones((3, 4), dtype=np.int64), [], "one-dimensional"),
    "empty histogram": ("bad.json", json.dumps({"max_sequence_length": 2, "counts": [0, 0]}), [], "empty"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_histogram_files_fail_with_one_line(tmp_path, case):
    name, content, extra, expected = BAD_INPUTS[case]
    path = _write(tmp_path, name, content)
    completed = run_cli("report", "--histogram", path, "--algorithm", "spfhp", *extra)
    _assert_one_line_error(completed, expected)


@pytest.mark.parametrize("args,expected", [
    (["--algorithm", "magic"], "unknown packing algorithm"),
    (["--max-sequences-per-pack", "0"], "at least 1"),
    (["--max-sequences-per-pack", "two"], "positive integer"),
    (["--algorithm", "nnlshp", "--max-sequences-per-pack", "4"], "<= 3"),
    (["--algorithm", "ennlshp", "--max-sequences-per-pack", "max"], "<= 3"),
    (["--histogram", "no-such-histogram"], "neither a shipped name"),
    (["--max-sequence-length", "128"], "not the requested 128"),
    (["--algorithm", "sort", "--batch-size", "0"], "batch-size"),
    (["--unknown-flag"], "unrecognized arguments"),
])
def test_bad_arguments_fail_with_one_line(args, expected):
    completed = run_cli("report", *args)
    _assert_one_line_error(completed, expected)


def _assert_one_line_error(completed, expected):
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert completed.stdout == ""


def test_report_json_rows(small_histogram):
    completed = run_cli("report", "--histogram", small_histogram, "--algorithm", "none", "spfhp", "lp",
                        "--max-sequences-per-pack", "2", "max", "--json")
    assert completed.returncode == 0, completed.stderr
    rows = json.loads(completed.stdout)
    assert [(r["algorithm"], r["max_sequences_per_pack"]) for r in rows] == [
        ("none", 1), ("spfhp", 2), ("spfhp", None), ("lp", 2), ("lp", None)]
    histogram = Histogram.load(small_histogram)
    for row in rows:
        # The contract's fields in order; an lp row that skipped its LP also says why ("lp_skipped").
        assert list(row)[:len(FIELDS)] == FIELDS and set(row) - set(FIELDS) <= {"lp_skipped"}
        assert row["num_tokens"] == histogram.num_tokens
        assert row["num_padding_tokens"] == row["num_packs"] * 64 - histogram.num_tokens
        assert row["efficiency"] == pytest.approx(histogram.num_tokens / (row["num_packs"] * 64))
        if row["algorithm"] != "none":
            # every row at a depth carries the bound lp certified for that depth
            assert row["lp_bound_packs"] is not None and row["lp_bound_packs"] <= row["num_packs"]
        expected = pack(histogram, row["algorithm"], row["max_sequences_per_pack"]).num_packs
        assert row["num_packs"] == expected


def test_report_table(small_histogram, capsys):
    assert main(["report", "--histogram", str(small_histogram), "--algorithm", "lpfhp", "lp",
                 "--max-sequences-per-pack", "3"]) == 0
    output = capsys.readouterr().out
    assert "theoretical speed-up" in output
    header = next(line for line in output.splitlines() if line.startswith("algorithm"))
    for column in ("packs", "tokens", "padding", "efficiency %", "packing factor", "max depth", "strategies",
                   "seconds", "LP bound"):
        assert column in header
    assert sum(line.startswith(("lpfhp ", "lp ")) for line in output.splitlines()) == 2


def test_plot_writes_pngs(small_histogram, tmp_path):
    completed = run_cli("plot", "--histogram", small_histogram, "--output", tmp_path / "figures",
                        "--algorithm", "spfhp", "--max-sequences-per-pack", "3")
    assert completed.returncode == 0, completed.stderr
    written = completed.stdout.split()
    assert {os.path.basename(p) for p in written} == {"histogram.png", "padding_spfhp_3.png", "residual_nnlshp_3.png"}
    for path in written:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_quick_json(small_histogram):
    completed = run_cli("bench", "--histogram", small_histogram, "--quick", "--repeats", "1", "--json")
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["assign"]["num_sequences"] == 1_000_000
    assert report["assign"]["peak_rss_bytes"] > 0
    assert {r["algorithm"] for r in report["plans"]} >= {"spfhp", "lpfhp", "lp"}


def test_library_errors_are_packing_errors():
    with pytest.raises(PackingError, match="longer than max_sequence_length"):
        Histogram.from_lengths([3, 600], 512)
    with pytest.raises(PackingError, match="at least 1"):
        Histogram.from_lengths([0, 3], 512)
    with pytest.raises(PackingError, match="positive integer"):
        pack(Histogram.from_lengths([3], 8), "spfhp", 0)
    with pytest.raises(PackingError, match="positive integer"):
        pack(Histogram.from_lengths([3], 8), "spfhp", 2.5)
    with pytest.raises(PackingError, match="does not take"):
        pack(Histogram.from_lengths([3], 8), "spfhp", 2, batch_size=3)
    assert issubclass(PackingError, ValueError)


def test_report_bound_honours_the_time_limit(small_histogram, monkeypatch, capsys):
    # --bound runs lp for depths that have no lp row: that call takes --time-limit too
    # (it used to run without one, however long the LP took).
    import packing.cli as cli

    calls = []

    def recording_pack(histogram, algorithm, depth, **options):
        calls.append((algorithm, depth, options.get("time_limit")))
        return pack(histogram, algorithm, depth, **options)

    monkeypatch.setattr(cli, "pack", recording_pack)
    assert main(["report", "--histogram", str(small_histogram), "--algorithm", "lpfhp",
                 "--max-sequences-per-pack", "3", "--bound", "--time-limit", "2.5"]) == 0
    assert ("lp", 3, 2.5) in calls, calls
    assert "LP bound" in capsys.readouterr().out


# 28 sequences of length <= 16 at depth 2: lpfhp's 17 packs are one from the simple bounds (16),
# so lp skips its LP; the LP bound proves 17 optimal (issue 38: the report said "7.14 % over").
SKIPPED_LP_LENGTHS = [1, 1, 3, 3, 3, 4, 4, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 11, 12, 12, 13, 14, 14, 15, 15, 15, 15, 16]


def test_report_says_when_lp_skipped_its_bound_and_bound_computes_it(tmp_path):
    counts = np.bincount(SKIPPED_LP_LENGTHS, minlength=17)[1:]
    path = _write(tmp_path, "h.json", json.dumps({"max_sequence_length": 16, "counts": counts.tolist()}))
    plain = run_cli("report", "--histogram", path, "--algorithm", "lp", "--max-sequences-per-pack", "2")
    assert plain.returncode == 0, plain.stderr
    assert "skipped its LP" in plain.stdout and "--bound" in plain.stdout
    rows = json.loads(run_cli("report", "--histogram", path, "--algorithm", "lp", "--max-sequences-per-pack", "2",
                              "--json").stdout)
    assert rows[0]["num_packs"] == 17 and rows[0]["lp_bound_packs"] == 16 and rows[0]["lp_skipped"]
    bound = run_cli("report", "--histogram", path, "--algorithm", "lp", "lpfhp", "--max-sequences-per-pack", "2",
                    "--bound", "--json")
    assert bound.returncode == 0, bound.stderr
    for row in json.loads(bound.stdout):  # the LP's own bound: 17 packs are optimal, 0 % over it
        assert row["lp_bound_packs"] == 17 and row["gap"] == 0.0 and "lp_skipped" not in row
    assert "skipped its LP" not in run_cli("report", "--histogram", path, "--algorithm", "lp",
                                           "--max-sequences-per-pack", "2", "--bound").stdout
