"""PopTorch's host layout of one call's micro-batches."""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from bert_packed.errors import ConfigError


def stack_host_batch(micro_batches: List[Dict[str, np.ndarray]], *, num_steps: int, gradient_accumulation: int,
                     num_replicas: int) -> Dict[str, torch.Tensor]:
    """Micro-batches (step-major, then replica-major) -> PopTorch's host batch per field.

    Row order of the result: [step (device iteration), accumulation step, replica, pack].
    """
    per_step = gradient_accumulation * num_replicas
    order = [s * per_step + r * gradient_accumulation + j
             for s in range(num_steps) for j in range(gradient_accumulation) for r in range(num_replicas)]
    fields = micro_batches[0].keys()
    host = {}
    for name in fields:
        arrays = [np.asarray(micro_batches[i][name]) for i in order]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ConfigError(f"micro-batches of one call differ in the shape of {name!r} ({sorted(shapes)}); "
                              f"the IPU path needs fixed shapes")
        stacked = np.concatenate(arrays, axis=0)
        if stacked.dtype.kind == "f":
            stacked = stacked.astype(np.float32)  # normalisers stay fp32 (counts can exceed fp16)
        host[name] = torch.from_numpy(np.ascontiguousarray(stacked))
    return host
