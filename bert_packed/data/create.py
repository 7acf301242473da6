"""`create`: raw text -> unpacked pre-training HDF5 (Google BERT's create_pretraining_data).

Input text: one sentence per line, documents separated by blank lines. The algorithm is
the one of Google's reference implementation, re-implemented here on token ids:

1. Tokenise every line with WordPiece (`tokenizers`, BertWordPieceTokenizer normalisation);
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
Everything is driven by one `random.Random(seed)`, so a seed gives identical files.
"""
import array
import collections
import collections.abc
import itertools
import os
import random

import numpy as np
from tqdm import tqdm

from . import h5io
from .errors import DataError
from .errors import refuse_output_over_input
from .vocab import SPECIAL_TOKENS, check_corpus_file, load_vocab, utf8_lines

Instance = collections.namedtuple(
    "Instance", "tokens segment_ids masked_positions masked_labels is_random_next")


def read_documents(input_paths, vocab_path, *, lowercase=True, batch_lines=4096,
                   show_progress=False):
    """Tokenise corpus files into documents: a list of documents, each a list of sentences,
    each a non-empty list of token ids. Blank lines end documents; empty ones are dropped."""
    from tokenizers import BertWordPieceTokenizer

    load_vocab(vocab_path)  # checks the special tokens with a clear message
    tokenizer = BertWordPieceTokenizer(os.fspath(vocab_path), clean_text=True, handle_chinese_chars=True,
                                       strip_accents=None, lowercase=lowercase)
    documents = [[]]

    def flush(lines):
        encodings = iter(tokenizer.encode_batch([x for x in lines if x is not None],
                                                add_special_tokens=False))
        for line in lines:
            if line is None:
                documents.append([])
                continue
            ids = next(encodings).ids
            if ids:
                documents[-1].append(list(ids))

    for path in input_paths:
        check_corpus_file(path)
        pending = []
        # Invalid UTF-8 is refused with file, line and byte (vocab.utf8_lines: one policy for
        # `vocab` and `create`).
        for line in tqdm(utf8_lines(path), desc=f"tokenise {os.path.basename(path)}", unit=" lines",
                         disable=not show_progress):
            line = line.strip()
            # A blank line is a document boundary; keep its place in the batch order.
            pending.append(line if line else None)
            if len(pending) >= batch_lines:
                flush(pending)
                pending = []
        if pending:
            flush(pending)
        documents.append([])  # files never share a document
    documents = [doc for doc in documents if doc]
    if not documents:
        raise DataError(f"{', '.join(map(str, input_paths))}: no text found; the corpus needs "
                        "one sentence per line, documents separated by blank lines")
    return documents


def create_instances(documents, vocab_size, special_ids, *, max_seq_length, max_predictions,
                     dupe_factor, short_seq_prob=0.1, masked_lm_prob=0.15,
                     whole_word_mask=False, continuation_ids=frozenset(), seed=12345,
                     show_progress=False):
    """Run the algorithm on tokenised documents; return the shuffled instances (an
    `InstanceStore`: a sequence of `Instance`, held in flat typed arrays).

    `special_ids`: dict with the ids of [CLS] [SEP] [MASK] (and the other specials, which
    are never drawn as random replacements). `continuation_ids`: ids of `##` pieces, used
    only with `whole_word_mask`.
    """
    rng = random.Random(seed)
    documents = list(documents)
    rng.shuffle(documents)
    excluded = set(special_ids.values())
    replacement_ids = [i for i in range(vocab_size) if i not in excluded]
    instances = InstanceStore()
    total = dupe_factor * len(documents)
    with tqdm(total=total, desc="create", unit=" docs", disable=not show_progress) as bar:
        for _ in range(dupe_factor):
            for index in range(len(documents)):
                instances.extend(_instances_from_document(
                    documents, index, rng, max_seq_length, max_predictions, short_seq_prob,
                    masked_lm_prob, special_ids, replacement_ids, whole_word_mask,
                    continuation_ids))
                bar.update()
    instances.shuffle(rng)
    return instances


