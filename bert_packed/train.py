"""The training loop: data -> backend.train_step -> metrics, evaluation, checkpoints.

One *step* is one optimizer update over the global batch: ``gradient_accumulation``
micro-batches of ``micro_batch_size`` packs on every data-parallel replica. The backend
owns the step (see backends/base.py); this module owns everything around it:

- builds the data source (generated or HDF5), measures the packing factor p and applies
  the configured packing hyperparameter adjustment (divide gradient accumulation by p,
  or LAMB betas ** p), builds the model, optimizer and learning-rate schedule;
- logs one JSON line per logged step to ``metrics.jsonl`` (DESIGN §5 fields) and writes
  ``summary.json`` at the end; throughput counts REAL sequences and tokens (not packs,
  not padding), timed around ``train_step`` (data generation excluded, reported apart);
- evaluates every ``eval_every`` steps on held-out data (fields ``eval_*`` in that
  step's line);
- what is trained and how it is judged is a *task* (``bert_packed.task``): pre-training,
  or a fine-tuning task (``finetune.task``); the task gives the model, the data, the
  metric keys of each line, the evaluation and the end-of-run outputs (``OUT/hf``);
- checkpoints atomically every ``checkpoint_every`` steps; ``resume=True`` continues
  from the last checkpoint exactly: same weights, optimizer moments, schedule position,
  data position and RNG states, so steps k+1... reproduce an uninterrupted run.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import os
import random
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from bert_packed.checkpoint import (CHECKPOINT_NAME, RESUME_HARMLESS_KEYS, CheckpointError, config_differences,
                                    load_checkpoint, rng_state, save_checkpoint, set_rng_state)
from bert_packed.config import Config, ConfigError, gradient_accumulation, num_replicas, validate
from bert_packed.io import DirectoryLock, remove_orphans, write_text_atomic
from bert_packed.task import get_task

METRICS_NAME, SUMMARY_NAME = "metrics.jsonl", "summary.json"


# ---------------------------------------------------------------------------------------
# Building blocks


def setup_distributed(backend, timeout_minutes: float = 10.0) -> tuple:
    """(rank, world_size); joins the torchrun process group when launched by torchrun.

    ``backend`` is the backend object (its class attributes are read): one with its own
    launcher (the IPU's PopRun) reports its shard through ``process_shard()`` ->
    (instance index, number of instances) or None; ``dist_backend`` names the process
    group's backend (gloo by default). A collective that waits longer than ``timeout_minutes``
    (a hung or dead rank) raises instead of blocking for gloo's/NCCL's default 30 minutes."""
    shard = getattr(backend, "process_shard", None)
    shard = shard() if callable(shard) else None
    if shard is not None:
        return int(shard[0]), int(shard[1])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=getattr(backend, "dist_backend", "gloo"),
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def bert_config(config: Config, **overrides):
    """The model's ``BertConfig``: the model section, the data section's packed shapes, ``overrides``."""
    from bert_packed.modeling import BertConfig, ModelConfigError

    names = {f.name for f in dataclasses.fields(BertConfig)}
    values = {k: v for k, v in dataclasses.asdict(config.model).items() if k in names}
    values["max_sequences_per_pack"] = config.data.max_sequences_per_pack
    values["max_masked_tokens_per_pack"] = config.data.max_masked_tokens_per_pack
    try:
        return BertConfig(**{**values, **overrides})
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from None


def build_model(config: Config):
    """BertForPreTraining from the model section plus the data section's packed shapes."""
    from bert_packed.modeling import BertForPreTraining

    return BertForPreTraining(bert_config(config))


def adjust_for_packing(config: Config, packing_factor: float, base_accumulation: int):
    """(gradient_accumulation, (beta1, beta2)) after train.packing_adjustment with p."""
    from bert_packed import optim

    o = config.optimizer
    return optim.adjust_for_packing(
        config.train.packing_adjustment, packing_factor=packing_factor,
        gradient_accumulation=base_accumulation, betas=(o.beta1, o.beta2),
    )


def build_optimizer(config: Config, model, betas=None):
    """(optimizer, schedule) of the optimizer section; ``betas`` default to its beta1, beta2."""
    from bert_packed import optim

    o = config.optimizer
    betas = (o.beta1, o.beta2) if betas is None else betas
    optimizer = optim.build_optimizer(model, o.name, lr=o.learning_rate, betas=betas, eps=o.eps,
                                      weight_decay=o.weight_decay, max_weight_norm=o.max_weight_norm,
                                      bias_max_weight_norm=o.bias_max_weight_norm)
    scheduler = optim.build_schedule(optimizer, o.schedule, warmup_fraction=o.warmup_fraction,
                                     total_steps=config.train.steps)
    return optimizer, scheduler


def _truncate_metrics(path: str, last_step: int) -> None:
    """Keep only the lines of steps <= last_step (a resumed run rewrites the rest)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError):
            break  # a torn last line from the kill
    write_text_atomic(path, "".join(kept))


def _all_reduce_sum(values: List[float]) -> List[float]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()
    return list(values)


def _gather(obj: Any) -> List[Any]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _real_counts(micro_batches) -> List[float]:
    """[sequences, packs, tokens] actually present (padding excluded), for any task's batches:
    the sequences of a pack are numbered 1..k in ``sequence_ids``, so its largest id counts them."""
    return [float(sum(b["sequence_ids"].max(axis=1).sum() for b in micro_batches)),
            float(sum(b["input_ids"].shape[0] for b in micro_batches)),
            float(sum((b["sequence_ids"] > 0).sum() for b in micro_batches))]


class _Progress:
    """tqdm on a terminal; plain lines (every ``every`` steps) when piped to a file."""

    def __init__(self, total: int, initial: int, enabled: bool, task):
        self.total, self.enabled, self.task = total, enabled, task
        self.bar = None
        self.every = max(1, total // 20)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int, line: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        text = self.task.progress_text(line)
        if self.bar is not None:  # short: the bar shares one terminal line with it
            self.bar.set_postfix_str(self.task.progress_text(line, short=True), refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total or step == 1:
            print(f"step {step:>5}/{self.total} | {text}", flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------
# Stopping early


class TrainingStopped(Exception):
    """The run stopped before its last step on purpose; ``str(exc)`` is one line for the user,
    ``exit_code`` what the command line exits with, ``label`` how that line starts."""

    exit_code, label = 1, "error"


class DivergenceError(TrainingStopped):
    """A non-finite loss / gradient norm / weight, or too many skipped steps in a row. The last
    good checkpoint is kept and summary.json says what happened."""

    exit_code = 3


class Interrupted(TrainingStopped):
    """SIGINT / SIGTERM: the run stopped at a step boundary after writing a checkpoint."""

    label = "stopped"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)  # the shell's convention for "ended by signal N"


class CollectiveTimeout(TrainingStopped):
    """Distributed run: a collective outlived ``train.collective_timeout_minutes``."""


class _StopSignals:
    """SIGINT/SIGTERM set a flag the loop reads at the next step boundary; another one more than
    ``GRACE_SECONDS`` later aborts at once (KeyboardInterrupt). Signals within the grace period
    are the same request: Ctrl-C under torchrun reaches a worker twice, from the terminal and
    forwarded by the agent. Only in the main thread (handlers cannot be set elsewhere)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    GRACE_SECONDS = 2.0

    def __init__(self, announce):
        self.signum, self.announce, self.previous, self.when = None, announce, {}, 0.0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            if time.monotonic() - self.when > self.GRACE_SECONDS:
                raise KeyboardInterrupt
            return
        self.signum, self.when = signum, time.monotonic()
        try:
            self.announce(f"{signal.Signals(signum).name}: stopping after this step (a checkpoint is written); "
                          f"send it again to abort at once")
        except RuntimeError:  # the signal interrupted a write to the same stream: skip the notice
            pass

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        return False


def _non_finite(metrics: Dict[str, Any]) -> Optional[str]:
    """'loss nan' for the first non-finite value the step must not have, else None. A step the
    backend skipped on purpose (fp16 loss scaling) may have a non-finite gradient norm."""
    keys = ["loss", "mlm_loss", "nsp_loss"] + ([] if metrics.get("skipped_step") else ["grad_norm"])
    for key in keys:
        value = metrics.get(key)
        if value is not None and not math.isfinite(float(value)):
            return f"{key} {float(value)}"
    return None


def _non_finite_weights(model) -> List[str]:
    return [name for name, tensor in model.state_dict().items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


# ---------------------------------------------------------------------------------------
# The loop


def train(config: Config, backend, *, output_dir: Optional[str] = None, resume: bool = False,
          resume_force: bool = False, show_progress: bool = True) -> Dict[str, Any]:
    """Train ``config`` on ``backend`` (an unprepared backend object, see backends/base.py;
    ``run.py`` resolves names with ``backends.get_backend``); returns the summary (also in
    summary.json).

    ``resume``: continue from the checkpoint in ``output_dir`` (a directory holding one is
    refused without it). A checkpoint whose configuration differs in keys that change the
    computation is refused (listing them) unless ``resume_force``. Raises ``ConfigError`` /
    ``CheckpointError`` / ``DataError`` (ValueErrors, one line) for user mistakes,
    ``DivergenceError`` on a non-finite step, ``Interrupted`` after SIGINT/SIGTERM."""
    if isinstance(backend, str):
        raise TypeError(f"train() takes a backend object, not the name {backend!r}: "
                        f"resolve it with backends.get_backend({backend!r})")
    threads = torch.get_num_threads()
    # The run writes its effective (packing-adjusted) accumulation and betas into the config
    # it works on; a copy keeps the caller's config as given, so a second run adjusts once.
    config = copy.deepcopy(config)
    lock = None
    try:
        run = _Run(config, backend, output_dir=output_dir, resume=resume, resume_force=resume_force,
                   show_progress=show_progress)
        lock = run.lock
        return run.train()
    except RuntimeError as exc:
        # gloo/NCCL report a collective that outlived train.collective_timeout_minutes as a
        # RuntimeError; say what it means instead of a traceback from deep inside torch.
        if dist.is_available() and dist.is_initialized() and "timed out" in str(exc).lower().replace("timeout", "timed out"):
            raise CollectiveTimeout(
                f"a collective between the {dist.get_world_size()} processes timed out after "
                f"train.collective_timeout_minutes={config.train.collective_timeout_minutes:g}: another rank hung "
                f"or died (see its log); the last checkpoint is intact") from None
        raise
    finally:  # train.num_threads is for this run only (callers in the same process keep theirs)
        torch.set_num_threads(threads)
        if lock is not None:
            lock.release()


def _prepare_output_dir(output_dir: str, is_main: bool) -> Optional[DirectoryLock]:
    """Create and lock the output directory (rank 0); remove temp files of dead writers."""
    if not is_main:
        return None
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"output directory {output_dir} is a file; choose another --output-dir")
    try:
        os.makedirs(output_dir, exist_ok=True)
        lock = DirectoryLock(output_dir).acquire()
    except PermissionError:
        raise ConfigError(f"output directory {output_dir} is not writable (permission denied); "
                          f"choose another --output-dir") from None
    except OSError as exc:
        raise ConfigError(f"output directory {output_dir}: {exc.strerror or exc}; choose another --output-dir") from None
    for prefix in (".checkpoint-", ".tmp-"):
        remove_orphans(output_dir, prefix)
    return lock


def _refuse_output_over_input(output_dir: str, init_checkpoint: Optional[str]) -> None:
    """The run's outputs (checkpoint.pt, OUT/hf, OUT/best, ...) must not land in the checkpoint it starts from."""
    if not init_checkpoint:
        return
    source = init_checkpoint if os.path.isdir(init_checkpoint) else os.path.dirname(init_checkpoint) or "."
    if os.path.realpath(source) == os.path.realpath(output_dir):
        raise ConfigError(f"--output-dir {output_dir} is the init checkpoint's directory ({init_checkpoint}); "
                          f"choose another --output-dir so the checkpoint stays as it is")


class _Run:
    """One invocation of the loop (state shared by its phases)."""

    def __init__(self, config: Config, backend, *, output_dir, resume, resume_force, show_progress):
        self.config, self.backend, self.resume, self.show_progress = config, backend, resume, show_progress
        t = config.train
        self.given = config.to_dict()  # before the packing adjustment: what resume compares
        # Validate before touching the process group, so config mistakes are reported once,
        # the same way in every process.
        validate(config, backend.name, int(os.environ.get("WORLD_SIZE", "1")))
        self.rank, self.world_size = setup_distributed(backend, t.collective_timeout_minutes)
        self.is_main = self.rank == 0
        for line in validate(config, backend.name, self.world_size) if self.is_main else ():
            print(f"warning: {line}", file=sys.stderr)
        self.output_dir = output_dir or t.output_dir or os.path.join("runs", config.name)
        _refuse_output_over_input(self.output_dir, config.model.init_checkpoint)
        self.metrics_path = os.path.join(self.output_dir, METRICS_NAME)
        self.summary_path = os.path.join(self.output_dir, SUMMARY_NAME)
        self.checkpoint_path = os.path.join(self.output_dir, CHECKPOINT_NAME)
        self.lock = _prepare_output_dir(self.output_dir, self.is_main)
        self.state = None
        try:
            if os.path.exists(self.checkpoint_path):
                if not resume:
                    raise ConfigError(
                        f"{self.output_dir} already holds a checkpoint ({CHECKPOINT_NAME}); pass --resume to "
                        f"continue that run, choose another --output-dir, or delete {self.output_dir} to start over "
                        f"(nothing was changed)")
                self.state = load_checkpoint(self.checkpoint_path)
                self._check_resumable(self.state, resume_force)
        except BaseException:
            if self.lock is not None:  # train() never sees this half-built run
                self.lock.release()
            raise

    def _check_resumable(self, state: Dict[str, Any], force: bool) -> None:
        path = self.checkpoint_path
        saved_backend = state.get("backend", self.backend.name)
        if saved_backend != self.backend.name:
            raise CheckpointError(
                f"{path} was written by backend {saved_backend!r}, this run uses {self.backend.name!r}: optimizer "
                f"state does not carry over between backends; resume with --backend {saved_backend}")
        if state["world_size"] != self.world_size:
            raise CheckpointError(f"{path} was written by {state['world_size']} processes, this run has "
                                  f"{self.world_size}; resume with the same number of processes")
        changed = config_differences(state.get("config_given", {}), self.given)
        refused = [key for key in changed if key not in RESUME_HARMLESS_KEYS]
        if refused and not force:
            raise CheckpointError(
                f"{path}: the configuration differs from the checkpoint's in {', '.join(refused)}; that would "
                f"change the computation, so resuming is refused (restore them, or pass --resume-force)")
        if self.is_main:
            for key in changed:
                section, name = key.split(".", 1)
                old = state.get("config_given", {}).get(section, {}).get(name)
                note = " (forced)" if key in refused else ""
                print(f"note: resuming with {key} changed from {old!r} to "
                      f"{self.given.get(section, {}).get(name)!r}{note}", file=sys.stderr)

    def train(self) -> Dict[str, Any]:
        config, backend, t = self.config, self.backend, self.config.train
        rank, world_size, is_main = self.rank, self.world_size, self.is_main
        backend_name = backend.name
        output_dir, metrics_path, checkpoint_path = self.output_dir, self.metrics_path, self.checkpoint_path

        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)

        # The task reads its data and resolves the config (checkpoint shape, labels, steps).
        task = get_task(config)
        task.setup(rank=rank, world_size=world_size, show_progress=self.show_progress)
        # Data first: the packing factor of the data decides the hyperparameter adjustment.
        source = task.data_source("train", micro_batch_size=t.micro_batch_size, rank=rank, world_size=world_size)
        packing_factor = t.packing_factor or source.packing_factor
        base_accumulation = gradient_accumulation(config, backend_name, world_size)
        accumulation, betas = adjust_for_packing(config, packing_factor, base_accumulation)
        # The backends read the effective values from the config.
        config.train.gradient_accumulation, config.train.global_batch_size = accumulation, None
        config.optimizer.beta1, config.optimizer.beta2 = betas
        steps = task.num_steps(accumulation * num_replicas(config, backend_name, world_size) * t.micro_batch_size)
        if steps != t.steps and backend_name in ("ipu", "mock"):  # one PopTorch call runs device_iterations steps
            steps = -(-steps // config.ipu.device_iterations) * config.ipu.device_iterations
        t.steps = steps
        # (After the task has resolved train.steps: fine-tuning derives them from its epochs.)
        if self.state is not None and self.state["step"] >= t.steps:
            # Nothing to train: leave every file as it is (rewriting summary.json from an empty
            # invocation would lose its first/last lines).
            if is_main:
                print(f"note: {checkpoint_path} is at step {self.state['step']} and train.steps={t.steps}: nothing "
                      f"to do (raise --steps to continue)", file=sys.stderr)
            try:
                with open(self.summary_path) as f:
                    return json.load(f)
            except (OSError, ValueError):
                return {"status": "completed", "last_step": self.state["step"], "checkpoint_step": self.state["step"]}

        model = task.build_model()
        optimizer, scheduler = build_optimizer(config, model)  # the adjusted betas, set above
        backend.prepare(model, optimizer, config, scheduler=scheduler)
        micro_batches_per_step = getattr(backend, "micro_batches_per_step", accumulation)
        steps_per_call = getattr(backend, "steps_per_call", 1)

        # Held-out data, built once before the first step; evaluated every eval_every steps and at
        # the end (a task that must report validation metrics evaluates at the end regardless).
        evaluating = t.eval_every > 0 or task.always_evaluate
        if evaluating:
            task.prepare_evaluation(micro_batch_size=t.micro_batch_size, rank=rank, world_size=world_size)

        start_step, totals = 0, {"sequences": 0.0, "packs": 0.0, "tokens": 0.0, "seconds": 0.0, "data_seconds": 0.0}
        state = self.state
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None and state.get("scheduler") is not None:
                scheduler.load_state_dict(state["scheduler"])
            source.load_state_dict(state["data"][rank])
            task.load_state_dict(state.get("task") or {})
            set_rng_state(state["rng"][rank])
            start_step, totals = state["step"], state["totals"]
            self.state = state = None  # free the host copy of the weights
            if is_main:
                _truncate_metrics(metrics_path, start_step)
        elif is_main:
            if self.resume:
                print(f"note: no checkpoint in {output_dir}; starting from step 0", file=sys.stderr)
            open(metrics_path, "w").close()

        writer = None
        if is_main and t.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except Exception:  # tensorboard not installed: optional
                writer = None

        progress = _Progress(t.steps, start_step, enabled=is_main and self.show_progress, task=task)
        if is_main and self.show_progress and start_step == 0:
            progress.write(
                f"training {config.name} on {backend_name} x{world_size}: {t.steps} steps of "
                f"{micro_batches_per_step * world_size} x {t.micro_batch_size} packs "
                f"(S={config.data.max_sequence_length}, K={config.data.max_sequences_per_pack}, "
                f"{packing_factor:.2f} sequences/pack), output {output_dir}")
        if is_main and self.show_progress and start_step > 0:
            progress.write(f"resumed {config.name} from step {start_step} of {t.steps} ({checkpoint_path})")

        def summary(status: str, step: int, error: Optional[str] = None) -> Dict[str, Any]:
            out = {
                "status": status, "error": error,
                "config": config.name, "backend": backend_name, "world_size": world_size, "steps": t.steps,
                "last_step": step, "micro_batch_size": t.micro_batch_size, "gradient_accumulation": accumulation,
                "packs_per_step": micro_batches_per_step * world_size * t.micro_batch_size,
                "max_sequence_length": config.data.max_sequence_length,
                "max_sequences_per_pack": config.data.max_sequences_per_pack,
                "packing_algorithm": config.data.packing_algorithm, "packing_factor": packing_factor,
                "packing_adjustment": t.packing_adjustment, "betas": list(betas),
                "data_packing": getattr(source, "packing", None),
                "total_sequences": totals["sequences"], "total_tokens": totals["tokens"],
                "total_packs": totals["packs"],
                "train_seconds": totals["seconds"], "data_seconds": totals["data_seconds"],
                # Throughput of this invocation without its first (warm-up) step.
                "sequences_per_second": timed["sequences"] / timed["seconds"] if timed["seconds"] else None,
                "tokens_per_second": timed["tokens"] / timed["seconds"] if timed["seconds"] else None,
                "first": first_line, "last": last_line,
                "resumed_from_step": start_step if start_step else None,
                "checkpoint_step": checkpoint_step,
                "task": task.name,
                "config_resolved": config.to_dict(),
                **task_summary,
            }
            if is_main:
                write_text_atomic(self.summary_path, json.dumps(out, indent=2) + "\n")
            return out

        def stop_diverged(step: int, what: str) -> None:
            kept = (f"last good checkpoint {checkpoint_path} (step {checkpoint_step})" if checkpoint_step
                    else "no checkpoint was written before it")
            message = f"step {step}: {what}: training diverged and was stopped; {kept}"
            progress.close()
            summary("diverged", step - 1, message)
            raise DivergenceError(message)

        def write_checkpoint(step: int) -> int:
            """The checkpoint of ``step`` (returned); a model with non-finite weights stops the run instead."""
            bad_weights = _checkpoint(backend, checkpoint_path, step, model, optimizer, scheduler, source, totals,
                                      config, self.given, world_size, is_main, task)
            if bad_weights:
                stop_diverged(step, f"non-finite weights ({', '.join(bad_weights[:3])})")
            return step

        iterator = iter(source)
        task_summary: Dict[str, Any] = {}  # the task's end-of-run results (eval, labels, hf_export)
        first_line = last_line = None
        checkpoint_step = start_step or None  # start_step > 0 only after loading checkpoint_path
        step = start_step
        skipped_in_a_row = 0
        checkpoint_due = False
        timed = {"sequences": 0.0, "tokens": 0.0, "seconds": 0.0}  # this invocation, first step excluded
        with _StopSignals(progress.write) as stop:
            while step < t.steps:
                calls = min(steps_per_call, t.steps - step)
                data_start = time.perf_counter()
                micro_batches = [next(iterator) for _ in range(micro_batches_per_step * calls)]
                data_seconds = time.perf_counter() - data_start
                start = time.perf_counter()
                results = backend.train_step(micro_batches)
                seconds = time.perf_counter() - start
                results = results if isinstance(results, list) else [results]
                # Every step of the call is checked before any line or checkpoint is written.
                for i, metrics in enumerate(results):
                    bad = _non_finite(metrics)
                    if bad is not None:
                        stop_diverged(step + i + 1, f"non-finite {bad}")
                per_step = len(micro_batches) // len(results)
                for i, metrics in enumerate(results):
                    step += 1
                    counts = _all_reduce_sum(_real_counts(micro_batches[i * per_step:(i + 1) * per_step]))
                    step_seconds = seconds / len(results)
                    line = {"step": step, **{key: metrics[key] for key in task.metric_names}}
                    line.update({
                        "sequences": int(counts[0]), "packs": int(counts[1]), "tokens": int(counts[2]),
                        "seconds": step_seconds, "data_seconds": data_seconds / len(results),
                        "sequences_per_second": counts[0] / step_seconds, "tokens_per_second": counts[2] / step_seconds,
                    })
                    # Backend-specific extras (learning_rate, grad_norm, loss_scale, ...) pass through.
                    line.update({k: v for k, v in metrics.items() if k not in line and not k.startswith("num_")
                                 and isinstance(v, (int, float))})
                    if metrics.get("skipped_step"):
                        skipped_in_a_row += 1
                        notice = (f"step {step}: update skipped by loss scaling (gradient overflow; loss scale now "
                                  f"{metrics.get('loss_scale', 'lowered')}), {skipped_in_a_row} in a row")
                        if progress.enabled:
                            progress.write(notice)
                        elif is_main:  # the log says so even without progress output
                            print(f"note: {notice}", file=sys.stderr)
                        if skipped_in_a_row >= t.max_consecutive_skipped_steps:
                            stop_diverged(step, f"{skipped_in_a_row} consecutive updates skipped by loss scaling "
                                                f"(train.max_consecutive_skipped_steps={t.max_consecutive_skipped_steps})")
                    else:
                        skipped_in_a_row = 0
                    for key, total in zip(("sequences", "packs", "tokens"), counts):
                        totals[key] += total
                    totals["seconds"] += step_seconds
                    totals["data_seconds"] += line["data_seconds"]
                    if step > start_step + 1 or t.steps - start_step == 1:
                        timed["sequences"] += counts[0]
                        timed["tokens"] += counts[2]
                        timed["seconds"] += step_seconds
                    evaluated = evaluating and ((t.eval_every > 0 and step % t.eval_every == 0) or step == t.steps)
                    if evaluated:
                        evaluation = task.evaluate(backend)
                        line.update(evaluation)
                        bad = _non_finite({"loss": line["eval_loss"]})
                        if bad is not None:
                            stop_diverged(step, f"non-finite eval_{bad}")
                        progress.write(f"step {step}: eval {task.eval_text(evaluation)}")
                        task.on_evaluation(step, evaluation, backend, model, output_dir)
                    first_line = first_line or line
                    last_line = line
                    # An evaluated step is always written: its eval_* fields exist only in this line.
                    if is_main and (step % t.log_every == 0 or step == t.steps or evaluated):
                        with open(metrics_path, "a") as f:
                            f.write(json.dumps(line) + "\n")
                        if writer is not None:
                            for key, value in line.items():
                                if key != "step":
                                    writer.add_scalar(key, value, step)
                    progress.update(step, line)
                    checkpoint_due = checkpoint_due or (t.checkpoint_every > 0 and (
                        step % t.checkpoint_every == 0 or step == t.steps))
                # At the end of the call: the weights and the data position are those after its
                # last step (a call of several steps, IPU device_iterations, cannot be split).
                if checkpoint_due:
                    checkpoint_due = False
                    checkpoint_step = write_checkpoint(step)
                # Every rank stops at the same step: the flag is summed over ranks.
                if _all_reduce_sum([float(stop.signum is not None)])[0] and step < t.steps:
                    signum = stop.signum or signal.SIGTERM
                    if checkpoint_step != step:
                        checkpoint_step = write_checkpoint(step)
                    progress.close()
                    message = (f"{signal.Signals(signum).name} at step {step} of {t.steps}: checkpoint "
                               f"{checkpoint_path} written; continue with --resume")
                    summary("interrupted", step, message)
                    raise Interrupted(message, signum)
        progress.close()
        if writer is not None:
            writer.close()

        sync_to_host = getattr(backend, "sync_to_host", None)  # IPU: weights live on the device
        if callable(sync_to_host):
            sync_to_host()
        task.finish(backend, model, output_dir, task_summary)  # eval metrics, predictions, OUT/hf
        result = summary("completed", step)
        if is_main and self.show_progress and first_line is not None:
            key = task.headline_metric
            evaluated = f" (eval {last_line['eval_' + key]:.3f})" if "eval_" + key in last_line else ""
            if "eval" in result:
                evaluated = f"; eval {task.eval_text({'eval_' + k: v for k, v in result['eval'].items() if k != 'step'})}"
            rate = f"{result['sequences_per_second']:.0f}" if result["sequences_per_second"] else "n/a"
            print(f"done: steps {first_line['step']}-{last_line['step']} in {totals['seconds']:.0f} s of training; "
                  f"{key} {first_line[key]:.3f} -> {last_line[key]:.3f}{evaluated}; "
                  f"{rate} sequences/s; {metrics_path}", flush=True)
        return result


def _checkpoint(backend, path, step, model, optimizer, scheduler, source, totals, config, given, world_size,
                is_main, task) -> List[str]:
    """Write the checkpoint of ``step``; returns the names of non-finite weights instead (and
    writes nothing) when there are any, so the file on disk is always the last good state."""
    # Every rank contributes its data position and RNG state; rank 0 writes the file.
    sync_to_host = getattr(backend, "sync_to_host", None)  # IPU: weights live on the device
    if callable(sync_to_host):
        sync_to_host()
    bad = _non_finite_weights(model)
    if bad:
        return bad
    data_states = _gather(source.state_dict())
    rng_states = _gather(rng_state())
    if is_main:
        save_checkpoint(path, {
            "step": step, "world_size": world_size, "backend": backend.name, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "data": data_states, "rng": rng_states, "totals": dict(totals), "config": config.to_dict(),
            "config_given": given, "task": task.state_dict(),
        })
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return []
