"""WordPiece vocabularies: train one from raw text, load and check one for `create`.

The vocabulary file is the plain BERT `vocab.txt` (one token per line, the line number is
the id), so Google's and Hugging Face's vocabularies work as they are.
"""
import os

from ..io import read_utf8, utf8_lines as _utf8_lines, write_text_atomic
from .errors import DataError, refuse_output_over_input

# The order matters only for ids: [PAD] = 0 because the packed layout reads token 0 as
# padding; the rest follow the Hugging Face convention.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_vocab(input_paths, vocab_size, output_path, *, lowercase=True, min_frequency=2,
                limit_alphabet=1000):
    """Train a WordPiece vocabulary with `tokenizers` and write it atomically as vocab.txt.

    Normalisation is BertWordPieceTokenizer's (clean text, split Chinese characters, strip
    accents and lower-case when `lowercase`). Returns the number of tokens written (at most
    `vocab_size`; a small corpus may yield fewer).
    """
    from tokenizers import BertWordPieceTokenizer

    if isinstance(input_paths, (str, os.PathLike)):
        input_paths = [input_paths]
    input_paths = [os.fspath(p) for p in input_paths]
    refuse_output_over_input(output_path, input_paths)
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise DataError(f"--size {vocab_size} is too small: use at least {len(SPECIAL_TOKENS) + 1}")
    for path in input_paths:
        check_corpus_file(path)
        for _ in utf8_lines(path):  # the same invalid-UTF-8 policy as `create` (see utf8_lines)
            pass
    tokenizer = BertWordPieceTokenizer(clean_text=True, handle_chinese_chars=True,
                                       strip_accents=None, lowercase=lowercase)
    tokenizer.train(input_paths, vocab_size=vocab_size, min_frequency=min_frequency,
                    limit_alphabet=limit_alphabet, special_tokens=list(SPECIAL_TOKENS),
                    show_progress=False, wordpieces_prefix="##")
    # tokenizers numbers the alphabet and equally frequent merges in its hash maps' order, which
    # changes from process to process: the same corpus gave the same tokens under different ids
    # (three runs, three files). Ids carry no meaning for BERT, so they are made canonical: the
    # special tokens first, in their fixed order, then every other token sorted by its text.
    learned = sorted(set(tokenizer.get_vocab()) - set(SPECIAL_TOKENS))
    tokens = [token for token in SPECIAL_TOKENS if token in tokenizer.get_vocab()] + learned
    if len(tokens) <= len(SPECIAL_TOKENS):
        raise DataError(f"{input_paths[0]}: no words found to build a vocabulary from; "
                        "give a corpus with text in it")
    write_text_atomic(output_path, "".join(token + "\n" for token in tokens))
    return len(tokens)


def utf8_lines(path):
    """The lines of corpus file `path`, decoded as UTF-8 (line ends kept).

    The one invalid-UTF-8 policy of `vocab` and `create`: a corpus must be UTF-8, and a byte
    sequence that is not is refused with one line naming the file, line and byte offset (no
    silent replacement or dropping: either would train on text that is not in the corpus).
    The message is bert_packed.io's, as for every user file. Convert a file with
    `iconv -f <encoding> -t utf-8`, or drop bad bytes with `iconv -c`.
    """
    with open(path, "rb") as handle:
        yield from _utf8_lines(path, handle, DataError)  # the project's one reader of user text (bert_packed.io)


def check_corpus_file(path):
    """Raise DataError unless `path` is a readable, non-empty text file."""
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; give corpus text files")
    if not os.path.isfile(path):
        raise DataError(f"{path}: corpus file not found")
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    if not head.strip():
        raise DataError(f"{path}: the corpus is empty; give one sentence per line, "
                        "documents separated by blank lines")


def load_vocab(path):
    """Read vocab.txt -> dict token -> id; raise DataError if a required special token is missing."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: vocabulary file not found (make one with "
                        "`python -m bert_packed.data vocab`)")
    tokens = [line.rstrip("\r") for line in read_utf8(path, DataError).split("\n")]
    while tokens and tokens[-1] == "":
        tokens.pop()
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    missing = [token for token in SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise DataError(f"{path}: the vocabulary lacks {' '.join(missing)}; "
                        "BERT pre-training needs [PAD] [UNK] [CLS] [SEP] [MASK]")
    if vocab["[PAD]"] != 0:
        # The packed layout and the NVIDIA files both read token id 0 as padding.
        raise DataError(f"{path}: [PAD] must be the first line (id 0), it is line "
                        f"{vocab['[PAD]'] + 1}")
    return vocab
