"""Inputs checked for what they claim (issue 46, class 3, 5 and 6) in the format readers
(bert_packed.data.prepare.formats), and `vocab`/`stats` reading what `create` reads.

Every refusal: the one-line message, exit status 2, the inputs byte-identical afterwards and
nothing left behind (no output directory, file or vocabulary). Calls go in-process."""
import json
import os
import resource
import shutil
import subprocess
import sys

import h5py
import pytest

from bert_packed.data.__main__ import main as data_main
from bert_packed.data.prepare.vocab import train_vocab
from bert_packed.data.prepare import formats
from hostile import assert_unchanged, main_error, snapshot
from test_data_create import synthetic_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGORITHM = ["--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1", "--seed", "1",
             "--workers", "1", "--no-progress"]
SENTENCES = ["The river runs past the old mill.", "Birds sing in the tall trees at dawn.",
             "A farmer walks his dog along the lane.", "Rain falls softly on the green hills."]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats")
    corpus = synthetic_corpus(folder / "corpus.txt", num_documents=24)
    train_vocab(corpus, 200, folder / "vocab.txt")
    return folder


@pytest.fixture
def work(data, tmp_path):
    shutil.copytree(data, tmp_path / "data")
    return tmp_path / "data"


def documents(count=6):
    return [" ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(3)) for i in range(count)]


def write_parquet(path, values, type_=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(values, type=type_), "id": list(range(len(values)))}), path)
    return path


def write_wiki(path, trailer=""):
    docs = "".join(f'<doc id="{i}" curid="{i}" url="https://w/?curid={i}" title="T{i}">\nT{i}\n\n{text}\n</doc>\n'
                   for i, text in enumerate(documents()))
    path.write_text(docs + trailer)
    return path


def create_error(capsys, work, inputs, *extra, output=None):
    """(status, line) of a refused create; the work folder is unchanged and no output is left."""
    before = snapshot(work)
    output = output or work / "out"
    code, line = main_error(capsys, ["create", "--input", *map(str, inputs), "--vocab", str(work / "vocab.txt"),
                                     "--output", str(output), *ALGORITHM, *map(str, extra)], entry=data_main)
    assert_unchanged(before, work)
    assert not os.path.lexists(output)
    assert not [name for name in os.listdir(work) if name.startswith(".tmp-")]
    return code, line


def vocab_error(capsys, work, inputs, *extra):
    before = snapshot(work)
    code, line = main_error(capsys, ["vocab", "--input", *map(str, inputs), "--size", "100", "--output",
                                     str(work / "new_vocab.txt"), *map(str, extra)], entry=data_main)
    assert_unchanged(before, work)
    assert not (work / "new_vocab.txt").exists()
    return code, line


