"""The error a user's configuration mistake raises, at the bottom of the import graph.

Every module may raise it without importing the config loader (``bert_packed.config``), e.g.
the data readers and tools that have no config.
User mistakes are ``ValueError`` subclasses with a one-line message naming the fix; the
command lines (``bert_packed.cli.run_cli``) print it as ``error: ...`` and exit 2.
"""


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line naming the fix."""


class OptimConfigError(ValueError):
    """An optimiser / schedule / packing-adjustment setting is invalid (one-line message;
    ``bert_packed.optim`` and ``bert_packed.loop.plan`` raise it)."""


EXCERPT_LIMIT = 60  # characters of a value a message quotes


def excerpt(value, limit: int = EXCERPT_LIMIT) -> str:
    """``repr(value)`` for a message, at most about ``limit`` characters: a long value (a 100 kB
    ``--set``, a pasted file) is quoted by its start and its length, never echoed whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters written out"
    return f"{text[:limit]}... ({size})"
