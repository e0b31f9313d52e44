"""What the attention benchmark measures: the types, modes, levels and dtypes, a case (one
configuration) and its result, and the config and module each case times."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_zformer.cpu_speedups import enable_cpu_speedups
from hf_zformer.modeling.attention import ATTENTION_CLASSES, Attention
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling.policy import active

TYPES = ("full", "full_eager", "zformer", "xformer", "fastformer", "zformer_torch", "fastformer_torch",
         "zformer_kernels", "fastformer_kernels", "zformer_folded", "zformer_plain", "fastformer_folded",
         "fastformer_plain")
# Types measured unless others are named: the `_torch` variants (the torch forms of the sequence
# operations where the default backend would take a fused kernel) only differ from their type on a GPU.
DEFAULT_TYPES = ("full", "full_eager", "zformer", "xformer", "fastformer")
MODES = ("forward", "train")
LEVELS = ("attention", "module", "model", "seq2seq", "causal", "classification")
# The levels `sweep` runs, one module per case: the attention alone (its output projection set
# aside), the whole attention module (output projection included) and a one-layer model.
GRID_LEVELS = ("attention", "module", "model")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Baseline of every speedup column: PyTorch's fused attention.
BASELINE = "full"


@dataclass
class ModelShape:
    """The size of the models a whole-model level builds (seq2seq, causal, classification): every
    level's shape extends it with its lengths."""

    batch: int = 4
    width: int = 512
    layers: int = 6
    heads: int = 8
    ffn: int = 2048
    vocab: int = 8000

    def size(self) -> dict:
        """The fields of this class, for a `ModelRow`."""
        return {name: getattr(self, name) for name in ModelShape.__dataclass_fields__}


@dataclass
class ModelRow:
    """The leading columns of a whole-model level's result row: the model, its size, precision and
    device; each level's result extends it with its lengths and measurements."""

    model: str
    description: str
    parameters: int
    batch: int
    width: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    dtype: str
    device: str


def ratios_to_baseline(results: list, baseline: str, key, ratios: dict[str, str]) -> None:
    """Fill each result's ratio fields against the `baseline` model's result at the same `key(result)`:
    `ratios` maps a ratio field to the field it divides (the result's value / the baseline's). A
    result without a baseline at its key keeps None."""
    bases = {key(r): r for r in results if r.model == baseline}
    for r in results:
        base = bases.get(key(r))
        if base is not None:
            for ratio, field_name in ratios.items():
                setattr(r, ratio, getattr(r, field_name) / getattr(base, field_name))


# the backend (`ops.use_kernel_backend`) each suffix of a benchmark type runs: `_torch` the torch
# forms of the sequence operations, `_kernels` the plain forms with the fused kernels wherever they
# apply (where `auto` may take a folded form instead)
BACKEND_SUFFIXES = {"_torch": "torch", "_kernels": "triton"}
# `<type>_folded` / `<type>_plain`: the type's folded form under autocast on every device / on none
# (its attention modules' `folded_autocast_devices`, where the execution policy has its default)
FORM_SUFFIXES = {"_folded": True, "_plain": False}


def attention_of(benchmark_type: str) -> str:
    """The model's attention type of a benchmark type: `full_eager` is full attention through the
    einsum reference, `<type>_torch` / `<type>_kernels` the type on another backend, `<type>_folded`
    / `<type>_plain` the type with its folded form under autocast everywhere / nowhere."""
    if benchmark_type not in TYPES:
        raise ValueError(f"unknown attention type {benchmark_type!r}; choose one of {list(TYPES)}")
    if benchmark_type.startswith("full"):
        return "full"
    return next((benchmark_type.removesuffix(s) for s in (*BACKEND_SUFFIXES, *FORM_SUFFIXES)
                 if benchmark_type.endswith(s)), benchmark_type)


