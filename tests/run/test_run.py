"""run.py: defaults, the real phase2 config on cpu with size overrides, one-line errors."""
import json
import os
import subprocess
import sys

import pytest
import torch

import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_arguments_means_the_demo_on_cpu():
    args = run.parse_args([])
    assert (args.config, args.backend, args.overrides, args.resume) == ("demo", "cpu", [], False)


def test_phase2_starts_on_cpu_with_only_size_overrides(tmp_path):
    # BERT-Large phase 2 as shipped (S=512, K=3, 78 MLM slots, LAMB 0.002828, lpfhp) shrunk
    # in size only, so the real config is what runs.
    sizes = ["model.num_hidden_layers=1", "model.hidden_size=64", "model.num_attention_heads=2",
             "model.intermediate_size=128", "train.micro_batch_size=1", "train.gradient_accumulation=2",
             "data.num_sequences=300", "train.checkpoint_every=0", "train.num_threads=1"]
    argv = ["--config", "phase2", "--steps", "2", "--no-progress", "--output-dir", str(tmp_path)]
    for override in sizes:
        argv += ["--set", override]
    assert run.main(argv) == 0
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert (summary["config"], summary["max_sequence_length"], summary["max_sequences_per_pack"]) == ("phase2", 512, 3)
    resolved = summary["config_resolved"]
    assert resolved["optimizer"]["learning_rate"] == 0.002828 and resolved["data"]["max_masked_tokens"] == 76
    assert summary["last"]["step"] == 2 and summary["last"]["tokens"] > 512  # several sequences per pack


BAD = [
    (["--config", "no_such_config"], "unknown config 'no_such_config'"),
    (["--config", "tiny", "--set", "train.stepz=3"], "unknown key train.stepz"),
    (["--config", "tiny", "--set", "train.steps=three"], "train.steps: expected int"),
    (["--config", "phase2", "--backend", "mock", "--set", "model.num_hidden_layers=4"],
     "layers_per_ipu=[3, 7, 7, 7] sums to 24 but model.num_hidden_layers=4"),
    (["--config", "tiny", "--set", "train.global_batch_size=12", "--set", "train.micro_batch_size=8"],
     "global_batch_size=12 is not divisible"),
    (["--config", "tiny", "--backend", "tpu"], "unknown backend 'tpu'; available: cpu, cuda, ipu, mock"),
]
if not torch.cuda.is_available():
    BAD.append((["--config", "tiny", "--backend", "cuda"], "backend 'cuda' is not available"))


@pytest.mark.parametrize("argv, fragment", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_configuration_is_one_line_and_exit_2(argv, fragment, capsys, tmp_path):
    assert run.main(argv + ["--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


def test_bad_configuration_from_a_real_process_has_no_traceback():
    result = subprocess.run([sys.executable, "run.py", "--config", "tiny", "--set", "data.nope=1"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error: --set: unknown key data.nope") and result.stderr.count("\n") == 1