class InstanceStore(collections.abc.Sequence):
    """The instances of a run in flat typed arrays: about 4 bytes a token where Python lists of
    ints take 16-20 (a pointer per token in each of two lists, plus the list objects), so
    `create` holds dupe_factor x its text in instances at a quarter of the memory. Items are
    `Instance`s of int32/int8 numpy views, in the shuffled order once `shuffle` has run.

    `shuffle(rng)` permutes exactly as `rng.shuffle` permutes a list of the same length (the
    permutation depends on the length alone), so the output equals the list version's.
    """

    def __init__(self):
        self._tokens, self._segments = array.array("i"), array.array("b")
        self._positions, self._labels = array.array("i"), array.array("i")
        self._token_ends, self._masked_ends = array.array("q"), array.array("q")
        self._random_next = array.array("b")
        self._order = None

    def extend(self, instances):
        if self._order is not None:
            raise RuntimeError("InstanceStore is read-only once shuffled")
        for instance in instances:
            self._tokens.extend(instance.tokens)
            self._segments.extend(instance.segment_ids)
            self._positions.extend(instance.masked_positions)
            self._labels.extend(instance.masked_labels)
            self._token_ends.append(len(self._tokens))
            self._masked_ends.append(len(self._positions))
            self._random_next.append(int(instance.is_random_next))

    def shuffle(self, rng):
        order = list(range(len(self._token_ends)))
        rng.shuffle(order)
        self._order = array.array("q", order)

    def __len__(self):
        return len(self._token_ends)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if self._order is not None:
            index = self._order[index]
        t0 = self._token_ends[index - 1] if index else 0
        m0 = self._masked_ends[index - 1] if index else 0
        t1, m1 = self._token_ends[index], self._masked_ends[index]
        view = memoryview
        return Instance(np.frombuffer(view(self._tokens)[t0:t1], np.intc),
                        np.frombuffer(view(self._segments)[t0:t1], np.int8),
                        np.frombuffer(view(self._positions)[m0:m1], np.intc),
                        np.frombuffer(view(self._labels)[m0:m1], np.intc), bool(self._random_next[index]))


def _instances_from_document(documents, index, rng, max_seq_length, max_predictions,
                             short_seq_prob, masked_lm_prob, special_ids, replacement_ids,
                             whole_word_mask, continuation_ids):
    document = documents[index]
    max_num_tokens = max_seq_length - 3  # room for [CLS], [SEP], [SEP]
    target_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_length = rng.randint(2, max_num_tokens)
    instances = []
    chunk, chunk_length = [], 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_length:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = list(itertools.chain.from_iterable(chunk[:a_end]))
            tokens_b = []
            if len(chunk) == 1 or rng.random() < 0.5:
                is_random_next = True
                target_b_length = target_length - len(tokens_a)
                # Ten tries to find another document (one-document corpora reuse this one).
                for _ in range(10):
                    other = rng.randint(0, len(documents) - 1)
                    if other != index:
                        break
                other_document = documents[other]
                start = rng.randint(0, len(other_document) - 1)
                for sentence in other_document[start:]:
                    tokens_b.extend(sentence)
                    if len(tokens_b) >= target_b_length:
                        break
                # The gathered sentences not used as A go back to the document.
                i -= len(chunk) - a_end
            else:
                is_random_next = False
                tokens_b = list(itertools.chain.from_iterable(chunk[a_end:]))
            _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng)
            tokens = [special_ids["[CLS]"]] + tokens_a + [special_ids["[SEP]"]] + tokens_b \
                + [special_ids["[SEP]"]]
            segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
            tokens, positions, labels = _mask_tokens(
                tokens, masked_lm_prob, max_predictions, special_ids, replacement_ids, rng,
                whole_word_mask, continuation_ids)
            instances.append(Instance(tokens, segment_ids, positions, labels, is_random_next))
            chunk, chunk_length = [], 0
        i += 1
    return instances


def _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng):
    """Trim the longer segment (front or back at random) until the pair fits. One draw per
    removed token, as the reference does, but the cuts are counted first and applied once (the
    reference deletes token by token from the front of a list: quadratic in the cut)."""
    lengths, cuts = [len(tokens_a), len(tokens_b)], [[0, 0], [0, 0]]
    while lengths[0] + lengths[1] > max_num_tokens:
        longer = 0 if lengths[0] > lengths[1] else 1
        # Both ends, so the model does not learn that text always ends at a sentence end.
        cuts[longer][0 if rng.random() < 0.5 else 1] += 1
        lengths[longer] -= 1
    for segment, (front, back) in zip((tokens_a, tokens_b), cuts):
        if front or back:
            segment[:] = segment[front:len(segment) - back]


