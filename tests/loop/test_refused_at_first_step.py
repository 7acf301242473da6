"""A run refused at its start (an attention this device cannot run: refused from the
implementation's declared capabilities, before the model first runs) writes nothing: no metrics.jsonl, no tensorboard folder, no lock, no folder it made
(issue 46: "a refused attention choice leaves an empty metrics.jsonl")."""
import os

import pytest

from hostile import main_error


@pytest.mark.parametrize("attention, needle", [("varlen", "cannot train model.attention_implementation=varlen"),
                                               ("flex", "cannot train model.attention_implementation=flex")])
def test_an_attention_the_cpu_cannot_run_leaves_nothing(tmp_path, capsys, attention, needle):
    output = tmp_path / "runs" / "demo"
    argv = ["--config", "demo", "--backend", "cpu", "--steps", "1", "--output-dir", str(output),
            "--set", f"model.attention_implementation={attention}", "--set", "train.tensorboard=true"]
    code, line = main_error(capsys, argv)
    assert code == 2 and line.startswith("error: ") and needle in line, line
    assert not (tmp_path / "runs").exists()
    # A folder the user made stays, and stays empty.
    output.mkdir(parents=True)
    code, _ = main_error(capsys, argv)
    assert code == 2 and os.listdir(output) == []
