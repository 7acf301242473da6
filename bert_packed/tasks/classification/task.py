"""Packed sequence classification (single-label, multi-label, regression) as a task of the loop.

    python run.py --config finetune_classification --init-checkpoint DIR \\
        --set finetune.train_file=train.csv --set finetune.validation_file=dev.csv \\
        --set finetune.text_column=sentence --set finetune.label_column=label --output-dir OUT

The training and validation files are tokenised with the checkpoint's tokenizer, packed
(several sequences, each with its own [CLS], per row of data.max_sequence_length tokens;
``finetune.packing=false``: one per row) and trained with the per-sequence losses of
``BertForSequenceClassification``. Every ``train.eval_every`` steps and at the end the whole
validation set is evaluated (``metrics``); the best evaluation's
weights are kept in ``OUT/best`` (a Hugging Face directory) and, with
``finetune.load_best_model_at_end``, exported as ``OUT/hf`` with their metrics under
``eval`` in ``OUT/summary.json`` and their predictions in ``OUT/predictions.jsonl``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from bert_packed.errors import ConfigError
from bert_packed.tasks import data as ft_data
from bert_packed.tasks.packed import PackedTask
from bert_packed.tasks.classification import metrics as ft_metrics
from bert_packed.tasks.classification.data import MAX_LABELS, Labels, split_rows
from bert_packed.io.files import write_text_atomic
from bert_packed.limits import bounded

PREDICTIONS_NAME = "predictions.jsonl"


# ----------------------------------------------------------------------------- the task


@dataclass
class ClassificationFields:
    """``finetune.*`` keys of sequence classification (CSV/TSV/JSONL files with named columns)."""

    text_column: str = "text"
    text_pair_column: Optional[str] = None
    label_column: str = "label"
    # Hugging Face's names; null = from the labels (lists: multi-label, fractional numbers or
    # num_labels 1: regression, else single-label).
    problem_type: Optional[str] = field(default=None, metadata={"choices": (
        None, "single_label_classification", "multi_label_classification", "regression")})
    # null = from the data (string labels: their count; integer labels: the largest + 1).
    num_labels: Optional[int] = bounded(None, ge=1, **MAX_LABELS)
    # Multi-label labels written as one string: the separator between label names.
    label_separator: str = ","


class ClassificationTask(PackedTask):
    """Sequence classification / regression fine-tuning (see the module docstring)."""

    name = "classification"
    config_fields = ClassificationFields
    always_evaluate = True  # summary.json reports the validation metrics

    def __init__(self, config):
        super().__init__(config)
        self.labels: Optional[Labels] = None
        self.eval_labels = None
        self._tokenizer = None

    # -- setup ------------------------------------------------------------------------------
    def setup(self, *, rank: int = 0, world_size: int = 1, show_progress: bool = True) -> None:
        super().setup(rank=rank, world_size=world_size, show_progress=show_progress)
        c, f, d = self.config, self.config.finetune, self.config.data
        if not f.train_file:
            raise ConfigError("fine-tuning needs finetune.train_file (a CSV, TSV or JSONL file)")
        if not f.packing:
            d.max_sequences_per_pack = 1  # one sequence per row: the padded baseline
        self._tokenizer = self.checked_tokenizer("fine-tuning")
        columns = [f.text_column] + ([f.text_pair_column] if f.text_pair_column else []) + [f.label_column]
        train = ft_data.read_table(f.train_file, columns)
        if f.validation_file:
            validation = ft_data.read_table(f.validation_file, columns)
            validation_where = f.validation_file
        else:
            train, validation = split_rows(train, f.validation_fraction, c.train.seed, f.train_file)
            validation_where = f"{f.train_file} (validation part)"
        checkpoint_labels = None
        if self.pretrained is not None and self.pretrained.hf_config.get("id2label"):
            from bert_packed.io.hf_io import label_maps

            checkpoint_labels = label_maps(self.pretrained.hf_config)[0]
        self.labels = Labels.from_training(train[f.label_column], f.problem_type, f.num_labels, f.label_separator,
                                           checkpoint_labels, f.train_file)
        self.metric_names = ("loss",) if self.labels.problem_type == "regression" else ("loss", "accuracy")
        self.best_metric = "eval_" + (f.metric_for_best_model or ft_metrics.DEFAULT_BEST[self.labels.problem_type])
        self.greater_is_better = self.best_model.greater_is_better = self.best_metric not in ("eval_loss", "eval_mse")
        self.train_data = self._dataset(train, f.train_file)
        self.eval_data = self._dataset(validation, validation_where)
        self.eval_labels = self.eval_data.samples["labels"]
        self.note(f"fine-tuning {self.labels.problem_type} with {self.labels.num_labels} label(s): "
                  f"{self.train_data.num_sequences} training and {self.eval_data.num_sequences} validation sequences; "
                  f"{self.train_data.packing_factor:.2f} sequences per row "
                  f"({self.train_data.algorithm}, at most {d.max_sequences_per_pack} per row of {d.max_sequence_length})")

    def _dataset(self, table: Dict[str, List[Any]], where: str) -> ft_data.PackedDataset:
        from functools import partial

        from bert_packed.tasks.classification.data import collate_classification

        c, f, d = self.config, self.config.finetune, self.config.data
        encoded = ft_data.encode_texts(self._tokenizer, table[f.text_column],
                                       table[f.text_pair_column] if f.text_pair_column else None,
                                       max_length=d.max_sequence_length, truncation=f.truncation, where=where)
        labels = self.labels.encode(table[f.label_column], f.label_separator, where)
        collate = partial(collate_classification, max_sequence_length=d.max_sequence_length,
                          max_sequences_per_pack=d.max_sequences_per_pack)
        return ft_data.PackedDataset(encoded, {"labels": labels}, collate, max_sequence_length=d.max_sequence_length,
                                     max_sequences_per_pack=d.max_sequences_per_pack,
                                     algorithm=d.packing_algorithm, seed=c.train.seed)

    # -- model ------------------------------------------------------------------------------
    def model_class(self):
        from bert_packed.tasks.classification.model import BertForSequenceClassification

        return BertForSequenceClassification

    def bert_config_overrides(self) -> Dict[str, Any]:
        return {"num_labels": self.labels.num_labels, "problem_type": self.labels.problem_type}

    def export_labels(self) -> Optional[Dict[int, str]]:
        return self.labels.id2label

    # -- evaluation -------------------------------------------------------------------------
    def predict_logits(self, backend) -> np.ndarray:
        """Logits [N, C] of every validation sequence (in file order) through ``backend``."""
        logits = np.zeros((self.eval_data.num_sequences, self.labels.num_labels), dtype=np.float32)
        for batch, rows in self.evaluation_batches():
            out = backend.predict_step(batch, names=("logits",))["logits"]
            present = rows >= 0
            logits[rows[present]] = out[present]
        return logits

    def evaluate(self, backend) -> Dict[str, float]:
        import torch

        from bert_packed.tasks.classification.model import classification_loss_terms

        logits = self.predict_logits(backend)
        labels = self.eval_labels
        weights = torch.ones((1, len(logits)))
        terms = classification_loss_terms(torch.from_numpy(logits)[None], torch.from_numpy(labels)[None], weights,
                                          self.labels.problem_type)
        metrics = {"eval_loss": float(terms["loss_sum"].sum() / max(1, len(logits)))}
        metrics.update({f"eval_{k}": v for k, v in ft_metrics.compute_metrics(logits, labels, self.labels.problem_type).items()})
        self.last_outputs = logits
        return metrics

    # -- end of run -------------------------------------------------------------------------
    def finish(self, backend, model, output_dir: str, summary: Dict[str, Any]) -> None:
        logits = self.chosen_evaluation(model, output_dir, summary)
        summary["labels"] = {str(i): name for i, name in self.labels.id2label.items()}
        summary["problem_type"] = self.labels.problem_type
        if self.is_main and logits is not None:
            self._write_predictions(os.path.join(output_dir, PREDICTIONS_NAME), logits)
            summary["predictions"] = os.path.join(output_dir, PREDICTIONS_NAME)
        super().finish(backend, model, output_dir, summary)

    def _write_predictions(self, path: str, logits: np.ndarray) -> None:
        lines = ft_metrics.prediction_lines(logits, self.labels.problem_type, self.labels.id2label, self.eval_labels)
        write_text_atomic(path, "".join(json.dumps(line) + "\n" for line in lines))

    def outputs_state(self, outputs: np.ndarray) -> Any:
        return outputs.tolist()

    def outputs_from_state(self, state: Any) -> np.ndarray:
        return np.asarray(state, dtype=np.float32)

    def state_dict(self) -> Dict[str, Any]:
        labels = {"problem_type": self.labels.problem_type, "num_labels": self.labels.num_labels,
                  "id2label": {str(i): n for i, n in self.labels.id2label.items()}, "named": self.labels.named}
        return {**super().state_dict(), "labels": labels}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("labels") and self.labels is None:  # export from a checkpoint, without the data
            saved = state["labels"]
            self.labels = Labels(saved["problem_type"], saved["num_labels"],
                                 {int(i): n for i, n in saved["id2label"].items()}, saved["named"])
        super().load_state_dict(state)
