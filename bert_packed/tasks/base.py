"""The task interface: what the ONE training loop (``bert_packed.loop.train``) trains.

The loop owns the mechanics (backend steps, timing, metrics.jsonl, checkpoints, resume,
progress); a *task* says what is trained and how it is judged, and owns everything of its
own: its config keys, its data and collation, its model (head and loss), its metrics, its
best-model choice and its outputs. Pre-training is one task; fine-tuning tasks
(``bert_packed.finetune``) plug in the same way, chosen by ``finetune.task`` (null =
pre-training). A task provides:

- ``config_fields``: a dataclass of its own ``finetune.*`` keys (registered with the config by
  :func:`register_config_sections`; a key set for another task gets a warning);
- ``setup(...)``: read its data, resolve the config (checkpoint shape, labels);
- ``num_steps(packs_per_step)``: optimizer steps (e.g. from epochs);
- ``model_class()`` / ``build_model()``: the model (``model.init_checkpoint`` loaded, see
  ``bert_packed.io.hf_io``); the model declares ``metric_names`` / ``count_names`` (what the
  backends sum), ``add_step_normalizers`` and its ``pipeline_layout``;
- ``data_source(split, ...)``: endless micro-batches of packs with the data-source
  contract of ``bert_packed.data`` (sharding, ``state_dict``, ``packing_factor``);
- ``metric_names``: the keys of each metrics.jsonl line after ``step`` (from the backend's
  metrics); ``progress_text(line)``: the progress line;
- ``prepare_evaluation(micro_batch_size=, rank=, world_size=)`` and ``evaluate(backend)``:
  ``{"eval_*": float}``; ``best_metric`` names the key that selects the best model (None: no
  selection) and ``greater_is_better``: the base class keeps the best evaluation
  (:class:`BestModel`, ``OUT/best``) and reports it at the end;
- ``finish(backend, model, output_dir, summary)``: end-of-run outputs (predictions, the
  Hugging Face export in ``OUT/hf``) and the ``summary["eval"]`` metrics;
- ``state_dict()`` / ``load_state_dict()``: what a checkpoint must keep for ``--resume``;
- ``export(model, directory)``: the Hugging Face export (class = the model's
  ``hf_architecture``, labels, tokenizer).

Every task is a package of the same five files (``__init__.py`` exporting the class,
``task.py``, ``model.py``, ``data.py``, ``metrics.py``) registered with one line in
``bert_packed.tasks.registry.TASKS``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, ClassVar, Dict, Optional, Tuple

from bert_packed.errors import ConfigError


class BestModel:
    """The best evaluation so far by one metric: ``value``, ``step`` and all its ``metrics``.
    A NaN value (e.g. the Pearson correlation of a constant prediction) never counts as better."""

    def __init__(self, greater_is_better: bool = True):
        self.greater_is_better = greater_is_better
        self.best: Dict[str, Any] = {}

    def is_better(self, value: float) -> bool:
        if value != value:
            return False
        if "value" not in self.best:
            return True
        return value > self.best["value"] if self.greater_is_better else value < self.best["value"]

    def update(self, step: int, value: float, metrics: Dict[str, float]) -> bool:
        """Keep this evaluation when it is better; returns whether it was."""
        if not self.is_better(value):
            return False
        self.best = {"value": value, "step": step, "metrics": dict(metrics)}
        return True


class Task:
    """Base class: the parts every task shares (init checkpoint, best model, export, defaults)."""

    name: ClassVar[str] = "task"
    config_fields: ClassVar[Optional[type]] = None  # the task's own finetune.* keys (a dataclass)
    metric_names: tuple = ("loss",)
    headline_metric = "loss"  # the metric of the run's closing line (first -> last)
    always_evaluate = False  # evaluate at the end even with train.eval_every 0
    best_metric: Optional[str] = None  # eval_* key that selects the best model; None: no selection
    greater_is_better = True

    def __init__(self, config):
        self.config = config
        self.pretrained = None  # bert_packed.io.hf_io.Pretrained when model.init_checkpoint is set
        self.is_main = True
        self.show_progress = True
        self.best_model = BestModel()
        self.last_eval: Dict[str, Any] = {}
        self.last_outputs: Any = None  # what the latest evaluation predicted (task-specific)
        self.best_outputs: Any = None  # ... and the best one
        self._tokenizer_cache: Tuple[Optional[str], Any] = (None, None)

    # -- setup ----------------------------------------------------------------------------
    def setup(self, *, rank: int = 0, world_size: int = 1, show_progress: bool = True) -> None:
        """Resolve the config before anything is built (override and call super())."""
        self.is_main, self.show_progress = rank == 0, show_progress
        self.best_model.greater_is_better = self.greater_is_better
        path = self.config.model.init_checkpoint
        if path:
            from bert_packed.io import hf_io
            from bert_packed.tasks.registry import resolve_checkpoint_shape

            self.pretrained = hf_io.read_pretrained(path)
            resolve_checkpoint_shape(self.config, self.pretrained)
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
        from bert_packed.model.build import bert_config

        model = self.model_class()(bert_config(self.config, **self.bert_config_overrides()))
        if self.pretrained is not None:
            from bert_packed.io import hf_io

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

    def training_lengths(self):
        """The token lengths of the task's own training sequences (what ``--profile`` packs), or None
        when the run's data is ``data.path`` or generated from ``data.histogram``."""
        return None

    def progress_text(self, line: Dict[str, Any], short: bool = False) -> str:
        text = " ".join(f"{k.replace('_accuracy', '_acc')} {line[k]:.3f}" for k in self.metric_names)
        return text if short else f"{text} {line['sequences_per_second']:.0f} seq/s"

    def eval_text(self, metrics: Dict[str, float]) -> str:
        return " ".join(f"{k[len('eval_'):]} {v:.4f}" for k, v in metrics.items())

    # -- the best model ---------------------------------------------------------------------
    def on_evaluation(self, step: int, metrics: Dict[str, float], backend, model, output_dir: str) -> None:
        """After every evaluation: remember it; when it is the best by ``best_metric``, keep its
        outputs and, with ``finetune.load_best_model_at_end``, its weights in ``OUT/best``."""
        if self.best_metric is None:
            return
        if self.best_metric not in metrics:
            raise ConfigError(f"finetune.metric_for_best_model: no {self.best_metric} among the evaluation "
                              f"metrics ({', '.join(k[5:] for k in metrics)})")
        self.last_eval = {"step": step, **metrics}
        if not self.best_model.update(step, metrics[self.best_metric], metrics):
            return
        self.best_outputs = self.last_outputs
        if self.is_main and self.config.finetune.load_best_model_at_end:
            backend.sync_to_host()  # IPU: the weights live on the device
            self.export(model, os.path.join(output_dir, "best"))

    def chosen_evaluation(self, model, output_dir: str, summary: Dict[str, Any]) -> Any:
        """At the end: the evaluation to report (the best with ``finetune.load_best_model_at_end``,
        its weights loaded back into ``model`` when training went on past it; else the last)
        goes to ``summary["eval"]``; returns its outputs."""
        best = self.best_model.best
        use_best = self.config.finetune.load_best_model_at_end and "step" in best
        if use_best and best["step"] != self.last_eval.get("step"):
            from bert_packed.io import hf_io

            saved = hf_io.read_pretrained(os.path.join(output_dir, "best"))
            hf_io.load_weights(model, saved.state_dict, source=saved.path)
            self.note(f"loaded the best model (step {best['step']}, {self.best_metric[len('eval_'):]} "
                      f"{best['value']:.4f}) from {saved.path}")
        chosen = best if use_best else ({"step": self.last_eval.get("step"), "metrics": self.last_eval}
                                        if self.last_eval else {})
        if chosen.get("metrics"):
            metrics = {k[len("eval_"):]: v for k, v in chosen["metrics"].items() if k.startswith("eval_")}
            summary["eval"] = {**metrics, "step": chosen["step"]}
        return self.best_outputs if use_best else self.last_outputs

    # -- end of run -------------------------------------------------------------------------
    def tokenizer(self):
        """The tokenizer to ship with the export: ``model.tokenizer``, else the init checkpoint's; or None."""
        from bert_packed.io import hf_io

        path = self.config.model.tokenizer or (self.pretrained.tokenizer_path if self.pretrained else None)
        init = self.config.model.init_checkpoint
        if not path and init and os.path.isdir(init) and hf_io.tokenizer_in(init):
            path = init  # e.g. exporting a run's checkpoint: the checkpoint it started from
        if not path:
            return None
        if self._tokenizer_cache[0] != path:
            self._tokenizer_cache = (path, hf_io.load_tokenizer(path))
        return self._tokenizer_cache[1]

    def export_labels(self) -> Optional[Dict[int, str]]:
        return None

    def export(self, model, directory: str) -> str:
        """Hugging Face export of ``model`` (weights on the host) to ``directory``."""
        from bert_packed.io import hf_io

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

    # -- resume -----------------------------------------------------------------------------
    def outputs_state(self, outputs: Any) -> Any:
        """``outputs`` (of an evaluation) as plain data for the checkpoint."""
        return outputs

    def outputs_from_state(self, state: Any) -> Any:
        return state

    def state_dict(self) -> Dict[str, Any]:
        return {"best": dict(self.best_model.best), "last_eval": dict(self.last_eval),
                "best_outputs": None if self.best_outputs is None else self.outputs_state(self.best_outputs)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best_model.best = dict(state.get("best") or {})
        self.last_eval = dict(state.get("last_eval") or {})
        saved = state.get("best_outputs")
        self.best_outputs = None if saved is None else self.outputs_from_state(saved)


