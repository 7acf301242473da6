"""Where the data tools run their tasks: this process, a local Dask cluster, or an existing one.

``run_tasks(function, tasks, workers=N, scheduler=ADDRESS)`` calls ``function(task)`` for every
task and returns the results in task order:

- ``workers=1`` and no scheduler: in this process, one task after another (nothing to start);
- ``workers=N > 1``: a ``dask.distributed.LocalCluster`` of N single-threaded worker processes
  that starts and stops with the call (nothing to install or start by hand);
- ``scheduler="tcp://host:8786"``: the tasks go to an existing Dask cluster (``dask scheduler``
  and ``dask worker``, dask-mpi, dask-jobqueue/Slurm, Kubernetes). Its workers must import this
  package and see the same file system (inputs and the output directory).

Why Dask: it is what NVIDIA's LDDL uses for the same job, it starts a local cluster with one
call, and the same code then runs on any cluster it supports. The tasks are independent and
coarse (a block of input text, a shard), so the scheduler's overhead (about a millisecond a task)
does not matter; results are small dicts, the data goes through the file system.

Determinism does not depend on the engine: each task's output is a function of the task alone
(its inputs and seeds), so any number of workers, in any order, writes the same files.

Errors: a task's exception is re-raised here with its own type (a ``DataError`` stays one line);
Ctrl-C stops the cluster with the call.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, List, Optional

from tqdm import tqdm

from .errors import DataError

# Worker processes run their tasks single-threaded: the tokenizer's own thread pool would
# otherwise multiply with the workers.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
              "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MAX_WORKERS = 4096  # more local processes than any machine has cores


def default_workers() -> int:
    """All the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def check_workers(workers: Optional[int], scheduler: Optional[str]) -> int:
    """The number of local workers (the default: every core); a DataError for a bad value."""
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise DataError(f"--workers must be between 1 and {MAX_WORKERS} (local worker processes, one per core: no "
                        f"machine has more cores), got {workers}")
    if scheduler and workers is not None and workers != 1:
        pass  # an existing cluster has its own workers; --workers is ignored there (said in --help)
    return workers


def run_tasks(function: Callable[[Any], Any], tasks: Iterable[Any], *, workers: Optional[int] = 1,
              scheduler: Optional[str] = None, desc: str = "tasks", unit: str = " tasks",
              show_progress: bool = False) -> List[Any]:
    """``[function(task) for task in tasks]`` on the chosen engine (see module doc), with a
    progress bar over tasks. ``function`` must be importable by name (a module-level function)
    when it runs on Dask workers."""
    tasks = list(tasks)
    workers = check_workers(workers, scheduler)
    if not tasks:
        return []
    bar = tqdm(total=len(tasks), desc=desc, unit=unit, disable=not show_progress)
    try:
        if scheduler is None and (workers == 1 or len(tasks) == 1):
            results = []
            for task in tasks:
                results.append(function(task))
                bar.update()
            return results
        return _run_on_dask(function, tasks, workers=min(workers, len(tasks)), scheduler=scheduler, bar=bar)
    finally:
        bar.close()


def _run_on_dask(function, tasks, *, workers, scheduler, bar):
    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError:  # pragma: no cover - dask[distributed] is in requirements.txt
        raise DataError("--workers > 1 and --scheduler need dask.distributed: pip install 'dask[distributed]'") from None
    if scheduler is not None:
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise DataError(f"--scheduler {scheduler}: cannot reach a Dask scheduler there "
                            f"({str(exc).splitlines()[0][:160]})") from None
        cluster = None
    else:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR, memory_limit=0,
                               env=dict(WORKER_ENV))
        client = Client(cluster)
    try:
        # pure=False: a task is never answered from another call's cache; key order = task order.
        futures = client.map(function, tasks, pure=False)
        index = {future.key: i for i, future in enumerate(futures)}
        results = [None] * len(tasks)
        for future in as_completed(futures):
            results[index[future.key]] = future.result()  # re-raises the task's exception
            bar.update()
        return results
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
