"""``lines``: one sentence per line, a blank line between documents (lines are not split further).

The format of any file that no other format claims. A line is one sentence and is never split, so a
line longer than any sequence of the configuration could use (``CHARS_PER_TOKEN_LIMIT`` characters
per token of ``--max-sequence-length``: a file without line breaks, a paragraph per line) is
refused: truncation would drop nearly all of it without a word.
"""
from bert_packed.data.errors import DataError
from bert_packed.data.prepare.formats.base import CHARS_PER_TOKEN_LIMIT, TextFormat, first_line


class Lines(TextFormat):
    name = "lines"
    fallback = True
    help = "one sentence per line, a blank line between documents"

    def boundary(self, line):
        # A blank line, exactly as the reader decides it (str.strip of the decoded line).
        return "after" if not line.decode("utf-8", "replace").strip() else None

    def documents(self, lines, path, start, text_column, max_seq_length):
        limit = None if max_seq_length is None else CHARS_PER_TOKEN_LIMIT * max_seq_length
        document = []
        for number, line in enumerate(lines):
            line = line.strip()
            if limit is not None and len(line) > limit:
                raise DataError(f"{path}: line {first_line(path, start) + number} is {len(line)} characters long, "
                                f"more than a sequence of --max-sequence-length {max_seq_length} can use (at most "
                                f"{limit}); this format is one sentence per line and never splits a line: break "
                                f"the text into sentences (a file without line breaks?) or give it as JSONL")
            if line:
                document.append(line)
            elif document:
                yield document
                document = []
        if document:
            yield document


FORMAT = Lines()
