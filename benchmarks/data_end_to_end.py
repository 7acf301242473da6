"""The main job end to end at a size that exercises it: create -> pack -> train -> SIGKILL -> resume.

    python benchmarks/data_end_to_end.py --megabytes 1000 --steps 400 --kill-after 250
    python benchmarks/data_end_to_end.py --dry-run    # 0.05 MB, the tiny model, 6 steps, killed after 3

The corpus is the King James Bible (Debian bible-kjv, ~4.3 MB) written out N times until it
holds at least ``--megabytes`` MB, each copy with its chapters in another seeded order (so the
copies are new documents in new blocks). Then, each phase a subprocess of its own:

1. ``create`` with ``--workers`` workers into ``--output-shards`` unpacked shards;
2. ``pack`` with the same workers (``--algorithm lp``: the manifest's certificate gap);
3. ``run.py --config demo`` on the packed directory with the default ``data.lanes``, killed with
   SIGKILL once the metrics pass ``--kill-after`` (a checkpoint every ``--checkpoint-every``
   steps), then ``--resume`` to ``--steps``.

Prints one markdown table: wall time and CPU time per phase, the peak summed RSS of each phase's
process tree (Dask workers included; sampled every 0.1 s), the data wait share of the resumed
run (``summary.json``'s ``data_wait_fraction``) and the certificate gap. ``--check`` also trains
an uninterrupted run and compares its ``metrics.jsonl`` losses with the killed-and-resumed one.

Run it on a quiet machine: the timings are only as good as the cores are free.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: the project root first, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, markdown_table, run_measured  # noqa: E402


def run_phase(argv, env, kill_when=None, interval=0.1):
    """Run ``argv`` to its end (or SIGKILL it once ``kill_when()`` is true); (wall s, CPU s, peak RSS, rc, stdout)."""
    run = run_measured(argv, env=env, kill_when=kill_when, interval=interval, merge_stderr=True)
    return run.seconds, run.cpu_seconds, run.peak_rss, (-signal.SIGKILL if run.killed else run.returncode), run.stdout


def checked(result, argv):
    wall, cpu, peak, rc, out = result
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(argv)}\n{out[-3000:]}")
    return result


def write_corpus(folder, megabytes, seed=0, whole_copies=True):
    """KJV copies (chapters shuffled per copy, seeded) until the file holds ``megabytes`` MB (without
    ``whole_copies``: stops at the chapter that reaches it)."""
    kjv = os.path.join(folder, "kjv.txt")
    subprocess.run([sys.executable, "-m", "bert_packed.data", "kjv", "--output", kjv], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    with open(kjv, "rb") as handle:
        documents = [d for d in handle.read().split(b"\n\n") if d.strip()]
    path = os.path.join(folder, "corpus.txt")
    rng = random.Random(seed)
    written = 0
    with open(path, "wb") as out:
        while written < megabytes * 1e6:
            rng.shuffle(documents)
            for document in documents:
                out.write(document.strip(b"\n") + b"\n\n")
                written += len(document) + 2
                if not whole_copies and written >= megabytes * 1e6:
                    break
    return kjv, path


def last_step(metrics_path):
    try:
        with open(metrics_path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(metrics_path) - 4096))
            lines = handle.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def losses(metrics_path):
    with open(metrics_path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=1000, help="corpus size in MB (at least)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output-shards", type=int, default=256)
    parser.add_argument("--dupe-factor", type=int, default=1)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--algorithm", default="lp")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-after", type=int, default=250, help="SIGKILL the run once it logged this step")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--check", action="store_true", help="also train without a kill and compare the losses")
    parser.add_argument("--work", default=None, help="work folder (default: a new temporary one, removed at the end)")
    parser.add_argument("--dry-run", action="store_true", help="0.05 MB of corpus, 4 shards, 1 worker, the tiny "
                        "model for 6 steps killed after step 3 (seconds: checks the plumbing, not the speed)")
    args = parser.parse_args(argv)
    config = "demo"
    if args.dry_run:
        config = "tiny"
        args.megabytes, args.workers, args.output_shards, args.vocab_size = 0.05, 1, 4, 300
        args.steps, args.kill_after, args.checkpoint_every = 6, 3, 1
        args.max_seq_length, args.max_predictions = 64, 3
    folder = args.work or tempfile.mkdtemp(prefix="end-to-end-")
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    kjv, corpus = write_corpus(folder, args.megabytes, whole_copies=not args.dry_run)
    vocab = os.path.join(folder, "vocab.txt")
    vocab_input = corpus if args.dry_run else kjv
    subprocess.run([sys.executable, "-m", "bert_packed.data", "vocab", "--input", vocab_input, "--size", str(args.vocab_size),
                    "--output", vocab], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    unpacked, packed = os.path.join(folder, "train"), os.path.join(folder, "packed")
    rows = []
    argv = [sys.executable, "-m", "bert_packed.data", "create", "--input", corpus, "--vocab", vocab, "--output", unpacked,
            "--max-seq-length", str(args.max_seq_length), "--max-predictions", str(args.max_predictions),
            "--dupe-factor", str(args.dupe_factor), "--output-shards", str(args.output_shards),
            "--workers", str(args.workers), "--no-progress"]
    rows.append(("create", checked(run_phase(argv, env), argv)))
    argv = [sys.executable, "-m", "bert_packed.data", "pack", "--input", unpacked, "--output", packed,
            "--algorithm", args.algorithm, "--max-sequences-per-pack", "3", "--workers", str(args.workers),
            "--no-progress"]
    rows.append(("pack", checked(run_phase(argv, env), argv)))
    with open(os.path.join(packed, "manifest.json")) as handle:
        manifest = json.load(handle)
    run_dir = os.path.join(folder, "run")
    train = [sys.executable, "run.py", "--config", config, "--no-progress", "--steps", str(args.steps),
             "--output-dir", run_dir, "--set", f"data.path={packed}", "--set", f"model.vocab_size={args.vocab_size}",
             "--set", f"train.checkpoint_every={args.checkpoint_every}", "--set", "train.eval_every=0"]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    killed = run_phase(train, env, kill_when=lambda: last_step(metrics) >= args.kill_after)
    if killed[3] != -signal.SIGKILL:
        raise SystemExit(f"the run ended before the kill ({killed[3]}):\n{killed[4][-3000:]}")
    rows.append((f"train to step {args.kill_after}, SIGKILL", killed))
    rows.append(("resume", checked(run_phase(train + ["--resume"], env), train)))
    with open(os.path.join(run_dir, "summary.json")) as handle:
        summary = json.load(handle)
    print(f"corpus {os.path.getsize(corpus) / 1e6:.{2 if args.dry_run else 0}f} MB, {manifest['num_sequences']} sequences in "
          f"{manifest['num_packs']} packs over {len(manifest['shards'])} shards; gap to the LP bound "
          f"{manifest.get('gap_percent')} %; data wait {summary.get('data_wait_fraction')}")
    print(markdown_table(["phase", "wall s", "CPU s", "peak RSS MiB (all processes)"],
                         [[name, f"{wall:.1f}", f"{cpu:.1f}", f"{peak / 2**20:.0f}"] for name, (wall, cpu, peak, _, _) in rows]
                         + [["all", f"{sum(r[1][0] for r in rows):.1f}", f"{sum(r[1][1] for r in rows):.1f}",
                             f"{max(r[1][2] for r in rows) / 2**20:.0f}"]]))
    if args.check:
        straight = os.path.join(folder, "run-straight")
        argv = [a if a != run_dir else straight for a in train]
        checked(run_phase(argv, env), argv)
        ours, theirs = losses(metrics), losses(os.path.join(straight, "metrics.jsonl"))
        equal = all(ours[s] == theirs[s] for s in theirs)
        print(f"killed and resumed equals the uninterrupted run step for step: {equal} ({len(theirs)} steps)")
    if args.work is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
