"""Know the memory before a real run: the per-IPU estimate, and an offline compile in one of two modes.

``python run.py --backend ipu --config phase2 --compile-only`` (Graphcore's ``--compile-only``)
prints the estimate of ``ipu/memory.py``, then compiles the training executable for a GC200
without attaching to one (``Options.useOfflineIpuTarget``). Two modes, because one compile
cannot do both jobs:

* ``cache`` (the default, ``--compile-only`` or ``--compile-only cache``): the options are exactly the real run's. PopART
  keys its executable cache on a hash of the IR, the data flow, the optimizer's constants, the
  device and the session options, engine options included (popart ``sessionoptions.cpp``
  ``std::hash<SessionOptions>``, ``ir.cpp`` ``std::hash<IrBundle>``); the offline target is no
  part of it (same architecture, same IPU count, same tiles), so with the executable cache on
  (``ipu.executable_cache_dir``) the real run that follows loads this executable instead of
  compiling for tens of minutes. A layout that does not fit fails here with Poplar's
  out-of-memory error, which names the tiles; there is no memory report.
* ``report`` (``python run.py --backend ipu --config phase2 --compile-only report``): the same compile plus Poplar's
  report options (``debug.allowOutOfMemory``, ``autoReport.all``, ``autoReport.directory``), so
  the memory report in ``<output>/poplar_report`` is written even when the layout does not fit
  (open it with PopVision Graph Analyser, or ``pva``). Those engine options change the cache
  key, so this executable can never serve the real run, and the cache is off for it.

Under ``--backend mock`` the same code path runs on the mock: its compile checks annotations,
options (PopTorch's tables) and shapes, computes the cache key PopART would (the mock's
``cache_key``), and warns when the estimate exceeds an IPU; there is no Poplar and no report.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, Optional

from bert_packed.errors import ConfigError
from bert_packed.io.files import write_text_atomic

ESTIMATE_NAME, REPORT_DIR_NAME = "memory_estimate", "poplar_report"
MODES = ("cache", "report")


def report_memory(config, backend, output_dir: str) -> Dict[str, Any]:
    """Print the per-IPU estimate and write it as ``memory_estimate.md`` / ``.json``."""
    estimate = backend.memory_estimate(config)
    title = (f"Estimated memory per IPU, {config.name}: layers_per_ipu {list(config.ipu.layers_per_ipu)}, "
             f"micro-batch {config.train.micro_batch_size} x S={config.data.max_sequence_length}")
    text = f"{title}\n\n{estimate['table']}\n"
    if estimate.get("tile_table"):
        text += f"\n{estimate['tile_table']}\n"
    print(text, flush=True)
    os.makedirs(output_dir, exist_ok=True)
    write_text_atomic(os.path.join(output_dir, ESTIMATE_NAME + ".md"), text)
    rows = {"ipus": estimate["ipus"], "limit_bytes": estimate["limit_bytes"], "fits": estimate["fits"],
            "largest_tensors": estimate.get("largest_tensors", [])}
    write_text_atomic(os.path.join(output_dir, ESTIMATE_NAME + ".json"), json.dumps(rows, indent=2) + "\n")
    if not estimate["fits"]:
        print(f"warning: the estimate exceeds an IPU's memory ({estimate['limit_bytes'] / 2**20:,.0f} MiB); see "
              f"docs/ipu.md for what to change (layers_per_ipu, micro-batch, available_memory_proportion)",
              file=sys.stderr)
    return estimate


def _ipu_count_note(config) -> Optional[str]:
    """PopTorch compiles offline for exactly the IPUs the model uses, and reserves a power of two
    on real hardware (CompilerImpl::createDevice); the device's IPU count is in the cache key."""
    used = config.ipu.ipus_per_replica * config.ipu.replication_factor
    if used & (used - 1):
        reserved = 1 << (used - 1).bit_length()
        return (f"the layout uses {used} IPUs: the offline target has {used}, the real run reserves {reserved} (a "
                f"power of two) and PopART's cache key includes the device's IPU count, so the real run will "
                f"compile again")
    return None


