"""``parquet``: one row per document, its text in the ``--text-column`` column; blocks are row groups.

Claimed by name (.parquet) or by the magic bytes ``PAR1``. The text column must hold strings (or
UTF-8 bytes): a column of another type (integers, say) and a null value are refused naming the
file and column, never skipped. Newlines in the text separate paragraphs, split into sentences.
"""
import os

from bert_packed.data.errors import DataError
from bert_packed.data.prepare.formats.base import Format, check_nul, text_sentences


class Parquet(Format):
    name = "parquet"
    suffixes = (".parquet",)
    help = "one row per document, the text in --text-column"

    def sniff(self, head, first):
        return head.startswith(b"PAR1")

    def plan_blocks(self, path, block_bytes, text_column):
        return [(group, group + 1) for group in range(_parquet_file(path, text_column).metadata.num_row_groups)]

    def text_bytes(self, path, text_column):
        """The uncompressed size of the text column (compressed Parquet holds several times its size)."""
        metadata = _parquet_file(path, text_column).metadata
        index = metadata.schema.to_arrow_schema().get_field_index(text_column)
        return sum(metadata.row_group(g).column(index).total_uncompressed_size for g in range(metadata.num_row_groups))

    def read_block(self, path, start, stop, text_column, max_seq_length=None):
        parquet = _parquet_file(path, text_column)
        first = sum(parquet.metadata.row_group(g).num_rows for g in range(start))
        for group in range(start, stop):
            column = parquet.read_row_group(group, columns=[text_column]).column(0)
            if column.null_count:
                row = first + column.is_null().to_pylist().index(True)
                raise DataError(f"{path}: column {text_column!r}: row {row} is null (no text); a Parquet corpus "
                                f"has text in every row: drop the null rows")
            for number, text in enumerate(column.to_pylist(), first):
                if isinstance(text, bytes):
                    try:
                        text = text.decode("utf-8")
                    except UnicodeDecodeError:
                        raise DataError(f"{path}: column {text_column!r}: row {number} is not UTF-8; corpora must "
                                        f"be UTF-8") from None
                check_nul(path, f"column {text_column!r}: row {number}", text)
                document = text_sentences(text)
                if document:
                    yield document
            first += len(column)


def _is_text(data_type):
    import pyarrow as pa

    checks = [pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary]
    checks += [getattr(pa.types, name) for name in ("is_string_view", "is_binary_view") if hasattr(pa.types, name)]
    return any(check(data_type) for check in checks)


def _parquet_file(path, text_column):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(os.fspath(path))
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise DataError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:160]})") from None
    schema = parquet.schema_arrow
    if text_column not in schema.names:
        raise DataError(f"{path}: no column {text_column!r} (it has {', '.join(map(repr, schema.names)) or 'none'}); "
                        f"name the text column with --text-column")
    data_type = schema.field(text_column).type
    if not _is_text(data_type):
        raise DataError(f"{path}: column {text_column!r} holds {data_type} values, not text; name the text column "
                        f"with --text-column")
    return parquet


FORMAT = Parquet()
