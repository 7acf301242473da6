"""Debian's fortune cookies as a real short-text classification corpus.

Packages ``fortunes`` and ``fortunes-min`` install one file per category under
``/usr/share/games/fortunes`` (``computers``, ``science``, ``politics``, ...), entries
separated by lines holding only ``%``. The task: given a fortune, name its category.
``write_fortunes_dataset`` writes ``train.csv`` and ``validation.csv`` (columns ``text``,
``label``): whitespace collapsed to single spaces, empty and duplicate entries dropped, a
seeded stratified split.
"""
from __future__ import annotations

import csv
import io
import os
import random
from typing import Dict, List, Sequence, Tuple

from bert_packed.data import DataError
from bert_packed.io.files import write_text_atomic

FORTUNES_DIR = "/usr/share/games/fortunes"
DEFAULT_CATEGORIES = ("computers", "definitions", "politics", "science", "songs-poems")


def fortunes_available(directory: str = FORTUNES_DIR, categories: Sequence[str] = DEFAULT_CATEGORIES) -> bool:
    return all(os.path.isfile(os.path.join(directory, c)) for c in categories)


def read_fortunes(path: str) -> List[str]:
    """The entries of one fortune file, each on one line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    entries, current = [], []
    for line in text.splitlines() + ["%"]:
        if line.strip() == "%":
            entry = " ".join(" ".join(current).split())
            if entry:
                entries.append(entry)
            current = []
        else:
            current.append(line)
    return entries


def fortunes_dataset(directory: str = FORTUNES_DIR, categories: Sequence[str] = DEFAULT_CATEGORIES, *,
                     validation_fraction: float = 0.1, seed: int = 0) -> Tuple[List[Dict[str, str]], List[Dict[str, str]]]:
    """(train rows, validation rows) of ``{"text", "label"}``; each category split on its own."""
    missing = [c for c in categories if not os.path.isfile(os.path.join(directory, c))]
    if missing:
        raise DataError(f"no fortune file(s) {', '.join(missing)} in {directory}; install Debian's fortunes and "
                        f"fortunes-min (apt-get install fortunes fortunes-min)")
    rng = random.Random(seed)
    seen, train, validation = set(), [], []
    for category in categories:
        entries = [e for e in read_fortunes(os.path.join(directory, category)) if not (e in seen or seen.add(e))]
        rng.shuffle(entries)
        held = max(1, round(len(entries) * validation_fraction))
        validation += [{"text": e, "label": category} for e in entries[:held]]
        train += [{"text": e, "label": category} for e in entries[held:]]
    rng.shuffle(train)
    return train, validation


def _csv(rows: List[Dict[str, str]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["text", "label"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_fortunes_dataset(output_dir: str, directory: str = FORTUNES_DIR,
                           categories: Sequence[str] = DEFAULT_CATEGORIES, *, validation_fraction: float = 0.1,
                           seed: int = 0) -> Dict[str, int]:
    """Write ``train.csv`` / ``validation.csv`` into ``output_dir``; returns row counts per file and category."""
    train, validation = fortunes_dataset(directory, categories, validation_fraction=validation_fraction, seed=seed)
    write_text_atomic(os.path.join(output_dir, "train.csv"), _csv(train))
    write_text_atomic(os.path.join(output_dir, "validation.csv"), _csv(validation))
    counts = {"train": len(train), "validation": len(validation)}
    for category in categories:
        counts[category] = sum(r["label"] == category for r in train + validation)
    return counts
