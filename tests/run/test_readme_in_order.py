"""The README run as a newcomer runs it (issue 49): its commands in the order printed, in one
fresh copy of the repository, each exiting as the README shows (0, or 2 where it prints
``error:``), and printing what its block shows but for what docs/examples.py declares machine-
dependent (timings, losses: ``examples.VARIES``). tests/run/test_doc_snippets.py checks each
command alone; this file sees what one command leaves for the next (an output directory that
already holds a run)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional

import pytest

import test_doc_snippets as snippets

ROOT = snippets.ROOT

def _one_run_each(commands):
    """A command printed again further on with its output (the quick start's
    ``pip install -r requirements.txt && python run.py``, then ``$ python run.py`` and what it
    prints) is one run, not two: the later one, which shows the output, is kept."""
    return [c for i, c in enumerate(commands) if not any(c.text == later.text for later in commands[i + 1:])]


README = _one_run_each([c for c in snippets.COMMANDS if c.doc == "README.md"])


def _trains(words: List[str]) -> bool:
    """A run.py command that writes an output directory (not a mode that only prints)."""
    return (len(words) > 1 and words[1] == "run.py" and "--print-config" not in words and "--compile-only" not in words
            and "--resume" not in words)


def _output_dir(words: List[str]) -> str:
    """Where ``python run.py ...`` writes: ``--output-dir``, else runs/NAME of its config."""
    if "--output-dir" in words:
        return os.path.normpath(words[words.index("--output-dir") + 1])
    name = words[words.index("--config") + 1] if "--config" in words else "demo"
    return os.path.join("runs", os.path.splitext(os.path.basename(name))[0])


def _expects_error(command) -> bool:
    return any(line.startswith("error: ") for line in snippets._expected_outputs(command))


def test_each_training_command_of_the_readme_has_its_own_output_dir():
    # Was: the quick start, the real-data run and torchrun all wrote runs/demo, so the second
    # stopped at once ("runs/demo already holds a checkpoint"); the mock smoke run met the
    # phase-2 CPU example's runs/phase2.
    seen = {}
    for command in README:
        words = snippets._strip_launchers(shlex.split(command.text, comments=True))
        if not _trains(words) or _expects_error(command) or any(snippets.PLACEHOLDER.search(w) for w in words[1:]):
            continue
        directory = _output_dir(words)
        assert directory not in seen, (f"README.md:{command.line} writes {directory}, as line {seen[directory]} "
                                       f"did before it: give it its own --output-dir")
        seen[directory] = command.line
    assert len(seen) >= 5, seen  # the demo, phase 2 on the CPU, torchrun, the two real-data runs, the mock


def _not_run(command, words: List[str]) -> Optional[str]:
    """Why a README command is parsed (test_doc_snippets) but not run here, or None."""
    joined = " ".join(words)
    if words[0] in snippets.NOT_PYTHON:
        return snippets.NOT_PYTHON[words[0]]
    words = snippets._strip_launchers(words)
    if words[1:3] == ["-m", "pytest"]:
        return "the test suite itself"
    if any(snippets.PLACEHOLDER.search(w) for w in words[1:]):
        return "a synopsis with placeholders"
    if "--backend ipu" in joined or command.text.startswith("poprun"):
        return "needs IPUs and the Poplar SDK"
    if "--init-checkpoint" in words:
        return "needs a pre-trained checkpoint and the data files it names"
    if "--profile" in words:
        return "the BERT-Large profile: minutes on a CPU"
    if ("bert_packed.data" in joined or "data.path=" in joined) and not shutil.which("bible"):
        return "needs Debian's bible-kjv"
    return None


def _example_command(text: str):
    """docs/examples.py's Command for a README command (its output filter), or None."""
    examples = snippets._examples()
    for example in examples.EXAMPLES:
        for command in example.commands:
            if " ".join(command.argv()) == " ".join(shlex.split(text)):
                return example, command
    return None, None


def _environment(copy: str) -> dict:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(name, None)
    return env


def _copy_of_the_repository(destination: str) -> str:
    """The checkout as a fresh clone has it: no runs, data, caches or environment."""
    ignore = shutil.ignore_patterns(".git", ".venv", "runs", "data", "__pycache__", ".pytest_cache", ".hypothesis",
                                    "*.egg-info", "build")
    shutil.copytree(ROOT, destination, ignore=lambda d, names: [n for n in ignore(d, names)
                                                                if not (n == "data" and d != ROOT)])
    return destination


@pytest.mark.slow
def test_the_readme_runs_in_order_in_a_fresh_copy(tmp_path):
    examples = snippets._examples()
    copy = _copy_of_the_repository(str(tmp_path / "packed-bert"))
    env, ran, failures = _environment(copy), [], []
    for command in README:
        words = shlex.split(command.text, comments=True)
        if _not_run(command, words):
            continue
        expected_status = 2 if _expects_error(command) else 0
        done = subprocess.run(words, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ran.append(command.text)
        if done.returncode != expected_status:
            failures.append(f"README.md:{command.line}: `{command.text}` exited {done.returncode}, "
                            f"not {expected_status}:\n{done.stdout[-2000:]}")
            continue
        example, recorded = _example_command(command.text)
        shown = snippets._expected_outputs(command)
        if recorded is None or not shown or example.name in examples.COUNTS_VARY:
            continue  # no printed output to compare (or counts that may differ, as the README says)
        printed = examples._shorten(done.stdout.rstrip("\n").splitlines(), recorded)
        if command.text.startswith("python -m packing report"):
            snippets._same_table(shown, printed)
            continue
        if recorded.cut:  # a long line the block cuts at a ", ": compare the kept start
            printed = [line if len(line) <= len(want) or not want.endswith("...") else line[:len(want) - 3] + "..."
                       for line, want in zip(printed, shown)] + printed[len(shown):]
        want = [examples.reproducible(line) for line in shown]
        got = [examples.reproducible(line) for line in printed]
        if got != want:
            failures.append(f"README.md:{command.line}: `{command.text}` printed\n" + "\n".join(got)
                            + "\nwhere the README shows\n" + "\n".join(want))
    assert not failures, "\n\n".join(failures)
    assert any(t == "python run.py" for t in ran) and any(t.startswith("torchrun") for t in ran), ran
