"""`create`'s algorithm: documents -> unpacked pre-training rows (Google BERT's create_pretraining_data).

The documents come from the input formats (bert_packed.data.prepare.formats), tokenised by the sharded
engine (create_shards.py; one shard for a single-file output, create_file.py). The algorithm is
the one of Google's reference implementation, re-implemented here on token ids:

1. Tokenise every sentence with WordPiece (`tokenizers`, BertWordPieceTokenizer normalisation);
   drop empty documents; shuffle the documents.
2. `dupe_factor` times over all documents, cut each document into instances: the target
   length is max_seq_length - 3, except with probability `short_seq_prob` (10 %) a random
   length in [2, max_seq_length - 3] (so the model also sees short inputs at fine-tuning).
   Sentences are gathered until the target is reached; a random prefix of them is
   segment A. With probability 1/2 (always, if only one sentence was gathered) segment B
   comes from a random other document ("random next", label 1) and the unused sentences
   are put back; otherwise B is the rest of the gathered sentences (label 0).
3. The pair is truncated to max_seq_length - 3 tokens by removing tokens from the longer
   segment, at its front or back at random, then laid out as [CLS] A [SEP] B [SEP].
4. Masked LM: num_to_predict = min(max_predictions, max(1, round(15 % of the tokens)))
   positions (never [CLS]/[SEP]; optionally whole words) chosen at random; each becomes
   [MASK] with probability 80 %, stays itself 10 %, a random token 10 %.
5. All instances are shuffled and written in the NVIDIA/MLPerf HDF5 layout (`h5io`).

One deliberate difference: the random replacement token is drawn from the vocabulary
without its special tokens ([PAD] is id 0 and would read as padding in the packed layout).

How it runs (the semantics above, not Google's code): documents are flat token arrays
(`Documents`); a pair is two token ranges into them (`_PairBuilder`: a few draws of one
`random.Random(seed)` per pair, Google's calls in Google's order, checked against a list
version by a test); truncation and masking run in numpy over all rows of a chunk at once
(`truncate_pairs`, `_mask`), drawing from a PCG64 stream seeded by that Random. No per-token
Python runs (it was ~60 % of `create`). A seed gives identical files; the bytes differ from
versions before this layout (other draws, the same distribution).
"""
import array
import bisect
import collections.abc
import itertools
import random
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from bert_packed.data import h5io
from bert_packed.data.errors import DataError

class Documents(NamedTuple):
    """Tokenised documents as flat arrays: ``tokens`` (int32, every sentence back to back),
    ``sentence_ends`` (int64, cumulative token ends) and ``document_ends`` (int64, cumulative
    sentence ends). Every sentence and every document is non-empty. About 4 bytes a token,
    where lists of Python ints take 16-20."""

    tokens: np.ndarray
    sentence_ends: np.ndarray
    document_ends: np.ndarray

    @classmethod
    def from_lists(cls, documents):
        """From a list of documents, each a list of sentences, each a non-empty list of ids."""
        sentences = [sentence for document in documents for sentence in document]
        lengths = np.fromiter((len(s) for s in sentences), np.int64, len(sentences))
        tokens = np.fromiter(itertools.chain.from_iterable(sentences), np.int32, int(lengths.sum()))
        sizes = np.fromiter((len(d) for d in documents), np.int64, len(documents))
        return cls(tokens, np.cumsum(lengths), np.cumsum(sizes))

    def __len__(self):
        return len(self.document_ends)


