"""The model and the IPU path use only torch 2.0 APIs (the Poplar SDK 3.3/3.4 ships torch 2.0.1).

We cannot install torch 2.0.1 here (a 600 MB wheel), so two checks run on the installed torch:

1. Dynamic, the strong one: a mock-IPU train step and eval step run under a
   ``TorchFunctionMode`` that records every torch function, ``torch.nn.functional`` function and
   Tensor method actually called, with the keyword arguments used. Each must be in
   ``TORCH_2_0`` below: APIs (and keywords) checked by hand against the torch 2.0 reference
   (pytorch.org/docs/2.0). A new call fails the test until someone checks it and adds it.
2. Static, a tripwire: the sources of the model and IPU path (bert_packed model files, ipu/) are
   scanned for attribute chains and keywords that PyTorch added after 2.0 (hand-curated from
   the 2.1-2.6 release notes; not exhaustive). ``bert_packed/model/attention/flex.py`` is exempt: it is
   the CUDA-only path, imported lazily and guarded.
"""
import ast
import os

from torch.overrides import TorchFunctionMode

from backends.mock import MockBackend
from bert_packed.config import load_config
from bert_packed.model.build import build_optimizer
from bert_packed.tasks.pretraining.model import build_model
from bert_packed.loop.plan import make_plan
from ipu_helpers import TINY_MODEL, random_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> keyword arguments verified in torch 2.0 (positional use is always fine).
TORCH_2_0 = {
    "torch.gather": set(), "torch.matmul": set(), "torch.ones_like": {"dtype"}, "torch.softmax": {"dim", "dtype"},
    "torch.stack": {"dim"}, "torch.device": set(), "torch.tanh": set(), "torch.tensor": {"dtype", "device"},
    "torch.zeros": {"device", "dtype"}, "torch.zeros_like": {"dtype", "device"}, "torch.full": {"dtype", "device"},
    "torch.arange": {"device", "dtype"}, "torch.where": set(), "torch.cat": {"dim"}, "torch.ones": {"dtype", "device"},
    "torch.equal": set(),
    "torch.nn.functional.gelu": {"approximate"}, "torch.nn.functional.linear": set(),
    "torch.nn.functional.dropout": {"p", "training", "inplace"},
    "torch.nn.functional.embedding": {"padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"},
    "torch.nn.functional.layer_norm": {"weight", "bias", "eps"},
    "torch.nn.functional.cross_entropy": {"weight", "size_average", "ignore_index", "reduce", "reduction",
                                          "label_smoothing"},
    "torch.nn.functional.softmax": {"dim", "dtype"},
    "torch.nn.functional.scaled_dot_product_attention": {"attn_mask", "dropout_p", "is_causal"},
    "torch._C._set_grad_enabled": set(),
    "torch.ops.profiler._record_function_enter_new": set(), "torch.ops.profiler._record_function_exit": set(),
    "Tensor.backward": {"gradient", "retain_graph", "create_graph", "inputs"},
    "Tensor.norm": {"p", "dim", "keepdim", "dtype"}, "Tensor.add_": {"alpha"}, "Tensor.addcmul_": {"value"},
    "Tensor.argmax": {"dim", "keepdim"}, "Tensor.clamp": {"min", "max"}, "Tensor.sum": {"dim", "keepdim", "dtype"},
    "Tensor.mean": {"dim", "keepdim"}, "Tensor.to": {"dtype", "device"}, "Tensor.masked_fill": set(),
    "Tensor.__get__": set(), "Tensor.__set__": set(),  # property access (.grad, .data, .shape)
}
TORCH_2_0["Tensor.split"] = {"dim"}  # Tensor.split(split_size, dim=0) in 2.0
TORCH_2_0.update({f"Tensor.{name}": set() for name in (
    "__and__", "__eq__", "__float__", "__getitem__", "__invert__", "__mul__", "__add__", "__radd__", "__rsub__",
    "__truediv__", "__or__", "__ne__", "__gt__", "__lt__", "__neg__", "__rmul__", "__sub__", "__setitem__",
    "add", "clone", "copy_", "detach", "dim", "div", "div_", "double", "expand", "float", "gt", "mul", "mul_", "ne",
    "reshape", "sqrt", "sub", "t", "transpose", "view", "half", "int", "long", "unsqueeze", "squeeze", "contiguous",
    "permute", "size", "eq", "item", "exp", "log", "max", "min", "abs", "type_as", "new_zeros", "fill_", "zero_",
    "masked_fill_", "view_as", "expand_as", "flatten", "chunk", "__len__", "numel", "tolist", "cpu",
    "requires_grad_", "to", "float", "bool", "logical_and", "all", "any", "lt", "le", "ge", "sign", "rsqrt", "pow",
    "neg", "sigmoid", "tanh", "softmax", "log_softmax", "matmul", "bmm", "baddbmm", "addmm", "index_select",
    "register_hook")})  # register_hook(hook): the mock's layer reports (loop.within_step.watch_layers)

