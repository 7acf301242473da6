"""SQuAD input: reading v1.1/v2.0 JSON and flat rows, windows and answer labels, packed collation.

The windows are checked against Hugging Face's fast tokenizer called as run_qa.py calls it,
the answer labels against the gold text (decoded through the offsets), and the test set
itself is checked to contain what the issue asks for (>= 200 questions, long contexts with
several windows, answers on window edges, unanswerable questions)."""
import dataclasses
import json

import numpy as np
import pytest

from bert_packed.collate import BatchError
from bert_packed.data import DataError
from bert_packed.tasks.squad.data import (QA_FIELDS, build_features, collate_question_answering,
                                             examples_from_rows, examples_from_squad_json, feature_slots,
                                             pack_features, read_squad)
from squad_fixtures import make_features, make_squad_v2, write_squad

S, STRIDE, QUERY = 96, 32, 24


@pytest.fixture(scope="module")
def squad():
    return make_features(S, STRIDE, QUERY)


def _context_tokens(features, f):
    return np.nonzero(features.offsets[f, :, 0] >= 0)[0]


def test_test_set_has_what_the_issue_asks_for(squad):
    _, examples, _, features = squad
    assert len(examples) >= 200
    assert sum(ex.is_impossible for ex in examples) >= 40
    windows = np.bincount(features.example_index)
    assert (windows >= 3).sum() >= 50  # long contexts: several windows each
    first_edge = last_edge = straddle = 0
    for f in range(features.num_features):
        ex = examples[features.example_index[f]]
        context = _context_tokens(features, f)
        start, end = features.start_positions[f], features.end_positions[f]
        first_edge += bool(start) and start == context[0]
        last_edge += bool(end) and end == context[-1]
        if ex.answers and start == 0:  # labelled "no answer here": does the window cut the answer?
            a0, a1 = ex.answers[0][1], ex.answers[0][1] + len(ex.answers[0][0])
            w0, w1 = features.offsets[f, context[0], 0], features.offsets[f, context[-1], 1]
            straddle += (w0 < a1 <= w1 and a0 < w0) or (w0 <= a0 < w1 and a1 > w1)
    assert first_edge >= 3 and last_edge >= 2 and straddle >= 3, (first_edge, last_edge, straddle)


def test_windows_are_hugging_face_fast_tokenizer_windows(squad):
    transformers = pytest.importorskip("transformers")
    _, examples, tokenizer, features = squad
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    out = hf([ex.question for ex in examples], [ex.context for ex in examples], truncation="only_second",
             max_length=S, stride=STRIDE, return_overflowing_tokens=True, return_offsets_mapping=True,
             return_token_type_ids=True)
    assert len(out["input_ids"]) == features.num_features
    np.testing.assert_array_equal(out["overflow_to_sample_mapping"], features.example_index)
    for f, ids in enumerate(out["input_ids"]):
        n = len(ids)
        assert features.lengths[f] == n
        np.testing.assert_array_equal(features.input_ids[f, :n], ids)
        np.testing.assert_array_equal(features.segment_ids[f, :n], out["token_type_ids"][f])
        context = np.asarray([s == 1 for s in out.sequence_ids(f)])
        np.testing.assert_array_equal(features.offsets[f, :n][context], np.asarray(out["offset_mapping"][f])[context])
        assert (features.offsets[f, :n][~context] == -1).all() and (features.offsets[f, n:] == -1).all()


def test_answer_labels_decode_to_the_gold_answer_or_point_at_cls(squad):
    _, examples, _, features = squad
    labelled = 0
    for f in range(features.num_features):
        ex = examples[features.example_index[f]]
        start, end = features.start_positions[f], features.end_positions[f]
        context = _context_tokens(features, f)
        if start == 0:
            assert end == 0
            if ex.answers:  # the window does not hold the whole answer
                a0, a1 = ex.answers[0][1], ex.answers[0][1] + len(ex.answers[0][0])
                assert not (features.offsets[f, context[0], 0] <= a0 and a1 <= features.offsets[f, context[-1], 1])
            continue
        labelled += 1
        assert start in context and end in context and start <= end
        text = ex.context[features.offsets[f, start, 0]:features.offsets[f, end, 1]]
        assert text == ex.answers[0][0]
    # Every answerable question is labelled in at least one window.
    answered = {features.example_index[f] for f in range(features.num_features) if features.start_positions[f]}
    assert answered == {i for i, ex in enumerate(examples) if ex.answers}
    assert labelled > len(answered)  # overlapping windows label the same answer twice


def test_long_question_is_cut_to_max_query_length(squad):
    _, examples, tokenizer, _ = squad
    ex = examples[0]
    long = type(ex)(ex.id, " ".join([ex.question] * 10), ex.context, ex.answers)
    features = build_features([long], tokenizer, max_seq_length=S, doc_stride=STRIDE, max_query_length=QUERY)
    question = features.segment_ids[0, :features.lengths[0]] == 0
    assert question.sum() == QUERY + 2  # [CLS] question [SEP]
    with pytest.raises(DataError, match="doc_stride"):
        build_features([ex], tokenizer, max_seq_length=S, doc_stride=S, max_query_length=QUERY)
    with pytest.raises(DataError, match="max_seq_length"):
        build_features([ex], tokenizer, max_seq_length=20, doc_stride=4, max_query_length=QUERY)


