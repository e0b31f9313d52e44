"""What the Triton kernel families share (`triton_linear_attention.py`, `triton_pooling.py`,
`triton_shared_pool.py`, `triton_prefix_pool.py`, `triton_product.py`): whether the kernels can
run here (`AVAILABLE`, `RUNNABLE`), the GPU's shared memory and the bounds each family's tiles are
checked against, tiles and launch options, the jit helpers every family loads rows with, and the
custom-op registration that makes each family an operator inside torch.compile and under Python
dispatch modes (`register_family`).

Inputs are read where they lie (the head views of the projections, any strides, bf16/fp16/fp32; a
mask of any dtype) and every sum over the sequence runs in fp32; outputs come back in the inputs'
dtype, laid out (B, N, H, d) so that merging the heads is a view. Sums run over fixed tiles and
slices in sequence order, and padding's rows add exact zeros, so outputs at real positions do not
change, bit for bit, when padding is appended.

The kernel modules do no dispatch: `ops.py` decides when they run, by the execution policy
(`policy.py`). This file ships to the Hugging Face Hub with every checkpoint and imports where
triton is not installed (`AVAILABLE` is then False and no kernel may be called); with
`TRITON_INTERPRET=1` the kernels run on the CPU (triton 3.7 or later: `RUNNABLE`), which is how the
tests check them without a GPU. The Triton interpreter (`policy.INTERPRETED`) multiplies 16-bit
tiles wrongly (numpy has no bf16 product): the kernels take the fp32 product of the same tiles
there, as fp32 inputs do anyway.
"""

import re

import torch

from .policy import INTERPRETED, active

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch forms of ops.py run instead
    triton = tl = None

AVAILABLE = triton is not None

# the log-sum-exp of an online softmax before any real score (finite: no NaN)
FLOOR = -1.0e38

# triton's interpreter before 3.7 stops at a loop bound computed inside a kernel (it asks an integer
# of a one-element array), and every sequence loop here has one: interpreted, the kernels need 3.7.
INTERPRETER_MINIMUM = (3, 7)
VERSION = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) if AVAILABLE else None
RUNNABLE = AVAILABLE and not (INTERPRETED and VERSION < INTERPRETER_MINIMUM)

if AVAILABLE:
    # the running maximum of an online softmax before any real score (finite: no NaN); a constexpr,
    # the only kind of global a compiled kernel may read
    FLOOR_CONSTANT = tl.constexpr(FLOOR)

    @triton.jit
    def kept(M, smb, smn, b, rows, length, HAS_MASK: tl.constexpr):
        """Which of `rows` are real tokens of sequence b (inside the length, mask != 0)."""
        keep = rows < length
        if HAS_MASK:
            keep = keep & (tl.load(M + b * smb + rows * smn, mask=keep, other=0) != 0)
        return keep

    @triton.jit
    def load_tile(X, rows, keep, columns, width, sxn, sxd):
        """The tile X[rows, columns] (zero outside `keep` and the width) of one (sequence, head)."""
        return tl.load(X + rows[:, None] * sxn + columns[None, :] * sxd,
                       mask=keep[:, None] & (columns[None, :] < width), other=0.0)
else:
    FLOOR_CONSTANT = kept = load_tile = None


# Rows per tile, and rows per slice of a split sum over the sequence: a fixed slice (whatever the
# length) keeps every real row in the same tile and slice when padding is appended.
BLOCK_N = 64
_CHUNK = 512


_multiprocessors: dict = {}


def fused(pairs: int, device: torch.device) -> bool:
    """Whether `pairs` (sequence, head) pairs fill the device with one program each: from the
    policy's `fused_min_pairs` pairs, or where unset the GPU's number of multiprocessors (the
    interpreter: always)."""
    least = active().fused_min_pairs
    if least is not None:
        return pairs >= least
    if device.type != "cuda":
        return True
    if device not in _multiprocessors:
        _multiprocessors[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return pairs >= _multiprocessors[device]


def supported_width(width: int) -> bool:
    """Head widths the kernels take: up to 256 (one tile per head)."""
    return 1 <= width <= 256


# Shared memory one program may ask for (the opt-in maximum of a block), by compute capability,
# where triton's driver does not say (NVIDIA's CUDA C++ Programming Guide, technical specifications).
SHARED_MEMORY_BY_CAPABILITY = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448}
_shared_memory: dict = {}


@torch.compiler.assume_constant_result  # inside torch.compile: asked once while tracing, not a graph break
def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on `device` (None where there is no limit: the
    interpreter)."""
    if INTERPRETED or device.type != "cuda":
        return None
    if device not in _shared_memory:
        if not torch.cuda.is_available():  # a GPU this machine lacks (`explain.py` asks): no limit known
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            limit = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
        except Exception:  # a driver without the query: the capability's limit, or the smallest known
            limit = SHARED_MEMORY_BY_CAPABILITY.get(torch.cuda.get_device_capability(index),
                                                    min(SHARED_MEMORY_BY_CAPABILITY.values()))
        _shared_memory[device] = limit
    return _shared_memory[device]


def bound(bounds, tile: int) -> int | None:
    """The shared memory a family with `bounds` asks for at `tile`, or None past its largest tile."""
    return next((size for largest, size in bounds if tile <= largest), None)


def fits(needed: int | None, limit: int | None) -> bool:
    return needed is not None and (limit is None or needed <= limit)


def tile(width: int) -> int:
    """A width padded to a tile: a power of two, at least 16 (the smallest matrix-product tile)."""
    return max(16, triton.next_power_of_2(width))


def slices(length: int) -> tuple[int, int]:
    """(number of slices, rows per slice) of a split sum over the sequence."""
    return max(1, triton.cdiv(length, _CHUNK)), _CHUNK


def heads_last(batch: int, heads: int, length: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, N, width) tensor stored as (B, N, H, width): merging its heads is a view."""
    return torch.empty(batch, length, heads, width, dtype=like.dtype, device=like.device).transpose(1, 2)


