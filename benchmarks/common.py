"""What the benchmark scripts share: a setup in its own process, timed windows, medians and
spreads, result rows as JSON (written atomically) and Markdown tables.

    from benchmarks.common import ROOT, run_worker, run_measured, timed_windows, spread, write_rows, markdown_table

A script runs as ``python benchmarks/NAME.py`` (``ensure_root_on_path()`` makes the project and
this package importable then) or is imported as ``benchmarks.NAME`` (tests).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_root_on_path() -> None:
    """Put the project root first on ``sys.path`` (a script run by path has benchmarks/ there instead)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


# ----------------------------------------------------------------------------- statistics


def spread(values: Iterable[float]) -> Dict[str, float]:
    """Median, min and max of ``values`` (at least one)."""
    values = sorted(float(v) for v in values)
    if not values:
        raise ValueError("spread() of no values")
    return {"median": statistics.median(values), "min": values[0], "max": values[-1]}


def spread_fields(name: str, values: Iterable[float]) -> Dict[str, float]:
    """``{name: median, name_min: min, name_max: max}``: how result rows carry a spread."""
    s = spread(values)
    return {name: s["median"], f"{name}_min": s["min"], f"{name}_max": s["max"]}


def fmt_spread(row: Dict[str, Any], name: str, pattern: str = "{:.1f}") -> str:
    """``median (min-max)`` of a row's ``spread_fields``."""
    return (f"{pattern.format(row[name])} ({pattern.format(row[name + '_min'])}-"
            f"{pattern.format(row[name + '_max'])})")


def fmt(value: Any, pattern: str = "{:.1f}", missing: str = "n/a") -> str:
    return missing if value is None else pattern.format(value)


# ----------------------------------------------------------------------------- timing


def timed_windows(step: Callable[[], Dict[str, float]], *, repeats: int, min_steps: int = 1,
                  min_seconds: float = 0.0, sync: Callable[[], None] = lambda: None,
                  clock: Callable[[], float] = time.perf_counter) -> List[Dict[str, float]]:
    """``repeats`` timed windows, each of at least ``min_steps`` calls of ``step`` and at least
    ``min_seconds`` of wall time. ``step()`` returns the amounts it processed (e.g. sequences,
    tokens), summed per window; ``sync()`` waits for queued device work (before the clock starts,
    and before it is read at the end of the window, so a window times the work it launched).
    Each window: its ``seconds``, ``steps`` and the sums."""
    if repeats < 1 or min_steps < 1 or not min_seconds >= 0:
        raise ValueError(f"timed_windows needs repeats >= 1, min_steps >= 1 and min_seconds >= 0, got "
                         f"{repeats}, {min_steps}, {min_seconds}")
    windows = []
    for _ in range(repeats):
        sync()
        start = clock()
        totals: Dict[str, float] = {}
        steps = 0
        while steps < min_steps or clock() - start < min_seconds:
            for key, value in step().items():
                totals[key] = totals.get(key, 0.0) + float(value)
            steps += 1
        sync()
        windows.append({"seconds": clock() - start, "steps": steps, **totals})
    return windows


def rates(windows: Sequence[Dict[str, float]], key: str) -> List[float]:
    """Per window: ``key`` per second."""
    return [w[key] / w["seconds"] for w in windows]


# ----------------------------------------------------------------------------- one setup per process


def result_line(prefix: str, row: Dict[str, Any]) -> str:
    """The one line a worker prints for its parent (``prefix`` then the row as JSON)."""
    return prefix + json.dumps(row)


