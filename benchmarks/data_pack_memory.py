"""Benchmark: `pack` on N generated sequences (default 1 M) in bounded memory.

    python benchmarks/data_pack_memory.py [--num-sequences 1000000] [--algorithm lpfhp]

Writes a synthetic unpacked HDF5 file (NVIDIA layout, S=128, lengths from the Wikipedia
histogram scaled to 128), then runs `python -m bert_packed.data pack` on it in a child
process and reports that process's own peak resident memory (VmHWM; getrusage's ru_maxrss
would carry this parent's peak across fork + exec), wall time, file
sizes and the packing statistics. Figures go to docs/benchmarks/training.md ("Real data").
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, ROOT)

CHILD = r"""
import json, re, sys, time
from bert_packed.data.prepare.pack import pack_file
start = time.perf_counter()
stats = pack_file(sys.argv[1], sys.argv[2], algorithm=sys.argv[3], max_sequences_per_pack=3,
                  seed=0, show_progress=True)
stats["seconds"] = time.perf_counter() - start
stats["peak_rss_mib"] = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
print(json.dumps(stats))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-sequences", type=int, default=1_000_000)
    parser.add_argument("--algorithm", default="lpfhp")
    parser.add_argument("--workdir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args(argv)
    from bert_packed.data.prepare.synthetic import write_synthetic_unpacked

    workdir = args.workdir or tempfile.mkdtemp(prefix="pack-bench-")
    os.makedirs(workdir, exist_ok=True)
    source, output = os.path.join(workdir, "train.h5"), os.path.join(workdir, "packed.h5")
    start = time.perf_counter()
    write_synthetic_unpacked(source, args.num_sequences, max_seq_length=128, max_predictions=20,
                             seed=0, show_progress=True)
    print(f"generated {args.num_sequences} sequences in {time.perf_counter() - start:.1f} s "
          f"({os.path.getsize(source) / 2**20:.0f} MiB)", file=sys.stderr)
    result = subprocess.run([sys.executable, "-c", CHILD, source, output, args.algorithm],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(result.returncode)
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    stats["input_mib"] = os.path.getsize(source) / 2**20
    stats["output_mib"] = os.path.getsize(output) / 2**20
    stats["input_uncompressed_mib"] = args.num_sequences * (128 * 6 + 20 * 8 + 1) / 2**20
    keys = ("num_sequences", "num_packs", "algorithm", "packing_factor", "efficiency",
            "unpacked_efficiency", "seconds", "peak_rss_mib", "input_mib", "input_uncompressed_mib",
            "output_mib")
    print(json.dumps({key: stats[key] for key in keys}, indent=1))
    if not args.keep and args.workdir is None:
        for path in (source, output):
            os.unlink(path)
        os.rmdir(workdir)


if __name__ == "__main__":
    main()
