"""The attention benchmark's harness: machine measurements (matmul FLOP/s, copy bandwidth, load,
memory), timing and peak memory of one call, and the side-by-side runs of cases (`run_cases`,
`sweep`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import random
import signal
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict

import torch

from hf_zformer.modeling.ops import use_kernel_backend
from .cases import BASELINE, DTYPES, GRID_LEVELS, MODES, TYPES, BenchCase, BenchResult, build_module, kernel_backend_of, make_config
from .flops import case_flops, set_flops_fractions
from .traffic import count_traffic

# Environment variables that change CPU timings (THP_MEM_ALLOC_ENABLE=1: transparent huge pages for
# torch's CPU allocations; MALLOC_*: whether glibc returns freed memory to the system, see
# hf_zformer.memory.retain_freed_memory); recorded in the metadata and in front of the recorded command line.
TIMING_ENVIRONMENT = (
    "THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
)

# the note of a case a stopped run did not reach (Ctrl-C, or SIGTERM under `interrupt_on_terminate`)
INTERRUPTED = "not measured: the run was stopped first"


@contextlib.contextmanager
def interrupt_on_terminate():
    """Within the block SIGTERM (what `timeout`, job schedulers and process managers send) raises
    KeyboardInterrupt as Ctrl-C does, so that a run stopped from outside still writes what it
    measured; Ctrl-C works too where the process started with SIGINT ignored (a background job of a
    non-interactive shell). The handlers before it come back after the block."""
    before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    for number in before:
        signal.signal(number, signal.default_int_handler)
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


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
        elapsed = timed_call(lambda: torch.nn.functional.linear(a, b), device)  # warm-up
        elapsed = timed_call(lambda: torch.nn.functional.linear(a, b), device)
        if elapsed >= target_seconds or size >= max_size:
            break
        size *= 2
    times = [timed_call(lambda: torch.nn.functional.linear(a, b), device) for _ in range(repeats)]
    seconds = statistics.median(times)
    return {"size": size, "dtype": str(dtype).replace("torch.", ""), "seconds": seconds, "flops": 2 * size**3 / seconds}


def measure_copy_bandwidth(device: torch.device, size_bytes: int | None = None, repeats: int = 5,
                           calls: int = 5) -> dict:
    """Bytes per second of a copy between two buffers of `size_bytes` (1 GiB on a GPU, 64 MiB on a
    CPU: far beyond any cache), read plus written: the median over `repeats` timed runs of `calls`
    copies each (a run's synchronisation then weighs little against its copies), after one warm-up.
    The 100% of the attention benchmark's bandwidth column, as the matmul rate is of its FLOP/s
    column, and of the kernel benchmark's."""
    size_bytes = size_bytes or (2**30 if device.type == "cuda" else 2**26)
    source = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)

    def copies():
        for _ in range(calls):
            target.copy_(source)

    timed_call(copies, device)
    seconds = statistics.median(timed_call(copies, device) for _ in range(repeats)) / calls
    moved = 2 * source.numel() * source.element_size()
    return {"size_bytes": moved // 2, "seconds": seconds, "bytes_per_s": moved / seconds}


def paired_ratio_interval(base_times: list[float], times: list[float], confidence: float = 0.95,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high) of the per-round speed ratios base / other, with a bootstrap interval of
    the median at `confidence`. base_times[i] and times[i] are the i-th timed calls of two models
    that ran in the same round of a side-by-side run, so each ratio compares calls made moments
    apart: a load change that hits one round hits both of its calls. Resampling rounds (with
    replacement, `resamples` times, a fixed `seed`: the same times give the same interval) says how
    far the median could move on another run of the same length. Ratio > 1: the other model is faster."""
    if len(base_times) != len(times):
        raise ValueError(f"paired times need one call per round of each model; got {len(base_times)} and {len(times)}")
    if not times:
        raise ValueError("paired times are empty")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1; got {confidence}")
    if any(t <= 0 for t in [*base_times, *times]):
        raise ValueError("paired times must be positive")
    ratios = [base / other for base, other in zip(base_times, times)]
    generator = random.Random(seed)
    medians = sorted(statistics.median(generator.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[int(round((1 - tail) * (resamples - 1)))]
    return statistics.median(ratios), low, high


def source_commit() -> str:
    """The commit of the code that runs: `HF_ZFORMER_COMMIT` where set (a copied tree whose git
    history, if any, is not its own), else `git rev-parse HEAD` (with "+changes" when tracked files
    differ from it), else "unknown"."""
    if os.environ.get("HF_ZFORMER_COMMIT"):
        return os.environ["HF_ZFORMER_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ sits in the checkout's root
    def run(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = run("rev-parse", "HEAD").strip()
        return commit + ("+changes" if run("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(device: torch.device) -> dict:
    info = {
        "commit": source_commit(),
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
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
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


def _make_inputs(case: BenchCase, config, device: torch.device):
    """Inputs of one call; the (n, B, D) -> (B, N, D) transpose happens here, before timing."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(case.batch, case.length, dtype=torch.long, device=device) if case.mask else None
    if case.level == "model":
        ids = torch.randint(3, config.vocab_size, (case.batch, case.length), generator=generator).to(device)
        return {"input_ids": ids, "attention_mask": mask}
    seed_layout = torch.randn(case.length, case.batch, case.width, generator=generator)  # (n, B, D) like Zformer_Pytorch's timing
    hidden = seed_layout.transpose(0, 1).contiguous().to(device)  # (B, N, D)
    hidden.requires_grad_(case.mode == "train")
    return {"hidden_states": hidden, "attention_mask": mask}


def _make_step(module, inputs: dict, case: BenchCase, device: torch.device) -> Callable[[], None]:
    autocast_dtype = DTYPES[case.dtype]
    use_autocast = autocast_dtype != torch.float32
    backend = kernel_backend_of(case.attention_type)

    def output_of(result):
        if case.level == "model":
            return result.last_hidden_state
        return result[0]

    if case.mode == "forward":
        module.eval()

        def step():
            with torch.inference_mode(), torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast), \
                    use_kernel_backend(backend):
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
        with use_kernel_backend(backend):
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast):
                output = output_of(module(**inputs))
            if grad is None or grad.shape != output.shape or grad.dtype != output.dtype:
                grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)).to(device, output.dtype)
            output.backward(grad)

    return step


