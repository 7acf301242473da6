"""Benchmark: where a sharded `create` or `pack` spends its time, task by task.

    python benchmarks/data_task_times.py create --input kjv_x20.txt --vocab vocab.txt --output DIR \
        --max-seq-length 128 --max-predictions 20 --dupe-factor 10 --seed 12345 --workers 2

Runs ``python -m bert_packed.data`` with the given arguments in this process, with every task
timed where it runs (in the worker): its wall time and its thread's CPU time
(``time.thread_time``). Prints, per phase (tokenise blocks, write shards, pack shards), the
phase's wall time, the number of tasks, their mean wall and CPU seconds and the ratio of the
two (1.0: the task had its core to itself; above: it waited for the core or the GIL). With
``--workers 1`` the tokenizer's own threads are not in a task's CPU time.
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.append(ROOT)  # after PYTHONPATH: another version given there wins

from benchmarks.common import markdown_table  # noqa: E402


def timed(payload):
    """Run one task and time it on the worker: (result, wall s, thread CPU s)."""
    function, task = payload
    start, cpu = time.perf_counter(), time.thread_time()
    result = function(task)
    return result, time.perf_counter() - start, time.thread_time() - cpu


def main(argv):
    from bert_packed.data.prepare import engine
    from bert_packed.data.__main__ import main as data_main

    phases = []
    run = engine.Engine.run

    def run_timed(self, function, tasks, **options):
        start = time.perf_counter()
        results = run(self, timed, [(function, task) for task in tasks], **options)
        phases.append((function.__name__, time.perf_counter() - start, [r[1:] for r in results]))
        return [r[0] for r in results]

    engine.Engine.run = run_timed
    status = data_main(argv)
    rows = []
    for name, wall, times in phases:
        task_wall = sum(w for w, _ in times) / max(1, len(times))
        task_cpu = sum(c for _, c in times) / max(1, len(times))
        rows.append([name, f"{wall:.2f}", len(times), f"{task_wall:.3f}", f"{task_cpu:.3f}",
                     f"{task_wall / task_cpu if task_cpu else float('nan'):.3f}"])
    print(markdown_table(["phase", "wall s", "tasks", "task wall s (mean)", "task CPU s (mean)", "wall / CPU"], rows,
                         align="lrrrrr"))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