def _mask_tokens(tokens, masked_lm_prob, max_predictions, special_ids, replacement_ids, rng,
                 whole_word_mask, continuation_ids):
    """Google's masking: candidates (words with --whole-word-mask, else tokens; never [CLS] or
    [SEP]) visited in a uniformly random order until num_to_predict positions are masked.

    The random order is drawn lazily (Fisher-Yates, one draw per candidate visited) instead of
    shuffling every candidate as the reference does: the same distribution, but about 20 draws
    per sequence instead of about 115 at S=128 (the full shuffle was 40 % of `create`'s time)."""
    cls_id, sep_id, mask_id = special_ids["[CLS]"], special_ids["[SEP]"], special_ids["[MASK]"]
    if whole_word_mask:
        candidates = []
        for position, token in enumerate(tokens):
            if token == cls_id or token == sep_id:
                continue
            if candidates and token in continuation_ids:
                candidates[-1].append(position)
            else:
                candidates.append([position])
    elif tokens.count(cls_id) + tokens.count(sep_id) == 3 and tokens[0] == cls_id:
        # [CLS] A [SEP] B [SEP] with no special id inside A or B (C-speed scans): every other position
        second = tokens.index(sep_id)
        candidates = list(range(1, second)) + list(range(second + 1, len(tokens) - 1))
    else:  # single tokens: the same draws as one-token groups, without the group objects
        candidates = [p for p, token in enumerate(tokens) if token != cls_id and token != sep_id]
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
        if not whole_word_mask:
            group = (group,)
        elif len(masked) + len(group) > num_to_predict:
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


def instances_to_arrays(instances, max_seq_length, max_predictions):
    """Instances -> dict of NVIDIA-layout numpy arrays (padded with zeros)."""
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype)
              in h5io.unpacked_shapes(len(instances), max_seq_length, max_predictions).items()}
    for row, instance in enumerate(instances):
        length, num_masked = len(instance.tokens), len(instance.masked_positions)
        arrays["input_ids"][row, :length] = instance.tokens
        arrays["input_mask"][row, :length] = 1
        arrays["segment_ids"][row, :length] = instance.segment_ids
        arrays["masked_lm_positions"][row, :num_masked] = instance.masked_positions
        arrays["masked_lm_ids"][row, :num_masked] = instance.masked_labels
        arrays["next_sentence_labels"][row] = int(instance.is_random_next)
    return arrays


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


def create_pretraining_file(input_paths, vocab_path, output_path, *, max_seq_length=128,
                            max_predictions=20, dupe_factor=10, seed=12345, short_seq_prob=0.1,
                            masked_lm_prob=0.15, lowercase=True, whole_word_mask=False,
                            show_progress=False):
    """The whole `create` step; writes `output_path` atomically and returns summary statistics."""
    if isinstance(input_paths, (str, os.PathLike)):
        input_paths = [input_paths]
    input_paths = [os.fspath(p) for p in input_paths]
    refuse_output_over_input(output_path, input_paths + [os.fspath(vocab_path)])
    check_options(max_seq_length, max_predictions, dupe_factor, masked_lm_prob, short_seq_prob)
    vocab_path = os.fspath(vocab_path)
    vocab = load_vocab(vocab_path)
    documents = read_documents(input_paths, vocab_path, lowercase=lowercase,
                               show_progress=show_progress)
    special_ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    continuation_ids = frozenset(i for token, i in vocab.items() if token.startswith("##"))
    vocab_size = max(vocab.values()) + 1
    instances = create_instances(
        documents, vocab_size, special_ids, max_seq_length=max_seq_length,
        max_predictions=max_predictions, dupe_factor=dupe_factor, short_seq_prob=short_seq_prob,
        masked_lm_prob=masked_lm_prob, whole_word_mask=whole_word_mask,
        continuation_ids=continuation_ids, seed=seed, show_progress=show_progress)
    arrays = instances_to_arrays(instances, max_seq_length, max_predictions)
    with h5io.atomic_h5(output_path) as handle:
        for name in h5io.UNPACKED_FIELDS:
            h5io.create_dataset(handle, name, arrays[name])
        handle.attrs.update({
            "max_seq_length": max_seq_length, "max_predictions_per_seq": max_predictions,
            "dupe_factor": dupe_factor, "seed": seed, "short_seq_prob": short_seq_prob,
            "masked_lm_prob": masked_lm_prob, "do_lower_case": bool(lowercase),
            "whole_word_mask": bool(whole_word_mask), "vocab_size": vocab_size,
            "num_documents": len(documents)})
    lengths = arrays["input_mask"].sum(axis=1, dtype=np.int64)
    num_masked = (arrays["masked_lm_ids"] != 0).sum()
    return {"num_documents": len(documents), "num_sequences": len(instances),
            "num_tokens": int(lengths.sum()), "num_masked_tokens": int(num_masked),
            "random_next_fraction": float(arrays["next_sentence_labels"].mean()) if instances else 0.0,
            "padding_fraction": 1.0 - float(lengths.sum()) / max(1, len(instances) * max_seq_length)}
