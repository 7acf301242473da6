"""Regenerate the printed examples of README.md and docs/*.md (issue 38): run each documented
command as written, record its output in docs/examples/NAME.txt and put that text into the
fenced block (or, for a table an output file holds, the Markdown table) after the marker
``<!-- example: NAME -->`` of the doc, so figures are re-run, never edited by hand.

    python docs/examples.py                 # every example (minutes: the demo trains 200 steps)
    python docs/examples.py demo errors     # some of them
    python docs/examples.py --list          # names, docs and commands

Each command runs in a scratch directory (so a documented ``runs/NAME`` output never meets an
old run) with the repository on ``PYTHONPATH`` and ``run.py`` / ``benchmarks/`` resolved to it;
piped output, as a reader who copies the command into a script sees it. Timings (``seq/s``,
``s of training``, the ``seconds`` column) depend on the machine and its load: the doc says
so after the block; counts, losses and packs do not. tests/run/test_doc_snippets.py checks
that every block equals its record and that the recorded commands are the documented ones.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "examples")
MARKER = "<!-- example: {} -->"
# A marker, then the block it owns: a fenced block (its inside) or a Markdown table (its lines).
MARKER_RE = re.compile(r"^<!-- example: ([\w-]+) -->\n(?:```\w*\n(.*?)^```\n|((?:\|[^\n]*\n)+))", re.S | re.M)


@dataclass
class Command:
    """One ``$`` line of a block: what the reader types (``shown``, with ``\\`` continuations)
    and what of its output the block keeps (``keep``: a line filter; dropped runs become ``...``;
    ``cut``: lines longer than that are cut at a ``, `` and end in ``...``)."""

    shown: str
    keep: Optional[Callable[[str], bool]] = None
    cut: Optional[int] = None
    exit_code: int = 0

    def argv(self) -> List[str]:
        return shlex.split(self.shown.replace("\\\n", " "))


@dataclass
class Example:
    name: str
    doc: str
    commands: List[Command]
    needs: Optional[Callable[[], Optional[str]]] = None  # a reason it cannot run here, or None
    setup: List[Command] = field(default_factory=list)  # run first in the same directory, not shown
    table_from: Optional[str] = None  # the block is the first Markdown table of this output file
    show_commands: bool = True  # False: the block holds the output alone (the prose names the command)


def _lines_matching(*patterns: str) -> Callable[[str], bool]:
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    return lambda line: bool(regex.match(line))


def _needs_bible():
    return None if shutil.which("bible") else "needs Debian's bible-kjv (`apt-get install bible-kjv`)"


# A tiny transformers checkpoint in DIR (the tests' fixture), its config.json edited by EDIT.
TINY_CHECKPOINT = (
    "python -c 'import json, os, sys, transformers, bert_packed; "
    "sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(bert_packed.__file__)), \"tests\")); "
    "from finetune_fixtures import save_hf_checkpoint, write_vocab; "
    "save_hf_checkpoint(transformers, \"DIR\", write_vocab(\"vocab\"), max_position_embeddings=128); "
    "path = os.path.join(\"DIR\", \"config.json\"); config = json.load(open(path)); config.update({EDIT}); "
    "json.dump(config, open(path, \"w\"))'")
HEADER_AND_DONE = _lines_matching(r"training ", r"done: ")
PHASE2_CPU = ("python run.py --backend cpu --config phase2 --steps 3 --set model.num_hidden_layers=2 "
              "--set model.hidden_size=128 \\\n    --set model.num_attention_heads=2 --set model.intermediate_size=512 "
              "--set train.gradient_accumulation=2 --set data.num_sequences=2000 \\\n    --output-dir runs/phase2-cpu")
MOCK_SMOKE = ("python run.py --backend mock --config phase2.yaml --steps 3 --set model.num_hidden_layers=4 \\\n"
              "    --set \"ipu.layers_per_ipu=[1,1,1,1]\" --set train.gradient_accumulation=9 "
              "--set model.hidden_size=64 \\\n"
              "    --set model.num_attention_heads=4 --set model.intermediate_size=256 --set model.vocab_size=1024 \\\n"
              "    --set data.max_sequence_length=128 --set data.num_sequences=2000 --output-dir runs/phase2-mock")
KJV_CREATE = ("python -m bert_packed.data create --input data/kjv.txt --vocab data/vocab.txt --output {out} \\\n"
              "      --max-seq-length 128 --max-predictions 20 --dupe-factor 5 --seed 0")

EXAMPLES = [
    Example("demo", "README.md", [Command("python run.py", keep=_lines_matching(
        r"training ", r"step +(1|50|150|200)/", r"step (100|200):", r"done: "))]),
    Example("phase2-cpu", "README.md", [Command(PHASE2_CPU, keep=HEADER_AND_DONE)]),
    Example("torchrun", "README.md", [Command(
        "torchrun --nproc_per_node 2 run.py --backend cpu --config demo --steps 20 --set train.global_batch_size=16 "
        "--set train.micro_batch_size=8 --output-dir runs/demo-torchrun", keep=_lines_matching(r"done: "))]),
    Example("errors", "README.md", [
        Command("python run.py --config demo --set train.micro_batchsize=8", cut=150, exit_code=2),
        Command("python run.py --config phase2 --backend mock --set model.num_hidden_layers=4", exit_code=2),
        Command("python run.py --config demo --steps 1000000000000000000000000000000", exit_code=2),
        Command("python run.py --backend cuda", exit_code=2),
    ]),
    Example("packing-report", "README.md", [Command(
        "python -m packing report --algorithm none spfhp lpfhp lp --max-sequences-per-pack 3 max")]),
    Example("real-data", "README.md", [
        Command("python -m bert_packed.data kjv --output data/kjv.txt"),
        Command("python -m bert_packed.data vocab --input data/kjv.txt --size 4096 --output data/vocab.txt"),
        Command(KJV_CREATE.format(out="data/train.h5")),
        Command("python -m bert_packed.data pack --input data/train.h5 --output data/packed.h5 --algorithm lp "
                "--max-sequences-per-pack 3"),
        Command("python -m bert_packed.data stats data/packed.h5 --plot data/packed.png",
                keep=lambda line: not re.match(r"\s+(sequence lengths:|\d+-\d+\s)", line)),
        Command("python run.py --config demo --steps 10 --set data.path=data/packed.h5 --set model.vocab_size=4096 "
                "--set train.eval_every=0 --output-dir runs/demo-kjv", keep=_lines_matching(r"done: ")),
    ], needs=_needs_bible),
    Example("real-data-shards", "README.md", [
        Command(KJV_CREATE.format(out="data/train") + " --output-shards 4"),
        Command("python -m bert_packed.data pack --input data/train --output data/packed --algorithm lp "
                "--max-sequences-per-pack 3"),
        Command("python run.py --config demo --steps 10 --set data.path=data/packed --set data.eval_path=data/packed "
                "--set model.vocab_size=4096 --output-dir runs/demo-kjv-shards", keep=_lines_matching(r"done: ")),
    ], needs=_needs_bible, setup=[
        Command("python -m bert_packed.data kjv --output data/kjv.txt"),
        Command("python -m bert_packed.data vocab --input data/kjv.txt --size 4096 --output data/vocab.txt")]),
    # Step lines only: under load a slow step also prints progress lines inside it.
    Example("profile-table", "README.md", [Command("python run.py --backend mock --config phase2 --profile "
                                                   "--output-dir runs/profile")],
            table_from="runs/profile/overhead.md"),
    Example("cuda-unavailable", "docs/cuda.md", [Command("python run.py --backend cuda", exit_code=2)],
            show_commands=False),
    Example("finetune-shape-error", "docs/finetuning.md", [Command(
        "python run.py --config finetune_classification --init-checkpoint DIR --set model.hidden_size=64",
        exit_code=2)], setup=[Command(TINY_CHECKPOINT.replace("{EDIT}", ""))], show_commands=False),
    Example("finetune-depth-error", "docs/finetuning.md", [Command(
        "python run.py --config finetune_classification --init-checkpoint DIR", exit_code=2)],
        setup=[Command(TINY_CHECKPOINT.replace("{EDIT}", "num_hidden_layers=3"))], show_commands=False),
    Example("ipu-memory-phase1", "docs/ipu.md",
            [Command("python run.py --backend mock --config phase1 --compile-only")],
            table_from="runs/phase1/compile/memory_estimate.md"),
    Example("ipu-memory-phase2", "docs/ipu.md",
            [Command("python run.py --backend mock --config phase2 --compile-only")],
            table_from="runs/phase2/compile/memory_estimate.md"),
    Example("mock-smoke", "README.md", [Command(MOCK_SMOKE, keep=_lines_matching(r"training ", r"step +\d+/",
                                                                                 r"done: "))]),
]


# What a re-run prints differently on another machine, or under another load (README.md, after the
# quick start's block, says so): timings, and losses and accuracies (floating-point rounding of
# other library builds and versions). tests/run/test_readme_in_order.py re-runs the README's
# commands and compares everything else: counts, packs, sequences per pack, the LP bound, messages.
VARIES = [
    (re.compile(r"\b\d+ (seq/s|sequences/s)\b"), r"N \1"),
    (re.compile(r"\bin \d+ s of training\b"), "in N s of training"),
    (re.compile(r"\b(loss|mlm|nsp|mlm_acc|mlm_loss|eval) \d+\.\d+"), r"\1 X"),
    (re.compile(r"-> \d+\.\d+"), "-> X"),
]
# Examples whose counts may differ too, and why (the doc says so after the block).
COUNTS_VARY = {
    "real-data": "vocab's WordPiece trainer breaks ties between equally frequent merges in hash order",
    "real-data-shards": "vocab's WordPiece trainer breaks ties between equally frequent merges in hash order",
}


def reproducible(line: str) -> str:
    """``line`` with what ``VARIES`` lists replaced by placeholders: what every machine prints."""
    for pattern, placeholder in VARIES:
        line = pattern.sub(placeholder, line)
    return line


# Lines that appear only when the machine is slow: progress inside a long step and its estimate.
LOAD_DEPENDENT = re.compile(r"step \d+: micro-batch |warning: .* per step, ~")


def _shorten(lines: List[str], command: Command) -> List[str]:
    """The lines the block keeps: ``keep``'s, ``...`` for each dropped run; long ones cut; the
    lines a slow machine adds (``LOAD_DEPENDENT``) left out without a trace."""
    out: List[str] = []
    for line in lines:
        if LOAD_DEPENDENT.match(line):
            continue
        if command.keep is None or command.keep(line):
            if command.cut and len(line) > command.cut and ", " in line[:command.cut]:
                line = line[:line.rindex(", ", 0, command.cut)] + ", ..."
            out.append(line)
        elif not out or out[-1] != "...":
            out.append("...")
    return out


def _environment() -> dict:
    """``python`` and ``torchrun`` are this interpreter's (its environment's ``bin`` first on PATH)."""
    env = {**os.environ, "PYTHONPATH": ROOT,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("WORLD_SIZE", None)
    return env


def _resolve(argv: List[str]) -> List[str]:
    """``run.py`` and ``benchmarks/X.py`` as the repository's files (the command runs elsewhere)."""
    return [os.path.join(ROOT, a) if a == "run.py" or a.startswith("benchmarks/") else a for a in argv]


