"""`pack`: unpacked HDF5 (NVIDIA/MLPerf layout) -> packed HDF5 (the packed-batch fields of docs/design.md).

Memory stays bounded whatever the input size; only per-sequence scalars (lengths, masked
counts, the assignment: a few tens of bytes per sequence) live in RAM:

1. **Lengths** (pass 1, chunked): `input_mask` row sums and masked-slot counts.
2. **Plan and assignment** from `packing`: histogram -> plan (`--algorithm`) -> concrete
   packs (CSR: `pack_offsets`, `sequence_indices`), both seeded.
3. **Scatter** (pass 2, chunked): each input block is written, record by record, into a
   temporary file at the row its sequence has in *pack order* (the CSR order). The input
   is read once, sequentially, however the assignment shuffled the sequences.
4. **Write**: the temporary file is read sequentially, a chunk of packs at a time, and
   each chunk goes through the model's collator (`bert_packed.collate`) into the packed
   fields, written as row slices of the output datasets.

The output's attributes carry the packing statistics (the packing result's fields plus
`num_sequences`, `unpacked_efficiency`, `speedup`). Same input, options and seed: a
byte-identical file. Nothing is dropped or duplicated: `verify_packed_file` checks a
digest of every (tokens, labels) sequence before and after.
"""
import hashlib
import os

import numpy as np
from tqdm import tqdm

from bert_packed.data import h5io
from bert_packed.io.files import make_folder, make_temp
from bert_packed.limits import SEQUENCES_PER_PACK
from bert_packed.data.errors import DataError, refuse_output_over_input

PACKED_DTYPES = {"input_ids": np.int32, "segment_ids": np.int8, "position_ids": np.int32,
                 "sequence_ids": np.int8, "mlm_positions": np.int32, "mlm_labels": np.int32,
                 "mlm_sequence_ids": np.int8, "cls_positions": np.int32, "nsp_labels": np.int8,
                 "nsp_weights": np.float32}


def read_lengths(handle, max_sequence_length, *, read_rows=1 << 16, show_progress=False, path=""):
    """Pass 1: (lengths, num_masked) per sequence, int64, read in blocks of `read_rows`."""
    mask, positions = handle["input_mask"], handle["masked_lm_positions"]
    num_rows = mask.shape[0]
    lengths = np.empty(num_rows, np.int64)
    num_masked = np.empty(num_rows, np.int64)
    for start in tqdm(range(0, num_rows, read_rows), desc="pack: lengths", unit=" blocks",
                      disable=not show_progress):
        block = mask[start:start + read_rows] != 0
        lengths[start:start + len(block)] = block.sum(axis=1)
        # NVIDIA layout: unused masked slots hold position 0 ([CLS] is never masked).
        num_masked[start:start + len(block)] = (positions[start:start + read_rows] != 0).sum(axis=1)
    if num_rows == 0:
        raise DataError(f"{path}: the file holds no sequences; nothing to pack")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise DataError(f"{path}: sequence {empty[0]} is empty (input_mask all 0); "
                        "re-create the file")
    too_long = np.flatnonzero(lengths > max_sequence_length)
    if too_long.size:
        raise DataError(f"{path}: sequence {too_long[0]} has {lengths[too_long[0]]} tokens, longer "
                        f"than --max-sequence-length {max_sequence_length}; raise it")
    return lengths, num_masked


def plan_packs(lengths, max_sequence_length, algorithm, max_sequences_per_pack, seed):
    """Histogram -> plan -> assignment with `packing`; returns (PackingResult, Assignment)."""
    import packing

    try:
        histogram = packing.Histogram.from_lengths(lengths, max_sequence_length)
        result = packing.pack(histogram, algorithm=algorithm,
                              max_sequences_per_pack=max_sequences_per_pack, seed=seed)
        assignment = packing.assign(result.plan, lengths, seed=seed)
    except packing.PackingError as exc:
        raise DataError(str(exc)) from None
    return result, assignment