def test_reads_squad_json_rows_and_json_lines_alike(tmp_path):
    document = make_squad_v2(seed=1, num_paragraphs=6)
    from_json = read_squad(write_squad(tmp_path / "v2.json", document))
    rows = [{"id": ex.id, "title": ex.title, "context": ex.context, "question": ex.question,
             "answers": {"text": ex.answer_texts, "answer_start": [s for _, s in ex.answers]}} for ex in from_json]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert read_squad(str(tmp_path / "rows.jsonl")) == from_json
    assert read_squad(str(tmp_path / "rows.json")) == from_json
    assert examples_from_rows(rows) == from_json
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    saved = read_squad(str(tmp_path / "saved"))  # a split saved with save_to_disk (titles are not read)
    assert saved == [dataclasses.replace(ex, title="") for ex in from_json]
    impossible = [ex for ex in from_json if ex.is_impossible]
    assert impossible and all(ex.answers == [] for ex in impossible)
    # v2.0 "plausible_answers" of an impossible question are not answers.
    qa = document["data"][0]["paragraphs"][0]["qas"][-1]
    assert qa["is_impossible"]
    qa["plausible_answers"] = [{"text": "x", "answer_start": 0}]
    (reread,) = [ex for ex in examples_from_squad_json(document) if ex.id == qa["id"]]
    assert reread.answers == []


def test_answer_start_off_by_a_few_characters_is_moved_to_the_text():
    rows = [{"id": "a", "context": "The cat sat on the mat.", "question": "Where?",
             "answers": {"text": ["the mat"], "answer_start": [13]}}]
    (example,) = examples_from_rows(rows)
    assert example.answers == [("the mat", 15)]


@pytest.mark.parametrize("content, needle", [
    ("", "is empty"),
    ("{not json\n", "line 1 is not JSON"),
    ('{"version": "v2.0", "data": []}', "holds no questions"),
    ('{"data": [{"title": "t", "paragraphs": [{"qas": []}]}]}', "no 'context' field"),
    ('{"id": "1", "context": "abc", "question": "q", "answers": {"text": ["zz"], "answer_start": [0]}}',
     "does not occur in its context"),
    ('{"id": "1", "context": "abc", "question": "q", "answers": []}\n'
     '{"id": "1", "context": "abd", "question": "q", "answers": []}\n', "occurs twice"),
    ('{"id": "1", "context": "abc", "question": "q", "answers": {"text": ["a"], "answer_start": []}}',
     "answers.text has 1 entries but answers.answer_start has 0"),
])
def test_bad_files_are_one_line_data_errors(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DataError, match=needle) as info:
        read_squad(str(path))
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="does not exist"):
        read_squad(str(tmp_path / "missing.json"))


def test_packed_collation_keeps_every_feature_and_its_answer(squad):
    _, _, _, features = squad
    K = 4
    assignment = pack_features(features.lengths, max_sequence_length=S, max_sequences_per_pack=K)
    batch = collate_question_answering(features.samples(), assignment, max_sequence_length=S, max_sequences_per_pack=K)
    assert set(batch) == set(QA_FIELDS)
    slots = feature_slots(assignment, K)
    assert sorted(slots[slots >= 0].tolist()) == list(range(features.num_features))
    assert batch["input_ids"].shape[0] < features.num_features  # packing saved rows
    b, k = np.nonzero(slots >= 0)
    f = slots[b, k]
    np.testing.assert_array_equal(batch["label_weights"][b, k], 1.0)
    assert (batch["label_weights"][slots < 0] == 0).all()
    # The answer columns hold the feature's answer tokens, inside the feature's own tokens.
    for name, local in (("start_positions", features.start_positions), ("end_positions", features.end_positions)):
        columns = batch[name][b, k]
        np.testing.assert_array_equal(columns - batch["cls_positions"][b, k], local[f])
        np.testing.assert_array_equal(batch["input_ids"][b, columns], features.input_ids[f, local[f]])
        np.testing.assert_array_equal(batch["sequence_ids"][b, columns], k + 1)
    bad = dict(features.samples(), start_positions=features.lengths.copy())
    with pytest.raises(BatchError, match="outside its"):
        collate_question_answering(bad, assignment, max_sequence_length=S, max_sequences_per_pack=K)


def test_validation_split_holds_out_whole_contexts(squad):
    from bert_packed.tasks.squad.task import split_examples

    _, examples, _, _ = squad
    train, held = split_examples(examples, 0.25, seed=0, where="train.json")
    assert len(train) + len(held) == len(examples) and held and train
    assert not {ex.context for ex in train} & {ex.context for ex in held}
    assert split_examples(examples, 0.25, seed=0, where="x") == (train, held)
    with pytest.raises(DataError, match="too few"):
        split_examples(examples[:1], 0.5, seed=0, where="one.json")
