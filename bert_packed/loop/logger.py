"""The metrics logger: ``metrics.jsonl`` (one JSON line per logged step), TensorBoard, the
progress bar or progress lines, and the throughput counters behind them.

Throughput counts REAL sequences and tokens (not packs, not padding), timed around
``train_step`` (data generation excluded, reported apart); the rate of an invocation leaves
out its first (warm-up) step.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional

from bert_packed.backend import Deferred, StepMetrics
from bert_packed.io.files import write_text_atomic

METRICS_NAME = "metrics.jsonl"


def to_host(steps: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The steps' metrics with every tensor value read as a python float, all in one transfer
    per device (a backend may leave a step's numbers on the device: no synchronisation inside
    the step; they are read here, where the loop must look at them), then every ``Deferred``
    value worked out (by then the device is past them)."""
    import torch

    steps = [metrics.raw if isinstance(metrics, StepMetrics) else metrics for metrics in steps]  # unread values
    tensors: Dict[Any, List[Any]] = {}
    for i, metrics in enumerate(steps):
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(value.device, []).append((i, key, value))
    out = [dict(metrics) for metrics in steps]
    for entries in tensors.values():
        read = torch.stack([value.detach().reshape(()).double() for _, _, value in entries]).cpu().tolist()
        for (i, key, _), number in zip(entries, read):
            out[i][key] = number
    for step in out:
        for key, value in step.items():
            if isinstance(value, Deferred):
                step[key] = value.item()
    return out


def real_counts(micro_batches) -> List[float]:
    """[sequences, packs, tokens] actually present (padding excluded), for any task's batches:
    the sequences of a pack are numbered 1..k in ``sequence_ids``, so its largest id counts them."""
    return [float(sum(b["sequence_ids"].max(axis=1).sum() for b in micro_batches)),
            float(sum(b["input_ids"].shape[0] for b in micro_batches)),
            float(sum((b["sequence_ids"] > 0).sum() for b in micro_batches))]


class Throughput:
    """Running totals of a run (kept in checkpoints) and the timed share of this invocation."""

    def __init__(self, totals: Optional[Dict[str, float]] = None, *, start_step: int = 0, total_steps: int = 0):
        self.totals = dict(totals or {"sequences": 0.0, "packs": 0.0, "tokens": 0.0, "seconds": 0.0,
                                      "data_seconds": 0.0})
        self.timed = {"sequences": 0.0, "tokens": 0.0, "seconds": 0.0}  # this invocation, first step excluded
        self.start_step, self.total_steps = start_step, total_steps

    def add(self, step: int, counts: List[float], seconds: float, data_seconds: float) -> None:
        for key, total in zip(("sequences", "packs", "tokens"), counts):
            self.totals[key] += total
        self.totals["seconds"] += seconds
        self.totals["data_seconds"] += data_seconds
        if step > self.start_step + 1 or self.total_steps - self.start_step == 1:
            self.timed["sequences"] += counts[0]
            self.timed["tokens"] += counts[2]
            self.timed["seconds"] += seconds

    def rate(self, key: str) -> Optional[float]:
        """``sequences`` or ``tokens`` per second of this invocation, warm-up excluded."""
        return self.timed[key] / self.timed["seconds"] if self.timed["seconds"] else None


class Progress:
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

    def status(self) -> Optional[Callable[[str], None]]:
        """On a terminal, where a long step's own progress goes: the bar's postfix, redrawn (the
        bar itself moves once per step). None on a pipe, where it goes as lines instead."""
        if self.bar is None:
            return None
        return lambda text: self.bar is not None and self.bar.set_postfix_str(text, refresh=True)

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
            self.bar = None


def truncate_metrics(path: str, last_step: int) -> None:
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


class MetricsLogger:
    """Where a run's numbers go. Only the main process writes files; ``progress`` is shown
    there when ``show_progress``."""

    def __init__(self, output_dir: str, *, is_main: bool, task, total_steps: int, start_step: int,
                 show_progress: bool, tensorboard: bool, log_every: int):
        self.path = os.path.join(output_dir, METRICS_NAME)
        self.is_main, self.log_every = is_main, log_every
        self.progress = Progress(total_steps, start_step, enabled=is_main and show_progress, task=task)
        self.first_line: Optional[Dict[str, Any]] = None
        self.last_line: Optional[Dict[str, Any]] = None
        self.writer = None
        self.start_step = start_step
        self.created: List[str] = []  # what this logger made (``undo``)
        if not is_main:
            return
        if start_step:
            truncate_metrics(self.path, start_step)
        else:
            if not os.path.exists(self.path):
                self.created.append(self.path)
            open(self.path, "w").close()
        if tensorboard:
            folder = os.path.join(output_dir, "tensorboard")
            if not os.path.exists(folder):
                self.created.append(folder)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(folder)
            except Exception:  # tensorboard not installed: optional
                self.writer = None

    def write(self, text: str) -> None:
        """A line among the progress output (progress bar or lines)."""
        self.progress.write(text)

    def note(self, text: str) -> None:
        """A notice that reaches the log even without progress output."""
        if self.progress.enabled:
            self.progress.write(text)
        elif self.is_main:
            print(f"note: {text}", file=sys.stderr)

    def log(self, step: int, line: Dict[str, Any], *, force: bool = False) -> None:
        """Record ``line`` (step ``step``): in metrics.jsonl every ``log_every`` steps and when
        ``force`` (an evaluated or last step: its eval_* fields exist only in this line)."""
        self.first_line = self.first_line or line
        self.last_line = line
        if self.is_main and (step % self.log_every == 0 or force):
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
            if self.writer is not None:
                for key, value in line.items():
                    if key != "step":
                        self.writer.add_scalar(key, value, step)
        self.progress.update(step, line)

    def close(self) -> None:
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def undo(self) -> bool:
        """For a run refused before its first step (e.g. an attention the device cannot run, found
        when the model first runs): remove the empty files this logger created and return True;
        False (nothing removed) once a step was logged or on a resumed run."""
        if self.first_line is not None or self.start_step:
            return False
        self.close()
        for path in reversed(self.created):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
        self.created = []
        return True
