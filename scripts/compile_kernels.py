"""Compile every Triton kernel of hf_zformer for a CUDA GPU, on a machine without one, and report
what each compiled kernel asks of the GPU: registers per thread, bytes spilled to local memory,
shared memory against the architecture's limit, and how many programs fit on one multiprocessor.

    python scripts/compile_kernels.py                       # sm_80 and sm_90, head widths 32 to 256
    python scripts/compile_kernels.py --arch 90 --widths 64 --dtypes bf16 --json kernels.json

Triton compiles down to the GPU's machine code (cubin) with the ptxas it bundles; neither a GPU nor
a CUDA driver is needed. The kernels are reached through their public functions in
`hf_zformer.modeling.triton_ops` (every family's kernel module under one name), forward and backward, with CPU tensors of the shapes and layouts
the models give them (head views of a projection, and contiguous): Zformer's linear attention (one program per (sequence, head) pair, and the split plan),
with and without a mask and a scale, at head width d against d and, for the Hedgehog feature map,
2 d against d + 1; Fastformer's poolings per head (one slice and several), across heads at the
model widths 8 d, and causal (prefix), the column scaling of W_r and the fused product
q + (v diag(k_g)) W_r^T at the model widths. Every launch compiles and returns at once: nothing runs, so
the outputs stay unwritten. A kernel compiled for several calls is reported once.

Only what the dispatch would run on each GPU is compiled: each family's module bounds its kernels'
shared memory by the tile they hold (`LINEAR_ATTENTION_SHARED`, `SHARED_POOL_SHARED`,
`PREFIX_POOL_SHARED`, and `PRODUCT_SHARED` for the fused product's fixed tiles) and leaves tiles whose bound exceeds the GPU's shared memory to the torch
forms; those are listed at the end. Exit status 1 where a kernel fails to compile, asks more shared
memory than the architecture gives one program (the launch would fail on that GPU with "out of
resource: shared memory"), or more than its family's bound (the bound the dispatch trusts is
wrong); with `--strict` spilled registers fail too. Needs triton; `TRITON_INTERPRET` is ignored here.
"""

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# Per multiprocessor, by compute capability: (GPUs, shared memory, threads), from NVIDIA's CUDA C++
# Programming Guide; what one program may ask for is `triton_ops.SHARED_MEMORY_BY_CAPABILITY`.
# Every one of them has 65,536 registers per multiprocessor.
ARCHITECTURES = {
    80: ("A100", 167_936, 2048),
    86: ("RTX 30xx / A10", 102_400, 1536),
    89: ("L4 / L40 / RTX 40xx", 102_400, 1536),
    90: ("H100 / H200", 233_472, 2048),
}
REGISTERS_PER_SM = 65_536
MODEL_HEADS = 8  # the model widths of the cross-head pooling: 8 heads of each head width


@dataclass
class CompiledKernel:
    arch: int
    kernel: str
    dtype: str
    constants: str
    num_warps: int
    num_stages: int
    registers: int | None
    spilled_bytes: int | None
    shared_bytes: int
    shared_limit: int
    programs_per_sm: int | None
    seconds: float
    bound: int | None = None  # the family's shared-memory bound for this tile (`*_SHARED` of its module)
    error: str = ""

    @property
    def fails(self) -> bool:
        over_bound = self.bound is not None and self.shared_bytes > self.bound
        return bool(self.error) or self.shared_bytes > self.shared_limit or over_bound

    @property
    def spills(self) -> bool:
        return bool(self.spilled_bytes)


