"""Fine-tuning data: read labelled text files, tokenise, pack, serve micro-batches.

Shared by the fine-tuning tasks:

- ``read_table(path, columns)``: rows of a CSV, TSV or JSON-lines file (by extension:
  ``.csv``, ``.tsv``/``.tab``, ``.jsonl``/``.json``) or of a Hugging Face dataset directory
  (``save_to_disk``; with ``datasets`` installed), as a dict of column lists;
  a missing file or column, an empty file, or an unreadable row is a one-line ``DataError``;
- ``encode_texts(tokenizer, texts, pairs, max_length, truncation=, where=)``: token ids and
  segment ids with BERT's ``[CLS] A [SEP] B [SEP]`` template (the ``tokenizers`` library);
  a text longer than ``max_length`` is truncated with a warning (``truncation: truncate``)
  or refused (``error``);
- ``PackedDataset``: encoded sequences packed once with ``packing`` (the algorithms of
  pre-training, several sequences and [CLS] tokens per row) and collated by a task's
  collate function into fixed-shape micro-batches; ``source(...)`` serves the training
  stream (re-shuffled per epoch) with the data-source contract of ``bert_packed.data``,
  ``batches(...)`` the evaluation batches in a fixed order with each slot's row index;
- ``held_out(...)``: the seeded validation split of a training file without a validation file.

The tasks' base class, ``PackedTask``, is in ``bert_packed.tasks.packed``.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.errors import ConfigError
from bert_packed.io.files import file_sha256, utf8_lines

__all__ = ["read_table", "encode_texts", "Encoded", "PackedDataset", "held_out", "TRUNCATION"]

TRUNCATION = ("truncate", "error")
_DELIMITERS = {".csv": ",", ".tsv": "\t", ".tab": "\t"}


def _format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in _DELIMITERS:
        return ext
    if ext in (".jsonl", ".json", ".ndjson"):
        return ".jsonl"
    raise DataError(f"{path}: unknown file type {ext or '(none)'}; use .csv, .tsv or .jsonl")


def _read_saved_dataset(path: str, columns: Sequence[str]) -> Dict[str, List[Any]]:
    """The ``columns`` of a Hugging Face dataset saved with ``Dataset.save_to_disk``."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a directory: reading a saved Hugging Face dataset needs the datasets "
                        f"package (pip install datasets); or give a CSV, TSV or JSONL file") from None
    try:
        dataset = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({str(exc).splitlines()[0]})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"{path} holds the splits {', '.join(dataset)}; give one of them, e.g. "
                        f"{os.path.join(path, next(iter(dataset)))}")
    if len(dataset) == 0:
        raise DataError(f"{path}: the dataset is empty (no rows)")
    for column in columns:
        if column not in dataset.column_names:
            raise DataError(f"{path}: no column {column!r}; columns: {', '.join(dataset.column_names)}")
    out = {}
    for column in columns:
        values = list(dataset[column])
        for i, value in enumerate(values):
            if value is None:
                raise DataError(f"{path}: row {i + 1}: no value in column {column!r} (None)")
        out[column] = Column(values, path=path, name=column)
    return out


class Column(list):
    """The values of one column of a table :func:`read_table` read, and where each came from:
    ``where(i)`` is ``"FILE: line N: column 'NAME'"`` (``"row N"`` for a saved dataset), so a
    check anywhere downstream (texts, labels) names the file, line and column of a bad value."""

    def __init__(self, values: Sequence[Any] = (), *, path: str = "data", name: str = "",
                 lines: Optional[Sequence[int]] = None):
        super().__init__(values)
        self.path, self.name = path, name
        self.lines = None if lines is None else list(lines)

    def at(self, i: int) -> str:
        """``line N`` of value ``i`` (``row N`` for a saved dataset)."""
        return f"line {self.lines[i]}" if self.lines is not None else f"row {i + 1}"

    def where(self, i: int, column: bool = True) -> str:
        return f"{self.path}: {self.at(i)}" + (f": column {self.name!r}" if column else "")

    def take(self, indices: Sequence[int]) -> "Column":
        """The values at ``indices``, still knowing their lines."""
        return Column([self[i] for i in indices], path=self.path, name=self.name,
                      lines=None if self.lines is None else [self.lines[i] for i in indices])