def run_command(command: Command, cwd: str, env: dict) -> Tuple[List[str], float]:
    """(output lines as the block shows them, seconds); a wrong exit status is an error."""
    start = time.monotonic()
    done = subprocess.run(_resolve(command.argv()), cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != command.exit_code:
        raise SystemExit(f"{command.shown!r} exited {done.returncode}, not {command.exit_code}:\n{done.stdout}")
    return _shorten(done.stdout.rstrip("\n").splitlines(), command), time.monotonic() - start


def generate(example: Example) -> str:
    """The block's text: each command as ``$ ...`` and its output lines."""
    scratch = tempfile.mkdtemp(prefix=f"example-{example.name}-")
    try:
        for command in example.setup:
            run_command(command, scratch, _environment())
        lines: List[str] = []
        for command in example.commands:
            output, seconds = run_command(command, scratch, _environment())
            print(f"  {seconds:6.1f} s  {command.shown.splitlines()[0][:100]}", file=sys.stderr)
            lines += ["$ " + command.shown] * example.show_commands + output
        if example.table_from:
            with open(os.path.join(scratch, example.table_from)) as f:
                return re.search(r"^(?:\|[^\n]*\n)+", f.read(), re.M).group(0)
        return "\n".join(lines) + "\n"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def record_path(name: str) -> str:
    return os.path.join(RECORDS, name + ".txt")


def blocks(doc_text: str):
    """(name, start, end) of each marked block of a doc: the span its content occupies."""
    for m in MARKER_RE.finditer(doc_text):
        group = 2 if m.group(2) is not None else 3
        yield m.group(1), m.start(group), m.end(group)


def splice(doc_text: str, name: str, block: str) -> str:
    """``doc_text`` with the block after ``name``'s marker replaced by ``block``."""
    found = [(start, end) for n, start, end in blocks(doc_text) if n == name]
    if len(found) != 1:
        raise SystemExit(f"{len(found)} markers {MARKER.format(name)!r} followed by a fenced block or a table; "
                         f"need one")
    start, end = found[0]
    return doc_text[:start] + block + doc_text[end:]


def write(example: Example, block: str) -> None:
    os.makedirs(RECORDS, exist_ok=True)
    with open(record_path(example.name), "w") as f:
        f.write(block)
    path = os.path.join(ROOT, example.doc)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(splice(text, example.name, block))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="examples to regenerate (default: all)")
    p.add_argument("--list", action="store_true", help="print the examples and exit")
    args = p.parse_args(argv)
    by_name = {e.name: e for e in EXAMPLES}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        p.error(f"unknown example(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    if args.list:
        for e in EXAMPLES:
            print(f"{e.name} ({e.doc}): " + " && ".join(c.shown.replace("\\\n    ", "") for c in e.commands))
        return 0
    for example in [by_name[n] for n in args.names] if args.names else EXAMPLES:
        reason = example.needs() if example.needs else None
        if reason:
            print(f"{example.name}: skipped, {reason}", file=sys.stderr)
            continue
        print(f"{example.name}:", file=sys.stderr)
        write(example, generate(example))
    return 0


if __name__ == "__main__":
    sys.exit(main())