class _CompileOnlyDriver:
    """The part of triton's driver interface a compile asks for, naming the target GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        # a device per target: triton keeps compiled kernels per device, so a kernel compiled for
        # one architecture is not handed out again for the next
        return self.target.arch

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        raise RuntimeError("compile_kernels.py compiles only: nothing is timed")


def _block_limit(arch: int) -> int:
    """Shared memory one program may ask for on compute capability `arch` (major * 10 + minor)."""
    from hf_zformer.modeling.triton_ops import SHARED_MEMORY_BY_CAPABILITY

    return SHARED_MEMORY_BY_CAPABILITY[(arch // 10, arch % 10)]


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, local-memory bytes per thread) of a cubin, read with the cuobjdump
    that triton bundles (None, None where there is none)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([tool, "--dump-resource-usage", handle.name], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    spilled = (int(local.group(1)) if local else 0) + (int(stack.group(1)) if stack else 0)
    return (int(registers.group(1)) if registers else None), spilled


def _programs_per_sm(arch: int, registers: int | None, shared: int, num_warps: int) -> int | None:
    """Programs resident on one multiprocessor, bounded by registers (allocated per warp in units
    of 256), shared memory and threads."""
    if registers is None:
        return None
    _, shared_per_sm, threads_per_sm = ARCHITECTURES[arch]
    per_warp = -(-registers * 32 // 256) * 256
    bounds = [REGISTERS_PER_SM // (per_warp * num_warps), threads_per_sm // (32 * num_warps)]
    if shared:
        bounds.append(shared_per_sm // (shared + 1024))  # the runtime reserves 1 KiB per block
    return min(bounds)


_SHOWN_CONSTANTS = ("heads", "D", "DK", "DV", "DX", "DY", "BD", "BH", "BB", "BM", "BO", "BI", "BLOCK_N", "HAS_MASK",
                    "HAS_SCALE", "HAS_DIRECTION", "HAS_GATE", "SHARED", "FINAL", "DOT_FP32", "TRANSPOSE", "SIZE")


class KernelCompiler:
    """Makes every triton launch compile for `arch` instead of running (`JITFunction.__getitem__`),
    and records each distinct compiled kernel once."""

    def __init__(self, arch: int):
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self.arch = arch
        self.limit = _block_limit(arch)
        self.bound: int | None = None  # set by `drive_kernels` before each family's launches
        self.results: list[CompiledKernel] = []
        self.torch_forms: list[str] = []  # what the dispatch leaves to the torch forms on this GPU
        self._seen: set[int] = set()
        self._driver = driver
        self._jit = JITFunction
        self._getitem = JITFunction.__getitem__

    def __enter__(self):
        self._previous = getattr(self._driver, "_active", None)  # reset_active() would look for a GPU
        self._driver.set_active(_CompileOnlyDriver(self.arch))
        compiler = self

        def launcher(function, grid):
            def launch(*args, **kwargs):
                compiler._compile(function, grid, args, kwargs)

            return launch

        self._jit.__getitem__ = launcher
        return self

    def __exit__(self, *exc):
        self._jit.__getitem__ = self._getitem
        self._driver._active = self._previous

    def _compile(self, function, grid, args, kwargs):
        name = function.fn.__name__
        dtype = next((str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor)), "")
        constants = ", ".join(f"{k}={kwargs[k]}" for k in _SHOWN_CONSTANTS if k in kwargs)
        block_limit = self.limit
        start = time.perf_counter()
        try:
            kernel = function.run(*args, grid=grid, warmup=True, **kwargs)
        except Exception as error:  # a compile error is the finding: report it and go on
            message = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            self.results.append(CompiledKernel(self.arch, name, dtype, constants, kwargs.get("num_warps", 4),
                                               kwargs.get("num_stages", 3), None, None, 0, block_limit, None,
                                               time.perf_counter() - start, self.bound, error=message))
            return
        if id(kernel) in self._seen:
            return
        self._seen.add(id(kernel))
        registers, spilled = _resource_usage(kernel.asm["cubin"])
        metadata = kernel.metadata
        compiled_for = metadata.target.arch
        self.results.append(CompiledKernel(
            self.arch, name, dtype, constants, metadata.num_warps, metadata.num_stages, registers, spilled,
            metadata.shared, block_limit, _programs_per_sm(self.arch, registers, metadata.shared, metadata.num_warps),
            time.perf_counter() - start, self.bound,
            error="" if compiled_for == self.arch else f"compiled for sm_{compiled_for}, not sm_{self.arch}",
        ))


def _backward(output: torch.Tensor, *inputs: torch.Tensor) -> None:
    torch.autograd.grad(output, [t for t in inputs if t is not None and t.requires_grad],
                        torch.ones_like(output), allow_unused=True)


BATCH, HEADS = 2, 2  # of the calls that compile the kernels (any size compiles the same code)


def drive_kernels(triton_ops, compiler: KernelCompiler, widths: list[int], dtypes: list[torch.dtype],
                  length: int = 600) -> None:
    """Calls every kernel function the dispatch would run on `compiler`'s GPU (the fit rules of
    `triton_ops` against its shared memory), forward and backward, at head `widths` and `dtypes`:
    CPU tensors, whose launches compile (`KernelCompiler`). `length` spans several slices of the
    split sums. What the rules leave to the torch forms is listed in `compiler.torch_forms`."""
    mask = torch.ones(BATCH, length, dtype=torch.bool)
    layout = {"heads": True}

    def tensor(*shape, dtype):
        """Zeros (B, H, N, d) as head views of a (B, N, H * d) projection (how the attention classes
        pass Q, K and V), or contiguous (a feature map's output): the strides decide how triton
        specialises a kernel, and with it the shared memory it asks (65,536 against 40,960 bytes
        for the fused forward at 64-wide bf16 heads)."""
        if len(shape) != 4 or not layout["heads"]:
            return torch.zeros(*shape, dtype=dtype, requires_grad=True)
        b, h, n, d = shape
        return torch.zeros(b, n, h * d, dtype=dtype, requires_grad=True).view(b, n, h, d).transpose(1, 2)

    try:
        for dtype, heads_layout, width in itertools.product(dtypes, (True, False), widths):
            layout["heads"] = heads_layout
            _drive_linear_attention(triton_ops, compiler, tensor, dtype, width, mask)
            _drive_poolings(triton_ops, compiler, tensor, dtype, width, mask)
    finally:
        compiler.bound = None


def _drive_linear_attention(triton_ops, compiler, tensor, dtype, width, mask) -> None:
    """Zformer: plain heads (d against d) and the Hedgehog map's features (2 d against d + 1), in
    both launch plans, with a mask and a scale and without."""
    from hf_zformer.modeling.policy import use_policy  # imported once TRITON_INTERPRET is settled

    length = mask.shape[1]
    for dk, dv in ((width, width), (2 * width, width + 1)):
        if not triton_ops.linear_attention_fits(dk, dv, compiler.limit):
            compiler.torch_forms.append(f"linear attention {dk} x {dv}")
            continue
        compiler.bound = triton_ops.linear_attention_shared(dk, dv)
        for min_pairs, with_mask in itertools.product((1, 10**9), (True, False)):  # one program per pair; split
            q, k = (tensor(BATCH, HEADS, length, dk, dtype=dtype) for _ in range(2))
            v = tensor(BATCH, HEADS, length, dv, dtype=dtype)
            scale = torch.ones(1, requires_grad=True) if with_mask else None
            with use_policy(fused_min_pairs=min_pairs):
                out = triton_ops.linear_attention_kernel(q, k, v, mask if with_mask else None, scale)
                _backward(out, q, k, v, scale)


def _drive_poolings(triton_ops, compiler, tensor, dtype, width, mask) -> None:
    """Fastformer: the per-head pooling (one slice and several; a (rows, width) tile and a few
    vectors, no bound needed), plain and gated (the key pooling), the pooling across `MODEL_HEADS`
    heads of the layer's input, and the causal (prefix) pooling; the first two along a direction
    and as the mean; and the column scaling of W_r at the model's width."""
    from hf_zformer.modeling.policy import active  # imported once TRITON_INTERPRET is settled
    from hf_zformer.modeling.triton_launch import tile
    from hf_zformer.modeling.triton_pooling import GATE_TILE
    from hf_zformer.modeling.triton_product import SCALE_BATCH

    length, limit = mask.shape[1], compiler.limit
    compiler.bound = None
    # the gate's gradients take a tile of sequences: a batch that fills it compiles the largest
    full_tile = max(BATCH, GATE_TILE // tile(width))
    for rows, with_direction, gated in itertools.product((active().pool_chunk or 64, length), (True, False),
                                                         (False, True)):
        batch = full_tile if gated else BATCH
        values = tensor(batch, HEADS, rows, width, dtype=dtype)
        # the key pooling's direction is one per head (w_k), its gate one per sequence (q_g)
        direction = torch.zeros(1 if gated else batch, HEADS, width, requires_grad=True) if with_direction else None
        gate = torch.zeros(batch, HEADS, width, requires_grad=True) if gated else None
        rows_mask = torch.ones(batch, rows, dtype=torch.bool)
        pooled = triton_ops.direction_pool_kernel(values, direction, rows_mask, gate=gate)
        _backward(pooled, values, direction, gate)
    model_width = MODEL_HEADS * width
    if triton_ops.shared_fits(model_width, MODEL_HEADS, limit):
        compiler.bound = triton_ops.shared_pool_shared(model_width, MODEL_HEADS)
        for with_direction in (True, False):
            rows_input = tensor(BATCH, length, model_width, dtype=dtype)
            direction = torch.zeros(1, MODEL_HEADS, model_width, requires_grad=True) if with_direction else None
            _backward(triton_ops.shared_pool_kernel(rows_input, direction, mask), rows_input, direction)
    else:
        compiler.torch_forms.append(f"pooling across {MODEL_HEADS} heads {model_width} wide")
    if triton_ops.prefix_fits(width, limit):
        compiler.bound = triton_ops.prefix_shared(width)
        scores, values = tensor(BATCH, HEADS, length, 1, dtype=dtype), tensor(BATCH, HEADS, length, width, dtype=dtype)
        pooled, _ = triton_ops.prefix_pool_kernel(scores, values, mask)
        _backward(pooled, scores, values)
    else:
        compiler.torch_forms.append(f"causal pooling {width} wide")
    # W_r diag(k_g): the fp32 weight scaled into the autocast dtype (fp32 without autocast); fixed
    # 32 x 32 tiles, no bound needed; the backward's fullest group of sequences
    compiler.bound = None
    weight = torch.zeros(model_width, model_width, requires_grad=True)
    scales = torch.zeros(max(BATCH, SCALE_BATCH), model_width, requires_grad=True)
    _backward(triton_ops.column_scale_kernel(weight, scales, dtype), weight, scales)
    # r = q + (v diag(k_g)) W_r^T in one product (its backward through the map above)
    if triton_ops.product_fits(limit):
        compiler.bound = triton_ops.PRODUCT_SHARED
        query, value = (tensor(BATCH, length, 3 * model_width, dtype=dtype)[..., :model_width] for _ in range(2))
        _backward(triton_ops.scaled_product_kernel(query, value, weight, scales[:BATCH]), query, value, weight, scales)
    else:
        compiler.torch_forms.append(f"scaled product {model_width} wide")


def compile_all(archs: list[int], widths: list[int], dtypes: list[torch.dtype], jobs: int = 1
                ) -> tuple[list[CompiledKernel], dict[int, list[str]]]:
    """(every distinct compiled kernel, per architecture what runs as the torch form instead).
    With `jobs` > 1, the (architecture, precision, head width) parts are shared among `jobs`
    processes (`_compile_parts`)."""
    from hf_zformer.modeling import triton_ops

    if not triton_ops.AVAILABLE:
        raise SystemExit("compile_kernels.py needs triton: pip install triton")
    parts = list(itertools.product(archs, dtypes, widths))
    if jobs > 1 and len(parts) > 1:
        try:
            return _compile_parts(parts, min(jobs, len(parts)))
        except RuntimeError as error:  # the processes, not a kernel (a kernel's compile error is a finding)
            print(f"{error}\ncompiling in this process instead", file=sys.stderr)
    results, torch_forms = [], {}
    for arch in archs:
        with KernelCompiler(arch) as compiler:
            drive_kernels(triton_ops, compiler, widths, dtypes)
        results += compiler.results
        torch_forms[arch] = sorted(set(compiler.torch_forms))
    return results, torch_forms


def _compile_share(parts, first: int, step: int, queue) -> None:
    """In a forked process: compiles parts[first::step], putting (index, kernels as dicts, torch
    forms) on `queue` for each, or (None, the error, None) where one fails."""
    try:
        for index in range(first, len(parts), step):
            arch, dtype, width = parts[index]
            results, torch_forms = compile_all([arch], [width], [dtype])
            queue.put((index, [asdict(kernel) for kernel in results], torch_forms[arch]))
    except BaseException:  # the parent raises it, rather than waiting for a part that never comes
        import traceback

        queue.put((None, traceback.format_exc(), None))


def _compile_parts(parts: list[tuple[int, torch.dtype, int]], jobs: int
                   ) -> tuple[list[CompiledKernel], dict[int, list[str]]]:
    """`compile_all` with the parts shared among `jobs` forked processes: a fork, not a fresh
    interpreter, so that each sees the modules as this process holds them (bounds set by a caller
    included), and nothing crosses but plain data. A kernel compiled by several parts (one that
    does not depend on the head width) is reported once, as in one process. RuntimeError where a
    process fails or ends before its parts are done (`compile_all` then compiles them itself)."""
    import multiprocessing
    from queue import Empty

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_compile_share, args=(parts, first, jobs, queue)) for first in range(jobs)]
    for worker in workers:
        worker.start()
    done = {}
    try:
        while len(done) < len(parts):
            try:
                index, kernels, forms = queue.get(timeout=5)
            except Empty:  # every worker flushes its parts before it ends: none alive, none to come
                if any(worker.is_alive() for worker in workers):
                    continue
                codes = sorted({worker.exitcode for worker in workers})
                raise RuntimeError(f"the compile processes ended (exit codes {codes}) with "
                                   f"{len(parts) - len(done)} of {len(parts)} parts not compiled") from None
            if index is None:
                raise RuntimeError(f"compiling in a worker process failed:\n{kernels}")
            done[index] = kernels, forms
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    results, torch_forms, seen = [], {}, set()
    for index, (arch, _, _) in enumerate(parts):
        kernels, forms = done[index]
        keys = [tuple(value for name, value in kernel.items() if name != "seconds") for kernel in kernels]
        results += [CompiledKernel(**kernel) for kernel, key in zip(kernels, keys) if key not in seen]
        seen.update(keys)
        torch_forms[arch] = sorted(set(torch_forms.get(arch, [])) | set(forms))
    return results, torch_forms


