"""`packing` stands alone: it imports, packs and runs its command line with torch made
unimportable, and installing the project pulls no torch (pyproject's dependencies)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any "import torch" below now raises ImportError
import numpy as np
import packing
from packing import Histogram, pack, pack_sequences
from packing.cli import main
histogram = Histogram.from_lengths(np.arange(1, 200) % 64 + 1, 64)
for name in packing.ALGORITHMS:
    pack(histogram, name, 3 if name in ("nnlshp", "ennlshp") else None)
rows = pack_sequences([[1, 2, 3], [4] * 60, [5] * 7], 64, "lp")
assert main(["report", "--histogram", "wikipedia-512", "--algorithm", "lpfhp", "--json"]) == 0
print("torch-free:", sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "bert_packed")))
"""


def test_packing_works_without_torch():
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    completed = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=environment,
                               cwd=ROOT, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().splitlines()[-1] == "torch-free: ['torch']"  # only the blocking entry
    assert json.loads("\n".join(completed.stdout.strip().splitlines()[:-1]))[0]["algorithm"] == "lpfhp"


def test_installing_the_project_pulls_no_torch():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import pytest
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    names = [requirement.split(">")[0].split("=")[0].split("[")[0].strip().lower()
             for requirement in project["dependencies"]]
    assert "torch" not in names and {"numpy", "scipy", "highspy"} <= set(names)
