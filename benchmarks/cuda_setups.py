"""The setups of benchmarks/cuda_throughput.py: what each row trains, and how it is built.

A row is one :class:`Setup` of :data:`SETUPS`: ours at a fixed micro-batch (``--micro-batch-size``,
``--gradient-accumulation``), ``run-py-default`` (exactly what ``python run.py --backend cuda
--config NAME`` resolves to: the same ``load_config`` and ``resolve_run`` run.py calls, no override
but the generated data's size and, for a CPU dry run, ``cuda.device=cpu``), a lever on top of that
default (one line of :data:`LEVERS`: the switch's overrides; a switch this tree does not have is a
row that says "not available"), or a Hugging Face peer. Every row trains the config's recipe, its
dropouts included.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from benchmarks.common import ensure_root_on_path

ensure_root_on_path()

from bert_packed.config import ConfigError, load_config, resolve_run  # noqa: E402
from bert_packed.loop.plan import make_plan  # noqa: E402
from run import register_config_sections  # noqa: E402

register_config_sections()  # the backends' sections before any config loads

LAYOUTS = (("padded", 1), ("packed", 3))  # --tiles-only
RUN_PY_DEFAULT = "run-py-default"


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    family: str  # "ours" (fixed micro-batch), "run.py" (run.py's resolution, + a lever's switch) or "hf"
    depth: int  # data.max_sequences_per_pack of the data it trains on (HF rows: 1, then flattened or padded)
    attention: str  # our registry name, HF's attn_implementation, or "resolved" (run.py's choice)
    label: str
    switch: Tuple[str, ...] = ()  # a lever: the config overrides that turn it on (family "run.py")


# One line per lever: (row, overrides that turn it on, label). Each row is run.py's default plus
# the switch; a switch the config does not know is a "not available" row, not a crash.
LEVERS = (
    ("lever-fused-qkv", ("model.fused_qkv=true",), "run.py default + one fused QKV projection"),
    ("lever-padded-vocab", ("model.vocab_padding_multiple=64",), "run.py default + vocabulary padded to 64"),
    ("lever-compiled-lamb", ("cuda.compile_optimizer=true",), "run.py default + LAMB and clipping compiled"),
    ("lever-cuda-graphs", ("cuda.compile_mode=reduce-overhead",), "run.py default + the compiled step as CUDA graphs (reduce-overhead)"),
    ("lever-fp8", ("cuda.fp8=true",), "run.py default + FP8 linear layers (torchao)"),
)

SETUPS = {s.name: s for s in (
    Setup(RUN_PY_DEFAULT, "run.py", 3, "resolved", "run.py --backend cuda default (no overrides)"),
    *(Setup(name, "run.py", 3, "resolved", label, tuple(switch)) for name, switch, label in LEVERS),
    Setup("packed-dense", "ours", 3, "dense", "packed, dense mask"),
    Setup("packed-sdpa", "ours", 3, "sdpa", "packed, sdpa + block-diagonal mask"),
    Setup("packed-flex", "ours", 3, "flex", "packed, flex (skips tiles between sequences)"),
    Setup("packed-varlen", "ours", 3, "varlen", "packed, torch varlen (Flash over cu_seqlens)"),
    Setup("padded-sdpa", "ours", 1, "sdpa", "padded, sdpa + padding mask (every padding token computed)"),
    Setup("padded-dense", "ours", 1, "dense", "padded, dense mask (every padding token computed)"),
    Setup("padded-flex", "ours", 1, "flex", "padded, flex (skips padding tiles: not the usual baseline)"),
    Setup("hf-padded-sdpa", "hf", 1, "sdpa", "HF BertForPreTraining, padded, sdpa"),
    Setup("hf-padding-free-fa2", "hf", 1, "flash_attention_2", "HF padding-free (DataCollatorWithFlattening), flash_attention_2"),
    Setup("hf-padding-free-varlen", "hf", 1, "torch_varlen", "HF padding-free (DataCollatorWithFlattening), torch varlen"),
)}
BASELINE = "padded-sdpa"  # the first ratio column: sequences/s over the usual padded baseline's

# Published dense (no 2:4 sparsity) tensor-core peaks, TFLOP/s, from NVIDIA's data sheets
# (the sheets print the sparse figures, twice these, for TF32/BF16/FP16):
# A100: nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# H100 SXM / PCIe / NVL: resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
# H200: nvidia.com/en-us/data-center/h200/ (same compute as H100 SXM)
# L4: nvidia.com/en-us/data-center/l4/ ; L40S: nvidia.com/en-us/data-center/l40s/
# "fp32" is plain FP32 (cuda.allow_tf32 false); fp32 with TF32 allowed is rated at "tf32".
PEAK_TFLOPS = (  # (substring of torch.cuda.get_device_name, peaks); first match wins
    ("H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 366.0, "fp16": 366.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def peak_tflops(device_name: str, precision: str, allow_tf32: bool) -> Optional[float]:
    """Dense peak TFLOP/s of ``device_name`` for the run's matmul precision, or None if unlisted/CPU."""
    key = "tf32" if precision == "fp32" and allow_tf32 else precision
    for substring, peaks in PEAK_TFLOPS:
        if substring.lower() in device_name.lower():
            return peaks[key]
    return None


