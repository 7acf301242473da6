"""``wikiextractor``: WikiExtractor output, ``<doc id=.. url=.. title=..>`` ... ``</doc>``.

The title line right after ``<doc>`` is dropped (it repeats the title attribute); every other line
is a paragraph split into sentences. Blocks start at ``<doc`` lines. A ``<doc>`` without its
``</doc>``, a ``</doc>`` without its ``<doc>`` and text outside any document (after the last
``</doc>``, say) are refused: the file is cut, or is not WikiExtractor output.
"""
from bert_packed.data.errors import DataError
from bert_packed.data.prepare.formats.base import TextFormat, first_line, split_sentences


def opens_doc(line) -> bool:
    """A ``<doc ...>`` line (bytes or str; the same test when cutting and reading)."""
    return line[:5] in (b"<doc ", b"<doc>", "<doc ", "<doc>")


class WikiExtractor(TextFormat):
    name = "wikiextractor"
    help = "WikiExtractor output (<doc ...> ... </doc>)"

    def sniff(self, head, first):
        return opens_doc(first)

    def boundary(self, line):
        return "at" if opens_doc(line) else None

    def documents(self, lines, path, start, text_column, max_seq_length):
        document, opened, title_next = [], None, False
        for number, line in enumerate(lines):
            stripped = line.strip()
            if opens_doc(line):
                if opened is not None:
                    _cut_doc(path, start, opened, "before the next <doc>")
                document, opened, title_next = [], number, True
            elif stripped == "</doc>":
                if opened is None:
                    raise DataError(f"{path}: line {first_line(path, start) + number}: </doc> without its <doc>; the "
                                    f"file is cut or is not WikiExtractor output (force another with --format)")
                if document:
                    yield document
                document, opened = [], None
            elif opened is not None:
                if title_next:
                    title_next = False  # the title repeats the doc's title attribute; not a sentence
                else:
                    document.extend(split_sentences(stripped))
            elif stripped:
                raise DataError(f"{path}: line {first_line(path, start) + number}: text outside any <doc> ... </doc> "
                                f"({stripped[:40]!r}); WikiExtractor output holds only documents: remove it, or "
                                f"force another format with --format")
        if opened is not None:
            _cut_doc(path, start, opened, "at the end of the file")


def _cut_doc(path, start, opened, where):
    raise DataError(f"{path}: line {first_line(path, start) + opened}: this <doc> has no </doc> {where}: the file "
                    f"is cut in the middle of a document (an interrupted WikiExtractor run?); re-extract it or "
                    f"leave it out")


FORMAT = WikiExtractor()
