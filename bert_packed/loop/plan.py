"""The step plan: what one optimizer step is, computed once per run and passed along, and all
the arithmetic behind it (replicas, gradient accumulation from a global batch, the packing
adjustments, the steps of a run).

It replaces writing the effective (packing-adjusted) accumulation, betas and steps back into
the config: the config stays what the user gave, and every part (backend, optimizer,
schedule, checkpoints, summary) reads the plan. ``bert_packed.config.validate`` asks
:func:`check_global_batch` here. No torch: the config's validation imports this module.

Packing changes how many sequences one optimizer step sees (about p times more, p = the
packing factor). The seeds offer two adjustments (``train.packing_adjustment``): divide
gradient accumulation by p (same sequences per update, same hyperparameters), or keep the
batch and raise LAMB's betas to the power p (the momentum after one packed update then
matches p unpacked updates with nearly equal gradients; paper Appendix D).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from bert_packed.errors import ConfigError, OptimConfigError

PACKING_ADJUSTMENTS = ("none", "gradient_accumulation", "betas")


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


def num_replicas(config, backend, world_size: int = 1) -> int:
    """Data-parallel model copies taking part in one optimizer step (``backend``: a backend
    object or class; it says how many replicas one process feeds)."""
    return world_size * backend.replicas_per_process(config)


def gradient_accumulation(config, backend, world_size: int = 1) -> int:
    """Micro-batches per replica per step before any packing adjustment."""
    return accumulation_for(config.train, num_replicas(config, backend, world_size))


def accumulation_for(train, replicas: int) -> int:
    """``gradient_accumulation`` for the ``train`` section and ``replicas`` in all (for a
    backend's own checks, which know their replicas but not the backend object)."""
    if train.global_batch_size is None:
        return train.gradient_accumulation
    return train.global_batch_size // (train.micro_batch_size * replicas)


def check_global_batch(config, backend, world_size: int = 1) -> None:
    """``train.global_batch_size`` must be whole micro-batches on every replica (ConfigError)."""
    t = config.train
    if t.global_batch_size is None:
        return
    replicas = num_replicas(config, backend, world_size)
    per_pass = t.micro_batch_size * replicas
    if t.global_batch_size % per_pass:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x replicas "
            f"= {t.micro_batch_size} x {replicas} = {per_pass}; pick a multiple of {per_pass}"
        )


def _check_packing_factor(packing_factor: float) -> float:
    packing_factor = float(packing_factor)
    if not packing_factor >= 1.0:
        raise OptimConfigError(f"packing_factor (sequences per pack) must be >= 1, got {packing_factor}")
    return packing_factor


def adjust_gradient_accumulation(gradient_accumulation: int, packing_factor: float) -> int:
    """Micro-batches per step so a packed step sees about as many sequences as an unpacked one.

    ``round(gradient_accumulation / p)``, at least 1 (e.g. 2048 at p = 1.17 -> 1750, the
    value of Graphcore's packed phase-1 config; 2048 at p = 2.0 -> 1024).
    """
    packing_factor = _check_packing_factor(packing_factor)
    if gradient_accumulation < 1:
        raise OptimConfigError(f"gradient_accumulation must be >= 1, got {gradient_accumulation}")
    return max(1, int(round(gradient_accumulation / packing_factor)))


def adjust_lamb_betas(betas: Sequence[float], packing_factor: float) -> Tuple[float, float]:
    """``(beta1 ** p, beta2 ** p)``: the paper's heuristic for keeping the batch of packs."""
    packing_factor = _check_packing_factor(packing_factor)
    return (float(betas[0]) ** packing_factor, float(betas[1]) ** packing_factor)


def adjust_for_packing(method: str, *, gradient_accumulation: int, betas: Sequence[float],
                       packing_factor: float) -> Tuple[int, Tuple[float, float]]:
    """Apply one of ``PACKING_ADJUSTMENTS``; returns ``(gradient_accumulation, betas)``.

    ``"none"``: unchanged; ``"gradient_accumulation"``: divide it by p; ``"betas"``: betas ** p.
    """
    if method == "none":
        return int(gradient_accumulation), (float(betas[0]), float(betas[1]))
    if method == "gradient_accumulation":
        return adjust_gradient_accumulation(gradient_accumulation, packing_factor), (float(betas[0]), float(betas[1]))
    if method == "betas":
        return int(gradient_accumulation), adjust_lamb_betas(betas, packing_factor)
    raise OptimConfigError(f"unknown packing adjustment {method!r}; choose one of: {', '.join(PACKING_ADJUSTMENTS)}")


def make_plan(config, backend, *, world_size: int = 1, packing_factor: Optional[float] = None,
              num_steps: Optional[Callable[[int], int]] = None) -> StepPlan:
    """The plan of ``config`` on ``backend`` (object or class) with ``world_size`` processes.

    ``packing_factor``: sequences per pack measured on the data (``train.packing_factor``
    overrides it; 1.0 when neither is known, which only matters for a packing adjustment).
    ``num_steps(packs_per_step)``: the task's step count (default ``train.steps``); steps a task
    derives are rounded up to whole calls of ``steps_per_call`` steps."""
    t = config.train
    p = float(t.packing_factor or packing_factor or 1.0)
    o = config.optimizer
    accumulation, betas = adjust_for_packing(t.packing_adjustment, packing_factor=p, betas=(o.beta1, o.beta2),
                                             gradient_accumulation=gradient_accumulation(config, backend, world_size))
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
