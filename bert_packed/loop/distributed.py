"""The process group of a data-parallel run (torchrun, or a backend's own launcher) and the
loop's small host-side collectives."""
from __future__ import annotations

import datetime
import os
from typing import Any, List, Tuple

import torch
import torch.distributed as dist


def setup_distributed(backend, timeout_minutes: float = 10.0) -> Tuple[int, int]:
    """(rank, world_size); joins the torchrun process group when launched by torchrun.

    A backend with its own launcher (the IPU's PopRun) reports its shard through
    ``backend.process_shard()``; otherwise the process group is initialised with the backend's
    ``dist_backend``. A collective that waits longer than ``timeout_minutes`` (a hung or dead
    rank) raises instead of blocking for gloo's/NCCL's default 30 minutes."""
    shard = backend.process_shard()
    if shard is not None:
        return int(shard[0]), int(shard[1])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        check_launcher(world_size)
        dist.init_process_group(backend=backend.dist_backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def planned_world_size(backend) -> int:
    """The processes of the run ``setup_distributed`` is about to join (the backend's launcher's
    count, the process group's, else ``WORLD_SIZE``): known before joining, so the config is
    validated once, the same way in every process, before any collective."""
    shard = backend.process_shard()
    if shard is not None:
        return int(shard[1])
    if is_distributed():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


LAUNCHER_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets besides WORLD_SIZE


def check_launcher(world_size: int) -> None:
    """A one-line ``ConfigError`` when ``WORLD_SIZE`` asks for several processes but the rest of
    torchrun's variables are not there (a WORLD_SIZE left set in the shell): torch's env://
    rendezvous would end in a traceback."""
    from bert_packed.errors import ConfigError

    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          f"not: this process was not started by torchrun; for one process unset WORLD_SIZE "
                          f"(unset WORLD_SIZE), for {world_size} launch with torchrun --nproc_per_node {world_size} "
                          f"run.py ...")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(values: List[float]) -> List[float]:
    """``values`` summed over the processes (as they are in one process)."""
    if is_distributed() and dist.get_world_size() > 1:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()
    return list(values)


def gather(obj: Any) -> List[Any]:
    """Every process's ``obj``, in rank order (a one-element list in one process)."""
    if is_distributed() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def barrier() -> None:
    if is_distributed():
        dist.barrier()
