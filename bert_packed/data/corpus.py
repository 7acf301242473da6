"""Corpus input of the sharded `create`: which files, which format, and blocks of whole documents.

Inputs are files, directories (every file below, recursively, in sorted order; hidden names are
skipped) and globs (expanded here, sorted, so the shell's own order and limits do not matter).
Each file has one of four formats, detected from its name and first line or forced with
``--format``:

- ``lines``: one sentence per line, a blank line between documents (today's `create` input;
  lines are not split further);
- ``wikiextractor``: ``<doc id=.. url=.. title=..>`` ... ``</doc>``; the title line right after
  ``<doc>`` is dropped, every other line is a paragraph split into sentences;
- ``jsonl``: one JSON object per line, its text field (``--text-column``) is one document;
- ``parquet``: one row per document, text in the ``--text-column`` column.

In JSONL and Parquet documents, newlines separate paragraphs; paragraphs are split into
sentences with blingfire (27 MB/s, where pysbd manages 0.2 MB/s: see
benchmarks/sentence_splitters.py).

Blocks: every file is cut into blocks of about ``block_bytes`` (Parquet: row groups) that hold
whole documents, so blocks can be read by independent tasks. A nominal cut offset is moved
forward to the next document boundary by a function of the offset and the file alone (the
first line that starts at or after it, then on to the line after the next blank line, the
next ``<doc`` line, or that line itself for JSONL), so the block that ends at a cut and the
one that starts there agree: no document is split or read twice, whatever the block size.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, List, Sequence, Tuple

from ..io import not_utf8_message
from .errors import DataError

FORMATS = ("lines", "wikiextractor", "jsonl", "parquet")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_GLOB_CHARS = set("*?[")


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """The input files, in order: each pattern's files sorted; a file named twice is read once."""
    found, seen = [], set()
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if os.path.exists(pattern) or not _GLOB_CHARS & set(pattern):
            matches = [pattern]
        else:
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(f"--input {pattern}: the pattern matches no file")
        for match in matches:
            for path in _files_below(match) if os.path.isdir(match) else [match]:
                key = os.path.realpath(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path)
    return found


def _files_below(directory):
    paths = []
    for folder, names, files in os.walk(directory):
        names[:] = sorted(name for name in names if not name.startswith("."))
        paths.extend(os.path.join(folder, name) for name in files if not name.startswith("."))
    if not paths:
        raise DataError(f"--input {directory}: the directory holds no files")
    return sorted(paths)


def detect_format(path: str, forced: str = None) -> str:
    """The file's format: ``forced`` if given, else by suffix, then by the first non-blank line."""
    if forced:
        return forced
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    if head.startswith(b"PAR1"):
        return "parquet"
    first = next((line.strip() for line in head.split(b"\n") if line.strip()), b"")
    if _opens_doc(first):
        return "wikiextractor"
    if first.startswith(b"{"):
        try:
            if isinstance(json.loads(first), dict):
                return "jsonl"
        except ValueError:
            pass
    return "lines"


def _opens_doc(line) -> bool:
    """A WikiExtractor ``<doc ...>`` line (bytes or str; the same test when cutting and reading)."""
    prefix = line[:5]
    return prefix in (b"<doc ", b"<doc>", "<doc ", "<doc>")


def _blank(raw: bytes) -> bool:
    """A blank line, exactly as the reader decides it (str.strip of the decoded line)."""
    return not raw.decode("utf-8", "replace").strip()


def plan_blocks(path: str, fmt: str, block_bytes: int, text_column: str = "text") -> List[Tuple[int, int]]:
    """The file's blocks as (start, stop): byte ranges of whole documents, or row-group ranges
    for Parquet. Empty ranges are left out."""
    if fmt == "parquet":
        return [(group, group + 1) for group in range(_parquet_file(path, text_column).metadata.num_row_groups)]
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as handle:
        nominal = block_bytes
        while nominal < size:
            cut = _align(handle, nominal, fmt)
            if cut > cuts[-1]:
                cuts.append(cut)
            # Nominal offsets up to this cut would only scan the same text again.
            nominal = max(nominal + block_bytes, (cuts[-1] // block_bytes + 1) * block_bytes)
    if cuts[-1] < size:
        cuts.append(size)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def text_bytes(path: str, fmt: str, text_column: str = "text") -> int:
    """About how much text the file holds: its size, or for Parquet the uncompressed size of the
    text column (compressed Parquet holds several times its size in text)."""
    if fmt != "parquet":
        return os.path.getsize(path)
    metadata = _parquet_file(path, text_column).metadata
    index = metadata.schema.to_arrow_schema().get_field_index(text_column)
    return sum(metadata.row_group(g).column(index).total_uncompressed_size for g in range(metadata.num_row_groups))


def _align(handle, offset: int, fmt: str) -> int:
    """The document boundary for nominal cut ``offset`` (see the module docstring)."""
    handle.seek(offset - 1)
    handle.readline()  # the rest of the line holding byte offset-1: the next line starts at >= offset
    while True:
        start = handle.tell()
        line = handle.readline()
        if not line:
            return start
        if fmt == "jsonl" or (fmt == "wikiextractor" and _opens_doc(line)):
            return start
        if fmt == "lines" and _blank(line):
            return handle.tell()


def _parquet_file(path, text_column):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise DataError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:160]})") from None
    names = parquet.schema_arrow.names
    if text_column not in names:
        raise DataError(f"{path}: no column {text_column!r} (it has {', '.join(map(repr, names)) or 'none'}); "
                        f"name the text column with --text-column")
    return parquet


