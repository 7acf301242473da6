"""The data-source contract and the pieces every source shares: ``Batch``, ``empty_batch``,
``EpochCursor`` and the ``DataSource`` protocol (see ``bert_packed.data`` for the contract)."""
from __future__ import annotations

from typing import Any, Dict, Iterator, Protocol, runtime_checkable

import numpy as np

from bert_packed.collate import MLM_FIELDS, SEQUENCE_FIELDS, TOKEN_FIELDS
from bert_packed.data.errors import DataError

Batch = Dict[str, np.ndarray]


def empty_batch(micro_batch_size: int, max_sequence_length: int, max_sequences_per_pack: int,
                max_masked_tokens_per_pack: int) -> Batch:
    """All-zero micro-batch with the contract's fields, shapes [B, S|M|K] and dtypes (all
    padding: no sequences)."""
    B, S, K, M = micro_batch_size, max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack
    batch = {}
    for names, width in ((TOKEN_FIELDS, S), (MLM_FIELDS, M), (SEQUENCE_FIELDS, K)):
        batch.update({name: np.zeros((B, width), dtype=np.int64) for name in names})
    batch["nsp_weights"] = np.zeros((B, K), dtype=np.float32)
    return batch


class EpochCursor:
    """Where global micro-batch g of a stream of epochs starts: ``locate(g) -> (epoch, first item)``.

    Each epoch serves its items (in that epoch's order) ``micro_batch_size`` at a time and drops
    the last partial micro-batch (fixed shapes). A *base* ``(base_global, base_epoch,
    base_offset)`` says that micro-batch ``base_global`` starts at item ``base_offset`` of epoch
    ``base_epoch``: a run resumed with a different micro-batch size continues at exactly the item
    where the checkpoint stopped, so no item is skipped or served twice. The default base (0, 0,
    0) is the plain stream ``g -> divmod(g, batches per epoch)``.
    """

    def __init__(self, num_items: int, micro_batch_size: int, state: Dict[str, int] = None):
        self.num_items, self.micro_batch_size = int(num_items), int(micro_batch_size)
        state = state or {}
        self.base_global = int(state.get("base_global", 0))
        self.base_epoch = int(state.get("base_epoch", 0))
        self.base_offset = int(state.get("base_offset", 0))
        self.batches_per_epoch = self.num_items // self.micro_batch_size

    def state_dict(self) -> Dict[str, int]:
        return {"base_global": self.base_global, "base_epoch": self.base_epoch, "base_offset": self.base_offset}

    def locate(self, global_batch: int) -> tuple:
        k = int(global_batch) - self.base_global
        if k < 0:
            raise DataError(f"micro-batch {global_batch} lies before the resumed position {self.base_global}")
        first_epoch = (self.num_items - self.base_offset) // self.micro_batch_size  # left in the base epoch
        if k < first_epoch:
            return self.base_epoch, self.base_offset + k * self.micro_batch_size
        epoch, index = divmod(k - first_epoch, self.batches_per_epoch)
        return self.base_epoch + 1 + epoch, index * self.micro_batch_size


class RankStream:
    """The endless iterator of a rank's global micro-batches g = rank, rank + world_size, ...
    for sources that can build any global micro-batch (``batch(g)``) and keep the next one in
    ``_next_global_batch`` (their state)."""

    def __iter__(self):
        while True:
            global_batch = self._next_global_batch
            batch = self.batch(global_batch)
            self._next_global_batch = global_batch + self.world_size
            yield batch


@runtime_checkable
class DataSource(Protocol):
    packing_factor: float
    packing: Any  # how this run packed the data (a dict for summary.json), None when the file came packed

    def __iter__(self) -> Iterator[Batch]:
        ...

    def state_dict(self) -> Dict[str, Any]:
        ...

    def load_state_dict(self, state: Dict[str, Any], force: bool = False) -> None:
        # force (--resume-force): continue on data that changed since the checkpoint where the
        # source can say where; sources that cannot refuse a change whatever force says.
        ...
