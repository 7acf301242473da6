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
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Mapping, Tuple

from bert_packed.data import DataError

__all__ = ["SquadExample", "read_squad", "examples_from_rows", "examples_from_squad_json"]


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


def _checked_answer(example_id: str, context: str, text: Any, start: Any, where: str) -> Tuple[str, int]:
    """(text, start) with ``context[start:start+len(text)] == text``; a start that is off by
    a few characters (some hand-made files) is moved to the nearest occurrence."""
    if not isinstance(text, str) or not text:
        raise DataError(f"{where}: question {example_id!r} has an answer without text")
    if isinstance(start, bool) or not isinstance(start, int):
        raise DataError(f"{where}: question {example_id!r}: answer_start must be an integer, got {start!r}")
    if context[start:start + len(text)] == text:
        return text, start
    found = list(_occurrences(context, text))
    if not found:
        raise DataError(f"{where}: question {example_id!r}: answer {text!r} does not occur in its context")
    nearest = min(found, key=lambda i: abs(i - start))
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
    if not isinstance(value, kind):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataError(f"{where}: {what}: {key!r} must be a {expected}, got {type(value).__name__}")
    return value


def examples_from_squad_json(document: Mapping[str, Any], where: str = "SQuAD JSON") -> List[SquadExample]:
    """Examples of a SQuAD v1.1 / v2.0 document (the ``{"version", "data": [...]}`` object)."""
    examples = []
    for article in _require(document, "data", list, where, "the document"):
        title = article.get("title", "") if isinstance(article, dict) else ""
        for paragraph in _require(article, "paragraphs", list, where, f"article {title!r}"):
            context = _require(paragraph, "context", str, where, f"a paragraph of {title!r}")
            for qa in _require(paragraph, "qas", list, where, f"a paragraph of {title!r}"):
                example_id = str(_require(qa, "id", (str, int), where, "a question"))
                question = _require(qa, "question", str, where, f"question {example_id!r}")
                # v2.0: an impossible question's "answers" is empty (its "plausible_answers" are not answers).
                raw = [] if qa.get("is_impossible", False) else qa.get("answers", [])
                if not isinstance(raw, list):
                    raise DataError(f"{where}: question {example_id!r}: 'answers' must be a list")
                answers = [_checked_answer(example_id, context, a.get("text") if isinstance(a, dict) else None,
                                           a.get("answer_start") if isinstance(a, dict) else None, where) for a in raw]
                examples.append(SquadExample(example_id, question, context, answers, title))
    return examples


def examples_from_rows(rows: Iterable[Mapping[str, Any]], where: str = "rows") -> List[SquadExample]:
    """Examples of flat Hugging Face ``squad`` / ``squad_v2`` rows (``datasets`` or JSON lines):
    ``id, title, context, question, answers: {"text": [...], "answer_start": [...]}``."""
    examples = []
    for number, row in enumerate(rows, 1):
        what = f"row {number}"
        example_id = str(_require(row, "id", (str, int), where, what))
        context = _require(row, "context", str, where, what)
        question = _require(row, "question", str, where, what)
        answers = row.get("answers") or {"text": [], "answer_start": []}
        if isinstance(answers, list):  # rows written from SQuAD JSON: [{"text", "answer_start"}, ...]
            answers = {"text": [a.get("text") for a in answers], "answer_start": [a.get("answer_start") for a in answers]}
        texts, starts = answers.get("text", []), answers.get("answer_start", [])
        if len(texts) != len(starts):
            raise DataError(f"{where}: {what}: answers.text and answers.answer_start differ in length")
        pairs = [_checked_answer(example_id, context, t, s, where) for t, s in zip(texts, starts)]
        examples.append(SquadExample(example_id, question, context, pairs, str(row.get("title", ""))))
    return examples


def read_squad(path: str) -> List[SquadExample]:
    """Examples of a SQuAD JSON file, of flat rows as JSON lines / a JSON list, or of a Hugging
    Face ``squad`` / ``squad_v2`` split saved with ``save_to_disk`` (a directory; needs ``datasets``).

    Raises ``DataError`` (one line) for a missing, empty or malformed file, duplicate ids,
    or an answer that is not in its context.
    """
    if os.path.isdir(path):  # a Hugging Face dataset saved with save_to_disk (squad / squad_v2 columns)
        from bert_packed.finetune.data import read_table

        table = read_table(path, ("id", "context", "question", "answers"))
        return _unique_ids(examples_from_rows([dict(zip(table, row)) for row in zip(*table.values())], path), path)
    if not os.path.isfile(path):
        raise DataError(f"SQuAD file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read SQuAD file {path}: {exc}") from None
    if not text.strip():
        raise DataError(f"SQuAD file {path} is empty")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {number} is not JSON ({exc.msg}); expected SQuAD JSON or JSON lines") from None
    if isinstance(document, dict) and "data" in document:
        examples = examples_from_squad_json(document, path)
    elif isinstance(document, dict):  # a one-line JSON-lines file
        examples = examples_from_rows([document], path)
    elif isinstance(document, list):
        examples = examples_from_rows(document, path)
    else:
        examples = examples_from_rows(rows, path)
    return _unique_ids(examples, path)


def _unique_ids(examples: List[SquadExample], path: str) -> List[SquadExample]:
    if not examples:
        raise DataError(f"SQuAD file {path} holds no questions")
    seen = set()
    for example in examples:
        if example.id in seen:
            raise DataError(f"{path}: question id {example.id!r} occurs twice (ids key predictions.json)")
        seen.add(example.id)
    return examples