def create_instances(documents, vocab_size, special_ids, *, max_seq_length, max_predictions,
                     dupe_factor, short_seq_prob=0.1, masked_lm_prob=0.15,
                     whole_word_mask=False, continuation_ids=frozenset(), seed=12345,
                     show_progress=False):
    """Run the algorithm on tokenised documents (a `Documents`, or a list of documents, each a list
    of sentences of token ids); return the shuffled `Instances`, which lay themselves out (and mask)
    a chunk of rows at a time.

    `special_ids`: dict with the ids of [CLS] [SEP] [MASK] (and the other specials, which
    are never drawn as random replacements). `continuation_ids`: ids of `##` pieces, used
    only with `whole_word_mask`.

    Pairs are chosen with one `random.Random(seed)` (a few draws per pair, in document
    order); truncation and masking draw in bulk from a NumPy PCG64 stream seeded from it
    (raw 64-bit words turned into doubles here, so no NumPy method's stream is relied on).
    """
    if not isinstance(documents, Documents):
        documents = Documents.from_lists(documents)
    rng = random.Random(seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    pairs = _PairBuilder(documents, order, max_seq_length - 3, short_seq_prob)
    with tqdm(total=dupe_factor * len(order), desc="create", unit=" docs", disable=not show_progress) as bar:
        for _ in range(dupe_factor):
            for index in range(len(order)):
                pairs.document(index, rng)
                bar.update()
    shuffled = list(range(len(pairs.random_next)))
    rng.shuffle(shuffled)
    stream = rng.getrandbits(64)
    excluded = set(special_ids.values())
    replacement_ids = np.array([i for i in range(vocab_size) if i not in excluded], np.int32)
    masking = _Masking(special_ids, replacement_ids, masked_lm_prob, max_predictions, whole_word_mask,
                       continuation_ids)
    return Instances(documents.tokens, pairs.truncated(max_seq_length - 3, stream),
                     np.asarray(shuffled, np.int64), max_seq_length, masking, stream)


def _uniform(seed_words, count):
    """``count`` doubles in [0, 1) from PCG64's raw words (53 bits each), seeded by ``seed_words``."""
    words = np.random.PCG64(np.random.SeedSequence(seed_words)).random_raw(int(count))
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


class _PairBuilder:
    """Google's pairing, on sentence and token offsets into `Documents` (no token is copied):
    each pair is (A start, A length, B start, B length, random next), A and B being runs of
    whole sentences, before truncation."""

    def __init__(self, documents, order, max_num_tokens, short_seq_prob):
        self.ends = documents.sentence_ends.tolist()
        self.starts = [0] + self.ends[:-1]
        document_ends = documents.document_ends.tolist()
        self.first = [0] + document_ends[:-1]  # first sentence of each document
        self.last = document_ends
        self.order, self.max_num_tokens, self.short_seq_prob = order, max_num_tokens, short_seq_prob
        self.a_start, self.a_length = array.array("q"), array.array("q")
        self.b_start, self.b_length = array.array("q"), array.array("q")
        self.random_next = array.array("b")

    def document(self, index, rng):
        """The pairs of the document at ``index`` of the shuffled order. ``randint(a, b)`` is drawn
        as ``a + rng._randbelow(b - a + 1)``, what randint itself does (the same draws, checked
        against randint by a test), without its argument handling (a third of this loop)."""
        ends, starts, below = self.ends, self.starts, rng._randbelow
        doc = self.order[index]
        first, last = self.first[doc], self.last[doc]
        target = self.max_num_tokens
        if rng.random() < self.short_seq_prob:
            target = 2 + below(self.max_num_tokens - 1)
        chunk = first  # the chunk's first sentence
        while chunk < last:
            a0 = starts[chunk]
            # sentences are gathered until they reach the target, or the document ends: sentence i
            i = min(bisect.bisect_left(ends, a0 + target, chunk, last), last - 1)
            size = i - chunk + 1
            a_end = chunk + (1 + below(size - 1) if size >= 2 else 1)  # A: sentences [chunk, a_end)
            a1 = ends[a_end - 1]
            if size == 1 or rng.random() < 0.5:
                b0, b1 = self._random_b(index, target - (a1 - a0), below)
                self.random_next.append(1)
                i = a_end - 1  # the gathered sentences not used as A go back to the document
            else:
                b0, b1 = a1, ends[i]
                self.random_next.append(0)
            self.a_start.append(a0)
            self.a_length.append(a1 - a0)
            self.b_start.append(b0)
            self.b_length.append(b1 - b0)
            chunk = i + 1

    def _random_b(self, index, target_b, below):
        """Token range of B from another document: from a random sentence on, whole sentences until
        it holds ``target_b`` tokens (at least one sentence; the document's end at most)."""
        for _ in range(10):  # ten tries to find another document (one-document corpora reuse this one)
            other = below(len(self.order))
            if other != index:
                break
        doc = self.order[other]
        first, last = self.first[doc], self.last[doc]
        start = first + below(last - first)
        b0 = self.starts[start]
        end = min(bisect.bisect_left(self.ends, b0 + target_b, start, last), last - 1)
        return b0, self.ends[end]

    def truncated(self, max_num_tokens, stream):
        """[n, 4] int64 (A start, A length, B start, B length) after truncation, and the labels."""
        pairs = np.stack([np.frombuffer(x, np.int64) for x in (self.a_start, self.a_length, self.b_start,
                                                                self.b_length)], axis=1)
        return truncate_pairs(pairs, max_num_tokens, [stream, 0]), np.frombuffer(self.random_next, np.int8)


def truncate_pairs(pairs, max_num_tokens, seed_words):
    """Google's truncation for every pair at once: while A + B is over ``max_num_tokens``, drop a
    token of the longer segment (B on ties), at its front or back with probability 1/2 each.
    Which segment loses how many is a function of the lengths alone (the longer one down to the
    other's length, then alternately, B first); the front/back draws are one uniform per dropped
    token. ``pairs``: [n, 4] (A start, A length, B start, B length); returns a new array."""
    pairs = np.array(pairs, np.int64)
    la, lb = pairs[:, 1], pairs[:, 3]
    over = np.maximum(la + lb - max_num_tokens, 0)
    first = np.minimum(over, np.abs(la - lb))  # from the longer segment
    rest = over - first
    cut_a = np.where(la > lb, first, 0) + rest // 2
    cut_b = np.where(la > lb, 0, first) + (rest + 1) // 2
    cuts = np.stack([cut_a, cut_b], axis=1).reshape(-1)
    draws = _uniform(seed_words, int(cuts.sum()))
    front = np.bincount(np.repeat(np.arange(cuts.size), cuts), weights=draws < 0.5,
                        minlength=cuts.size).astype(np.int64).reshape(-1, 2)
    pairs[:, 0] += front[:, 0]
    pairs[:, 1] -= cut_a
    pairs[:, 2] += front[:, 1]
    pairs[:, 3] -= cut_b
    return pairs


class _Masking(NamedTuple):
    special_ids: dict
    replacement_ids: np.ndarray
    masked_lm_prob: float
    max_predictions: int
    whole_word_mask: bool
    continuation_ids: frozenset


class Instances(collections.abc.Sized):
    """The shuffled instances of a run: token ranges into the documents' flat tokens, laid out
    and masked a chunk of ``ROWS`` rows at a time (`chunks`), so no per-token Python runs and
    the padded arrays of a whole run are never needed. Chunk c's masking draws are seeded by
    (stream, 1 + c): the output does not depend on who reads which chunk."""

    ROWS = 4096

    def __init__(self, tokens, pairs, order, max_seq_length, masking, stream):
        (self._pairs, self._random_next), self._tokens, self._order = pairs, tokens, order
        self.max_seq_length, self._masking, self._stream = max_seq_length, masking, stream

    def __len__(self):
        return len(self._order)

    def chunks(self):
        """Yields (first row, dict of NVIDIA-layout arrays) for every chunk of rows, in order."""
        for chunk, start in enumerate(range(0, len(self), self.ROWS)):
            rows = self._order[start:start + self.ROWS]
            arrays = _lay_out(self._tokens, self._pairs[rows], self.max_seq_length, self._masking,
                              [self._stream, 1 + chunk])
            arrays["next_sentence_labels"][:] = self._random_next[rows]
            yield start, arrays


def _ranges(starts, lengths):
    """The indices of the runs [start, start + length) back to back (int64)."""
    total = int(lengths.sum())
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return shift + np.arange(total, dtype=np.int64)


def _lay_out(tokens, pairs, max_seq_length, masking, seed_words):
    """[CLS] A [SEP] B [SEP] for every pair, padded, then masked (`_mask`): NVIDIA-layout arrays.
    Row-major order over a row's A (or B) columns is the order of its tokens, so boolean masks
    fill them from the runs' indices."""
    special = masking.special_ids
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype)
              in h5io.unpacked_shapes(len(pairs), max_seq_length, masking.max_predictions).items()}
    a0, la, b0, lb = pairs.T
    length, rows = la + lb + 3, np.arange(len(pairs))
    column = np.arange(max_seq_length)[None, :]
    ids = np.zeros((len(pairs), max_seq_length), np.int32)
    ids[(column >= 1) & (column <= la[:, None])] = tokens[_ranges(a0, la)]
    in_b = (column >= la[:, None] + 2) & (column < length[:, None] - 1)
    ids[in_b] = tokens[_ranges(b0, lb)]
    ids[:, 0] = special["[CLS]"]
    ids[rows, la + 1] = special["[SEP]"]
    ids[rows, length - 1] = special["[SEP]"]
    arrays["input_mask"][:] = column < length[:, None]
    arrays["segment_ids"][:] = in_b
    arrays["segment_ids"][rows, length - 1] = 1
    positions, labels, shown = (_mask_whole_words if masking.whole_word_mask else _mask)(
        ids, length, la, masking, seed_words)
    ids[rows[:, None], positions] = np.where(positions > 0, shown, ids[rows[:, None], positions])
    arrays["input_ids"][:] = ids
    arrays["masked_lm_positions"][:] = positions
    arrays["masked_lm_ids"][:] = labels
    return arrays


