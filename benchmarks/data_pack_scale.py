"""Benchmark: `pack` of a sharded dataset with 1 and 2 workers: throughput and peak memory.

    python benchmarks/data_pack_scale.py [--shards 8] [--sequences-per-shard 250000] \
        [--workers 1 2] [--algorithm lp] [--input DIR] [--workdir DIR] [--keep]
    python benchmarks/data_pack_scale.py --dry-run   # 2 shards of 500 sequences, 1 worker (seconds)

Writes a synthetic unpacked sharded dataset (NVIDIA layout, S=128, lengths from the Wikipedia
histogram scaled to 128, one manifest.json), then runs `python -m bert_packed.data pack
--input DIR --output DIR/packed-wN --workers N` once per worker count in a child process, and
samples the resident memory of that process and all its descendants (psutil, recursive, every
20 ms: Dask's worker processes included) for the peak of their sum and of the largest one.
Prints a markdown table, a row as each run ends: wall time, sequences/s, peak RSS, packs, efficiency, the gap to the
global LP bound, the sharding gap and the gap to the sum of the shards' own bounds (from the
output manifest), and whether every worker count wrote the same bytes. Run it on a quiet machine: the timings are what it is for.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import markdown_header, markdown_row, run_measured  # noqa: E402

HEADER = ["workers", "seconds", "sequences/s", "CPU s", "sequences per CPU s", "peak RSS, all processes (MiB)",
          "largest process (MiB)", "packs", "efficiency %", "gap to LP bound %", "sharding gap %",
          "gap to the shards' bounds %"]


def make_dataset(folder, shards, per_shard):
    """Synthetic unpacked shards plus the manifest (what sharded `create` writes)."""
    from bert_packed.data.shards import shard_entry, shard_name, write_manifest
    from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

    os.makedirs(folder, exist_ok=True)
    entries = []
    for i in range(shards):
        path = os.path.join(folder, shard_name(i))
        write_synthetic_unpacked(path, per_shard, max_seq_length=128, max_predictions=20, seed=100 + i)
        entries.append(shard_entry(path))
    write_manifest(folder, kind="unpacked", shards=entries, options={"synthetic": True})


def measure(command, interval=0.02):
    """(seconds, peak summed RSS MiB, peak single-process RSS MiB, stdout, CPU seconds) of ``command``
    and its descendants (benchmarks.common.run_measured); exits with the tail of stderr if it fails."""
    run = run_measured(command, interval=interval)
    if run.returncode != 0:
        sys.exit(f"pack failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return run.seconds, run.peak_rss / 2**20, run.peak_rss_one / 2**20, run.stdout.strip(), run.cpu_seconds


def digest(folder):
    hasher = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        hasher.update(name.encode())
        with open(os.path.join(folder, name), "rb") as handle:
            hasher.update(handle.read())
    return hasher.hexdigest()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--sequences-per-shard", type=int, default=250_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--algorithm", default="lp")
    parser.add_argument("--max-sequences-per-pack", type=int, default=3)
    parser.add_argument("--input", default=None, help="pack this unpacked dataset instead of synthetic shards")
    parser.add_argument("--workdir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--dry-run", action="store_true",
                        help="2 synthetic shards of 500 sequences (seconds: checks the plumbing, not the speed)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.shards, args.sequences_per_shard, args.workers = 2, 500, [1]

    workdir = args.workdir or tempfile.mkdtemp(prefix="pack-scale-")
    if args.input:
        source = args.input
        with open(os.path.join(source, "manifest.json"), encoding="utf-8") as handle:
            given = json.load(handle)
        num_sequences, args.shards = given["num_sequences"], given["num_shards"]
    else:
        source = os.path.join(workdir, "train")
        start = time.perf_counter()
        make_dataset(source, args.shards, args.sequences_per_shard)
        num_sequences = args.shards * args.sequences_per_shard
        print(f"generated {num_sequences} sequences in {args.shards} shards in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    digests = set()
    print(f"`pack` of {num_sequences:,} sequences in {args.shards} shards ({args.algorithm}, "
          f"K={args.max_sequences_per_pack})\n")
    print(markdown_header(HEADER), flush=True)
    for workers in args.workers:
        output = os.path.join(workdir, f"packed-w{workers}")
        command = [sys.executable, "-m", "bert_packed.data", "pack", "--input", source, "--output", output,
                   "--algorithm", args.algorithm, "--max-sequences-per-pack", str(args.max_sequences_per_pack),
                   "--workers", str(workers), "--no-progress"]
        seconds, peak_sum, peak_one, line, cpu = measure(command)
        print(line, file=sys.stderr)
        with open(os.path.join(output, "manifest.json"), encoding="utf-8") as handle:
            manifest = json.load(handle)
        digests.add(digest(output))
        print(markdown_row([workers, f"{seconds:.1f}", f"{num_sequences / seconds:,.0f}", f"{cpu:.1f}",
                            f"{num_sequences / cpu:,.0f}", f"{peak_sum:.0f}", f"{peak_one:.0f}", manifest["num_packs"],
                            f"{100 * manifest['efficiency']:.3f}", f"{manifest['gap_percent']:.4f}",
                            f"{manifest['sharding_gap_percent']:.4f}",
                            f"{manifest['gap_to_shards_bound_percent']:.4f}"]), flush=True)
    print(f"\noutputs byte-identical across worker counts: {len(digests) == 1}")
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