def _check_depth(max_sequences_per_pack) -> None:
    """Sequence ids are int8 in a packed file (PACKED_DTYPES): at most 127 sequences per pack,
    data.max_sequences_per_pack's maximum too (bert_packed.limits)."""
    limit = SEQUENCES_PER_PACK["le"]
    if max_sequences_per_pack is not None and max_sequences_per_pack > limit:
        raise DataError(f"--max-sequences-per-pack must be <= {limit} ({SEQUENCES_PER_PACK['why']}), got "
                        f"{max_sequences_per_pack}")


def _record_dtype(seq_len, num_predictions):
    """One unpacked sequence as a structured record (the file's fields and dtypes)."""
    return np.dtype([(name, dtype, shape[1:]) for name, (shape, dtype)
                     in h5io.unpacked_shapes(0, seq_len, num_predictions).items()])


def _scatter_to_pack_order(handle, destination, record_dtype, tmp_path, *, read_rows,
                           show_progress):
    """Pass 2: write every input row to row destination[i] of a flat temporary file."""
    num_rows = destination.size
    size = record_dtype.itemsize
    fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, num_rows * size)
        with tqdm(total=num_rows, desc="pack: scatter", unit=" seq", unit_scale=True,
                  disable=not show_progress) as bar:
            for start in range(0, num_rows, read_rows):
                stop = min(num_rows, start + read_rows)
                block = np.zeros(stop - start, record_dtype)
                for name in record_dtype.names:
                    data = handle[name][start:stop]
                    if name == "next_sentence_labels":
                        data = data.reshape(-1)
                    else:
                        data = data[:, :record_dtype[name].shape[0]]
                    block[name] = data
                rows = destination[start:stop]
                order = np.argsort(rows, kind="stable")
                rows, block = rows[order], block[order]
                raw = block.tobytes()
                # Runs of consecutive destinations go out in one write.
                breaks = np.flatnonzero(np.diff(rows) != 1) + 1
                for run_start, run_stop in zip(np.r_[0, breaks], np.r_[breaks, rows.size]):
                    os.pwrite(fd, raw[run_start * size:run_stop * size], int(rows[run_start]) * size)
                bar.update(stop - start)
    finally:
        os.close(fd)


def pack_file(input_path, output_path, *, algorithm="lpfhp", max_sequences_per_pack=3,
              max_sequence_length=None, max_masked_tokens_per_pack=None, seed=0,
              chunk_packs=8192, read_rows=1 << 16, compression="gzip", show_progress=True):
    """The whole `pack` step. Writes `output_path` atomically; returns the statistics dict."""
    if chunk_packs < 1 or read_rows < 1:
        raise DataError("--chunk-packs must be at least 1")
    _check_depth(max_sequences_per_pack)
    refuse_output_over_input(output_path, [input_path])
    with h5io.open_h5(input_path) as handle, h5io.read_errors(input_path):
        if h5io.is_packed(handle):
            raise DataError(f"{input_path}: this file is already packed; give the unpacked file")
        num_sequences, in_seq_len, num_predictions = h5io.check_unpacked(handle, input_path)
        seq_len = max_sequence_length or in_seq_len
        lengths, num_masked = read_lengths(handle, seq_len, read_rows=read_rows,
                                           show_progress=show_progress, path=input_path)
        result, assignment = plan_packs(lengths, seq_len, algorithm, max_sequences_per_pack, seed)
        offsets = np.asarray(assignment.pack_offsets, np.int64)
        indices = np.asarray(assignment.sequence_indices, np.int64)
        num_packs = offsets.size - 1
        depth = int(np.diff(offsets).max())
        max_k = max_sequences_per_pack or depth
        _check_depth(max_k)
        masked_per_pack = np.add.reduceat(num_masked[indices], offsets[:-1])
        needed_m = int(masked_per_pack.max())
        max_m = max_masked_tokens_per_pack or needed_m
        if needed_m > max_m:
            raise DataError(f"a pack needs {needed_m} masked-token slots but "
                            f"--max-masked-tokens-per-pack is {max_m}; raise it")
        destination = np.empty(num_sequences, np.int64)
        destination[indices] = np.arange(num_sequences)
        # Records keep the input's width, cut to the pack length when that is shorter (the
        # lengths were checked to fit); the collator pads to the pack length.
        record_dtype = _record_dtype(min(seq_len, in_seq_len), num_predictions)
        folder = os.path.dirname(os.path.abspath(output_path))
        make_folder(folder)
        fd, tmp_records = make_temp(folder, prefix=".tmp-pack-", suffix=".bin")
        os.close(fd)
        try:
            _scatter_to_pack_order(handle, destination, record_dtype, tmp_records,
                                   read_rows=read_rows, show_progress=show_progress)
            del destination
            stats = _statistics(result, lengths, num_packs, seq_len, max_k, max_m, seed,
                                algorithm, input_path)
            size = record_dtype.itemsize
            with open(tmp_records, "rb") as records:
                def read_records(r0, r1):
                    records.seek(r0 * size)
                    return np.frombuffer(records.read((r1 - r0) * size), record_dtype)

                write_packed(output_path, read_records, offsets, stats, chunk_packs=chunk_packs,
                             compression=compression, vocab_size=handle.attrs.get("vocab_size"),
                             show_progress=show_progress)
        finally:
            if os.path.exists(tmp_records):
                os.unlink(tmp_records)
    return stats


