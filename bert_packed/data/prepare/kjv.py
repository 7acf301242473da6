"""The King James Bible as a small real corpus (Debian package `bible-kjv`).

`bible -f Gen1:1-Rev22:21` prints one verse per line as `Ge1:1 In the beginning ...`
(book abbreviation, chapter:verse, a space, the text). We strip the references, keep one
verse per line (verses are sentence-like) and make every chapter a document, separated
by blank lines: the input format of `create`.
"""
import re
import shutil
import subprocess

from bert_packed.data.errors import DataError
from bert_packed.io.files import write_text_atomic

_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)\s+(.*)$")


def kjv_available():
    """True when the `bible` program (Debian bible-kjv) is installed."""
    return shutil.which("bible") is not None


def kjv_documents(first="Gen1:1", last="Rev22:21"):
    """Run `bible` and return the chapters as documents: a list of lists of verse strings."""
    if not kjv_available():
        raise DataError("the `bible` program is not installed; install Debian's bible-kjv "
                        "(apt-get install bible-kjv)")
    result = subprocess.run(["bible", "-f", f"{first}-{last}"], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise DataError(f"bible -f {first}-{last} failed: {result.stderr.strip() or result.stdout.strip()}")
    documents, current = [], None
    for line in result.stdout.splitlines():
        match = _VERSE.match(line.strip())
        if match is None:
            continue  # headers or blank lines, if a version prints any
        book, chapter, _, text = match.groups()
        if (book, chapter) != current:
            documents.append([])
            current = (book, chapter)
        if text.strip():
            documents[-1].append(text.strip())
    if not documents:
        raise DataError(f"bible -f {first}-{last} printed no verses; check the range")
    return documents


def write_kjv_corpus(output_path, first="Gen1:1", last="Rev22:21"):
    """Write the range as a `create` corpus (one verse per line, chapters as documents).

    Returns (num_documents, num_verses).
    """
    documents = kjv_documents(first, last)
    write_text_atomic(output_path, "\n".join("\n".join(doc) + "\n" for doc in documents))
    return len(documents), sum(len(doc) for doc in documents)