def training_flops(model: Any, lengths: np.ndarray, num_masked: int, with_nsp: bool = True) -> float:
    """Useful FLOPs of one training pass (forward + backward) over sequences of ``lengths``.

    Counted per real token: the encoder's matmuls (Q, K, V and output projections 4 H^2,
    feed-forward 2 H I, per layer) and, per sequence of n tokens, attention scores and
    context (2 n^2 H per layer); the MLM head at the ``num_masked`` masked tokens (transform
    H^2 + decoder H V); the pooler and NSP classifier per sequence. Backward costs twice the
    forward, and a multiply-add is 2 FLOPs: 6 x multiply-adds. Padding, the tiles between
    sequences, unused MLM slots and HF's decoder over unmasked tokens are computed by some
    setups but are not useful work, so they are not counted: MFU compares setups on the same
    work.
    """
    h, layers, inter, vocab = model.hidden_size, model.num_hidden_layers, model.intermediate_size, model.vocab_size
    lengths = np.asarray(lengths, dtype=np.float64)
    macs = layers * (4 * h * h + 2 * h * inter) * lengths.sum() + layers * 2 * h * np.square(lengths).sum()
    macs += num_masked * (h * h + h * vocab)
    if with_nsp:
        macs += len(lengths) * (h * h + 2 * h)
    return float(6 * macs)


def batch_counts(batch: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """Host-side counts of one micro-batch: real sequence lengths and masked tokens."""
    ids = np.asarray(batch["sequence_ids"])
    rows, seq_len = ids.shape
    width = int(ids.max()) + 1
    per_row = np.stack([np.bincount(ids[r], minlength=width) for r in range(rows)])[:, 1:]
    lengths = per_row[per_row > 0]
    return {"lengths": lengths, "sequences": int(lengths.size), "tokens": int(lengths.sum()),
            "masked": int((np.asarray(batch["mlm_sequence_ids"]) > 0).sum()), "slots": rows * seq_len}


# ----------------------------------------------------------------------------- availability


def unavailable_reason(setup: Setup, device: torch.device, precision: str, dropout: Tuple[float, float] = (0.0, 0.0)
                       ) -> Optional[str]:
    """Why ``setup`` cannot train on ``device`` with the config's (hidden, attention) ``dropout``
    (one line), or None if it can. run.py's rows are checked by run.py's own validation instead."""
    gpu = device.type == "cuda"
    if setup.family == "run.py":
        return None
    if setup.family == "ours":
        from bert_packed.model.attention import AttentionError, get_attention

        impl = get_attention(setup.attention)
        if impl.check is None:
            return None
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        try:
            impl.check(device=device, dtype=dtype, dropout_p=dropout[1], needs_grad=True)
        except AttentionError as exc:
            return f"{'GPU only' if not gpu else 'not run'}: {exc}"
        return None
    if setup.attention == "sdpa":
        return None
    if not gpu:
        return "GPU only: a Flash-attention kernel (no CPU implementation)"
    if precision == "fp32":
        return "not run: Flash attention needs bf16 or fp16"
    if setup.attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "not run: needs the flash-attn package (pip install flash-attn), which transformers' flash_attention_2 uses"
    if setup.attention == "torch_varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"not run: torch {torch.__version__} has no torch.nn.attention.varlen"
    if setup.attention == "torch_varlen" and dropout[1] > 0:
        return f"not run: torch varlen_attn has no attention dropout (attention_probs_dropout_prob={dropout[1]})"
    return None


# ----------------------------------------------------------------------------- the machine


_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
               "power.limit", "power.max_limit", "power.draw", "temperature.gpu", "memory.total")


