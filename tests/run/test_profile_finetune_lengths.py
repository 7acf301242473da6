"""``--profile`` with a fine-tuning config packs the training file's own lengths (issue 46, from
the previous held-out round: it took its packing factors from the Wikipedia histogram)."""
import numpy as np
import pytest

from bert_packed.analysis import profiling
from bert_packed.config import load_config
from finetune_fixtures import classification_rows, tiny_pretraining_checkpoint, write_rows

transformers = pytest.importorskip("transformers")


def test_a_fine_tuning_profile_packs_the_training_files_lengths(tmp_path):
    from packing import Histogram, pack

    from bert_packed.tasks.registry import get_task

    checkpoint = tiny_pretraining_checkpoint(transformers, tmp_path)
    train = write_rows(str(tmp_path / "train.csv"), classification_rows(60, 1), ["text", "label"])
    dev = write_rows(str(tmp_path / "dev.csv"), classification_rows(10, 2), ["text", "label"])
    overrides = [f"model.init_checkpoint={checkpoint}", "data.max_sequence_length=64", f"finetune.train_file={train}",
                 f"finetune.validation_file={dev}", "data.packing_algorithm=lpfhp"]
    config = load_config("finetune_classification", overrides)
    task = get_task(load_config("finetune_classification", overrides))
    task.setup(show_progress=False)
    expected = np.asarray(task.train_data.lengths)
    assert len(expected) == 60

    lengths = profiling.data_lengths(config)
    assert np.array_equal(np.sort(lengths), np.sort(expected))
    assert config.finetune.train_file == train and config.data.path is None  # the caller's config as given
    stats = profiling.packing_statistics(config, depths=(1, 3), lengths=lengths)
    direct = pack(Histogram.from_lengths(expected, 64), algorithm="lpfhp", max_sequences_per_pack=3).to_dict()
    assert stats["rows"][3]["packing_factor"] == pytest.approx(direct["packing_factor"], rel=1e-12)
    histogram = profiling.packing_statistics(config, depths=(1, 3))  # what it used to report
    assert abs(stats["rows"][3]["packing_factor"] - histogram["rows"][3]["packing_factor"]) > 0.1
    assert stats["source"] == "lengths of the fine-tuning training data"
