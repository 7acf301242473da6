"""benchmarks/vs_hf_trainer_*.py: the medians and tables they share (vs_hf_trainer_common.py), on runs
written by hand (no Trainer, no download); the dry runs themselves are in test_scripts.py (slow)."""
import json

import pytest

from benchmarks import vs_hf_trainer_classification as classification
from benchmarks import vs_hf_trainer_common as shared
from benchmarks import vs_hf_trainer_pretraining as pretraining


def _run(row, repeat, loop, accuracy=None, seed=None):
    run = {"row": row, "repeat": repeat, "loop_seconds": loop, "command_seconds": loop + 10, "sequences": 100,
           "tokens": 2000, "steps": 7, "load_average": [1.5, 1.0, 1.0]}
    if accuracy is not None:
        run["dev_accuracy"] = accuracy
    if seed is not None:
        run["seed"] = seed
    return run


RUNS = [_run("hf-grouped", 0, 10.0, 0.75, 0), _run("packed", 0, 5.0, 0.8, 0), _run("hf-grouped", 1, 12.0, 0.77, 1),
        _run("packed", 1, 4.0, 0.78, 1), {"row": "packed-compile", "repeat": 0, "error": "log:\nno C++ compiler"}]


def test_summary_medians_and_the_table_with_a_failed_row():
    summary = shared.summarise(RUNS, ["hf-grouped", "packed", "packed-compile"])
    assert summary["packed"]["loop_seconds"] == {"median": 4.5, "min": 4.0, "max": 5.0, "mean": 4.5,
                                                 "stdev": pytest.approx(0.7071, abs=1e-4)}
    assert summary["packed"]["sequences_per_second"]["max"] == 25.0
    assert summary["packed-compile"] == {"failed": "no C++ compiler"}
    lines = shared.table(summary, {n: classification.FINETUNE_ROWS[n][1] for n in summary}, "hf-grouped").splitlines()
    assert lines[0].startswith("| row | loop s | command s | dev acc | seq/s |") and lines[1].count("---") == 9
    packed = [line for line in lines if line.startswith("| packed-bert, packed (the shipped")][0].split(" | ")
    assert packed[1:4] == ["4.5 (4.0-5.0)", "14.5 (14.0-15.0)", "0.7900 (0.7800-0.8000)"]
    assert packed[-1] == "2.44x |"  # 11.0 / 4.5: the loop speed-up over the grouped Trainer
    assert any("failed: no C++ compiler" in line for line in lines)
    assert all(line.count("|") == lines[0].count("|") for line in lines)  # every row as wide as the header


def test_quality_table_per_seed():
    table = shared.quality_table(RUNS, {"packed": "ours", "hf-grouped": "theirs"}).splitlines()
    assert table[2] == "| ours | 0, 1 | 0.8000, 0.7800 | 0.7900 | 0.0141 | 0.7800-0.8000 |"
    assert table[3].startswith("| theirs | 0, 1 | 0.7500, 0.7700 |")


def test_summarise_a_stopped_benchmark(tmp_path, capsys):
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in RUNS if "error" not in r))
    assert classification.main(["--summarise", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "runs per row: [2]" in out and "| dev acc per seed |" in out
    # The pre-training script's table has no dev column and only its own rows: none here.
    assert pretraining.main(["--summarise", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""


def test_precision_settings_and_dry_run_settings():
    class Args:
        device, bf16, threads, rows, repeats, seed_list, train_size, dev_size = "cpu", False, 1, "a,b", 3, None, 2000, 9

    shared.dry_run_settings(Args, "a,b", "a")
    assert (Args.rows, Args.repeats, Args.train_size, Args.dev_size) == ("a", 1, 48, 9)
    Args.rows = "b"
    shared.dry_run_settings(Args, "a,b", "a")
    assert Args.rows == "b"  # --rows given: kept
