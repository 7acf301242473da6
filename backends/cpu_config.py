"""The ``cpu`` config section (backend ``cpu``), registered by ``backends/__init__.py``: compiling
the fixed-shape packed step, and how the process reuses host memory. The ``cuda`` section
extends it (the cuda backend is the cpu backend's step with GPU hooks)."""
from __future__ import annotations

from dataclasses import dataclass, field

from bert_packed.config import HARMLESS, bounded
from bert_packed.limits import STEPS, at_most


@dataclass
class CPUConfig:
    """Settings of the cpu backend's step (and, extended, the cuda backend's)."""

    # torch.compile the model once: packs have one fixed [B, S] shape, so one static graph
    # serves every step (no recompiles after warm-up; a run errs if there are any). The first
    # step pays the compile time (seconds to minutes: summary.json's first line shows it).
    compile: bool = field(default=False, metadata=HARMLESS)
    # torch.compile mode: "default", "reduce-overhead" (CUDA graphs on a GPU) or "max-autotune".
    compile_mode: str = field(default="default", metadata={
        "choices": ("default", "reduce-overhead", "max-autotune"), **HARMLESS})
    # Optimizer steps that may compile (the first forward/backward compiles; eval compiles
    # its own graph on first use). After them, graphs compiled are counted as recompiles.
    num_warmup_steps: int = bounded(2, ge=0, **STEPS, **HARMLESS)
    # Recompiles tolerated after warm-up; more is an error (a shape or guard changed: with
    # fixed [B, S] packs that is a bug, and it silently costs seconds per step). Each takes
    # seconds to minutes, so 10^6 would be weeks of compiling.
    max_recompiles_after_warmup: int = bounded(0, ge=0, **at_most(10**6, "each recompile takes seconds to minutes"),
                                               **HARMLESS)
    # glibc only: serve large allocations from the heap and keep freed memory in the process
    # (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB) instead of mapping fresh pages for every
    # tensor over 32 MiB and unmapping them when it is freed. A step's large temporaries (the
    # 30,522 x 384 embedding gradient, the MLM logits) then reuse memory already touched, with
    # no page faults: pre-training MiniLM ran 1.11x faster (docs/benchmarks/trainer.md). The memory
    # the process has held is not returned to the system until it exits. No effect elsewhere.
    reuse_freed_memory: bool = field(default=True, metadata=HARMLESS)
    # "bf16": every forward under torch.autocast("cpu", bfloat16), so the matrix products (and
    # their backward) run in bf16 on the CPU's AVX512-BF16 / AMX units; the weights (the
    # optimizer's master copy), gradients, optimizer state and checkpoints stay fp32, and the
    # loss and softmax stay fp32 (autocast's lists). Refused on a CPU without native bf16
    # instructions, where bf16 would only be emulated. (The cuda section redefines it.)
    precision: str = field(default="fp32", metadata={"choices": ("fp32", "bf16")})
    # Dropout masks of the eager step from raw random bits (two elements per 64-bit draw of
    # torch's CPU generator, kept with probability 1 - p to within 2**-32) instead of torch's
    # bernoulli_: the same dropout, 1.8x cheaper, about 5 % of a fine-tuning step
    # (bert_packed/model/dropout.py). false: torch's masks (F.dropout), e.g. to repeat a run of an
    # earlier version. Compiled steps and CUDA tensors always use torch's.
    fast_dropout: bool = True
