"""Helpers of the hostile-input suite (tests/*/test_hostile_*.py).

Every case asserts three things: the exact one-line message, the exit code, and that the
inputs and the previous outputs are byte-identical afterwards (``snapshot`` before,
``assert_unchanged`` after). Calls go in-process (``run.main``, the data CLI's ``main``)
so the suite stays fast; only real signals need a subprocess.
"""
import hashlib
import os

import run

TINY = ["--config", "tiny", "--no-progress", "--set", "data.num_sequences=300", "--set", "data.num_eval_sequences=60",
        "--set", "data.packing_algorithm=lpfhp",
        "--set", "train.micro_batch_size=4"]


def snapshot(*roots):
    """{path: sha256} of every file under ``roots`` (files or folders), hidden files included."""
    digests = {}
    for root in roots:
        root = os.fspath(root)
        paths = [root] if os.path.isfile(root) else [
            os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names]
        for path in paths:
            with open(path, "rb") as handle:
                digests[path] = hashlib.sha256(handle.read()).hexdigest()
    return digests


def assert_unchanged(before, *roots, ignore=(".lock",)):
    after = {path: digest for path, digest in snapshot(*roots).items()
             if os.path.basename(path) not in ignore}
    before = {path: digest for path, digest in before.items() if os.path.basename(path) not in ignore}
    assert after == before, sorted(set(after.items()) ^ set(before.items()))


def main_error(capsys, argv, entry=None):
    """(exit code, the one stderr line) of ``entry(argv)`` (default run.main); asserts one line."""
    code = (entry or run.main)(argv)
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith(("warning:", "note:"))]
    assert len(err) == 1, err
    return code, err[0]


def run_ok(capsys, argv):
    code = run.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured
