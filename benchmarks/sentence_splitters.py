"""Sentence splitters for `create`'s paragraph input (WikiExtractor, JSONL, Parquet): speed and
quality of blingfire and pysbd, measured in one small run.

    python benchmarks/sentence_splitters.py [--corpus kjv.txt] [--mib 2]

Speed: MB/s over paragraphs made of KJV verses (a chapter per paragraph), one thread.
Quality: a few tricky cases (abbreviations, initials, decimals, quotes, ellipses); each case
lists the expected sentences and counts as right only when the split matches exactly.
"""
import argparse
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: the project root on the path, so `benchmarks` is the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, markdown_header, markdown_row  # noqa: E402

CASES = [
    ("Mr. Smith went to Washington. He arrived at 3 p.m. on Monday.",
     ["Mr. Smith went to Washington.", "He arrived at 3 p.m. on Monday."]),
    ("The U.S. economy grew by 2.5 percent. Analysts were surprised.",
     ["The U.S. economy grew by 2.5 percent.", "Analysts were surprised."]),
    ("Dr. J. R. R. Tolkien wrote it. It sold well.", ["Dr. J. R. R. Tolkien wrote it.", "It sold well."]),
    ('"Stop!" she said. "Why?" he asked.', ['"Stop!" she said.', '"Why?" he asked.']),
    ("Pi is about 3.14159. The value of e is 2.718.", ["Pi is about 3.14159.", "The value of e is 2.718."]),
    ("He said \"I will go.\" Then he left.", ["He said \"I will go.\"", "Then he left."]),
    ("It costs $4.50 (approx.) in the U.K. today. Prices vary.",
     ["It costs $4.50 (approx.) in the U.K. today.", "Prices vary."]),
    ("Wait... what happened? Nobody knows.", ["Wait... what happened?", "Nobody knows."]),
    ("See e.g. chapter 4 and Fig. 2 for details. The end.", ["See e.g. chapter 4 and Fig. 2 for details.", "The end."]),
    ("Apple Inc. was founded in 1976. Its HQ is in Cupertino.",
     ["Apple Inc. was founded in 1976.", "Its HQ is in Cupertino."]),
]


def splitters():
    import blingfire
    import pysbd

    segmenter = pysbd.Segmenter(language="en", clean=False)
    return {"blingfire": lambda text: [s for s in blingfire.text_to_sentences(text).split("\n") if s.strip()],
            "pysbd": lambda text: [s.strip() for s in segmenter.segment(text) if s.strip()]}


def paragraphs(corpus, mib):
    if corpus is None:
        corpus = "/tmp/kjv-splitters.txt"
        if not os.path.exists(corpus):
            subprocess.run([sys.executable, "-m", "bert_packed.data", "kjv", "--output", corpus], check=True,
                           stdout=subprocess.DEVNULL, cwd=ROOT)
    out, size = [], 0
    with open(corpus, encoding="utf-8") as handle:
        for chapter in handle.read().split("\n\n"):
            text = " ".join(line.strip() for line in chapter.splitlines() if line.strip())
            out.append(text)
            size += len(text.encode())
            if size >= mib * 2**20:
                break
    return out, size


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", default=None, help="one sentence per line corpus (default: KJV)")
    parser.add_argument("--mib", type=float, default=2.0, help="text to time, MiB")
    args = parser.parse_args(argv)
    texts, size = paragraphs(args.corpus, args.mib)
    print(markdown_header(["splitter", f"MB/s ({size / 1e6:.1f} MB)", "tricky cases right", "failures"]))
    for name, split in splitters().items():
        start = time.perf_counter()
        for text in texts:
            split(text)
        speed = size / 1e6 / (time.perf_counter() - start)
        wrong = [i for i, (text, want) in enumerate(CASES) if split(text) != want]
        print(markdown_row([name, f"{speed:.2f}", f"{len(CASES) - len(wrong)}/{len(CASES)}", wrong]))
        for i in wrong:
            print(f"  {name} case {i}: {split(CASES[i][0])}", file=sys.stderr)


if __name__ == "__main__":
    main()
