"""The one reader of user text files (bert_packed.io.files.read_utf8 / utf8_lines, issue 36): what the
config loader, the fine-tuning readers and the checkpoint reader share."""
import json

import pytest

from bert_packed.io import hf_io
from bert_packed.io.checkpoint import CheckpointError
from bert_packed.data import DataError
from bert_packed.io.files import read_utf8, utf8_lines
from bert_packed.io.yaml_io import YamlError, load_yaml


def test_read_utf8_drops_a_leading_bom_unless_asked_to_keep_it(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"\xef\xbb\xbfh\xc3\xa9\n\xef\xbb\xbfx")
    assert read_utf8(path) == "h\u00e9\n\ufeffx"  # only the leading mark is a byte-order mark
    assert read_utf8(path, drop_bom=False) == "\ufeffh\u00e9\n\ufeffx"


@pytest.mark.parametrize("error", [DataError, YamlError, CheckpointError])
def test_a_byte_that_is_not_utf8_is_the_callers_error_in_one_line(tmp_path, error):
    path = tmp_path / "latin1.txt"
    path.write_bytes("ok\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(error) as caught:
        read_utf8(path, error)
    assert str(caught.value) == (f"{path}: line 2: not UTF-8 (byte 0xe9 at byte offset 6, column 4); save the file "
                                 f"as UTF-8, e.g. iconv -f <encoding> -t utf-8")


def test_utf8_lines_name_the_line_and_yield_those_before_it(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes(b"\xef\xbb\xbfa\nb\n\xffc\n")
    seen = []
    with open(path, "rb") as handle, pytest.raises(DataError, match=r"lines.txt: line 3: not UTF-8 \(byte 0xff at "
                                                                       r"byte offset 7, column 1\)"):
        for line in utf8_lines(path, handle, DataError):
            seen.append(line)
    assert seen == ["a\n", "b\n"]


def test_the_readers_use_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"a: \xff\n")
    with pytest.raises(YamlError, match="bad.yaml: line 1: not UTF-8"):
        load_yaml(str(bad))
    config = tmp_path / "config.json"
    config.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(CheckpointError, match="config.json: line 1: not UTF-8 .byte 0xff at byte offset 7"):
        hf_io._read_json(str(config))
    # json refuses a byte-order mark (so does transformers' reader): kept, as before.
    config.write_bytes(b"\xef\xbb\xbf" + json.dumps({"a": 1}).encode())
    with pytest.raises(CheckpointError, match="config.json: not readable JSON .Unexpected UTF-8 BOM"):
        hf_io._read_json(str(config))
