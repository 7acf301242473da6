"""The structure the project keeps (issue 22), checked on the source itself:

- layers point down: ``packing`` <- ``bert_packed`` <- ``ipu`` / ``backends`` <- ``run.py``; ``ipu``
  imports nothing from ``backends``; and no import circle among the project's modules, counting
  imports inside functions too (a lazy import is still an arrow);
- no function over 100 lines in ``bert_packed/``, ``backends/``, ``packing/``, ``ipu/`` or ``run.py``;
- ``bert_packed`` names no backend (no "ipu"/"mock" string, no "cpu"/"cuda" string that is not a
  torch device) and probes no backend with ``getattr``/``hasattr``;
- every backend implements the contract it declares (``bert_packed.backend.Backend``) and the
  optional capabilities it claims (``Profiling``, ``OfflineCompile``), which the loop never uses;
- (issue 36) the configuration is a leaf: ``bert_packed.config`` imports no task, backend, torch or
  reader of checkpoints/data, and building a ``Config`` loads none of them; every backend class is
  defined in ``backends/``; run.py's ``--backend`` lists the backend registry.
- every task is a package of the same files (issue 36; pre-training too, issue 48), each registered
  task in it; at most 8 modules at the top of ``bert_packed``; what training reads never imports
  the offline data tools (``bert_packed.data.prepare``, issue 48).
"""
import ast
import os
import subprocess
import sys

import pytest

from backends import BACKENDS

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
    assert "bert_packed.io.hf_io" in GRAPH["bert_packed.tasks.base"] and "bert_packed.tasks.base" not in GRAPH["bert_packed.io.hf_io"]
    assert "bert_packed.model.modeling" in GRAPH["bert_packed.model.build"]
    # Issue 36: the task registry registers the tasks' keys with the config, never the reverse.
    assert "bert_packed.config" in GRAPH["bert_packed.tasks.registry"]
    assert "bert_packed.tasks.registry" not in GRAPH["bert_packed.config"]


@pytest.mark.parametrize("prefix", ["bert_packed", "backends", "packing", "ipu", "run"])
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
@pytest.mark.parametrize("name", sorted(BACKENDS), ids=lambda name: f"backend_{name}")
def test_every_backend_implements_its_contract(name):
    from backends import BACKENDS, get_backend_class
    from bert_packed.backend import Backend, OfflineCompile, Profiling

    cls = get_backend_class(name)
    assert issubclass(cls, Backend) and cls.name == name
    assert cls.config_section == BACKENDS[name][2]
    required = ("is_available", "prepare", "train_step", "eval_step", "predict_step", "state_dict")
    missing = [member for member in required if getattr(cls, member) is getattr(Backend, member)]
    assert not missing, missing
    if issubclass(cls, Profiling):
        assert cls.profile is not Profiling.profile
    if issubclass(cls, OfflineCompile):
        assert cls.compile_only is not OfflineCompile.compile_only


# What every task package holds, pre-training's too (bert_packed/tasks/packed.py says what goes where).
TASK_FILES = {"__init__.py", "task.py", "model.py", "data.py", "metrics.py"}
TASKS_DIR = os.path.join(ROOT, "bert_packed", "tasks")


def _task_packages():
    return sorted(name for name in os.listdir(TASKS_DIR)
                  if os.path.isfile(os.path.join(TASKS_DIR, name, "__init__.py")))


def test_every_task_package_has_the_same_files():
    packages = _task_packages()
    assert {"pretraining", "classification", "squad", "token_classification"} <= set(packages), packages
    files = {name: {f for f in os.listdir(os.path.join(TASKS_DIR, name)) if f.endswith(".py")} for name in packages}
    wrong = {name: sorted(found ^ TASK_FILES) for name, found in files.items() if found != TASK_FILES}
    assert not wrong, wrong
    # Nothing task-specific is left loose beside them: the interface, the registry and what the
    # fine-tuning tasks share.
    loose = {f for f in os.listdir(TASKS_DIR) if f.endswith(".py")}
    assert loose == {"__init__.py", "base.py", "registry.py", "packed.py", "data.py"}, sorted(loose)


def test_every_registered_task_lives_in_its_package():
    from bert_packed.tasks.base import Task
    from bert_packed.tasks.packed import PackedTask
    from bert_packed.tasks.registry import TASKS, task_class

    assert set(TASKS) == set(_task_packages())
    for name in TASKS:
        cls = task_class(name)
        assert cls.__module__ == f"bert_packed.tasks.{name}.task" and issubclass(cls, Task), (name, cls)
        assert name == "pretraining" or issubclass(cls, PackedTask), (name, cls)
        model = cls.model_class(None)  # reads nothing of the task
        assert model.__module__ == f"bert_packed.tasks.{name}.model", (name, model)


