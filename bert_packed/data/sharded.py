"""Training on a sharded dataset (`data.path` = a directory of HDF5 shards + manifest.json).

Why not `HDF5Source` on many files: it either caches a whole file in every rank or reads
random rows, decompressing a 1,024-row gzip chunk for each few rows it keeps (a few hundred
packs/s per rank at S=512), and every rank builds an int64 permutation of the whole data each
epoch. Here each rank reads only its own shards, in whole chunks, and shuffles in bounded
windows; the position of any item is computed, never replayed.

The stream (contract of `bert_packed.data`):

- **Lanes.** The n shards (manifest order) are dealt round-robin into L lanes (``data.lanes``;
  default: the largest divisor of n up to 64, ``default_lanes``):
  lane l holds shards l, l + L, l + 2L, ... Global micro-batch g comes from lane g % L: it is
  that lane's (g // L)-th micro-batch (counted from the epoch's start, see below). Rank r of W
  yields the g with g % W == r; when W divides L those all come from the lanes l with
  l % W == r, so a rank opens and reads only its own shards, and the global stream does not
  depend on W (1 process x N accumulation == N processes, for every N dividing L). A W that
  does not divide L is refused (re-shard with ``--output-shards`` a multiple of W). An L that
  does not divide n is served with a warning naming the share of the data each epoch skips
  (``uneven_lanes_message``).
- **Layout.** Shards may differ in their masked-slot width (M, or P unpacked): every block
  is zero-padded to the configured S, K, M as it is read, so rows of two shards join.
- **Epoch e of lane l** is an order of its items: the lane's shards in an order permuted by
  (seed, e, l); each shard cut into blocks of its HDF5 chunk (1,024 rows; the last block may
  be shorter), the blocks permuted by the same generator; that block sequence cut into
  *windows* of ``window_blocks`` consecutive blocks, and the rows of window k permuted by
  (seed, e, l, k). Without ``shuffle`` (evaluation) all these orders are the identity.
- **Epoch length.** Every lane serves the same number m = min over lanes of
  (lane items // B) of micro-batches per epoch, so an epoch is L * m global micro-batches.
  Dropped each epoch: the last (lane items - m * B) items of each lane's epoch order (its
  tail: a different set each epoch, since the order is reshuffled); in all,
  num_items - L * m * B items, at most (B - 1) per lane plus the lanes' size differences.
- **Resume.** The state is the next global micro-batch plus a cursor (an epoch start and the
  item each lane has reached: L integers), so a resumed run yields exactly the micro-batch
  that would have come. With another micro-batch size (``--resume-force``) the packs come in
  the same order: the original micro-batches' items, in their order, re-cut to the new size
  (``RecutCursor``), so a step of the same global batch reads the packs the uninterrupted run
  would have read. A process reads only its own lanes, so with several processes that is
  refused (resume with the old size, or on one process). The state names the dataset
  (shards' names, sizes, rows and content checksums, digested: ``dataset_identity``); a
  changed dataset is refused unless the resume is forced (then a new epoch starts where it
  stopped).

Memory per rank: for each of its L / W lanes, the window being served and the next one
(prefetched by one background thread while the current one trains; what a window holds is a
pure function of (seed, epoch, lane, window), so the thread changes timing only). Windows
hold the file's dtypes; the default window is max(1, 16 // L) blocks (16K packs over all
lanes), so a rank holds about 2 x max(16K / W, L / W x 1K) packs. Range checks run once per
block as it is read, not per micro-batch.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import numpy as np

from bert_packed.data import h5io
from bert_packed.data.errors import DataError
from bert_packed.data.hdf5 import CHUNK_CACHE, check_dims, check_rows, check_vocab, read_layout, to_batch
from bert_packed.data.shards import load_manifest, shard_paths
from bert_packed.data.source import RankStream

WINDOW_PACKS = 16384  # packs held in windows over all lanes (per lane: at least one block)


MAX_DEFAULT_LANES = 64  # a process reading every lane holds 2 x 64 x 1,024 packs (0.7 GB at S=512)


def default_lanes(num_shards: int) -> int:
    """The largest divisor of ``num_shards`` up to 64: every lane holds the same number of shards
    and a single process holds a bounded number of windows however many shards there are."""
    return max(d for d in range(1, min(num_shards, MAX_DEFAULT_LANES) + 1) if num_shards % d == 0)


def uneven_lanes_message(directory, lane_shards, lane_items, micro_batch_size) -> str:
    """What lanes that do not divide the shards cost: every lane serves as many micro-batches as
    the smallest lane has, so each epoch skips the longer lanes' surplus (the items no lane's
    epoch reaches: a different set each epoch)."""
    num_shards, lanes = sum(len(s) for s in lane_shards), len(lane_shards)
    served = lanes * (min(lane_items) // micro_batch_size) * micro_batch_size
    total = sum(lane_items)
    counts = sorted({len(s) for s in lane_shards})
    return (f"{directory}: data.lanes={lanes} does not divide its {num_shards} shards: lanes hold "
            f"{counts[0]} to {counts[-1]} shards and each serves only as many micro-batches as the smallest, so every "
            f"epoch skips {100.0 * (total - served) / total:.1f} % of the data ({total - served} of {total} items); "
            f"set data.lanes to a divisor of {num_shards}, such as {default_lanes(num_shards)} (the default when unset)")


def dataset_identity(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """What a checkpoint records of the data: shard count, rows and a digest of the shards'
    names, sizes, rows and content checksums (``sha256``, docs/data.md): a changed, added or
    removed shard changes it, and so does the same dataset re-packed with another seed (same
    names, sizes and rows, other packs). A manifest from before checksums gives the digest it
    gave then (names, sizes, rows), so its checkpoints still resume."""
    shards = [[s["file"], int(s["bytes"]), int(s["num_items"])] + ([str(s["sha256"])] if "sha256" in s else [])
              for s in manifest["shards"]]
    digest = hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]
    identity = {"num_shards": len(shards), "num_items": int(sum(s[2] for s in shards)), "digest": digest}
    if all(len(s) == 4 for s in shards):
        identity["content"] = "sha256"
    return identity


class LaneCursor:
    """Where global micro-batch g starts: ``locate(g) -> (epoch, lane, first item)`` in the
    lane's epoch order. A base ``(base_global, base_epoch, base_offsets)`` says that from
    micro-batch ``base_global`` on, lane l continues at item ``base_offsets[l]`` of epoch
    ``base_epoch`` (the default base, all zeros, is the plain stream)."""

    def __init__(self, lane_items: List[int], micro_batch_size: int, state: Dict[str, Any] = None):
        self.lane_items, self.micro_batch_size = [int(x) for x in lane_items], int(micro_batch_size)
        self.lanes = len(self.lane_items)
        state = state or {}
        self.base_global = int(state.get("base_global", 0))
        self.base_epoch = int(state.get("base_epoch", 0))
        self.base_offsets = [int(x) for x in state.get("base_offsets", [0] * self.lanes)]
        if len(self.base_offsets) != self.lanes:
            raise DataError(f"the data state has {len(self.base_offsets)} lanes, this dataset {self.lanes}; "
                            "resume with the same dataset")
        self.batches_per_lane = min(self.lane_items) // self.micro_batch_size
        # Micro-batches of each lane left in the base epoch (the shortest remainder decides).
        self.first_epoch = min((n - o) // self.micro_batch_size for n, o in zip(self.lane_items, self.base_offsets))

    def state_dict(self) -> Dict[str, Any]:
        return {"base_global": self.base_global, "base_epoch": self.base_epoch, "base_offsets": list(self.base_offsets)}

    def locate(self, global_batch: int) -> tuple:
        k = int(global_batch) - self.base_global
        if k < 0:
            raise DataError(f"micro-batch {global_batch} lies before the resumed position {self.base_global}")
        lane = int(global_batch) % self.lanes
        if k < self.lanes * self.first_epoch:
            return self.base_epoch, lane, self.base_offsets[lane] + (k // self.lanes) * self.micro_batch_size
        epoch, index = divmod(k - self.lanes * self.first_epoch, self.lanes * self.batches_per_lane)
        return self.base_epoch + 1 + epoch, lane, (index // self.lanes) * self.micro_batch_size

    def epoch_end(self, epoch: int, lane: int) -> int:
        """One past the last item lane ``lane`` serves in ``epoch``."""
        if epoch == self.base_epoch:
            return self.base_offsets[lane] + self.first_epoch * self.micro_batch_size
        return self.batches_per_lane * self.micro_batch_size

    def pieces(self, global_batch: int) -> List[tuple]:
        """The items of micro-batch ``global_batch``: [(epoch, lane, first item, stop item)]."""
        epoch, lane, start = self.locate(global_batch)
        return [(epoch, lane, start, start + self.micro_batch_size)]

    def recut(self, first: int, micro_batch_size: int) -> "RecutCursor":
        """This stream from micro-batch ``first`` on, cut into micro-batches of another size."""
        return RecutCursor(self, micro_batch_size, base_global=first, base_unit=first, base_item=0)


class RecutCursor:
    """A stream resumed (``--resume-force``) with another micro-batch size B: the items of the
    original stream's micro-batches (its *units*: ``units``, a ``LaneCursor`` of their size u),
    in their order, cut into micro-batches of B. Micro-batch g >= ``base_global`` holds items
    [p, p + B) of that item sequence, p = ``base_item`` + (g - ``base_global``) * B, counted from
    the start of unit ``base_unit``. So the packs come in the order of the uninterrupted run
    whatever B; a micro-batch may join the end of one lane's unit and the start of the next
    lane's. Resumed again with yet another size, the units stay those of the original stream."""

    def __init__(self, units: LaneCursor, micro_batch_size: int, *, base_global: int, base_unit: int,
                 base_item: int):
        self.units, self.micro_batch_size = units, int(micro_batch_size)
        self.base_global, self.base_unit, self.base_item = int(base_global), int(base_unit), int(base_item)

    @classmethod
    def from_state(cls, lane_items: List[int], state: Dict[str, Any]) -> "RecutCursor":
        units = LaneCursor(lane_items, int(state["unit_size"]), state["units"])
        return cls(units, int(state["micro_batch_size"]), base_global=state["base_global"],
                   base_unit=state["base_unit"], base_item=state["base_item"])

    def state_dict(self) -> Dict[str, Any]:
        return {"recut": True, "unit_size": self.units.micro_batch_size, "units": self.units.state_dict(),
                "micro_batch_size": self.micro_batch_size, "base_global": self.base_global,
                "base_unit": self.base_unit, "base_item": self.base_item}

    def position(self, global_batch: int) -> tuple:
        """(unit, item within it) where micro-batch ``global_batch`` starts."""
        k = int(global_batch) - self.base_global
        if k < 0:
            raise DataError(f"micro-batch {global_batch} lies before the resumed position {self.base_global}")
        unit, item = divmod(self.base_item + k * self.micro_batch_size, self.units.micro_batch_size)
        return self.base_unit + unit, item

    def pieces(self, global_batch: int) -> List[tuple]:
        unit, item = self.position(global_batch)
        size, left, out = self.units.micro_batch_size, self.micro_batch_size, []
        while left:
            epoch, lane, start = self.units.locate(unit)
            take = min(size - item, left)
            out.append((epoch, lane, start + item, start + item + take))
            unit, item, left = unit + 1, 0, left - take
        return out

    def locate(self, global_batch: int) -> tuple:
        return self.pieces(global_batch)[0][:3]

    def epoch_end(self, epoch: int, lane: int) -> int:
        return self.units.epoch_end(epoch, lane)

    def recut(self, first: int, micro_batch_size: int) -> "RecutCursor":
        unit, item = self.position(first)
        return RecutCursor(self.units, micro_batch_size, base_global=first, base_unit=unit, base_item=item)


