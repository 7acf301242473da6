"""Every benchmark's dry run (tiny shapes, seconds), imported as the ``benchmarks`` package: it runs
and prints the rows it should, with every number finite; and the helper is what they share."""
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

import pytest

from benchmarks.common import ROOT

SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
HELPERS = {"__init__", "common", "vs_hf_trainer_common", "cuda_setups"}  # modules the scripts import, no main
# Benchmarks whose dry runs have tests of their own (test name: where).
ELSEWHERE = {"cuda_throughput": "tests/benchmarks/test_cuda_throughput.py",
             "cuda_profile": "tests/benchmarks/test_cuda_profile.py",
             "data_task_times": "test_data_task_times_tables_every_phase_of_create (below)"}


@dataclass
class DryRun:
    script: str
    argv: Sequence[str]  # "{tmp}" stands for the test's temporary folder
    row: str  # a regular expression: the lines that are the benchmark's rows
    rows: int  # at least this many
    slow: bool = False  # tens of seconds or more (subprocesses that import torch and train)
    needs: Sequence[str] = ()  # modules, files or ("bin:NAME") programs without which the script cannot run
    subprocess: bool = False  # run as ``python -m benchmarks.NAME`` (it patches classes or changes directory)


TABLE_ROW = r"^\| (?!-)"
DRY_RUNS = [
    DryRun("attention_buckets", ["--repeats", "2", "--packs", "2", "--seq-len", "32", "--max-sequences", "3",
                                 "--skip-model", "--threads", "1"], r"^\| attention fwd\+bwd", 4),
    DryRun("convergence", ["--preset", "dry", "--workdir", "{tmp}/work", "--plot", "{tmp}/convergence.png",
                           "--sequential"], r"^\| (packed|unpacked)", 2, slow=True, needs=["bin:bible"]),
    DryRun("data_create_scale", ["--dry-run"], r"^\| 1 \| .* \| shards \| 1 \|", 1, needs=["bin:bible"]),
    DryRun("data_end_to_end", ["--dry-run", "--work", "{tmp}/work"], r"^\| (create|pack|resume|all) \|", 4, slow=True,
           needs=["bin:bible"]),
    DryRun("data_engine_overhead", ["--tasks", "10", "--workers", "2", "--repeats", "2"],
           r"10 empty tasks on 2 local workers: [\d.]+ s \([\d.]+-[\d.]+ over 2 call\(s\)\)", 1, slow=True),
    DryRun("data_pack_memory", ["--num-sequences", "2000", "--workdir", "{tmp}/work"], r'^ "(num_packs|seconds|peak_rss_mib)": [\d.]+', 3),
    DryRun("data_pack_scale", ["--dry-run", "--workdir", "{tmp}/work"], r"^\| 1 \| [\d.]+ \|", 1),
    DryRun("data_reader", ["--packs", "256", "--shards", "2", "--micro-batch", "8", "--seconds", "0.2",
                           "--workdir", "{tmp}/work"], r"^\| (HDF5Source|ShardedSource)", 4),
    DryRun("finetune_fortunes", ["--dry-run", "--output-dir", "{tmp}/out"], r"^\| (packed|padded) \|", 2, slow=True,
           needs=["transformers", "/usr/share/games/fortunes"]),
    DryRun("ipu_fp16_mock_curve", ["--steps", "2"], r"^(fp16|fp32): cpu loss [\d.]+ -> [\d.]+", 2),
    DryRun("ipu_mock_cycles", ["--config", "tiny", "--depths", "1", "3"], r"^\| [13] \| [\d,]+", 2),
    DryRun("model_speed", ["--tiny", "--repeats", "1", "--depths", "3", "--attention", "dense"], r"median +[\d.]+ ms", 3,
           needs=["transformers"]),
    DryRun("optimizer_step", ["--rounds", "1", "--threads", "1", "--dry-run"], TABLE_ROW, 3),
    DryRun("packing_equivalence", ["--compare-with", ROOT, "--dry-run"], r"^\d+ results, 0 differ$", 1),
    DryRun("packing_long_limit", ["--max-sequence-length", "1000", "--cases", "from_lengths", "pack:lpfhp",
                                  "--memory-limit-gib", "4"], r"^\| (from_lengths|pack:lpfhp) \| this \|", 2),
    DryRun("packing_lp_master", ["--dry-run"], r"scipy / highs \(best of 2 each\): [\d.]+x", 1),
    DryRun("packing_peers", ["--cases", "squad-384", "--depths", "8", "--algorithms", "lpfhp", "spfhp",
                             "--skip-peers", "--time-limit", "2", "--timeout", "120"],
           r"^squad-384 +(lpfhp|spfhp) +8 +[\d,]+", 2),
    DryRun("packing_small_inputs", ["--sequences", "200", "--cases", "squad-384", "--depths", "3", "max"],
           r"^squad-384 depth (3|max): [\d,]+ packs", 2),
    DryRun("packing_split_scale", ["--shards", "4", "--sequences", "4000"], r"^4 shards, 4,000 sequences, lp: global plan",
           1),
    DryRun("profile_step", ["--output", "{tmp}/profile.json", "--warmup", "1", "--steps", "2", "--", "--config", "tiny",
                            "--steps", "3", "--output-dir", "{tmp}/run", "--no-progress",
                            "--set", "train.eval_every=0"], r"^\| step/", 5, subprocess=True),
    DryRun("sentence_splitters", ["--mib", "0.05"], r"^\| (blingfire|pysbd) \| [\d.]+ \|", 1,
           needs=["bin:bible", "blingfire", "pysbd"]),
    DryRun("squad_packed_vs_padded", ["--workdir", "{tmp}/work", "--train-paragraphs", "6", "--dev-paragraphs", "3",
                                      "--epochs", "1", "--repeats", "1", "--layers", "1", "--hidden", "32",
                                      "--heads", "2"], r"^\| (packed|padded) \|", 2, slow=True, needs=["tokenizers"]),
    DryRun("train_packed_vs_padded", ["--config", "tiny", "--steps", "2", "--block", "1", "--warmup", "1"],
           r"^\| (packed|padded) \| [13] \|", 2),
] + [DryRun(f"vs_hf_trainer_{task}", ["--dry-run", "--output-dir", "{tmp}/out", "--threads", "1"],
            r"^\| (HF Trainer|packed-bert)", 2, slow=True, needs=["transformers", "datasets", "accelerate"]
            + (["seqeval"] if task == "ner" else []))
     for task in ("classification", "pretraining", "ner", "qa")]


