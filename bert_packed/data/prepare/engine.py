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
Ctrl-C stops the cluster with the call. Local worker processes start with SIGINT ignored
(``_start_sigint_free``): a terminal's Ctrl-C goes to the whole process group, and each worker
that took it printed its own asyncio traceback before this process's one line; here only this
process takes it, and it stops the workers.

Deadlines: ``--scheduler`` must answer Dask's handshake within ``CONNECT_TIMEOUT``. Dask's own
``Client(address, timeout=...)`` bounds the TCP connect but not the handshake read that follows,
so at an address where something else listens (a plain TCP server that says nothing, an HTTP
server) it waited forever; ``Engine.start`` does the handshake itself under the deadline first.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional

from tqdm import tqdm

from bert_packed.data.errors import DataError

# Worker processes run their tasks single-threaded: the tokenizer's own thread pool would
# otherwise multiply with the workers.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
              "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
# A local cluster's servers (each worker, each nanny, the scheduler) wake every 20 ms to time their
# own event loop ("tick": a log line when it stalls for 3 s) and every 0.5 s to sample the
# process's CPU, memory and I/O for the dashboard. With one busy worker per core every wake-up
# takes a core, or the GIL, from a task: per-shard wall time was 1.07x its CPU time with two
# workers (1.03x with these), 1.01x in-process (docs/benchmarks/data.md). Neither timer feeds a decision here
# (memory_limit=0: no memory monitor), so they run at a pace that costs nothing.
QUIET_LOCAL_CLUSTER = {"distributed.admin.tick.interval": "1s", "distributed.admin.system-monitor.interval": "5s"}
MAX_WORKERS = 4096  # more local processes than any machine has cores
# The scheduler always serves HTTP (health, metrics); without an address it takes port 8787 and,
# when another cluster of the machine holds it, prints a three-line warning on every run: a free
# port on the loopback interface says nothing and is reachable from nowhere else.
LOCAL_HTTP = "127.0.0.1:0"
CONNECT_TIMEOUT = 20.0  # seconds for --scheduler to accept a connection and answer Dask's handshake


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
    when it runs on Dask workers. One call, one cluster: use ``Engine`` for several phases."""
    with Engine(workers=workers, scheduler=scheduler) as engine:
        return engine.run(function, tasks, desc=desc, unit=unit, show_progress=show_progress)


def malloc_settings() -> List[str]:
    """The glibc malloc variables set in this process (run on each worker by ``slow_malloc_hint``)."""
    return [name for name in MALLOC_VARIABLES if os.environ.get(name) is not None]


def slow_malloc_hint(client) -> Optional[str]:
    """One line for the user when workers of an existing cluster run with a malloc threshold set
    (Dask's nanny sets MALLOC_TRIM_THRESHOLD_; any of them turns off glibc's adaptive mmap
    threshold): correct but slower, see ``Engine._connect``."""
    try:
        seen = client.run(malloc_settings)
    except Exception:  # a worker that cannot answer is not this hint's business
        return None
    slow = [address for address, names in seen.items() if names]
    if not slow:
        return None
    names = sorted({name for address in slow for name in seen[address]})
    return (f"note: {len(slow)} of {len(seen)} Dask workers run with {', '.join(names)} set (Dask's nanny "
            f"sets MALLOC_TRIM_THRESHOLD_), which makes writing shards about 1.3x slower; start them with "
            f"`dask worker --no-nanny` (docs/data.md, \"A Dask cluster\")")


def silence_dask_logs():
    """Dask's loggers in this process to CRITICAL (see ``_quiet_for_shutdown``)."""
    logging.getLogger("distributed").setLevel(logging.CRITICAL)


def _quiet_for_shutdown(client):
    """Before a local cluster stops, its worker processes log nothing more. A worker whose
    heartbeat is in flight as the cluster closes logs "Failed to communicate with scheduler during
    heartbeat" and a traceback (Dask issue 7105, open; seen here in about 1 run in 16) after a job
    that succeeded. Errors of the run itself were re-raised here already (a task's exception,
    KilledWorker)."""
    try:
        client.run(silence_dask_logs)
    except Exception:  # a worker that cannot answer is closing anyway
        pass


