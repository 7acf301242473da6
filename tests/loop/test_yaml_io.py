"""bert_packed.io.yaml_io: YAML with duplicate keys refused (both lines named), alias expansion
bounded (a "billion laughs" document refused quickly in little memory, anchors still fine),
and files that are not UTF-8 refused naming the file, line and byte."""
from __future__ import annotations

import time
import tracemalloc

import pytest

from bert_packed.io.yaml_io import MAX_NODES, YamlError, YamlSyntaxError, load_yaml, loads_yaml


def write(tmp_path, content, name="c.yaml"):
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def error(path_or_text, **kwargs):
    with pytest.raises(YamlError) as info:
        if hasattr(path_or_text, "read_bytes"):
            load_yaml(str(path_or_text), **kwargs)
        else:
            loads_yaml(path_or_text, "c.yaml", **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_reads_what_safe_load_reads(tmp_path):
    import yaml

    text = ("model:\n  hidden_size: 128\n  dropout: 1.0e-1\ntrain:\n  steps: 10\n  layers: [1, 2]\n"
            "  name: null\n  flag: yes\n")
    assert load_yaml(str(write(tmp_path, text))) == yaml.safe_load(text)
    assert load_yaml(str(write(tmp_path, ""))) is None
    assert issubclass(YamlError, ValueError)


def test_a_duplicate_key_is_refused_naming_both_lines(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\n  micro_batch_size: 4\n  steps: 1000\nmodel: {}\n")
    assert error(path) == (f"{path}: line 4: key 'steps' is already set on line 2 of the same mapping; which value "
                           f"is meant is ambiguous: keep one")


def test_a_duplicate_section_is_refused(tmp_path):
    path = write(tmp_path, "train:\n  steps: 10\nmodel:\n  hidden_size: 8\ntrain:\n  seed: 1\n")
    assert error(path) == (f"{path}: line 5: key 'train' is already set on line 1 of the same mapping; which value "
                           f"is meant is ambiguous: keep one")


def test_a_duplicate_key_in_a_flow_mapping_is_refused():
    assert error("a: {x: 1, y: 2, x: 3}\n") == ("c.yaml: line 1: key 'x' is already set on line 1 of the same "
                                                "mapping; which value is meant is ambiguous: keep one")


def test_the_same_key_in_different_mappings_and_merge_overrides_are_fine():
    text = ("base: &base {lr: 0.1, steps: 5}\n"
            "a:\n  <<: *base\n  steps: 7\n"      # a merge's keys may be overridden: that is what it is for
            "b:\n  steps: 9\n")
    assert loads_yaml(text) == {"base": {"lr": 0.1, "steps": 5}, "a": {"lr": 0.1, "steps": 7}, "b": {"steps": 9}}


def test_anchors_and_aliases_are_not_banned():
    text = "ipu: &layout {layers_per_ipu: [0, 4, 4, 4], replication_factor: 4}\nother: *layout\n"
    data = loads_yaml(text)
    assert data["other"] == {"layers_per_ipu": [0, 4, 4, 4], "replication_factor": 4}


def billion_laughs(levels=9, width=9):
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_document_is_refused_quickly_in_little_memory(tmp_path):
    path = write(tmp_path, billion_laughs())  # 9^10: 3.5 billion values when expanded, 700 bytes of text
    tracemalloc.start()
    start = time.perf_counter()
    try:
        message = error(path)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == (f"{path}: the document expands to more than {MAX_NODES:,} values (aliases of aliases: a "
                       f"\"billion laughs\" document?); a config is far smaller: write it out without the nesting")
    assert seconds < 2.0 and peak < 20 * 2 ** 20, (seconds, peak)


def test_the_bound_counts_expanded_values_not_text():
    small = billion_laughs(levels=2, width=9)  # 1 + 9 * (1 + 9 * (1 + 9)) values in l2 alone
    assert len(loads_yaml(small)["l2"]) == 9
    assert "expands to more than 500 values" in error(small, max_nodes=500)


def test_a_recursive_alias_is_refused():
    assert error("a: &a [1, *a]\n") == ("c.yaml: line 1: an alias refers to a collection that contains it (a "
                                        "recursive alias); it would expand forever")


def test_a_non_utf8_file_is_refused_naming_the_file_line_and_byte(tmp_path):
    path = write(tmp_path, "model:\n  tokenizer: caf\xe9/vocab.txt\n".encode("latin-1"))
    assert error(path) == (f"{path}: line 2: not UTF-8 (byte 0xe9 at byte offset 23, column 17); save the file as "
                           f"UTF-8, e.g. iconv -f <encoding> -t utf-8")
    utf16 = write(tmp_path, "train:\n  steps: 1\n".encode("utf-16"), "u16.yaml")
    assert error(utf16) == (f"{utf16}: line 1: not UTF-8 (byte 0xff at byte offset 0, column 1: a UTF-16 byte-order "
                            f"mark); save the file as UTF-8, e.g. iconv -f <encoding> -t utf-8")


def test_a_utf8_byte_order_mark_is_fine(tmp_path):
    assert load_yaml(str(write(tmp_path, b"\xef\xbb\xbftrain:\n  steps: 3\n"))) == {"train": {"steps": 3}}


def test_syntax_errors_name_the_file_line_and_column(tmp_path):
    path = write(tmp_path, "train:\n  steps: [1, 2\nmodel: x\n")
    message = error(path)
    assert message.startswith(f"{path}: line 3, column 6: not valid YAML (while parsing a flow sequence"), message


def test_only_text_that_is_not_yaml_is_a_syntax_error():
    # A --set value that is not YAML stays the string typed; a duplicate key or an alias bomb
    # in one must not fall back to that string.
    with pytest.raises(YamlSyntaxError):
        loads_yaml("[1, 2", "--set a.b")
    for text in ("{x: 1, x: 2}", billion_laughs().replace("\n", ", ").join("{}")):
        with pytest.raises(YamlError) as info:
            loads_yaml(text, "--set a.b")
        assert not isinstance(info.value, YamlSyntaxError), str(info.value)


def test_python_objects_are_refused_as_safe_load_does():
    assert error("a: !!python/object/apply:os.system ['true']\n").startswith(
        "c.yaml: line 1, column 4: not valid YAML (could not determine a constructor for the tag")


def test_absurd_nesting_is_an_error_not_a_traceback():
    assert error("a: " + "[" * 3000 + "]" * 3000 + "\n") == ("c.yaml: nested too deeply to read (thousands of "
                                                             "levels); a config is a few levels deep")


# ----------------------------------------------------------------------------- through run.py

@pytest.mark.parametrize("case", ["duplicate", "laughs", "latin-1"])
def test_run_refuses_such_configs_in_one_line_writing_nothing(tmp_path, capsys, case):
    from hostile import assert_unchanged, main_error, snapshot

    config = tmp_path / "c.yaml"
    if case == "duplicate":
        # (Today the second value wins: a hidden size no head count divides, refused for that instead.)
        config.write_text("model:\n  hidden_size: 64\n  hidden_size: 63\n")
        expected = (f"{config}: line 3: key 'hidden_size' is already set on line 2 of the same mapping; which value "
                    f"is meant is ambiguous: keep one")
    elif case == "laughs":
        config.write_text(billion_laughs().replace("l0:", "train:\n  note: x\nl0:"))
        expected = (f"{config}: the document expands to more than {MAX_NODES:,} values (aliases of aliases: a "
                    f"\"billion laughs\" document?); a config is far smaller: write it out without the nesting")
    else:
        config.write_bytes("model:\n  tokenizer: caf\xe9\n".encode("latin-1"))
        expected = (f"{config}: line 2: not UTF-8 (byte 0xe9 at byte offset 23, column 17); save the file as UTF-8, "
                    f"e.g. iconv -f <encoding> -t utf-8")
    before = snapshot(tmp_path)
    assert main_error(capsys, ["--config", str(config), "--output-dir", str(tmp_path / "out")]) == (
        2, f"error: {expected}")
    assert_unchanged(before, tmp_path)
    assert not (tmp_path / "out").exists()
