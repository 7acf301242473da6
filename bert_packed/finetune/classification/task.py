"""Packed sequence classification (single-label, multi-label, regression) as a task of the loop.

    python run.py --config finetune_classification --init-checkpoint DIR \\
        --set finetune.train_file=train.csv --set finetune.validation_file=dev.csv \\
        --set finetune.text_column=sentence --set finetune.label_column=label --output-dir OUT

The training and validation files are tokenised with the checkpoint's tokenizer, packed
(several sequences, each with its own [CLS], per row of data.max_sequence_length tokens;
``finetune.packing=false``: one per row) and trained with the per-sequence losses of
``BertForSequenceClassification``. Every ``train.eval_every`` steps and at the end the whole
validation set is evaluated (``bert_packed.finetune.classification.metrics``); the best evaluation's
weights are kept in ``OUT/best`` (a Hugging Face directory) and, with
``finetune.load_best_model_at_end``, exported as ``OUT/hf`` with their metrics under
``eval`` in ``OUT/summary.json`` and their predictions in ``OUT/predictions.jsonl``.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.errors import ConfigError
from bert_packed.finetune import data as ft_data
from bert_packed.finetune.classification import metrics as ft_metrics
from bert_packed.io import write_text_atomic
from bert_packed.limits import at_most, bounded

_INTEGER = re.compile(r"^[+-]?\d+$")
PREDICTIONS_NAME = "predictions.jsonl"


# ----------------------------------------------------------------------------- labels
#
# What the label values are decides the problem type when finetune.problem_type is null,
# and a value that could mean two things is refused rather than guessed:
#
# - integers ("0", 2) are class ids; names ("pos") are classes mapped to ids in sorted order;
#   booleans are the two classes "False" / "True"; lists are multi-label;
# - a number with a fraction ("0.37") makes the task regression;
# - a whole number written with a decimal point or an exponent ("1.0", "2e0") is ambiguous on
#   its own (a class id a spreadsheet or pandas printed as a float, or a regression target that
#   happens to be whole): with problem_type null it is refused; with a classification
#   problem_type it is that class id, with regression that number;
# - a multi-label row is a JSON list of names or ids, or names joined by finetune.label_separator;
#   an empty cell ("", spaces) or [] is a row with NO labels (every class negative): the one
#   empty label accepted, as multi-label data has such rows. An empty name inside a row ("a,,b",
#   "a,", ["a", ""]) is refused (a label lost?), and so is data where no row has a label;
# - with problem_type null, a name holding label_separator ("a,b") is ambiguous (names joined
#   for multi-label, or one class whose name holds it?) and refused;
# - empty labels elsewhere (single-label, regression), "nan" / "inf" (a missing value
#   written as a number), names mixed with numbers or booleans, lists mixed with single values,
#   negative class ids and fractional class ids are refused, naming file, line, column, value.

_NON_FINITE = ("nan", "inf", "infinity")
# Classes: the head is num_labels x hidden_size weights (4 GiB in fp32 at 2^20 x 1024) and a
# multi-label target is num_labels floats per sequence; GLUE-style tasks have 2 to 100s.
MAX_LABELS = at_most(2**20, "the head alone would be num_labels x hidden_size weights")
_NUMBERS = ("int", "whole", "fraction")


def _kind(value: Any) -> str:
    """'empty', 'list', 'bool', 'int', 'whole' (1.0, 2e0), 'fraction' (0.37), 'non-finite'
    (nan, inf), 'name' (any other string) or 'other' (a JSON object)."""
    if value is None:
        return "empty"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, list):
        return "list"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        if not text:
            return "empty"
        if _INTEGER.match(text):
            return "int"
        if text.lower().lstrip("+-") in _NON_FINITE:
            return "non-finite"
        try:
            number = float(text)
        except ValueError:
            return "name"
    else:
        return "other"
    if not math.isfinite(number):
        return "non-finite"
    return "whole" if number.is_integer() else "fraction"


def _bad(values: Sequence[Any], row: int, where: str, text: str, shown: Any = None) -> DataError:
    """DataError ``FILE: line N: column 'C': label V <text>`` for value ``row`` of ``values``."""
    shown = values[row] if shown is None else shown
    return DataError(f"{ft_data.value_where(values, row, where)}: label {shown!r} {text}")


def _check_items(values: Sequence[Any], items: Sequence[Any], rows: Sequence[int], where: str) -> List[str]:
    """The kinds of label ``items`` (``rows[k]``: the value item k came from), refusing what no
    class label can be and mixtures of kinds."""
    kinds = [_kind(x) for x in items]
    first: Dict[str, int] = {}
    for k, kind in enumerate(kinds):
        first.setdefault(kind, k)
        if kind == "non-finite":
            raise _bad(values, rows[k], where, "is not a finite number (a missing value written as a number?); fix "
                                               "or remove the row", items[k])
        if kind == "empty":
            raise _bad(values, rows[k], where, "is empty; every row needs a label (remove the row or fill it in)",
                       items[k])
        if kind in ("other", "list"):
            raise _bad(values, rows[k], where, f"is a {'JSON object' if kind == 'other' else 'list'}, not a single "
                                               f"label (multi-label data: lists of labels, or names joined by "
                                               f"finetune.label_separator)", items[k])
    for kind, others in (("name", _NUMBERS), ("bool", _NUMBERS + ("name",))):
        clash = [first[o] for o in others if o in first]
        if kind in first and clash:
            a, b = sorted((first[kind], min(clash)))
            raise DataError(f"{ft_data.value_where(values, rows[b], where)}: label {items[b]!r} is not written like "
                            f"label {items[a]!r} ({ft_data.value_at(values, rows[a])}): labels mix names, numbers or "
                            f"booleans; write every label the same way (all names, or all class ids)")
    return kinds


def infer_problem_type(values: List[Any], num_labels: Optional[int], where: str = "labels",
                       separator: Optional[str] = None) -> str:
    """The problem type the labels ``values`` imply (Hugging Face's rule, ambiguity refused, see
    the rules above): lists -> multi-label; ``num_labels`` 1 or a fractional number ->
    regression; integer ids, names or booleans -> single-label. A name holding ``separator``
    (names joined for multi-label?) is refused: the problem type must then be given."""
    kinds = [_kind(v) for v in values]
    if "list" in kinds:
        scalar = [i for i, kind in enumerate(kinds) if kind != "list"]
        if scalar:
            raise _bad(values, scalar[0], where, "is not a list, but other rows' labels are (multi-label); write "
                                                 "every label as a list ([] for none)")
        return "multi_label_classification"
    if num_labels == 1:
        return "regression"
    kinds = _check_items(values, values, range(len(values)), where)
    if "fraction" in kinds:
        return "regression"
    if "whole" in kinds:
        raise _bad(values, kinds.index("whole"), where,
                   "is a whole number written as a decimal: a class id or a regression target? set "
                   "finetune.problem_type (single_label_classification or regression), or write class ids as "
                   "integers")
    joined = [i for i, kind in enumerate(kinds) if kind == "name" and separator and separator in str(values[i])]
    if joined:
        raise _bad(values, joined[0], where,
                   f"holds finetune.label_separator {separator!r}: several labels (multi-label) or one class whose "
                   f"name holds {separator!r}? set finetune.problem_type (multi_label_classification or "
                   f"single_label_classification)")
    return "single_label_classification"


class Labels:
    """Label names <-> ids for one job, fixed by the training data (or the checkpoint's labels)."""

    def __init__(self, problem_type: str, num_labels: int, id2label: Dict[int, str], named: bool):
        self.problem_type, self.num_labels, self.id2label, self.named = problem_type, num_labels, id2label, named
        self.label2id = {name: i for i, name in id2label.items()}

    @classmethod
    def from_training(cls, values: List[Any], problem_type: Optional[str], num_labels: Optional[int],
                      separator: str, checkpoint_labels: Optional[Dict[int, str]], where: str) -> "Labels":
        problem_type = problem_type or infer_problem_type(values, num_labels, where, separator)
        if problem_type == "regression":
            width = len(values[0]) if isinstance(values[0], list) else 1
            if width == 0:
                raise _bad(values, 0, where, "is empty; every row needs a label (remove the row or fill it in)")
            if num_labels is not None and num_labels != width:
                raise DataError(f"{where}: regression labels have {width} value(s) per row but finetune.num_labels="
                                f"{num_labels}")
            return cls(problem_type, width, {i: f"LABEL_{i}" for i in range(width)}, named=False)
        multi = problem_type == "multi_label_classification"
        split = [_row_labels(values, i, separator, where) if multi else [v] for i, v in enumerate(values)]
        items = [x for row in split for x in row]
        if multi and not items:
            raise DataError(f"{where}: no row has a label (multi-label rows may have none, written as an empty "
                            f"value or [], but some row must name a class)")
        rows = [i for i, row in enumerate(split) for _ in row]  # the value each item came from
        kinds = _check_items(values, items, rows, where)
        if "fraction" in kinds:
            k = kinds.index("fraction")
            raise _bad(values, rows[k], where, "is not a class id (it has a fraction); for numeric targets set "
                                               "finetune.problem_type=regression", items[k])
        if items and all(kind in ("int", "whole") for kind in kinds):  # class ids are kept as they are
            ids = [int(float(x)) for x in items]
            if min(ids) < 0:
                k = ids.index(min(ids))
                raise _bad(values, rows[k], where, "is a negative class id; class ids count from 0", items[k])
            if num_labels is None and max(ids) >= MAX_LABELS["le"]:
                k = ids.index(max(ids))
                raise _bad(values, rows[k], where, f"would make {max(ids) + 1} classes (class ids count from 0), more "
                                                   f"than {MAX_LABELS['le']}: {MAX_LABELS['why']}", items[k])
            count = num_labels if num_labels is not None else max(ids) + 1
            return cls(problem_type, count, {i: f"LABEL_{i}" for i in range(count)}, named=False)
        names = sorted({str(x) for x in items})
        if checkpoint_labels and set(names) <= set(checkpoint_labels.values()):
            mapping = dict(checkpoint_labels)  # keep a fine-tuned checkpoint's label ids
        else:
            mapping = dict(enumerate(names))
        if len(mapping) > MAX_LABELS["le"]:
            raise DataError(f"{where}: the labels are {len(mapping)} distinct names, more than {MAX_LABELS['le']} "
                            f"classes: {MAX_LABELS['why']}")
        if num_labels is not None and num_labels != len(mapping):
            raise DataError(f"{where}: the labels are {len(mapping)} names ({_preview(mapping.values())}) but "
                            f"finetune.num_labels={num_labels}; drop the setting or fix the labels")
        return cls(problem_type, len(mapping), mapping, named=True)

    def encode(self, values: List[Any], separator: str, where: str) -> np.ndarray:
        """Model targets: int64 [N] (single-label), float32 multi-hot [N, C], float32 [N(, C)]."""
        if self.problem_type == "regression":
            out = np.zeros((len(values), self.num_labels), dtype=np.float32)
            for i, value in enumerate(values):
                row = value if isinstance(value, list) else [value]
                kinds = [_kind(x) for x in row]
                if "empty" in kinds or not row:
                    raise _bad(values, i, where, "is empty; every row needs a label (remove the row or fill it in)")
                if "non-finite" in kinds:
                    raise _bad(values, i, where, "is not a finite number; a regression target must be one (fix or "
                                                 "remove the row)")
                if len(row) != self.num_labels or not all(kind in _NUMBERS for kind in kinds):
                    raise _bad(values, i, where, f"is not {self.num_labels} number(s) (problem_type regression)")
                out[i] = [float(x) for x in row]
            return out[:, 0] if self.num_labels == 1 else out
        multi = self.problem_type == "multi_label_classification"
        out = np.zeros((len(values), self.num_labels), dtype=np.float32) if multi else np.zeros(len(values), np.int64)
        for i, value in enumerate(values):
            for item in (_row_labels(values, i, separator, where) if multi else [value]):
                label = self._id(item, values, i, where)
                if multi:
                    out[i, label] = 1.0
                else:
                    out[i] = label
        return out

    def _id(self, item: Any, values: Sequence[Any], row: int, where: str) -> int:
        kind = _kind(item)
        if kind in ("empty", "non-finite", "list", "other"):
            _check_items(values, [item], [row], where)  # raises
        if self.named:
            if str(item) not in self.label2id:
                raise _bad(values, row, where, f"is not one of the training labels ({_preview(self.label2id)})", item)
            return self.label2id[str(item)]
        if kind not in ("int", "whole"):
            raise _bad(values, row, where, "is not an integer class id", item)
        label = int(float(item))
        if not 0 <= label < self.num_labels:
            raise _bad(values, row, where, f"is outside num_labels={self.num_labels} (0..{self.num_labels - 1}); "
                                           f"set finetune.num_labels or fix the label", item)
        return label


def _row_labels(values: Sequence[Any], row: int, separator: str, where: str) -> List[Any]:
    """The labels of multi-label row ``row``: its JSON list, or its names split at ``separator``
    (spaces around a name dropped). An empty value or [] is a row with no labels; an empty name
    inside a row is refused (see the rules above)."""
    value = values[row]
    if isinstance(value, list):
        labels = value
    else:
        text = "" if value is None else str(value).strip()
        labels = [part.strip() for part in text.split(separator)] if text else []
    if any(_kind(label) == "empty" for label in labels):
        if isinstance(value, list):
            raise _bad(values, row, where, "has an empty label name; a label lost? remove it, or write [] for a row "
                                           "with no labels")
        raise _bad(values, row, where, f"has an empty label name between or around the separators ({separator!r}); a "
                                       f"label lost? join the names by single separators, or leave the value empty "
                                       f"for a row with no labels")
    return labels


def _preview(names, limit: int = 8) -> str:
    names = [str(n) for n in names]
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


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


class ClassificationTask(ft_data.PackedTask):
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
            train, validation = _split_rows(train, f.validation_fraction, c.train.seed, f.train_file)
            validation_where = f"{f.train_file} (validation part)"
        checkpoint_labels = None
        if self.pretrained is not None and self.pretrained.hf_config.get("id2label"):
            from bert_packed.hf_io import label_maps

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

        from bert_packed.collate import collate_classification

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
        from bert_packed.modeling import BertForSequenceClassification

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

        from bert_packed.losses import classification_loss_terms

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
        lines = prediction_lines(logits, self.labels.problem_type, self.labels.id2label, self.eval_labels)
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


def prediction_lines(logits: np.ndarray, problem_type: str, id2label: Dict[int, str],
                     labels: Optional[np.ndarray] = None) -> List[Dict[str, Any]]:
    """One JSON-able dict per sequence: ``row``, ``prediction`` (label name(s) or value(s)),
    ``logits``, and ``label`` when the true labels are known."""
    predicted = ft_metrics.predictions(logits, problem_type)

    def named(value):
        if problem_type == "single_label_classification":
            return id2label[int(value)]
        if problem_type == "multi_label_classification":
            return [id2label[j] for j in np.flatnonzero(value)]
        return float(value) if np.ndim(value) == 0 else [float(x) for x in value]

    lines = []
    for i in range(len(logits)):
        line = {"row": i, "prediction": named(predicted[i]), "logits": [round(float(x), 6) for x in logits[i]]}
        if labels is not None:
            line["label"] = named(labels[i] > 0.5) if problem_type == "multi_label_classification" else named(labels[i])
        lines.append(line)
    return lines


def _split_rows(table: Dict[str, List[Any]], fraction: float, seed: int, where: str) -> Tuple[Dict, Dict]:
    """(train, validation): a seeded random ``fraction`` of the rows held out."""
    num_rows = len(next(iter(table.values())))
    parts = ft_data.held_out(num_rows, fraction, seed, what="rows", where=where)
    return tuple({k: v.take(indices) if isinstance(v, ft_data.Column) else [v[i] for i in indices]
                  for k, v in table.items()} for indices in parts)