def test_bert_packed_keeps_at_most_eight_modules_at_the_top():
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "bert_packed")) if f.endswith(".py"))
    assert len(top) <= 8, top


# What training reads never imports the offline data tools (create, pack, vocab, stats: they
# write the files the readers read), so the readers and the tools can change apart.
PREPARE = "bert_packed.data.prepare"


def test_training_never_imports_the_offline_data_tools():
    # (run.py's --profile reads a dataset's lengths through `stats`: an analysis, not training.)
    training = ("bert_packed.loop", "bert_packed.tasks", "bert_packed.model", "backends", "ipu")
    readers = [m for m in MODULES if m.startswith("bert_packed.data") and not m.startswith(PREPARE)
               and m != "bert_packed.data.__main__"]
    assert {"bert_packed.data.hdf5", "bert_packed.data.sharded", "bert_packed.data.generated"} <= set(readers)
    wrong = {m: sorted(t for t in _reachable(m) if t.startswith(PREPARE))
             for m in readers + [m for m in MODULES if m.startswith(training)]}
    wrong = {m: t for m, t in wrong.items() if t}
    assert not wrong, wrong


def test_the_offline_tools_check_would_see_an_import():
    # Not vacuous: the command line reaches the tools, and the tools reach the readers' h5io.
    assert any(t.startswith(PREPARE) for t in _reachable("bert_packed.data.__main__"))
    assert "bert_packed.data.h5io" in _reachable("bert_packed.data.prepare.pack")


def test_user_text_is_decoded_in_one_place():
    # bert_packed.io.files.read_utf8 / utf8_lines decode user text files; bert_packed/data keeps the
    # corpus readers of its own pipeline (data.vocab.utf8_lines) until it adopts them.
    found = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "bert_packed" or name in ("bert_packed.io.files",) or name.startswith("bert_packed.data"):
            continue
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "decode"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "utf-8"):
                found.append(f"{name}:{node.lineno}")
    assert not found, found


# -- issue 36: configuration as a leaf, one home for backends ------------------------------------

# What the config must not pull in: tasks, backends and their IPU knowledge, the model, and the
# readers of checkpoints and data (it reads its own YAML through bert_packed.io.yaml_io).
NOT_FOR_CONFIG = ("bert_packed.tasks", "bert_packed.finetune", "backends", "ipu", "bert_packed.io.hf_io",
                  "bert_packed.io.checkpoint", "bert_packed.data", "bert_packed.model.modeling", "bert_packed.loop.train")


