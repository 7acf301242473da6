"""The structure the project keeps (issue 22), checked on the source itself:

- layers point down: ``packing`` <- ``bert_packed`` <- ``ipu`` / ``backends`` <- ``run.py``; ``ipu``
  imports nothing from ``backends``; and no import circle among the project's modules, counting
  imports inside functions too (a lazy import is still an arrow);
- no function over 100 lines in ``bert_packed/``, ``backends/`` or ``run.py``;
- ``bert_packed`` names no backend (no "ipu"/"mock" string, no "cpu"/"cuda" string that is not a
  torch device) and probes no backend with ``getattr``/``hasattr``;
- every backend implements the contract it declares (``bert_packed.backend.Backend``).
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("packing", "bert_packed", "backends", "ipu")
# What each layer may import from the project (its own package included).
ALLOWED = {
    "packing": {"packing"},
    "bert_packed": {"packing", "bert_packed"},
    "ipu": {"packing", "bert_packed", "ipu"},
    "backends": {"packing", "bert_packed", "ipu", "backends"},
    "run": {"packing", "bert_packed", "ipu", "backends"},
}
BACKEND_NAMES = ("cpu", "cuda", "ipu", "mock")


def _modules():
    """{module name: path} of every project module (packages as their __init__)."""
    found = {"run": os.path.join(ROOT, "run.py")}
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join(parts)] = path
    return found


MODULES = _modules()


def _tree(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _imports(name, path):
    """Project modules ``name`` imports, anywhere in the file (functions included)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_layers_point_down():
    wrong = [(name, target) for name, targets in GRAPH.items() for target in targets
             if target.split(".")[0] not in ALLOWED[name.split(".")[0]]]
    assert not wrong, wrong


def test_no_import_circle_anywhere():
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert not circles, circles


def test_the_circles_of_issue_22_would_be_found():
    # The check above is not vacuous: a lazy import inside a function is an arrow (the task
    # reads checkpoints only when it has one; the model is built only when asked for).
    assert "bert_packed.hf_io" in GRAPH["bert_packed.task"] and "bert_packed.task" not in GRAPH["bert_packed.hf_io"]
    assert "bert_packed.modeling" in GRAPH["bert_packed.build"]
    # Issue 36: the task registry registers the tasks' keys with the config, never the reverse.
    assert "bert_packed.config" in GRAPH["bert_packed.task"] and "bert_packed.task" not in GRAPH["bert_packed.config"]


@pytest.mark.parametrize("prefix", ["bert_packed", "backends", "run"])
def test_no_function_over_100_lines(prefix):
    long = []
    for name, path in MODULES.items():
        if name.split(".")[0] != prefix:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def _parents(tree):
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _names_a_device(node):
    """``x.type``, ``device``, ``device_type``, ``query.device.type``: an expression of a torch device (type)."""
    text = ast.unparse(node)
    return text.endswith(".type") or "device" in text


def _is_torch_device(node, parent, parents):
    """A "cpu"/"cuda" string used as a torch device: map_location=/device= keywords, a comparison
    with a device (type) (``x.type == "cpu"``, ``device_type in ("cpu", "cuda")``),
    ``torch.device(...)`` / ``.to(...)`` / ``startswith``, a ``device=`` parameter default."""
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)):  # ("cpu", "cuda"): what the collection is used for
        parent = parents.get(parent)
    if isinstance(parent, ast.keyword):
        return parent.arg in ("map_location", "device", "device_type")
    if isinstance(parent, ast.Compare):
        return any(_names_a_device(side) for side in [parent.left, *parent.comparators])
    if isinstance(parent, ast.Call):
        func = parent.func
        return isinstance(func, ast.Attribute) and func.attr in ("device", "to", "startswith")
    if isinstance(parent, ast.arguments):  # a parameter default: def f(..., device="cpu")
        return True
    return False


def test_bert_packed_names_no_backend():
    found = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "bert_packed":
            continue
        tree = _tree(path)
        parents = _parents(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and node.value in BACKEND_NAMES):
                continue
            parent = parents.get(node)
            if node.value in ("cpu", "cuda") and _is_torch_device(node, parent, parents):
                continue
            found.append(f"{name}:{node.lineno} {node.value!r}")
    assert not found, found


def test_bert_packed_probes_no_backend():
    probes = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "bert_packed":
            continue
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                target = ast.unparse(node.args[0])
                if "backend" in target:
                    probes.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes


# ids without the bare names: conftest skips tests whose keywords include "cuda" or "ipu" (hardware).
@pytest.mark.parametrize("name", ["cpu", "cuda", "ipu", "mock"], ids=lambda name: f"backend_{name}")
def test_every_backend_implements_its_contract(name):
    from backends import BACKENDS, get_backend_class
    from bert_packed.backend import Backend

    cls = get_backend_class(name)
    assert issubclass(cls, Backend) and cls.name == name
    assert cls.config_section == BACKENDS[name][2]
    required = ("is_available", "prepare", "train_step", "eval_step", "predict_step", "state_dict", "profile")
    missing = [member for member in required if getattr(cls, member) is getattr(Backend, member)]
    assert not missing, missing
    if cls.offline_compile:
        assert cls.compile_only is not Backend.compile_only