def test_every_benchmark_has_a_dry_run():
    """A new script without a dry run here fails (or names the test that runs it)."""
    covered = {d.script for d in DRY_RUNS} | set(ELSEWHERE) | HELPERS
    assert sorted(set(SCRIPTS) - covered) == []
    assert sorted(covered - set(SCRIPTS)) == []  # nothing listed that is gone


def _missing(needs):
    for need in needs:
        if need.startswith("bin:"):
            if shutil.which(need[4:]) is None:
                return f"the {need[4:]} program (a Debian package) is not installed"
        elif need.startswith("/"):
            if not os.path.exists(need):
                return f"{need} (a Debian package) is not installed"
        elif importlib.util.find_spec(need) is None:
            return f"the {need} package is not installed"
    return None


def check_rows(out: str, row: str, rows: int) -> None:
    """At least ``rows`` lines match ``row``; every Markdown table is whole (each row as many cells as its
    header); no number printed is NaN or infinite; no row failed."""
    found = [line for line in out.splitlines() if re.search(row, line)]
    assert len(found) >= rows, f"{len(found)} row(s) matching {row!r} in:\n{out}"
    for line in out.splitlines():
        assert not re.search(r"(?<![\w-])[-+]?(nan|inf)(?![\w-])", line, re.IGNORECASE), line
        assert "failed" not in line.lower() or not line.startswith("|"), line
    table = None
    for line in out.splitlines() + [""]:
        if line.startswith("|"):
            cells = len(line.strip()[1:-1].split("|"))
            if table is None:
                table = cells
            assert cells == table, f"a row of {cells} cells under a header of {table}: {line}"
        else:
            table = None


