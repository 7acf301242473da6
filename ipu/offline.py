"""Know the memory before a real run: the per-IPU estimate, and an offline compile.

``python run.py --backend ipu --config phase2 --compile-only`` (Graphcore's ``--compile-only``):
prints the estimate of ``ipu/memory.py``, then compiles the training executable for a GC200
without attaching to one (``Options.useOfflineIpuTarget``), with Poplar writing its memory
report (``debug.allowOutOfMemory`` + ``autoReport.all``) to ``<output>/poplar_report`` even when
the layout does not fit: open it with PopVision Graph Analyser, or ``pva``. With the executable
cache on (the default), the real run that follows loads the executable instead of compiling.
Under ``--backend mock`` the same code path runs on the mock: its compile checks annotations,
options and shapes and warns when the estimate exceeds an IPU, but there is no Poplar report.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict

from bert_packed.io import write_text_atomic

ESTIMATE_NAME, REPORT_DIR_NAME = "memory_estimate", "poplar_report"


def report_memory(config, backend, output_dir: str) -> Dict[str, Any]:
    """Print the per-IPU estimate and write it as ``memory_estimate.md`` / ``.json``."""
    estimate = backend.memory_estimate(config)
    title = (f"Estimated memory per IPU, {config.name}: layers_per_ipu {list(config.ipu.layers_per_ipu)}, "
             f"micro-batch {config.train.micro_batch_size} x S={config.data.max_sequence_length}")
    text = f"{title}\n\n{estimate['table']}\n"
    print(text, flush=True)
    os.makedirs(output_dir, exist_ok=True)
    write_text_atomic(os.path.join(output_dir, ESTIMATE_NAME + ".md"), text)
    rows = {"ipus": estimate["ipus"], "limit_bytes": estimate["limit_bytes"], "fits": estimate["fits"]}
    write_text_atomic(os.path.join(output_dir, ESTIMATE_NAME + ".json"), json.dumps(rows, indent=2) + "\n")
    if not estimate["fits"]:
        print(f"warning: the estimate exceeds an IPU's memory ({estimate['limit_bytes'] / 2**20:,.0f} MiB); see "
              f"docs/ipu.md for what to change (layers_per_ipu, micro-batch, available_memory_proportion)",
              file=sys.stderr)
    return estimate


def compile_only(config, backend, output_dir: str) -> Dict[str, Any]:
    """Estimate, then compile offline with Poplar's memory report in ``output_dir``.

    The executable is the real run's: the task's model and the step plan the training loop
    computes (packing-adjusted accumulation and betas, steps)."""
    import torch

    from bert_packed.build import build_optimizer
    from bert_packed.loop.plan import make_plan
    from bert_packed.task import get_task

    estimate = report_memory(config, backend, output_dir)
    report_dir = os.path.join(output_dir, REPORT_DIR_NAME)
    task = get_task(config)
    task.setup(show_progress=False)
    source = task.data_source("train", micro_batch_size=config.train.micro_batch_size, rank=0, world_size=1)
    plan = make_plan(config, backend, packing_factor=source.packing_factor, num_steps=task.num_steps)
    if backend.prices_from_shapes:
        with torch.device("meta"):  # the mock compiles shapes: no gigabytes of weights on the CPU
            model = task.build_model()
    else:
        model = task.build_model()
    optimizer, _ = build_optimizer(config, model, plan.betas, steps=plan.steps)
    print(f"compiling {config.name} for {backend.name} offline (no IPU attached); Poplar's reports go to "
          f"{report_dir}", flush=True)
    start = time.perf_counter()
    executable = backend.compile_offline(model, optimizer, plan, config, report_dir)
    seconds = time.perf_counter() - start
    plan = getattr(executable, "pipeline", None)
    stages = f", pipeline stages on IPUs {plan['stage_ipus']}" if plan else ""
    if backend.prices_from_shapes:
        print(f"mock compile done in {seconds:.0f} s{stages}: annotations, options and shapes checked; the mock "
              f"has no Poplar, so no memory report (the estimate above is all there is)", flush=True)
    else:
        print(f"compiled in {seconds:.0f} s{stages}; memory report in {report_dir} (PopVision Graph Analyser); "
              f"the executable cache ({config.ipu.executable_cache_dir or 'off'}) serves the real run", flush=True)
    return {"estimate": estimate, "seconds": seconds, "report_dir": report_dir}
