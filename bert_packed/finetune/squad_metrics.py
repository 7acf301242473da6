"""SQuAD exact match and F1, as the official evaluation scripts define them.

The per-answer arithmetic (lower case; drop punctuation, the articles a/an/the and extra
whitespace; EM = normalised strings equal; F1 over the bags of normalised tokens; the
best score over all gold answers; percentages) is torchmetrics' ``squad`` (a port of the
official v1.1 script), not hand-written. SQuAD v2.0's official script adds two rules,
applied here before calling it: gold answers that normalise to nothing are dropped, and a
question without gold answers has the single gold answer ``""`` (so only the empty
prediction scores, EM = F1 = 1). With v2.0 data the scores are also reported for the
answerable (``has_ans_*``) and unanswerable (``no_ans_*``) questions apart, as the official
script does.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

__all__ = ["squad_scores", "normalize_answer"]


def normalize_answer(text: str) -> str:
    """The official normalisation (torchmetrics' implementation of it)."""
    from torchmetrics.functional.text.squad import _normalize_text

    return _normalize_text(text)


def _score(pairs) -> Dict[str, float]:
    from torchmetrics.functional.text.squad import squad

    if not pairs:
        return {"exact_match": 0.0, "f1": 0.0}
    # A question without a prediction is left out of preds: torchmetrics scores it 0 (and warns).
    preds = [{"id": key, "prediction_text": text} for key, text, _ in pairs if text is not None]
    targets = [{"id": key, "answers": {"text": gold, "answer_start": [0] * len(gold)}} for key, _, gold in pairs]
    result = squad(preds, targets)
    return {"exact_match": float(result["exact_match"]), "f1": float(result["f1"])}


def squad_scores(predictions: Mapping[str, str], examples: Sequence[Any], version_2: bool = None) -> Dict[str, Any]:
    """``{"exact_match", "f1", "total"}`` in percent over ``examples`` (``SquadExample``, or any
    object with ``id`` and ``answer_texts``); v2.0 (``version_2``, default: any example is
    unanswerable) adds ``has_ans_exact_match``, ``has_ans_f1``, ``has_ans_total`` and the
    ``no_ans_*`` three. A question missing from ``predictions`` scores 0, as officially."""
    if version_2 is None:
        version_2 = any(not ex.answer_texts for ex in examples)
    has_ans, no_ans = [], []
    for ex in examples:
        prediction = predictions.get(ex.id)
        gold = [text for text in ex.answer_texts if normalize_answer(text)] if version_2 else list(ex.answer_texts)
        if not gold:
            if not version_2:
                raise ValueError(f"question {ex.id!r} has no gold answer (SQuAD v1.1 needs one; v2.0 data allows none)")
            gold = [""]
        (has_ans if gold != [""] else no_ans).append((ex.id, prediction, gold))
    total = len(has_ans) + len(no_ans)
    overall = _score(has_ans + no_ans)
    out: Dict[str, Any] = {"exact_match": overall["exact_match"], "f1": overall["f1"], "total": total}
    if version_2:
        for name, pairs in (("has_ans", has_ans), ("no_ans", no_ans)):
            split = _score(pairs)
            out[f"{name}_exact_match"], out[f"{name}_f1"], out[f"{name}_total"] = split["exact_match"], split["f1"], len(pairs)
    return out