def report(results: list[CompiledKernel]) -> str:
    lines = ["| arch | kernel | dtype | constants | warps | stages | registers | spilled B "
             "| shared B (bound, limit) | programs/SM | compile s |", "|" + " --- |" * 11]
    for r in results:
        bound = "-" if r.bound is None else f"{r.bound:,}"
        shared = f"{r.shared_bytes:,} ({bound}, {r.shared_limit:,})"
        if r.shared_bytes > r.shared_limit or (r.bound is not None and r.shared_bytes > r.bound):
            shared += " OVER"
        spilled = "?" if r.spilled_bytes is None else f"{r.spilled_bytes}" + (" SPILLS" if r.spills else "")
        if r.error:
            lines.append(f"| sm_{r.arch} | {r.kernel} | {r.dtype} | {r.constants} | {r.num_warps} | {r.num_stages} "
                         f"| FAILED: {r.error} | | | | {r.seconds:.1f} |")
            continue
        lines.append(f"| sm_{r.arch} | {r.kernel} | {r.dtype} | {r.constants} | {r.num_warps} | {r.num_stages} "
                     f"| {r.registers if r.registers is not None else '?'} | {spilled} | {shared} "
                     f"| {r.programs_per_sm if r.programs_per_sm is not None else '?'} | {r.seconds:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(ARCHITECTURES),
                        help="compute capabilities to compile for, as major*10+minor (default: 80 90)")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 96, 128, 256],
                        help="head widths d (default: 32 64 96 128 256; 64/96/128 are the 8-head layers "
                             "512/768/1,024 wide); the pooling across heads runs at 8 d with 8 heads")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"],
                        help="input precisions (default: bf16 fp32)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--strict", action="store_true", help="fail on spilled registers too")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes compiling at once, sharing the (architecture, precision, head width) "
                             "parts (default: the CPU count; 1 compiles everything in this process)")
    args = parser.parse_args(argv)
    for width in args.widths:
        if width < 1:
            parser.error(f"--widths: {width} is not a positive head width")
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs} is not a positive number of processes")
    if args.json:
        from hf_zformer import folders

        try:  # before any work: no file of somebody else's is overwritten
            args.json = folders.check_output_files([args.json], name="--json")[0]
        except ValueError as error:
            parser.error(str(error))
    return args


