"""Generated pre-training data: realistic pack shapes, synthetic tokens.

What is realistic: the sequence lengths (drawn from a shipped histogram, Wikipedia-512 by
default, mapped onto ``data.max_sequence_length``) and therefore the packing: the lengths
are packed with the configured algorithm and depth by the ``packing`` library, exactly
as real data would be. So throughput (sequences/s, real tokens/s) measured on generated
data is the throughput real data of that length distribution would get.

What is synthetic: the tokens. They are random, but not uniform noise: pairs
``(w, successor[w, c])`` with ``w`` Zipf-distributed and ``c`` one of 4 choices, from
tables fixed by the seed. Uniform tokens would leave the MLM loss flat at log(V); with
this structure the loss visibly falls as the model learns the unigram frequencies and
the pair structure from context. 15 % of each sequence is masked (80 % [MASK], 10 %
random, 10 % kept, as in BERT); NSP labels are random coin flips (so the NSP loss stays
near log 2: there is nothing to learn there).

Layout of a sequence of length l (natural token order, docs/design.md):
``[CLS] A [SEP] B [SEP]`` with segment ids 0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``
(``[CLS] A [SEP]`` alone when l < 5; lengths below 3 are raised to 3).

Determinism: lengths and packing depend on (seed, split); the pack order of training
epoch e on (seed, e); the tokens of a pack on (seed, split, epoch, pack index). Nothing
depends on the micro-batch size or the number of ranks, except which rank gets which
micro-batch (see bert_packed.data).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator

import numpy as np

from bert_packed.data.errors import DataError
from bert_packed.data.source import Batch, EpochCursor, empty_batch

PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103
SPECIAL_IDS = (0, 100, 101, 102, 103)  # [PAD], [UNK], [CLS], [SEP], [MASK] in BERT's vocabulary
MIN_VOCAB_SIZE = 128
NUM_SUCCESSORS = 4
ZIPF_EXPONENT = 1.2
_SPLITS = {"train": 0, "eval": 1}


def sample_lengths(histogram: str, num_sequences: int, max_sequence_length: int, length_mapping: str, split: str,
                   seed: int) -> np.ndarray:
    """``num_sequences`` lengths of ``split`` drawn from ``histogram`` (a name or file of
    ``packing.Histogram.load``), mapped to S = ``max_sequence_length``."""
    from packing import Histogram

    hist = Histogram.load(histogram)
    rng = np.random.default_rng([seed, _SPLITS[split], 0])
    probabilities = hist.counts / hist.counts.sum()
    lengths = rng.choice(np.arange(1, hist.max_sequence_length + 1), size=num_sequences, p=probabilities)
    return map_lengths(lengths, hist.max_sequence_length, max_sequence_length, length_mapping)


def map_lengths(lengths: np.ndarray, source_length: int, max_sequence_length: int,
                length_mapping: str = "scale") -> np.ndarray:
    """Histogram lengths (1..source_length) onto S = ``max_sequence_length`` (int64).

    ``scale``: l -> ceil(l * S / source_length); ``truncate``: min(l, S); both clipped to [3, S].
    """
    lengths = np.asarray(lengths)
    if length_mapping == "scale":
        lengths = np.ceil(lengths * (max_sequence_length / source_length))
    return np.clip(lengths, 3, max_sequence_length).astype(np.int64)


def pack_lengths(lengths: np.ndarray, max_sequence_length: int, max_sequences_per_pack: int, algorithm: str,
                 seed: int):
    """Pack ``lengths`` with ``algorithm`` at depth ``max_sequences_per_pack`` -> (assignment, result dict)."""
    from packing import Histogram, assign, pack

    hist = Histogram.from_lengths(lengths, max_sequence_length=max_sequence_length)
    # Depth 1 is the padded baseline whatever the algorithm: one sequence per row.
    algorithm = "none" if max_sequences_per_pack == 1 else algorithm
    result = pack(hist, algorithm=algorithm, max_sequences_per_pack=max_sequences_per_pack, seed=seed)
    assignment = assign(result.plan, lengths, seed=seed)
    return assignment, result.to_dict()


class _TokenModel:
    """The fixed random tables behind the synthetic tokens (see module docstring)."""

    def __init__(self, vocab_size: int, seed: int):
        if vocab_size < MIN_VOCAB_SIZE:
            raise DataError(f"generated data needs model.vocab_size >= {MIN_VOCAB_SIZE}, got {vocab_size}")
        ids = np.setdiff1d(np.arange(1, vocab_size), SPECIAL_IDS)
        rng = np.random.default_rng([seed, 99])
        self.token_ids = rng.permutation(ids)  # rank r -> token id (so frequent ids are scattered)
        weights = 1.0 / np.arange(1, ids.size + 1) ** ZIPF_EXPONENT
        self.cdf = np.cumsum(weights / weights.sum())
        self.successors = rng.integers(0, ids.size, size=(ids.size, NUM_SUCCESSORS))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        num_pairs = (n + 1) // 2
        first = np.minimum(np.searchsorted(self.cdf, rng.random(num_pairs)), self.cdf.size - 1)
        second = self.successors[first, rng.integers(0, NUM_SUCCESSORS, size=num_pairs)]
        ranks = np.stack([first, second], axis=1).reshape(-1)[:n]
        return self.token_ids[ranks]

    def random_tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.token_ids[rng.integers(0, self.token_ids.size, size=n)]


class GeneratedSource:
    """Generated packed micro-batches of one rank (the interface of bert_packed.data).

    Takes the options every source takes (the micro-batch, the packed shapes S/K/M, seed, rank,
    world size, vocabulary size) and what generating needs: the ``split`` (its own sequences
    and random streams), the length ``histogram`` with ``num_sequences`` and ``length_mapping``,
    the ``packing_algorithm``, and masking (``max_masked_tokens``, ``mask_probability``): the
    ``data`` section's keys of the same names.

    Attributes: ``packing_factor`` (sequences per pack), ``num_packs``,
    ``num_sequences``, ``packing`` (the packing result dict of docs/design.md).
    """

    def __init__(self, *, micro_batch_size: int, max_sequence_length: int, max_sequences_per_pack: int,
                 max_masked_tokens_per_pack: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 vocab_size: int, split: str = "train", histogram: str, num_sequences: int,
                 length_mapping: str = "scale", packing_algorithm: str, max_masked_tokens: int,
                 mask_probability: float):
        if split not in _SPLITS:
            raise DataError(f"unknown split {split!r}; use one of {', '.join(_SPLITS)}")
        self.split, self.seed = split, seed
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.S, self.K, self.M = max_sequence_length, max_sequences_per_pack, max_masked_tokens_per_pack
        self.max_masked_tokens, self.mask_probability = max_masked_tokens, mask_probability
        self.tokens = _TokenModel(vocab_size, seed)
        self.lengths = sample_lengths(histogram, num_sequences, max_sequence_length, length_mapping, split, seed)
        self.assignment, self.packing = pack_lengths(self.lengths, max_sequence_length, max_sequences_per_pack,
                                                     packing_algorithm, seed)
        self.num_sequences = int(self.lengths.size)
        self.num_packs = int(self.assignment.num_packs)
        self.packing_factor = self.num_sequences / self.num_packs
        self.micro_batches_per_epoch = self.num_packs // micro_batch_size
        if self.micro_batches_per_epoch < 1:
            raise DataError(
                f"{split} data has {self.num_packs} packs, fewer than one micro-batch of {micro_batch_size}; "
                f"raise data.num_{'eval_' if split == 'eval' else ''}sequences"
            )
        self._next = rank  # next global micro-batch index this rank yields
        self._cursor = EpochCursor(self.num_packs, micro_batch_size)
        self._order_epoch, self._order = None, None

    # -- the interface ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        while True:
            g = self._next
            self._next += self.world_size
            yield self.micro_batch(g)

    def state_dict(self) -> Dict[str, Any]:
        return {"next_micro_batch": self._next, "num_packs": self.num_packs,
                "micro_batch_size": self.micro_batch_size, "world_size": self.world_size,
                "cursor": self._cursor.state_dict()}

    def load_state_dict(self, state: Dict[str, Any], force: bool = False) -> None:
        """Continue after the checkpoint's last micro-batch; with another micro-batch size, at the
        same pack of the same epoch (nothing skipped or repeated, see EpochCursor)."""
        mine = self.state_dict()
        for key in ("num_packs", "world_size"):
            if state.get(key) != mine[key]:
                raise DataError(f"checkpoint data state has {key}={state.get(key)}, this run {mine[key]}; "
                                "resume with the same config and number of processes")
        self._next = int(state["next_micro_batch"])
        cursor = EpochCursor(self.num_packs, int(state["micro_batch_size"]), state.get("cursor"))
        if state["micro_batch_size"] == self.micro_batch_size:
            self._cursor = cursor
        else:
            first = self._next - self.rank  # the step's first micro-batch: where the stream stands
            epoch, offset = cursor.locate(first)
            self._cursor = EpochCursor(self.num_packs, self.micro_batch_size,
                                       {"base_global": first, "base_epoch": epoch, "base_offset": offset})

    # -- building micro-batches ------------------------------------------------------------

    def _pack_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.split == "train":
                self._order = np.random.default_rng([self.seed, 1, epoch]).permutation(self.num_packs)
            else:  # evaluation always sees the same packs in the same order
                self._order = np.arange(self.num_packs)
            self._order_epoch = epoch
        return self._order

    def micro_batch(self, g: int) -> Batch:
        """Global micro-batch ``g`` (the same whichever rank builds it)."""
        epoch, start = self._cursor.locate(g)
        epoch = epoch if self.split == "train" else 0
        order = self._pack_order(epoch)
        B = self.micro_batch_size
        batch = empty_batch(B, self.S, self.K, self.M)
        for row, pack_id in enumerate(order[start:start + B]):
            self._fill_pack(batch, row, int(pack_id), epoch)
        return batch

    def _fill_pack(self, batch: Batch, row: int, pack_id: int, epoch: int) -> None:
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], epoch, pack_id, 2])
        a = self.assignment
        members = a.sequence_indices[a.pack_offsets[pack_id]:a.pack_offsets[pack_id + 1]]
        offset, num_masked = 0, 0
        for k, seq in enumerate(members):
            length = int(self.lengths[seq])
            ids = np.empty(length, dtype=np.int64)
            segments = np.zeros(length, dtype=np.int64)
            ids[0] = CLS_ID
            body = self.tokens.sample(rng, length)
            if length >= 5:  # [CLS] A [SEP] B [SEP]
                len_a = int(rng.integers(1, length - 3))
                special = np.array([0, len_a + 1, length - 1])
                segments[len_a + 2:] = 1
            else:  # [CLS] A [SEP]
                special = np.array([0, length - 1])
            is_special = np.zeros(length, dtype=bool)
            is_special[special] = True
            ids[~is_special] = body[: int((~is_special).sum())]
            ids[special[1:]] = SEP_ID
            # BERT's masking: round(15 % of the sequence), at least 1, capped per sequence.
            num_to_mask = min(self.max_masked_tokens, max(1, int(round(length * self.mask_probability))))
            num_to_mask = min(num_to_mask, self.M - num_masked)  # pack budget (rarely binding)
            candidates = np.flatnonzero(~is_special)
            chosen = np.sort(rng.permutation(candidates)[:num_to_mask])
            labels = ids[chosen].copy()
            action = rng.random(chosen.size)
            ids[chosen[action < 0.8]] = MASK_ID
            random_slots = chosen[(action >= 0.8) & (action < 0.9)]
            ids[random_slots] = self.tokens.random_tokens(rng, random_slots.size)

            span = slice(offset, offset + length)
            batch["input_ids"][row, span] = ids
            batch["segment_ids"][row, span] = segments
            batch["position_ids"][row, span] = np.arange(length)
            batch["sequence_ids"][row, span] = k + 1
            m = slice(num_masked, num_masked + chosen.size)
            batch["mlm_positions"][row, m] = chosen + offset
            batch["mlm_labels"][row, m] = labels
            batch["mlm_sequence_ids"][row, m] = k + 1
            batch["cls_positions"][row, k] = offset
            batch["nsp_labels"][row, k] = int(rng.integers(0, 2))
            batch["nsp_weights"][row, k] = 1.0
            offset += length
            num_masked += chosen.size
