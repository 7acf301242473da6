"""IPU specifics: PopTorch options (options.py), pipeline stages and the PopTorch optimizer
(pipeline.py), the backend shared by ``--backend ipu`` and ``--backend mock`` (backend.py), the
GC200 cost model (cost_model.py), the per-IPU memory estimate (memory.py), ``--compile-only``
(offline.py) and the IPU-free poptorch stand-in (mock_poptorch/).

Only this package and backends/ipu.py import ``poptorch``; see docs/ipu.md.
"""