def _start_sigint_free(start: Callable[[], Any], num_workers: int, poll: float = 0.02):
    """``start()`` (it spawns ``num_workers`` worker processes) with SIGINT ignored in this process
    until those processes exist: an ignored signal stays ignored across fork and exec (and Python,
    asyncio and Dask then install no handler of their own), so the workers never take a Ctrl-C,
    which a terminal sends to the whole process group; this process takes it and stops them.
    ``start`` runs in a helper thread so that this (main) thread can restore its handler as soon
    as the workers are forked, long before they are ready: a Ctrl-C is lost only while the
    processes are being forked, not during the seconds the cluster takes to start."""
    if threading.current_thread() is not threading.main_thread():
        return start()
    import psutil

    me = psutil.Process()
    before = {child.pid for child in me.children()}
    outcome = {}

    def target():
        try:
            outcome["value"] = start()
        except BaseException as exc:  # re-raised in the main thread
            outcome["error"] = exc

    helper = threading.Thread(target=target, name="start-dask-cluster", daemon=True)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        helper.start()
        while helper.is_alive() and _new_workers(me, before) < num_workers:
            helper.join(poll)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        while helper.is_alive():
            helper.join(0.1)  # interruptible: a Ctrl-C from here on is this process's
    except KeyboardInterrupt:
        helper.join()  # then close what it started
        cluster = outcome.get("value")
        if cluster is not None:
            cluster.close()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _new_workers(process, before) -> int:
    """Children of ``process`` not in ``before`` that are spawned Python processes (multiprocessing's
    spawn_main: the workers; not its resource tracker)."""
    count = 0
    for child in process.children():
        try:
            if child.pid not in before and any("spawn_main" in part for part in child.cmdline()):
                count += 1
        except Exception:  # a child that exited meanwhile
            continue
    return count


def check_scheduler(address: str, timeout: float = None):
    """DataError (one line, naming ``address``) unless a Dask server there answers the handshake
    within ``timeout`` seconds (default ``CONNECT_TIMEOUT``): nothing listening, something else
    listening (silent, or answering another protocol), or too slow."""
    from distributed.comm import connect

    timeout = CONNECT_TIMEOUT if timeout is None else float(timeout)

    async def handshake():
        # Dask's connect stops at ``timeout`` when nothing accepts (its own message says so); the
        # handshake read after it has no deadline of its own: this one, a second later.
        comm = await asyncio.wait_for(connect(address, timeout=timeout), timeout + 1.0)
        await comm.close()

    try:  # on a thread of its own: the caller may be inside an event loop already (a notebook)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(asyncio.run, handshake()).result()
    except (asyncio.TimeoutError, TimeoutError):
        raise DataError(f"--scheduler {address}: something listens there but did not answer Dask's handshake within "
                        f"{timeout:g} s: not a Dask scheduler; give the address that `dask scheduler` prints") from None
    except (OSError, ValueError, TypeError, EOFError) as exc:  # refused, not a Dask comm, a bad address
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise DataError(f"--scheduler {address}: cannot reach a Dask scheduler there ({reason})") from None


