"""Running a command line: how every entry point of the project turns errors into one line
and an exit status. It lives here because ``packing`` is the bottom layer (it imports nothing
of ours), so the packing CLI and every ``bert_packed``/``run.py`` command share it, with
``ArgumentParser`` (argparse's mistakes as one line, exit 2).

- a user mistake is a ``ValueError`` *subclass* (``PackingError``, ``ConfigError``,
  ``DataError``, ...): ``error: <message>``, exit 2. A bare ``ValueError`` is a bug of ours and
  keeps its traceback;
- an exception that carries its own ``exit_code`` and ``label`` (a run stopped on purpose:
  divergence exits 3, a signal 128 + N): ``<label>: <message>``, that status;
- ``OSError`` (a file the user named cannot be read or written): ``error: <file>: <reason>``, 2;
- Ctrl-C: the entry point's own line and status (default 130, the shell's convention);
  SIGTERM (what ``kill``, a scheduler or a container stop sends) is handled the same way at
  every stage, as a ``SignalInterrupt`` (a ``KeyboardInterrupt`` that knows its signal), with
  status 143: without it SIGTERM killed the process outright, wherever it was (an export
  half-written, a temporary file left, no summary).
"""
from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
from typing import Callable, Optional, Sequence


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a command-line mistake as one line and exit 2, like every other
    user mistake (argparse's default prints the usage block first)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM raised where the program is, as Ctrl-C raises ``KeyboardInterrupt``: the same
    handlers (cleanup, a stopped run's summary) see it; ``signum`` says which it was."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = int(signum)


def _raise_signal(signum, frame):
    raise SignalInterrupt(signum)


def run_cli(main: Callable[[], Optional[int]], *, interrupted: str = "interrupted (nothing half-written was kept)",
            interrupted_status: int = 130) -> int:
    """Call ``main()`` (which returns an exit status or None for 0) and map what it raises.
    SIGTERM meanwhile is Ctrl-C's ``KeyboardInterrupt`` (``SignalInterrupt``, exit 143)."""
    installed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_signal) if installed else None
    try:
        return _run(main, interrupted, interrupted_status)
    finally:
        # Put back the previous handler unless main() chose another on purpose (run.py ignores
        # both signals once its work is done).
        if installed and signal.getsignal(signal.SIGTERM) is _raise_signal:
            signal.signal(signal.SIGTERM, previous)


def _run(main, interrupted: str, interrupted_status: int) -> int:
    try:
        status = main()
    except ValueError as exc:
        if type(exc) is ValueError:
            raise
        return _fail(f"error: {exc}")
    except OSError as exc:
        filename = getattr(exc, "filename", None)
        return _fail(f"error: {filename or ''}{': ' if filename else ''}{exc.strerror or exc}")
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", None)
        return _fail(interrupted, interrupted_status if signum is None else 128 + signum)
    except Exception as exc:
        code, label = getattr(type(exc), "exit_code", None), getattr(type(exc), "label", None)
        if not isinstance(code, int) or not isinstance(label, str):
            raise
        return _fail(f"{label}: {exc}", getattr(exc, "exit_code", code))
    return 0 if status is None else int(status)


_LONG_RUN = re.compile(r"\S{401,}")


def _clip(line: str) -> str:
    """The line with every run of more than 400 non-blank characters (a 100 kB value a message
    quoted, a pasted file; longer than any sensible path) cut to its start, its end and its
    length: whatever message quoted it."""
    return _LONG_RUN.sub(lambda m: f"{m.group(0)[:100]}...[{len(m.group(0)):,} characters]...{m.group(0)[-60:]}",
                         line)


def _fail(line: str, status: int = 2) -> int:
    print(_clip(line), file=sys.stderr)
    return status


__all__: Sequence[str] = ("ArgumentParser", "SignalInterrupt", "run_cli")