def folds_under_autocast(benchmark_type: str, device_type: str) -> bool:
    """Whether a benchmark type takes its folded form (where it has one) under autocast on
    `device_type` (`FORM_SUFFIXES`, else the execution policy's `folded_autocast` for its type)."""
    forced = next((folds for suffix, folds in FORM_SUFFIXES.items() if benchmark_type.endswith(suffix)), None)
    if forced is not None:
        return forced
    return device_type in active().folded_autocast_devices(ATTENTION_CLASSES[attention_of(benchmark_type)].POLICY_NAME)


def kernel_backend_of(benchmark_type: str) -> str:
    """The backend of the sequence operations a benchmark type runs (`ops.use_kernel_backend`)."""
    return next((b for s, b in BACKEND_SUFFIXES.items() if benchmark_type.endswith(s)), "auto")


def make_config(attention_type: str, length: int, width: int, heads: int, **overrides) -> ZformerConfig:
    """A dropout-free config for `attention_type` with max_position_embeddings = `length` (xformer's
    projection E has ceil(max_pos / beta) rows, so k grows with the benchmarked length)."""
    kwargs = dict(
        hidden_size=width,
        num_attention_heads=heads,
        num_hidden_layers=1,
        attention_type=attention_of(attention_type),
        max_position_embeddings=length,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        vocab_size=1000,
        intermediate_size=1,  # the FFN shrunk away (model level)
        attn_implementation="eager" if attention_type == "full_eager" else "sdpa",
    )
    kwargs.update(overrides)
    return ZformerConfig(**kwargs)


def build_module(attention_type: str, config: ZformerConfig, level: str, device: torch.device) -> torch.nn.Module:
    """The attention module (initialised like a model's) of a one-layer `ZformerModel`, whole (level
    `module`) or with its output projection replaced by the identity (`attention`), or the model
    itself (`model`)."""
    from hf_zformer.modeling.modeling_zformer import ZformerModel

    model = enable_cpu_speedups(ZformerModel(config))  # _init_weights on every submodule; the CPU layer forms
    if attention_type.endswith(tuple(FORM_SUFFIXES)):
        devices = (device.type,) if folds_under_autocast(attention_type, device.type) else ()
        for module in model.modules():
            if isinstance(module, Attention):
                module.folded_autocast_devices = devices  # this module only, not the policy
    if level == "model":
        return model.to(device)
    attention = model.encoder.layers[0].attention
    if not isinstance(attention, ATTENTION_CLASSES[config.layer_attention_types()[0]]):  # pragma: no cover
        raise TypeError(f"unexpected attention module {type(attention).__name__}")
    if level == "attention":  # the attention alone; where a folded form would merge W_o, it then has none to merge
        attention.output = torch.nn.Identity()
    return attention.to(device)


@dataclass
class BenchCase:
    level: str
    attention_type: str
    mode: str
    batch: int
    length: int
    width: int
    heads: int
    dtype: str
    device: str
    mask: bool
    # each call replays the step captured once as a CUDA graph (host work and launches gone: the
    # GPU's own time, what torch.compile(mode="reduce-overhead") or a captured training step runs)
    graphs: bool = False
    # the module compiled by torch.compile in this mode ("" for eager calls): inductor's code around
    # the kernels' operators, and on a GPU in mode "reduce-overhead" its CUDA graphs
    compiled: str = ""


@dataclass
class BenchResult(BenchCase):
    """A case with its measurements (the CSV/JSON rows: the case's fields first)."""

    status: str = "ok"  # ok | skipped | oom | error
    note: str = ""
    time_ms: float | None = None
    times_ms: list = field(default_factory=list)
    peak_memory_mb: float | None = None
    flops: int | None = None
    executed_flops: int | None = None
    tflops: float | None = None
    flops_fraction: float | None = None
    executed_fraction: float | None = None
    speedup_vs_full: float | None = None
    operations: int | None = None  # operations dispatched by one call (views aside): `traffic.TrafficCounter`
    bytes: int | None = None  # bytes those operations read and write
    bandwidth_fraction: float | None = None  # bytes per second / the measured copy bandwidth
    profile: str = ""  # torch.profiler table of one call (--profile); not in the CSV
