"""The checkpointer: where a run's checkpoint lives, whether a run may resume from it, and
writing it (every rank's data position, host RNG state and backend device state such as an
IPU executable's RNG, the backend's optimizer state, the task's state; never from non-finite
weights). The file format is ``bert_packed.io.checkpoint``'s."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

from bert_packed.io.checkpoint import (CHECKPOINT_NAME, CheckpointError, config_differences, load_checkpoint,
                                    rng_state, save_checkpoint)
from bert_packed.config import ConfigError, resume_harmless_keys
from bert_packed.loop.distributed import barrier, gather
from bert_packed.loop.guard import non_finite_weights


class Checkpointer:
    """``output_dir``'s ``checkpoint.pt`` for one run on ``backend`` with ``world_size`` processes;
    ``given``: the configuration as the user gave it (what a resume is compared with)."""

    def __init__(self, output_dir: str, backend, *, world_size: int, is_main: bool, given: Dict[str, Any]):
        self.output_dir, self.backend, self.world_size, self.is_main = output_dir, backend, world_size, is_main
        self.given = given
        self.path = os.path.join(output_dir, CHECKPOINT_NAME)
        self.last_step: Optional[int] = None  # the step of the checkpoint on disk (None: none yet)

    def load(self, resume: bool, force: bool) -> Optional[Dict[str, Any]]:
        """The checkpoint to continue from, or None for a fresh start. A directory holding one is
        refused without ``resume``; one written differently (backend, processes, settings that
        change the computation) is refused unless ``force``."""
        if not os.path.exists(self.path):
            return None
        if not resume:
            raise ConfigError(
                f"{self.output_dir} already holds a checkpoint ({CHECKPOINT_NAME}); pass --resume to "
                f"continue that run, choose another --output-dir, or delete {self.output_dir} to start over "
                f"(nothing was changed)")
        state = load_checkpoint(self.path)
        self._check_resumable(state, force)
        self.last_step = state["step"]
        return state

    def _check_resumable(self, state: Dict[str, Any], force: bool) -> None:
        path, name = self.path, self.backend.name
        saved_backend = state.get("backend", name)
        if saved_backend != name:
            raise CheckpointError(
                f"{path} was written by backend {saved_backend!r}, this run uses {name!r}: optimizer "
                f"state does not carry over between backends; resume with --backend {saved_backend}")
        if state["world_size"] != self.world_size:
            raise CheckpointError(f"{path} was written by {state['world_size']} processes, this run has "
                                  f"{self.world_size}; resume with the same number of processes")
        saved = state.get("config_given", {})
        changed = config_differences(saved, self.given)
        harmless = resume_harmless_keys()
        refused = [key for key in changed if key not in harmless]
        if refused and not force:
            raise CheckpointError(
                f"{path}: the configuration differs from the checkpoint's in {', '.join(refused)}; that would "
                f"change the computation, so resuming is refused (restore them, or pass --resume-force)")
        if self.is_main:
            for key in changed:
                section, field = key.split(".", 1)
                note = " (forced)" if key in refused else ""
                print(f"note: resuming with {key} changed from {saved.get(section, {}).get(field)!r} to "
                      f"{self.given.get(section, {}).get(field)!r}{note}", file=sys.stderr)

    @staticmethod
    def backend_state(state: Dict[str, Any], rank: int) -> Dict[str, Any]:
        """What ``backend.prepare(state=)`` gets on resume in process ``rank``: the optimizer state
        and that process's device state (a checkpoint written before device states were kept
        per process holds one dict for all)."""
        saved = state.get("backend_state") or {}
        own = saved[rank] if isinstance(saved, list) else saved
        return {"optimizer": state["optimizer"], **own}

    def write(self, step: int, *, model, scheduler, source, task, totals: Dict[str, float],
              config: Dict[str, Any], plan: Dict[str, Any]) -> List[str]:
        """Write the checkpoint of ``step``; returns the names of non-finite weights instead (and
        writes nothing) when there are any, so the file on disk is always the last good state.
        Every rank contributes its data position and RNG state; rank 0 writes the file."""
        self.backend.sync_to_host()  # IPU: the weights live on the device
        bad = non_finite_weights(model)
        if bad:
            return bad
        data_states = gather(source.state_dict())
        rng_states = gather(rng_state())
        backend_state = dict(self.backend.state_dict())
        optimizer_state = backend_state.pop("optimizer")
        # The rest is each process's own device state (e.g. the RNG state of its IPUs' replicas).
        backend_states = gather(backend_state)
        if self.is_main:
            save_checkpoint(self.path, {
                "step": step, "world_size": self.world_size, "backend": self.backend.name,
                "model": model.state_dict(), "optimizer": optimizer_state,
                "backend_state": backend_states,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "data": data_states, "rng": rng_states, "totals": dict(totals), "config": config, "plan": plan,
                "config_given": self.given, "task": task.state_dict(),
            })
        barrier()
        self.last_step = step
        return []