def gpu_info(device: torch.device) -> Dict[str, Any]:
    """What the rows ran on: torch's device properties and, where ``nvidia-smi`` exists, the
    GPU's clocks (MHz) and power limit (W) now (``None`` entries where it has none)."""
    info: Dict[str, Any] = {"device": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count)
    info["nvidia_smi"] = nvidia_smi(device.index or 0) if device.type == "cuda" else None
    return info


def nvidia_smi(index: int = 0) -> Optional[Dict[str, str]]:
    """``nvidia-smi --query-gpu`` of GPU ``index`` (field -> text), or None without the tool."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(_SMI_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    values = [v.strip() for v in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(values) != len(_SMI_FIELDS):
        return {"error": (out.stderr or out.stdout).strip()[:200]}
    return dict(zip(_SMI_FIELDS, values))


# ----------------------------------------------------------------------------- building a setup (worker process)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _overrides(spec: Dict[str, Any], depth: int, attention: str) -> List[str]:
    """Our fixed-micro-batch rows and the HF rows: the config's recipe (dropouts included) at the
    benchmark's micro-batch, precision and compile setting."""
    return [
        f"data.max_sequences_per_pack={depth}", f"model.attention_implementation={attention}",
        f"train.micro_batch_size={spec['micro_batch_size']}", f"train.gradient_accumulation={spec['gradient_accumulation']}",
        "train.global_batch_size=null", "train.packing_adjustment=none",
        f"data.num_sequences={spec['num_sequences']}",
        f"data.packing_algorithm={spec['packing_algorithm'] if depth > 1 else 'none'}",
        f"cuda.precision={spec['precision']}", f"cuda.num_warmup_steps={spec['warmup_steps']}",
        f"cuda.compile={str(spec['compile'] and spec['compile_backend'] == 'inductor').lower()}",
        f"cuda.compile_mode={spec['compile_mode']}",
    ] + list(spec["set"])


def run_py_overrides(spec: Dict[str, Any], setup: Setup) -> List[str]:
    """``run-py-default`` and the levers: only what does not change the step (the generated data's
    size, and the device of a CPU dry run), then the lever's switch."""
    overrides = [f"data.num_sequences={spec['num_sequences']}"]
    if spec["device"] not in (None, "cuda"):
        overrides.append(f"cuda.device={spec['device']}")
    return overrides + list(setup.switch)


def run_py_config(spec: Dict[str, Any], setup: Setup, world_size: int = 1):
    """The config ``run.py --backend cuda --config MODEL`` trains with (its load and validation,
    which resolve the backend's defaults), plus the lever's switch."""
    from backends.cuda import CUDABackend

    config = load_config(spec["model"], run_py_overrides(spec, setup))
    return resolve_run(config, CUDABackend, world_size).config