def value_where(values: Sequence[Any], i: int, where: str, column: bool = True) -> str:
    """Where value ``i`` of ``values`` came from: ``FILE: line N: column 'NAME'`` for a
    ``Column``, else ``WHERE: row i+1`` (values built in code)."""
    if isinstance(values, Column):
        return values.where(i, column)
    return f"{where}: row {i + 1}"


def value_at(values: Sequence[Any], i: int) -> str:
    """``line N`` (or ``row N``) of value ``i`` of ``values``."""
    return values.at(i) if isinstance(values, Column) else f"row {i + 1}"


def no_duplicate_keys(where: str) -> Callable[[List[Tuple[str, Any]]], Dict[str, Any]]:
    """A ``json`` ``object_pairs_hook`` refusing an object that has a key twice (``json`` would
    keep the last value in silence): ``DataError`` naming ``where``, the key and, when the
    object has one, its ``id``."""
    def hook(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                owner = dict(pairs).get("id")
                at = f"the object with id {owner!r}: " if isinstance(owner, (str, int)) and key != "id" else ""
                raise DataError(f"{where}: {at}key {key!r} occurs twice in one object; which value is meant is "
                                f"ambiguous: keep one")
            out[key] = value
        return out
    return hook


def _read_jsonl(path: str, lines: Iterator[str]) -> Tuple[List[str], List[Dict[str, Any]], List[int]]:
    rows, numbers = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=no_duplicate_keys(f"{path}: line {number}"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {number}: not a JSON object ({exc.msg} at column {exc.colno}); "
                            f"JSON lines hold one object per line") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {number}: expected a JSON object per line, got a JSON "
                            f"{_json_kind(row)}")
        rows.append(row)
        numbers.append(number)
    return sorted({key for row in rows for key in row}), rows, numbers