class Engine:
    """Several ``run`` calls on one cluster: a local cluster starts (about 1-3 s) at the first
    call that needs one and stops when the ``with`` block ends, so a job of several phases
    (``create``: tokenise, then shards) starts it once."""

    def __init__(self, *, workers: Optional[int] = 1, scheduler: Optional[str] = None):
        self.workers, self.scheduler = check_workers(workers, scheduler), scheduler
        self._client = self._cluster = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self):
        client, cluster, self._client, self._cluster = self._client, self._cluster, None, None
        logger = logging.getLogger("distributed")
        level = logger.level
        try:
            if client is not None and cluster is not None:
                _quiet_for_shutdown(client)
                logger.setLevel(logging.CRITICAL)  # the scheduler and the nannies run in this process
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
        finally:
            logger.setLevel(level)

    def in_process(self, num_tasks: int) -> bool:
        """True when ``num_tasks`` tasks run in this process (no cluster is needed)."""
        return self.scheduler is None and (self.workers == 1 or num_tasks <= 1)

    def start(self, num_tasks: int = 2):
        """Connect now (the scheduler, or a local cluster when ``num_tasks`` tasks need one), so a
        caller can be refused before it writes anything (``run`` otherwise connects at its first
        call)."""
        if self._client is None and not self.in_process(num_tasks):
            self._connect()

    def run(self, function: Callable[[Any], Any], tasks: Iterable[Any], *, desc: str = "tasks",
            unit: str = " tasks", show_progress: bool = False) -> List[Any]:
        """``[function(task) for task in tasks]`` (see ``run_tasks``)."""
        tasks = list(tasks)
        if not tasks:
            return []
        bar = tqdm(total=len(tasks), desc=desc, unit=unit, disable=not show_progress)
        try:
            if self.in_process(len(tasks)):
                results = []
                for task in tasks:
                    results.append(function(task))
                    bar.update()
                return results
            return self._run_on_dask(function, tasks, bar)
        finally:
            bar.close()

    def _connect(self):
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:  # pragma: no cover - dask[distributed] is in requirements.txt
            raise DataError("--workers > 1 and --scheduler need dask.distributed: pip install 'dask[distributed]'") \
                from None
        if self.scheduler is not None:
            check_scheduler(self.scheduler)
            try:
                self._client = Client(self.scheduler, timeout=f"{CONNECT_TIMEOUT}s")
            except (OSError, TimeoutError) as exc:
                raise DataError(f"--scheduler {self.scheduler}: cannot reach a Dask scheduler there "
                                f"({str(exc).splitlines()[0][:160]})") from None
            hint = slow_malloc_hint(self._client)
            if hint:
                print(hint, file=sys.stderr)
            return
        import dask.config

        # Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in every worker before it starts. Setting
        # any malloc threshold turns off glibc's adaptive mmap threshold, so every array over 128 KiB
        # is mmap'd, faulted in page by page and unmapped again: writing shards took 1.3x the time
        # (KJV x20, 2 workers: 38.4 s -> 32.3 s without it, docs/benchmarks/data.md). Our workers
        # keep glibc's defaults; the other pre-spawn variables (thread counts) stay.
        pre_spawn = {key: value for key, value in dask.config.get("distributed.nanny.pre-spawn-environ").items()
                     if key not in MALLOC_VARIABLES}
        # Each worker's sampling profiler (for the dashboard, which a local cluster does not serve)
        # takes the GIL every 10 ms from the task's thread: about 4 % of `create` with 2 workers.
        # The same goes for QUIET_LOCAL_CLUSTER's timers, in every worker, nanny and the scheduler.
        with dask.config.set({"distributed.nanny.pre-spawn-environ": pre_spawn,
                              "distributed.worker.profile.enabled": False, **QUIET_LOCAL_CLUSTER}):
            self._cluster = _start_sigint_free(
                lambda: LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True,
                                     dashboard_address=LOCAL_HTTP, silence_logs=logging.ERROR, memory_limit=0,
                                     env=dict(WORKER_ENV)), self.workers)
        self._client = Client(self._cluster)

    def _run_on_dask(self, function, tasks, bar):
        from dask.distributed import as_completed

        if self._client is None:
            self._connect()
        # pure=False: a task is never answered from another call's cache; key order = task order.
        futures = self._client.map(function, tasks, pure=False)
        try:
            index = {future.key: i for i, future in enumerate(futures)}
            results = [None] * len(tasks)
            # with_results: results come in batches as tasks finish (a result() call per future is a
            # round trip to the client's event loop: 0.8 ms a task, measured); an error re-raises
            # the task's exception here.
            for future, result in as_completed(futures, with_results=True):
                results[index[future.key]] = result
                bar.update()
            return results
        except BaseException:
            self._client.cancel(futures)
            raise
