"""Speed and memory benchmarks of the attention family against PyTorch's fused attention.

Library side of `scripts/benchmark_attention.py` (never shipped with a checkpoint). Two levels:

- ``"attention"``: the attention module alone (the Zformer_Pytorch seed's experiment). The seed feeds
  a tensor of shape (n, batch, d); we create it in that layout and transpose it to our (B, N, D)
  layout *before* the timed region (`.transpose(0, 1).contiguous()`), so every type pays the same.
- ``"model"``: a one-layer ``ZformerModel`` with the feed-forward shrunk away
  (``intermediate_size=1``): embeddings, LayerNorms, attention, output projection and residuals.
- ``"seq2seq"`` (`seq2seq_benchmark`): training tokens/s and greedy-generation sentences/s of our
  encoder-decoder against transformers' ``BartForConditionalGeneration`` of identical size.

Types: ``full`` (our `FullAttention` through transformers' SDPA integration, i.e. PyTorch's fused
`scaled_dot_product_attention`), ``full_eager`` (our einsum reference), ``zformer``, ``xformer`` and
``fastformer``. Modes: ``forward`` (under `torch.inference_mode`) and ``train`` (forward+backward).

Every configuration reports the median wall time of several timed calls after warm-up, the peak
extra memory of one call, and the achieved FLOP/s as a fraction of the measured matrix-multiply
FLOP/s of the machine (see `attention_flops` for the counting). Nothing is hard-coded: every
number comes from the run that writes it.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from .modeling.attention import ATTENTION_CLASSES
from .modeling.configuration_zformer import ZformerConfig

TYPES = ("full", "full_eager", "zformer", "xformer", "fastformer")
MODES = ("forward", "train")
LEVELS = ("attention", "model", "seq2seq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Baseline of every speedup column: PyTorch's fused attention.
BASELINE = "full"
# Environment variables that change CPU timings (THP_MEM_ALLOC_ENABLE=1: transparent huge pages for
# torch's CPU allocations); recorded in the metadata and in front of the recorded command line.
TIMING_ENVIRONMENT = ("THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


# ----------------------------------------------------------------------------------------------
# FLOP counting
# ----------------------------------------------------------------------------------------------


def attention_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config=None) -> int:
    """Nominal forward FLOPs of one self-attention call (a multiply-add counts 2), by the equations
    of the design (whatever an implementation executes):

    - projections: a Linear D -> D' on B*N tokens costs 2 B N D D'.
    - full / full_eager: Q, K, V projections + Q K^T + P V = 6 B N D^2 + 4 B N^2 D (softmax ignored).
    - zformer: Q, K, V projections + K^T V + Q (K^T V) = 6 B N D^2 + 4 B N D d_h.
    - xformer: Q' (D -> D/alpha) + K = E Q' + V = E X + scores + P V with k = ceil(max_pos / beta)
      compressed keys: 2 B N D^2/alpha + 2 B k N (D/alpha + D + D/alpha + D).
    - fastformer: Q, K, V (unless shared with Q) and W_r projections, 2 B N D^2 each, plus the
      O(B N D) pooling/elementwise work: 2 scores + 2 poolings (2 B N D each) + 3 elementwise
      (B N D each) = 11 B N D.
    """
    config = config if config is not None else make_config(attention_type, length, width, heads)
    b, n, d = batch, length, width
    head_dim = d // heads
    if attention_type in ("full", "full_eager"):
        return 6 * b * n * d * d + 4 * b * n * n * d
    if attention_type == "zformer":
        return 6 * b * n * d * d + 4 * b * n * d * head_dim
    if attention_type == "xformer":
        query_width = d // config.xformer_alpha
        k = math.ceil(config.max_position_embeddings / config.xformer_beta)
        return 2 * b * n * d * query_width + 2 * b * k * n * (2 * query_width + 2 * d)
    if attention_type == "fastformer":
        return 2 * _fastformer_projections(config) * b * n * d * d + 11 * b * n * d
    raise ValueError(f"unknown attention type {attention_type!r}; choose one of {list(TYPES)}")


def _fastformer_projections(config) -> int:
    return 3 if config.fastformer_share_qv else 4


def folded(attention_type: str, length: int, width: int, config, dtype: str = "fp32") -> bool:
    """Whether hf_zformer's bidirectional zformer/fastformer take their folded form (the rule of
    `attention.py`: fp32 outside autocast, and fewer FLOPs than the plain form)."""
    if dtype != "fp32":
        return False
    if attention_type == "zformer":
        return length > width
    if attention_type == "fastformer":
        return (_fastformer_projections(config) - 1) * length > width
    return False


def executed_attention_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config=None,
                             dtype: str = "fp32") -> int:
    """Forward FLOPs that hf_zformer's implementation actually executes (matmuls only):

    - full, full_eager, and zformer/fastformer in their plain form: as `attention_flops`.
    - zformer folded (fp32, N > D): Gram matrix 2 B N D^2 + [W_v|b_v] S 2 B D (D+1)^2 + per-head
      products 4 B D (D+1) d_h + x_i A 2 B N D^2.
    - fastformer folded (fp32, (projections - 1) N > D): 2 score products and 2 poolings
      (2 B H N D each) + W_r diag(k_g) W_v 2 B D^3 + x_i A 2 B N D^2.
    - xformer: as nominal, but fused attention scores run on value-wide heads (zero-padded query
      and key channels): scores cost 2 B N k D instead of 2 B N k D/alpha.
    """
    config = config if config is not None else make_config(attention_type, length, width, heads)
    b, n, d = batch, length, width
    if folded(attention_type, n, d, config, dtype):
        if attention_type == "zformer":
            return 4 * b * n * d * d + 2 * b * d * (d + 1) ** 2 + 4 * b * d * (d + 1) * (d // heads)
        return 8 * b * heads * n * d + 2 * b * d**3 + 2 * b * n * d * d
    if attention_type == "xformer":
        query_width = d // config.xformer_alpha
        k = math.ceil(config.max_position_embeddings / config.xformer_beta)
        return 2 * b * n * d * query_width + 2 * b * k * n * (query_width + 3 * d)
    return attention_flops(attention_type, batch, length, width, heads, config)


def model_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config,
                executed: bool = False, dtype: str = "fp32") -> int:
    """Forward FLOPs of the one-layer model: attention (`attention_flops`, or
    `executed_attention_flops` when `executed`), the output projection (2 B N D^2) and the shrunk
    feed-forward (4 B N D I); embeddings and LayerNorms are ignored. Executed, a folded attention
    form merges the output projection into its per-sequence matrix when N > D, for 2 B D^3."""
    b, n, d = batch, length, width
    if not executed:
        attention, projection = attention_flops(attention_type, b, n, d, heads, config), 2 * b * n * d * d
    else:
        attention = executed_attention_flops(attention_type, b, n, d, heads, config, dtype=dtype)
        projection = 2 * b * n * d * d
        if folded(attention_type, n, d, config, dtype) and n > d:
            projection = 2 * b * d**3
    return attention + projection + 4 * b * n * d * config.intermediate_size


def step_flops(forward_flops: int, mode: str) -> int:
    """FLOPs of one timed step: forward, or forward+backward counted as 3x forward (the backward
    of a matmul is two matmuls of the same size)."""
    return forward_flops if mode == "forward" else 3 * forward_flops


# ----------------------------------------------------------------------------------------------
# Machine measurements
# ----------------------------------------------------------------------------------------------


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, max_size: int = 4096, target_seconds: float = 1.0,
                         repeats: int = 5) -> dict:
    """FLOP/s of a square `dtype` matrix product on `device` through `torch.nn.functional.linear`
    (the kernel the projections use; on CPU, bf16 `linear` runs oneDNN while a bf16 `torch.mm`
    falls back to a kernel ~15x slower). The size doubles from 256 until one product takes
    `target_seconds` (or reaches `max_size`), then the median of `repeats` products is taken."""
    size = 256
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        elapsed = _timed_call(lambda: torch.nn.functional.linear(a, b), device)  # warm-up
        elapsed = _timed_call(lambda: torch.nn.functional.linear(a, b), device)
        if elapsed >= target_seconds or size >= max_size:
            break
        size *= 2
    times = [_timed_call(lambda: torch.nn.functional.linear(a, b), device) for _ in range(repeats)]
    seconds = statistics.median(times)
    return {"size": size, "dtype": str(dtype).replace("torch.", ""), "seconds": seconds, "flops": 2 * size**3 / seconds}


def machine_info(device: torch.device) -> dict:
    info = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "load_average": load_average(),
        "environment": {k: os.environ[k] for k in TIMING_ENVIRONMENT if k in os.environ},
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def load_average():
    """1/5/15-minute load averages: other work on a shared machine slows every measurement."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _cpu_model() -> str:
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in output.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def available_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------
# Building what is timed
# ----------------------------------------------------------------------------------------------