def main(argv=None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (read when policy.py is first imported)
    args = parse_args(argv)
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[d] for d in args.dtypes]
    start = time.perf_counter()
    results, torch_forms = compile_all(args.arch, args.widths, dtypes, args.jobs)
    print(report(results))
    for arch, forms in torch_forms.items():
        if forms:
            print(f"\nsm_{arch}, the torch forms instead (tiles over the shared-memory bounds): {'; '.join(forms)}")
    failed = [r for r in results if r.fails]
    spilled = [r for r in results if r.spills]
    print(f"\n{len(results)} compiled kernels in {time.perf_counter() - start:.0f} s: {len(failed)} failed "
          f"(compile error, or shared memory over the GPU's limit or the family's bound), "
          f"{len(spilled)} spill registers")
    if args.json:
        import datetime

        import triton

        from benchmarks.harness import source_commit
        from hf_zformer import folders

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": "python scripts/compile_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": source_commit(), "date": datetime.date.today().isoformat(), "triton": triton.__version__,
            "torch": torch.__version__, "kernels": [asdict(r) for r in results],
            "torch_forms": {f"sm_{a}": f for a, f in torch_forms.items()},
        }, indent=1) + "\n")
        folders.record_files([args.json])
        print(f"wrote {args.json}")
    return 1 if failed or (args.strict and spilled) else 0


if __name__ == "__main__":
    sys.exit(main())
