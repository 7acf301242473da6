"""Reading user text files, atomic file output and run-directory locking, shared by
checkpoints, metrics, reports, the config loader, the fine-tuning readers and the data pipeline.

User text files (configs, tables, SQuAD JSON, CoNLL, Hugging Face config.json) are read as
UTF-8 through :func:`read_utf8` (the whole text) or :func:`utf8_lines` (line by line): a byte
that is not UTF-8 is refused in one line naming the file, line, byte offset and column
(:func:`not_utf8_message`), raised as the caller's own error class.

Every file the project publishes is written to a temporary file in the destination's
folder and ``os.replace``-d onto its name, so a reader (or a run killed half-way) sees
either the previous complete file or the new complete one, never a torn one. A failure
or an exception (KeyboardInterrupt included) removes the temporary file.

A process killed outright (SIGKILL, OOM killer, power loss) cannot clean up, so temporary
names carry the writer's host and process id (``.tmp-<host>.<pid>.<random><name>``): the
next writer into the same folder removes the orphans of processes of this host that no
longer exist, and never touches a live writer's file.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import tempfile
from typing import Iterable, Iterator, List, Optional, Tuple, Type

from bert_packed.errors import ConfigError

__all__ = ["file_sha256", "read_utf8", "utf8_lines", "write_text_atomic", "atomic_path", "publish", "make_temp", "make_folder",
           "remove_orphans", "DirectoryLock", "OutputInUseError", "not_utf8_message", "check_output_dir",
           "read_vocab_tokens"]

TEMP_PREFIX = ".tmp-"



def file_sha256(path, block: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes (hex, what ``sha256sum`` prints), read in blocks: how every
    rerun and resume recognises a file it reuses (shards, vocabularies, manifests, inputs)."""
    digest = hashlib.sha256()
    with open(os.fspath(path), "rb") as handle:
        for chunk in iter(lambda: handle.read(block), b""):
            digest.update(chunk)
    return digest.hexdigest()

def not_utf8_message(path, data: bytes, start: int, *, first_line: int = 1, base_offset: int = 0) -> str:
    """The one-line message for a byte that is not UTF-8: ``data[start]`` (``data`` begins at
    line ``first_line``, byte ``base_offset`` of the file ``path``), named by line, byte offset
    and column, with the fix. Readers refuse such bytes: decoding with a guessed encoding, or
    replacing them, would use text the file does not hold."""
    line_start = data.rfind(b"\n", 0, start) + 1
    line = first_line + data.count(b"\n", 0, line_start)
    column = len(data[line_start:start].decode("utf-8", errors="replace")) + 1
    offset = base_offset + start
    bom = ": a UTF-16 byte-order mark" if offset == 0 and data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
    return (f"{path}: line {line}: not UTF-8 (byte 0x{data[start]:02x} at byte offset {offset}, column {column}{bom}); "
            f"save the file as UTF-8, e.g. iconv -f <encoding> -t utf-8")


