"""SQuAD data, from files to packed batches (plain data and numpy, no torch).

1. **Read**: SQuAD v1.1 / v2.0 JSON and Hugging Face ``squad`` / ``squad_v2`` rows in,
   :class:`SquadExample` objects out (no tokenizer).

   - ``read_squad(path)``: a SQuAD JSON file (``{"version", "data": [{"title", "paragraphs":
     [{"context", "qas": [{"id", "question", "answers", "is_impossible"}]}]}]}``), flat rows as
     JSON lines or a JSON list (``id, title, context, question, answers: {"text": [...],
     "answer_start": [...]}``), or such a split saved with ``save_to_disk`` (a directory;
     needs ``datasets``);
   - ``examples_from_squad_json(document)`` / ``examples_from_rows(rows)``: the same from data
     in memory.

   Every question is checked before anything is trained; what is malformed or contradicts
   itself is a one-line ``DataError`` naming the file, the question id and the value (see
   ``read_squad``). One fix-up is a documented convenience: an ``answer_start`` up to
   ``ANSWER_START_TOLERANCE`` characters off its text is moved to the text, and the moves are
   counted in one note line.

2. **Featurise**: question + context windows through the checkpoint's fast tokenizer.
   :func:`build_features` tokenises question + context with the ``tokenizers`` library (the
   engine behind Hugging Face's fast tokenizers); a long context is split into overlapping
   windows of ``max_seq_length`` tokens that share ``doc_stride`` context tokens (Hugging Face's
   ``stride`` semantics, so the features are exactly those of ``tokenizer(question, context,
   truncation="only_second", stride=..., return_overflowing_tokens=True)``), with the character
   offsets of every context token. The answer is mapped to the token start / end of every
   window that contains it whole; a window that does not (and every window of an unanswerable
   v2.0 question) points at its own [CLS] (token 0), as Hugging Face's ``run_qa.py`` does.

3. **Pack and collate**: features side by side in fixed ``[B, S]`` rows.
   :func:`pack_features` plans the packs with the ``packing`` library (depth 1 = the padded
   layout); :func:`collate_question_answering` builds the batch ``QA_FIELDS``: each feature with
   its own [CLS], positions restarting, and the answer positions moved to pack columns;
   :func:`feature_slots` maps every pack slot back to its feature. The model side is
   ``bert_packed.tasks.squad.model.BertForQuestionAnswering``.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from bert_packed.collate import BatchError, one_per_pack, pack_tokens, per_sequence
from bert_packed.data import DataError

__all__ = ["SquadExample", "read_squad", "examples_from_rows", "examples_from_squad_json", "squad_version",
           "ANSWER_START_TOLERANCE", "SquadFeatures", "backend_tokenizer", "build_features",
           "QA_FIELDS", "pack_features", "collate_question_answering", "feature_slots"]


@dataclass
class SquadExample:
    """One question about one context. ``answers`` are ``(text, answer_start)`` pairs
    (character offset into ``context``); empty for an unanswerable (v2.0) question."""

    id: str
    question: str
    context: str
    answers: List[Tuple[str, int]] = field(default_factory=list)
    title: str = ""

    @property
    def is_impossible(self) -> bool:
        return not self.answers

    @property
    def answer_texts(self) -> List[str]:
        return [text for text, _ in self.answers]


# An answer_start at most this many characters off its text is moved to the text (and counted
# in one note line): hand-made files and converters that strip a leading space or count a
# "\r\n" as two characters are off by a few. Anything further is refused: the nearest
# occurrence of a short answer ("1674", "the") far away is a guess, not a fix.
ANSWER_START_TOLERANCE = 8


@dataclass
class Moved:
    """Answers whose ``answer_start`` was moved to their text: ``count``, and the first one
    (question id, the start given, the start used)."""

    count: int = 0
    first: Optional[Tuple[str, int, int]] = None

    def add(self, example_id: str, given: int, used: int) -> None:
        self.count += 1
        if self.first is None:
            self.first = (example_id, given, used)

    def note(self, where: str) -> Optional[str]:
        if not self.count:
            return None
        example_id, given, used = self.first
        return (f"note: {where}: moved {self.count} answer_start(s) to their answer text, at most "
                f"{ANSWER_START_TOLERANCE} characters away (first: question {example_id!r}, {given} -> {used})")


def _checked_answer(example_id: str, context: str, text: Any, start: Any, where: str,
                    moved: Optional[Moved] = None) -> Tuple[str, int]:
    """(text, start) with ``context[start:start+len(text)] == text``. A start up to
    ``ANSWER_START_TOLERANCE`` characters off is moved to the nearest occurrence (counted in
    ``moved``); a negative start, one past the context, or one further off is a DataError."""
    what = f"{where}: question {example_id!r}"
    if not isinstance(text, str) or not text:
        raise DataError(f"{what} has an answer without text (answer text {text!r})")
    if isinstance(start, bool) or not isinstance(start, int):
        raise DataError(f"{what}: answer_start must be an integer, got {start!r} (answer {text!r})")
    if start < 0:
        raise DataError(f"{what}: answer_start {start} is negative (answer {text!r}); it is the answer's character "
                        f"offset in the context, from 0")
    if start >= len(context):
        raise DataError(f"{what}: answer_start {start} is past the end of its {len(context)}-character context "
                        f"(answer {text!r})")
    if context[start:start + len(text)] == text:
        return text, start
    found = list(_occurrences(context, text))
    if not found:
        raise DataError(f"{what}: answer {text!r} does not occur in its context (answer_start {start})")
    nearest = min(found, key=lambda i: (abs(i - start), i))
    if abs(nearest - start) > ANSWER_START_TOLERANCE:
        raise DataError(f"{what}: answer_start {start} does not point at its answer {text!r}, which occurs "
                        f"{abs(nearest - start)} characters away (at {nearest}); a start at most "
                        f"{ANSWER_START_TOLERANCE} characters off is moved to the text, one further off is refused: "
                        f"fix answer_start")
    if moved is not None:
        moved.add(example_id, start, nearest)
    return text, nearest


def _occurrences(context: str, text: str) -> Iterable[int]:
    index = context.find(text)
    while index >= 0:
        yield index
        index = context.find(text, index + 1)


def _require(mapping: Any, key: str, kind: type, where: str, what: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise DataError(f"{where}: {what} has no {key!r} field")
    value = mapping[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataError(f"{where}: {what}: {key!r} must be a {expected}, got {type(value).__name__} {value!r}")
    return value


def _impossible_flag(qa: Mapping[str, Any], what: str) -> Optional[bool]:
    """The ``is_impossible`` field: True / False, None when absent; anything else refused (the
    string "false" is truthy: guessing would drop every answer)."""
    if "is_impossible" not in qa:
        return None
    value = qa["is_impossible"]
    if not isinstance(value, bool):
        raise DataError(f"{what}: is_impossible must be true or false, got {value!r}")
    return value


def _answers(example_id: str, context: str, texts: List[Any], starts: List[Any], impossible: Optional[bool],
             where: str, moved: Optional[Moved]) -> List[Tuple[str, int]]:
    """The checked answers of one question; ``is_impossible`` contradicting them is refused."""
    what = f"{where}: question {example_id!r}"
    if len(texts) != len(starts):
        raise DataError(f"{what}: answers.text has {len(texts)} entries but answers.answer_start has {len(starts)}; "
                        f"they pair up, one start per text")
    if impossible is True and texts:
        raise DataError(f"{what}: is_impossible is true but it has {len(texts)} answer(s) (first {texts[0]!r}); an "
                        f"unanswerable question has answers [] (SQuAD v2.0 keeps the others as plausible_answers)")
    if impossible is False and not texts:
        raise DataError(f"{what}: is_impossible is false but it has no answers; give its answers, or set "
                        f"is_impossible to true")
    return [_checked_answer(example_id, context, t, s, where, moved) for t, s in zip(texts, starts)]


def examples_from_squad_json(document: Mapping[str, Any], where: str = "SQuAD JSON", *,
                             moved: Optional[Moved] = None) -> List[SquadExample]:
    """Examples of a SQuAD v1.1 / v2.0 document (the ``{"version", "data": [...]}`` object).

    A question's ``answers`` must be a list of ``{"text", "answer_start"}``; ``is_impossible``
    (v2.0; a boolean) must agree with it: true with answers, or false without, is refused, as
    is an unanswerable question in a document whose ``version`` is 1.x."""
    examples = []
    version = str(document.get("version", "")) if isinstance(document, dict) else ""
    for article in _require(document, "data", list, where, "the document"):
        title = article.get("title", "") if isinstance(article, dict) else ""
        for paragraph in _require(article, "paragraphs", list, where, f"article {title!r}"):
            context = _require(paragraph, "context", str, where, f"a paragraph of {title!r}")
            for qa in _require(paragraph, "qas", list, where, f"a paragraph of {title!r}"):
                example_id = str(_require(qa, "id", (str, int), where, f"a question of {title!r}"))
                what = f"question {example_id!r}"
                question = _require(qa, "question", str, where, what)
                impossible = _impossible_flag(qa, f"{where}: {what}")
                # v2.0: an impossible question's answers are empty (its "plausible_answers" are not answers).
                raw = _require(qa, "answers", list, where, what)
                for answer in raw:
                    if not isinstance(answer, dict):
                        raise DataError(f"{where}: {what}: each answer must be an object {{\"text\", \"answer_start\"}}, "
                                        f"got {answer!r}")
                answers = _answers(example_id, context, [a.get("text") for a in raw],
                                   [a.get("answer_start") for a in raw], impossible, where, moved)
                if not answers and version.lstrip("v").startswith("1"):
                    raise DataError(f"{where}: {what} is unanswerable (no answers) but the document's version is "
                                    f"{version!r}; SQuAD v1.x has no unanswerable questions: give its answers, or mark "
                                    f"the file v2.0")
                examples.append(SquadExample(example_id, question, context, answers, title))
    return examples


def examples_from_rows(rows: Iterable[Mapping[str, Any]], where: str = "rows", *, moved: Optional[Moved] = None,
                       numbers: Optional[Sequence[int]] = None, unit: str = "row") -> List[SquadExample]:
    """Examples of flat Hugging Face ``squad`` / ``squad_v2`` rows (``datasets`` or JSON lines):
    ``id, title, context, question, answers: {"text": [...], "answer_start": [...]}`` (or a
    list of ``{"text", "answer_start"}``). ``answers`` is required (an unanswerable question
    has empty lists); an ``is_impossible`` field must agree with it. ``numbers``: each row's
    line or row number for messages (``unit`` names it)."""
    examples = []
    for index, row in enumerate(rows):
        what = f"{unit} {numbers[index] if numbers is not None else index + 1}"
        example_id = str(_require(row, "id", (str, int), where, what))
        context = _require(row, "context", str, where, what)
        question = _require(row, "question", str, where, what)
        impossible = _impossible_flag(row, f"{where}: question {example_id!r}")
        answers = _require(row, "answers", (dict, list), where, f"{what} (question {example_id!r})")
        if isinstance(answers, list):  # rows written from SQuAD JSON: [{"text", "answer_start"}, ...]
            if not all(isinstance(a, dict) for a in answers):
                raise DataError(f"{where}: question {example_id!r}: each answer must be an object "
                                f"{{\"text\", \"answer_start\"}}")
            texts, starts = [a.get("text") for a in answers], [a.get("answer_start") for a in answers]
        else:
            texts = _require(answers, "text", list, where, f"question {example_id!r}: answers")
            starts = _require(answers, "answer_start", list, where, f"question {example_id!r}: answers")
        pairs = _answers(example_id, context, texts, starts, impossible, where, moved)
        examples.append(SquadExample(example_id, question, context, pairs, str(row.get("title", ""))))
    return examples


def read_squad(path: str, *, notes: bool = True, moved: Optional[Moved] = None) -> List[SquadExample]:
    """Examples of a SQuAD JSON file, of flat rows as JSON lines / a JSON list, or of a Hugging
    Face ``squad`` / ``squad_v2`` split saved with ``save_to_disk`` (a directory; needs ``datasets``).

    Raises ``DataError`` (one line naming the file, question and value) for a missing, empty,
    non-UTF-8 or malformed file, a key twice in one object, duplicate question ids, an answer
    that is not in its context, an ``answer_start`` that is negative, past the context or more
    than ``ANSWER_START_TOLERANCE`` characters off its text, answers texts and starts that do
    not pair up, and ``is_impossible`` / ``version`` contradicting the answers. Starts moved
    to their text are counted in one ``note:`` line on stderr (``notes``; a caller that reports
    it itself, e.g. from one process of many, passes ``notes=False`` and its own ``moved``).
    """
    moved = Moved() if moved is None else moved
    if os.path.isdir(path):  # a Hugging Face dataset saved with save_to_disk (squad / squad_v2 columns)
        from bert_packed.tasks.data import read_table

        table = read_table(path, ("id", "context", "question", "answers"))
        examples = examples_from_rows([dict(zip(table, row)) for row in zip(*table.values())], path, moved=moved)
    else:
        examples = _read_squad_file(path, moved)
    examples = _unique_ids(examples, path)
    note = moved.note(path)
    if note and notes:
        print(note, file=sys.stderr)
    return examples


def _read_squad_file(path: str, moved: Moved) -> List[SquadExample]:
    from bert_packed.tasks.data import no_duplicate_keys
    from bert_packed.io.files import read_utf8

    if not os.path.isfile(path):
        raise DataError(f"SQuAD file {path} does not exist")
    text = read_utf8(path, DataError)
    if not text.strip():
        raise DataError(f"SQuAD file {path} is empty")
    try:
        document = json.loads(text, object_pairs_hook=no_duplicate_keys(path))
    except json.JSONDecodeError:
        rows, numbers = [], []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line, object_pairs_hook=no_duplicate_keys(f"{path}: line {number}")))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {number} is not JSON ({exc.msg} at column {exc.colno}); expected SQuAD "
                                f"JSON or JSON lines") from None
            numbers.append(number)
        return examples_from_rows(rows, path, moved=moved, numbers=numbers, unit="line")
    if isinstance(document, dict) and "data" in document:
        return examples_from_squad_json(document, path, moved=moved)
    if isinstance(document, dict):  # a one-line JSON-lines file
        return examples_from_rows([document], path, moved=moved, numbers=[1], unit="line")
    if isinstance(document, list):
        return examples_from_rows(document, path, moved=moved)
    raise DataError(f"{path}: a JSON {type(document).__name__}, not SQuAD JSON (an object with \"data\") nor rows")


def _unique_ids(examples: List[SquadExample], path: str) -> List[SquadExample]:
    if not examples:
        raise DataError(f"SQuAD file {path} holds no questions")
    seen = set()
    for example in examples:
        if example.id in seen:
            raise DataError(f"{path}: question id {example.id!r} occurs twice (ids key predictions.json)")
        seen.add(example.id)
    return examples



def squad_version(train: Sequence[SquadExample], validation: Sequence[SquadExample],
                  version_2_with_negative: Optional[bool], *, train_where: str, validation_where: str) -> bool:
    """Whether the job is SQuAD v2.0: ``finetune.version_2_with_negative``, or (null) whether
    any question is unanswerable. Set to false, an unanswerable question in the training file
    is as much a contradiction as one in the validation file (it would be trained to point at
    [CLS] in a v1.1 job): ``DataError`` naming the file and the question."""
    if version_2_with_negative is None:
        return any(example.is_impossible for example in list(train) + list(validation))
    if not version_2_with_negative:
        for examples, where in ((train, train_where), (validation, validation_where)):
            impossible = [example.id for example in examples if example.is_impossible]
            if impossible:
                raise DataError(f"{where}: question {impossible[0]!r} is unanswerable (no answers), and "
                                f"{len(impossible)} in all, but finetune.version_2_with_negative is false (SQuAD "
                                f"v1.1); set it to true (or null), or remove them")
    return bool(version_2_with_negative)


# ----------------------------------------------------------------------------- features


class SquadFeatures(NamedTuple):
    """Tokenised windows, one row per feature, padded to ``max_seq_length`` columns.

    ``input_ids``/``segment_ids``/``input_mask`` ``[F, L]``; ``offsets`` ``[F, L, 2]``:
    character span in the context of every context token, -1 elsewhere (question, special
    tokens, padding); ``example_index`` ``[F]``; ``start_positions`` / ``end_positions``
    ``[F]``: answer tokens within the feature (0 = its [CLS]: no answer in this window).
    """

    input_ids: np.ndarray
    segment_ids: np.ndarray
    input_mask: np.ndarray
    offsets: np.ndarray
    example_index: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self.input_mask.sum(axis=1).astype(np.int64)

    @property
    def num_features(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, indices) -> "SquadFeatures":
        """The features at ``indices`` (an index array, slice or boolean mask)."""
        return SquadFeatures(*(np.asarray(array)[indices] for array in self))

    def samples(self) -> Dict[str, np.ndarray]:
        """The per-feature arrays ``collate_question_answering`` reads."""
        return {"input_ids": self.input_ids, "segment_ids": self.segment_ids, "input_mask": self.input_mask,
                "start_positions": self.start_positions, "end_positions": self.end_positions}


def backend_tokenizer(tokenizer: Any):
    """A private copy of the ``tokenizers.Tokenizer`` behind ``tokenizer`` (a Hugging Face fast
    tokenizer, or a ``tokenizers.Tokenizer``): truncation and padding are set per call, so
    the caller's object is left as it was."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise DataError("question answering needs a fast tokenizer (a tokenizer.json, or a vocab.txt that "
                        f"transformers converts); got {type(tokenizer).__name__}")
    return Tokenizer.from_str(backend.to_str())


