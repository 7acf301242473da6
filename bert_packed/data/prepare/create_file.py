"""Single-file `create` (``--output`` ending in .h5/.hdf5): the sharded engine writing one shard.

The file is the one shard of ``create --output DIR --output-shards 1`` with the same inputs and
options, byte for byte: the same format readers (bert_packed.data.prepare.formats, any format, files,
directories and globs), the same tokenising and the same seeds. The shard is made in a temporary
directory next to the output and moved onto it whole; a failure or Ctrl-C leaves nothing behind
(no resume: a single file is made in one go, as before).
"""
import os
import shutil
import tempfile

from bert_packed.io.files import TEMP_PREFIX, publish
from bert_packed.data import shards
from bert_packed.data.prepare.create_shards import DEFAULT_BLOCK_BYTES, WriteFailed, create_shards
from bert_packed.data.errors import DataError, refuse_output_over_input


def create_pretraining_file(input_paths, vocab_path, output_path, *, max_seq_length=128, max_predictions=20,
                            dupe_factor=10, seed=12345, short_seq_prob=0.1, masked_lm_prob=0.15, lowercase=True,
                            whole_word_mask=False, input_format=None, text_column="text", workers=1,
                            scheduler=None, block_bytes=DEFAULT_BLOCK_BYTES, show_progress=False):
    """The whole `create` step into one HDF5 file, written atomically; returns summary statistics
    (those of `create_shards.create_shards`, without the shard count)."""
    if isinstance(input_paths, (str, os.PathLike)):
        input_paths = [input_paths]
    input_paths = [os.fspath(p) for p in input_paths]
    output_path = os.fspath(output_path)
    refuse_output_over_input(output_path, input_paths + [os.fspath(vocab_path)])
    _refuse_inside_an_input_directory(output_path, input_paths)
    if os.path.isdir(output_path):
        raise DataError(f"--output {output_path} is a directory; a name ending in .h5/.hdf5 writes one file")
    folder = os.path.dirname(os.path.abspath(output_path))
    made = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    work = tempfile.mkdtemp(prefix=TEMP_PREFIX + "create-", dir=folder)
    try:
        summary = create_shards(input_paths, vocab_path, work, max_seq_length=max_seq_length,
                                max_predictions=max_predictions, dupe_factor=dupe_factor, seed=seed,
                                short_seq_prob=short_seq_prob, masked_lm_prob=masked_lm_prob, lowercase=lowercase,
                                whole_word_mask=whole_word_mask, input_format=input_format, text_column=text_column,
                                workers=workers, scheduler=scheduler, output_shards=1, block_bytes=block_bytes,
                                show_progress=show_progress)
        publish(os.path.join(work, shards.shard_name(0)), output_path)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        if made and not os.listdir(folder):
            os.rmdir(folder)
        if isinstance(exc, WriteFailed):  # its words are for a directory that keeps finished shards
            reason = str(exc).split("writing failed (", 1)[-1].split("); finished", 1)[0]
            raise DataError(f"{output_path}: writing failed ({reason}); nothing was written: free space (or raise "
                            f"the limit) and run the command again") from None
        raise
    shutil.rmtree(work, ignore_errors=True)
    summary.pop("num_shards", None)
    return summary


def _refuse_inside_an_input_directory(output_path, input_paths):
    """An output inside an input directory would be read as corpus by the next run."""
    target = os.path.realpath(output_path)
    for argument in input_paths:
        if os.path.isdir(argument):
            real = os.path.realpath(argument)
            if target.startswith(real + os.sep):
                raise DataError(f"--output {output_path} is inside the input directory {argument}; a rerun would read "
                                f"it as corpus: choose another --output")
