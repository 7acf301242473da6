"""SQuAD input: SQuAD v1.1 / v2.0 JSON and Hugging Face ``squad`` / ``squad_v2`` rows in,
:class:`SquadExample` objects out (plain data, no tokenizer, no torch).

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
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from bert_packed.data import DataError

__all__ = ["SquadExample", "read_squad", "examples_from_rows", "examples_from_squad_json", "squad_version",
           "ANSWER_START_TOLERANCE"]


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
        from bert_packed.finetune.data import read_table

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
    from bert_packed.finetune.data import no_duplicate_keys, read_utf8

    if not os.path.isfile(path):
        raise DataError(f"SQuAD file {path} does not exist")
    text = read_utf8(path)
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
