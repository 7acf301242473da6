"""Tasks: what the ONE training loop (``bert_packed.train``) trains.

The loop owns the mechanics (backend steps, timing, metrics.jsonl, checkpoints, resume,
progress); a *task* says what is trained and how it is judged. Pre-training is one task;
fine-tuning tasks (``bert_packed.finetune``) plug in the same way, chosen by
``finetune.task`` (null = pre-training). A task provides:

- ``setup(...)``: read its data, resolve the config (checkpoint shape, labels, steps);
- ``build_model()``: the model (``model.init_checkpoint`` loaded, see ``bert_packed.hf_io``);
  the model declares ``metric_names`` / ``count_names`` (what the backends sum) and
  ``add_step_normalizers`` (the step's global counts);
- ``data_source(split, ...)``: endless micro-batches of packs with the data-source
  contract of ``bert_packed.data`` (sharding, ``state_dict``, ``packing_factor``);
- ``metric_names``: the keys of each metrics.jsonl line after ``step`` (from the backend's
  metrics); ``progress_text(line)``: the progress line;
- ``prepare_evaluation(micro_batch_size=, rank=, world_size=)``: build the held-out batches
  once, before the first step (when ``train.eval_every > 0``);
  ``evaluate(backend)``: ``{"eval_*": float}`` on them; ``best_metric`` names the
  key that selects the best model (None: no selection) and ``greater_is_better``;
- ``on_evaluation(step, metrics, backend, model, output_dir)``: best-model bookkeeping;
- ``finish(backend, model, output_dir, summary)``: end-of-run outputs (predictions, the
  Hugging Face export in ``OUT/hf``) and the ``summary["eval"]`` metrics;
- ``state_dict()`` / ``load_state_dict()``: what a checkpoint must keep for ``--resume``;
- ``export(model, directory)``: the Hugging Face export (class = the model's
  ``hf_architecture``, labels, tokenizer).

Register a task with ``TASKS[name] = "module:Class"`` (imported on use).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Dict, List, Optional

from bert_packed.config import Config, ConfigError

TASKS = {
    "pretraining": "bert_packed.task:PretrainingTask",
    "classification": "bert_packed.finetune.classification:ClassificationTask",
    "squad": "bert_packed.finetune.squad:SquadTask",
}


def get_task(config: Config) -> "Task":
    """The task object for ``config`` (``finetune.task``; null = pre-training)."""
    name = getattr(getattr(config, "finetune", None), "task", None) or "pretraining"
    if name not in TASKS:
        raise ConfigError(f"finetune.task={name!r} is not a task; tasks: {', '.join(sorted(TASKS))}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)(config)


class Task:
    """Base class: the pre-training-independent parts (init checkpoint, export, defaults)."""

    name = "task"
    metric_names: tuple = ("loss",)
    headline_metric = "loss"  # the metric of the run's closing line (first -> last)
    always_evaluate = False  # evaluate at the end even with train.eval_every 0
    best_metric: Optional[str] = None
    greater_is_better = True

    def __init__(self, config: Config):
        self.config = config
        self.pretrained = None  # bert_packed.hf_io.Pretrained when model.init_checkpoint is set
        self.is_main = True
        self.show_progress = True

    # -- setup ----------------------------------------------------------------------------
    def setup(self, *, rank: int = 0, world_size: int = 1, show_progress: bool = True) -> None:
        """Resolve the config before anything is built (override and call super())."""
        self.is_main, self.show_progress = rank == 0, show_progress
        path = self.config.model.init_checkpoint
        if path:
            from bert_packed import hf_io

            self.pretrained = hf_io.read_pretrained(path)
            hf_io.resolve_model_config(self.config.model, self.pretrained)
            d, m = self.config.data, self.config.model
            if d.max_sequence_length > m.max_position_embeddings:
                raise ConfigError(f"data.max_sequence_length={d.max_sequence_length} exceeds the checkpoint's "
                                  f"max_position_embeddings={m.max_position_embeddings}; shorten it")

    def num_steps(self, packs_per_step: int) -> int:
        """Optimizer steps of the run (``train.steps`` unless the task derives them, e.g. from epochs)."""
        return self.config.train.steps

    def note(self, text: str) -> None:
        """A one-line note on stderr from the main process."""
        if self.is_main:
            print(text, file=sys.stderr, flush=True)

    # -- model ------------------------------------------------------------------------------
    def model_class(self):
        raise NotImplementedError

    def bert_config_overrides(self) -> Dict[str, Any]:
        return {}

    def build_model(self):
        """The task's model from the config, with the init checkpoint's weights loaded."""
        from bert_packed.train import bert_config

        model = self.model_class()(bert_config(self.config, **self.bert_config_overrides()))
        if self.pretrained is not None:
            from bert_packed import hf_io

            self.note(hf_io.load_weights(model, self.pretrained.state_dict, source=self.pretrained.path))
            self.pretrained.state_dict = {}  # the model holds the weights now
        return model

    # -- data, evaluation -------------------------------------------------------------------
    def data_source(self, split: str, *, micro_batch_size: int, rank: int, world_size: int):
        raise NotImplementedError

    def prepare_evaluation(self, *, micro_batch_size: int, rank: int, world_size: int) -> None:
        pass

    def evaluate(self, backend) -> Dict[str, float]:
        return {}

    def progress_text(self, line: Dict[str, Any], short: bool = False) -> str:
        text = " ".join(f"{k.replace('_accuracy', '_acc')} {line[k]:.3f}" for k in self.metric_names)
        return text if short else f"{text} {line['sequences_per_second']:.0f} seq/s"

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return " ".join(f"{k[len('eval_'):]} {v:.4f}" for k, v in metrics.items())

    def on_evaluation(self, step: int, metrics: Dict[str, float], backend, model, output_dir: str) -> None:
        pass

    # -- best model (fine-tuning tasks) ------------------------------------------------------
    def record_evaluation(self, step: int, metrics: Dict[str, float], backend, model, output_dir: str, *,
                          better: bool) -> bool:
        """Remember the last evaluation; when ``better``, it becomes ``self.best`` and, with
        ``finetune.load_best_model_at_end``, the weights are exported to ``OUT/best``. Returns ``better``."""
        self.last_eval = {"step": step, **metrics}
        if not better:
            return False
        self.best = {"value": metrics[self.best_metric], "step": step, "metrics": dict(metrics)}
        if self.is_main and self.config.finetune.load_best_model_at_end:
            sync_to_host = getattr(backend, "sync_to_host", None)  # IPU: weights live on the device
            if callable(sync_to_host):
                sync_to_host()
            self.export(model, os.path.join(output_dir, "best"))
        return True

    def restore_best(self, model, output_dir: str, value_text: str) -> bool:
        """At the end of a run: True when the best evaluation is the one to report; its weights
        (``OUT/best``) are loaded back into ``model`` when training went on past it."""
        use_best = self.config.finetune.load_best_model_at_end and "step" in self.best
        if use_best and self.best["step"] != self.last_eval.get("step"):
            from bert_packed import hf_io

            best = hf_io.read_pretrained(os.path.join(output_dir, "best"))
            hf_io.load_weights(model, best.state_dict, source=best.path)
            self.note(f"loaded the best model (step {self.best['step']}, {value_text}) from {best.path}")
        return use_best

    # -- end of run -------------------------------------------------------------------------
    def tokenizer(self):
        """The tokenizer to ship with the export: ``model.tokenizer``, else the init checkpoint's; or None."""
        from bert_packed import hf_io

        path = self.config.model.tokenizer or (self.pretrained.tokenizer_path if self.pretrained else None)
        init = self.config.model.init_checkpoint
        if not path and init and os.path.isdir(init) and hf_io.tokenizer_in(init):
            path = init  # e.g. exporting a run's checkpoint: the checkpoint it started from
        if path and getattr(self, "_tokenizer_path", None) != path:
            self._tokenizer_cache, self._tokenizer_path = hf_io.load_tokenizer(path), path
        return getattr(self, "_tokenizer_cache", None) if path else None

    def export_labels(self) -> Optional[Dict[int, str]]:
        return None

    def export(self, model, directory: str) -> str:
        """Hugging Face export of ``model`` (weights on the host) to ``directory``."""
        from bert_packed import hf_io

        return hf_io.save_pretrained(model, directory, tokenizer=self.tokenizer(), id2label=self.export_labels())

    def finish(self, backend, model, output_dir: str, summary: Dict[str, Any]) -> None:
        """End-of-run outputs; the base writes ``OUT/hf`` when ``train.hf_export``."""
        if self.is_main and self.config.train.hf_export:
            directory = self.export(model, os.path.join(output_dir, "hf"))
            summary["hf_export"] = directory
            # Generated data (the demo) has no text, so no tokenizer exists to ship: say nothing then.
            from_text = self.config.data.path or self.config.model.init_checkpoint or self.config.model.tokenizer
            if from_text and not os.path.isfile(os.path.join(directory, "tokenizer.json")):
                self.note(f"note: {directory} has no tokenizer (set model.tokenizer to a vocab.txt or tokenizer "
                          f"directory to ship one)")

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