def _mask(ids, length, a_length, masking, seed_words):
    """Google's masking for every row at once: num_to_predict = min(max_predictions,
    max(1, round(15 % of the tokens))) positions (never [CLS]/[SEP]) chosen uniformly without
    replacement, as the first draws of a Fisher-Yates shuffle of the candidates (one vectorised
    step per masked slot, over all rows; the shuffle runs on candidate ranks, which are mapped
    to positions at the end); each shown as [MASK] 80 %, itself 10 %, a random non-special token
    10 %. Returns (positions, labels, shown), [rows, max_predictions], positions ascending,
    zero-padded."""
    special, width = masking.special_ids, masking.max_predictions
    num_rows, seq_len = ids.shape
    column = np.arange(seq_len)[None, :]
    candidate = (column < length[:, None]) & (ids != special["[CLS]"]) & (ids != special["[SEP]"])
    num_candidates = candidate.sum(axis=1)
    # round() halves to even, as Python's round in the reference
    wanted = np.minimum(width, np.maximum(1, np.round(length * masking.masked_lm_prob).astype(np.int64)))
    wanted = np.minimum(wanted, num_candidates)
    steps = int(wanted.max(initial=0))
    draws = _uniform(seed_words, num_rows * steps * 3).reshape(3, num_rows, steps)
    rank = np.broadcast_to(np.arange(seq_len), (num_rows, seq_len)).copy()
    for step in range(steps):
        live = np.flatnonzero(wanted > step)
        pick = step + (draws[0, live, step] * (num_candidates[live] - step)).astype(np.int64)
        rank[live, step], rank[live, pick] = rank[live, pick], rank[live, step]
    rank = rank[:, :steps]
    # Rank r is position r + 1 in A, r + 2 in B; rows with a special id inside A or B (text that
    # tokenised to one) look their candidates up.
    positions = rank + 1 + (rank >= a_length[:, None])
    odd = np.flatnonzero(num_candidates != length - 3)
    if odd.size:
        table = np.argsort(~candidate[odd], axis=1, kind="stable")
        positions[odd] = np.take_along_axis(table, np.minimum(rank[odd], seq_len - 1), axis=1)
    used = np.arange(steps)[None, :] < wanted[:, None]
    positions = np.sort(np.where(used, positions, seq_len), axis=1)
    positions = np.where(positions == seq_len, 0, positions)
    rows = np.arange(num_rows)[:, None]
    labels = np.where(used, ids[rows, positions], 0)
    replacement = masking.replacement_ids[(draws[2] * masking.replacement_ids.size).astype(np.int64)]
    shown = np.where(draws[1] < 0.8, special["[MASK]"], np.where(draws[1] < 0.9, labels, replacement))
    return _widen(positions, width), _widen(labels, width), _widen(np.where(used, shown, 0), width)


