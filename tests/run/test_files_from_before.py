"""Files written before the folder moves of issue 48 load after them: a run directory (our
checkpoint, its Hugging Face export) and a packed sharded dataset, all made by the code of the
commit before the moves (tests/fixtures/before_issue48: the tiny config, 2 steps; KJV Gen 1-5
through create and pack with 2 shards at S=64)."""
import json
import shutil
from pathlib import Path

import pytest

import run

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "before_issue48"
QUIET = ["--config", "tiny", "--no-progress", "--set", "train.tensorboard=false"]


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.fixture
def before(tmp_path):
    copy = tmp_path / "before"
    shutil.copytree(FIXTURES, copy)
    return copy


def test_a_checkpoint_from_before_resumes_as_a_run_of_today_continues(before, tmp_path):
    argv = QUIET + ["--set", "train.checkpoint_every=2"]
    assert run.main(argv + ["--steps", "4", "--output-dir", str(before / "run"), "--resume"]) == 0
    # Today's code, the same way: 2 steps (as the fixture was made), then resumed to 4.
    assert run.main(argv + ["--steps", "2", "--output-dir", str(tmp_path / "today")]) == 0
    assert run.main(argv + ["--steps", "4", "--output-dir", str(tmp_path / "today"), "--resume"]) == 0
    resumed, today = _losses(before / "run"), _losses(tmp_path / "today")
    # Steps 1-2 were trained by the old code, 3-4 by today's from its checkpoint: the same numbers
    # as today's code throughout.
    assert sorted(resumed) == [1, 2, 3, 4]
    assert resumed == today


def test_an_export_from_before_initialises_a_run(before, tmp_path):
    from bert_packed.io import hf_io

    pretrained = hf_io.read_pretrained(str(before / "run" / "hf"))
    assert pretrained is not None
    out = tmp_path / "init"
    assert run.main(QUIET + ["--steps", "1", "--init-checkpoint", str(before / "run" / "hf"), "--output-dir", str(out)]) == 0
    assert _losses(out).keys() == {1}


def test_a_packed_dataset_from_before_trains(before, tmp_path):
    out = tmp_path / "packed-run"
    assert run.main(QUIET + ["--steps", "2", "--set", f"data.path={before / 'packed'}", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and sorted(_losses(out)) == [1, 2]
