"""Hostile inputs to the sharded `create` (`--output DIR`): each case asserts the one-line
message, exit status 2, and that inputs (and finished outputs) are byte-identical afterwards,
with no job left behind for a bad input (the fixed rerun must not be refused)."""
import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from bert_packed.data.__main__ import main as data_main
from bert_packed.data.prepare.vocab import train_vocab
from hostile import assert_unchanged, main_error, snapshot
from test_data_create import synthetic_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGORITHM = ["--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1", "--seed", "1",
             "--workers", "1", "--no-progress"]
UTF8_HINT = "save the file as UTF-8, e.g. iconv -f <encoding> -t utf-8"  # bert_packed.io.files: one message for every reader


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    corpus = synthetic_corpus(folder / "corpus.txt", num_documents=24)
    train_vocab(corpus, 200, folder / "vocab.txt")
    return folder


@pytest.fixture
def work(data, tmp_path):
    shutil.copytree(data, tmp_path / "data")
    return tmp_path / "data"


def create_error(capsys, work, inputs, *extra, output=None):
    """(status, line) of a failing create into ``work/out``; asserts ``work`` is unchanged."""
    before = snapshot(work)
    output = output or work / "out"
    code, line = main_error(capsys, ["create", "--input", *map(str, inputs), "--vocab", str(work / "vocab.txt"),
                                     "--output", str(output), *ALGORITHM, *map(str, extra)], entry=data_main)
    assert_unchanged(before, work)
    return code, line


