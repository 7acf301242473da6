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
- ``PackedTask``: the ``Task`` steps every fine-tuning task takes the same way with its
  ``train_data`` / ``eval_data`` ``PackedDataset`` (the run's length, evaluation batches).
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from bert_packed.data import DataError
from bert_packed.errors import ConfigError
from bert_packed.task import Task

__all__ = ["read_table", "encode_texts", "Encoded", "PackedDataset", "PackedTask", "TRUNCATION"]

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
    return {column: list(dataset[column]) for column in columns}


def read_table(path: str, columns: Sequence[str]) -> Dict[str, List[Any]]:
    """The ``columns`` of every row of ``path``: a CSV/TSV file with a header row, JSON lines,
    or a directory holding a Hugging Face dataset saved with ``save_to_disk`` (needs ``datasets``)."""
    if not path:
        raise DataError("no data file given")
    if os.path.isdir(path):
        return _read_saved_dataset(path, columns)
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    kind = _format(path)
    rows: List[Dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            if kind == ".jsonl":
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path}:{number}: not a JSON object ({exc.msg})") from None
                    if not isinstance(row, dict):
                        raise DataError(f"{path}:{number}: expected a JSON object per line")
                    rows.append(row)
                available = sorted({key for row in rows for key in row})
            else:
                reader = csv.DictReader(handle, delimiter=_DELIMITERS[kind])
                available = list(reader.fieldnames or [])
                rows = list(reader)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except csv.Error as exc:
        raise DataError(f"{path}: not valid {kind[1:].upper()} ({exc})") from None
    if not rows:
        raise DataError(f"{path}: the file is empty (no data rows)")
    for column in columns:
        if column not in available:
            raise DataError(f"{path}: no column {column!r}; columns: {', '.join(map(str, available)) or '(none)'}")
    out: Dict[str, List[Any]] = {column: [] for column in columns}
    for number, row in enumerate(rows, 1):
        for column in columns:
            value = row.get(column)
            if value is None:  # JSONL row without the key, or a short CSV row
                raise DataError(f"{path}: row {number} has no value in column {column!r}")
            out[column].append(value)
    return out


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
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise DataError(f"{where}: row {i + 1}: the text is {type(text).__name__}, not a string")
    inputs = list(texts) if pairs is None else list(zip(texts, pairs))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    encodings = tokenizer.encode_batch(inputs)
    too_long = [i for i, e in enumerate(encodings) if len(e.ids) > max_length]
    if too_long:
        first = too_long[0]
        if truncation == "error":
            raise DataError(f"{where}: row {first + 1} has {len(encodings[first].ids)} tokens, more than the "
                            f"maximum {max_length} (data.max_sequence_length); shorten it, raise the maximum, or "
                            f"set finetune.truncation=truncate")
        tokenizer.enable_truncation(max_length, strategy="longest_first")
        try:
            for i, encoding in zip(too_long, tokenizer.encode_batch([inputs[i] for i in too_long])):
                encodings[i] = encoding
        finally:
            tokenizer.no_truncation()
        print(f"warning: {where}: {len(too_long)} of {len(inputs)} texts are longer than {max_length} tokens and "
              f"were truncated (first: row {first + 1}); finetune.truncation=error refuses them", file=sys.stderr)
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
    ``bert_packed.collate.collate_classification`` with S and K bound). Packing:
    ``packing.pack`` with ``algorithm`` at depth ``max_sequences_per_pack`` (depth 1 and
    algorithm ``none``: one sequence per row, the padded baseline).
    """

    def __init__(self, encoded: Encoded, extra: Dict[str, np.ndarray], collate: Callable, *,
                 max_sequence_length: int, max_sequences_per_pack: int, algorithm: str, seed: int):
        from packing import Histogram, pack

        self.samples = {"input_ids": encoded.input_ids, "segment_ids": encoded.segment_ids, **extra}
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

    def source(self, micro_batch_size: int, rank: int = 0, world_size: int = 1) -> "PackedSource":
        return PackedSource(self, micro_batch_size, rank, world_size)


class PackedSource:
    """The training stream of a ``PackedDataset`` (data-source contract of ``bert_packed.data``).

    Packs of epoch e come in the order of ``assignment(e)``; epochs follow each other
    seamlessly (a micro-batch may span two), so every sequence is seen once per epoch.
    Global micro-batch g holds packs [g*B, (g+1)*B) of that stream; rank r serves g % n == r.
    """

    def __init__(self, dataset: PackedDataset, micro_batch_size: int, rank: int, world_size: int):
        self.dataset, self.micro_batch_size = dataset, int(micro_batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.next_global = self.rank
        self.packing_factor = dataset.packing_factor
        self.packing = {"algorithm": dataset.algorithm, "max_sequences_per_pack": dataset.max_sequences_per_pack,
                        "num_sequences": dataset.num_sequences, "num_packs": dataset.num_packs,
                        "packing_factor": dataset.packing_factor}

    def micro_batches_per_epoch(self) -> float:
        return self.dataset.num_packs / self.micro_batch_size

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        B, P = self.micro_batch_size, self.dataset.num_packs
        stream = np.arange(self.next_global * B, (self.next_global + 1) * B)
        epochs, positions = stream // P, stream % P
        self.next_global += self.world_size
        parts = []
        for epoch in np.unique(epochs):
            parts.append(self.dataset._batch(self.dataset.assignment(int(epoch)), positions[epochs == epoch])[0])
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}

    def state_dict(self) -> Dict[str, Any]:
        return {"next_global": int(self.next_global)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.next_global = int(state["next_global"])


def epochs_to_steps(epochs: float, num_packs: int, packs_per_step: int) -> int:
    """Optimizer steps that cover ``epochs`` passes over ``num_packs`` packs (at least 1)."""
    return max(1, math.ceil(epochs * num_packs / packs_per_step))


class PackedTask(Task):
    """A fine-tuning task that trains on ``train_data`` and evaluates every pack of ``eval_data``
    (``PackedDataset``s its ``setup`` builds)."""

    def __init__(self, config):
        super().__init__(config)
        self.train_data: Optional[PackedDataset] = None
        self.eval_data: Optional[PackedDataset] = None
        self._eval_batches: List[Tuple[Dict[str, np.ndarray], np.ndarray]] = []

    def checked_tokenizer(self, purpose: str):
        """:meth:`Task.tokenizer`, refused in one line when there is none or it has more tokens
        than the model's vocabulary (``purpose`` names the task in the message)."""
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise ConfigError(f"{purpose} needs a tokenizer: --init-checkpoint a Hugging Face directory with "
                              "tokenizer files (tokenizer.json or vocab.txt), or set model.tokenizer")
        vocab_size = self.config.model.vocab_size
        if tokenizer.get_vocab_size() > vocab_size:
            raise ConfigError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
                              f"{vocab_size}; use the checkpoint's own tokenizer")
        return tokenizer

    def num_steps(self, packs_per_step: int) -> int:
        """``train.steps``, or ``finetune.epochs`` over the training packs (unless steps came from the CLI)."""
        f, t = self.config.finetune, self.config.train
        if f.epochs is None or "steps" in self.config.cli_keys["train"]:
            return t.steps
        return epochs_to_steps(f.epochs, self.train_data.num_packs, packs_per_step)

    def data_source(self, split: str, *, micro_batch_size: int, rank: int, world_size: int):
        if split != "train":
            raise ValueError(f"{self.name} evaluates the whole validation set (evaluate), not a stream")
        return self.train_data.source(micro_batch_size, rank, world_size)

    def prepare_evaluation(self, *, micro_batch_size: int, rank: int, world_size: int) -> None:
        self._eval_batches = list(self.eval_data.batches(micro_batch_size))

    def evaluation_batches(self) -> List[Tuple[Dict[str, np.ndarray], np.ndarray]]:
        """Every validation pack once, as ``(batch, rows)`` (built on first use when the loop did not)."""
        if not self._eval_batches:
            self.prepare_evaluation(micro_batch_size=self.config.train.micro_batch_size, rank=0, world_size=1)
        return self._eval_batches