def run_worker(command: List[str], prefix: str, *, timeout: Optional[float] = None,
               cwd: str = ROOT, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run ``command`` (a fresh interpreter: its own caches, allocator and dynamo counters) and
    return the row it printed after ``prefix`` (the last such line). Otherwise a row with only
    ``status``: ``failed: timeout after T s`` or ``failed: <last line of stderr>``."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: timeout after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    return {"status": f"failed: {lines[-1] if lines else f'exit status {proc.returncode}'}"}


@dataclass
class Measured:
    """What :func:`run_measured` saw of one command."""
    seconds: float  # wall clock, start to exit
    cpu_seconds: float  # user + system of the command and every descendant it waited for
    peak_rss: int  # bytes: the peak of the summed RSS of the process tree (0 without sampling)
    peak_rss_one: int  # bytes: the peak RSS of its largest single process
    returncode: int
    stdout: str  # with stderr merged when ``merge_stderr``; "" when written to ``log_path``
    stderr: str
    killed: bool  # stopped by ``kill_when``

    def check(self, command: Sequence[str], error: Callable[[str], BaseException] = SystemExit) -> "Measured":
        """``self``, or raise ``error`` naming the command, its exit status and the tail of its output."""
        if self.returncode and not self.killed:
            tail = (self.stderr or self.stdout).strip()[-2000:]
            raise error(f"failed ({self.returncode}): {' '.join(command)}\n{tail}")
        return self


def tree_rss(process) -> tuple:
    """(summed RSS, largest RSS) in bytes of a ``psutil.Process`` and its descendants (shared pages
    count once per process, so the sum is an upper bound); (0, 0) once it is gone."""
    import psutil

    try:
        members = [process] + process.children(recursive=True)
    except psutil.Error:
        return 0, 0
    sizes = []
    for member in members:
        try:
            sizes.append(member.memory_info().rss)
        except psutil.Error:
            pass
    return sum(sizes), max(sizes, default=0)


def run_measured(command: Sequence[str], *, cwd: str = ROOT, env: Optional[Dict[str, str]] = None,
                 interval: float = 0.1, sample_memory: bool = True, log_path: Optional[str] = None,
                 merge_stderr: bool = False, kill_when: Optional[Callable[[], bool]] = None) -> Measured:
    """Run ``command`` to its end (or SIGKILL its process group once ``kill_when()`` is true), every
    ``interval`` seconds sampling the memory of its process tree (psutil; ``sample_memory=False``
    needs no psutil). Output: captured (``stdout``, ``stderr``), or both written to ``log_path``.
    Never raises for a failed command: see :meth:`Measured.check`."""
    import resource
    import signal

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = open(log_path, "w") if log_path else None
    merged = merge_stderr or log is not None
    start = time.perf_counter()
    try:
        process = subprocess.Popen(list(command), cwd=cwd, env=env, text=True, start_new_session=kill_when is not None,
                                   stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE)
    except BaseException:
        if log:
            log.close()
        raise
    streams = {"stdout": process.stdout, "stderr": process.stderr}
    texts: Dict[str, List[str]] = {name: [] for name in streams}
    readers = [threading.Thread(target=texts[name].extend, args=(stream,), daemon=True)
               for name, stream in streams.items() if stream is not None]
    for reader in readers:
        reader.start()
    watched = None
    if sample_memory:
        import psutil

        try:
            watched = psutil.Process(process.pid)
        except psutil.Error:
            watched = None
    peak = peak_one = 0
    killed = False
    while process.poll() is None:
        if watched is not None:
            total, one = tree_rss(watched)
            peak, peak_one = max(peak, total), max(peak_one, one)
        if kill_when is not None and kill_when():
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            killed = True
            break
        time.sleep(interval)
    for reader in readers:
        reader.join(timeout=10)
    seconds = time.perf_counter() - start
    if log:
        log.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Measured(seconds, cpu, peak, peak_one, process.returncode, "".join(texts["stdout"]),
                    "".join(texts["stderr"]), killed)


# ----------------------------------------------------------------------------- results


def write_rows(path: Optional[str], rows: List[Dict[str, Any]]) -> None:
    """The rows as a JSON list at ``path``, atomically (a kill leaves the previous version); no-op without a path."""
    if path:
        from bert_packed.io.files import write_text_atomic

        write_text_atomic(path, json.dumps(rows, indent=1))


def read_rows(path: str, required: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """A results file of ``write_rows``; ``ValueError`` (one line) when it cannot be read or is not
    a list of rows that each have the ``required`` keys."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read results ({exc})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in required) for r in rows):
        raise ValueError(f"{path}: not a results file of this benchmark (a JSON list of rows)")
    return rows


def markdown_header(header: Sequence[str], align: str = "") -> str:
    """A Markdown table's first two lines (for a table printed a row at a time, as rows finish).
    ``align``: one character per column, ``l`` (default) or ``r``."""
    header = list(header)
    align = (align + "l" * len(header))[:len(header)]
    return "| " + " | ".join(header) + " |\n" + "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"


def markdown_row(cells: Sequence[Any], width: int = 0) -> str:
    """One row of a Markdown table, padded with empty cells to ``width`` columns."""
    cells = [str(c) for c in cells]
    cells += [""] * (width - len(cells))
    return "| " + " | ".join(cells) + " |"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table. ``align``: one character per column, ``l`` (default) or ``r``."""
    header = list(header)
    return "\n".join([markdown_header(header, align)] + [markdown_row(row, len(header)) for row in rows])