# attribute chain -> the torch version that added it (tripwire for the static scan)
POST_2_0 = {
    "torch.compiler": "2.1", "torch.export": "2.1", "torch.float8_e4m3fn": "2.1", "torch.float8_e5m2": "2.1",
    "torch.nn.utils.parametrizations.weight_norm": "2.1", "torch.utils.flop_counter": "2.1",
    "torch.nn.attention": "2.2", "torch.unravel_index": "2.2", "torch.distributed.device_mesh": "2.2",
    "torch.library.impl_abstract": "2.2", "torch.amp.GradScaler": "2.3", "torch.get_default_device": "2.3",
    "torch.uint16": "2.3", "torch.uint32": "2.3", "torch.uint64": "2.3", "torch.nn.functional.rms_norm": "2.4",
    "torch.nn.RMSNorm": "2.4", "torch.library.custom_op": "2.4", "torch.library.register_fake": "2.4",
    "torch.serialization.add_safe_globals": "2.4", "torch.amp.custom_fwd": "2.4", "torch.amp.custom_bwd": "2.4",
    "torch.xpu": "2.4", "torch.nn.Buffer": "2.5", "torch.cond": "2.5", "torch.accelerator": "2.6",
    "torch.nn.attention.flex_attention": "2.5",
}
# (function, keyword) -> version that added the keyword
POST_2_0_KEYWORDS = {("scaled_dot_product_attention", "scale"): "2.1",
                     ("scaled_dot_product_attention", "enable_gqa"): "2.5"}

SCANNED = ["bert_packed/model/modeling.py", "bert_packed/model/attention/__init__.py", "bert_packed/model/losses.py", "bert_packed/optim.py",
           "bert_packed/collate.py", "bert_packed/model/attention/bucketed.py"] + sorted(
    os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, "ipu"))
    for f in files if f.endswith(".py"))


def _api_name(func):
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    owner, _, name = qualname.rpartition(".")
    if owner in ("TensorBase", "_TensorBase", "Tensor", "getset_descriptor"):  # _TensorBase: torch 2.0
        return f"Tensor.{name}"
    if owner == "_VariableFunctionsClass":
        return f"torch.{name}"
    if module == "torch._C._nn":
        return f"torch.nn.functional.{name}"
    if module.startswith("torch._ops."):
        op = qualname.split("::")[-1].split(".")[0] if "::" in qualname else name
        return f"torch.ops.{module[len('torch._ops.'):]}.{op}"
    if "loss_fn" in qualname:  # the mock's recording wrapper around a torch loss function
        return "torch.nn.functional.cross_entropy"
    return f"{module}.{name}" if module else name


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.setdefault(_api_name(func), set()).update(kwargs)
        return func(*args, **kwargs)


def test_ipu_path_calls_only_torch_2_0_apis():
    config = load_config("phase2", TINY_MODEL + [
        "model.num_hidden_layers=2", "ipu.layers_per_ipu=[1,1]", "train.gradient_accumulation=5",
        "train.micro_batch_size=1", "ipu.replication_factor=1", "ipu.half_precision=false"])
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model, (0.9, 0.999))
    backend = MockBackend()
    backend.prepare(model, optimizer, make_plan(config, backend), scheduler=scheduler)
    batches = random_micro_batches(0, 5, config)
    recorder = _Recorder()
    with recorder:
        backend.train_step(batches)
        backend.eval_step(batches[0])
    assert len(recorder.calls) > 30  # the recorder saw the model run
    unknown = sorted(name for name in recorder.calls if name not in TORCH_2_0)
    assert not unknown, f"not checked against torch 2.0: {unknown} (verify in the 2.0 docs, then add to TORCH_2_0)"
    new_keywords = {name: sorted(kw - TORCH_2_0[name]) for name, kw in recorder.calls.items() if kw - TORCH_2_0[name]}
    assert not new_keywords, f"keywords not checked against torch 2.0: {new_keywords}"


def _chains(tree, aliases):
    """Dotted attribute chains rooted at an imported torch name, e.g. 'torch.nn.functional.gelu'."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            current = node
            while isinstance(current, ast.Attribute):
                parts.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id in aliases:
                yield ".".join([aliases[current.id]] + parts[::-1]), node.lineno


def scan_source(text, path):
    """Problems (one line each) for post-2.0 attribute chains, imports and keywords in ``text``."""
    problems = []
    tree = ast.parse(text)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0])
                            for a in node.names if a.name.split(".")[0] == "torch"})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                for chain, version in POST_2_0.items():
                    if full == chain or full.startswith(chain + "."):
                        problems.append(f"{path}:{node.lineno} imports {full} (torch {version})")
    for chain, line in _chains(tree, aliases):
        for banned, version in POST_2_0.items():
            if chain == banned or chain.startswith(banned + "."):
                problems.append(f"{path}:{line} uses {chain} (torch {version})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for keyword in node.keywords:
                version = POST_2_0_KEYWORDS.get((name, keyword.arg))
                if version:
                    problems.append(f"{path}:{node.lineno} calls {name}({keyword.arg}=...) (torch {version})")
    return problems


def test_sources_use_no_api_added_after_torch_2_0():
    problems = []
    for path in SCANNED:
        with open(os.path.join(ROOT, path)) as f:
            problems += scan_source(f.read(), path)
    assert len(SCANNED) > 10
    assert not problems, "\n".join(problems)


def test_the_static_scan_can_fail():
    """The tripwire catches post-2.0 uses (so an empty result above means something)."""
    snippet = ("import torch\nimport torch.nn.functional as F\nfrom torch.nn.attention import sdpa_kernel\n"
               "x = F.rms_norm(y, (4,))\nz = torch.nn.RMSNorm(4)\n"
               "a = F.scaled_dot_product_attention(q, k, v, scale=0.1)\n")
    problems = scan_source(snippet, "snippet.py")
    assert len(problems) == 4, problems
