"""Input formats of `create` and `vocab`: one module per format, registered here once.

Inputs are files, directories (every file below, recursively, in sorted order; hidden names are
skipped) and globs (expanded here, sorted, so the shell's own order and limits do not matter).
Each file has one format, detected from its name and head or forced with ``--format``:

- ``lines`` (lines.py): one sentence per line, a blank line between documents;
- ``wikiextractor`` (wikiextractor.py): ``<doc id=.. url=.. title=..>`` ... ``</doc>``;
- ``jsonl`` (jsonl.py): one JSON object per line, its text field (``--text-column``) a document;
- ``parquet`` (parquet.py): one row per document, text in the ``--text-column`` column.

Each module declares detection (``suffixes``, ``sniff``), block boundaries (``plan_blocks``: blocks
of whole documents that independent tasks read) and reading (``read_block``), with the checks of
what the file claims (base.py). A new format is one module of this package with a `Format`
subclass as its ``FORMAT``: the registry finds it on disk (no list to extend), and the CLI's
``--format`` choices, `create` (sharded or one file), `vocab` and `stats` take it from
``REGISTRY``. Detection asks the formats in name order, the fallback last.

In JSONL, Parquet and WikiExtractor documents, newlines separate paragraphs, and paragraphs are
split into sentences with blingfire (27 MB/s, where pysbd manages 0.2 MB/s: see
benchmarks/sentence_splitters.py).
"""
from __future__ import annotations

import glob
import importlib
import os
import pkgutil
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from bert_packed.data.errors import DataError
from bert_packed.data.prepare.formats.base import BOM, Format, check_input_file, split_sentences, text_sentences

__all__ = ["REGISTRY", "FORMATS", "Format", "get", "detect_format", "plan_blocks", "text_bytes", "read_block",
           "expand_inputs", "check_corpus_file", "split_sentences", "text_sentences", "describe"]



def _discover() -> Dict[str, Format]:
    """{name: format} of every module of this package that declares a ``FORMAT`` (found on disk),
    in name order with the fallback last."""
    found = []
    for info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda i: i.name):
        if info.ispkg or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FORMAT", None), Format):
            found.append(module.FORMAT)
    return {fmt.name: fmt for fmt in sorted(found, key=lambda fmt: fmt.fallback)}


REGISTRY: Dict[str, Format] = _discover()
FORMATS = tuple(REGISTRY)  # the built-in formats; REGISTRY is what the commands read
_GLOB_CHARS = set("*?[")


def get(name: str) -> Format:
    """The registered format ``name``; a DataError naming the choices otherwise."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise DataError(f"--format must be one of {', '.join(REGISTRY)}, got {name!r}") from None


def describe() -> str:
    """The formats in a few words (for --help)."""
    return "; ".join(f"{name}: {fmt.help}" for name, fmt in REGISTRY.items())


def detect_format(path: str, forced: Optional[str] = None) -> str:
    """The file's format: ``forced`` if given, else by suffix, then by its head (a byte-order mark
    dropped first), else the fallback (``lines``)."""
    if forced:
        return get(forced).name
    lower = os.fspath(path).lower()
    for name, fmt in REGISTRY.items():
        if fmt.suffixes and lower.endswith(fmt.suffixes):
            return name
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    if head.startswith(BOM):
        head = head[len(BOM):]
    first = next((line.strip() for line in head.split(b"\n") if line.strip()), b"")
    for name, fmt in REGISTRY.items():
        if fmt.sniff(head, first):
            return name
    return next(name for name, fmt in REGISTRY.items() if fmt.fallback)


def plan_blocks(path: str, fmt: str, block_bytes: int, text_column: str = "text") -> List[Tuple[int, int]]:
    """The file's blocks as (start, stop): byte ranges of whole documents, or row-group ranges for
    Parquet. Empty ranges are left out."""
    return get(fmt).plan_blocks(path, block_bytes, text_column)


def text_bytes(path: str, fmt: str, text_column: str = "text") -> int:
    """About how much text the file holds (its size; Parquet: the text column uncompressed)."""
    return get(fmt).text_bytes(path, text_column)


def read_block(path: str, fmt: str, start: int, stop: int, text_column: str = "text",
               max_seq_length: Optional[int] = None) -> Iterator[List[str]]:
    """The documents of one block, each a list of sentences (empty documents are kept out).
    ``max_seq_length``: the sequences being made, for the checks that depend on it (None: none)."""
    return get(fmt).read_block(path, start, stop, text_column, max_seq_length)


def read_documents(path: str, fmt: str, text_column: str = "text", block_bytes: int = 8 << 20,
                   max_seq_length: Optional[int] = None) -> Iterator[List[str]]:
    """Every document of a file, block by block (what `create` reads of it)."""
    for start, stop in plan_blocks(path, fmt, block_bytes, text_column):
        yield from read_block(path, fmt, start, stop, text_column, max_seq_length)


def check_corpus_file(path):
    """DataError unless ``path`` is a regular, non-empty file (a pipe or device is named as such)."""
    check_input_file(path)
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    if not head.strip():
        raise DataError(f"{path}: the corpus is empty; give one sentence per line, "
                        "documents separated by blank lines")


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
