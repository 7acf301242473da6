"""`vocab` and `create`: Google BERT's pre-training data algorithm, checked on its statistics.

Synthetic text runs everywhere; the King James Bible (Debian bible-kjv) is the real corpus
and its tests skip, saying so, where the `bible` program is missing.
"""
import hashlib
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bert_packed.data import DataError
from bert_packed.data.prepare.create_file import create_pretraining_file
from bert_packed.data.prepare.kjv import kjv_available, kjv_documents, write_kjv_corpus
from bert_packed.data.prepare.vocab import SPECIAL_TOKENS, load_vocab, train_vocab
from helpers import assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_bible = pytest.mark.skipif(not kjv_available(),
                                 reason="needs the `bible` program (Debian package bible-kjv)")
CLS, SEP, MASK = 2, 3, 4


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "bert_packed.data", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def synthetic_corpus(path, num_documents=60, seed=0):
    """Documents of 20..60 'sentences' of 2..8 words drawn from ~100 made-up words (short
    sentences, long documents: the setting Google's algorithm was made for)."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "va"]
    words = sorted({"".join(rng.choice(syllables, size=rng.integers(1, 3))) for _ in range(120)})
    with open(path, "w") as handle:
        for _ in range(num_documents):
            for _ in range(rng.integers(20, 61)):
                handle.write(" ".join(rng.choice(words, size=rng.integers(2, 9))) + " .\n")
            handle.write("\n")
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    corpus = synthetic_corpus(folder / "corpus.txt")
    vocab = folder / "vocab.txt"
    train_vocab(corpus, 400, vocab)
    output = folder / "train.h5"
    create_pretraining_file(corpus, vocab, output, max_seq_length=64, max_predictions=10,
                            dupe_factor=3, seed=7)
    return folder, corpus, vocab, output


@pytest.fixture(scope="module")
def kjv(tmp_path_factory):
    """Genesis (50 chapters = 50 documents) through vocab and create at S=128."""
    if not kjv_available():
        pytest.skip("needs the `bible` program (Debian package bible-kjv)")
    folder = tmp_path_factory.mktemp("kjv")
    corpus = folder / "genesis.txt"
    write_kjv_corpus(corpus, "Gen1:1", "Gen50:26")
    vocab = folder / "vocab.txt"
    train_vocab(corpus, 2000, vocab)
    output = folder / "train.h5"
    create_pretraining_file(corpus, vocab, output, max_seq_length=128, max_predictions=20,
                            dupe_factor=5, seed=1)
    return folder, corpus, vocab, output


def read(path):
    with h5py.File(path, "r") as handle:
        return {name: handle[name][:] for name in handle}


def check_layout_and_masking(arrays, max_seq_length, max_predictions, vocab_size):
    """Every row is [CLS] A [SEP] B [SEP] with the reference masking rule; returns the
    (masked, kept, random) counts over all masked slots."""
    ids, mask, segments = arrays["input_ids"], arrays["input_mask"], arrays["segment_ids"]
    positions, labels = arrays["masked_lm_positions"], arrays["masked_lm_ids"]
    lengths = mask.sum(axis=1)
    assert lengths.max() <= max_seq_length and lengths.min() >= 5
    columns = np.arange(max_seq_length)
    np.testing.assert_array_equal(mask, columns[None, :] < lengths[:, None])  # prefix masks
    # Unmask to recover the original text, then check the structure on it.
    original = ids.copy()
    used = positions != 0
    rows = np.nonzero(used)[0]
    original[rows, positions[used]] = labels[used]
    assert np.all(original[:, 0] == CLS)
    assert np.all(original[np.arange(len(ids)), lengths - 1] == SEP)
    assert np.all((original == SEP).sum(axis=1) == 2)
    assert np.all(ids[mask == 0] == 0) and np.all(segments[mask == 0] == 0)
    first_sep = np.argmax(original == SEP, axis=1)
    np.testing.assert_array_equal(segments, (columns[None, :] > first_sep[:, None]) & (mask != 0))
    # Masked positions: sorted, distinct, never [CLS]/[SEP], count = min(P, max(1, round(15 %))).
    expected = np.minimum(max_predictions, np.maximum(1, np.round(lengths * 0.15))).astype(int)
    np.testing.assert_array_equal(used.sum(axis=1), expected)
    for row in range(len(ids)):
        p = positions[row][used[row]]
        assert np.all(np.diff(p) > 0)
        assert not np.isin(original[row, p], [CLS, SEP]).any()
    assert np.all(np.diff(used.astype(int), axis=1) <= 0)  # used slots come first
    shown = ids[rows, positions[used]]
    assert shown.min() >= 0 and shown.max() < vocab_size
    assert not np.isin(shown, [0, 1, CLS, SEP]).any()  # random tokens exclude the specials
    num_mask = int((shown == MASK).sum())
    num_kept = int(((shown == labels[used]) & (shown != MASK)).sum())
    return num_mask, num_kept, int(used.sum()) - num_mask - num_kept


def test_vocab_has_special_tokens_first_and_respects_size(synthetic):
    _, _, vocab_path, _ = synthetic
    tokens = open(vocab_path).read().split("\n")[:-1]
    assert tuple(tokens[:5]) == SPECIAL_TOKENS
    assert 50 < len(tokens) <= 400 and len(set(tokens)) == len(tokens)
    assert load_vocab(vocab_path)["[MASK]"] == MASK


def test_vocab_ids_do_not_depend_on_the_process(synthetic, tmp_path):
    """tokenizers numbers tokens in hash order (a new order in every process): the same corpus gave
    differently ordered vocab.txt files. Trained in two processes with room for every merge (no tie
    at the size limit), the files are identical: specials first, then the learned tokens sorted."""
    _, corpus, _, _ = synthetic
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = []
    for run in range(2):
        output = tmp_path / f"vocab{run}.txt"
        subprocess.run([sys.executable, "-m", "bert_packed.data", "vocab", "--input", str(corpus), "--size", "30000",
                        "--output", str(output)], cwd=root, check=True, capture_output=True)
        files.append(output.read_bytes())
    assert files[0] == files[1]
    tokens = files[0].decode().split("\n")[:-1]
    assert tuple(tokens[:5]) == SPECIAL_TOKENS and tokens[5:] == sorted(tokens[5:]) and len(tokens) > 50


def test_create_layout_and_masking_on_synthetic_text(synthetic):
    _, _, vocab, output = synthetic
    arrays = read(output)
    vocab_size = len(load_vocab(vocab))
    num_mask, num_kept, num_random = check_layout_and_masking(arrays, 64, 10, vocab_size)
    total = num_mask + num_kept + num_random
    assert total > 3000
    # 80/10/10 within ~4 standard deviations of the binomial proportions.
    assert abs(num_mask / total - 0.8) < 4 * np.sqrt(0.16 / total)
    assert abs(num_kept / total - 0.1) < 4 * np.sqrt(0.09 / total)
    assert abs(num_random / total - 0.1) < 4 * np.sqrt(0.09 / total)


def test_random_next_share_is_half_without_short_targets(synthetic, tmp_path):
    """Each pair flips a fair coin for "random next"; only single-sentence chunks force it,
    and with full-length targets on long documents of short sentences those are rare. (Short
    targets make many single-sentence chunks, so with the default 10 % the share is higher:
    that is the reference algorithm, see the KJV test.)"""
    _, corpus, vocab, _ = synthetic
    output = tmp_path / "long.h5"
    create_pretraining_file(corpus, vocab, output, max_seq_length=64, max_predictions=10,
                            dupe_factor=3, seed=7, short_seq_prob=0.0)
    arrays = read(output)
    labels = arrays["next_sentence_labels"]
    assert abs(labels.mean() - 0.5) < 4 * np.sqrt(0.25 / len(labels)) + 0.02, labels.mean()
    # Short targets (10 % of document passes by default) add short rows on top of the
    # documents' ends.
    short = lambda a: (a["input_mask"].sum(axis=1) < 0.5 * 64).mean()  # noqa: E731
    assert short(read(synthetic[3])) > short(arrays) + 0.03


def test_create_is_deterministic_for_a_seed(synthetic, tmp_path):
    folder, corpus, vocab, output = synthetic
    again, other = tmp_path / "again.h5", tmp_path / "other.h5"
    create_pretraining_file(corpus, vocab, again, max_seq_length=64, max_predictions=10,
                            dupe_factor=3, seed=7)
    create_pretraining_file(corpus, vocab, other, max_seq_length=64, max_predictions=10,
                            dupe_factor=3, seed=8)
    digest = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()  # noqa: E731
    assert digest(again) == digest(output)
    assert digest(other) != digest(output)


def test_dupe_factor_multiplies_the_passes(synthetic, tmp_path):
    _, corpus, vocab, output = synthetic
    once = tmp_path / "once.h5"
    create_pretraining_file(corpus, vocab, once, max_seq_length=64, max_predictions=10,
                            dupe_factor=1, seed=7)
    num_once, num_three = len(read(once)["next_sentence_labels"]), len(read(output)["next_sentence_labels"])
    # Each pass draws new targets and masks, so the counts differ a little per pass.
    assert 2.0 * num_once < num_three < 4.0 * num_once


@needs_bible
def test_kjv_corpus_strips_references_and_makes_chapters_documents():
    documents = kjv_documents("Gen1:1", "Gen2:25")
    assert len(documents) == 2 and [len(d) for d in documents] == [31, 25]
    assert documents[0][0] == "In the beginning God created the heaven and the earth."
    assert not any(line[:1].isdigit() or ":" in line.split(" ")[0] for d in documents for line in d)


@needs_bible
def test_create_matches_reference_statistics_on_kjv(kjv):
    _, _, vocab, output = kjv
    arrays = read(output)
    num_mask, num_kept, num_random = check_layout_and_masking(arrays, 128, 20, len(load_vocab(vocab)))
    total = num_mask + num_kept + num_random
    tokens = arrays["input_mask"].sum()
    assert 0.14 < total / tokens < 0.16  # ~15 % of the tokens ([CLS]/[SEP] included, as the reference)
    assert abs(num_mask / total - 0.8) < 0.02
    assert abs(num_kept / total - 0.1) < 0.015 and abs(num_random / total - 0.1) < 0.015
    # Verses are long, so some chunks hold a single verse and force a random next sentence:
    # the reference algorithm gives a little over 50 % here.
    share = arrays["next_sentence_labels"].mean()
    assert 0.48 < share < 0.62, share


# -- bad input: one line, exit status 2 --------------------------------------------------



def test_vocab_without_mask_token_is_refused(synthetic, tmp_path):
    _, corpus, vocab, _ = synthetic
    bad = tmp_path / "vocab.txt"
    bad.write_text("".join(t + "\n" for t in open(vocab).read().split("\n") if t != "[MASK]"))
    result = run_cli("create", "--input", corpus, "--vocab", bad, "--output", tmp_path / "x.h5")
    assert_one_line_error(result, "[MASK]")
    assert not (tmp_path / "x.h5").exists()


def test_empty_corpus_is_refused(synthetic, tmp_path):
    _, _, vocab, _ = synthetic
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    assert_one_line_error(run_cli("create", "--input", empty, "--vocab", vocab,
                                  "--output", tmp_path / "x.h5"), "empty")
    assert_one_line_error(run_cli("vocab", "--input", empty, "--size", 100,
                                  "--output", tmp_path / "v.txt"), "empty")
    assert_one_line_error(run_cli("create", "--input", tmp_path / "missing.txt", "--vocab", vocab,
                                  "--output", tmp_path / "x.h5"), "not found")


def test_vocab_cli_writes_a_usable_vocabulary(synthetic, tmp_path):
    _, corpus, _, _ = synthetic
    result = run_cli("vocab", "--input", corpus, "--size", 300, "--output", tmp_path / "v.txt")
    assert result.returncode == 0, result.stderr
    vocab = load_vocab(tmp_path / "v.txt")
    assert len(vocab) <= 300 and vocab["[CLS]"] == CLS
    with pytest.raises(DataError, match="too small"):
        train_vocab(corpus, 3, tmp_path / "tiny.txt")


def test_whole_word_masking_masks_whole_words(synthetic, tmp_path):
    _, corpus, _, _ = synthetic
    vocab = tmp_path / "small_vocab.txt"
    train_vocab(corpus, 60, vocab)  # small, so words split into pieces
    output = tmp_path / "wwm.h5"
    create_pretraining_file(corpus, vocab, output, max_seq_length=64, max_predictions=10,
                            dupe_factor=1, seed=3, whole_word_mask=True)
    arrays = read(output)
    tokens = open(vocab).read().split("\n")
    continuation = np.array([t.startswith("##") for t in tokens[:-1]])
    original = arrays["input_ids"].copy()
    used = arrays["masked_lm_positions"] != 0
    original[np.nonzero(used)[0], arrays["masked_lm_positions"][used]] = arrays["masked_lm_ids"][used]
    num_pieces = 0
    for row in range(len(original)):
        masked = set(arrays["masked_lm_positions"][row][used[row]].tolist())
        for position in masked:
            # A piece right after [CLS]/[SEP] lost its word start to truncation.
            if continuation[original[row, position]] and original[row, position - 1] not in (CLS, SEP):
                num_pieces += 1
                assert position - 1 in masked  # the word's previous piece is masked too
            if position + 1 < 64 and continuation[original[row, position + 1]] \
                    and arrays["input_mask"][row, position + 1]:
                # ... and the next piece of the same word, unless the budget ran out mid-word
                # (the reference skips words that do not fit, so it never does).
                assert position + 1 in masked
    assert num_pieces > 20  # the synthetic words do split into pieces


# -- the vectorised instance builder against Google's list algorithm ----------------------------

def google_pairs(documents, max_num_tokens, short_seq_prob, dupe_factor, rng):
    """Google's create_instances_from_document on lists, pairing only (before truncation and
    masking), with its random calls in its order: the reference the offsets must reproduce."""
    documents = list(documents)
    rng.shuffle(documents)
    pairs = []
    for _ in range(dupe_factor):
        for index, document in enumerate(documents):
            target = max_num_tokens
            if rng.random() < short_seq_prob:
                target = rng.randint(2, max_num_tokens)
            chunk, length, i = [], 0, 0
            while i < len(document):
                chunk.append(document[i])
                length += len(document[i])
                if i == len(document) - 1 or length >= target:
                    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                    tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
                    if len(chunk) == 1 or rng.random() < 0.5:
                        for _ in range(10):
                            other = rng.randint(0, len(documents) - 1)
                            if other != index:
                                break
                        other_document = documents[other]
                        tokens_b = []
                        for sentence in other_document[rng.randint(0, len(other_document) - 1):]:
                            tokens_b.extend(sentence)
                            if len(tokens_b) >= target - len(tokens_a):
                                break
                        i -= len(chunk) - a_end
                        pairs.append((tokens_a, tokens_b, 1))
                    else:
                        pairs.append((tokens_a, [t for sentence in chunk[a_end:] for t in sentence], 0))
                    chunk, length = [], 0
                i += 1
    return pairs


@pytest.mark.parametrize("max_num_tokens, short_seq_prob, num_documents", [(61, 0.1, 30), (20, 0.5, 12), (40, 0.0, 1)])
def test_pair_offsets_are_googles_pairs(max_num_tokens, short_seq_prob, num_documents):
    import random

    from bert_packed.data.prepare.create import Documents, _PairBuilder

    maker = np.random.default_rng(num_documents)
    documents = [[maker.integers(5, 400, size=maker.integers(1, 25)).tolist() for _ in range(maker.integers(1, 30))]
                 for _ in range(num_documents)]
    expected = google_pairs(documents, max_num_tokens, short_seq_prob, 3, random.Random(11))
    flat = Documents.from_lists(documents)
    rng = random.Random(11)
    order = list(range(len(flat)))
    rng.shuffle(order)
    builder = _PairBuilder(flat, order, max_num_tokens, short_seq_prob)
    for _ in range(3):
        for index in range(len(order)):
            builder.document(index, rng)
    tokens = flat.tokens.tolist()
    found = [(tokens[a:a + la], tokens[b:b + lb], nxt) for a, la, b, lb, nxt
             in zip(builder.a_start, builder.a_length, builder.b_start, builder.b_length, builder.random_next)]
    assert len(found) == len(expected) > 10
    assert found == expected


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=30), st.integers(3, 250))
@settings(max_examples=60, deadline=None)
def test_truncation_cuts_what_googles_loop_cuts(lengths, max_num_tokens):
    from bert_packed.data.prepare.create import truncate_pairs

    pairs = np.array([[1000, a, 5000, b] for a, b in lengths], np.int64)
    out = truncate_pairs(pairs, max_num_tokens, [1, 2])
    for (a, b), (a0, la, b0, lb) in zip(lengths, out.tolist()):
        kept_a, kept_b = a, b
        while kept_a + kept_b > max_num_tokens:  # the reference: a token off the longer segment (B on ties)
            if kept_a > kept_b:
                kept_a -= 1
            else:
                kept_b -= 1
        assert (la, lb) == (kept_a, kept_b)
        # each kept run lies inside its segment: front cuts plus back cuts are the cuts
        assert 1000 <= a0 and a0 + la <= 1000 + a and 5000 <= b0 and b0 + lb <= 5000 + b
    np.testing.assert_array_equal(out, truncate_pairs(pairs, max_num_tokens, [1, 2]))  # a function of its seed


def test_truncation_cuts_each_end_half_the_time():
    from bert_packed.data.prepare.create import truncate_pairs

    pairs = np.tile(np.array([[0, 400, 1000, 100]], np.int64), (2000, 1))  # 300 tokens off A each
    front = truncate_pairs(pairs, 200, [7])[:, 0]
    assert abs(front.mean() - 150) < 5 * np.sqrt(300 * 0.25 / 2000)
    assert front.std() > 0.5 * np.sqrt(300 * 0.25)  # drawn per pair, not shared


def test_masking_picks_every_candidate_alike_and_shows_80_10_10():
    """Rows of 50 tokens ([CLS] 23 [SEP] 24 [SEP]): round(7.5) = 8 of the 47 candidates masked per
    row, each candidate equally likely; none is [CLS]/[SEP]; the shown token 80/10/10."""
    from bert_packed.data.prepare.create import _Masking, _mask

    rows, length = 20000, 50
    ids = np.tile(np.arange(100, 150), (rows, 1))
    ids[:, 0], ids[:, 24], ids[:, 49] = CLS, SEP, SEP
    masking = _Masking({"[CLS]": CLS, "[SEP]": SEP, "[MASK]": MASK}, np.arange(5, 300, dtype=np.int32), 0.15, 10,
                       False, frozenset())
    positions, labels, shown = _mask(ids, np.full(rows, length), np.full(rows, 23), masking, [3])
    used = positions > 0
    assert np.all(used.sum(axis=1) == 8) and not used[:, 8:].any() and np.all(np.diff(positions[:, :8], axis=1) > 0)
    counts = np.bincount(positions[used], minlength=length)
    assert counts[0] == counts[24] == counts[49] == 0
    expected = rows * 8 / 47
    assert np.all(np.abs(counts[[p for p in range(length) if p not in (0, 24, 49)]] - expected)
                  < 5 * np.sqrt(expected))
    np.testing.assert_array_equal(labels[used], ids[np.nonzero(used)[0], positions[used]])
    total = used.sum()
    for share, count in ((0.8, (shown[used] == MASK).sum()), (0.1, (shown[used] == labels[used]).sum())):
        assert abs(count / total - share) < 5 * np.sqrt(share * (1 - share) / total)


def test_masking_never_picks_a_special_id_inside_the_text():
    """Text can tokenise to [SEP]'s id: such a position is no candidate (the rows that hold one
    look their candidates up instead of computing them)."""
    from bert_packed.data.prepare.create import _Masking, _mask

    rows = 4000
    ids = np.tile(np.arange(100, 150), (rows, 1))
    ids[:, 0], ids[:, 24], ids[:, 49] = CLS, SEP, SEP
    ids[::2, 10] = SEP  # inside A in every other row
    masking = _Masking({"[CLS]": CLS, "[SEP]": SEP, "[MASK]": MASK}, np.arange(5, 300, dtype=np.int32), 0.15, 10,
                       False, frozenset())
    positions, labels, _ = _mask(ids, np.full(rows, 50), np.full(rows, 23), masking, [4])
    used = positions > 0
    assert np.all(used.sum(axis=1) == 8)
    assert not np.isin(labels[used], [CLS, SEP]).any()
    counts = np.bincount(positions[::2][used[::2]], minlength=50)
    assert counts[10] == 0 and counts[[0, 24, 49]].sum() == 0
    expected = (rows // 2) * 8 / 46
    assert np.all(np.abs(counts[[p for p in range(50) if p not in (0, 10, 24, 49)]] - expected) < 5 * np.sqrt(expected))
