"""The docs run (issue 38): every command in a fenced block of README.md, packing/README.md
and docs/*.md parses with its entry point's real argument parser (run.py's ``--set`` keys
against the config sections, ``python -m ...`` modules and ``benchmarks/`` scripts exist and
accept the flags), the ones a CPU runs in seconds run, the commands named in the prose exist,
and the printed examples are the ones docs/examples.py last generated. A command that is not run is a skipped test whose reason says why (an IPU, a
GPU, the network, large data, or minutes of CPU time), so nothing is dropped silently."""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from typing import List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", "packing/README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
                                                  + glob.glob(os.path.join(ROOT, "docs", "benchmarks", "*.md")))
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PROGRAMS = ("python", "torchrun", "poprun", "pip", "nice", "apt-get", "git", "mkdir", "mv", "~/")
# A word that stands for something the reader fills in (a synopsis line, not a command).
PLACEHOLDER = re.compile(r"^section\.key|^(\.\.\.|[A-Z]+(\|[A-Z]+)*|<.*>|\[.*|.*\]|.*=[A-Z]+)$|[A-Z]+/|\|")


@dataclass
class DocCommand:
    doc: str
    line: int
    text: str  # as written, one line (continuations joined)

    @property
    def key(self) -> str:
        """The command without its ``# comment``, one blank between words (``RUNS``' keys)."""
        return " ".join(shlex.split(self.text, comments=True))

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{self.text[:60]}"


def _block_commands(body: str) -> List[tuple]:
    """(line offset, command) of a block: its ``$`` lines, or (a block without prompts) the lines
    that start with a program; ``\\`` continuations joined, ``&&`` split."""
    prompts = any(line.startswith("$ ") for line in body.splitlines())
    out, pending, start = [], None, 0
    for i, line in enumerate(body.splitlines()):
        if pending is not None:
            pending += " " + line.strip()
        elif prompts and line.startswith("$ "):
            pending, start = line[2:], i
        elif not prompts and line.startswith(PROGRAMS):
            pending, start = line, i
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        out += [(start, part.strip()) for part in pending.split(" && ")]
        pending = None
    return out


def doc_commands() -> List[DocCommand]:
    commands = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for m in BLOCK.finditer(text):
            if m.group(1) not in ("", "sh", "bash", "shell", "console"):
                continue
            first = text[:m.start(2)].count("\n") + 1
            commands += [DocCommand(doc, first + offset, command) for offset, command in _block_commands(m.group(2))]
    return commands


def python_blocks():
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for m in BLOCK.finditer(text):
            if m.group(1) == "python":
                yield doc, text[:m.start(2)].count("\n") + 1, m.group(2)


COMMANDS = doc_commands()


# -- Parsing with the real parsers --------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser, namespace, extras):
        super().__init__()
        self.parser, self.namespace, self.extras = parser, namespace, extras


