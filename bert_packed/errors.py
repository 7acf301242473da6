"""The error a user's configuration mistake raises, at the bottom of the import graph.

Every module may raise it without importing the config loader (``bert_packed.config``
imports the task modules to learn their config keys, so they must not import it back).
User mistakes are ``ValueError`` subclasses with a one-line message naming the fix; the
command lines (``bert_packed.cli.run_cli``) print it as ``error: ...`` and exit 2.
"""


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line naming the fix."""