def _answer_tokens(offsets: np.ndarray, is_context: np.ndarray, start_char: int, end_char: int) -> Tuple[int, int]:
    """(start, end) token of the character span [start_char, end_char) in one window, or (0, 0)
    (the [CLS]) when the window's context does not contain the whole span.

    ``offsets`` ``[L, 2]`` character spans, ``is_context`` ``[L]`` bool. The start is the last
    context token beginning at or before ``start_char``, the end the first one ending at or
    after ``end_char`` (so an answer inside a word piece maps to the whole piece).
    """
    context = np.nonzero(is_context)[0]
    first, last = int(context[0]), int(context[-1])
    if offsets[first, 0] > start_char or offsets[last, 1] < end_char:
        return 0, 0
    start = int(context[np.nonzero(offsets[context, 0] <= start_char)[0][-1]])
    end = int(context[np.nonzero(offsets[context, 1] >= end_char)[0][0]])
    return start, end


def build_features(examples: Sequence[SquadExample], tokenizer: Any, *, max_seq_length: int = 384,
                   doc_stride: int = 128, max_query_length: int = 64, show_progress: bool = False) -> SquadFeatures:
    """Tokenise every example into one or more windows (see the module docstring).

    ``doc_stride`` is the number of context tokens consecutive windows share (Hugging
    Face's ``stride``; the original BERT script's ``doc_stride`` was the step between window
    starts instead). Questions longer than ``max_query_length`` tokens are cut to that many.
    The answer labels use each example's first answer (as Hugging Face trains).
    """
    if max_query_length < 1 or max_seq_length < max_query_length + 4:
        raise DataError(f"max_seq_length={max_seq_length} leaves no room for context after a question of up to "
                        f"max_query_length={max_query_length} tokens and 3 special tokens")
    room = max_seq_length - max_query_length - 3  # fewest context tokens a window can hold
    if not 0 <= doc_stride < room:
        raise DataError(f"doc_stride={doc_stride} must be below the context room of a window "
                        f"({room} = max_seq_length - max_query_length - 3); lower finetune.doc_stride")
    tok = backend_tokenizer(tokenizer)
    tok.no_padding()
    tok.no_truncation()
    question_tok = backend_tokenizer(tok)
    tok.enable_truncation(max_seq_length, stride=doc_stride, strategy="only_second", direction="right")

    L = int(max_seq_length)
    ids, segments, masks, offsets_out, example_index, starts, ends = [], [], [], [], [], [], []
    pairs = []
    for example in examples:
        if not example.context.strip():
            raise DataError(f"question {example.id!r} has an empty context")
        question = example.question.lstrip()  # leading spaces make the window arithmetic fail (HF run_qa)
        if not question.strip():
            raise DataError(f"question {example.id!r} is empty")
        pairs.append((question, example.context))
    # Questions over max_query_length tokens are cut at that token's end.
    for i, encoding in enumerate(question_tok.encode_batch([q for q, _ in pairs], add_special_tokens=False)):
        if len(encoding.ids) > max_query_length:
            pairs[i] = (pairs[i][0][:encoding.offsets[max_query_length - 1][1]], pairs[i][1])

    chunk = 256  # encode_batch runs in Rust threads; chunks keep the progress bar moving
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(pairs), desc="tokenising", unit="question")
    for first in range(0, len(pairs), chunk):
        encodings = tok.encode_batch(pairs[first:first + chunk])
        for index, encoding in enumerate(encodings, first):
            example = examples[index]
            answer = example.answers[0] if example.answers else None
            for window in [encoding] + list(encoding.overflowing):
                # Encoding properties build a new list on every access: read each once.
                sequence_ids, window_ids, window_offsets = window.sequence_ids, window.ids, window.offsets
                if sequence_ids[0] is not None or 1 not in sequence_ids:
                    raise DataError("the tokenizer does not frame question and context as [CLS] question [SEP] "
                                    "context [SEP] (no post-processor?); use the checkpoint's BERT tokenizer")
                n = len(window_ids)
                is_context = np.zeros(L, dtype=bool)
                is_context[:n] = np.asarray([s == 1 for s in sequence_ids])
                row_offsets = np.full((L, 2), -1, dtype=np.int64)
                row_offsets[:n][is_context[:n]] = np.asarray(window_offsets, dtype=np.int64)[is_context[:n]]
                if answer is None:
                    start, end = 0, 0
                else:
                    start, end = _answer_tokens(row_offsets, is_context, answer[1], answer[1] + len(answer[0]))
                pad = L - n
                ids.append(window_ids + [0] * pad)
                segments.append(window.type_ids + [0] * pad)
                masks.append([1] * n + [0] * pad)
                offsets_out.append(row_offsets)
                example_index.append(index)
                starts.append(start)
                ends.append(end)
        if progress is not None:
            progress.update(len(encodings))
    if progress is not None:
        progress.close()
    if not ids:
        raise DataError("no questions to tokenise")
    return SquadFeatures(
        input_ids=np.asarray(ids, dtype=np.int64), segment_ids=np.asarray(segments, dtype=np.int64),
        input_mask=np.asarray(masks, dtype=np.int64), offsets=np.stack(offsets_out),
        example_index=np.asarray(example_index, dtype=np.int64),
        start_positions=np.asarray(starts, dtype=np.int64), end_positions=np.asarray(ends, dtype=np.int64))