def create_ok(capsys, work, inputs, output, *extra):
    code = data_main(["create", "--input", *map(str, inputs), "--vocab", str(work / "vocab.txt"),
                      "--output", str(output), *ALGORITHM, *map(str, extra)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured


def vocab_tokens(capsys, work, inputs, *extra):
    output = work / "learned.txt"
    code = data_main(["vocab", "--input", *map(str, inputs), "--size", "500", "--min-frequency", "1",
                      "--output", str(output), *map(str, extra)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    return output.read_text().split("\n")[:-1]


# -- Parquet: a text column that holds no text ---------------------------------------------------------

@pytest.mark.parametrize("command", ["create", "vocab"])
def test_a_parquet_column_of_integers_is_refused_not_skipped(work, capsys, command):
    bad = write_parquet(work / "numbers.parquet", [1, 2, 3])
    inputs = [work / "corpus.txt", bad]
    code, line = (create_error if command == "create" else vocab_error)(capsys, work, inputs)
    assert (code, line) == (2, f"error: {bad}: column 'text' holds int64 values, not text; name the text column "
                               f"with --text-column")


@pytest.mark.parametrize("command", ["create", "vocab"])
def test_a_null_parquet_text_is_refused(work, capsys, command):
    bad = write_parquet(work / "nulls.parquet", [documents()[0], None, documents()[1]])
    code, line = (create_error if command == "create" else vocab_error)(capsys, work, [bad])
    assert (code, line) == (2, f"error: {bad}: column 'text': row 1 is null (no text); a Parquet corpus has text in "
                               f"every row: drop the null rows")


def test_a_parquet_file_is_read_by_vocab_as_create_reads_it(work, capsys):
    """`vocab` on Parquet once got an iconv recipe (its bytes read as text); now its text column."""
    tokens = vocab_tokens(capsys, work, [write_parquet(work / "docs.parquet", documents())])
    assert {"river", "farmer", "dawn"} <= set(tokens)
    assert "par" not in tokens and "id" not in tokens


# -- WikiExtractor: markup and text outside documents --------------------------------------------------

@pytest.mark.parametrize("command", ["create", "vocab"])
def test_text_after_the_last_doc_is_refused_not_dropped(work, capsys, command):
    wiki = write_wiki(work / "wiki_00", trailer="A sentence after the last document.\n")
    line_number = len(wiki.read_text().split("\n")) - 1
    code, line = (create_error if command == "create" else vocab_error)(capsys, work, [wiki])
    assert (code, line) == (2, f"error: {wiki}: line {line_number}: text outside any <doc> ... </doc> ('A sentence "
                               f"after the last document.'); WikiExtractor output holds only documents: remove it, "
                               f"or force another format with --format")


def test_vocab_on_wikiextractor_output_learns_no_markup(work, capsys):
    tokens = vocab_tokens(capsys, work, [write_wiki(work / "wiki_00")])
    assert {"river", "farmer"} <= set(tokens)
    assert not {"curid", "doc", "url", "<", "https", "t0"} & set(tokens)


# -- JSONL: a byte-order mark, a null text ------------------------------------------------------------

def jsonl_text(count=6):
    return "".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(documents(count)))


def test_jsonl_with_a_byte_order_mark_named_txt_is_read_as_jsonl(work, capsys):
    """Detected by content after the BOM: the same shard as the plain .jsonl, and no JSON syntax learned."""
    (work / "bom.txt").write_bytes(b"\xef\xbb\xbf" + jsonl_text().encode())
    (work / "plain.jsonl").write_text(jsonl_text())
    create_ok(capsys, work, [work / "bom.txt"], work / "a")
    create_ok(capsys, work, [work / "plain.jsonl"], work / "b")
    assert json.loads((work / "a" / "manifest.json").read_text())["inputs"][0]["format"] == "jsonl"
    assert (work / "a" / "shard-00000.h5").read_bytes() == (work / "b" / "shard-00000.h5").read_bytes()
    tokens = vocab_tokens(capsys, work, [work / "bom.txt"])
    assert "river" in tokens and not {"{", '"', "text", ":"} & set(tokens)


def test_a_null_json_text_says_null_text(work, capsys):
    bad = work / "null.jsonl"
    bad.write_text(jsonl_text(2) + json.dumps({"text": None, "id": 9}) + "\n")
    assert create_error(capsys, work, [bad]) == (
        2, f"error: {bad}: line 3: null text in field 'text'; leave the record out or give it text")


def test_a_json_text_that_is_a_number_says_so(work, capsys):
    bad = work / "number.jsonl"
    bad.write_text(json.dumps({"text": 7}) + "\n")
    assert create_error(capsys, work, [bad]) == (
        2, f"error: {bad}: line 1: field 'text' holds a JSON int, not text; name the text field with --text-column")


# -- plain text: a line no sequence can use, NUL bytes ---------------------------------------------------

def test_a_file_without_line_breaks_is_refused(work, capsys):
    bad = work / "one_line.txt"
    bad.write_text(" ".join(SENTENCES * 100))  # 15,000 characters, no line break
    length = len(bad.read_text())
    assert create_error(capsys, work, [bad]) == (
        2, f"error: {bad}: line 1 is {length} characters long, more than a sequence of --max-sequence-length 64 can "
           f"use (at most 3200); this format is one sentence per line and never splits a line: break the text into "
           f"sentences (a file without line breaks?) or give it as JSONL")


@pytest.mark.parametrize("command", ["create", "vocab"])
def test_a_tail_of_nul_bytes_is_refused_naming_the_offset(work, capsys, command):
    bad = work / "nul.txt"
    text = (work / "corpus.txt").read_bytes()
    bad.write_bytes(text + b"\x00" * 64)
    line_number = text.count(b"\n") + 1
    code, line = (create_error if command == "create" else vocab_error)(capsys, work, [bad])
    assert (code, line) == (2, f"error: {bad}: line {line_number}: a NUL byte at byte offset {len(text)}; "
                               f"a text corpus holds no NUL bytes (a binary file, or one padded with zeros?): remove "
                               f"them or leave the file out")


# -- files that are not regular files ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["create", "vocab"])
def test_a_named_pipe_is_named_as_one_not_as_missing(work, tmp_path, capsys, command):
    fifo = tmp_path / "pipe.txt"  # outside ``work``: the snapshot would block opening it
    os.mkfifo(fifo)
    code, line = (create_error if command == "create" else vocab_error)(capsys, work, [fifo])
    assert (code, line) == (2, f"error: {fifo}: is a named pipe (FIFO), not a regular file; a corpus file is read in "
                               f"blocks by offset (more than once), so save the stream to a file and give that")


def test_a_named_pipe_as_vocabulary_is_named_as_one(work, tmp_path, capsys):
    fifo = tmp_path / "vocab_pipe.txt"
    os.mkfifo(fifo)
    before = snapshot(work)
    code, line = main_error(capsys, ["create", "--input", str(work / "corpus.txt"), "--vocab", str(fifo), "--output",
                                     str(work / "out"), *ALGORITHM], entry=data_main)
    assert (code, line) == (2, f"error: {fifo}: is a named pipe (FIFO), not a regular file; a vocabulary file is read "
                               f"in blocks by offset (more than once), so save the stream to a file and give that")
    assert_unchanged(before, work)
    assert not (work / "out").exists()


# -- the vocabulary ------------------------------------------------------------------------------------

def test_a_vocabulary_with_a_token_twice_is_refused(work, capsys):
    tokens = (work / "vocab.txt").read_text().split("\n")[:-1]
    (work / "vocab.txt").write_text("\n".join(tokens + [tokens[7]]) + "\n")
    assert create_error(capsys, work, [work / "corpus.txt"]) == (
        2, f"error: {work / 'vocab.txt'}: line {len(tokens) + 1} repeats the token {tokens[7]!r} of line 8; a token "
           f"is listed once, or its id is ambiguous: remove the duplicate line")
    assert create_error(capsys, work, [work / "corpus.txt"], output=work / "one.h5")[0] == 2


def test_a_tokenizer_vocabulary_with_a_token_twice_is_refused(work):
    from bert_packed.io.hf_io import CheckpointError, load_tokenizer

    tokens = (work / "vocab.txt").read_text().split("\n")[:-1]
    (work / "vocab.txt").write_text("\n".join(tokens + ["[CLS]"]) + "\n")
    with pytest.raises(CheckpointError, match=r"repeats the token '\[CLS\]' of line 3"):
        load_tokenizer(str(work / "vocab.txt"))


# -- shard counts --------------------------------------------------------------------------------------

def test_fewer_shards_than_requested_are_said(work, capsys):
    captured = create_ok(capsys, work, [work / "corpus.txt"], work / "out", "--output-shards", "72")
    written = len(json.loads((work / "out" / "manifest.json").read_text())["shards"])
    assert written < 72
    assert (f"warning: --output-shards 72: only {written} shards receive documents (24 documents in all; shards "
            f"without any are not written), so {written} are written") in captured.err.splitlines()


# -- stats reads what create writes --------------------------------------------------------------------

def test_stats_reads_a_dataset_directory(work, capsys):
    from bert_packed.data.stats import dataset_stats

    create_ok(capsys, work, [work / "corpus.txt"], work / "out", "--output-shards", "3")
    shards = sorted((work / "out").glob("shard-*.h5"))
    parts = [dataset_stats(path) for path in shards]
    before = snapshot(work)
    assert data_main(["stats", str(work / "out"), "--json", "--no-plot"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert_unchanged(before, work)
    assert whole["num_shards"] == 3 and whole["kind"] == "unpacked"
    for key in ("num_rows", "num_sequences", "num_tokens", "num_masked_tokens"):
        assert whole[key] == sum(part[key] for part in parts), key
    assert whole["length_counts"] == [sum(c) for c in zip(*(part["length_counts"] for part in parts))]
    with h5py.File(shards[0], "r") as handle:
        assert whole["max_sequence_length"] == handle["input_ids"].shape[1]


def test_stats_on_a_corpus_says_it_is_one(work, capsys):
    corpus = work / "docs.jsonl"
    corpus.write_text(jsonl_text())
    before = snapshot(work)
    code, line = main_error(capsys, ["stats", str(corpus), "--no-plot"], entry=data_main)
    assert (code, line) == (2, f"error: {corpus}: a jsonl corpus (the input of `create`), not HDF5; stats reads what "
                               f"`create` and `pack` write: an HDF5 file or a dataset directory")
    assert_unchanged(before, work)


def test_stats_on_a_named_pipe_says_so(work, tmp_path, capsys):
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    code, line = main_error(capsys, ["stats", str(fifo), "--no-plot"], entry=data_main)
    assert (code, line) == (2, f"error: {fifo}: is a named pipe (FIFO), not a regular file; stats reads an HDF5 file "
                               f"or a dataset directory")
    assert sorted(os.listdir(tmp_path)) == ["data", "pipe.h5"]


# -- the single-file create is the sharded engine writing one shard -------------------------------------

def test_a_single_file_is_the_one_shard_of_a_directory(work, capsys):
    (work / "docs.jsonl").write_text(jsonl_text(12))
    create_ok(capsys, work, [work / "docs.jsonl"], work / "one.h5")
    create_ok(capsys, work, [work / "docs.jsonl"], work / "dir", "--output-shards", "1")
    assert (work / "one.h5").read_bytes() == (work / "dir" / "shard-00000.h5").read_bytes()
    assert not [name for name in os.listdir(work) if name.startswith(".tmp-")]


def test_a_single_file_that_cannot_be_written_leaves_nothing(work, capsys):
    """A full disk (RLIMIT_FSIZE: writes over the limit fail with EFBIG) while the one shard is written:
    one line naming the .h5 (not the temporary directory's shard), nothing left behind."""
    create_ok(capsys, work, [work / "corpus.txt"], work / "reference.h5")
    size = os.path.getsize(work / "reference.h5")
    before = snapshot(work)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    result = subprocess.run([sys.executable, "-m", "bert_packed.data", "create", "--input", str(work / "corpus.txt"),
                             "--vocab", str(work / "vocab.txt"), "--output", str(work / "one.h5"), *ALGORITHM],
                            capture_output=True, text=True, cwd=ROOT, preexec_fn=limit)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: {work / 'one.h5'}: writing failed (File too large); nothing was "
                                     f"written: free space (or raise the limit) and run the command again")
    assert_unchanged(before, work)
    assert sorted(os.listdir(work)) == sorted(os.path.basename(path) for path in before)


# -- a new format is one module: registered once, every command reads it ---------------------------------

def test_the_registry_is_every_format_module_on_disk():
    """A new format is one file: every module of the formats package but ``base`` is registered,
    with no list to extend, and the fallback (``lines``) is asked last."""
    folder = os.path.dirname(formats.__file__)
    modules = sorted(name[:-3] for name in os.listdir(folder) if name.endswith(".py") and name not in
                     ("__init__.py", "base.py"))
    assert sorted(fmt.__class__.__module__.rsplit(".", 1)[1] for fmt in formats.REGISTRY.values()) == modules
    assert [fmt.fallback for fmt in formats.REGISTRY.values()] == [False] * (len(modules) - 1) + [True]


def test_a_registered_format_is_read_by_every_command(work, capsys, monkeypatch):
    """A toy format (one document per line, ``id<TAB>text``) registered in the registry alone: the
    --format choices, `vocab`, the sharded and the single-file `create` all take it."""
    from bert_packed.data.prepare import formats
    from bert_packed.data.prepare.formats.base import TextFormat, split_sentences

    class Tabbed(TextFormat):
        name = "tsv"
        suffixes = (".tsv",)

        def boundary(self, line):
            return "at"

        def documents(self, lines, path, start, text_column, max_seq_length):
            for line in lines:
                if line.strip():
                    yield split_sentences(line.split("\t", 1)[1])

    monkeypatch.setitem(formats.REGISTRY, "tsv", Tabbed())
    corpus = work / "docs.tsv"
    corpus.write_text("".join(f"id{i}\t{text}\n" for i, text in enumerate(documents(12))))
    tokens = vocab_tokens(capsys, work, [corpus], "--format", "tsv")
    assert "river" in tokens and not {"id0", "id", "##0"} & set(tokens)
    create_ok(capsys, work, [corpus], work / "one.h5", "--format", "tsv")
    create_ok(capsys, work, [corpus], work / "dir")  # detected by its suffix
    assert json.loads((work / "dir" / "manifest.json").read_text())["num_documents"] == 12
    assert (work / "one.h5").read_bytes() == (work / "dir" / "shard-00000.h5").read_bytes()
