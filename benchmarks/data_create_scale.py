"""How `create` scales with the corpus: wall time, MB/s and peak memory of all its processes.

    python benchmarks/data_create_scale.py --copies 1 4 16 --workers 1 2 [--single-file]
    python benchmarks/data_create_scale.py --dry-run     # 40 KB of the KJV, once (seconds: the plumbing)

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

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, markdown_header, markdown_row, run_measured  # noqa: E402

HEADER = ["copies", "input MB", "output", "workers", "wall s", "MB/s", "CPU s", "MB per CPU s",
          "peak RSS MiB (all processes)", "sequences", "sha256 of the shards"]


def digest(output):
    """sha256 over the shard files and manifest in name order (equal digests: identical bytes)."""
    import hashlib

    hasher = hashlib.sha256()
    names = sorted(os.listdir(output)) if os.path.isdir(output) else [""]
    for name in names:
        with open(os.path.join(output, name) if name else output, "rb") as handle:
            hasher.update(handle.read())
    return hasher.hexdigest()[:12]


def prepare(folder, corpus, vocab_size, vocab=None, head_bytes=None):
    """The KJV corpus (or ``corpus``; its first ``head_bytes``, cut at a blank line, when given) and a
    vocabulary trained on it (or ``vocab``: `tokenizers`' trainer can differ in a few tokens from run
    to run, so runs to compare share one file)."""
    if corpus is None:
        corpus = os.path.join(folder, "kjv.txt")
        subprocess.run([sys.executable, "-m", "bert_packed.data", "kjv", "--output", corpus], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    if head_bytes is not None:
        with open(corpus, "rb") as source:
            text = source.read(head_bytes)
        corpus = os.path.join(folder, "head.txt")
        with open(corpus, "wb") as out:
            out.write(text[:text.rfind(b"\n\n") + 1] if b"\n\n" in text else text)
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


def main(argv=None):
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
    parser.add_argument("--dry-run", action="store_true", help="the first 40 KB of the KJV, one copy, one worker, "
                        "a 300-token vocabulary, dupe factor 1 (seconds: checks the plumbing, not the speed)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.copies, args.workers, args.vocab_size, args.dupe_factor = [1], [1], 300, 1
    folder = tempfile.mkdtemp(prefix="create-scale-")
    corpus, vocab = prepare(folder, args.corpus, args.vocab_size, args.vocab, head_bytes=40_000 if args.dry_run else None)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    print(markdown_header(HEADER))
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
            run = run_measured(argv, env=env).check(argv)
            wall, peak, out, cpu = run.seconds, run.peak_rss, run.stdout, run.cpu_seconds
            sequences = out.split(": ", 1)[1].split(" sequences")[0] if ": " in out else "?"
            print(markdown_row([copies, f"{megabytes:.1f}", mode, workers, f"{wall:.1f}", f"{megabytes / wall:.2f}",
                                f"{cpu:.1f}", f"{megabytes / cpu:.3f}", f"{peak / 2**20:.0f}", sequences,
                                digest(output)]), flush=True)
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
