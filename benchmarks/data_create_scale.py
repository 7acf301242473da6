"""How `create` scales with the corpus: wall time, MB/s and peak memory of all its processes.

    python benchmarks/data_create_scale.py --copies 1 4 16 --workers 1 2 [--single-file]

The corpus is the King James Bible (Debian bible-kjv, ~4.3 MB) concatenated N times (each copy's
chapters are new documents). Each run is `python -m bert_packed.data create` in a subprocess;
memory is the peak of the summed RSS of that process and all its descendants (the Dask
workers), sampled every 0.1 s with psutil (shared pages count once per process, so the sum is an
upper bound). ``--single-file`` adds today's one-file `create` (`--output x.h5`) as the
baseline whose memory grows with the corpus. Prints a markdown table.

Run it on a quiet machine: the timings are only as good as the cores are free.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_measured(argv, env=None, interval=0.1):
    """(wall seconds, peak summed RSS bytes, stdout, CPU seconds) of a subprocess and its descendants
    (CPU: user + system of every waited-for descendant, from getrusage(RUSAGE_CHILDREN))."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    watched = psutil.Process(process.pid)
    peak = 0
    while process.poll() is None:
        total = 0
        try:
            for member in [watched] + watched.children(recursive=True):
                try:
                    total += member.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(interval)
    out, err = process.communicate()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if process.returncode:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(argv)}\n{err[-2000:]}")
    return wall, peak, out, cpu


def digest(output):
    """sha256 over the shard files and manifest in name order (equal digests: identical bytes)."""
    import hashlib

    hasher = hashlib.sha256()
    names = sorted(os.listdir(output)) if os.path.isdir(output) else [""]
    for name in names:
        with open(os.path.join(output, name) if name else output, "rb") as handle:
            hasher.update(handle.read())
    return hasher.hexdigest()[:12]


def prepare(folder, corpus, vocab_size, vocab=None):
    """The KJV corpus (or ``corpus``) and a vocabulary trained on it (or ``vocab``: `tokenizers`'
    trainer can differ in a few tokens from run to run, so runs to compare share one file)."""
    if corpus is None:
        corpus = os.path.join(folder, "kjv.txt")
        subprocess.run([sys.executable, "-m", "bert_packed.data", "kjv", "--output", corpus], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    if vocab is not None:
        return corpus, os.path.abspath(vocab)
    vocab = os.path.join(folder, "vocab.txt")
    subprocess.run([sys.executable, "-m", "bert_packed.data", "vocab", "--input", corpus, "--size", str(vocab_size),
                    "--output", vocab], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return corpus, vocab


def concatenated(folder, corpus, copies):
    path = os.path.join(folder, f"corpus-x{copies}.txt")
    with open(corpus, "rb") as source:
        text = source.read().rstrip(b"\n") + b"\n\n"
    with open(path, "wb") as out:
        for _ in range(copies):
            out.write(text)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--corpus", default=None, help="corpus to concatenate (default: the KJV)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--vocab", default=None, help="use this vocab.txt instead of training one")
    parser.add_argument("--dupe-factor", type=int, default=5)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--output-shards", type=int, default=None, help="default: create's (one per ~4 MiB)")
    parser.add_argument("--block-bytes", type=int, default=None, help="default: create's (8 MiB tokenising blocks)")
    parser.add_argument("--single-file", action="store_true", help="also time today's one-file create (.h5)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (its path is printed)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="create-scale-")
    corpus, vocab = prepare(folder, args.corpus, args.vocab_size, args.vocab)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    print(f"| copies | input MB | output | workers | wall s | MB/s | CPU s | MB per CPU s | peak RSS MiB (all processes) "
          f"| sequences | sha256 of the shards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for copies in args.copies:
        path = concatenated(folder, corpus, copies)
        megabytes = os.path.getsize(path) / 1e6
        runs = [("shards", w) for w in args.workers] + ([("one .h5", 1)] if args.single_file else [])
        for mode, workers in runs:
            output = os.path.join(folder, f"out-{copies}-{workers}" + (".h5" if mode == "one .h5" else ""))
            argv = [sys.executable, "-m", "bert_packed.data", "create", "--input", path, "--vocab", vocab,
                    "--output", output, "--max-seq-length", str(args.max_seq_length),
                    "--max-predictions", str(args.max_predictions),
                    "--dupe-factor", str(args.dupe_factor), "--seed", "12345"]
            if mode == "shards":
                argv += ["--workers", str(workers), "--no-progress"]
                if args.output_shards:
                    argv += ["--output-shards", str(args.output_shards)]
                if args.block_bytes:
                    argv += ["--block-bytes", str(args.block_bytes)]
            wall, peak, out, cpu = run_measured(argv, env=env)
            sequences = out.split(": ", 1)[1].split(" sequences")[0] if ": " in out else "?"
            print(f"| {copies} | {megabytes:.1f} | {mode} | {workers} | {wall:.1f} | {megabytes / wall:.2f} | {cpu:.1f} | "
                  f"{megabytes / cpu:.3f} | {peak / 2**20:.0f} | {sequences} | {digest(output)} |", flush=True)
            if mode == "shards":
                with open(os.path.join(output, "manifest.json")) as handle:
                    assert json.load(handle)["num_sequences"] == int(sequences)
                shutil.rmtree(output)
            else:
                os.unlink(output)
    if args.keep:
        print(f"work folder: {folder}", file=sys.stderr)
    else:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