# calls of a compiled step before its warm-up: inductor compiles on the first, and in mode
# "reduce-overhead" its CUDA graph trees run the step once more before recording it, then replay
COMPILED_WARMUP = 3


def compile_module(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    """`module` under torch.compile in `mode`, for the one shape of its case (`dynamic=False`). Every
    case compiles its own module, and the modules of one attention class share the code dynamo
    guards, so its limit on recompilations is raised for the process (beyond it dynamo would fall
    back to eager calls without saying so in the results)."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 1024))
    return torch.compile(module, mode=mode, dynamic=False)


def capture_graph(step: Callable[[], None], device: torch.device, warmup: int = 3) -> Callable[[], None]:
    """`step` captured once as a CUDA graph (after `warmup` calls on a side stream, which compile the
    kernels and let autograd and the allocator settle); returns the graph's replay, which runs the
    same kernels on the same buffers without the host work of the eager call."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay():
        graph.replay()

    # the graph reads the module's parameters and the inputs where they were at capture: the eager
    # step's closure holds them, so it lives as long as the replay
    replay.eager_step = step
    return replay


def timed_call(step: Callable[[], None], device: torch.device) -> float:
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
        """Run `action`, turning out-of-memory errors into an "oom" result and any other failure (a
        kernel that does not compile on this device, say) into an "error" result naming it, so one
        failing case does not cost the rest of the grid; the traceback goes to stderr."""
        if not self.active:
            return
        try:
            action()
        except Exception as error:  # noqa: BLE001 - reported in the result, traceback printed
            if _is_oom(error):
                self.result.status, self.result.note = "oom", str(error).splitlines()[0][:200]
            else:
                traceback.print_exc()
                first = (str(error).strip().splitlines() or [""])[0]
                self.result.status, self.result.note = "error", f"{type(error).__name__}: {first}"[:200]
            self.release()

    def build(self):
        def action():
            torch.manual_seed(0)
            module = build_module(self.case.attention_type, self.config, self.case.level, self.device)
            if self.case.compiled:
                module = compile_module(module, self.case.compiled)
            self.step = _make_step(module, _make_inputs(self.case, self.config, self.device), self.case, self.device)
            if self.case.compiled:  # compiled on the first call; in "reduce-overhead" recorded on the next
                for _ in range(COMPILED_WARMUP):
                    self.step()
            if self.case.graphs:
                try:
                    self.step = capture_graph(self.step, self.device)
                except RuntimeError as error:  # an operation the capture refuses (a host sync): say which
                    if _is_oom(error):
                        raise
                    self.result.status, self.result.note = "error", f"CUDA graph capture: {str(error).splitlines()[0][:200]}"
                    self.release()

        self.guarded(action)

    def call(self, record: bool) -> float | None:
        elapsed = []
        self.guarded(lambda: elapsed.append(timed_call(self.step, self.device)))
        if elapsed and record:
            self.times.append(elapsed[0])
        return elapsed[0] if elapsed else None

    def count_traffic(self):
        """Operations and bytes moved by one eager call (`traffic.TrafficCounter`), after the warm-up
        (a training step makes its output gradient on its first call); a captured step's eager form
        counts, and a compiled module, whose code the counter cannot follow, counts nothing."""
        if self.case.compiled:
            return

        def action():
            counter = count_traffic(getattr(self.step, "eager_step", self.step))
            self.result.operations, self.result.bytes = counter.operations, counter.bytes

        self.guarded(action)

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
              matmul_flops: float | None = None, profile: bool = False,
              measure_traffic: bool = True) -> list[BenchResult]:
    """Measure configurations side by side: after each one's warm-up, the timed calls go round-robin
    over them (call 1 of every case, then call 2, ...), so that load from other processes on a shared
    machine hits every type alike and the speedups compare like with like. A configuration whose
    warm-up call is slow gets fewer timed calls (about `max_seconds` worth, but at least
    min(3, repeats)). With `measure_traffic`, one more call after the warm-up counts each one's
    operations and bytes moved (`traffic`; `set_bandwidth_fractions` then gives their share of the
    copy rate).
    The memory of each is measured after its timed calls."""
    runners = [_Runner(case, max_memory_bytes) for case in cases]
    counts = {}
    for runner in runners:
        runner.build()
        last = None
        for _ in range(warmup):
            last = runner.call(record=False)
        counts[id(runner)] = repeats if not last else max(min(3, repeats), min(repeats, int(max_seconds / last)))
        if measure_traffic:
            runner.count_traffic()
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
    graphs: bool = False,
    compiled: str = "",
    measure_traffic: bool = True,
) -> list[BenchResult]:
    """Every (mode, width, heads, length) with all `types` measured side by side (`run_cases`),
    lengths ascending. Once a type takes longer than `max_seconds` per call (or runs out of
    memory), its longer lengths in the same (mode, width, heads) are recorded as skipped. `graphs`:
    every call replays the step captured as a CUDA graph (`capture_graph`); `compiled`: the modules
    run under torch.compile in that mode (`compile_module`); `measure_traffic`: as
    `run_cases`."""
    from tqdm.auto import tqdm

    types, lengths, modes = list(types), sorted(lengths), list(modes)
    for attention_type in types:
        if attention_type not in TYPES:
            raise ValueError(f"unknown attention type {attention_type!r}; choose one of {list(TYPES)}")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")
    if level not in GRID_LEVELS:
        raise ValueError(f"sweep level must be one of {list(GRID_LEVELS)}, not {level!r}")
    groups = [(mode, w, h, n) for mode in modes for w in widths for h in heads for n in lengths]
    results, stopped = [], {}
    bar = tqdm(total=len(groups) * len(types), disable=not progress, desc="benchmark", dynamic_ncols=True)
    try:
        for mode, w, h, n in groups:
            bar.set_postfix_str(f"{mode} n={n} d={w} h={h}")
            cases, group_results = [], []
            for t in types:
                case = BenchCase(level, t, mode, batch, n, w, h, dtype, device, mask, graphs, compiled)
                if (mode, w, h, t) in stopped:
                    group_results.append(_skipped(case, stopped[(mode, w, h, t)]))
                else:
                    cases.append(case)
            group_results += run_cases(cases, warmup, repeats, max_seconds, measure_memory, max_memory_bytes,
                                       matmul_flops, profile, measure_traffic)
            group_results.sort(key=lambda r: types.index(r.attention_type))
            for result in group_results:
                key = (mode, w, h, result.attention_type)
                if result.status == "oom":
                    stopped[key] = f"out of memory at n={result.length}"
                elif result.status == "ok" and result.time_ms / 1e3 > max_seconds and key not in stopped:
                    stopped[key] = f"n={result.length} took {result.time_ms / 1e3:.1f} s > --max_seconds {max_seconds:g}"
            results += group_results  # a whole group at once: an interrupted group leaves nothing half-measured
            bar.update(len(types))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (interrupt_on_terminate): keep what was measured
        measured = len(results) // len(types)
        for mode, w, h, n in groups[measured:]:
            results += [_skipped(BenchCase(level, t, mode, batch, n, w, h, dtype, device, mask, graphs, compiled),
                                 INTERRUPTED) for t in types]
    bar.close()
    add_speedups(results)
    return results


def _skipped(case: BenchCase, note: str) -> BenchResult:
    """A case recorded without a measurement, with why, and its FLOPs."""
    result = BenchResult(**asdict(case))
    result.status, result.note = "skipped", note
    result.flops, result.executed_flops = case_flops(case)
    return result


def add_speedups(results: list[BenchResult]):
    """speedup_vs_full = time of fused SDPA `full` / time of this type, same configuration."""
    baseline = {
        _group(r): r.time_ms for r in results if r.attention_type == BASELINE and r.status == "ok"
    }
    for r in results:
        base = baseline.get(_group(r))
        r.speedup_vs_full = base / r.time_ms if base and r.status == "ok" else None


def _group(r: BenchResult):
    return (r.level, r.mode, r.batch, r.length, r.width, r.heads, r.dtype, r.device, r.mask, r.graphs, r.compiled)
