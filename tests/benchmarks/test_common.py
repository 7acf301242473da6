"""benchmarks/common.py: the helper every benchmark shares (imported as a package)."""
import json
import sys

import pytest

from benchmarks import common


def test_spread_and_its_row_fields():
    assert common.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert common.spread_fields("x", [4, 1, 2, 3]) == {"x": 2.5, "x_min": 1.0, "x_max": 4.0}
    assert common.fmt_spread({"x": 2.5, "x_min": 1.0, "x_max": 4.0}, "x") == "2.5 (1.0-4.0)"
    with pytest.raises(ValueError):
        common.spread([])


def test_timed_windows_run_whole_steps_for_at_least_the_window():
    now = [0.0]
    synced = []

    def step():
        now[0] += 0.4  # each step takes 0.4 "seconds" of the fake clock
        return {"tokens": 10}

    windows = common.timed_windows(step, repeats=3, min_steps=2, min_seconds=1.0, sync=lambda: synced.append(now[0]),
                                   clock=lambda: now[0])
    assert len(windows) == 3 and len(synced) == 6
    for w in windows:
        assert w["steps"] == 3 and w["tokens"] == 30 and w["seconds"] == pytest.approx(1.2)
    assert common.rates(windows, "tokens") == pytest.approx([25.0] * 3)
    # min_steps wins over a zero-length window.
    assert [w["steps"] for w in common.timed_windows(step, repeats=2, min_steps=4, clock=lambda: now[0])] == [4, 4]


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"repeats": 1, "min_steps": 0}, {"repeats": 1, "min_seconds": -1},
                                    {"repeats": 1, "min_seconds": float("nan")}])
def test_timed_windows_refuse_impossible_windows(kwargs):
    with pytest.raises(ValueError):
        common.timed_windows(lambda: {}, **kwargs)


def test_run_worker_returns_the_row_or_a_failed_status(tmp_path):
    prefix = "ROW "
    ok = common.run_worker([sys.executable, "-c", f"print('noise'); print({prefix!r} + '{{\"a\": 1}}')"], prefix)
    assert ok == {"a": 1}
    failed = common.run_worker([sys.executable, "-c", "import sys; sys.exit('error: broken setup')"], prefix)
    assert failed == {"status": "failed: error: broken setup"}
    slow = common.run_worker([sys.executable, "-c", "import time; time.sleep(30)"], prefix, timeout=0.5)
    assert slow == {"status": "failed: timeout after 0.5 s"}


def test_rows_round_trip_and_bad_files_are_one_line(tmp_path):
    path = tmp_path / "rows.json"
    rows = [{"setup": "a", "status": "ok", "x": 1.5}]
    common.write_rows(str(path), rows)
    assert common.read_rows(str(path), ("setup", "status")) == rows
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left
    common.write_rows(None, rows)  # no path: nothing written
    for content, message in ((None, "cannot read results"), ("{", "cannot read results"),
                             ('{"a": 1}', "not a results file"), ('[{"setup": "a"}]', "not a results file")):
        bad = tmp_path / "bad.json"
        if content is not None:
            bad.write_text(content)
        before = bad.read_bytes() if bad.exists() else None
        with pytest.raises(ValueError) as info:
            common.read_rows(str(bad), ("setup", "status"))
        assert message in str(info.value) and "\n" not in str(info.value)
        assert (bad.read_bytes() if bad.exists() else None) == before
        if bad.exists():
            bad.unlink()


def test_markdown_table_pads_short_rows_and_aligns():
    table = common.markdown_table(["a", "b", "c"], [[1, 2, 3], ["only"]], align="lr")
    assert table.splitlines() == ["| a | b | c |", "|---|---:|---|", "| 1 | 2 | 3 |", "| only |  |  |"]
    json.dumps(table)


def test_run_measured_output_status_memory_log_and_kill(tmp_path):
    ok = common.run_measured([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                             interval=0.01)
    assert (ok.returncode, ok.stdout, ok.stderr, ok.killed) == (0, "out\n", "err\n", False)
    assert ok.seconds > 0 and ok.cpu_seconds >= 0 and ok.peak_rss >= ok.peak_rss_one >= 0
    assert ok.check(["x"]) is ok
    failed = common.run_measured([sys.executable, "-c", "import sys; sys.exit('error: broken')"], sample_memory=False)
    with pytest.raises(SystemExit, match=r"failed \(1\): prog\nerror: broken"):
        failed.check(["prog"])
    with pytest.raises(RuntimeError):
        failed.check(["prog"], RuntimeError)
    log = tmp_path / "log.txt"
    logged = common.run_measured([sys.executable, "-c", "import sys; print('a'); print('b', file=sys.stderr)"],
                                 log_path=str(log), sample_memory=False)
    assert logged.stdout == "" and sorted(log.read_text().split()) == ["a", "b"]
    killed = common.run_measured([sys.executable, "-c", "import time; time.sleep(30)"], interval=0.05,
                                 kill_when=lambda: True)
    assert killed.killed and killed.returncode != 0 and killed.seconds < 20
    assert killed.check(["sleep"]) is killed  # a kill asked for is not a failure


def test_markdown_header_and_rows_make_the_table():
    assert common.markdown_header(["a", "b"], "r") + "\n" + common.markdown_row([1], 2) == \
        common.markdown_table(["a", "b"], [[1]], "r")
