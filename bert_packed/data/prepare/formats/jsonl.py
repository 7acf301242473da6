"""``jsonl``: one JSON object per line; its text field (``--text-column``) is one document.

Claimed by name (.jsonl, .ndjson, .json) or by a first line that is a JSON object (after a
byte-order mark: a JSONL file with a BOM is JSONL, whatever its name). Newlines in the text
separate paragraphs, which are split into sentences. A line that is not JSON, a record without the
field, a null text and a text that is not a string are refused, naming the line.
"""
import json

from bert_packed.data.errors import DataError
from bert_packed.data.prepare.formats.base import TextFormat, first_line, text_sentences


class JsonLines(TextFormat):
    name = "jsonl"
    suffixes = (".jsonl", ".ndjson", ".json")
    help = "one JSON object per line, the text in --text-column"

    def sniff(self, head, first):
        if not first.startswith(b"{"):
            return False
        try:
            return isinstance(json.loads(first), dict)
        except ValueError:
            return False

    def boundary(self, line):
        return "at"

    def documents(self, lines, path, start, text_column, max_seq_length):
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}: line {first_line(path, start) + number}: not JSON ({str(exc)[:120]}); "
                                f"JSONL input is one JSON object per line") from None
            text = record.get(text_column) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}: line {first_line(path, start) + number}: {_why(record, text_column)}")
            document = text_sentences(text)
            if document:
                yield document


def _why(record, text_column):
    if isinstance(record, dict) and text_column in record:
        value = record[text_column]
        if value is None:
            return f"null text in field {text_column!r}; leave the record out or give it text"
        return (f"field {text_column!r} holds a JSON {type(value).__name__}, not text; name the text field with "
                f"--text-column")
    keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
    return f"no text field {text_column!r} (the record has {keys or 'no fields'}); name the field with --text-column"


FORMAT = JsonLines()