def write_packed(output_path, read_records, offsets, stats, *, chunk_packs, compression, vocab_size=None,
                 show_progress=False, digest=None):
    """Write a packed file atomically: the packs ``offsets`` (CSR over records in pack order),
    whose records ``read_records(r0, r1)`` returns (a structured array), a chunk of packs at a
    time through the model's collator; ``stats`` (S, K, M and the statistics) become attributes.
    Shared by `pack_file` (records from its scratch file) and sharded packing (from memory), so
    both write the same layout. With ``digest`` (a hashlib object; a shard, of bounded size) the
    file is built in memory (``h5io.atomic_h5_image``) and the digest updated with its bytes."""
    num_packs = offsets.size - 1
    seq_len, max_k = stats["max_sequence_length"], stats["max_sequences_per_pack"]
    max_m = stats["max_masked_tokens_per_pack"]
    writer = h5io.atomic_h5(output_path) if digest is None else h5io.atomic_h5_image(output_path, digest)
    with writer as out:
        datasets = {}
        widths = {"S": seq_len, "K": max_k, "M": max_m}
        for name, dim in h5io.PACKED_FIELDS.items():
            datasets[name] = h5io.create_dataset(
                out, name, shape=(num_packs, widths[dim]), dtype=PACKED_DTYPES[name],
                compression=compression)
        with tqdm(total=num_packs, desc="pack: write", unit=" packs", unit_scale=True,
                  disable=not show_progress) as bar:
            for p0 in range(0, num_packs, chunk_packs):
                p1 = min(num_packs, p0 + chunk_packs)
                r0, r1 = int(offsets[p0]), int(offsets[p1])
                block = read_records(r0, r1)
                samples = {name: block[name] for name in block.dtype.names}
                batch = h5io.collate_records(
                    samples, offsets[p0:p1 + 1] - r0, np.arange(r1 - r0),
                    max_sequence_length=seq_len, max_sequences_per_pack=max_k,
                    max_masked_tokens_per_pack=max_m)
                for name, dataset in datasets.items():
                    dataset[p0:p1] = batch[name]
                bar.update(p1 - p0)
        if vocab_size is not None:  # so training can say when the model's is smaller
            out.attrs["vocab_size"] = int(vocab_size)
        # Timings stay out of the file, so the same inputs give a byte-identical file.
        out.attrs.update({key: value for key, value in stats.items()
                          if value is not None and key != "planning_seconds"})


