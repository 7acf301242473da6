"""The step plan: what one optimizer step is, computed once per run and passed along.

It replaces writing the effective (packing-adjusted) accumulation, betas and steps back into
the config: the config stays what the user gave, and every part (backend, optimizer,
schedule, checkpoints, summary) reads the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from bert_packed.build import adjust_for_packing
from bert_packed.config import Config, gradient_accumulation


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step of a run.

    ``gradient_accumulation``: micro-batches per replica per step after the packing adjustment;
    ``replicas_per_process``: replicas one process feeds (the backend says); ``world_size``:
    processes; ``steps``: optimizer steps of the run (a multiple of ``steps_per_call`` when the
    task derived them); ``betas``: the optimizer's, after the adjustment; ``settings``: the
    backend's own config section (None when it has none)."""

    micro_batch_size: int
    gradient_accumulation: int
    replicas_per_process: int
    world_size: int
    steps: int
    steps_per_call: int
    betas: Tuple[float, float]
    packing_factor: float
    seed: int = 0
    max_grad_norm: Optional[float] = None
    settings: Any = None

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches one process contributes to one step."""
        return self.gradient_accumulation * self.replicas_per_process

    @property
    def num_replicas(self) -> int:
        return self.world_size * self.replicas_per_process

    @property
    def packs_per_step(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation * self.num_replicas


def make_plan(config: Config, backend, *, world_size: int = 1, packing_factor: Optional[float] = None,
              num_steps: Optional[Callable[[int], int]] = None) -> StepPlan:
    """The plan of ``config`` on ``backend`` (object or class) with ``world_size`` processes.

    ``packing_factor``: sequences per pack measured on the data (``train.packing_factor``
    overrides it; 1.0 when neither is known, which only matters for a packing adjustment).
    ``num_steps(packs_per_step)``: the task's step count (default ``train.steps``); steps a task
    derives are rounded up to whole calls of ``steps_per_call`` steps."""
    t = config.train
    p = float(t.packing_factor or packing_factor or 1.0)
    accumulation, betas = adjust_for_packing(config, p, gradient_accumulation(config, backend, world_size))
    replicas = backend.replicas_per_process(config)
    per_call = backend.steps_per_call_for(config)
    steps = t.steps
    if num_steps is not None:
        steps = num_steps(t.micro_batch_size * accumulation * replicas * world_size)
        if steps != t.steps:
            steps = -(-steps // per_call) * per_call
    settings = config.sections[backend.config_section] if backend.config_section else None
    return StepPlan(micro_batch_size=t.micro_batch_size, gradient_accumulation=accumulation,
                    replicas_per_process=replicas, world_size=world_size, steps=steps, steps_per_call=per_call,
                    betas=betas, packing_factor=p, seed=t.seed, max_grad_norm=config.optimizer.max_grad_norm,
                    settings=settings)
