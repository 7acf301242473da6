"""The training loop: data -> backend.train_step -> metrics, evaluation, checkpoints.

One *step* is one optimizer update over the global batch: ``gradient_accumulation``
micro-batches of ``micro_batch_size`` packs on every data-parallel replica. The backend owns
the step (``bert_packed.backend``); the task owns what is trained and how it is judged
(``bert_packed.tasks``: the model, the data, the metric keys, the evaluation, the end-of-run
outputs); this module wires the loop's parts (``bert_packed.loop``) around them:

- the step plan (``loop.plan``): the packing factor p of the data decides the configured
  hyperparameter adjustment (divide gradient accumulation by p, or LAMB betas ** p), the task
  the number of steps; computed once, never written back into the config;
- the metrics logger (``loop.logger``): one JSON line per logged step in ``metrics.jsonl``
  (the fields of docs/design.md, "Output files"), TensorBoard, the progress bar; ``summary.json`` at the end;
- the divergence guard (``loop.guard``) and the stop signals (``loop.stops``);
- the checkpointer (``loop.checkpointer``): atomic checkpoints every ``checkpoint_every``
  steps; ``resume=True`` continues from the last one exactly (weights, optimizer moments,
  schedule position, data position and RNG states), so steps k+1... reproduce an
  uninterrupted run.
"""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from bert_packed.backend import StepAbandoned
from bert_packed.model.build import build_optimizer
from bert_packed.io.checkpoint import set_rng_state
from bert_packed.config import Config, ConfigError, ResolvedRun, input_paths, resolve_run
from bert_packed.io.files import DirectoryLock, check_output_dir, remove_orphans, write_text_atomic
from bert_packed.loop.checkpointer import Checkpointer
from bert_packed.loop.data_wait import DataWait
from bert_packed.loop.distributed import all_reduce_sum, planned_world_size, setup_distributed
from bert_packed.loop.estimate import slow_step_warning
from bert_packed.loop.guard import DivergenceGuard
from bert_packed.loop.logger import MetricsLogger, Throughput, real_counts, to_host
from bert_packed.loop.plan import StepPlan, make_plan
from bert_packed.loop.prefetch import Prefetcher
from bert_packed.loop.stops import (CollectiveTimeout, DivergenceError, Interrupted, StopSignals,  # noqa: F401
                                    TrainingStopped)
from bert_packed.loop.within_step import StepWatch, memory_text
from bert_packed.tasks.registry import get_task

SUMMARY_NAME = "summary.json"


def train(config: Config, backend, *, output_dir: Optional[str] = None, resume: bool = False,
          resume_force: bool = False, show_progress: bool = True,
          resolved: Optional[ResolvedRun] = None) -> Dict[str, Any]:
    """Train ``config`` on ``backend`` (an unprepared backend object, see ``bert_packed.backend``;
    ``run.py`` resolves names with ``backends.get_backend``); returns the summary (also in
    summary.json).

    ``resume``: continue from the checkpoint in ``output_dir`` (a directory holding one is
    refused without it). A checkpoint whose configuration differs in keys that change the
    computation is refused (listing them) unless ``resume_force``. Raises ``ConfigError`` /
    ``CheckpointError`` / ``DataError`` (ValueErrors, one line) for user mistakes,
    ``DivergenceError`` on a non-finite step, ``Interrupted`` after SIGINT/SIGTERM.

    ``resolved``: the caller's resolution of ``config`` (``bert_packed.config.resolve_run``, as
    ``run.py`` does before it builds the backend); without it, or made for another backend or
    world size, the loop resolves the config itself. Either way the run trains (a copy of) the
    resolved run's config; ``config`` itself is never changed."""
    if isinstance(backend, str):
        raise TypeError(f"train() takes a backend object, not the name {backend!r}: "
                        f"resolve it with backends.get_backend({backend!r})")
    threads = torch.get_num_threads()
    run = None
    try:
        run = _Run(config, backend, output_dir=output_dir, resume=resume, resume_force=resume_force,
                   show_progress=show_progress, resolved=resolved)
        return run.execute()
    except BaseException as exc:
        if run is not None and run.logger is None:  # refused before anything was written: leave no trace
            run.close(undo=True)
        elif run is not None and isinstance(exc, ValueError) and run.logger.undo():
            run.close(undo=True)  # refused at the first step (a one-line ValueError): no trace either
        timeout = _collective_timeout(exc, config)
        if timeout is not None:
            raise timeout from None
        raise
    finally:  # train.num_threads is for this run only (callers in the same process keep theirs)
        torch.set_num_threads(threads)
        if run is not None:
            run.close()


