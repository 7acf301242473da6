"""Benchmark: `pack` of a sharded dataset with 1 and 2 workers: throughput and peak memory.

    python benchmarks/data_pack_scale.py [--shards 8] [--sequences-per-shard 250000] \
        [--workers 1 2] [--algorithm lp] [--input DIR] [--workdir DIR] [--keep]

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
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_dataset(folder, shards, per_shard):
    """Synthetic unpacked shards plus the manifest (what sharded `create` writes)."""
    from bert_packed.data.shards import shard_entry, shard_name, write_manifest
    from bert_packed.data.synthetic import write_synthetic_unpacked

    os.makedirs(folder, exist_ok=True)
    entries = []
    for i in range(shards):
        path = os.path.join(folder, shard_name(i))
        write_synthetic_unpacked(path, per_shard, max_seq_length=128, max_predictions=20, seed=100 + i)
        entries.append(shard_entry(path))
    write_manifest(folder, kind="unpacked", shards=entries, options={"synthetic": True})


def measure(command, interval=0.02):
    """(seconds, peak summed RSS MiB, peak single-process RSS MiB, stdout, CPU seconds) of ``command``
    and its descendants (CPU: user + system, from getrusage(RUSAGE_CHILDREN))."""
    import resource

    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = psutil.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_sum = peak_one = 0
    while process.poll() is None:
        try:
            family = [process] + process.children(recursive=True)
        except psutil.Error:
            family = [process]
        sizes = []
        for member in family:
            try:
                sizes.append(member.memory_info().rss)
            except psutil.Error:
                pass
        if sizes:
            peak_sum, peak_one = max(peak_sum, sum(sizes)), max(peak_one, max(sizes))
        time.sleep(interval)
    out, err = process.communicate()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode != 0:
        sys.exit(f"pack failed ({process.returncode}): {err.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, peak_sum / 2**20, peak_one / 2**20, out.strip(), cpu


def digest(folder):
    hasher = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        hasher.update(name.encode())
        with open(os.path.join(folder, name), "rb") as handle:
            hasher.update(handle.read())
    return hasher.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--sequences-per-shard", type=int, default=250_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--algorithm", default="lp")
    parser.add_argument("--max-sequences-per-pack", type=int, default=3)
    parser.add_argument("--input", default=None, help="pack this unpacked dataset instead of synthetic shards")
    parser.add_argument("--workdir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()

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
    print("| workers | seconds | sequences/s | CPU s | sequences per CPU s | peak RSS, all processes (MiB) | "
          "largest process (MiB) | packs | efficiency % | gap to LP bound % | sharding gap % | "
          "gap to the shards' bounds % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
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
        print(f"| {workers} | {seconds:.1f} | {num_sequences / seconds:,.0f} | {cpu:.1f} | {num_sequences / cpu:,.0f} | "
            f"{peak_sum:.0f} | {peak_one:.0f} | "
            f"{manifest['num_packs']} | {100 * manifest['efficiency']:.3f} | {manifest['gap_percent']:.4f} | "
            f"{manifest['sharding_gap_percent']:.4f} | {manifest['gap_to_shards_bound_percent']:.4f} |", flush=True)
    print(f"\noutputs byte-identical across worker counts: {len(digests) == 1}")
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