class PretrainingTask(Task):
    """MLM + NSP pre-training (generated or HDF5 data): the loop's original job."""

    name = "pretraining"
    metric_names = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
    headline_metric = "mlm_loss"

    def __init__(self, config: Config):
        super().__init__(config)
        self.eval_batches: List[Dict[str, Any]] = []

    def model_class(self):
        from bert_packed.modeling import BertForPreTraining

        return BertForPreTraining

    def data_source(self, split: str, *, micro_batch_size: int, rank: int, world_size: int):
        from bert_packed.data import build_data_source

        return build_data_source(self.config, split=split, micro_batch_size=micro_batch_size, rank=rank,
                                 world_size=world_size)

    def progress_text(self, line: Dict[str, Any], short: bool = False) -> str:
        if short:  # the bar shares one terminal line with it
            return f"mlm {line['mlm_loss']:.3f} acc {line['mlm_accuracy']:.3f} {line['sequences_per_second']:.0f} seq/s"
        return (f"loss {line['loss']:.3f} mlm {line['mlm_loss']:.3f} nsp {line['nsp_loss']:.3f} "
                f"mlm_acc {line['mlm_accuracy']:.3f} {line['sequences_per_second']:.0f} seq/s")

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return (f"loss {metrics['eval_loss']:.3f} mlm {metrics['eval_mlm_loss']:.3f} "
                f"nsp {metrics['eval_nsp_loss']:.3f} mlm_acc {metrics['eval_mlm_accuracy']:.3f}")

    def prepare_evaluation(self, *, micro_batch_size: int, rank: int, world_size: int) -> None:
        """The first ``train.eval_batches`` held-out micro-batches of this rank, built once (the
        same batches every time, so evaluations are comparable)."""
        iterator = iter(self.data_source("eval", micro_batch_size=micro_batch_size, rank=rank, world_size=world_size))
        self.eval_batches = [next(iterator) for _ in range(self.config.train.eval_batches)]

    def evaluate(self, backend) -> Dict[str, float]:
        """Count-weighted means over the held-out micro-batches."""
        totals = {"mlm": 0.0, "nsp": 0.0, "mlm_acc": 0.0, "nsp_acc": 0.0, "tokens": 0.0, "sequences": 0.0}
        for batch in self.eval_batches:
            m = backend.eval_step(batch)
            totals["mlm"] += m["mlm_loss"] * m["num_mlm_tokens"]
            totals["mlm_acc"] += m["mlm_accuracy"] * m["num_mlm_tokens"]
            totals["nsp"] += m["nsp_loss"] * m["num_sequences"]
            totals["nsp_acc"] += m["nsp_accuracy"] * m["num_sequences"]
            totals["tokens"] += m["num_mlm_tokens"]
            totals["sequences"] += m["num_sequences"]
        tokens, sequences = max(totals["tokens"], 1.0), max(totals["sequences"], 1.0)
        out = {"eval_mlm_loss": totals["mlm"] / tokens, "eval_nsp_loss": totals["nsp"] / sequences,
               "eval_mlm_accuracy": totals["mlm_acc"] / tokens, "eval_nsp_accuracy": totals["nsp_acc"] / sequences}
        out["eval_loss"] = out["eval_mlm_loss"] + out["eval_nsp_loss"]
        return out
