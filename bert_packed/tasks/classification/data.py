"""Sequence classification data: the labels of a table (their problem type, checked), the
seeded validation split, and the collation of packed batches.

- :class:`Labels` (``Labels.from_training``, ``encode``): label values -> class ids, multi-hot
  rows or regression targets, refusing in one line what it would have to guess;
- :func:`collate_classification`: the packed batch ``CLASSIFICATION_FIELDS`` (the inputs of
  ``bert_packed.tasks.classification.model.BertForSequenceClassification``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from bert_packed.collate import pack_tokens, per_sequence
from bert_packed.data import DataError
from bert_packed.tasks import data as ft_data
from bert_packed.limits import at_most

__all__ = ["Labels", "infer_problem_type", "MAX_LABELS", "CLASSIFICATION_FIELDS", "collate_classification"]

_INTEGER = re.compile(r"^[+-]?\d+$")
# Packed sequence classification: one label per packed sequence.
CLASSIFICATION_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions", "labels", "label_weights")


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


def split_rows(table: Dict[str, List[Any]], fraction: float, seed: int, where: str) -> Tuple[Dict, Dict]:
    """(train, validation): a seeded random ``fraction`` of the rows held out."""
    num_rows = len(next(iter(table.values())))
    parts = ft_data.held_out(num_rows, fraction, seed, what="rows", where=where)
    return tuple({k: v.take(indices) if isinstance(v, ft_data.Column) else [v[i] for i in indices]
                  for k, v in table.items()} for indices in parts)


# ----------------------------------------------------------------------------- collation


def collate_classification(
    samples: Mapping[str, np.ndarray],
    assignment: Any,
    *,
    max_sequence_length: int,
    max_sequences_per_pack: int,
) -> Dict[str, np.ndarray]:
    """Packed sequence-classification batch: token fields, ``cls_positions``, ``labels`` and
    ``label_weights`` ``[B, K]`` (``BertForSequenceClassification``'s inputs).

    ``samples``: ``input_ids``, ``segment_ids``, optional ``input_mask`` (as for ``collate``)
    and ``labels``: ``[N]`` int class per sequence (-> int64 ``[B, K]``), or floats ``[N]`` /
    ``[N, C]`` (regression targets, multi-hot labels -> float32 ``[B, K(, C)]``).
    """
    S, K = int(max_sequence_length), int(max_sequences_per_pack)
    batch, layout = pack_tokens(samples, assignment, S, K)
    labels = np.asarray(samples["labels"])
    batch["labels"] = per_sequence(layout, labels, K, np.float32 if labels.dtype.kind == "f" else np.int64)
    batch["label_weights"] = per_sequence(layout, np.ones(len(np.asarray(samples["input_ids"]))), K, np.float32)
    return batch