def _widen(values, width):
    out = np.zeros((values.shape[0], width), np.int64)
    out[:, :values.shape[1]] = values
    return out


def _mask_whole_words(ids, length, a_length, masking, seed_words):
    """--whole-word-mask: Google's word-group masking row by row (`_mask_words`: a word's pieces
    are not independent), the chunk's draws from a Python Random seeded from its stream. Same
    return as `_mask`."""
    rng = random.Random(int(_uniform(seed_words, 1)[0] * 2**53))
    width, replacement_ids = masking.max_predictions, masking.replacement_ids.tolist()
    positions, labels, shown = (np.zeros((len(ids), width), np.int64) for _ in range(3))
    for row in range(len(ids)):
        tokens = ids[row, :length[row]].tolist()
        output, masked, original = _mask_words(tokens, masking.masked_lm_prob, width, masking.special_ids,
                                               replacement_ids, rng, masking.continuation_ids)
        count = len(masked)
        positions[row, :count], labels[row, :count] = masked, original
        shown[row, :count] = [output[p] for p in masked]
    return positions, labels, shown


def _mask_words(tokens, masked_lm_prob, max_predictions, special_ids, replacement_ids, rng, continuation_ids):
    """Google's whole-word masking of one row: words (a token and its ``##`` pieces; never
    [CLS] or [SEP]) visited in a uniformly random order (drawn lazily, Fisher-Yates, one draw per
    word visited), a word skipped when it would overrun num_to_predict, until it is reached.
    Returns (tokens as shown, masked positions ascending, their original tokens)."""
    cls_id, sep_id, mask_id = special_ids["[CLS]"], special_ids["[SEP]"], special_ids["[MASK]"]
    candidates = []
    for position, token in enumerate(tokens):
        if token == cls_id or token == sep_id:
            continue
        if candidates and token in continuation_ids:
            candidates[-1].append(position)
        else:
            candidates.append([position])
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    output = list(tokens)
    masked = []
    random, num_candidates, num_replacements = rng.random, len(candidates), len(replacement_ids)
    for k in range(num_candidates):
        if len(masked) >= num_to_predict:
            break
        j = k + int(random() * (num_candidates - k))
        candidates[k], candidates[j] = candidates[j], candidates[k]
        group = candidates[k]
        if len(masked) + len(group) > num_to_predict:
            continue
        for position in group:
            if random() < 0.8:
                replacement = mask_id
            elif random() < 0.5:
                replacement = tokens[position]
            else:
                replacement = replacement_ids[int(random() * num_replacements)]
            output[position] = replacement
            masked.append((position, tokens[position]))
    masked.sort()
    return output, [p for p, _ in masked], [label for _, label in masked]


def check_options(max_seq_length, max_predictions, dupe_factor, masked_lm_prob, short_seq_prob):
    """DataError for an option the algorithm cannot run with (one check for file and shards)."""
    if max_seq_length < 5:
        raise DataError(f"--max-sequence-length {max_seq_length} is too short: [CLS] A [SEP] B [SEP] "
                        "needs at least 5")
    if max_predictions < 1:
        raise DataError(f"--max-predictions must be at least 1, got {max_predictions}")
    if dupe_factor < 1:
        raise DataError(f"--dupe-factor must be at least 1, got {dupe_factor}")
    if not 0 < masked_lm_prob < 1 or not 0 <= short_seq_prob <= 1:
        raise DataError("--masked-lm-prob must be in (0, 1) and --short-seq-prob in [0, 1]")
