"""Benchmark: what the data tools' engine (a local Dask cluster) costs a task, all in.

    python benchmarks/data_engine_overhead.py [--tasks 12500] [--workers 2] [--repeats 3]

Runs `--tasks` tasks that do nothing (each a dict shaped like one of `create`'s block tasks)
through ``engine.Engine`` on a local cluster of `--workers` processes, after one warm-up call
that starts the cluster, and prints the wall time and the time per task: scheduler, client,
transfers and workers together (the median of `--repeats` calls, with their min and max). 12,500 is about the task count of `create` and `pack` on 20 GB
of text (2,500 blocks, 5,000 shards twice), the figure the 20 GB projection in
docs/benchmarks/data.md needs. Measure on a quiet machine.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)

from benchmarks.common import spread, timed_windows  # noqa: E402


def empty_task(task):
    """A task that returns at once (module level, so Dask's workers import it by name)."""
    return task["index"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=12500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed calls (median, min and max)")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.workers < 2 or args.repeats < 1:
        parser.error("--tasks and --repeats must be at least 1 and --workers at least 2 (one worker runs "
                     "in-process, no engine)")
    from bert_packed.data.prepare import engine

    options = {"max_seq_length": 512, "max_predictions": 80, "dupe_factor": 10, "seed": 12345, "num_shards": 5000}
    tasks = [{"work": "/data/out/.work", "vocab": "/data/vocab.txt", "options": options, "index": i,
              "path": "/data/wiki/wiki_00", "format": "wikiextractor", "start": i << 23, "stop": (i + 1) << 23}
             for i in range(args.tasks)]
    results = []

    def call():
        results[:] = runner.run(empty_task, tasks)
        return {"tasks": len(tasks)}

    with engine.Engine(workers=args.workers) as runner:
        runner.run(empty_task, tasks[:args.workers])  # starts the cluster; not timed
        seconds = spread(w["seconds"] for w in timed_windows(call, repeats=args.repeats))
    assert results == list(range(args.tasks))
    print(f"{args.tasks:,} empty tasks on {args.workers} local workers: {seconds['median']:.1f} s "
          f"({seconds['min']:.1f}-{seconds['max']:.1f} over {args.repeats} call(s)), "
          f"{seconds['median'] / args.tasks * 1e3:.2f} ms a task")
    return 0

if __name__ == "__main__":
    sys.exit(main())