def _json_kind(value: Any, article: str = "") -> str:
    kind = {list: "array", dict: "object", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
    return ("an " if article and kind[0] in "ao" else article) + kind


def _read_delimited(path: str, lines: Iterator[str], delimiter: str) -> Tuple[List[str], List[List[str]], List[int]]:
    """Header and rows of a CSV/TSV file, each row checked to have exactly the header's fields.

    Quoting is standard CSV (a value holding the delimiter, a quote or a line break is quoted
    whole, inner quotes doubled); ``strict`` refuses malformed quoting instead of guessing."""
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    limit = csv.field_size_limit(max(csv.field_size_limit(), _MAX_FIELD))  # long documents are texts too
    try:
        return _read_rows(path, reader, delimiter)
    finally:
        csv.field_size_limit(limit)


_MAX_FIELD = 1 << 27  # characters of one CSV value (csv's default is 131,072)


class _LiteralReader:
    """TSV as IANA defines it (and GLUE's files have it): each line a row, fields split at tabs,
    quotes plain characters; ``csv.reader``'s interface (iteration, ``line_num``)."""

    def __init__(self, lines: Sequence[str]):
        self._lines, self.line_num = lines, 0

    def __iter__(self):
        for line in self._lines:
            self.line_num += 1
            line = line.rstrip("\r\n")
            yield line.split("\t") if line else []


def _read_tsv(path: str, lines: Iterator[str]) -> Tuple[List[str], List[List[str]], List[int]]:
    """Header and rows of a TSV file, its quotes read either way TSV is written in the wild.

    Literal quotes (IANA's TSV, GLUE's files: ``"Quoted words," she said<TAB>pos``) and CSV
    quoting (``pandas.to_csv(sep="\\t")``: a value with a quote, tab or line break quoted whole,
    inner quotes doubled) are both read. A file that only one reading fits is read that way; one
    that both fit alike is the same either way; one that both fit differently is CSV-quoted when a
    quoted value has doubled inner quotes or every header name is quoted (what CSV writers do and
    literal text does not), and refused (naming the line) otherwise; one that neither fits is
    refused with both readings' reasons."""
    lines = list(lines)
    readings, errors = {}, {}
    for name, read in (("csv", lambda: _read_delimited(path, iter(lines), "\t")),
                       ("literal", lambda: _read_rows(path, _LiteralReader(lines), "\t"))):
        try:
            readings[name] = read()
        except DataError as exc:
            errors[name] = str(exc)
    if len(readings) == 1:
        return next(iter(readings.values()))
    if not readings:
        if errors["csv"] == errors["literal"]:
            raise DataError(errors["csv"])
        strip = len(f"{path}: ")
        raise DataError(f"{path}: not valid TSV read either way: with literal quotes, {errors['literal'][strip:]}; "
                        f"with CSV quoting, {errors['csv'][strip:]}")
    quoted, literal = readings["csv"], readings["literal"]
    if quoted == literal:
        return quoted
    header = literal[0]
    if header and all(len(t) >= 2 and t[0] == t[-1] == '"' for t in header):
        return quoted  # every header name quoted: a CSV writer's QUOTE_ALL
    first = None
    if quoted[2] == literal[2]:
        for number, q_row, l_row in zip(quoted[2], quoted[1], literal[1]):
            for q, raw in zip(q_row, l_row):
                if q != raw:
                    if '""' in raw[1:-1]:
                        return quoted  # doubled inner quotes: CSV quoting
                    first = first or (number, raw, q)
    else:  # a quoted value spans lines under CSV quoting, yet every line is a row with literal quotes
        i = next((i for i, (n, m) in enumerate(zip(literal[2], quoted[2])) if n != m),
                 min(len(literal[2]), len(quoted[2])))
        first = (quoted[2][i - 1] if i else 1, None, None)  # the row before the first that starts elsewhere
    number, raw, value = first
    if raw is not None:
        raise DataError(f"{path}: line {number}: {_short(raw)!r} is the text {_short(value)!r} with CSV quoting and "
                        f"{_short(raw)!r} with literal quotes; which is meant is ambiguous: remove the quotes if they "
                        f"are not part of the text, quote the value whole with its quotes doubled if they are, or "
                        f"give the file as JSON lines (.jsonl)")
    raise DataError(f"{path}: line {number}: a quoted value runs over several lines with CSV quoting, yet every line "
                    f"is a row of its own with literal quotes; which is meant is ambiguous: write the file with one "
                    f"convention throughout, or as JSON lines (.jsonl)")


def _read_rows(path: str, reader, delimiter: str) -> Tuple[List[str], List[List[str]], List[int]]:
    name = "tab" if delimiter == "\t" else repr(delimiter)
    header: Optional[List[str]] = None
    rows, numbers = [], []
    first = 1
    try:
        for fields in reader:
            line, first = first, reader.line_num + 1
            if not fields:  # a blank line
                continue
            if header is None:
                header = fields
                seen: Dict[str, int] = {}
                for column, title in enumerate(header, 1):
                    if title in seen:
                        raise DataError(f"{path}: line {line}: the header names column {title!r} twice (columns "
                                        f"{seen[title]} and {column}); which one is meant is ambiguous: rename one")
                    seen[title] = column
                continue
            if len(fields) > len(header):
                raise DataError(f"{path}: line {line}: {len(fields)} fields but the header has {len(header)}: extra "
                                f"value {_short(fields[len(header)])!r} in {_row_preview(fields)} (a {name} inside an "
                                f"unquoted value?); quote values that hold the delimiter")
            if len(fields) < len(header):
                raise DataError(f"{path}: line {line}: {len(fields)} field(s) but the header has {len(header)}: no "
                                f"value for column {header[len(fields)]!r} in {_row_preview(fields)}; every row needs "
                                f"every column (an empty value is nothing between two delimiters)")
            rows.append(fields)
            numbers.append(line)
    except csv.Error as exc:
        lines_text = f"line {first}" if reader.line_num <= first else f"lines {first}-{reader.line_num}"
        if "field larger than field limit" in str(exc):
            raise DataError(f"{path}: {lines_text}: a value of more than {csv.field_size_limit():,} characters (a "
                            f"quote that is never closed?); shorten it, or fix the quoting") from None
        reason = str(exc).replace("\t", "\\t")  # a tab in a one-line message is invisible
        raise DataError(f"{path}: {lines_text}: not valid {'TSV' if delimiter == chr(9) else 'CSV'} ({reason}); a value "
                        f"holding a quote, a {name} or a line break must be quoted whole, with inner quotes "
                        f"doubled (\"\")") from None
    return header or [], rows, numbers


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _row_preview(fields: Sequence[str], limit: int = 6) -> str:
    """``['a', 'b c', ...]``: a row's fields, each shortened, for a message."""
    shown = [repr(_short(f)) for f in fields[:limit]] + (["..."] if len(fields) > limit else [])
    return "[" + ", ".join(shown) + "]"


def read_table(path: str, columns: Sequence[str]) -> Dict[str, Column]:
    """The ``columns`` of every row of ``path`` (a ``Column`` per name, in file order): a CSV/TSV
    file with a header row, JSON lines, or a directory holding a Hugging Face dataset saved
    with ``save_to_disk`` (needs ``datasets``).

    One pass checks the whole file before anything is trained, and refuses (``DataError``
    naming the file, line, column and value) what it would otherwise have to guess: bytes
    that are not UTF-8 (a UTF-8 byte-order mark is fine and dropped), a header naming a
    column twice, a row with more or fewer fields than the header (an unquoted delimiter),
    malformed quoting, a JSON line that is not one object or repeats a key, a row without a
    value for a requested column. Empty texts and labels are refused where they are read
    (``encode_texts``, the task's labels), which know whether empty can mean something."""
    if not path:
        raise DataError("no data file given")
    if os.path.isdir(path):
        return _read_saved_dataset(path, columns)
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    kind = _format(path)
    with open(path, "rb") as handle:
        lines = utf8_lines(path, handle, DataError)
        if kind == ".jsonl":
            available, rows, numbers = _read_jsonl(path, lines)
            index = None
        else:
            read = _read_tsv if _DELIMITERS[kind] == "\t" else partial(_read_delimited, delimiter=",")
            available, rows, numbers = read(path, lines)
            index = {title: i for i, title in enumerate(available)}
    if not rows:
        raise DataError(f"{path}: the file is empty (no data rows)")
    for column in columns:
        if column not in available:
            raise DataError(f"{path}: no column {column!r}; columns: {', '.join(map(str, available)) or '(none)'}"
                            f"{_column_hint(column, available, kind)}")
    out: Dict[str, Column] = {}
    for column in columns:
        if index is not None:
            values = [fields[index[column]] for fields in rows]
        else:
            values = []
            for row, number in zip(rows, numbers):
                value = row.get(column)
                if value is None:  # a JSON line without the key, or with null
                    raise DataError(f"{path}: line {number}: no value in column {column!r} "
                                    f"({'null' if column in row else 'no such key'})")
                values.append(value)
        out[column] = Column(values, path=path, name=column, lines=numbers)
    return out


def _column_hint(column: str, available: Sequence[str], kind: str) -> str:
    """Why a column may be missing: spaces around a header name, or the wrong delimiter."""
    for title in available:
        if isinstance(title, str) and title.strip() == column:
            return f" (the header has {title!r}: spaces around the name)"
    if kind != ".jsonl" and len(available) == 1:
        other = ("tab", ".tsv") if kind == ".csv" else ("','", ".csv")
        if ("\t" if kind == ".csv" else ",") in available[0]:
            return f" (the header is one column holding a {other[0]}: name the file {other[1]}?)"
    return ""


class Encoded:
    """Tokenised sequences: ``input_ids`` / ``segment_ids`` as int32 ``[N, width]`` (0-padded)
    and ``lengths`` ``[N]``; ``num_truncated`` of them were cut to fit."""

    def __init__(self, input_ids: np.ndarray, segment_ids: np.ndarray, lengths: np.ndarray, num_truncated: int):
        self.input_ids, self.segment_ids, self.lengths = input_ids, segment_ids, lengths
        self.num_truncated = num_truncated

    def __len__(self) -> int:
        return len(self.lengths)


def encode_texts(tokenizer, texts: Sequence[str], pairs: Optional[Sequence[str]] = None, *, max_length: int,
                 truncation: str = "truncate", where: str = "data") -> Encoded:
    """Tokenise ``texts`` (and ``pairs``) as BERT inputs of at most ``max_length`` tokens."""
    if truncation not in TRUNCATION:
        raise DataError(f"finetune.truncation must be one of {', '.join(TRUNCATION)}, got {truncation!r}")
    for values in (texts, pairs) if pairs is not None else (texts,):
        for i, text in enumerate(values):
            if not isinstance(text, str):
                raise DataError(f"{value_where(values, i, where)}: the text is {_json_kind(text, 'a ')} "
                                f"({text!r}), not a string")
            if not text.strip():
                raise DataError(f"{value_where(values, i, where)}: the text is empty; remove the row or fill it in "
                                f"(an empty text would train on [CLS] [SEP] alone)")
    if pairs is not None and len(pairs) != len(texts):
        raise DataError(f"{where}: {len(texts)} texts but {len(pairs)} text pairs")
    inputs = list(texts) if pairs is None else list(zip(texts, pairs))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    encodings = tokenizer.encode_batch(inputs)
    too_long = [i for i, e in enumerate(encodings) if len(e.ids) > max_length]
    if too_long:
        first = too_long[0]
        if truncation == "error":
            raise DataError(f"{value_where(texts, first, where, column=False)}: {len(encodings[first].ids)} tokens, "
                            f"more than the maximum {max_length} (data.max_sequence_length); shorten it, raise the "
                            f"maximum, or set finetune.truncation=truncate")
        tokenizer.enable_truncation(max_length, strategy="longest_first")
        try:
            for i, encoding in zip(too_long, tokenizer.encode_batch([inputs[i] for i in too_long])):
                encodings[i] = encoding
        finally:
            tokenizer.no_truncation()
        print(f"warning: {where}: {len(too_long)} of {len(inputs)} texts are longer than {max_length} tokens and "
              f"were truncated (first: {value_at(texts, first)}); "
              f"finetune.truncation=error refuses them", file=sys.stderr)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    width = int(max(1, lengths.max(initial=1)))
    input_ids = np.zeros((len(encodings), width), dtype=np.int32)
    segment_ids = np.zeros((len(encodings), width), dtype=np.int32)
    for i, encoding in enumerate(encodings):
        input_ids[i, :lengths[i]] = encoding.ids
        segment_ids[i, :lengths[i]] = encoding.type_ids
    return Encoded(input_ids, segment_ids, lengths, len(too_long))


class PackedDataset:
    """Encoded sequences (+ per-sequence ``extra`` arrays, e.g. labels) packed into rows.

    ``collate(samples, assignment_slice) -> batch`` builds one micro-batch (e.g.
    ``bert_packed.tasks.classification.data.collate_classification`` with S and K bound). Packing:
    ``packing.pack`` with ``algorithm`` at depth ``max_sequences_per_pack`` (depth 1 and
    algorithm ``none``: one sequence per row, the padded baseline).
    """

    def __init__(self, encoded: Encoded, extra: Dict[str, np.ndarray], collate: Callable, *,
                 max_sequence_length: int, max_sequences_per_pack: int, algorithm: str, seed: int):
        from packing import Histogram, pack

        # The tokenizer's lengths, as a mask: a sequence is never measured by its id values (a
        # vocabulary may put [UNK] or any other token at id 0; counting non-zero ids would cut
        # every such token off in silence).
        mask = (np.arange(encoded.input_ids.shape[1])[None, :] < np.asarray(encoded.lengths)[:, None]).astype(np.int8)
        self.samples = {"input_ids": encoded.input_ids, "segment_ids": encoded.segment_ids, "input_mask": mask,
                        **extra}
        self.lengths = encoded.lengths
        self.collate = collate
        self.max_sequences_per_pack = max_sequences_per_pack
        self.seed = seed
        hist = Histogram.from_lengths(self.lengths, max_sequence_length=max_sequence_length)
        algorithm = "none" if max_sequences_per_pack == 1 else algorithm
        self.result = pack(hist, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed)
        self.algorithm = algorithm
        self._assignments: Dict[int, Any] = {}

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_packs(self) -> int:
        return int(self.result.num_packs)

    @property
    def packing_factor(self) -> float:
        return self.num_sequences / max(1, self.num_packs)

    def assignment(self, epoch: int, shuffle: bool = True):
        """Sequences -> packs for ``epoch``: the same plan, a new seeded draw of which sequences
        of each length go together and a new pack order (epoch-independent when not shuffled)."""
        from packing import assign

        key = epoch if shuffle else -1
        if key not in self._assignments:
            if len(self._assignments) > 2:
                self._assignments.clear()
            seed = self.seed + 1 + epoch if shuffle else self.seed
            self._assignments[key] = assign(self.result.plan, self.lengths, seed=seed, shuffle_packs=shuffle)
        return self._assignments[key]

    def _batch(self, assignment, pack_indices: np.ndarray) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
        """The micro-batch of ``pack_indices`` (-1 = an empty pack) and each slot's sequence index [B, K] (-1 = none)."""
        from bert_packed.collate import PackSlice

        offsets, indices = [0], []
        for p in pack_indices:
            if p >= 0:
                members = assignment.sequence_indices[assignment.pack_offsets[p]:assignment.pack_offsets[p + 1]]
                indices.extend(int(i) for i in members)
            offsets.append(len(indices))
        layout = PackSlice(np.array(offsets, dtype=np.int64), np.array(indices, dtype=np.int64))
        batch = self.collate(self.samples, layout)
        rows = np.full((len(pack_indices), self.max_sequences_per_pack), -1, dtype=np.int64)
        for b in range(len(pack_indices)):
            members = layout.sequence_indices[layout.pack_offsets[b]:layout.pack_offsets[b + 1]]
            rows[b, :len(members)] = members
        return batch, rows

    def batches(self, micro_batch_size: int) -> Iterator[Tuple[Dict[str, np.ndarray], np.ndarray]]:
        """Every pack once, in a fixed order, as fixed-shape micro-batches (the last one filled
        with empty packs); yields ``(batch, rows)`` with ``rows`` [B, K] the sequence index per slot."""
        assignment = self.assignment(0, shuffle=False)
        for start in range(0, self.num_packs, micro_batch_size):
            packs = np.arange(start, start + micro_batch_size)
            packs[packs >= self.num_packs] = -1
            yield self._batch(assignment, packs)

    def source(self, micro_batch_size: int, rank: int = 0, world_size: int = 1,
               inputs: Sequence[str] = ()) -> "PackedSource":
        return PackedSource(self, micro_batch_size, rank, world_size, inputs)

    def fingerprint(self) -> str:
        """SHA-256 of the sequences as packed (every sample array, by name, and the lengths)."""
        if getattr(self, "_fingerprint", None) is None:
            import hashlib

            digest = hashlib.sha256()
            for name in sorted(self.samples):
                array = np.ascontiguousarray(self.samples[name])
                digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
                digest.update(array.tobytes())
            digest.update(np.ascontiguousarray(self.lengths, dtype=np.int64).tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint


def file_record(path: str) -> Dict[str, Any]:
    """What a resume compares of an input, by content: a file's size and SHA-256; a directory's
    (a dataset saved with ``save_to_disk``) files, each with its size and SHA-256."""
    if os.path.isdir(path):
        files = []
        for folder, _, names in sorted(os.walk(path)):
            for name in sorted(names):
                full = os.path.join(folder, name)
                files.append([os.path.relpath(full, path), os.path.getsize(full), file_sha256(full)])
        return {"path": path, "files": files}
    return {"path": path, "size": os.path.getsize(path), "sha256": file_sha256(path)}


def _same_record(saved: Dict[str, Any], now: Dict[str, Any]) -> bool:
    """Whether an input is what the checkpoint recorded. A directory recorded before checksums
    (names, sizes and modification times) is compared by names and sizes: its content is then
    vouched for by the checkpoint's ``sequences_sha256``, as it was."""
    if "files" in saved and "files" in now and any(isinstance(f[2], int) for f in saved["files"]):
        return [f[:2] for f in saved["files"]] == [f[:2] for f in now["files"]]
    return saved == now


def _record_change(saved: Dict[str, Any], now: Dict[str, Any]) -> str:
    """How an input's record changed, in a few words."""
    if "sha256" in saved and "sha256" in now:
        if saved["size"] != now["size"]:
            return f"{saved['size']:,} bytes then, {now['size']:,} now"
        return f"same size, other content: sha256 {saved['sha256'][:12]} then, {now['sha256'][:12]} now"
    return "its files differ (names, sizes or content)"


class PackedSource:
    """The training stream of a ``PackedDataset`` (data-source contract of ``bert_packed.data``).

    Packs of epoch e come in the order of ``assignment(e)``; epochs follow each other
    seamlessly (a micro-batch may span two), so every sequence is seen once per epoch.
    Global micro-batch g holds packs [p0 + (g-g0)*B, p0 + (g-g0+1)*B) of that stream (the base
    (g0, p0) is (0, 0) until a resume changes the micro-batch size B); rank r serves g % n == r.

    Its state records what the run read: the input files (``inputs``: size and SHA-256) and a
    SHA-256 of the training sequences themselves (tokens, segments, masks, labels: what the
    tokenizer made of the files). A resume on other data is refused unless forced; forced, the
    stream starts a new epoch of the new data where the checkpoint stopped.
    """

    def __init__(self, dataset: PackedDataset, micro_batch_size: int, rank: int, world_size: int,
                 inputs: Sequence[str] = ()):
        self.dataset, self.micro_batch_size = dataset, int(micro_batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.next_global = self.rank
        self.base_global, self.base_pack = 0, 0
        self.inputs = [p for p in inputs if p]
        self.records = [file_record(p) for p in self.inputs]  # as read now, at setup
        self.packing_factor = dataset.packing_factor
        self.packing = {"algorithm": dataset.algorithm, "max_sequences_per_pack": dataset.max_sequences_per_pack,
                        "num_sequences": dataset.num_sequences, "num_packs": dataset.num_packs,
                        "packing_factor": dataset.packing_factor}

    def micro_batches_per_epoch(self) -> float:
        return self.dataset.num_packs / self.micro_batch_size

    def __iter__(self):
        return self

    def _first_pack(self, global_batch: int) -> int:
        """Where micro-batch ``global_batch`` starts in the stream of packs (epochs end to end)."""
        return self.base_pack + (int(global_batch) - self.base_global) * self.micro_batch_size

    def __next__(self) -> Dict[str, np.ndarray]:
        B, P = self.micro_batch_size, self.dataset.num_packs
        first = self._first_pack(self.next_global)
        stream = np.arange(first, first + B)
        epochs, positions = stream // P, stream % P
        self.next_global += self.world_size
        parts = []
        for epoch in np.unique(epochs):
            parts.append(self.dataset._batch(self.dataset.assignment(int(epoch)), positions[epochs == epoch])[0])
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}

    def state_dict(self) -> Dict[str, Any]:
        return {"next_global": int(self.next_global), "base_global": self.base_global, "base_pack": self.base_pack,
                "micro_batch_size": self.micro_batch_size, "num_packs": self.dataset.num_packs,
                "num_sequences": self.dataset.num_sequences, "sequences_sha256": self.dataset.fingerprint(),
                "inputs": self.records}

    def load_state_dict(self, state: Dict[str, Any], force: bool = False) -> None:
        """Continue after the checkpoint's last micro-batch. Data other than the checkpoint's (an
        input file, or the sequences the tokenizer made of them) is refused unless ``force``;
        forced, the stream starts a new epoch of this data there. With another micro-batch size
        the stream continues at the same pack of the same epoch: nothing skipped or read twice."""
        next_global = int(state["next_global"])
        if next_global % self.world_size != self.rank:
            raise DataError(f"the data state (next micro-batch {next_global}) belongs to another rank than "
                            f"{self.rank} of {self.world_size}; resume with the same number of processes")
        old_size = int(state.get("micro_batch_size", self.micro_batch_size))
        first = next_global - self.rank  # the step's first micro-batch: where the global stream stands
        position = int(state.get("base_pack", 0)) + (first - int(state.get("base_global", 0))) * old_size
        changed = self._changed_inputs(state)
        if changed:
            if not force:
                raise DataError(f"the fine-tuning data changed since the checkpoint: {changed}; resume with the data "
                                f"the run started on, or pass --resume-force to continue on this data (from a new "
                                f"epoch)")
            old_packs = int(state.get("num_packs") or self.dataset.num_packs)
            position = (position // old_packs + 1) * self.dataset.num_packs
            if self.rank == 0:
                print(f"note: --resume-force: the fine-tuning data changed since the checkpoint ({changed}); training "
                      f"continues from the start of a new epoch of this data", file=sys.stderr)
        self.next_global, self.base_global, self.base_pack = next_global, first, position

    def _changed_inputs(self, state: Dict[str, Any]) -> str:
        """'' when this is the checkpoint's data (as far as it recorded: a checkpoint from before
        these records is taken as is), else what changed."""
        saved = {r["path"]: r for r in state.get("inputs", ())}
        for path, now in zip(self.inputs, self.records):
            if path in saved:
                if not _same_record(saved[path], now):
                    return f"{path}: {_record_change(saved[path], now)}"
        if "sequences_sha256" in state and state["sequences_sha256"] != self.dataset.fingerprint():
            return (f"{state.get('num_sequences')} training sequences then, {self.dataset.num_sequences} now, with "
                    f"other tokens or labels (another tokenizer or data?)")
        return ""


def held_out(num_items: int, fraction: float, seed: int, *, what: str, where: str) -> Tuple[List[int], List[int]]:
    """(kept, held out) item indices, each ascending: a seeded random ``fraction`` of ``num_items``
    held out for validation (``finetune.validation_fraction`` without a ``validation_file``);
    ``what`` names the items in the message (rows, sentences, contexts)."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"finetune.validation_fraction must be in (0, 1) without a validation_file, got {fraction}")
    num_held = int(round(num_items * fraction))
    if num_held < 1 or num_held >= num_items:
        raise DataError(f"{where}: {num_items} {what} are too few to hold out {fraction:.0%} for validation; "
                        f"give finetune.validation_file")
    order = np.random.default_rng(seed).permutation(num_items)
    return np.sort(order[num_held:]).tolist(), np.sort(order[:num_held]).tolist()