def split_sentences(paragraph: str) -> List[str]:
    """A paragraph's sentences (blingfire); an empty list for a blank paragraph."""
    import blingfire

    paragraph = paragraph.strip()
    if not paragraph:
        return []
    return [s for s in (x.strip() for x in blingfire.text_to_sentences(paragraph).split("\n")) if s]


def text_sentences(text: str) -> List[str]:
    """A JSONL/Parquet document's sentences: paragraphs by newline, then sentences."""
    return [s for paragraph in text.split("\n") for s in split_sentences(paragraph)]


def read_block(path: str, fmt: str, start: int, stop: int, text_column: str = "text") -> Iterator[List[str]]:
    """The documents of one block, each a list of sentences (empty documents are kept out)."""
    if fmt == "parquet":
        yield from _parquet_documents(path, start, stop, text_column)
        return
    text = _decode(path, start, stop)
    lines = text.split("\n")  # "\n" only: the cuts were found by bytes' readline
    if fmt == "lines":
        yield from _line_documents(lines)
    elif fmt == "wikiextractor":
        yield from _wikiextractor_documents(lines, path, start)
    else:
        yield from _jsonl_documents(lines, path, start, text_column)


def _decode(path, start, stop) -> str:
    with open(path, "rb") as handle:
        handle.seek(start)
        data = handle.read(stop - start)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # The project's one message for a byte that is not UTF-8 (bert_packed.io), as vocab gives.
        raise DataError(not_utf8_message(path, data, exc.start, first_line=_first_line(path, start),
                                         base_offset=start)) from None


def _first_line(path, offset) -> int:
    """The line number of byte ``offset`` (counted only for error messages)."""
    count = 1
    with open(path, "rb") as handle:
        while offset > 0:
            chunk = handle.read(min(offset, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def _line_documents(lines):
    document = []
    for line in lines:
        line = line.strip()
        if line:
            document.append(line)
        elif document:
            yield document
            document = []
    if document:
        yield document


def _wikiextractor_documents(lines, path, start):
    document, opened, title_next = [], None, False
    for number, line in enumerate(lines):
        stripped = line.strip()
        if _opens_doc(line):
            if opened is not None:
                _cut_doc(path, start, opened, "before the next <doc>")
            document, opened, title_next = [], number, True
        elif stripped == "</doc>":
            if opened is None:
                raise DataError(f"{path}: line {_first_line(path, start) + number}: </doc> without its <doc>; "
                                f"the file is cut or is not WikiExtractor output (force another with --format)")
            if document:
                yield document
            document, opened = [], None
        elif opened is not None:
            if title_next:
                title_next = False  # the title repeats the doc's title attribute; not a sentence
            else:
                document.extend(split_sentences(stripped))
    if opened is not None:
        _cut_doc(path, start, opened, "at the end of the file")


def _cut_doc(path, start, opened, where):
    raise DataError(f"{path}: line {_first_line(path, start) + opened}: this <doc> has no </doc> {where}: the file "
                    f"is cut in the middle of a document (an interrupted WikiExtractor run?); re-extract it or "
                    f"leave it out")


def _jsonl_documents(lines, path, start, text_column):
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}: line {_first_line(path, start) + number}: not JSON ({str(exc)[:120]}); JSONL "
                            f"input is one JSON object per line") from None
        text = record.get(text_column) if isinstance(record, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}: line {_first_line(path, start) + number}: no text field {text_column!r} "
                            f"(the record has {keys or 'no fields'}); name the field with --text-column")
        document = text_sentences(text)
        if document:
            yield document


def _parquet_documents(path, start, stop, text_column):
    parquet = _parquet_file(path, text_column)
    for group in range(start, stop):
        column = parquet.read_row_group(group, columns=[text_column]).column(0)
        for text in column.to_pylist():
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{path}: row group {group}: a {text_column!r} value is not UTF-8; corpora must "
                                    f"be UTF-8") from None
            document = text_sentences(text) if isinstance(text, str) else []
            if document:
                yield document
