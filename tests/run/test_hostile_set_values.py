"""A huge ``--set`` value (issue 46): the error names the key and shows only the value's start and
its length, whatever the key (a path, a name, a list element, the section or key itself), exit 2,
one line, nothing written. Was: "init checkpoint xxxx...[100,001 characters]...xxxx: no such file
or directory" (the value, not the key), the same for data.path and data.histogram."""
import os

import pytest

from hostile import main_error

LONG = "x" * 100_000
SHOWN = f"{'x' * 40!r}... is 100,000 characters long; a name or path setting takes at most 4,096"


def refused(capsys, tmp_path, config, setting):
    out = tmp_path / "out"
    argv = ["--config", config, "--no-progress", "--output-dir", str(out), "--steps", "1", "--set", setting]
    code, line = main_error(capsys, argv)
    assert not out.exists() or sorted(os.listdir(out)) == [".lock"]
    assert code == 2 and len(line) < 500, (code, line[:300])
    return line


@pytest.mark.parametrize("key", ["model.init_checkpoint", "model.tokenizer", "data.path", "data.eval_path",
                                 "data.histogram", "data.packing_algorithm", "train.output_dir", "model.hidden_act"])
def test_a_huge_text_value_names_its_key(capsys, tmp_path, key):
    assert refused(capsys, tmp_path, "tiny", f"{key}={LONG}") == f"error: --set: {key}: {SHOWN}"


@pytest.mark.parametrize("key", ["finetune.train_file", "finetune.validation_file", "finetune.metric_for_best_model"])
def test_a_huge_fine_tuning_value_names_its_key(capsys, tmp_path, key):
    line = refused(capsys, tmp_path, "finetune_classification", f"{key}={LONG}")
    assert line == f"error: --set: {key}: {SHOWN}"


def test_a_huge_list_for_a_text_setting_names_its_key(capsys, tmp_path):
    line = refused(capsys, tmp_path, "tiny", f"data.path=[{LONG}]")
    assert line == f"error: --set: data.path: expected str, got ['{'x' * 58}... (100,004 characters written out) (list)"


def test_a_value_of_the_longest_path_length_is_taken():
    from bert_packed.config import load_config

    import backends

    backends.register_config_sections()
    assert load_config("tiny", [f"data.histogram={'y' * 4096}"]).data.histogram == "y" * 4096


def test_a_huge_section_or_key_name_is_shortened(capsys, tmp_path):
    line = refused(capsys, tmp_path, "tiny", f"{LONG}.steps=1")
    assert line.startswith(f"error: --set: unknown section {'x' * 59!r}"[:-1] + "... (100,000 characters); sections are")
    line = refused(capsys, tmp_path, "tiny", f"train.{LONG}=1")
    assert line.startswith(f"error: --set: unknown key train.{'x' * 59!r}"[:-1] + "... (100,000 characters); keys of "
                           "train: ")
