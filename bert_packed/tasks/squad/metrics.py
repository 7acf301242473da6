"""SQuAD evaluation: answers from logits, then the official scores.

**Answers** (:func:`postprocess_predictions`): from start/end logits to answer texts, n-best
spans per window, windows merged per question, by the rules of Hugging Face's
``postprocess_qa_predictions`` (itself the original BERT ``run_squad.py``'s):

* per feature (window): the ``n_best_size`` highest start and end scores are paired; a pair
  is a candidate when both tokens are context tokens of that window, ``end >= start`` and
  the span has at most ``max_answer_length`` tokens; its score is ``start + end`` logit;
* per question: the candidates of all its windows compete; the best ``n_best_size`` are kept
  (``nbest``), the answer text is the context's characters from the start token's first to
  the end token's last character (original spacing and case);
* SQuAD v2.0: the null score of a window is ``start[CLS] + end[CLS]``; the question's null
  score is the *lowest* over its windows (the window most confident an answer exists); the
  question is answered ``""`` when ``null - best_span > null_score_diff_threshold``.
  ``null_odds[id]`` is that difference (the official evaluation's ``na_prob`` input).

Logits come in per pack; :func:`feature_logits` maps them back to features by
``sequence_ids`` / ``position_ids`` (vectorised), so the same code serves packed and padded
batches.

**Scores** (:func:`squad_scores`): exact match and F1 as the official evaluation scripts
define them. The per-answer arithmetic (lower case; drop punctuation, the articles a/an/the and extra
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

from typing import Any, Dict, List, Mapping, NamedTuple, Sequence

import numpy as np

__all__ = ["Predictions", "feature_logits", "postprocess_predictions", "squad_scores", "normalize_answer"]


class Predictions(NamedTuple):
    """``answers``: id -> text (``predictions.json``); ``null_odds``: id -> null score minus best
    span score (v2.0; ``null_odds.json``); ``nbest``: id -> list of {text, score, start_logit,
    end_logit} best first."""

    answers: Dict[str, str]
    null_odds: Dict[str, float]
    nbest: Dict[str, List[Dict[str, Any]]]


def feature_logits(batch: Mapping[str, np.ndarray], start_logits: np.ndarray, end_logits: np.ndarray,
                   slots: np.ndarray, out_start: np.ndarray, out_end: np.ndarray) -> None:
    """Scatter one packed batch's per-token logits ``[B, S]`` into per-feature arrays.

    ``slots`` ``[B, K]``: the feature index of every pack slot (-1 = empty, see
    ``data.feature_slots``); ``out_start`` / ``out_end`` ``[F, L]`` receive token t of
    feature f at ``[f, t]`` (t = the token's position id).
    """
    sequence_ids = np.asarray(batch["sequence_ids"])
    rows, cols = np.nonzero(sequence_ids > 0)
    features = np.asarray(slots)[rows, sequence_ids[rows, cols] - 1]
    local = np.asarray(batch["position_ids"])[rows, cols]
    out_start[features, local] = np.asarray(start_logits)[rows, cols]
    out_end[features, local] = np.asarray(end_logits)[rows, cols]


def _window_candidates(start: np.ndarray, end: np.ndarray, is_context: np.ndarray, n_best_size: int,
                       max_answer_length: int):
    """(start token, end token, score) arrays of one window's valid spans."""
    context = np.nonzero(is_context)[0]
    if len(context) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    # Only context tokens can start or end an answer: ranking among them keeps n_best real candidates.
    top_start = context[np.argsort(-start[context], kind="stable")[:n_best_size]]
    top_end = context[np.argsort(-end[context], kind="stable")[:n_best_size]]
    s, e = np.meshgrid(top_start, top_end, indexing="ij")
    s, e = s.ravel(), e.ravel()
    keep = (e >= s) & (e - s + 1 <= max_answer_length)
    s, e = s[keep], e[keep]
    return s, e, start[s] + end[e]


def postprocess_predictions(examples: Sequence[Any], features: Any, start_logits: np.ndarray, end_logits: np.ndarray,
                            *, n_best_size: int = 20, max_answer_length: int = 30,
                            version_2_with_negative: bool = False,
                            null_score_diff_threshold: float = 0.0) -> Predictions:
    """Answers of ``examples`` (``data.SquadExample``) from per-feature logits.

    ``features``: ``data.SquadFeatures`` (``offsets``, ``example_index``, ``lengths``);
    ``start_logits`` / ``end_logits`` ``[F, L]`` feature-local (see :func:`feature_logits`).
    """
    if n_best_size < 1 or max_answer_length < 1:
        raise ValueError("n_best_size and max_answer_length must be >= 1")
    offsets = np.asarray(features.offsets)
    example_index = np.asarray(features.example_index)
    lengths = np.asarray(features.lengths)
    order = np.argsort(example_index, kind="stable")
    bounds = np.searchsorted(example_index[order], np.arange(len(examples) + 1))
    answers: Dict[str, str] = {}
    null_odds: Dict[str, float] = {}
    nbest: Dict[str, List[Dict[str, Any]]] = {}
    for i, example in enumerate(examples):
        spans: List[tuple] = []  # (score, start_logit, end_logit, char_start, char_end)
        null_score = None
        for f in order[bounds[i]:bounds[i + 1]]:
            n = int(lengths[f])
            start, end = np.asarray(start_logits[f, :n], np.float64), np.asarray(end_logits[f, :n], np.float64)
            window_null = float(start[0] + end[0])
            if null_score is None or window_null < null_score[0]:
                null_score = (window_null, float(start[0]), float(end[0]))
            s, e, score = _window_candidates(start, end, offsets[f, :n, 0] >= 0, n_best_size, max_answer_length)
            spans.extend(zip(score.tolist(), start[s].tolist(), end[e].tolist(),
                             offsets[f, s, 0].tolist(), offsets[f, e, 1].tolist()))
        spans.sort(key=lambda span: -span[0])
        best = [{"text": example.context[c0:c1], "score": sc, "start_logit": sl, "end_logit": el}
                for sc, sl, el, c0, c1 in spans[:n_best_size]]
        best_text = best[0]["text"] if best else ""
        if version_2_with_negative and null_score is not None:
            best_score = best[0]["score"] if best else -np.inf
            diff = null_score[0] - best_score
            null_odds[example.id] = float(diff) if np.isfinite(diff) else float("inf")
            if diff > null_score_diff_threshold:
                best_text = ""
            best.append({"text": "", "score": null_score[0], "start_logit": null_score[1], "end_logit": null_score[2]})
            best.sort(key=lambda candidate: -candidate["score"])
            best = best[:n_best_size]
        answers[example.id] = best_text
        nbest[example.id] = best
    return Predictions(answers, null_odds, nbest)


# ----------------------------------------------------------------------------- scores


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
