"""Token classification metrics: each word's predicted tag, and entity-level precision,
recall and F1 by ``seqeval`` (with word accuracy).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

__all__ = ["entity_scores", "word_predictions"]


def entity_scores(true_tags: List[List[str]], predicted_tags: List[List[str]]) -> Dict[str, float]:
    """Entity-level ``precision``, ``recall``, ``f1`` (micro-averaged over entities) and word
    ``accuracy``, by ``seqeval`` with its default rules, as ``evaluate``'s seqeval metric in
    ``transformers``' ``run_ner.py`` (``overall_*``): an entity is a maximal run B-X I-X ...
    (an I-X after another type or O also starts one, as conlleval counts it); it is right
    when its type and both ends are. No predicted (or true) entity: 0, not a warning."""
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    return {"precision": float(precision_score(true_tags, predicted_tags, zero_division=0)),
            "recall": float(recall_score(true_tags, predicted_tags, zero_division=0)),
            "f1": float(f1_score(true_tags, predicted_tags, zero_division=0)),
            "accuracy": float(accuracy_score(true_tags, predicted_tags))}


def word_predictions(logits: List[np.ndarray], word_starts: List[np.ndarray], id2label: Dict[int, str]) -> List[List[str]]:
    """Each word's tag: the argmax at its first sub-token ('O' for a word without tokens)."""
    out = []
    for sentence_logits, starts in zip(logits, word_starts):
        best = sentence_logits.argmax(axis=-1)
        out.append([id2label[int(best[t])] if t >= 0 else "O" for t in starts])
    return out
