"""The data pipeline's error class, shared with the data sources of the package.

User mistakes (missing or corrupt files, missing fields, a bad vocabulary, an empty corpus,
a sequence longer than the configured length) raise `DataError` (a ValueError) with a
one-line message that names the problem and the fix; the CLI prints it as `error: ...`
and exits 2.
"""
import os


class DataError(ValueError):
    """A user mistake about data (missing file, wrong fields or shapes): one line."""


def refuse_output_over_input(output_path, input_paths, *, option="--output"):
    """DataError when ``output_path`` is one of ``input_paths`` (the same file, however named):
    writing it would destroy the input the step is reading."""
    output = os.path.realpath(os.fspath(output_path))
    for path in input_paths:
        path = os.fspath(path)
        same = os.path.realpath(path) == output
        if not same and os.path.exists(path) and os.path.exists(output):
            same = os.path.samefile(path, output)
        if same:
            raise DataError(f"{option} {output_path} is also an input ({path}); writing it would destroy the input: "
                            f"choose another output path")
