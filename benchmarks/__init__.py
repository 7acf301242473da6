"""The benchmark scripts (``python benchmarks/NAME.py ...``), importable as a package so tests
and scripts share :mod:`benchmarks.common` (setups in their own process, timed windows,
medians and spreads, result rows as JSON, Markdown tables)."""
