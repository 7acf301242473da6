"""Benchmark: packs/s per rank of the training readers at S=512 on the same packed data.

    python benchmarks/data_reader.py [--packs 262144] [--shards 8] [--micro-batch 32] [--seconds 20]

Writes N synthetic packs (S=512, K=3; a small file from `create`'s synthetic generator packed
with `pack`, tiled to N packs with fresh random tokens so gzip sees realistic entropy) twice:
as one HDF5 file and as a directory of `--shards` shards with a manifest. Then reads
micro-batches for up to `--seconds` each (or one epoch, whichever ends first) with

- (a) `HDF5Source` reading random rows (``max_cache_bytes=0`` forces that path, as for a file
  over its 1 GiB cache), with h5py's default 1 MiB chunk cache (before) and with
  `hdf5.CHUNK_CACHE` (after);
- (b) `ShardedSource` as rank 0 of 1 (it reads all shards) and of `--shards` ranks (one lane).

Prints a markdown table (packs/s per rank; the time includes range checks, padding and the
conversion to int64 tensors' dtypes, i.e. all the reader does for the training loop).
Measure on a quiet machine: one process, OMP_NUM_THREADS=1.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)

from benchmarks.common import markdown_header, markdown_row  # noqa: E402

DIMS = dict(max_sequence_length=512, max_sequences_per_pack=3, max_masked_tokens_per_pack=78)


def template(workdir, vocab_size):
    """A few thousand valid packs at S=512 (create's synthetic sequences, packed)."""
    from bert_packed.data.prepare.pack import pack_file
    from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

    unpacked, packed = os.path.join(workdir, "template-unpacked.h5"), os.path.join(workdir, "template.h5")
    write_synthetic_unpacked(unpacked, 8192, max_seq_length=512, max_predictions=76, vocab_size=vocab_size, seed=0)
    pack_file(unpacked, packed, algorithm="lpfhp", max_sequences_per_pack=3, seed=0, show_progress=False)
    import h5py

    with h5py.File(packed, "r") as handle:
        return {name: handle[name][:] for name in handle}, int(handle.attrs["num_sequences"])


def write_data(workdir, num_packs, num_shards, vocab_size=30522):
    """The single file and the shard directory, holding the same N packs."""
    from bert_packed.data import h5io
    from bert_packed.data.shards import shard_entry, shard_name, write_manifest

    fields, sequences = template(workdir, vocab_size)
    rows = len(fields["input_ids"])
    rng = np.random.default_rng(0)
    single, directory = os.path.join(workdir, "packed.h5"), os.path.join(workdir, "shards")
    os.makedirs(directory, exist_ok=True)
    bounds = np.linspace(0, num_packs, num_shards + 1).astype(int)
    paths = [single] + [os.path.join(directory, shard_name(i)) for i in range(num_shards)]
    sizes = [num_packs] + list(np.diff(bounds))
    handles = [h5io.atomic_h5(path) for path in paths]
    files = [context.__enter__() for context in handles]
    datasets = [{name: h5io.create_dataset(f, name, shape=(size,) + array.shape[1:], dtype=array.dtype)
                 for name, array in fields.items()} for f, size in zip(files, sizes)]
    total_sequences = 0
    for start in range(0, num_packs, rows):
        stop = min(num_packs, start + rows)
        block = {name: array[:stop - start].copy() for name, array in fields.items()}
        ordinary = block["input_ids"] >= 5  # fresh tokens, [CLS]/[SEP]/padding kept
        block["input_ids"][ordinary] = rng.integers(5, vocab_size, size=int(ordinary.sum()))
        total_sequences += int((block["nsp_weights"] != 0).sum())
        for name, array in block.items():
            datasets[0][name][start:stop] = array
            for shard in range(num_shards):  # the part of this block in each shard
                lo, hi = max(start, bounds[shard]), min(stop, bounds[shard + 1])
                if lo < hi:
                    datasets[shard + 1][name][lo - bounds[shard]:hi - bounds[shard]] = array[lo - start:hi - start]
    files[0].attrs.update({"num_sequences": total_sequences, "vocab_size": vocab_size})
    for context in handles:
        context.__exit__(None, None, None)
    write_manifest(directory, kind="packed", shards=[shard_entry(p) for p in paths[1:]])
    return single, directory


def rate(make, seconds, micro_batch_size):
    """Packs/s of one source over up to ``seconds`` (the first micro-batch included)."""
    source = make()
    per_epoch = getattr(source, "num_batches_per_epoch", None) or (
        len(source.lane_items) * (min(source.lane_items) // micro_batch_size) // source.world_size)
    iterator, count = iter(source), 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and count < per_epoch:
        next(iterator)
        count += 1
    elapsed = time.perf_counter() - start
    source.close()
    return count * micro_batch_size / elapsed, count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--packs", type=int, default=262144)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workdir", default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args(argv)
    from bert_packed.data.hdf5 import HDF5Source
    from bert_packed.data.sharded import ShardedSource

    workdir = args.workdir or tempfile.mkdtemp(prefix="reader-bench-")
    start = time.perf_counter()
    single, directory = write_data(workdir, args.packs, args.shards)
    print(f"wrote {args.packs} packs twice in {time.perf_counter() - start:.0f} s "
          f"({os.path.getsize(single) / 2**20:.0f} MiB compressed)", file=sys.stderr)
    common = dict(DIMS, micro_batch_size=args.micro_batch, seed=1, vocab_size=30522)
    cases = [("HDF5Source, random rows, h5py's 1 MiB chunk cache (before)",
              lambda: HDF5Source(single, max_cache_bytes=0, chunk_cache={}, **common)),
             ("HDF5Source, random rows, CHUNK_CACHE (after)", lambda: HDF5Source(single, max_cache_bytes=0, **common)),
             ("ShardedSource, rank 0 of 1", lambda: ShardedSource(directory, **common)),
             (f"ShardedSource, rank 0 of {args.shards}",
              lambda: ShardedSource(directory, rank=0, world_size=args.shards, **common))]
    print(f"\n{args.packs} packs, S=512, micro-batch {args.micro_batch}, up to {args.seconds:g} s each\n")
    print(markdown_header(["reader", "packs/s per rank", "micro-batches timed"], align="lrr"))
    for name, make in cases:
        packs_per_second, count = rate(make, args.seconds, args.micro_batch)
        print(markdown_row([name, f"{packs_per_second:,.0f}", count]), flush=True)


if __name__ == "__main__":
    main()