def _collective_timeout(exc: BaseException, config: Config) -> Optional[CollectiveTimeout]:
    """gloo/NCCL report a collective that outlived train.collective_timeout_minutes as a
    RuntimeError: say what it means instead of a traceback from deep inside torch."""
    if not (isinstance(exc, RuntimeError) and dist.is_available() and dist.is_initialized()
            and "timed out" in str(exc).lower().replace("timeout", "timed out")):
        return None
    return CollectiveTimeout(
        f"a collective between the {dist.get_world_size()} processes timed out after "
        f"train.collective_timeout_minutes={config.train.collective_timeout_minutes:g}: another rank hung "
        f"or died (see its log); the last checkpoint is intact")


def _missing_folders(path: str) -> List[str]:
    """The folders of ``path`` that do not exist yet, deepest first (what makedirs creates)."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _prepare_output_dir(output_dir: str, is_main: bool) -> Optional[DirectoryLock]:
    """Create and lock the output directory (rank 0); remove temp files of dead writers. The
    lock remembers what it created (``created``: its lock file and the folders makedirs made,
    deepest first), so a run
    refused before writing anything can leave no trace (``_Run.close(undo=True)``)."""
    if not is_main:
        return None
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"output directory {output_dir} is a file; choose another --output-dir")
    try:
        created = _missing_folders(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        lock = DirectoryLock(output_dir)
        if not os.path.exists(lock.path):
            created.insert(0, lock.path)
        lock.acquire()
        lock.created = created
    except PermissionError:
        raise ConfigError(f"output directory {output_dir} is not writable (permission denied); "
                          f"choose another --output-dir") from None
    except OSError as exc:
        raise ConfigError(f"output directory {output_dir}: {exc.strerror or exc}; choose another --output-dir") from None
    for prefix in (".checkpoint-", ".tmp-"):
        remove_orphans(output_dir, prefix)
    return lock


def resolved_config(config: Config, plan: StepPlan) -> Dict[str, Any]:
    """``config.to_dict()`` with the plan's effective accumulation, betas and steps (what
    summary.json's ``config_resolved`` and a checkpoint's ``config`` record)."""
    values = config.to_dict()
    values["train"].update(gradient_accumulation=plan.gradient_accumulation, global_batch_size=None, steps=plan.steps)
    values["optimizer"].update(beta1=plan.betas[0], beta2=plan.betas[1])
    return values


class _Pending(NamedTuple):
    """A launched step whose numbers have not been read: its metrics (possibly device tensors),
    real [sequences, packs, tokens] and host seconds."""

    step: int
    metrics: Dict[str, Any]
    counts: List[float]
    seconds: float
    data_seconds: float


class _Run:
    """One invocation of the loop: the state its parts share, built in ``__init__`` (output
    directory, lock, checkpoint to resume) and ``_setup`` (task, plan, model, backend)."""

    def __init__(self, config: Config, backend, *, output_dir, resume, resume_force, show_progress, resolved=None):
        # Resolve (once: the caller's resolved run counts) before touching the process group, so
        # config mistakes are reported the same way in every process.
        world_size = planned_world_size(backend)
        if resolved is None or not resolved.matches(backend, world_size):
            resolved = resolve_run(config, backend, world_size)
        warnings = resolved.warnings
        # The run's own copy of the resolved config: tasks may shape it (e.g. one sequence per row
        # for the padded baseline); the caller's config and resolved run stay as given.
        config = copy.deepcopy(resolved.config)
        self.config, self.backend, self.resume, self.show_progress = config, backend, resume, show_progress
        self.resume_force = resume_force  # also lets a data source continue on changed data
        t = config.train
        self.given = config.to_dict()  # before any task shapes it: what a resume compares
        self.rank, self.world_size = setup_distributed(backend, t.collective_timeout_minutes)
        self.is_main = self.rank == 0
        for line in warnings if self.is_main else ():
            print(f"warning: {line}", file=sys.stderr)
        self.output_dir = output_dir or t.output_dir or os.path.join("runs", config.name)
        check_output_dir(self.output_dir, input_paths(config))  # not a file, not where an input is
        self.summary_path = os.path.join(self.output_dir, SUMMARY_NAME)
        self.data_wait = DataWait()
        self.logger: Optional[MetricsLogger] = None
        self.pending: List[_Pending] = []  # steps launched whose numbers are not read yet
        self.task_summary: Dict[str, Any] = {}  # the task's end-of-run results (eval, labels, hf_export)
        self.lock = _prepare_output_dir(self.output_dir, self.is_main)
        self.checkpointer = Checkpointer(self.output_dir, backend, world_size=self.world_size, is_main=self.is_main,
                                         given=self.given)
        try:
            self.state = self.checkpointer.load(resume, resume_force)
        except BaseException:
            self.close(undo=True)  # train() never sees this half-built run
            raise

    def close(self, undo: bool = False) -> None:
        """Release the output directory; ``undo``: also remove what the run created there (its lock
        file, the directory itself), for a run refused before it wrote anything."""
        if self.logger is not None:
            self.logger.close()
        if self.lock is None:
            return
        if undo:
            for path in self.lock.created:  # the lock file first, then the (then empty) directory
                try:
                    if path == self.lock.path:
                        os.remove(path)
                    else:
                        os.rmdir(path)
                except OSError:
                    pass
        self.lock.release()
        self.lock = None

    def execute(self) -> Dict[str, Any]:
        if not self._setup():
            return self._unchanged_summary()
        step = self._loop()
        self.logger.close()
        try:
            self.backend.sync_to_host()  # IPU: the weights live on the device
            self.task.finish(self.backend, self.model, self.output_dir, self.task_summary)  # eval, predictions, OUT/hf
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM after the last step: say what is left
            self._interrupted_finishing(step, getattr(exc, "signum", signal.SIGINT))
        result = self.summary("completed", step)
        line = self.data_wait.warning() if self.is_main else None
        if line:  # a completed run only: a stopped one says one line, why it stopped
            print(f"warning: {line}", file=sys.stderr, flush=True)
        self._closing_line(result)
        return result

    # -- setup --------------------------------------------------------------------------------
    def _setup(self) -> bool:
        """Build the run; False when a resumed run has nothing left to do."""
        config, backend, t = self.config, self.backend, self.config.train
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        # The task reads its data and resolves the config (checkpoint shape, labels).
        self.task = task = get_task(config)
        task.setup(rank=self.rank, world_size=self.world_size, show_progress=self.show_progress)
        # Data first: the packing factor of the data decides the hyperparameter adjustment.
        self.source = task.data_source("train", micro_batch_size=t.micro_batch_size, rank=self.rank,
                                       world_size=self.world_size)
        self.plan = plan = make_plan(config, backend, world_size=self.world_size,
                                     packing_factor=self.source.packing_factor, num_steps=task.num_steps)
        state = self.state
        if state is not None and state["step"] >= plan.steps:
            return False
        self.slow = self._warn_if_slow(plan, plan.steps - (state["step"] if state is not None else 0))
        self._setup_note("building the model")
        self.model = task.build_model()
        self._setup_note("building the optimizer")
        self.optimizer, self.scheduler = build_optimizer(config, self.model, plan.betas, steps=plan.steps)
        backend_state = None
        if state is not None:  # restored on the host, before the backend compiles anything
            self.model.load_state_dict(state["model"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            self.source.load_state_dict(state["data"][self.rank], force=self.resume_force)
            task.load_state_dict(state.get("task") or {})
            backend_state = self.checkpointer.backend_state(state, self.rank)
        self._setup_note(f"preparing the {backend.name} backend")
        backend.prepare(self.model, self.optimizer, plan, scheduler=self.scheduler, state=backend_state)
        # Held-out data, built once before the first step; evaluated every eval_every steps and at
        # the end (a task that must report validation metrics evaluates at the end regardless).
        self.evaluating = t.eval_every > 0 or task.always_evaluate
        if self.evaluating:
            self._setup_note("preparing the evaluation data")
            task.prepare_evaluation(micro_batch_size=t.micro_batch_size, rank=self.rank, world_size=self.world_size)
        self.start_step, totals = 0, None
        if state is not None:
            set_rng_state(state["rng"][self.rank])
            self.start_step, totals = state["step"], state["totals"]
            self.state = None  # free the host copy of the weights
        elif self.is_main and self.resume:
            print(f"note: no checkpoint in {self.output_dir}; starting from step 0", file=sys.stderr)
        self.throughput = Throughput(totals, start_step=self.start_step, total_steps=plan.steps)
        self.guard = DivergenceGuard([k for k in task.metric_names if k.endswith("loss")],
                                     t.max_consecutive_skipped_steps)
        self.logger = MetricsLogger(self.output_dir, is_main=self.is_main, task=task, total_steps=plan.steps,
                                    start_step=self.start_step, show_progress=self.show_progress,
                                    tensorboard=t.tensorboard, log_every=t.log_every)
        self._opening_line()
        return True

    def _warn_if_slow(self, plan: StepPlan, steps: int) -> bool:
        """One warning line, before the model is built, when a step would take many minutes on
        this backend (``loop.estimate``): a first run of phase2 on a CPU is hours per step. True
        when it warned (the set-up then says what it does: ``_setup_note``)."""
        if not self.is_main:
            return False
        packs = plan.micro_batches_per_step * plan.micro_batch_size  # this process's share of a step
        line = slow_step_warning(self.config, packs_per_step=packs, steps=steps, rate=self.backend.compute_rate,
                                 backend_name=self.backend.label)
        if line:
            print(f"warning: {line}", file=sys.stderr, flush=True)
        return bool(line)

    def _setup_note(self, what: str) -> None:
        """A run warned to be huge shows where its set-up is (building BERT-Large and its
        optimizer takes a minute on a busy CPU) and the memory it holds; a fast run says nothing."""
        if self.slow and self.show_progress:
            memory = memory_text()
            print(f"setup: {what}{f' ({memory})' if memory else ''}", flush=True)

    def _unchanged_summary(self) -> Dict[str, Any]:
        """A resumed run already at its last step: every file stays as it is (rewriting
        summary.json from an empty invocation would lose its first/last lines)."""
        step = self.state["step"]
        if self.is_main:
            print(f"note: {self.checkpointer.path} is at step {step} and train.steps={self.plan.steps}: nothing "
                  f"to do (raise --steps to continue)", file=sys.stderr)
        try:
            with open(self.summary_path) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            return {"status": "completed", "last_step": step, "checkpoint_step": step}
        if self.is_main and summary.get("status") == "interrupted" and summary.get("error"):
            print(f"note: the run was stopped: {summary['error']}", file=sys.stderr)  # e.g. while exporting
        return summary

    def _opening_line(self) -> None:
        if not (self.is_main and self.show_progress):
            return
        c, plan = self.config, self.plan
        if self.start_step:
            self.logger.write(f"resumed {c.name} from step {self.start_step} of {plan.steps} "
                              f"({self.checkpointer.path})")
            return
        self.logger.write(
            f"training {c.name} on {self.backend.label} x{self.world_size}: {plan.steps} steps of "
            f"{plan.micro_batches_per_step * self.world_size} x {plan.micro_batch_size} packs "
            f"(S={c.data.max_sequence_length}, K={c.data.max_sequences_per_pack}, "
            f"{plan.packing_factor:.2f} sequences/pack), output {self.output_dir}")

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> int:
        """Steps until the plan's last one (or a stop); returns the last step done.

        A step's numbers may stay on the device (``backend.train_step`` returns tensors): they are
        read, all pending steps at once, only where a step must be looked at (``_read_due``), and
        every step is checked for divergence then, in order."""
        plan, launched = self.plan, self.start_step
        self.feed = feed = Prefetcher(self.source, self.config.train.prefetch_micro_batches,
                                      transform=self.backend.stage_batch)
        self.data_wait.start()
        # One process may end a long step early on a stop signal; with several, a rank that left
        # mid-step would leave the others waiting in the step's gradient reduction.
        can_abandon = self.world_size == 1
        try:
            with StopSignals(self.logger.write, mid_step=can_abandon) as stop:
                progress = self.logger.progress
                watch = StepWatch(self.logger.write if progress.enabled else None, stop, total_steps=plan.steps,
                                  can_abandon=can_abandon, status=progress.status())
                self.backend.micro_batch_hook, self.backend.layer_hook = watch, watch.layer
                while launched < plan.steps:
                    calls = min(plan.steps_per_call, plan.steps - launched)
                    data_start = time.perf_counter()
                    try:
                        micro_batches = self._read(feed, plan.micro_batches_per_step * calls, watch)
                        data_seconds = time.perf_counter() - data_start
                        self.data_wait.add(data_seconds)
                        start = time.perf_counter()
                        watch.start(launched + 1, calls, len(micro_batches))
                        results = self.backend.train_step(micro_batches)
                    except StepAbandoned as exc:
                        self._abandon(launched, stop.signum, exc)
                    seconds = time.perf_counter() - start
                    results = results if isinstance(results, list) else [results]
                    per_step = len(micro_batches) // len(results)
                    for i, metrics in enumerate(results):
                        launched += 1
                        self.pending.append(_Pending(launched, metrics,
                                                     real_counts(micro_batches[i * per_step:(i + 1) * per_step]),
                                                     seconds / len(results), data_seconds / len(results)))
                    # Every rank stops at the same step: the flag is summed over ranks.
                    stopping = all_reduce_sum([float(stop.signum is not None)])[0] and launched < plan.steps
                    if stopping or any(self._read_due(p.step) for p in self.pending):
                        self._flush()
                    if stopping:
                        self._interrupt(launched, stop.signum or signal.SIGTERM)
        finally:
            self.data_wait.stop()
            self.backend.micro_batch_hook = self.backend.layer_hook = None
            feed.close()
        return launched

    @staticmethod
    def _read(feed, count: int, watch: StepWatch) -> List[Dict[str, Any]]:
        """The next call's ``count`` micro-batches; ``watch.read`` may drop the step on a stop."""
        micro_batches = []
        for index in range(count):
            micro_batches.append(next(feed))
            watch.read(index, count)
        return micro_batches

    def _read_due(self, step: int) -> bool:
        t = self.config.train
        return (step % t.log_every == 0 or step == self.plan.steps or self._checkpoint_every(step)
                or (self.evaluating and t.eval_every > 0 and step % t.eval_every == 0))

    def _flush(self) -> None:
        """Read the pending steps' numbers (one device synchronisation), check each, log each,
        then write the checkpoint when one of them was due: the weights and the data position are
        those after the last step launched (a call of several steps, IPU device_iterations,
        cannot be split)."""
        start = time.perf_counter()
        values = to_host([p.metrics for p in self.pending])
        share = (time.perf_counter() - start) / len(self.pending)  # waiting for the device: its steps' time
        for p, metrics in zip(self.pending, values):  # every step, before any line or checkpoint
            self._stop_if(p.step, self.guard.check_step(metrics))
        checkpoint_due = False
        for p, metrics in zip(self.pending, values):
            self._record(p.step, metrics, p.counts, p.seconds + share, p.data_seconds)
            checkpoint_due = checkpoint_due or self._checkpoint_every(p.step)
        last = self.pending[-1].step
        self.pending.clear()
        if checkpoint_due:
            self._checkpoint(last)

    def _record(self, step: int, metrics: Dict[str, Any], counts: List[float], seconds: float,
                data_seconds: float) -> None:
        """Count, evaluate when due, and log one step."""
        counts = all_reduce_sum(counts)
        line = {"step": step, **{key: metrics[key] for key in self.task.metric_names}}
        line.update({
            "sequences": int(counts[0]), "packs": int(counts[1]), "tokens": int(counts[2]),
            "seconds": seconds, "data_seconds": data_seconds,
            "sequences_per_second": counts[0] / seconds, "tokens_per_second": counts[2] / seconds,
        })
        # Backend-specific extras (learning_rate, grad_norm, loss_scale, ...) pass through.
        line.update({k: v for k, v in metrics.items() if k not in line and not k.startswith("num_")
                     and isinstance(v, (int, float))})
        notice, stop = self.guard.count_skipped(step, metrics)
        if notice:
            self.logger.note(notice)
        self._stop_if(step, stop)
        self.throughput.add(step, counts, seconds, data_seconds)
        t = self.config.train
        evaluated = self.evaluating and ((t.eval_every > 0 and step % t.eval_every == 0) or step == self.plan.steps)
        if evaluated:
            evaluation = self.task.evaluate(self.backend)
            line.update(evaluation)
            self._stop_if(step, self.guard.check_evaluation(line))
            self.logger.write(f"step {step}: eval {self.task.eval_text(evaluation)}")
            self.task.on_evaluation(step, evaluation, self.backend, self.model, self.output_dir)
        self.logger.log(step, line, force=evaluated or step == self.plan.steps)

    def _checkpoint_every(self, step: int) -> bool:
        every = self.config.train.checkpoint_every
        return every > 0 and (step % every == 0 or step == self.plan.steps)

    def _checkpoint(self, step: int) -> None:
        """The checkpoint of ``step``; a model with non-finite weights stops the run instead."""
        bad = self.checkpointer.write(step, model=self.model, scheduler=self.scheduler, source=self.feed,
                                      task=self.task, totals=self.throughput.totals,
                                      config=resolved_config(self.config, self.plan), plan=self._plan_record())
        if bad:
            self._stop_if(step, f"non-finite weights ({', '.join(bad[:3])})")

    def _plan_record(self) -> Dict[str, Any]:
        p = self.plan
        return {"micro_batch_size": p.micro_batch_size, "gradient_accumulation": p.gradient_accumulation,
                "replicas_per_process": p.replicas_per_process, "world_size": p.world_size, "steps": p.steps,
                "steps_per_call": p.steps_per_call, "betas": list(p.betas), "packing_factor": p.packing_factor}

    # -- the ways a run ends ------------------------------------------------------------------
    def _stop_if(self, step: int, reason: Optional[str]) -> None:
        """Stop the run at ``step`` as diverged when there is a ``reason``."""
        if reason is None:
            return
        saved = self.checkpointer.last_step
        kept = (f"last good checkpoint {self.checkpointer.path} (step {saved})" if saved
                else "no checkpoint was written before it")
        message = f"step {step}: {reason}: training diverged and was stopped; {kept}"
        self.logger.close()
        self.summary("diverged", step - 1, message)
        raise DivergenceError(message)

    def _interrupt(self, step: int, signum: int) -> None:
        if self.checkpointer.last_step != step:
            self._checkpoint(step)
        self.logger.close()
        message = (f"{signal.Signals(signum).name} at step {step} of {self.plan.steps}: checkpoint "
                   f"{self.checkpointer.path} written; continue with --resume")
        self.summary("interrupted", step, message)
        raise Interrupted(message, signum)

    def _abandon(self, step: int, signum: int, exc: StepAbandoned) -> None:
        """A stop signal inside a step that would take long to finish (``loop.within_step``): the
        partial step is dropped (no update was applied) and no checkpoint is written now, since
        the data position and RNG streams are already inside the dropped step; the last written
        checkpoint stays, and a resume from it reproduces the uninterrupted run exactly."""
        if self.pending:  # the finished steps' numbers: checked and logged
            self._flush()
        self.logger.close()
        saved = self.checkpointer.last_step
        kept = (f"the checkpoint {self.checkpointer.path} (step {saved}) is kept: --resume continues from step "
                f"{saved + 1}" if saved else "no checkpoint was written yet: a new run starts from step 1")
        message = (f"{signal.Signals(signum).name} during step {step + 1} of {self.plan.steps}, {exc.where}: "
                   f"the unfinished step was dropped; {kept}")
        self.summary("interrupted", step, message)
        raise Interrupted(message, signum)

    def _interrupted_finishing(self, step: int, signum: int = signal.SIGINT) -> None:
        """SIGINT (or SIGTERM) while the end-of-run outputs were being written (the final evaluation's results,
        predictions, OUT/hf): summary.json says so, and where the trained weights are (the model
        may hold the best evaluation's weights by then, so no checkpoint is written now)."""
        if self.checkpointer.last_step == step:
            kept = (f"the checkpoint {self.checkpointer.path} holds step {step} (python -m bert_packed.finetune "
                    f"export {self.output_dir} --output DIR writes its Hugging Face export)")
        else:
            kept = f"no checkpoint holds step {step} (train.checkpoint_every={self.config.train.checkpoint_every})"
        message = (f"{signal.Signals(signum).name} after the last step ({step}), while the end-of-run outputs (final "
                   f"evaluation, predictions, OUT/hf) were written: they are incomplete; {kept}")
        self.summary("interrupted", step, message)
        raise Interrupted(message, signum) from None

    def summary(self, status: str, step: int, error: Optional[str] = None) -> Dict[str, Any]:
        """summary.json (written by the main process) and its dict."""
        c, plan, totals = self.config, self.plan, self.throughput.totals
        out = {
            "status": status, "error": error,
            "config": c.name, "backend": self.backend.name, "world_size": self.world_size, "steps": plan.steps,
            "last_step": step, "micro_batch_size": plan.micro_batch_size,
            "gradient_accumulation": plan.gradient_accumulation,
            "packs_per_step": plan.micro_batches_per_step * self.world_size * plan.micro_batch_size,
            "max_sequence_length": c.data.max_sequence_length,
            "max_sequences_per_pack": c.data.max_sequences_per_pack,
            "packing_algorithm": c.data.packing_algorithm, "packing_factor": plan.packing_factor,
            "packing_adjustment": c.train.packing_adjustment, "betas": list(plan.betas),
            "data_packing": self.source.packing,
            "total_sequences": totals["sequences"], "total_tokens": totals["tokens"],
            "total_packs": totals["packs"],
            "train_seconds": totals["seconds"], "data_seconds": totals["data_seconds"],
            "data_wait_fraction": self.data_wait.fraction(),  # of this invocation's loop (loop.data_wait)
            # Throughput of this invocation without its first (warm-up) step.
            "sequences_per_second": self.throughput.rate("sequences"),
            "tokens_per_second": self.throughput.rate("tokens"),
            "first": self.logger.first_line, "last": self.logger.last_line,
            "resumed_from_step": self.start_step or None,
            "checkpoint_step": self.checkpointer.last_step,
            "task": self.task.name,
            "config_resolved": resolved_config(c, plan),
            **self.task_summary,
        }
        if self.is_main:
            write_text_atomic(self.summary_path, json.dumps(out, indent=2) + "\n")
        return out

    def _closing_line(self, result: Dict[str, Any]) -> None:
        first, last = self.logger.first_line, self.logger.last_line
        if not (self.is_main and self.show_progress and first is not None):
            return
        key, task = self.task.headline_metric, self.task
        evaluated = f" (eval {last['eval_' + key]:.3f})" if "eval_" + key in last else ""
        if "eval" in result:
            evaluated = f"; eval {task.eval_text({'eval_' + k: v for k, v in result['eval'].items() if k != 'step'})}"
        rate = f"{result['sequences_per_second']:.0f}" if result["sequences_per_second"] else "n/a"
        print(f"done: steps {first['step']}-{last['step']} in {self.throughput.totals['seconds']:.0f} s of training; "
              f"{key} {first[key]:.3f} -> {last[key]:.3f}{evaluated}; {rate} sequences/s; {self.logger.path}",
              flush=True)