def make_config(attention_type: str, length: int, width: int, heads: int, **overrides) -> ZformerConfig:
    """A dropout-free config for `attention_type` with max_position_embeddings = `length` (xformer's
    projection E has ceil(max_pos / beta) rows, so k grows with the benchmarked length)."""
    if attention_type not in TYPES:
        raise ValueError(f"unknown attention type {attention_type!r}; choose one of {list(TYPES)}")
    kwargs = dict(
        hidden_size=width,
        num_attention_heads=heads,
        num_hidden_layers=1,
        attention_type="full" if attention_type.startswith("full") else attention_type,
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
    """The attention module (initialised like a model's) or a one-layer `ZformerModel`."""
    from .modeling.modeling_zformer import ZformerModel

    model = ZformerModel(config)  # runs the model's _init_weights on every submodule
    if level == "model":
        return model.to(device)
    attention = model.encoder.layers[0].attention
    if not isinstance(attention, ATTENTION_CLASSES[config.layer_attention_types()[0]]):  # pragma: no cover
        raise TypeError(f"unexpected attention module {type(attention).__name__}")
    attention.output = torch.nn.Identity()  # the attention alone: model-level cases count the output projection
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
    profile: str = ""  # torch.profiler table of one call (--profile); not in the CSV


def _make_inputs(case: BenchCase, config, device: torch.device):
    """Inputs of one call; the (n, B, D) -> (B, N, D) transpose happens here, before timing."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(case.batch, case.length, dtype=torch.long, device=device) if case.mask else None
    if case.level == "model":
        ids = torch.randint(3, config.vocab_size, (case.batch, case.length), generator=generator).to(device)
        return {"input_ids": ids, "attention_mask": mask}
    seed_layout = torch.randn(case.length, case.batch, case.width, generator=generator)  # (n, B, D) like the seed
    hidden = seed_layout.transpose(0, 1).contiguous().to(device)  # (B, N, D)
    hidden.requires_grad_(case.mode == "train")
    return {"hidden_states": hidden, "attention_mask": mask}


def _make_step(module, inputs: dict, case: BenchCase, device: torch.device) -> Callable[[], None]:
    autocast_dtype = DTYPES[case.dtype]
    use_autocast = autocast_dtype != torch.float32

    def output_of(result):
        if case.level == "model":
            return result.last_hidden_state
        return result[0]

    if case.mode == "forward":
        module.eval()

        def step():
            with torch.inference_mode(), torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast):
                output_of(module(**inputs))

        return step

    module.train()
    grad = None

    def step():
        nonlocal grad
        for p in module.parameters():
            p.grad = None
        if "hidden_states" in inputs:
            inputs["hidden_states"].grad = None
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast):
            output = output_of(module(**inputs))
        if grad is None or grad.shape != output.shape or grad.dtype != output.dtype:
            grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)).to(device, output.dtype)
        output.backward(grad)

    return step


def _timed_call(step: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def peak_memory_bytes(step: Callable[[], None], device: torch.device) -> int | None:
    """Peak extra memory of one call above what was allocated before it.

    CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus the memory
    allocated before the call. CPU: the torch profiler with `profile_memory=True` records every
    allocation and free of PyTorch's CPU allocator with the running total allocated since the
    profile started; the peak is the maximum of that running total. Buffers that libraries
    allocate outside PyTorch's allocator (e.g. MKL/oneDNN scratch space) are not seen.
    """
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    try:
        from torch._C._profiler import _EventType

        peak = 0
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                peak = max(peak, node.extra_fields.total_allocated)
        return peak
    except (AttributeError, ImportError):  # pragma: no cover - private profiler API moved
        events = sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start)
        total = peak = 0
        for event in events:
            total += event.cpu_memory_usage
            peak = max(peak, total)
        return peak


def case_flops(case: BenchCase, config=None) -> tuple[int, int]:
    """(nominal, executed) FLOPs of one timed call of `case`."""
    config = config if config is not None else make_config(case.attention_type, case.length, case.width, case.heads)
    shape = (case.attention_type, case.batch, case.length, case.width, case.heads, config)

    if case.level == "model":
        counts = model_flops(*shape), model_flops(*shape, executed=True, dtype=case.dtype)
    else:
        counts = attention_flops(*shape), executed_attention_flops(*shape, dtype=case.dtype)
    return tuple(step_flops(count, case.mode) for count in counts)


def _quadratic_bytes(case: BenchCase, config) -> int:
    """Rough size of what eager full attention materialises: N x N scores and probabilities per
    head (x2 more for the backward); other types stay linear (xformer uses fused SDPA or k << N)."""
    if case.attention_type != "full_eager":
        return 0
    itemsize = 4
    per_matrix = case.batch * case.heads * case.length * case.length * itemsize
    return per_matrix * (3 if case.mode == "forward" else 5)


def _is_oom(error: Exception) -> bool:
    message = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in message or "can't allocate" in message


class _Runner:
    """One configuration being measured: the module, its inputs and the step that is timed."""

    def __init__(self, case: BenchCase, max_memory_bytes: int | None):
        self.case, self.device = case, torch.device(case.device)
        self.result = BenchResult(**asdict(case))
        self.config = make_config(case.attention_type, case.length, case.width, case.heads)
        self.result.flops, self.result.executed_flops = case_flops(case, self.config)
        self.step = None
        self.times = []
        needed = _quadratic_bytes(case, self.config)
        if max_memory_bytes is not None and needed > max_memory_bytes:
            self.result.status = "skipped"
            self.result.note = f"memory guard: needs ~{needed / 2**30:.1f} GiB > {max_memory_bytes / 2**30:.1f} GiB"

    @property
    def active(self) -> bool:
        return self.result.status == "ok"

    def guarded(self, action: Callable[[], None]):
        """Run `action`, turning out-of-memory errors into an "oom" result."""
        if not self.active:
            return
        try:
            action()
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not _is_oom(error):
                raise
            self.result.status, self.result.note = "oom", str(error).splitlines()[0][:200]
            self.release()

    def build(self):
        def action():
            torch.manual_seed(0)
            module = build_module(self.case.attention_type, self.config, self.case.level, self.device)
            self.step = _make_step(module, _make_inputs(self.case, self.config, self.device), self.case, self.device)

        self.guarded(action)

    def call(self, record: bool) -> float | None:
        elapsed = []
        self.guarded(lambda: elapsed.append(_timed_call(self.step, self.device)))
        if elapsed and record:
            self.times.append(elapsed[0])
        return elapsed[0] if elapsed else None

    def profile(self, rows: int = 12):
        """torch.profiler table (self CPU/CUDA time per op and input shape) of one call."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])

        def action():
            with profile(activities=activities, record_shapes=True) as prof:
                self.step()
                synchronize(self.device)
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            self.result.profile = prof.key_averages(group_by_input_shape=True).table(
                sort_by=sort, row_limit=rows, max_name_column_width=28, max_shapes_column_width=64
            )

        self.guarded(action)

    def finish(self, measure_memory: bool, matmul_flops: float | None):
        if not self.active:
            return
        r = self.result
        r.times_ms = [t * 1e3 for t in self.times]
        r.time_ms = statistics.median(r.times_ms)
        r.tflops = r.flops / (r.time_ms / 1e3) / 1e12
        if matmul_flops:
            set_flops_fractions([r], matmul_flops)
        if measure_memory:
            self.guarded(lambda: setattr(r, "peak_memory_mb", peak_memory_bytes(self.step, self.device) / 2**20))

    def release(self):
        self.step = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def run_cases(cases: list[BenchCase], warmup: int = 1, repeats: int = 5, max_seconds: float = 30.0,
              measure_memory: bool = True, max_memory_bytes: int | None = None,
              matmul_flops: float | None = None, profile: bool = False) -> list[BenchResult]:
    """Measure configurations side by side: after each one's warm-up, the timed calls go round-robin
    over them (call 1 of every case, then call 2, ...), so that load from other processes on a shared
    machine hits every type alike and the speedups compare like with like. A configuration whose
    warm-up call is slow gets fewer timed calls (about `max_seconds` worth, but at least
    min(3, repeats)). The memory of each is measured after its timed calls."""
    runners = [_Runner(case, max_memory_bytes) for case in cases]
    counts = {}
    for runner in runners:
        runner.build()
        last = None
        for _ in range(warmup):
            last = runner.call(record=False)
        counts[id(runner)] = repeats if not last else max(min(3, repeats), min(repeats, int(max_seconds / last)))
    for index in range(repeats):
        for runner in runners:
            if index < counts[id(runner)]:
                runner.call(record=True)
    for runner in runners:
        runner.finish(measure_memory, matmul_flops)
        if profile:
            runner.profile()
        runner.release()
    return [runner.result for runner in runners]



def sweep(
    types: Iterable[str],
    lengths: Iterable[int],
    widths: Iterable[int] = (512,),
    heads: Iterable[int] = (8,),
    batch: int = 4,
    modes: Iterable[str] = ("forward",),
    level: str = "attention",
    device: str = "cpu",
    dtype: str = "fp32",
    mask: bool = False,
    warmup: int = 1,
    repeats: int = 5,
    max_seconds: float = 30.0,
    max_memory_bytes: int | None = None,
    measure_memory: bool = True,
    matmul_flops: float | None = None,
    progress: bool = True,
    profile: bool = False,
) -> list[BenchResult]:
    """Every (mode, width, heads, length) with all `types` measured side by side (`run_cases`),
    lengths ascending. Once a type takes longer than `max_seconds` per call (or runs out of
    memory), its longer lengths in the same (mode, width, heads) are recorded as skipped."""
    from tqdm.auto import tqdm

    types, lengths, modes = list(types), sorted(lengths), list(modes)
    for attention_type in types:
        if attention_type not in TYPES:
            raise ValueError(f"unknown attention type {attention_type!r}; choose one of {list(TYPES)}")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")
    if level not in ("attention", "model"):
        raise ValueError(f"sweep level must be 'attention' or 'model', not {level!r}")
    groups = [(mode, w, h, n) for mode in modes for w in widths for h in heads for n in lengths]
    results, stopped = [], {}
    bar = tqdm(total=len(groups) * len(types), disable=not progress, desc="benchmark", dynamic_ncols=True)
    for mode, w, h, n in groups:
        bar.set_postfix_str(f"{mode} n={n} d={w} h={h}")
        cases, group_results = [], []
        for t in types:
            case = BenchCase(level, t, mode, batch, n, w, h, dtype, device, mask)
            if (mode, w, h, t) in stopped:
                result = BenchResult(**asdict(case))
                result.status, result.note = "skipped", stopped[(mode, w, h, t)]
                result.flops, result.executed_flops = case_flops(case)
                group_results.append(result)
            else:
                cases.append(case)
        group_results += run_cases(cases, warmup, repeats, max_seconds, measure_memory, max_memory_bytes,
                                   matmul_flops, profile)
        for result in sorted(group_results, key=lambda r: types.index(r.attention_type)):
            key = (mode, w, h, result.attention_type)
            if result.status == "oom":
                stopped[key] = f"out of memory at n={result.length}"
            elif result.status == "ok" and result.time_ms / 1e3 > max_seconds and key not in stopped:
                stopped[key] = f"n={result.length} took {result.time_ms / 1e3:.1f} s > --max-seconds {max_seconds:g}"
            results.append(result)
        bar.update(len(types))
    bar.close()
    add_speedups(results)
    return results



def add_speedups(results: list[BenchResult]):
    """speedup_vs_full = time of fused SDPA `full` / time of this type, same configuration."""
    baseline = {
        _group(r): r.time_ms for r in results if r.attention_type == BASELINE and r.status == "ok"
    }
    for r in results:
        base = baseline.get(_group(r))
        r.speedup_vs_full = base / r.time_ms if base and r.status == "ok" else None


def set_flops_fractions(results: list[BenchResult], matmul_flops: float):
    """flops_fraction = nominal FLOPs per second / the measured matmul FLOP/s (can exceed 1 where
    the implementation does less work than the equations); executed_fraction the same with the
    FLOPs actually executed (the hardware efficiency)."""
    for r in results:
        if r.status == "ok" and r.time_ms:
            r.flops_fraction = r.flops / (r.time_ms / 1e3) / matmul_flops
            r.executed_fraction = r.executed_flops / (r.time_ms / 1e3) / matmul_flops


def _group(r: BenchResult):
    return (r.level, r.mode, r.batch, r.length, r.width, r.heads, r.dtype, r.device, r.mask)


# ----------------------------------------------------------------------------------------------
# Encoder-decoder level: our translation model against BART of identical size
# ----------------------------------------------------------------------------------------------

SEQ2SEQ_MODELS = ("bart", "full", "zformer", "fastformer")


@dataclass
class Seq2SeqShape:
    batch: int = 16
    source_length: int = 32
    target_length: int = 32
    width: int = 512
    layers: int = 6
    heads: int = 8
    ffn: int = 2048
    vocab: int = 8000


@dataclass
class Seq2SeqResult:
    model: str
    description: str
    parameters: int
    batch: int
    source_length: int
    target_length: int
    width: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    dtype: str
    device: str
    train_step_ms: float | None = None
    train_tokens_per_s: float | None = None
    train_speedup_vs_bart: float | None = None
    generate_ms: float | None = None
    sentences_per_s: float | None = None
    generate_speedup_vs_bart: float | None = None
    train_times_ms: list = field(default_factory=list)
    generate_times_ms: list = field(default_factory=list)


def build_seq2seq(model: str, shape: Seq2SeqShape):
    """(model, description): transformers' `BartForConditionalGeneration`, or our
    `ZformerForConditionalGeneration` with the same width, depth, heads, FFN and vocabulary, dropout
    off. `full`: softmax attention everywhere (fused SDPA); `zformer`: zformer encoder, causal
    decoder and cross-attention; `fastformer`: fastformer encoder and causal decoder, full
    cross-attention (fastformer has no cross-attention form)."""
    positions = max(shape.source_length, shape.target_length) + 2
    if model == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(
            vocab_size=shape.vocab, d_model=shape.width, encoder_layers=shape.layers, decoder_layers=shape.layers,
            encoder_attention_heads=shape.heads, decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn,
            decoder_ffn_dim=shape.ffn, max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, activation_function="gelu", scale_embedding=True, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=None,
            tie_word_embeddings=True, attn_implementation="sdpa",
        )
        return BartForConditionalGeneration(config), "transformers BartForConditionalGeneration (sdpa)"
    if model not in SEQ2SEQ_MODELS:
        raise ValueError(f"unknown seq2seq model {model!r}; choose from {list(SEQ2SEQ_MODELS)}")
    from .modeling.modeling_zformer import ZformerForConditionalGeneration

    cross = "zformer" if model == "zformer" else "full"
    config = ZformerConfig(
        vocab_size=shape.vocab, hidden_size=shape.width, num_hidden_layers=shape.layers,
        num_decoder_layers=shape.layers, num_attention_heads=shape.heads, intermediate_size=shape.ffn,
        max_position_embeddings=positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attention_type=model, decoder_attention_type=model, cross_attention_type=cross,
        attn_implementation="sdpa",
    )
    description = f"ZformerForConditionalGeneration: {model} encoder, causal {model} decoder, {cross} cross-attention"
    return ZformerForConditionalGeneration(config), description


def seq2seq_benchmark(models: Iterable[str], shape: Seq2SeqShape, device: str = "cpu", dtype: str = "fp32",
                      warmup: int = 1, repeats: int = 5, progress: bool = True) -> list[Seq2SeqResult]:
    """Training steps (forward, backward, AdamW step on random token ids) and greedy generation of
    exactly `target_length` tokens (EOS suppressed, so every model does the same work), all models
    measured side by side: their timed calls alternate, so load from other processes hits all alike.
    tokens/s counts source + target tokens of a training batch; sentences/s = batch / generate time."""
    from tqdm.auto import tqdm

    models = list(models)
    device_ = torch.device(device)
    autocast_dtype = DTYPES[dtype]
    use_autocast = autocast_dtype != torch.float32
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(3, shape.vocab, (shape.batch, shape.source_length), generator=generator).to(device_)
    source_mask = torch.ones_like(source)
    labels = torch.randint(3, shape.vocab, (shape.batch, shape.target_length), generator=generator).to(device_)

    runners = {}
    for name in models:
        torch.manual_seed(0)
        model, description = build_seq2seq(name, shape)
        model.to(device_)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runners[name] = (model, description, optimizer)

    def train_step(name):
        model, _, optimizer = runners[name]
        model.train()
        with torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            loss = model(input_ids=source, attention_mask=source_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def generate(name):
        model = runners[name][0]
        model.eval()
        with torch.inference_mode(), torch.autocast(device_.type, dtype=autocast_dtype, enabled=use_autocast):
            output = model.generate(
                input_ids=source, attention_mask=source_mask, max_new_tokens=shape.target_length,
                min_new_tokens=shape.target_length, num_beams=1, do_sample=False,
            )
        if output.shape[1] < shape.target_length:  # pragma: no cover - min_new_tokens guarantees it
            raise RuntimeError(f"{name} generated {output.shape[1]} tokens, fewer than {shape.target_length}")

    times = {name: {"train": [], "generate": []} for name in models}
    bar = tqdm(total=2 * (warmup + repeats) * len(models), disable=not progress, desc="seq2seq", dynamic_ncols=True)
    for kind, function in (("train", train_step), ("generate", generate)):
        for index in range(warmup + repeats):
            for name in models:
                bar.set_postfix_str(f"{kind} {name}")
                elapsed = _timed_call(lambda: function(name), device_)
                if index >= warmup:
                    times[name][kind].append(elapsed)
                bar.update(1)
    bar.close()

    results = []
    for name in models:
        model, description, _ = runners[name]
        train = statistics.median(times[name]["train"])
        gen = statistics.median(times[name]["generate"])
        results.append(Seq2SeqResult(
            model=name, description=description, parameters=sum(p.numel() for p in model.parameters()),
            batch=shape.batch, source_length=shape.source_length, target_length=shape.target_length,
            width=shape.width, layers=shape.layers, heads=shape.heads, ffn=shape.ffn, vocab=shape.vocab,
            dtype=dtype, device=device, train_step_ms=train * 1e3,
            train_tokens_per_s=shape.batch * (shape.source_length + shape.target_length) / train,
            generate_ms=gen * 1e3, sentences_per_s=shape.batch / gen,
            train_times_ms=[t * 1e3 for t in times[name]["train"]],
            generate_times_ms=[t * 1e3 for t in times[name]["generate"]],
        ))
    base = next((r for r in results if r.model == "bart"), None)
    for r in results:
        if base is not None:
            r.train_speedup_vs_bart = r.train_tokens_per_s / base.train_tokens_per_s
            r.generate_speedup_vs_bart = r.sentences_per_s / base.sentences_per_s
    return results


def seq2seq_markdown(results: list[Seq2SeqResult]) -> str:
    if not results:
        return ""
    r0 = results[0]
    lines = [
        f"**encoder-decoder, batch {r0.batch}, source {r0.source_length} / target {r0.target_length} tokens, "
        f"width {r0.width}, {r0.layers}+{r0.layers} layers, {r0.heads} heads, FFN {r0.ffn}, vocabulary {r0.vocab}, "
        f"{r0.dtype}, {r0.device}**\n",
        "| model | parameters | train step ms | train tokens/s (vs BART) | greedy generate ms | sentences/s (vs BART) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        train_ratio = f" ({r.train_speedup_vs_bart:.2f}x)" if r.train_speedup_vs_bart is not None else ""
        gen_ratio = f" ({r.generate_speedup_vs_bart:.2f}x)" if r.generate_speedup_vs_bart is not None else ""
        lines.append(
            f"| {r.model} | {r.parameters / 1e6:.1f}M | {r.train_step_ms:.0f} | {r.train_tokens_per_s:.0f}{train_ratio} | "
            f"{r.generate_ms:.0f} | {r.sentences_per_s:.2f}{gen_ratio} |"
        )
    lines.append("")
    lines.extend(f"- `{r.model}`: {r.description}" for r in results)
    return "\n".join(lines) + "\n"


def write_seq2seq_reports(results: list[Seq2SeqResult], output_prefix: str, metadata: dict) -> dict:
    directory = os.path.dirname(output_prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    paths = {"csv": output_prefix + ".csv", "json": output_prefix + ".json", "md": output_prefix + ".md"}
    fields = [f for f in Seq2SeqResult.__dataclass_fields__]
    with open(paths["csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in results:
            row = asdict(r)
            for key in ("train_times_ms", "generate_times_ms"):
                row[key] = " ".join(f"{t:.1f}" for t in row[key])
            writer.writerow(row)
    with open(paths["json"], "w") as handle:
        json.dump({"metadata": metadata, "results": [asdict(r) for r in results]}, handle, indent=1)
    with open(paths["md"], "w") as handle:
        handle.write(markdown_header(metadata) + "\n" + seq2seq_markdown(results))
    return paths


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------

CSV_FIELDS = [
    "level", "attention_type", "mode", "batch", "length", "width", "heads", "dtype", "device", "mask", "status",
    "time_ms", "speedup_vs_full", "peak_memory_mb", "flops", "executed_flops", "tflops", "flops_fraction",
    "executed_fraction", "note", "times_ms",
]


def write_csv(results: list[BenchResult], path: str):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            row = asdict(r)
            row["times_ms"] = " ".join(f"{t:.3f}" for t in r.times_ms)
            writer.writerow({k: row[k] for k in CSV_FIELDS})


def write_json(results: list[BenchResult], path: str, metadata: dict):
    with open(path, "w") as handle:
        json.dump({"metadata": metadata, "results": [asdict(r) for r in results]}, handle, indent=1)


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown_table(results: list[BenchResult]) -> str:
    """One table per (level, mode, width, heads, dtype, device): rows = n, one column group per type."""
    out = []
    groups = {}
    for r in results:
        groups.setdefault((r.level, r.mode, r.batch, r.width, r.heads, r.dtype, r.device, r.mask), []).append(r)
    for (level, mode, batch, width, heads, dtype, device, mask), rows in groups.items():
        types = list(dict.fromkeys(r.attention_type for r in rows))
        lengths = sorted({r.length for r in rows})
        by_key = {(r.length, r.attention_type): r for r in rows}
        out.append(
            f"**{level}, {mode}, batch {batch}, width {width}, {heads} heads, {dtype}, {device}"
            f"{', all-ones padding mask' if mask else ''}** — time ms (speedup vs fused SDPA `full`) · "
            f"peak extra memory MiB · nominal FLOP/s as % of matmul (executed FLOP/s %, where it differs)\n"
        )
        out.append("| n | " + " | ".join(types) + " |")
        out.append("|---:|" + "---|" * len(types))
        for n in lengths:
            cells = []
            for t in types:
                r = by_key.get((n, t))
                if r is None:
                    cells.append("")
                elif r.status != "ok":
                    cells.append(f"{r.status}")
                else:
                    speed = f" ({r.speedup_vs_full:.2f}x)" if r.speedup_vs_full is not None else ""
                    frac = ""
                    if r.flops_fraction is not None:
                        frac = f" · {100 * r.flops_fraction:.0f}%"
                        if r.executed_flops != r.flops:
                            frac += f" ({100 * r.executed_fraction:.0f}%)"
                    cells.append(f"{r.time_ms:.1f}{speed} · {_fmt(r.peak_memory_mb, '.0f')}{frac}")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        notes = sorted({f"{r.attention_type} n={r.length}: {r.note}" for r in rows if r.status != "ok" and r.note})
        if notes:
            out.append("")
            out.extend(f"- {note}" for note in notes)
        out.append("")
        for r in rows:
            if r.profile:
                out.append(f"<details><summary>profile: {r.attention_type}, n={r.length}</summary>\n")
                out.append("```\n" + r.profile.strip() + "\n```\n</details>\n")
    return "\n".join(out)


def plot(results: list[BenchResult], path: str):
    """Time and peak memory vs n, log-log, one line per type; one row of panels per
    (level, mode, width, heads, dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in results:
        groups.setdefault((r.level, r.mode, r.batch, r.width, r.heads, r.dtype, r.device), []).append(r)
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 4 * len(groups)), squeeze=False)
    for row, (key, rows) in enumerate(groups.items()):
        level, mode, batch, width, heads, dtype, device = key
        for col, (attr, label) in enumerate((("time_ms", "time per call (ms)"), ("peak_memory_mb", "peak extra memory (MiB)"))):
            ax = axes[row][col]
            for t in dict.fromkeys(r.attention_type for r in rows):
                points = sorted((r.length, getattr(r, attr)) for r in rows
                                if r.attention_type == t and r.status == "ok" and getattr(r, attr))
                if points:
                    ax.plot(*zip(*points), marker="o", label=t)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length n")
            ax.set_ylabel(label)
            ax.set_title(f"{level} {mode}, B={batch}, d={width}, h={heads}, {dtype}, {device}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: list[BenchResult], output_prefix: str, metadata: dict, make_plot: bool = True) -> dict:
    """Write `<prefix>.csv`, `<prefix>.json`, `<prefix>.md` (and `<prefix>.png`); returns the paths."""
    directory = os.path.dirname(output_prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    paths = {"csv": output_prefix + ".csv", "json": output_prefix + ".json", "md": output_prefix + ".md"}
    write_csv(results, paths["csv"])
    write_json(results, paths["json"], metadata)
    with open(paths["md"], "w") as handle:
        handle.write(markdown_header(metadata) + "\n" + markdown_table(results))
    if make_plot:
        paths["png"] = output_prefix + ".png"
        plot(results, paths["png"])
    return paths


def markdown_header(metadata: dict) -> str:
    matmul = metadata.get("matmul", {})
    lines = [
        f"Command: `{metadata.get('command', '')}`",
        "",
        f"Machine: {metadata.get('cpu', '?')} ({metadata.get('cpu_count', '?')} CPUs, {metadata.get('threads', '?')} "
        f"torch threads){', ' + metadata['gpu'] if 'gpu' in metadata else ''}; torch {metadata.get('torch', '?')}, "
        f"transformers {metadata.get('transformers', '?')}; {metadata.get('date', '')}.",
        f"Environment: {metadata.get('environment') or 'defaults'}; load average at start "
        f"{metadata.get('load_average')}, at end {metadata.get('load_average_end')}.",
    ]
    if matmul:
        lines.append(
            f"Measured matmul: {matmul['size']}x{matmul['size']} {matmul['dtype']}, "
            f"{matmul['flops'] / 1e9:.1f} GFLOP/s (the 100% of the FLOP/s column)."
        )
    return "\n".join(lines) + "\n"


def command_line() -> str:
    """`python <script> <args>`, prefixed by the timing-relevant environment variables that are set."""
    environment = [f"{k}={os.environ[k]}" for k in TIMING_ENVIRONMENT if k in os.environ]
    script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return " ".join(environment + ["python", script] + sys.argv[1:])
