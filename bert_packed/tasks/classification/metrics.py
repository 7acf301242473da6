"""Evaluation metrics for sequence classification and regression.

Computed by well-kept libraries, not by hand: scikit-learn (accuracy, F1, Matthews
correlation) and SciPy (Pearson, Spearman). The names are those users know from GLUE /
Hugging Face ``evaluate``:

- single-label: ``accuracy``, ``f1_macro``, ``mcc``;
- multi-label (a label is predicted where its logit > 0): ``accuracy`` (every label of a
  sequence right), ``f1_micro``, ``f1_macro``;
- regression: ``pearson``, ``spearman``, ``mse`` (over all outputs).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import numpy as np

# The key that picks the best model, per problem type (larger is better for each).
DEFAULT_BEST = {"single_label_classification": "accuracy", "multi_label_classification": "f1_micro",
                "regression": "pearson"}
METRICS = {"single_label_classification": ("accuracy", "f1_macro", "mcc"),
           "multi_label_classification": ("accuracy", "f1_micro", "f1_macro"),
           "regression": ("pearson", "spearman", "mse")}


def predictions(logits: np.ndarray, problem_type: str) -> np.ndarray:
    """Class ids [N] (single-label), 0/1 [N, C] (multi-label) or values [N(, C)] (regression)."""
    if problem_type == "single_label_classification":
        return logits.argmax(axis=-1)
    if problem_type == "multi_label_classification":
        return (logits > 0).astype(np.int64)
    return logits[:, 0] if logits.shape[-1] == 1 else logits


def compute_metrics(logits: np.ndarray, labels: np.ndarray, problem_type: str) -> Dict[str, float]:
    """The metrics of ``problem_type`` for ``logits`` [N, C] against ``labels`` (as fed to the model)."""
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    predicted = predictions(logits, problem_type)
    if problem_type == "single_label_classification":
        labels = labels.astype(np.int64)
        return {"accuracy": float(accuracy_score(labels, predicted)),
                "f1_macro": float(f1_score(labels, predicted, average="macro", zero_division=0)),
                "mcc": float(matthews_corrcoef(labels, predicted))}
    if problem_type == "multi_label_classification":
        labels = (labels > 0.5).astype(np.int64)
        return {"accuracy": float(accuracy_score(labels, predicted)),
                "f1_micro": float(f1_score(labels, predicted, average="micro", zero_division=0)),
                "f1_macro": float(f1_score(labels, predicted, average="macro", zero_division=0))}
    if problem_type == "regression":
        from scipy.stats import pearsonr, spearmanr

        x, y = np.asarray(predicted, dtype=np.float64).reshape(-1), labels.astype(np.float64).reshape(-1)
        with warnings.catch_warnings():  # constant input (an untrained model): NaN, reported as such
            warnings.simplefilter("ignore")
            pearson = float(pearsonr(x, y)[0]) if len(x) > 1 else float("nan")
            spearman = float(spearmanr(x, y)[0]) if len(x) > 1 else float("nan")
        return {"pearson": pearson, "spearman": spearman, "mse": float(np.mean((x - y) ** 2))}
    raise ValueError(f"unknown problem_type {problem_type!r}")


def prediction_lines(logits: np.ndarray, problem_type: str, id2label: Dict[int, str],
                     labels: Optional[np.ndarray] = None) -> List[Dict[str, Any]]:
    """One JSON-able dict per sequence: ``row``, ``prediction`` (label name(s) or value(s)),
    ``logits``, and ``label`` when the true labels are known."""
    predicted = predictions(logits, problem_type)

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