def mask_arguments(mask: torch.Tensor | None, x: torch.Tensor):
    """(mask pointer, its two strides, HAS_MASK): the (B, N) mask as it is (any dtype), or a dummy."""
    if mask is None:
        return x, 0, 0, False
    return mask, mask.stride(0), mask.stride(1), True


def launch_options(*widths: int) -> dict:
    """Warps and pipeline stages of a launch: wide tiles (128 columns and up: 1,024 wide with 8
    heads, a feature map's 2 d) take 8 warps and two stages, or the staged tiles outgrow the largest
    shared memory a program may have (237,568 bytes asked against sm_90's 232,448 at three stages)."""
    if max(tile(w) for w in widths) >= 128:
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 4, "num_stages": 3}


def dot_fp32(*tensors: torch.Tensor) -> bool:
    return INTERPRETED or any(t.dtype == torch.float32 for t in tensors)


try:  # whether a Python dispatch mode is active: torch's own Python helper, no C-level state
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode
except ImportError:  # a torch without it: no mode is seen, the kernels launch as before
    def is_in_torch_dispatch_mode() -> bool:
        return False


def as_operators() -> bool:
    """Whether a call runs as its operators (`OPERATORS`) rather than as an autograd function that
    launches the kernels itself: inside torch.compile, and under a Python dispatch mode (a counter
    of operations or memory traffic, `torch.utils.flop_counter`, fake tensors, selective activation
    checkpointing), which would not see the kernels' launches but sees an operator's inputs and
    outputs, and runs its fake implementation where tensors hold no data."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def needs_graph(*tensors) -> bool:
    """Whether a call must record its backward (the host time of an autograd node is worth saving
    where launches, not the GPU, bound the time: inference on short inputs)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def sequences_per_tile(batch: int, most: int) -> int:
    """Sequences one tile of a kernel walking the batch takes: the batch rounded up to a power of
    two, at most `most` (a power of two), at least 1."""
    return max(1, min(triton.next_power_of_2(batch), most))


# ----------------------------------------------------------------------------------------------
# torch.compile: each kernel family as an operator
# ----------------------------------------------------------------------------------------------
# Inside torch.compile the public functions above call operators (`torch.library.custom_op`) that
# the compiler does not trace into: the forward and the backward of each family are an operator
# each, running the same launches as an eager call, and a fake implementation of each tells the
# compiler its outputs' shapes, dtypes and strides. Compiled graphs (inductor's CUDA graphs of
# `mode="reduce-overhead"` included) then launch the kernels as they are. So do calls under a
# Python dispatch mode (`as_operators`), which sees each operator whole. Other eager calls keep
# the autograd functions: an operator's dispatch costs more host time per call, and eager calls
# on short inputs are bound by host time.

Tensor = torch.Tensor


def operator_namespace() -> str:
    """The namespace of this copy's operators (`torch.ops.<namespace>`, every family's), named after
    the folder: the installed package and a checkpoint's copy of it (`trust_remote_code`) register
    their own."""
    return re.sub(r"[^0-9A-Za-z_]", "_", __name__.rpartition(".")[0] + "_kernels")


def save_all(ctx, inputs, output):
    """Saves the tensor inputs (None included) and the outputs, and the flags and numbers (a
    scale) aside, in order; the last output
    (a state or a log-sum-exp) takes no gradient, and none is made for it: without
    `set_materialize_grads(False)` autograd would fill a tensor of zeros for it before every
    backward (one more kernel launch each on a GPU), which the backward never reads."""
    ctx.save_for_backward(*(x for x in inputs if not isinstance(x, (bool, float))), *output)
    ctx.mark_non_differentiable(output[-1])
    ctx.set_materialize_grads(False)
    ctx.flags = [x for x in inputs if isinstance(x, (bool, float))]


def custom_op(name: str, function, fake):
    """`function` as the operator `name` of this copy's namespace (with a numbered namespace where a
    torch that refuses to redefine an operator already holds that name: a module executed again)."""
    for attempt in range(100):
        namespace = operator_namespace() + (f"_{attempt}" if attempt else "")
        try:
            operator = torch.library.custom_op(f"{namespace}::{name}", function, mutates_args=())
        except RuntimeError:
            continue
        operator.register_fake(fake)
        return operator
    raise RuntimeError(f"hf_zformer: no free namespace for the operator {name} of {__name__}")


def register_family(name: str, forward, fake, backward, grads, fake_grads) -> dict:
    """A kernel family's operators: the forward `name` (with its fake implementation), whose backward
    (`backward`, the saved inputs and outputs as `save_all` keeps them) calls the gradient operator
    `<name>_grads`; {name: operator} of both."""
    operator = custom_op(name, forward, fake)
    operator.register_autograd(backward, setup_context=save_all)
    return {name: operator, f"{name}_grads": custom_op(f"{name}_grads", grads, fake_grads)}
