"""The data pipeline's error class, shared with the data sources of the package.

User mistakes (missing or corrupt files, missing fields, a bad vocabulary, an empty corpus,
a sequence longer than the configured length) raise `DataError` (a ValueError) with a
one-line message that names the problem and the fix; the CLI prints it as `error: ...`
and exits 2.
"""
from . import DataError  # noqa: F401  (defined in bert_packed/data/__init__.py)