@contextlib.contextmanager
def _stop_after_parsing(parser_only: bool = False):
    """argparse's outermost ``parse_known_args`` (which ``parse_args`` calls) raises ``_Parsed``
    instead of returning: the entry point parses its real command line and does nothing else
    (``parser_only``: not even that; the parser is all it hands over)."""
    original = argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_known_args(self, args=None, namespace=None):
        if parser_only and depth[0] == 0:
            raise _Parsed(self, None, None)
        depth[0] += 1
        try:
            namespace, extras = original(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise _Parsed(self, namespace, extras)
        return namespace, extras

    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def parse_entry(argv: List[str], parser_only: bool = False) -> _Parsed:
    """Run ``python ARGV`` up to its argument parsing (a script path or ``-m module``); the
    script's changes to ``sys.argv`` and ``sys.path`` are undone."""
    saved, saved_path = sys.argv[:], sys.path[:]
    err = io.StringIO()
    try:
        with _stop_after_parsing(parser_only), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "-m":
                sys.argv = [argv[1]] + argv[2:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv[:]
                runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
    except _Parsed as parsed:
        return parsed
    except SystemExit as exc:
        pytest.fail(f"python {' '.join(argv)}: exit {exc.code}: {err.getvalue().strip()}")
    finally:
        sys.argv, sys.path[:] = saved, saved_path
    pytest.fail(f"python {' '.join(argv)} did not parse a command line with argparse")


def _option_strings(parser: argparse.ArgumentParser, words: List[str]) -> set:
    """Every option of ``parser`` and of the subcommand ``words`` name."""
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in words:
                if word in action.choices:
                    options |= _option_strings(action.choices[word], [])
    return options


def check_run_py(argv: List[str], synopsis: bool) -> None:
    """run.py's own parser, then every ``--set`` key and value against the config (the YAML
    sections and the backend's), as ``--print-config`` would; a placeholder path
    (``--init-checkpoint DIR``) is left out, since load_config reads the checkpoint."""
    import run
    from backends import get_backend_class
    from bert_packed.config import load_config, validate

    if synopsis:
        known = _run_py_options()
        unknown = [w for w in _flags(argv) if w not in known]
        assert not unknown, f"run.py has no option(s) {unknown}"
        keys = [argv[i + 1].strip("[]").split("=")[0] for i, w in enumerate(argv[:-1]) if w.strip("[]") == "--set"]
        _check_keys([k for k in keys if not PLACEHOLDER.search(k)])
        return
    argv = [w for i, w in enumerate(argv)
            if w != "--init-checkpoint" and (i == 0 or argv[i - 1] != "--init-checkpoint")]
    args = run.parse_args(argv)
    overrides = args.overrides + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    validate(load_config(args.config, overrides), get_backend_class(args.backend), args.world_size)


def _flags(words: List[str]) -> List[str]:
    """The ``--option`` words of a synopsis (``[--steps N]``, ``--a|--b``, ``--x=V``)."""
    flags = [part.split("=")[0] for w in words for part in w.strip("[]").split("|")]
    return [f for f in flags if f.startswith("--") and f != "--"]


def _run_py_options() -> set:
    import run

    try:
        with _stop_after_parsing(parser_only=True):
            run.parse_args([])
    except _Parsed as parsed:
        return set(parsed.parser._option_string_actions)
    raise AssertionError("run.parse_args parsed nothing")


def _check_keys(keys: List[str]) -> None:
    """Each ``section.key`` is a key ``--set`` accepts (the table ``load_config`` checks against)."""
    import backends  # noqa: F401  (registers the backends' sections)
    from bert_packed.config import Config, _section_types

    sections = Config().sections
    for key in keys:
        section, _, name = key.partition(".")
        assert section in sections, f"--set {key}: no section {section!r}"
        assert name in _section_types(type(sections[section])), f"--set {key}: no key {name!r} in section {section}"


# -- What each command is and whether it runs here ---------------------------------------------


def _strip_launchers(words: List[str]) -> List[str]:
    """``nice -n N``, ``torchrun ...``, ``poprun ...`` and an interpreter path peeled off: the
    words from ``python`` (or the script torchrun runs) on."""
    if words[:1] == ["nice"]:
        words = words[3:] if words[1:2] == ["-n"] else words[1:]
    if words[:1] == ["torchrun"]:
        script = next(i for i, w in enumerate(words) if w.endswith(".py"))
        return ["python"] + words[script:]
    if words[:1] == ["poprun"]:
        return words[next(i for i, w in enumerate(words) if w == "python"):]
    if words and words[0].endswith("/bin/python"):
        return ["python"] + words[1:]
    return words


NOT_PYTHON = {
    "pip": "installs from the network; the requirement file exists",
    "apt-get": "a system package manager (root); not run",
    "git": "repository housekeeping for a benchmark; not run",
    "mkdir": "shell housekeeping; not run",
    "mv": "shell housekeeping; not run",
}
EXTERNAL_MODULES = {"wikiextractor.WikiExtractor": "WikiExtractor on a Wikipedia dump (tens of GB)",
                    "pytest": "the test suite itself"}


def check_parses(command: DocCommand) -> Optional[str]:
    """Assert what can be checked without running; returns the words from ``python`` on (or None)."""
    words = shlex.split(command.text, comments=True)
    assert words, command.text
    if words[0] in NOT_PYTHON:
        if words[0] == "pip":
            for i, w in enumerate(words):
                if w == "-r":
                    assert os.path.isfile(os.path.join(ROOT, words[i + 1])), words[i + 1]
        return None
    words = _strip_launchers(words)
    assert words[0] == "python", f"{command.text}: not a python command"
    argv = words[1:]
    synopsis = any(PLACEHOLDER.search(w) for w in argv)
    if argv[0] == "-m":
        module = argv[1]
        if module in EXTERNAL_MODULES:
            if module == "pytest":
                for path in argv[2:]:
                    if path.startswith("tests/"):
                        assert os.path.isfile(os.path.join(ROOT, path)), path
            return None
        if module == "bert_packed.config":  # execs run.py --print-config
            argv = ["run.py", "--print-config"] + argv[2:]
        else:
            assert os.path.exists(os.path.join(ROOT, *module.split("."))) or os.path.exists(
                os.path.join(ROOT, *module.split(".")) + ".py"), f"no module {module}"
    else:
        assert os.path.isfile(os.path.join(ROOT, argv[0])), f"no script {argv[0]}"
    if argv[0] == "run.py":
        check_run_py(argv[1:], synopsis)
        return " ".join(words)
    if "--" in argv:  # a benchmark that hands the rest to run.py (benchmarks/profile_step.py)
        cut = argv.index("--")
        check_run_py(argv[cut + 1:], synopsis)
        argv, synopsis = argv[:cut], any(PLACEHOLDER.search(w) for w in argv[:cut])
    if synopsis:
        parsed = parse_entry(argv[:2] if argv[0] == "-m" else argv[:1], parser_only=True)
        known = _option_strings(parsed.parser, argv)
        unknown = [w for w in _flags(argv) if w not in known]
        assert not unknown, f"{argv[:2]} has no option(s) {unknown}"
        return None
    parsed = parse_entry(argv)
    assert not parsed.extras, f"unrecognized arguments: {parsed.extras}"
    return " ".join(words)


# -- Running the ones a CPU does in seconds ------------------------------------------------------

# Command as written -> the small overrides it runs with (appended to it), or () for as written.
RUNS = {
    "python run.py": ("--steps", "2", "--set", "train.eval_every=0"),  # the demo is 200 steps (~30 s)
    "python run.py --print-config phase2 --backend mock": (),
    "python run.py --config demo --set train.micro_batchsize=8": (),
    "python run.py --config phase2 --backend mock --set model.num_hidden_layers=4": (),
    "python run.py --config demo --steps 1000000000000000000000000000000": (),
    "python run.py --backend cuda": (),
    "python run.py --backend cuda --config tiny --set cuda.device=cpu --set cuda.precision=fp32": (
        "--steps", "2", "--set", "train.eval_every=0"),
    # Module entry points: main(argv) of the module; the printed table must be the doc's.
    "python -m packing report --algorithm none spfhp lpfhp lp --max-sequences-per-pack 3 max": (),
    "python -m bert_packed.analysis.scaling --output-dir runs/scaling": (),
}
MODULE_MAINS = {"packing": "packing.cli", "bert_packed.analysis.scaling": "bert_packed.analysis.scaling"}
SLOW = "minutes of CPU time; docs/examples.py runs it and records the output"


def skip_reason(words: List[str], text: str) -> str:
    """Why a parsed command is not run here."""
    joined = " ".join(words)
    if "--config phase2" in joined and "model.num_hidden_layers=" in joined and "--steps 3" in joined:
        return ("BERT-Large shape cut down: seconds on an idle 2-core machine, a minute under load (the mock's "
                "36 micro-batches); docs/examples.py runs it, tests/run/test_run.py and tests/ipu/test_ipu_* cover the paths")
    if "--backend ipu" in joined or text.startswith("poprun"):
        return "needs IPUs and the Poplar SDK"
    if "--backend cuda" in joined and "cuda.device=cpu" not in joined or "-m cuda" in joined:
        return "needs an NVIDIA GPU"
    if any(w.startswith("benchmarks/") for w in words):
        return "a benchmark: minutes on a quiet machine (docs/benchmarks.md has its figures)"
    if any(PLACEHOLDER.search(w) for w in words[1:]):
        return "a synopsis with placeholders: options checked, nothing to run it on"
    if "--init-checkpoint" in words:
        return "needs a pre-trained checkpoint and the data files it names"
    if "--config phase2" in joined and "num_hidden_layers" not in joined or "--profile" in joined:
        return "BERT-Large (or its profile) on a CPU: hours, or minutes for the profile"
    if "bert_packed.data" in joined or "data.path=" in joined:
        return "needs the corpus files of the commands before it (bible-kjv, minutes); docs/examples.py runs them"
    if text.startswith("torchrun"):
        return "two processes, seconds each to start; docs/examples.py runs it"
    return SLOW


def _expected_outputs(command: DocCommand) -> List[str]:
    """The lines printed under ``command`` in its block (up to the next ``$`` line)."""
    text = open(os.path.join(ROOT, command.doc)).read().splitlines()
    out = []
    for line in text[command.line:]:
        if line.startswith(("$ ", "```")):
            break
        if not line.startswith("    "):  # continuation lines of the command are indented
            out.append(line)
    return out


def run_here(command: DocCommand, words: List[str], tmp_path, monkeypatch, capsys) -> None:
    """run.py in this process (the suite has torch loaded), in a scratch directory; a printed
    ``error:`` line must equal the doc's (up to its ``...``)."""
    import importlib

    import run

    monkeypatch.chdir(tmp_path)
    if words[1] == "-m":
        status = importlib.import_module(MODULE_MAINS[words[2]]).main(words[3:] + list(RUNS[command.key]))
        captured = capsys.readouterr()
        assert status in (0, None), captured.err
        _same_table(_expected_outputs(command), captured.out.splitlines())
        return
    expected = [line for line in _expected_outputs(command) if line.startswith("error: ")]
    if expected and "torch 2.13.0+cpu" in expected[0]:
        import torch

        if torch.__version__ != "2.13.0+cpu":  # (with a GPU the command would train)
            pytest.skip(f"the doc's line is for torch 2.13.0+cpu, this is {torch.__version__}")
    argv = words[2:] + list(RUNS[command.key]) + ["--no-progress"] * ("--print-config" not in words)
    status = run.main(argv)
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    if expected:
        assert status == 2 and len(errors) == 1, captured.err
        want = expected[0][:-len("...")] if expected[0].endswith("...") else expected[0]
        assert errors[0].startswith(want) if expected[0].endswith("...") else errors[0] == want, errors[0]
    else:
        assert status == 0, captured.err


def _same_table(expected: List[str], printed: List[str]) -> None:
    """A printed table (``packing report``) equals the doc's but for its ``seconds`` column,
    which depends on the machine; nothing to compare where the doc prints nothing."""
    if not expected or all(line in ("", "...") for line in expected):
        return

    def without_seconds(lines):
        """Each line's words but the one under the header's ``seconds`` (right-aligned)."""
        header = next((line for line in lines if " seconds " in line), None)
        end = header.index(" seconds ") + len(" seconds") if header else -1
        return [[w.group() for w in re.finditer(r"\S+", line) if not w.start() < end <= w.end()]
                for line in lines if line.strip()]

    assert without_seconds(printed) == without_seconds(expected)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(command, tmp_path, monkeypatch, capsys):
    if any(line.startswith("error: ") for line in _expected_outputs(command)):
        # A documented mistake: refused with the doc's line (run, not parsed: parsing refuses it).
        assert command.key in RUNS, f"{command.text}: an error example must be run"
        run_here(command, shlex.split(command.text), tmp_path, monkeypatch, capsys)
        return
    words = check_parses(command)
    if words is None:
        words_ = shlex.split(command.text, comments=True)
        reason = NOT_PYTHON.get(words_[0]) or EXTERNAL_MODULES.get(words_[2] if len(words_) > 2 else "", "")
        pytest.skip(f"parsed; not run: {reason or 'a synopsis with placeholders: options checked'}")
    if command.key in RUNS:
        run_here(command, words.split(), tmp_path, monkeypatch, capsys)
        return
    pytest.skip(f"parsed; not run: {skip_reason(words.split(), command.text)}")


def test_every_run_entry_is_documented():
    """A command the table runs that the docs no longer show would test nothing."""
    texts = {c.key for c in COMMANDS}
    assert not [t for t in RUNS if t not in texts]


def test_the_commands_found_cover_the_docs():
    """The extraction finds the commands of each doc that has some (a change to the block
    format that hid them would otherwise pass silently)."""
    found = {c.doc for c in COMMANDS}
    for doc in ("README.md", "docs/cuda.md", "docs/data.md", "docs/finetuning.md", "docs/ipu.md",
                "docs/profiling.md", "docs/benchmarks/cuda.md", "docs/benchmarks/trainer.md"):
        assert doc in found, doc
    assert len(COMMANDS) >= 60, len(COMMANDS)


@pytest.mark.parametrize("doc,line,code", list(python_blocks()), ids=lambda v: str(v)[:40])
def test_python_block(doc, line, code, capsys):
    """A Python block compiles; one whose prints are followed by ``# expected`` comments runs
    and prints them."""
    prints = re.search(r"^print\(", code, re.M)
    expected = [m.group(1) for m in re.finditer(r"^# (.+)$", code, re.M)] if prints else []
    try:
        compiled = compile(code, f"{doc}:{line}", "exec")
    except SyntaxError as exc:
        if expected:
            raise
        pytest.skip(f"a sketch in pseudo-code (line {exc.lineno} is not Python), nothing printed to compare")
    if not expected:
        pytest.skip("compiles; a sketch of an API, with nothing printed to compare")
    exec(compiled, {"__name__": "doc_block"})
    assert capsys.readouterr().out.splitlines() == expected


# -- The printed examples are what docs/examples.py generated ------------------------------------


def _examples():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import examples
    finally:
        sys.path.remove(os.path.join(ROOT, "docs"))
    return examples


def test_each_generated_block_is_its_record():
    examples = _examples()
    names = {e.name for e in examples.EXAMPLES}
    seen = set()
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for name, start, end in examples.blocks(text):
            assert name in names, f"{doc}: marker {name!r} has no example in docs/examples.py"
            with open(examples.record_path(name)) as f:
                assert text[start:end] == f.read(), f"{doc}: the {name} block differs from docs/examples/{name}.txt; " \
                                                f"run python docs/examples.py {name}"
            seen.add(name)
    assert seen == names, f"examples without a marker: {sorted(names - seen)}"


def test_each_record_shows_the_commands_the_script_runs():
    """A record's ``$`` commands are the script's, in order (a command edited in the doc but not
    in the script, or the other way round, fails here or in the block check above)."""
    examples = _examples()
    documented = {c.key for c in COMMANDS + inline_commands()}
    for example in examples.EXAMPLES:
        with open(examples.record_path(example.name)) as f:
            record = f.read()
        if example.table_from:  # a table of an output file: a block of the docs shows its command
            for command in example.commands:
                assert " ".join(command.argv()) in documented, command.shown
            continue
        if not example.show_commands:  # an output alone, which the prose explains: a command that parses
            for command in example.commands:
                check_parses(DocCommand("docs/examples.py", 0, " ".join(command.argv())))
            continue
        shown = ["$ " + command.shown for command in example.commands]
        at = 0
        for text in shown:
            found = record.find(text + "\n", at)
            assert found == at or found > at and record[found - 1] == "\n", f"{example.name}: {text!r} not in order"
            at = found + len(text)
        assert record.startswith(shown[0] + "\n"), example.name
        assert record.count("\n$ ") == len(shown) - 1, example.name


@pytest.mark.parametrize("text", [
    "python run.py --stpes 3",                                   # run.py's parser
    "python run.py --config demo --set train.stpes=3",           # a --set key
    "python run.py --config nosuchconfig",                       # a config name
    "python run.py --backend cpu --config demo --set model.hidden_size=-1",  # a value out of range
    "python -m packing report --no-such-flag",                   # a module's parser
    "python -m bert_packed.data pack --input a.h5 --outptu b.h5",  # a subcommand's parser
    "python -m bert_packed.nosuch --help",                       # a module that does not exist
    "python benchmarks/model_speed.py --no-such 7",              # a benchmark's parser
    "python benchmarks/nosuch.py",                               # a script that does not exist
    "python run.py --backend B --config NAME [--stpes N]",       # a synopsis' option
    "python run.py --config NAME [--set finetune.txt_column=X]",  # a synopsis' --set key
])
def test_a_wrong_command_in_the_docs_fails_the_check(text):
    """The check can fail: each of these is refused (a test failure, not a skip)."""
    from bert_packed.config import ConfigError

    with pytest.raises((AssertionError, ConfigError, SystemExit, pytest.fail.Exception)):
        check_parses(DocCommand("test", 1, text))


# -- Commands named in the prose (`python ...` in backticks) ---------------------------------------


def inline_commands() -> List[DocCommand]:
    """`python ...` spans outside the fenced blocks (often a name with a flag or two)."""
    out = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        prose = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in re.finditer(r"`((?:nice -n \d+ )?(?:python|torchrun) [^`]+)`", prose):
            out.append(DocCommand(doc, prose[:m.start()].count("\n") + 1, " ".join(m.group(1).split())))
    return out


def _entry_source(argv: List[str]) -> str:
    """The source text of the entry point ``python ARGV`` names (all of a package's files)."""
    if argv[0] == "-m":
        path = os.path.join(ROOT, *argv[1].split("."))
        if os.path.isdir(path):
            assert os.path.isfile(os.path.join(path, "__main__.py")), f"{argv[1]} has no __main__.py"
            return "".join(open(p).read() for p in glob.glob(os.path.join(path, "**", "*.py"), recursive=True))
        assert os.path.isfile(path + ".py"), f"no module {argv[1]}"
        source = open(path + ".py").read()
    else:
        assert os.path.isfile(os.path.join(ROOT, argv[0])), f"no script {argv[0]}"
        source = open(os.path.join(ROOT, argv[0])).read()
    assert re.search(r"""__name__ == ["']__main__["']""", source), f"{' '.join(argv[:2])} runs nothing"
    # A benchmark's options may come from a module of benchmarks/ it shares (vs_hf_trainer_common.py).
    for m in re.finditer(r"^from benchmarks(?:\.(\w+) import| import (\w+))", source, re.MULTILINE):
        shared = os.path.join(ROOT, "benchmarks", (m.group(1) or m.group(2)) + ".py")
        if os.path.isfile(shared):
            source += open(shared).read()
    return source


def check_inline(command: DocCommand) -> None:
    """Static: the entry point exists and runs something, and each ``--flag`` is one it declares
    (run.py: its parser, ``--set`` keys: the config's)."""
    words = _strip_launchers(shlex.split(command.text))
    argv = words[1:]
    if argv[:2] == ["-m", "pytest"]:
        for path in argv[2:]:
            assert not path.startswith("tests/") or glob.glob(os.path.join(ROOT, path)), f"no test file {path}"
        return
    if argv[0] == "run.py":
        check_run_py(argv[1:], synopsis=True)
        return
    source = _entry_source(argv)
    unknown = [flag for flag in _flags(argv) if f'"{flag}"' not in source and f"'{flag}'" not in source]
    assert not unknown, f"{' '.join(argv[:2])} declares no {unknown}"


def test_commands_named_in_the_prose_exist():
    """Every `python ...` in the prose names an entry point that exists and runs something, with
    flags it declares; ``python -c`` snippets are left out (they import poptorch)."""
    commands = [c for c in inline_commands() if not c.text.startswith("python -c")]
    assert len(commands) >= 40, len(commands)
    failures = []
    for command in commands:
        try:
            check_inline(command)
        except (AssertionError, ValueError) as exc:
            failures.append(f"{command.doc}:{command.line}: `{command.text}`: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("text", [
    "python -m packing.nosuch",                       # no module
    "python -m packing.lp --time-limit 3",            # a module that runs nothing
    "python -m packing report --no-such-flag",        # a flag it does not declare
    "python run.py --stpes 3",                        # run.py's parser
    "python run.py --set train.stpes=3",              # a --set key
    "python -m pytest -q tests/test_nosuch.py",       # a test file
    "python benchmarks/nosuch.py --steps 3",          # a script
])
def test_a_wrong_command_in_the_prose_fails_the_check(text):
    with pytest.raises(AssertionError):
        check_inline(DocCommand("test", 1, text))
