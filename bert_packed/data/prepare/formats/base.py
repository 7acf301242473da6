"""What every input format of `create` (and `vocab`) shares: the `Format` interface, the byte-range
reading of text formats, the input-file checks and the sentence splitter.

A format is one module of this package with one `Format` subclass, registered in ``__init__``.
It declares:

- ``name``, ``suffixes`` (file names that are this format whatever they hold) and ``sniff`` (does the
  head of a file look like this format; ``fallback``: the format of a file nothing else claims);
- ``plan_blocks``: the file cut into blocks of whole documents, so independent tasks read them;
- ``read_block``: the documents of one block, each a list of sentences, with every rule about what
  the file claims to be checked on the way (one `DataError` line naming file and place).

Text formats (`TextFormat`) cut by byte offset: a nominal cut is moved forward to the first line
that starts at or after it, then on to the first line for which ``boundary_after``/``boundary_at``
says a document begins, a function of the offset and the file alone, so the block that ends at a
cut and the one that starts there agree (no document split or read twice, whatever the block size).
"""
from __future__ import annotations

import os
import stat
from typing import Iterator, List, Optional, Tuple

from bert_packed.io.files import not_utf8_message
from bert_packed.data.errors import DataError

BOM = b"\xef\xbb\xbf"
# A sentence line of the `lines` format longer than this many characters per token of a sequence
# cannot be used: English WordPiece text has ~4-5 characters a token, so at 50 more than nine tenths
# of the line would be cut off by truncation (see `TextFormat.max_line_chars`).
CHARS_PER_TOKEN_LIMIT = 50

_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_regular_kind(path) -> Optional[str]:
    """What ``path`` is when it exists but is neither a regular file nor a directory, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((kind for test, kind in _NOT_REGULAR if test(mode)), None)


def check_input_file(path, what="corpus file"):
    """DataError unless ``path`` is a regular file: a directory, a pipe, a device or a missing file
    is named as what it is (a named pipe is not "not found")."""
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; give {what}s")
    kind = not_regular_kind(path)
    if kind is not None:
        raise DataError(f"{path}: is {kind}, not a regular file; a {what} is read in blocks by offset (more than "
                        f"once), so save the stream to a file and give that")
    if not os.path.isfile(path):
        raise DataError(f"{path}: {what} not found")


def first_line(path, offset) -> int:
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


def check_nul(path, text: str, where: str):
    """DataError for a NUL character in decoded text (Parquet values; text files are checked by byte)."""
    at = text.find("\x00")
    if at >= 0:
        raise DataError(f"{path}: {where}: a NUL character at character {at}; text holds no NUL (binary data, or "
                        f"a value padded with zeros?)")


class Format:
    """One input format (see the module docstring)."""

    name = ""
    suffixes: Tuple[str, ...] = ()
    fallback = False  # the format of a file that no other format claims
    help = ""  # a few words for --help and messages

    def sniff(self, head: bytes, first: bytes) -> bool:
        """Whether a file whose first 64 KiB are ``head`` (byte-order mark dropped) and whose first
        non-blank line is ``first`` (stripped) is in this format."""
        return False

    def plan_blocks(self, path: str, block_bytes: int, text_column: str) -> List[Tuple[int, int]]:
        raise NotImplementedError

    def text_bytes(self, path: str, text_column: str) -> int:
        """About how much text the file holds (to size the shards)."""
        return os.path.getsize(path)

    def read_block(self, path: str, start: int, stop: int, text_column: str,
                   max_seq_length: Optional[int] = None) -> Iterator[List[str]]:
        """The documents of one block, each a list of sentences (empty documents left out)."""
        raise NotImplementedError


class TextFormat(Format):
    """A UTF-8 text format cut at document boundaries by byte offset."""

    def boundary(self, line: bytes) -> Optional[str]:
        """For a line found after a nominal cut: "at" (a document starts with this line), "after" (a
        document starts after it) or None (read on)."""
        raise NotImplementedError

    def plan_blocks(self, path, block_bytes, text_column):
        size = os.path.getsize(path)
        cuts = [0]
        with open(path, "rb") as handle:
            nominal = block_bytes
            while nominal < size:
                cut = self._align(handle, nominal)
                if cut > cuts[-1]:
                    cuts.append(cut)
                # Nominal offsets up to this cut would only scan the same text again.
                nominal = max(nominal + block_bytes, (cuts[-1] // block_bytes + 1) * block_bytes)
        if cuts[-1] < size:
            cuts.append(size)
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def _align(self, handle, offset: int) -> int:
        handle.seek(offset - 1)
        handle.readline()  # the rest of the line holding byte offset-1: the next line starts at >= offset
        while True:
            start = handle.tell()
            line = handle.readline()
            if not line:
                return start
            where = self.boundary(line)
            if where == "at":
                return start
            if where == "after":
                return handle.tell()

    def read_block(self, path, start, stop, text_column, max_seq_length=None):
        text = decode_block(path, start, stop)
        lines = text.split("\n")  # "\n" only: the cuts were found by bytes' readline
        return self.documents(lines, path, start, text_column, max_seq_length)

    def documents(self, lines, path, start, text_column, max_seq_length):
        raise NotImplementedError


def decode_block(path, start, stop) -> str:
    """Bytes [start, stop) of a text file as UTF-8, a byte-order mark at the file's start dropped. A NUL
    byte or a byte that is not UTF-8 is refused naming the file, line and byte offset."""
    with open(path, "rb") as handle:
        handle.seek(start)
        data = handle.read(stop - start)
    if start == 0 and data.startswith(BOM):
        data, start = data[len(BOM):], len(BOM)
    nul = data.find(b"\x00")
    if nul >= 0:
        line = first_line(path, start) + data.count(b"\n", 0, nul)
        raise DataError(f"{path}: line {line}: a NUL byte at byte offset {start + nul}; a text corpus holds no NUL "
                        f"bytes (a binary file, or one padded with zeros?): remove them or leave the file out")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # The project's one message for a byte that is not UTF-8 (bert_packed.io.files).
        raise DataError(not_utf8_message(path, data, exc.start, first_line=first_line(path, start),
                                         base_offset=start)) from None
