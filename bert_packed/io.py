"""Atomic file output shared by checkpoints, metrics, reports and the data pipeline.

Every file the project publishes is written to a temporary file in the destination's
folder and ``os.replace``-d onto its name, so a reader (or a run killed half-way) sees
either the previous complete file or the new complete one, never a torn one. A failure
or an exception (KeyboardInterrupt included) removes the temporary file: nothing is left
behind but the previous output.
"""
from __future__ import annotations

import os
import tempfile

__all__ = ["write_text_atomic", "atomic_path", "publish"]

TEMP_PREFIX = ".tmp-"


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
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(dir=folder, prefix=self.prefix, suffix=self.suffix)
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
    os.replace(tmp, path)