def _argv(argv, tmp_path):
    return [a.replace("{tmp}", str(tmp_path)) for a in argv]


@pytest.mark.parametrize("dry", [pytest.param(d, id=d.script, marks=[pytest.mark.slow] if d.slow else [])
                                 for d in DRY_RUNS])
def test_dry_run(dry, tmp_path, capsys, monkeypatch):
    reason = _missing(dry.needs)
    if reason:
        pytest.skip(reason)
    argv = _argv(dry.argv, tmp_path)
    if dry.subprocess:
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{dry.script}"] + argv, cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
    else:
        monkeypatch.chdir(tmp_path)  # anything written to the working directory lands here
        module = importlib.import_module(f"benchmarks.{dry.script}")
        try:
            status = module.main(argv)
        except SystemExit as exc:
            status = exc.code
        assert status in (0, None), capsys.readouterr()
        out = capsys.readouterr().out
    check_rows(out, dry.row, dry.rows)


@pytest.mark.parametrize("out", [
    "| a | b |\n|---|---|\n| x | 1.0 |\n| y | nan |",          # a NaN
    "| a | b |\n|---|---|\n| x | 1.0 | 2.0 |",                    # a row wider than its header
    "| a | b |\n|---|---|\n| x | failed: no compiler |",         # a failed row
    "| a | b |\n|---|---|",                                       # no rows
])
def test_the_check_refuses_what_a_broken_dry_run_prints(out):
    with pytest.raises(AssertionError):
        check_rows(out, r"^\| [xy] \|", 1)


def test_the_helper_is_shared_and_every_benchmark_fits_the_size_rules():
    """benchmarks.common is imported by the scripts; none is over 600 lines, no function over 100."""
    import ast

    scripts = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
    users = [os.path.basename(p) for p in scripts
             if re.search(r"^from benchmarks\.common import", open(p).read(), re.MULTILINE)]
    assert len(users) >= 15, users
    for path in scripts:
        with open(path) as f:
            source = f.read()
        assert len(source.splitlines()) <= 600, path
        long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100]
        assert not long, (path, long)


def test_ipu_mock_cycles_prints_one_row_per_depth(capsys):
    from benchmarks import ipu_mock_cycles

    assert ipu_mock_cycles.main(["--config", "tiny", "--depths", "1", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| K | est. cycles") and [row.split(" | ")[0] for row in table[1:]] == ["| 1", "| 3"]
    per_micro = [int(row.split(" | ")[1].replace(",", "")) for row in table[1:]]
    assert 0 < per_micro[0] < per_micro[1]  # deeper packs: the mask and loss unpacking cost cycles


def test_ipu_mock_cycles_bad_config_is_one_line(capsys):
    from benchmarks import ipu_mock_cycles

    assert ipu_mock_cycles.main(["--config", "tiny", "--set", "model.hidden_size=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_data_task_times_tables_every_phase_of_create(tmp_path, capsys):
    from benchmarks import data_task_times
    from bert_packed.data.prepare.vocab import train_vocab
    from test_data_create import synthetic_corpus

    text = synthetic_corpus(tmp_path / "corpus.txt", num_documents=12)
    vocab = tmp_path / "vocab.txt"
    train_vocab(text, 200, vocab)
    status = data_task_times.main(["create", "--input", str(text), "--vocab", str(vocab), "--output",
                                   str(tmp_path / "out"), "--max-seq-length", "64", "--max-predictions", "8",
                                   "--dupe-factor", "1", "--seed", "1", "--workers", "1"])
    assert status in (0, None)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| phase | wall s | tasks")
    assert len(table) >= 2 and all(int(row.split(" | ")[2]) >= 1 for row in table[1:])
