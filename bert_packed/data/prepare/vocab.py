"""WordPiece vocabularies: train one from raw text, load and check one for `create`.

The vocabulary file is the plain BERT `vocab.txt` (one token per line, the line number is
the id), so Google's and Hugging Face's vocabularies work as they are.
"""
import os

from bert_packed.io.files import read_vocab_tokens, write_text_atomic
from bert_packed.data.prepare import formats
from bert_packed.data.errors import DataError, refuse_output_over_input

# The order matters only for ids: [PAD] = 0 because the packed layout reads token 0 as
# padding; the rest follow the Hugging Face convention.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_vocab(input_paths, vocab_size, output_path, *, lowercase=True, min_frequency=2,
                limit_alphabet=1000, input_format=None, text_column="text"):
    """Train a WordPiece vocabulary with `tokenizers` and write it atomically as vocab.txt.

    The inputs are read as `create` reads them (files, directories, globs; each in its format,
    detected or ``input_format``: bert_packed.data.prepare.formats), so WikiExtractor markup, JSON syntax or
    Parquet bytes never become words, and every check of the readers applies.
    Normalisation is BertWordPieceTokenizer's (clean text, split Chinese characters, strip
    accents and lower-case when `lowercase`). Returns the number of tokens written (at most
    `vocab_size`; a small corpus may yield fewer).
    """
    from tokenizers import BertWordPieceTokenizer

    if isinstance(input_paths, (str, os.PathLike)):
        input_paths = [input_paths]
    input_paths = formats.expand_inputs([os.fspath(p) for p in input_paths])
    refuse_output_over_input(output_path, input_paths)
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise DataError(f"--size {vocab_size} is too small: use at least {len(SPECIAL_TOKENS) + 1}")
    for path in input_paths:
        check_corpus_file(path)
    inputs = [(path, formats.detect_format(path, input_format)) for path in input_paths]
    for _ in _sentences(inputs, text_column):  # every input checked before training starts
        pass
    tokenizer = BertWordPieceTokenizer(clean_text=True, handle_chinese_chars=True,
                                       strip_accents=None, lowercase=lowercase)
    tokenizer.train_from_iterator(_sentences(inputs, text_column), vocab_size=vocab_size,
                                  min_frequency=min_frequency, limit_alphabet=limit_alphabet,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False, wordpieces_prefix="##")
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


def _sentences(inputs, text_column, batch=1024):
    """Batches of the inputs' sentences, as `create` reads them."""
    pending = []
    for path, fmt in inputs:
        for document in formats.read_documents(path, fmt, text_column):
            pending.extend(document)
            if len(pending) >= batch:
                yield pending
                pending = []
    if pending:
        yield pending


check_corpus_file = formats.check_corpus_file


def load_vocab(path):
    """Read vocab.txt -> dict token -> id; raise DataError if a required special token is missing,
    or a token is listed twice (its id would be ambiguous)."""
    if not os.path.lexists(path) or os.path.isdir(path):
        raise DataError(f"{path}: vocabulary file not found (make one with "
                        "`python -m bert_packed.data vocab`)")
    formats.base.check_input_file(path, "vocabulary file")
    tokens = read_vocab_tokens(path, DataError)
    vocab = {token: index for index, token in enumerate(tokens)}
    missing = [token for token in SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise DataError(f"{path}: the vocabulary lacks {' '.join(missing)}; "
                        "BERT pre-training needs [PAD] [UNK] [CLS] [SEP] [MASK]")
    if vocab["[PAD]"] != 0:
        # The packed layout and the NVIDIA files both read token id 0 as padding.
        raise DataError(f"{path}: [PAD] must be the first line (id 0), it is line "
                        f"{vocab['[PAD]'] + 1}")
    return vocab
