"""IPU knowledge: the ``ipu`` config section (config.py), PopTorch options (options.py), pipeline
stages and the PopTorch optimizer (pipeline.py), PopTorch's host layout of a call
(host_batch.py), the GC200 cost model (cost_model.py), the per-IPU memory estimate (memory.py),
the cycle and memory estimates of an executable (estimates.py), ``--compile-only``
(offline.py) and the IPU-free poptorch stand-in (mock_poptorch/, mock_popart/, mock_popdist.py).

The backends built on it, ``ipu`` and ``mock``, live with the others in ``backends/``
(``backends/ipu.py``, ``backends/mock.py``). Only this package and backends/ipu.py import
``poptorch``; see docs/ipu.md.
"""