def _statistics(result, lengths, num_packs, seq_len, max_k, max_m, seed, algorithm, input_path):
    stats = dict(result.to_dict())
    stats["planning_seconds"] = stats.pop("seconds", None)
    num_tokens = int(lengths.sum())
    stats.update({
        "format": h5io.PACKED_FORMAT, "source": os.path.basename(os.fspath(input_path)),
        "algorithm": algorithm, "seed": seed, "num_sequences": int(lengths.size),
        "num_packs": int(num_packs), "num_tokens": num_tokens,
        "max_sequence_length": seq_len, "max_sequences_per_pack": max_k,
        "max_masked_tokens_per_pack": max_m,
        "efficiency": num_tokens / (num_packs * seq_len),
        "packing_factor": lengths.size / num_packs,
        "unpacked_efficiency": num_tokens / (lengths.size * seq_len),
        # Rows to process: unpacked / packed, i.e. the speed-up at a fixed cost per row.
        "speedup": lengths.size / num_packs})
    return {key: (value.item() if isinstance(value, np.generic) else value)
            for key, value in stats.items()
            if isinstance(value, (int, float, str, bool, np.generic)) or value is None}



# -- verification: every sequence survives packing exactly once ----------------------------

def _digest(tokens, segments, positions, labels, nsp):
    hasher = hashlib.blake2b(digest_size=16)
    for part in (tokens, segments, positions, labels, [nsp]):
        hasher.update(np.asarray(part, np.int64).tobytes())
        hasher.update(b"|")
    return hasher.digest()


def unpacked_digests(path, read_rows=1 << 14):
    """Sorted digests of every sequence of an unpacked file: (tokens, segment ids, masked
    positions, masked labels, next-sentence label)."""
    digests = []
    with h5io.open_h5(path) as handle:
        h5io.check_unpacked(handle, path)
        num = handle["input_ids"].shape[0]
        for start in range(0, num, read_rows):
            ids = handle["input_ids"][start:start + read_rows]
            mask = handle["input_mask"][start:start + read_rows] != 0
            seg = handle["segment_ids"][start:start + read_rows]
            pos = handle["masked_lm_positions"][start:start + read_rows]
            lab = handle["masked_lm_ids"][start:start + read_rows]
            nsp = handle["next_sentence_labels"][start:start + read_rows].reshape(-1)
            for row in range(len(ids)):
                length = int(mask[row].sum())
                used = pos[row] != 0
                digests.append(_digest(ids[row, :length], seg[row, :length], pos[row][used],
                                       lab[row][used], nsp[row]))
    return sorted(digests)


def packed_digests(path, read_rows=1 << 14):
    """Sorted digests of every sequence of a packed file, in the same form as
    `unpacked_digests` (masked positions made relative to the sequence's start)."""
    digests = []
    with h5io.open_h5(path) as handle:
        _, _, max_k, _ = h5io.check_packed(handle, path)
        num = handle["input_ids"].shape[0]
        for start in range(0, num, read_rows):
            rows = {name: handle[name][start:start + read_rows] for name in h5io.PACKED_FIELDS}
            for row in range(len(rows["input_ids"])):
                for k in range(1, max_k + 1):
                    if rows["nsp_weights"][row, k - 1] == 0:
                        continue
                    where = rows["sequence_ids"][row] == k
                    first = int(rows["cls_positions"][row, k - 1])
                    masked = rows["mlm_sequence_ids"][row] == k
                    digests.append(_digest(
                        rows["input_ids"][row][where], rows["segment_ids"][row][where],
                        rows["mlm_positions"][row][masked] - first,
                        rows["mlm_labels"][row][masked], rows["nsp_labels"][row, k - 1]))
    return sorted(digests)


def verify_packed_file(unpacked_path, packed_path):
    """Raise DataError unless the packed file holds exactly the unpacked file's sequences."""
    before, after = unpacked_digests(unpacked_path), packed_digests(packed_path)
    if before != after:
        raise DataError(f"{packed_path}: holds {len(after)} sequences, {unpacked_path} "
                        f"{len(before)}; the multisets of sequences differ")
    return len(before)