def _reachable(name):
    """Project modules ``name`` imports, directly or through others (lazy imports included)."""
    seen, todo = set(), [name]
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _imports_torch(path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_config_imports_no_task_backend_torch_or_reader():
    reached = _reachable("bert_packed.config") | {"bert_packed.config"}
    wrong = sorted(m for m in reached if m.startswith(NOT_FOR_CONFIG))
    assert not wrong, wrong
    with_torch = sorted(m for m in reached if _imports_torch(MODULES[m]))
    assert not with_torch, with_torch


def test_the_config_check_would_see_an_import_of_a_task():
    # Not vacuous: the task registry imports the config and (lazily) hf_io and torch users.
    reached = _reachable("bert_packed.tasks.registry")
    assert "bert_packed.config" in reached and "bert_packed.io.hf_io" in reached
    assert any(m.startswith(NOT_FOR_CONFIG) for m in reached - {"bert_packed.tasks.registry"})
    assert any(_imports_torch(MODULES[m]) for m in reached)


def test_building_a_config_loads_no_torch_task_or_backend():
    code = ("import sys\n"
            "import bert_packed.config as c\n"
            "config = c.Config()\n"
            "assert config.train.steps > 0 and config.finetune.task is None\n"
            f"bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith({NOT_FOR_CONFIG!r}))\n"
            "print(','.join(bad))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", result.stdout


def test_registering_brings_the_sections_and_keys_a_run_uses():
    # What the config holds only once the registries have registered it (run.py does, as conftest).
    code = ("import sys\n"
            "import bert_packed.config as c\n"
            "before = set(c.Config().sections), set(vars(c.Config().finetune))\n"
            "from run import register_config_sections\n"
            "register_config_sections()\n"
            "after = set(c.Config().sections), set(vars(c.Config().finetune))\n"
            "print(sorted(after[0] - before[0]), 'text_column' in after[1] - before[1], "
            "'doc_stride' in after[1] - before[1])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["['cpu',", "'cuda',", "'ipu']", "True", "True"]


def _class_bases(node):
    return [ast.unparse(base).rpartition(".")[2] for base in node.bases]


def _backend_classes():
    """(module, class) of every class in the project that subclasses the backend contract or one
    of its capabilities, directly or through another project class."""
    roots = {"Backend", "Profiling", "OfflineCompile"}
    classes = [(name, node) for name, path in MODULES.items() for node in ast.walk(_tree(path))
               if isinstance(node, ast.ClassDef)]
    found, grew = set(), True
    while grew:
        grew = False
        for name, node in classes:
            if (name, node.name) not in found and any(b in roots for b in _class_bases(node)):
                found.add((name, node.name))
                roots.add(node.name)
                grew = True
    return found


def test_no_backend_class_outside_backends():
    found = _backend_classes()
    assert {("backends.cpu", "CPUBackend"), ("backends.ipu", "PopTorchBackend"),
            ("backends.mock", "MockBackend")} <= found  # the search finds them
    outside = sorted(f"{module}.{cls}" for module, cls in found if module.split(".")[0] != "backends")
    assert not outside, outside


def test_registered_backends_are_defined_in_backends():
    from backends import BACKENDS, get_backend_class
    from bert_packed.backend import Backend

    for name in BACKENDS:
        for cls in get_backend_class(name).__mro__:
            if issubclass(cls, Backend) and cls is not Backend:
                assert cls.__module__.split(".")[0] == "backends", (name, cls)


def test_the_loop_uses_no_optional_capability():
    from bert_packed.backend import OfflineCompile, Profiling

    members = {m for cap in (Profiling, OfflineCompile) for m in vars(cap) if not m.startswith("_")}
    assert {"profile", "cost_unit", "compile_only", "memory_report"} <= members
    used = []
    for name, path in MODULES.items():
        if name == "bert_packed.loop.train" or name.startswith("bert_packed.loop"):
            used += [f"{name}:{n.lineno} .{n.attr}" for n in ast.walk(_tree(path))
                     if isinstance(n, ast.Attribute) and n.attr in members]
    assert not used, used


def test_backend_choices_are_the_registry():
    import run
    from backends import BACKENDS, available_backends

    action = next(a for a in run.build_parser()._actions if "--backend" in a.option_strings)
    listed = action.metavar.strip("{}").split(",")
    assert listed == available_backends() and set(listed) == set(BACKENDS)
    assert action.help.startswith(" | ".join(available_backends()))


class BareBackend:
    """A backend with the core contract only (no Profiling, no OfflineCompile); made a subclass of
    ``Backend`` when the test registers it (this module defines no backend class at import)."""


@pytest.mark.parametrize("mode, fragment", [
    ("--profile", "--profile: backend 'bare' has no Profiling capability"),
    ("--compile-only", "--compile-only compiles ahead of time: use --backend ipu or mock, not 'bare'"),
])
def test_a_backend_without_a_capability_is_refused_in_one_line(mode, fragment, monkeypatch, capsys, tmp_path):
    import backends
    import run
    from bert_packed.backend import Backend

    bare = type("Bare", (Backend,), {"name": "bare", "is_available": staticmethod(lambda config=None: True)})
    monkeypatch.setattr(sys.modules[__name__], "BareBackend", bare)
    monkeypatch.setitem(backends.BACKENDS, "bare", (__name__, "BareBackend", None))
    assert run.main(["--config", "tiny", "--backend", "bare", mode, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "out").exists()


def test_a_run_validates_once_and_resolves_the_checkpoint_shape_once(monkeypatch, tmp_path, capsys, one_thread):
    """run.py validates before it builds the backend, the loop when it starts: the checks run once.
    The init checkpoint's shape is resolved as the config loads, and the task does not resolve it
    again when it reads the weights."""
    import run
    from bert_packed import config as config_module
    from bert_packed.io import hf_io
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.config import load_config

    checkpoint = str(tmp_path / "init")
    hf_io.save_pretrained(build_model(load_config("tiny", ["model.num_hidden_layers=1"])), checkpoint)
    calls = {"validate": 0, "resolve": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(config_module, "_check", counted("validate", config_module._check))
    monkeypatch.setattr(hf_io, "resolve_model_config", counted("resolve", hf_io.resolve_model_config))
    argv = ["--config", "tiny", "--steps", "1", "--init-checkpoint", checkpoint, "--no-progress",
            "--set", "train.hf_export=false", "--set", "train.tensorboard=false", "--output-dir", str(tmp_path / "run")]
    assert run.main(argv) == 0
    assert calls == {"validate": 1, "resolve": 1}
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"num_hidden_layers": 1' in summary  # the checkpoint's shape, not tiny.yaml's 2