def create_ok(capsys, work, inputs, output, *extra):
    code = data_main(["create", "--input", *map(str, inputs), "--vocab", str(work / "vocab.txt"),
                      "--output", str(output), *ALGORITHM, *map(str, extra)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_a_glob_matching_nothing(work, capsys):
    pattern = work / "*.nothing"
    assert create_error(capsys, work, [pattern]) == (2, f"error: --input {pattern}: the pattern matches no file")


def test_an_empty_corpus(work, capsys):
    (work / "blank.txt").write_text("\n\n  \n")
    assert create_error(capsys, work, [work / "blank.txt"]) == (
        2, f"error: {work / 'blank.txt'}: the corpus is empty; give one sentence per line, documents separated by "
           f"blank lines")


def test_a_corpus_without_any_text(work, capsys):
    (work / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": " \n "}) + "\n")
    code, line = create_error(capsys, work, [work / "empty.jsonl"])
    assert code == 2 and line.startswith(f"error: {work / 'empty.jsonl'}: no text found; give documents"), line


def test_a_wikiextractor_file_cut_in_a_doc(work, capsys):
    path = work / "wiki_00"
    path.write_text('<doc id="1" url="u" title="A">\nA\n\nFirst text. More.\n</doc>\n'
                    '<doc id="2" url="u" title="B">\nB\n\nCut here')
    assert create_error(capsys, work, [path]) == (
        2, f"error: {path}: line 6: this <doc> has no </doc> at the end of the file: the file is cut in the middle "
           f"of a document (an interrupted WikiExtractor run?); re-extract it or leave it out")


def test_a_parquet_file_without_the_text_column(work, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = work / "d.parquet"
    pq.write_table(pa.table({"id": [1], "body": ["Some text."]}), path)
    assert create_error(capsys, work, [path]) == (
        2, f"error: {path}: no column 'text' (it has 'id', 'body'); name the text column with --text-column")


def test_a_jsonl_line_that_is_not_json(work, capsys):
    path = work / "c.jsonl"
    path.write_text(json.dumps({"text": "Fine."}) + "\n{not json\n")
    code, line = create_error(capsys, work, [path])
    assert code == 2 and line.startswith(f"error: {path}: line 2: not JSON (") and line.endswith(
        "JSONL input is one JSON object per line"), line


def test_a_jsonl_record_without_the_text_field(work, capsys):
    path = work / "c.jsonl"
    path.write_text(json.dumps({"text": "Fine."}) + "\n" + json.dumps({"id": 3, "body": "x"}) + "\n")
    assert create_error(capsys, work, [path]) == (
        2, f"error: {path}: line 2: no text field 'text' (the record has 'id', 'body'); name the field with "
           f"--text-column")


def test_invalid_utf8_gets_the_message_of_the_one_file_create(work, capsys):
    path = work / "bad.txt"
    lines = open(work / "corpus.txt", "rb").read().split(b"\n")
    lines[30] = lines[30][:4] + b"\xff" + lines[30][4:]
    path.write_bytes(b"\n".join(lines))
    offset = len(b"\n".join(lines[:30])) + 1 + 4
    expected = (2, f"error: {path}: line 31: not UTF-8 (byte 0xff at byte offset {offset}, column 5); {UTF8_HINT}")
    assert create_error(capsys, work, [path], "--block-bytes", 200) == expected
    code = data_main(["create", "--input", str(path), "--vocab", str(work / "vocab.txt"), "--output",
                      str(work / "one.h5")])
    assert (code, capsys.readouterr().err.strip()) == expected


@pytest.mark.parametrize("case", ["output is the input", "input inside output", "output inside input dir",
                                  "output is the vocab"])
def test_output_over_an_input(work, capsys, case):
    (work / "in").mkdir()
    shutil.copy(work / "corpus.txt", work / "in" / "corpus.txt")
    inputs, output = {"output is the input": ([work / "corpus.txt"], work / "corpus.txt"),
                      "input inside output": ([work / "in" / "corpus.txt"], work / "in"),
                      "output inside input dir": ([work / "in"], work / "in" / "shards"),
                      "output is the vocab": ([work / "corpus.txt"], work / "vocab.txt")}[case]
    code, line = create_error(capsys, work, inputs, output=output)
    assert code == 2, line
    if case in ("output is the input", "output is the vocab"):
        assert line.startswith(f"error: --output {output} is also an input ("), line
    elif case == "input inside output":
        assert line == (f"error: --output {output} holds an input ({work / 'in' / 'corpus.txt'}); writing shards "
                        f"there could destroy it: choose another --output")
    else:
        assert line == (f"error: --output {output} is inside the input directory {work / 'in'}; a rerun would read "
                        f"the shards as corpus: choose another --output")


WORKERS_RANGE = ("--workers must be between 1 and 4096 (local worker processes, one per core: no machine has more "
                 "cores), got ")


@pytest.mark.parametrize("flag, value, message", [
    ("--workers", "0", WORKERS_RANGE + "0"),
    ("--workers", "5000", WORKERS_RANGE + "5000"),
    ("--output-shards", "0", "--output-shards must be between 1 and 100000 (shard names have five digits), got 0"),
    ("--output-shards", "100001",
     "--output-shards must be between 1 and 100000 (shard names have five digits), got 100001"),
    ("--block-bytes", "0", "--block-bytes must be between 1 and 1073741824 (a block is read whole into one task's "
                           "memory), got 0"),
    ("--text-column", "", "--text-column must name the JSONL field / Parquet column of the text, got ''"),
    ("--text-column", " ", "--text-column must name the JSONL field / Parquet column of the text, got ' '"),
])
def test_bad_counts(work, capsys, flag, value, message):
    assert create_error(capsys, work, [work / "corpus.txt"], flag, value) == (2, f"error: {message}")


def test_sharded_options_with_a_single_file_output(work, capsys):
    code, line = create_error(capsys, work, [work / "corpus.txt"], "--output-shards", "2", output=work / "one.h5")
    # The single-file create is the sharded engine writing one shard (issue 48): --workers, --format,
    # --text-column and --block-bytes work for it; more than one shard does not.
    assert (code, line) == (2, f"error: --output-shards 2: --output {work / 'one.h5'} (.h5) is one file, one shard; "
                               f"give a directory for 2 shards")


def test_a_finished_dataset_is_never_overwritten(work, capsys):
    create_ok(capsys, work, [work / "corpus.txt"], work / "out")
    assert create_error(capsys, work, [work / "corpus.txt"], "--seed", "2") == (
        2, f"error: --output {work / 'out'} already holds a finished dataset (manifest.json); remove it or choose "
           f"another --output (nothing is overwritten)")


def test_a_directory_with_other_files_is_refused(work, capsys):
    (work / "out").mkdir()
    (work / "out" / "notes.txt").write_text("mine\n")
    assert create_error(capsys, work, [work / "corpus.txt"]) == (
        2, f"error: --output {work / 'out'} is not empty and holds no unfinished create; choose an empty or new "
           f"directory")


def _limit_file_size(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_disk_that_fills_keeps_finished_shards_and_the_rerun_finishes(work, capsys):
    """RLIMIT_FSIZE makes writes over the limit fail with EFBIG (Python ignores SIGXFSZ), as a
    full disk would fail them: the shards before are kept whole, the rerun finishes the job."""
    argv = ["--input", str(work / "corpus.txt"), "--vocab", str(work / "vocab.txt"), *ALGORITHM,
            "--output-shards", "4", "--dupe-factor", "3", "--block-bytes", "1500"]
    create_ok(capsys, work, [work / "corpus.txt"], work / "reference", "--output-shards", "4", "--dupe-factor", "3",
              "--block-bytes", "1500")
    sizes = [os.path.getsize(work / "reference" / f"shard-{i:05d}.h5") for i in range(4)]
    failing = next(i for i in range(1, 4) if sizes[i] > max(sizes[:i]))
    before = snapshot(work / "corpus.txt", work / "vocab.txt")
    result = subprocess.run([sys.executable, "-m", "bert_packed.data", "create", *argv, "--output", str(work / "out")],
                            capture_output=True, text=True, cwd=ROOT,
                            preexec_fn=_limit_file_size(max(sizes[:failing]) + 1))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: {work / 'out' / f'shard-{failing:05d}.h5'}: writing failed (File too large); finished shards are "
        f"kept: free space (or raise the limit) and run the same command again to finish")
    assert_unchanged(before, work / "corpus.txt", work / "vocab.txt")
    kept = sorted(name for name in os.listdir(work / "out") if not name.startswith("."))
    assert kept == [f"shard-{i:05d}.h5" for i in range(failing)]
    for name in kept:
        assert open(work / "out" / name, "rb").read() == open(work / "reference" / name, "rb").read()
    result = subprocess.run([sys.executable, "-m", "bert_packed.data", "create", *argv, "--output", str(work / "out")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(work / "out")) == sorted(os.listdir(work / "reference"))
    for name in os.listdir(work / "reference"):
        assert open(work / "out" / name, "rb").read() == open(work / "reference" / name, "rb").read()


def test_a_disk_that_fills_while_tokenising_keeps_the_job_for_the_rerun(work, capsys):
    argv = [sys.executable, "-m", "bert_packed.data", "create", "--input", str(work / "corpus.txt"), "--vocab",
            str(work / "vocab.txt"), "--output", str(work / "out"), *ALGORITHM]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, preexec_fn=_limit_file_size(4000))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: {work / 'out' / '.work' / 'blocks' / 'block-000000.bin'}: writing failed (File too large); finished "
        f"shards are kept: free space (or raise the limit) and run the same command again to finish")
    assert os.listdir(work / "out") == [".work"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(work / "out")) == ["manifest.json", "shard-00000.h5"]


def test_a_wikiextractor_end_without_its_start(work, capsys):
    path = work / "wiki_01"
    path.write_text('<doc id="1" url="u" title="A">\nA\n\nText.\n</doc>\n</doc>\n')
    assert create_error(capsys, work, [path], "--format", "wikiextractor") == (
        2, f"error: {path}: line 6: </doc> without its <doc>; the file is cut or is not WikiExtractor output (force "
           f"another with --format)")


def test_ctrl_c_keeps_finished_work_and_says_how_to_finish(work, capsys, monkeypatch):
    from bert_packed.data.prepare import create_shards as cs

    real = cs.write_shard

    def interrupt_second(task):
        if task["output"].endswith("shard-00001.h5"):
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(cs, "write_shard", interrupt_second)
    out = work / "out"
    code, line = main_error(capsys, ["create", "--input", str(work / "corpus.txt"), "--vocab", str(work / "vocab.txt"),
                                     "--output", str(out), "--output-shards", "3", *ALGORITHM], entry=data_main)
    assert (code, line) == (130, f"interrupted: finished blocks and shards are kept in {out}; run the same command "
                                 f"again to finish")
    assert sorted(os.listdir(out)) == [".work", "shard-00000.h5"]
    monkeypatch.setattr(cs, "write_shard", real)
    create_ok(capsys, work, [work / "corpus.txt"], out, "--output-shards", "3")
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-00000.h5", "shard-00001.h5", "shard-00002.h5"]