def compile_only(config, backend, output_dir: str, *, mode: str = "cache") -> Dict[str, Any]:
    """Estimate, then compile offline: ``mode="cache"`` with the real run's options (fills the
    executable cache), ``mode="report"`` with Poplar's memory report in ``output_dir`` instead.

    The executable is the real run's: the step plan the training loop computes (accumulation
    from ``train.global_batch_size`` and the packing adjustment with the packing factor measured
    on the run's data, betas, steps), because the accumulation factor is part of the cache key."""
    import torch

    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.loop.plan import make_plan
    from bert_packed.tasks.registry import get_task

    if mode not in MODES:
        raise ConfigError(f"compile mode {mode!r}: choose one of {', '.join(MODES)}")
    if config.finetune.task:
        raise ConfigError(f"--compile-only compiles the pre-training model; finetune.task={config.finetune.task} "
                          f"builds another one (its heads), so neither the estimate nor the cache would be its own")
    if config.ipu.log_cycle_count:
        raise ConfigError("PopTorch refuses cycle counting on an offline target (\"Cycle count logging is only "
                          "supported on actual IPU hardware.\"): compile with --set ipu.log_cycle_count=false")
    task = get_task(config)
    task.setup(show_progress=False)
    source = task.data_source("train", micro_batch_size=config.train.micro_batch_size, rank=0, world_size=1)
    plan = make_plan(config, backend, packing_factor=source.packing_factor, num_steps=task.num_steps)
    if backend.prices_from_shapes:
        with torch.device("meta"):  # the mock compiles shapes: no gigabytes of weights on the CPU
            model = build_model(config)
    else:
        model = build_model(config)
    backend.check_plan(model, plan, offline=True)  # a mistake is refused before anything is written
    estimate = report_memory(config, backend, output_dir)
    report_dir = os.path.join(output_dir, REPORT_DIR_NAME) if mode == "report" else None
    optimizer, _ = build_optimizer(config, model, plan.betas, steps=plan.steps)
    cache = config.ipu.executable_cache_dir
    if mode == "report":
        target = f"Poplar's reports go to {report_dir}; not cached (report options change the cache key)"
    elif cache and backend.prices_from_shapes:
        target = (f"the cache key is computed (the mock's cache lives in memory, in this process; with --backend ipu "
                  f"the executable goes to {cache}, where the real run finds it)")
    elif cache:
        target = f"the executable goes to the cache {cache}, where the real run will find it"
    else:
        target = "ipu.executable_cache_dir is null: nothing is kept for the real run (set it to fill a cache)"
    note = _ipu_count_note(config) if mode == "cache" and cache else None
    if note:
        print(f"warning: {note}", file=sys.stderr)
    print(f"compiling {config.name} for {backend.name} offline (no IPU attached, mode {mode}): {target}", flush=True)
    start = time.perf_counter()
    executable = backend.compile_offline(model, optimizer, plan, config, report_dir)
    seconds = time.perf_counter() - start
    layout = getattr(executable, "pipeline", None)
    stages = f", pipeline stages on IPUs {layout['stage_ipus']}" if layout else ""
    if backend.prices_from_shapes:
        print(f"mock compile done in {seconds:.0f} s{stages}: annotations, options and shapes checked; the mock "
              f"has no Poplar, so no memory report (the estimate above is all there is)", flush=True)
    elif mode == "report":
        print(f"compiled in {seconds:.0f} s{stages}; memory report in {report_dir} (PopVision Graph Analyser)",
              flush=True)
    else:
        print(f"compiled in {seconds:.0f} s{stages}; {target}", flush=True)
    return {"estimate": estimate, "seconds": seconds, "report_dir": report_dir, "mode": mode,
            "executable": executable}