# ----------------------------------------------------------------------------- packed batches


# The packed QA batch (BertForQuestionAnswering's inputs): token fields [B, S], then per
# feature slot [B, K]: its [CLS] column, answer start / end columns (absolute in the pack),
# and 1.0 where the slot holds a feature.
QA_FIELDS = ("input_ids", "segment_ids", "position_ids", "sequence_ids", "cls_positions",
             "start_positions", "end_positions", "label_weights")


def pack_features(lengths: np.ndarray, *, max_sequence_length: int, max_sequences_per_pack: int,
                  algorithm: str = "lpfhp", seed: int = 0, shuffle: bool = False):
    """Packs of feature indices (``packing.Assignment``; depth 1 = one feature per row).

    Features keep their index, so predictions map back to examples whatever the order.
    """
    from packing import Histogram, assign, pack

    lengths = np.asarray(lengths, dtype=np.int64)
    if max_sequences_per_pack == 1:
        order = np.random.default_rng(seed).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
        return one_per_pack(order)
    histogram = Histogram.from_lengths(lengths, max_sequence_length=max_sequence_length, name="squad features")
    result = pack(histogram, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed)
    return assign(result.plan, lengths, seed=seed, shuffle_packs=shuffle)


def collate_question_answering(samples: Mapping[str, np.ndarray], assignment: Any, *, max_sequence_length: int,
                               max_sequences_per_pack: int) -> Dict[str, np.ndarray]:
    """Packed QA batch (``QA_FIELDS``, numpy) of ``assignment``'s packs of ``samples``.

    ``samples``: ``input_ids``, ``segment_ids``, ``input_mask`` and per-feature
    ``start_positions`` / ``end_positions`` (token within the feature), e.g.
    ``SquadFeatures.samples()``. The answer positions become pack columns (feature start +
    token), so the model needs no per-feature offset; empty slots point at column 0 with
    weight 0.
    """
    S, K = int(max_sequence_length), int(max_sequences_per_pack)
    batch, layout = pack_tokens(samples, assignment, S, K)
    lengths = layout.lengths
    for name in ("start_positions", "end_positions"):
        local = np.asarray(samples[name], dtype=np.int64)[layout.order]
        if len(local) and (local.min() < 0 or np.any(local >= lengths)):
            bad = int(np.argmax((local < 0) | (local >= lengths)))
            raise BatchError(f"feature {int(layout.order[bad])}: {name} {int(local[bad])} is outside its "
                             f"{int(lengths[bad])} tokens")
        absolute = np.zeros((len(layout.offsets) - 1, K), dtype=np.int64)
        absolute[layout.pack_of, layout.slot] = layout.start + local
        batch[name] = absolute
    batch["label_weights"] = per_sequence(layout, np.ones(len(np.asarray(samples["input_ids"]))), K, np.float32)
    return batch


def feature_slots(assignment: Any, max_sequences_per_pack: int) -> np.ndarray:
    """``[P, K]`` feature index of every pack slot of ``assignment`` (-1 for an empty slot):
    how a packed batch's per-slot outputs map back to features."""
    offsets = np.asarray(assignment.pack_offsets, dtype=np.int64)
    indices = np.asarray(assignment.sequence_indices, dtype=np.int64)
    per_pack = np.diff(offsets)
    pack_of = np.repeat(np.arange(len(per_pack)), per_pack)
    slot = np.arange(len(indices)) - offsets[pack_of]
    out = np.full((len(per_pack), int(max_sequences_per_pack)), -1, dtype=np.int64)
    out[pack_of, slot] = indices
    return out