def distributed(device: torch.device):
    """(rank, world_size), joining torchrun's process group when launched by it."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL picks a GPU for this rank
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_sum(values: List[float]) -> List[float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)  # CPU tensor: the gloo side of the group
    return tensor.tolist()


def shared_clock() -> float:
    """``time.perf_counter()`` of rank 0 on every rank under torchrun (one tiny gloo broadcast), so
    that every rank ends a timed window after the same step (DDP's collectives need that)."""
    import time

    import torch.distributed as dist

    now = time.perf_counter()
    if not (dist.is_available() and dist.is_initialized()):
        return now
    value = torch.tensor([now], dtype=torch.float64)
    dist.broadcast(value, src=0)  # CPU tensor: the gloo side of the group
    return float(value.item())


def compile_stats() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def device_of(spec: Dict[str, Any]) -> torch.device:
    if spec["device"] in (None, "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(spec["device"])


def _ours(spec: Dict[str, Any], setup: Setup, device: torch.device):
    """(step function, micro-batch pool, config, model config, metrics) of our backend on ``setup``."""
    from backends.cuda import CUDABackend
    from bert_packed.model.build import build_optimizer
    from bert_packed.tasks.pretraining.model import build_model
    from bert_packed.tasks.pretraining.data import build_data_source

    rank, world_size = distributed(device)
    if setup.family == "run.py":
        config = run_py_config(spec, setup, world_size)
        if spec.get("gradient_accumulation_override"):  # a shorter step of the resolved micro-batch (profiles)
            config.train.gradient_accumulation = spec["gradient_accumulation_override"]
        micro_batch_size = config.train.micro_batch_size
    else:
        config = load_config(spec["model"], _overrides(spec, setup.depth, setup.attention))
        micro_batch_size = spec["micro_batch_size"]
    if config.train.num_threads is not None:  # as run.py does (the tiny config: 1)
        torch.set_num_threads(config.train.num_threads)
    source = build_data_source(config, split="train", micro_batch_size=micro_batch_size, rank=rank,
                               world_size=world_size)
    pool = list(itertools.islice(iter(source), spec["pool_size"]))
    torch.manual_seed(0)
    model = build_model(config)
    optimizer, scheduler = build_optimizer(config, model)
    backend = CUDABackend(device=None if device.type == "cuda" else device)
    plan = make_plan(config, backend, world_size=world_size)
    backend.prepare(model, optimizer, plan, scheduler=scheduler)
    if spec["compile"] and spec["compile_backend"] != "inductor" and setup.family == "ours":
        # A lighter dynamo backend (CI on a CPU): the same graph capture, guards and
        # recompile accounting as the backend's own torch.compile(model), without inductor.
        backend.forward_module = torch.compile(backend.model, backend=spec["compile_backend"], dynamic=False)
        backend.train_module = (backend.forward_module if backend.ddp is None else
                                torch.compile(backend.ddp, backend=spec["compile_backend"], dynamic=False))
        for handle in backend.layer_handles:  # the eager run's layer hooks: a compiled graph must not trace them
            handle.remove()
        backend.layer_handles = []
    # Page-locked on a GPU, as the training loop's prefetch thread stages them.
    pool = [backend.stage_batch(batch) for batch in pool]
    last: Dict[str, Any] = {}

    def step(micro_batches):
        # The step's numbers as they are (device tensors): reading them here would make the host
        # wait for the GPU every step, which the training loop does not.
        last.update(backend.train_step(micro_batches).raw)

    step.accumulation = plan.gradient_accumulation
    step.compiled = bool(config.cuda.compile) or (spec["compile"] and setup.family == "ours")
    return step, pool, config, model.config, last


_HF_VARLEN = "torch_varlen"


def register_hf_torch_varlen() -> None:
    """Make ``attn_implementation="torch_varlen"`` a transformers attention: torch's varlen_attn
    on the collator's ``cu_seq_lens_q/k`` (transformers' documented AttentionInterface route)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from torch.nn.attention.varlen import varlen_attn

        # query/key/value [1, heads, T, D] (one flattened row) -> [T, heads, D]
        flat = [t[0].transpose(0, 1) for t in (query, key, value)]
        out = varlen_attn(*flat, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"],
                          kwargs["max_length_k"], scale=scaling)
        return out[None], None  # [1, T, heads, D], no weights

    AttentionInterface.register(_HF_VARLEN, torch_varlen_attention)
    AttentionMaskInterface.register(_HF_VARLEN, flash_attention_mask)


def hf_padded_inputs(batch: Dict[str, np.ndarray], nsp: bool = False) -> Dict[str, torch.Tensor]:
    """transformers inputs of a one-sequence-per-row batch: padding mask, labels -100 off the masked
    positions, and with ``nsp`` the next-sentence labels (``BertForPreTraining``)."""
    t = {k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in batch.items()}
    labels = torch.full_like(t["input_ids"], -100)
    valid = t["mlm_sequence_ids"] > 0
    rows = torch.arange(labels.shape[0])[:, None].expand_as(valid)
    labels[rows[valid], t["mlm_positions"][valid]] = t["mlm_labels"][valid]
    inputs = {"input_ids": t["input_ids"], "token_type_ids": t["segment_ids"],
              "attention_mask": (t["sequence_ids"] > 0).long(), "labels": labels}
    if nsp:
        inputs["next_sentence_label"] = t["nsp_labels"][:, 0]
    return inputs


def hf_flattened_inputs(batches: List[Dict[str, np.ndarray]], *, flash_kwargs: bool) -> Dict[str, Any]:
    """The sequences of one-per-row ``batches`` through HF's ``DataCollatorWithFlattening`` (one [1, T] row)."""
    from transformers import DataCollatorWithFlattening

    features = []
    for batch in batches:
        padded = hf_padded_inputs(batch)
        for row in range(padded["input_ids"].shape[0]):
            n = int(padded["attention_mask"][row].sum())
            if n:
                features.append({"input_ids": padded["input_ids"][row, :n].tolist(),
                                 "labels": padded["labels"][row, :n].tolist()})
    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)


def packed_sequences_per_micro_batch(spec: Dict[str, Any]) -> int:
    """Sequences in one micro-batch of our depth-3 packs on this data (rounded): the default size of a
    flattened HF padding-free micro-batch, so both carry about the same real tokens."""
    from bert_packed.tasks.pretraining.data import build_data_source

    config = load_config(spec["model"], _overrides(spec, 3, "sdpa"))
    batches = list(itertools.islice(iter(build_data_source(config, split="train",
                                                           micro_batch_size=spec["micro_batch_size"])),
                                    spec["pool_size"]))
    sequences = sum(float(b["nsp_weights"].sum()) for b in batches)
    return max(1, round(sequences / len(batches)))


def padding_free_pool(spec: Dict[str, Any], source) -> List[Dict[str, np.ndarray]]:
    """``pool_size`` micro-batches of ``hf_sequences_per_micro_batch`` sequences (default: our packs'
    count) taken in order from a one-sequence-per-row ``source``, still one sequence per row."""
    per_micro = spec["hf_sequences_per_micro_batch"] or packed_sequences_per_micro_batch(spec)
    rows = spec["micro_batch_size"]
    raw = list(itertools.islice(iter(source), -(-spec["pool_size"] * per_micro // rows)))
    every = {k: np.concatenate([b[k] for b in raw]) for k in raw[0]}
    return [{k: v[i * per_micro:(i + 1) * per_micro] for k, v in every.items()} for i in range(spec["pool_size"])]


def _hf(spec: Dict[str, Any], setup: Setup, device: torch.device):
    """(step function, micro-batch pool, config, model config) of a transformers peer."""
    import transformers

    from bert_packed.tasks.pretraining.data import build_data_source
    from bert_packed.model.build import build_optimizer

    config = load_config(spec["model"], _overrides(spec, 1, "sdpa"))
    if config.train.num_threads is not None:
        torch.set_num_threads(config.train.num_threads)
    m = config.model
    rank, world_size = distributed(device)
    if world_size > 1:
        raise ConfigError("the Hugging Face peers run on one device (no --scaling for them)")
    source = build_data_source(config, split="train", micro_batch_size=spec["micro_batch_size"])
    if setup.attention == "sdpa":
        pool = list(itertools.islice(iter(source), spec["pool_size"]))
        inputs = [hf_padded_inputs(b, nsp=True) for b in pool]
    else:
        pool = padding_free_pool(spec, source)
        if setup.attention == _HF_VARLEN:
            register_hf_torch_varlen()
        inputs = [hf_flattened_inputs([b], flash_kwargs=setup.attention == _HF_VARLEN) for b in pool]
    hf_config = transformers.BertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.intermediate_size, hidden_act=m.hidden_act,
        max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size,
        layer_norm_eps=m.layer_norm_eps, hidden_dropout_prob=m.hidden_dropout_prob,
        attention_probs_dropout_prob=m.attention_probs_dropout_prob)
    torch.manual_seed(0)
    model_class = transformers.BertForPreTraining if setup.attention == "sdpa" else transformers.BertForMaskedLM
    model = model_class._from_config(hf_config, attn_implementation=setup.attention).to(device).train()
    optimizer, _ = build_optimizer(config, model)
    forward = model
    if spec["compile"]:
        # Padded rows have one shape; flattened rows change length every micro-batch: dynamic shapes.
        forward = torch.compile(model, backend=spec["compile_backend"], mode=None if spec["compile_mode"] == "default"
                                else spec["compile_mode"], dynamic=setup.attention != "sdpa")
    precision = spec["precision"]
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = config.cuda.allow_tf32
    max_norm = config.optimizer.max_grad_norm
    index = {id(b): i for i, b in enumerate(pool)}

    def to_device(x):
        return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in x.items()}

    def step(micro_batches):
        for batch in micro_batches:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = forward(**to_device(inputs[index[id(batch)]])).loss / len(micro_batches)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.accumulation = spec["gradient_accumulation"]
    step.compiled = bool(spec["compile"])
    return step, pool, config, m, {}