class _Shard:
    """One opened shard of this rank: its datasets, rows and chunk rows (the read block)."""

    def __init__(self, path, entry, source):
        self.path = path
        self.handle = h5io.open_h5(path, **CHUNK_CACHE)
        try:
            with h5io.read_errors(path):
                layout = read_layout(self.handle, path)
                source._check_shard(self, layout, entry)
                self.datasets = {name: self.handle[name] for name in layout.names}
                chunks = self.handle["input_ids"].chunks
                self.block_rows = int(chunks[0]) if chunks else 1024
                self.num_items = layout.num_items
        except BaseException:
            self.handle.close()
            raise

    def close(self):
        """Drop the dataset objects, then close the file: h5py's ``close`` looks through every open
        HDF5 object for the file's own, so closing n shards whose datasets are still open takes
        time quadratic in n (2.8 s of CPU for 256 shards; 0.25 s this way)."""
        self.datasets = {}
        self.handle.close()

    def read(self, start, stop):
        with h5io.read_errors(self.path):
            raw = {name: dataset[start:stop] for name, dataset in self.datasets.items()}
        if "next_sentence_labels" in raw:
            raw["next_sentence_labels"] = raw["next_sentence_labels"].reshape(-1)
        return raw


class ShardedSource(RankStream):
    """Packed micro-batches [micro_batch_size, ...] of one rank from a directory of shards (see
    the module docstring for the stream). Shapes follow the configuration as in ``HDF5Source``
    (narrower shards zero-padded, wider ones refused naming the option to raise).

    ``lanes``: L, 1..number of shards (default: ``default_lanes``); the world size must
    divide it, and the stream depends on it (not on the world size). Fewer lanes mean fewer
    windows held per rank. ``window_blocks``: blocks per window and lane (default
    max(1, 16 // L)). ``prefetch``: read the next window in a background thread.
    """

    packing = None  # packed beforehand (or served unpacked); no plan of this run

    def __init__(self, directory, *, micro_batch_size, max_sequence_length, max_sequences_per_pack,
                 max_masked_tokens_per_pack, seed, rank=0, world_size=1, shuffle=True, lanes=None,
                 window_blocks=None, prefetch=True, vocab_size=None, type_vocab_size=2):
        self.directory = os.fspath(directory)
        self.micro_batch_size = int(micro_batch_size)
        self.dims = (int(max_sequence_length), int(max_sequences_per_pack), int(max_masked_tokens_per_pack))
        self.seed, self.rank, self.world_size = int(seed or 0), int(rank), int(world_size)
        self.shuffle, self.vocab_size, self.type_vocab_size = bool(shuffle), vocab_size, type_vocab_size
        if not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}")
        self.manifest = manifest = load_manifest(self.directory)
        self.packed = manifest["kind"] == "packed"
        self._check_dataset(manifest, lanes)
        self.window_blocks = int(window_blocks or max(1, (WINDOW_PACKS // 1024) // self.lanes))
        paths, entries = shard_paths(self.directory, manifest), manifest["shards"]
        self.lane_shards = [list(range(lane, len(paths), self.lanes)) for lane in range(self.lanes)]
        self.lane_items = [sum(int(entries[i]["num_items"]) for i in shards) for shards in self.lane_shards]
        self.own_lanes = [lane for lane in range(self.lanes) if lane % self.world_size == self.rank]
        if min(self.lane_items) < self.micro_batch_size:
            raise DataError(f"{self.directory}: its smallest lane holds {min(self.lane_items)} items, fewer than one "
                            f"micro-batch of {self.micro_batch_size}; use a smaller micro-batch or more data")
        if self.rank == 0 and len(paths) % self.lanes:
            print(f"warning: {uneven_lanes_message(self.directory, self.lane_shards, self.lane_items, self.micro_batch_size)}",
                  file=sys.stderr, flush=True)
        self.packing_factor = float(manifest.get("num_sequences", manifest["num_items"])) / max(1, manifest["num_items"])
        if not self.packed:
            self.packing_factor = 1.0
        self.identity = dataset_identity(manifest)
        self._shards: Dict[int, _Shard] = {}
        try:
            for lane in self.own_lanes:
                for index in self.lane_shards[lane]:
                    self._shards[index] = _Shard(paths[index], entries[index], self)
        except BaseException:
            self.close()
            raise
        self._cursor = LaneCursor(self.lane_items, self.micro_batch_size)
        self._next_global_batch = self.rank
        self._windows: Dict[int, Dict[tuple, Any]] = {lane: {} for lane in self.own_lanes}  # lane -> key -> window
        self._orders: Dict[tuple, Any] = {}  # (epoch, lane) -> block order
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch") if prefetch else None

    # -- checks -------------------------------------------------------------------------

    def _check_dataset(self, manifest, lanes):
        where, num_shards = self.directory, len(manifest["shards"])
        self.lanes = int(lanes or default_lanes(num_shards))
        if not 1 <= self.lanes <= num_shards:
            raise DataError(f"{where}: {self.lanes} lanes for {num_shards} shards; lanes must be 1..{num_shards}")
        if self.lanes % self.world_size:
            raise DataError(f"{where}: {num_shards} shards ({self.lanes} lanes) cannot be split evenly over "
                            f"{self.world_size} ranks, each reading its own shards; re-shard with --output-shards "
                            f"a multiple of {self.world_size}")
        seq_len = int(manifest["max_sequence_length"])
        depth = int(manifest.get("max_sequences_per_pack", 1)) if self.packed else 1
        slots = int(manifest["max_masked_tokens_per_pack"] if self.packed else manifest["max_predictions_per_seq"])
        check_dims(where, (seq_len, depth, slots), *self.dims)

    def _check_shard(self, shard, layout, entry):
        """A shard must be what the manifest says: its kind, rows and S; its K/M within the config."""
        path, manifest = shard.path, self.manifest
        if layout.packed != self.packed:
            raise DataError(f"{path}: an {'un' if self.packed else ''}packed shard in a dataset the manifest calls "
                            f"{manifest['kind']}; re-create the dataset")
        if layout.num_items != int(entry["num_items"]):
            raise DataError(f"{path}: {layout.num_items} rows, the manifest records {entry['num_items']}; the shard "
                            f"does not match the manifest: re-create the dataset")
        if layout.num_items == 0:
            raise DataError(f"{path}: shard holds no rows; re-create the dataset")
        if layout.dims[0] != int(manifest["max_sequence_length"]):
            raise DataError(f"{path}: sequence length {layout.dims[0]} differs from the dataset's "
                            f"{manifest['max_sequence_length']}; shards of one dataset share it")
        check_dims(path, layout.dims, *self.dims)
        check_vocab(path, shard.handle.attrs.get("vocab_size"), self.vocab_size)

    # -- the lane orders and windows ----------------------------------------------------

    def _order(self, epoch, lane):
        """The block sequence of ``lane`` in ``epoch``: (shard index, first row, stop row) per block
        and the rows before each block (cumulative)."""
        key = (epoch, lane)
        with self._lock:
            if key in self._orders:
                return self._orders[key]
        rng = np.random.default_rng([self.seed, epoch, lane, 0x5A4D]) if self.shuffle else None
        shards = list(self.lane_shards[lane])
        if rng is not None:
            shards = [shards[i] for i in rng.permutation(len(shards))]
        blocks = []
        for index in shards:
            shard = self._shards[index]
            starts = np.arange(0, shard.num_items, shard.block_rows)
            if rng is not None:
                starts = starts[rng.permutation(len(starts))]
            blocks.extend((index, int(s), int(min(s + shard.block_rows, shard.num_items))) for s in starts)
        offsets = np.concatenate([[0], np.cumsum([stop - start for _, start, stop in blocks])])
        with self._lock:
            self._orders = {k: v for k, v in self._orders.items() if k[0] >= epoch - 1}  # this and the last epoch
            self._orders[key] = (blocks, offsets)
        return blocks, offsets

    def _window_of(self, epoch, lane, item):
        blocks, offsets = self._order(epoch, lane)
        return int(np.searchsorted(offsets, item, side="right") - 1) // self.window_blocks

    def _load_window(self, epoch, lane, k):
        """Window k of ``lane`` in ``epoch``: its rows in the window's order (file dtypes), range
        checked block by block as read. A pure function of (seed, epoch, lane, k)."""
        blocks, offsets = self._order(epoch, lane)
        first, last = k * self.window_blocks, min(len(blocks), (k + 1) * self.window_blocks)
        parts = []
        for index, start, stop in blocks[first:last]:
            shard = self._shards[index]
            raw = shard.read(start, stop)
            check_rows(raw, np.arange(start, stop), shard.path, packed=self.packed, vocab_size=self.vocab_size,
                       type_vocab_size=self.type_vocab_size, max_sequence_length=self.dims[0],
                       max_sequences_per_pack=self.dims[1], max_masked_tokens_per_pack=self.dims[2])
            # Shards may each have their own masked-slot width: every block gets the dataset's layout.
            parts.append(h5io.pad_fields(raw, packed=self.packed, max_sequence_length=self.dims[0],
                                         max_sequences_per_pack=self.dims[1], max_masked_tokens_per_pack=self.dims[2]))
        size = int(offsets[last] - offsets[first])
        arrays = {name: _concatenate([part[name] for part in parts]) for name in parts[0]}
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, lane, k, 0x5A4E]).permutation(size)
            arrays = {name: array[order] for name, array in arrays.items()}
        return int(offsets[first]), int(offsets[last]), arrays

    def _next_key(self, epoch, lane, k):
        """The window that lane ``lane`` serves after window k of ``epoch``."""
        blocks, offsets = self._order(epoch, lane)
        following = (k + 1) * self.window_blocks
        if following < len(blocks) and offsets[following] < self._cursor.epoch_end(epoch, lane):
            return epoch, k + 1
        return epoch + 1, 0

    def _window(self, epoch, lane, k):
        """Window (epoch, lane, k), from the prefetch when it was asked for; asks for the next
        one and forgets the lane's earlier ones (at most two windows per lane)."""
        held = self._windows[lane]
        key = (epoch, k)
        if key not in held:
            held[key] = self._submit(epoch, lane, k)
        for old in [old for old in held if old < key]:
            del held[old]
        following = self._next_key(epoch, lane, k)
        if following not in held:
            held[following] = self._submit(following[0], lane, following[1])
        window = held[key]
        return window.result() if hasattr(window, "result") else window

    def _submit(self, epoch, lane, k):
        if self._pool is None:
            return _Ready(self._load_window(epoch, lane, k))
        return self._pool.submit(self._load_window, epoch, lane, k)

    # -- the stream ---------------------------------------------------------------------

    def batch(self, global_batch):
        """Global micro-batch ``global_batch`` (it must come from one of this rank's lanes)."""
        pieces = []
        for epoch, lane, start, stop in self._cursor.pieces(global_batch):
            if lane not in self._windows:
                raise DataError(f"micro-batch {global_batch} comes from lane {lane}, not one of rank {self.rank}'s")
            position = start
            while position < stop:
                first, end, arrays = self._window(epoch, lane, self._window_of(epoch, lane, position))
                upto = min(stop, end)
                pieces.append({name: array[position - first:upto - first] for name, array in arrays.items()})
                position = upto
        raw = pieces[0] if len(pieces) == 1 else {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
        return to_batch(raw, packed=self.packed, max_sequence_length=self.dims[0],
                        max_sequences_per_pack=self.dims[1], max_masked_tokens_per_pack=self.dims[2])

    def held_rows(self):
        """Rows this source holds in windows now, per lane (finished and in-flight ones)."""
        out = {}
        for lane, held in self._windows.items():
            out[lane] = sum(w.result()[1] - w.result()[0] for w in held.values())
        return out

    def state_dict(self):
        return {"next_global_batch": int(self._next_global_batch), "seed": self.seed, "world_size": self.world_size,
                "micro_batch_size": self.micro_batch_size, "lanes": self.lanes, "epoch": self.epoch,
                "dataset": dict(self.identity), "cursor": self._cursor.state_dict()}

    def load_state_dict(self, state, force=False):
        """Continue exactly after the checkpoint's last micro-batch; with another micro-batch
        size the packs continue in the same order, re-cut (``RecutCursor``; one process, or one
        lane). A checkpoint of another dataset
        (or lane count) is refused unless ``force`` (then a new epoch starts here)."""
        next_global = int(state["next_global_batch"])
        if next_global % self.world_size != self.rank:
            raise DataError(f"the data state (next micro-batch {next_global}) belongs to another rank than "
                            f"{self.rank} of {self.world_size}; resume with the same number of processes")
        first = next_global - self.rank  # the step's first micro-batch (rank 0's): where the stream stands
        saved = state.get("dataset")
        same = saved == self.identity and int(state.get("lanes", self.lanes)) == self.lanes
        if not same:
            if not force:
                raise DataError(self._changed_message(saved, state))
            self._reset(next_global, LaneCursor(self.lane_items, self.micro_batch_size,
                                                {"base_global": first, "base_epoch": int(state.get("epoch", 0)) + 1}))
            return
        old_size = int(state.get("micro_batch_size", self.micro_batch_size))
        saved_cursor = state.get("cursor") or {}
        if saved_cursor.get("recut"):
            cursor = RecutCursor.from_state(self.lane_items, saved_cursor)
        else:
            cursor = LaneCursor(self.lane_items, old_size, saved_cursor)
        if old_size != self.micro_batch_size:
            if self.world_size > 1:
                raise DataError(f"{self.directory}: a resume with micro-batch size {self.micro_batch_size} where the "
                                f"checkpoint used {old_size} cannot keep the order of the packs on {self.world_size} "
                                f"processes (each reads its own shards, a micro-batch of another size would join "
                                f"several processes' lanes); resume with train.micro_batch_size={old_size}, or on "
                                f"one process")
            cursor = cursor.recut(first, self.micro_batch_size)
        self._reset(next_global, cursor)

    def _changed_message(self, saved, state):
        saved = saved or {}
        return (f"{self.directory}: the checkpoint was taken on data of {saved.get('num_shards')} shards, "
                f"{saved.get('num_items')} items ({state.get('lanes')} lanes), this dataset has "
                f"{self.identity['num_shards']} shards, {self.identity['num_items']} items ({self.lanes} lanes)"
                f"{' whose shards differ in content (checksums)' if saved.get('num_items') == self.identity['num_items'] else ''}; "
                "resume with the same dataset (or --resume-force to start a new epoch of this one there)")

    def _reset(self, next_global, cursor):
        self._drain()
        self._cursor, self._next_global_batch = cursor, next_global
        self._windows = {lane: {} for lane in self.own_lanes}

    @property
    def epoch(self):
        return self._cursor.locate(self._next_global_batch)[0]

    def _drain(self):
        for held in getattr(self, "_windows", {}).values():
            for window in held.values():
                if hasattr(window, "cancel"):
                    window.cancel()

    def close(self):
        """Stop the prefetch thread (waiting for a read in flight) and close the shards."""
        self._drain()
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)
        for shard in getattr(self, "_shards", {}).values():
            shard.close()
        self._shards = {}

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to stop
            pass


class _Ready:
    """A window read without the thread, shaped like a finished future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _concatenate(arrays):
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