def read_utf8(path, error: Type[Exception] = ValueError, *, drop_bom: bool = True) -> str:
    """The whole text of the user file ``path`` as UTF-8, a leading byte-order mark dropped
    (``drop_bom=False`` keeps it, for readers such as ``json`` that refuse it). A byte that is not
    UTF-8 raises ``error`` (the caller's one-line error class) with :func:`not_utf8_message`:
    decoding with a guessed encoding, or replacing the byte, would use text the file does not
    hold. An ``OSError`` (no such file, not readable) is the caller's to word."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(not_utf8_message(path, raw, exc.start)) from None
    return text[1:] if drop_bom and text.startswith("\ufeff") else text


def read_vocab_tokens(path, error: Type[Exception] = ValueError) -> List[str]:
    """The tokens of a WordPiece ``vocab.txt`` (one a line, the line number is the id; trailing
    empty lines dropped). A token on two lines is refused with ``error`` naming both: its id
    would be ambiguous (tokenizers keeps one of them, the model's embeddings both)."""
    tokens = [line.rstrip("\r") for line in read_utf8(path, error).split("\n")]
    while tokens and tokens[-1] == "":
        tokens.pop()
    seen = {}
    for number, token in enumerate(tokens, 1):
        if token in seen:
            raise error(f"{path}: line {number} repeats the token {token!r} of line {seen[token]}; a token is listed "
                        f"once, or its id is ambiguous: remove the duplicate line")
        seen[token] = number
    return tokens


def utf8_lines(path, handle, error: Type[Exception] = ValueError) -> Iterator[str]:
    """The lines of the binary ``handle`` (opened on ``path``) decoded as UTF-8, a leading
    byte-order mark dropped (Excel writes one; it is not part of the first column's name). The
    first byte that is not UTF-8 raises ``error`` naming the line, byte offset and column, as
    :func:`read_utf8` does; the lines before it have been yielded."""
    offset = 0
    for number, raw in enumerate(handle, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(not_utf8_message(path, raw, exc.start, first_line=number, base_offset=offset)) from None
        if number == 1 and text.startswith("\ufeff"):
            text = text[1:]
        offset += len(raw)
        yield text


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def make_temp(folder, *, prefix=TEMP_PREFIX, suffix=""):
    """mkstemp in ``folder`` with a name tagged by host and pid (see module docstring), after
    removing this prefix's orphans there. Returns ``(fd, path)``."""
    remove_orphans(folder, prefix)
    return tempfile.mkstemp(dir=folder, prefix=f"{prefix}{_host()}.{os.getpid()}.", suffix=suffix)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


def remove_orphans(folder, prefix=TEMP_PREFIX):
    """Remove ``prefix`` temporary files in ``folder`` left by dead processes of this host; returns them."""
    pattern = re.compile(re.escape(prefix) + re.escape(_host()) + r"\.(\d+)\.")
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def make_folder(folder):
    """os.makedirs(folder, exist_ok=True), with a clear OSError when a part of it is a file."""
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = folder
        while blocker and not os.path.isfile(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        raise NotADirectoryError(errno.ENOTDIR, f"is a file, so the folder {folder} cannot be made there",
                                 blocker) from None


def check_output_dir(output_dir: str, inputs: Iterable[Tuple[str, Optional[str]]] = (),
                     flag: str = "--output-dir") -> None:
    """Refuse, in one line (ConfigError), an output directory that a run must not write to: a
    file, a folder below a file, or the folder of one of its ``inputs`` ((what, path) pairs: a
    directory input, or the folder holding a file input), so no output lands on or beside what
    the run reads (a predictions.jsonl next to a data file of that name, a checkpoint.pt in a
    datasets directory). A folder inside an input directory is fine (its files stay as they are)."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"output directory {output_dir} is a file; choose another {flag}")
    above = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ConfigError(f"output directory {output_dir}: Not a directory ({above} is a file); choose another "
                          f"{flag}")
    target = os.path.realpath(output_dir)
    for what, path in inputs:
        if not path:
            continue
        folder = path if os.path.isdir(path) else (os.path.dirname(path) or ".")
        if os.path.realpath(folder) == target:
            raise ConfigError(f"{flag} {output_dir} is {what}'s directory ({path}); choose another {flag} so the "
                              f"input stays as it is")


def write_text_atomic(path, text):
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and os.replace."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)


class atomic_path:
    """Context manager: yields a temporary path next to ``path``, published onto it on success.

    ``prefix`` names the temporary file (``.tmp-`` by default; checkpoints use their own so a
    listing says what an orphan was). On an exception the temporary file is removed.
    """

    def __init__(self, path, *, prefix=TEMP_PREFIX, suffix=None):
        self.path = os.fspath(path)
        self.prefix = prefix
        self.suffix = os.path.basename(self.path) if suffix is None else suffix

    def __enter__(self):
        if _names_a_directory(self.path):  # before anything is written: abspath would drop the slash
            raise IsADirectoryError(errno.EISDIR, "ends in a path separator, so it names a directory; give the "
                                    "path of a file to write", self.path)
        folder = os.path.dirname(os.path.abspath(self.path))
        make_folder(folder)
        fd, self.tmp = make_temp(folder, prefix=self.prefix, suffix=self.suffix)
        os.close(fd)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                publish(self.tmp, self.path)
            except BaseException:
                _remove(self.tmp)
                raise
        else:
            _remove(self.tmp)
        return False


def _names_a_directory(path) -> bool:
    return path.endswith((os.sep, os.altsep or os.sep)) or os.path.basename(path) in ("", ".", "..")


def _remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def publish(tmp, path):
    """os.replace ``tmp`` onto ``path`` with the usual permissions (mkstemp makes files 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        os.replace(tmp, path)
    except OSError as exc:  # the error names what the user gave, not our temporary file
        raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None


class OutputInUseError(ValueError):
    """Another live run holds the output directory (one line: which process, and the fix)."""


class DirectoryLock:
    """One run per output directory: an exclusive ``flock`` on ``<directory>/.lock``.

    The operating system releases the lock when its process ends, however it ends, so a
    killed run leaves no stale lock: the file may remain, but the next run takes it. The file
    records the holder's host and pid for the error message of a second run.
    """

    NAME = ".lock"

    def __init__(self, directory):
        self.path = os.path.join(os.fspath(directory), self.NAME)
        self._handle = None

    def acquire(self) -> "DirectoryLock":
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            return self
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                handle.close()
                raise
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            directory = os.path.dirname(self.path)
            raise OutputInUseError(f"{directory} is in use by another run ({holder}); wait for it to finish, "
                                   f"or choose another --output-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the flock
            self._handle = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False
