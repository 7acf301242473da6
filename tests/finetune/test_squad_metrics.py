"""EM / F1 against values worked out by hand from the official SQuAD definitions, and the
post-processing rules (n-best, windows merged, max answer length, null threshold)."""
from types import SimpleNamespace

import numpy as np
import pytest

from bert_packed.tasks.squad.data import SquadExample
from bert_packed.tasks.squad.metrics import normalize_answer, postprocess_predictions, squad_scores


def _example(key, *golds):
    return SquadExample(key, "q?", "context", [(g, 0) for g in golds])


# (prediction, gold answers, EM, F1), each worked by hand:
CASES = [
    # articles, punctuation and case vanish: "eiffel tower" == "eiffel tower"
    ("The Eiffel Tower!", ["eiffel tower"], 1, 1.0),
    # "in paris france" vs "paris": 1 common of 3 predicted / 1 gold: P=1/3 R=1 F1=2(1/3)/(4/3)=1/2
    ("in  Paris, France", ["Paris"], 0, 0.5),
    # several gold answers: the best one counts ("red apple" matches the third exactly)
    ("a red apple", ["apple", "green apple", "red apple"], 1, 1.0),
    # "old red barn" vs "red barn": P=2/3 R=1 F1=0.8; vs "barn": P=1/3 R=1 F1=0.5 -> max 0.8
    ("an old red barn", ["the red barn", "barn"], 0, 0.8),
    # repeated tokens count once per match: "cat cat cat" vs "cat": common 1, P=1/3 R=1 -> 0.5
    ("the the cat cat cat", ["cat"], 0, 0.5),
    # whitespace inside: tabs/newlines collapse; hyphen is punctuation and is removed (not split)
    ("New\tYork-City", ["new yorkcity"], 1, 1.0),
]


def test_exact_match_and_f1_match_hand_worked_values_v1():
    examples = [_example(f"q{i}", *gold) for i, (_, gold, _, _) in enumerate(CASES)]
    predictions = {f"q{i}": pred for i, (pred, _, _, _) in enumerate(CASES)}
    scores = squad_scores(predictions, examples)
    em = 100 * sum(c[2] for c in CASES) / len(CASES)  # 3 of 6 -> 50
    f1 = 100 * sum(c[3] for c in CASES) / len(CASES)  # (1 + .5 + 1 + .8 + .5 + 1) / 6 = 0.8
    assert scores["total"] == 6
    assert scores["exact_match"] == pytest.approx(50.0) == pytest.approx(em)
    assert scores["f1"] == pytest.approx(80.0) == pytest.approx(f1)
    assert "has_ans_f1" not in scores


def test_v2_empty_answers_score_only_the_empty_prediction():
    examples = [_example("none-ok"), _example("none-bad"), _example("has-ok", "Paris"), _example("has-empty", "Paris"),
                _example("gold-is-article", "the", "Rome")]
    predictions = {"none-ok": "", "none-bad": "Paris", "has-ok": "paris.", "has-empty": "", "gold-is-article": "Rome"}
    scores = squad_scores(predictions, examples)
    # no-answer: "" == "" -> 1; "Paris" vs "" -> 0.  has-answer: 1, 0, and "the" (normalises to
    # nothing) is dropped from the golds, "Rome" matches -> 1.  Overall 3 of 5.
    assert scores["no_ans_total"] == 2 and scores["has_ans_total"] == 3
    assert scores["no_ans_exact_match"] == pytest.approx(50.0) and scores["no_ans_f1"] == pytest.approx(50.0)
    assert scores["has_ans_exact_match"] == pytest.approx(200 / 3) and scores["has_ans_f1"] == pytest.approx(200 / 3)
    assert scores["exact_match"] == pytest.approx(60.0) and scores["f1"] == pytest.approx(60.0)


def test_missing_prediction_scores_zero_and_normalisation_is_the_official_one():
    examples = [_example("a", "x y"), _example("b", "x y")]
    with pytest.warns(UserWarning):
        scores = squad_scores({"a": "x y"}, examples)
    assert scores["exact_match"] == pytest.approx(50.0)
    assert normalize_answer("  The  Quick, (brown) fox!  ") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    with pytest.raises(ValueError, match="no gold answer"):
        squad_scores({"a": ""}, [_example("a")], version_2=False)


# ----------------------------------------------------------------------------- post-processing


def _features(context_tokens, lengths, example_index):
    """Offsets where token t of a window covers characters [2t, 2t+1) of the context."""
    F, L = len(lengths), max(lengths)
    offsets = np.full((F, L, 2), -1, dtype=np.int64)
    for f, tokens in enumerate(context_tokens):
        for t, char in tokens.items():
            offsets[f, t] = (char, char + 1)
    return SimpleNamespace(offsets=offsets, example_index=np.asarray(example_index), lengths=np.asarray(lengths))


def test_best_span_across_windows_with_length_and_order_rules():
    context = "abcdefghij"
    example = SquadExample("q", "?", context, [("c", 2)])
    # Window 0 holds chars 0..5 at tokens 2..7; window 1 chars 4..9 at tokens 2..7 ([CLS] q [SEP] first).
    features = _features([{2 + i: i for i in range(6)}, {2 + i: 4 + i for i in range(6)}], [9, 9], [0, 0])
    start = np.full((2, 9), -5.0)
    end = np.full((2, 9), -5.0)
    start[0, 2], end[0, 7] = 4.0, 4.0  # window 0: "abcdef" (6 tokens) score 8, over max_answer_length=3
    start[0, 1], end[0, 1] = 9.0, 9.0  # a question token: never part of an answer
    start[1, 4], end[1, 5] = 3.5, 3.0  # window 1: "gh", score 6.5
    end[1, 3] = 3.4                    # ends before the best start of its window: not a span with it
    preds = postprocess_predictions([example], features, start, end, n_best_size=5, max_answer_length=3)
    assert preds.answers == {"q": "gh"}
    nbest = preds.nbest["q"]
    assert len(nbest) == 5 and nbest[0]["score"] == pytest.approx(6.5)
    assert [c["score"] for c in nbest] == sorted((c["score"] for c in nbest), reverse=True)
    assert all(1 <= len(c["text"]) <= 3 for c in nbest)
    preds = postprocess_predictions([example], features, start, end, n_best_size=5, max_answer_length=6)
    assert preds.answers == {"q": "abcdef"}  # now allowed: score 8
    assert preds.null_odds == {}


def test_null_threshold_uses_the_lowest_null_score_over_windows():
    example = SquadExample("q", "?", "abcdef", [])
    features = _features([{2 + i: i for i in range(4)}, {2 + i: 2 + i for i in range(4)}], [7, 7], [0, 0])
    start, end = np.zeros((2, 7)), np.zeros((2, 7))
    start[:, 0], end[:, 0] = [3.0, 1.0], [3.0, 1.0]  # null scores 6 and 2: the question's null score is 2
    start[0, 3], end[0, 3] = 2.0, 1.5               # best span "b", score 3.5
    preds = postprocess_predictions([example], features, start, end, version_2_with_negative=True)
    assert preds.answers == {"q": "b"} and preds.null_odds["q"] == pytest.approx(2 - 3.5)
    preds = postprocess_predictions([example], features, start, end, version_2_with_negative=True,
                                    null_score_diff_threshold=-2.0)
    assert preds.answers == {"q": ""}  # -1.5 > -2: the null answer wins
    assert "" in [c["text"] for c in preds.nbest["q"]]
