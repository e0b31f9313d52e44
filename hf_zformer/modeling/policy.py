"""The execution policy: which form of each operation runs, by device type, dtype and width.

One frozen table (`Policy`) holds every choice the modules and the sequence operations make about
their code path, with every threshold and device list those choices read; nothing else in this
folder keeps a switch. The forms an operation can take:

- `torch`: the plain torch form (every device and dtype, fp64 included; the reference);
- `folded`: a bidirectional module's folded form (one (D, D) map per sequence, no Q, K, V), the
  CPU's form of long inputs (`attention.use_folded_form`);
- `triton`: a fused Triton kernel (the `triton_*.py` families), on CUDA tensors in fp32/bf16 (fp16 for the
  poolings) where triton is installed;
- `fla`: flash-linear-attention's chunked kernel for causal linear attention (`pip install
  hf_zformer[gpu]`).

The operations and the entries that decide them:

| operation | entries |
|---|---|
| linear attention, bidirectional | `backend`, `kernel_devices`, `kernel_dtypes` |
| linear attention, causal | `backend`, `fla_devices`, `zformer_causal_block` |
| direction pooling | `backend`, `kernel_devices`, `pool_kernel_dtypes`, `gate_in_kernel` |
| shared direction pooling (folded fastformer) | the same, and `shared_pool_fp32` |
| causal softmax (prefix) pooling | `backend`, `kernel_devices`, `fastformer_causal_quadratic` |
| column scaling W diag(k) | `backend`, `kernel_devices`, `kernel_dtypes` |
| any of the kernels above | `plain_operations` (the torch form under `auto`) |
| fused column-scaled product | `experimental.fused_product` (see `Experimental`) |
| stacked q/k/v projection | `stacked_projection` |
| folded form (fp32, and under autocast) | `folded`, `folded_autocast` |
| fastformer's pooled output | `pooled_output` |
| few-row projections of the opt-in CPU layers | `few_rows` |

`backend` is the coarse switch: `auto` (every fast form where the table allows it), `torch` (plain
torch everywhere: the reference to compare with) or `triton` (as `auto`, but the kernels wherever
they can run, also on CPU tensors under `TRITON_INTERPRET=1`, as the tests run them). It starts
from the environment variable `HF_ZFORMER_KERNELS` (read at import), and `set_kernel_backend` /
`use_kernel_backend` change it. Every other entry changes through `use_policy`, the one way to
compare forms (an A/B): `with use_policy(stacked_projection=()): model(**batch)`.
`explain.explain(model, inputs)` reports the path each attention layer's operations take.

A call the table sends to a kernel the kernel cannot take (a state, fp64, a width past its tiles,
too little shared memory) takes the torch form, the reason logged once at debug level (`ops.py`).

This file ships to the Hugging Face Hub with every checkpoint: torch and stdlib only.
"""

import contextlib
import dataclasses
import os

import torch

KERNEL_BACKENDS = ("auto", "torch", "triton")
FORMS = ("torch", "folded", "triton", "fla")
# the operations with a kernel, as `ops.py` names them to the policy
KERNEL_OPERATIONS = ("linear_attention", "causal linear_attention", "direction_pool", "prefix_pool", "column_scale",
                     "scaled_product")

# `TRITON_INTERPRET=1` (read at import, as triton reads it): the kernels run through triton's
# interpreter, on CPU tensors too.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _devices(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclasses.dataclass(frozen=True)
class Experimental:
    """Kernels that no measurement has chosen: off every default path, taken only where an entry
    here names a device type (or under the backend `triton`, which forces every kernel). They stay
    in the library to be timed (`docs/bench/ab/fastformer_gpu.py`, whose variants turn them on
    through `use_policy`).

    - `fused_product`: device types on which `ops.column_scaled_product` takes its fused kernel
      (`triton_product.scaled_product_kernel`) for 16-bit rows under `auto`; elsewhere it is one batched
      product over the (B, O, I) map `column_scaled` forms.
    - `product_tiles`: that kernel's (rows, outputs, inner width, warps, pipeline stages) for
      16-bit rows.
    """

    fused_product: tuple[str, ...] = ()
    product_tiles: tuple[int, int, int, int, int] = (128, 128, 64, 8, 3)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The table (module docstring). Fields:

    - `backend`: 'auto', 'torch' or 'triton' (`HF_ZFORMER_KERNELS`).
    - `kernel_devices`: device types on which `auto` runs the Triton kernels; elsewhere the torch
      forms are the device's own.
    - `plain_operations`: kernel operations (`KERNEL_OPERATIONS`) that keep their torch form under
      `auto` even there (an A/B against the kernel; `triton` still forces them).
    - `kernel_dtypes`: dtypes the kernels take; `pool_kernel_dtypes`: the bidirectional poolings'
      (fp16 too: their result is fp32, where an fp16 attention output could overflow).
    - `shared_pool_fp32`: whether fp32 rows of the shared pooling (folded fastformer) take the
      kernel under `auto` (its products would run exactly on CUDA cores; the torch form's batched
      products are the faster there); `triton` takes it anyway.
    - `fla_devices`: device types on which causal linear attention takes fla's chunked kernel.
    - `gate_in_kernel`: whether the key pooling's gate q_g is applied inside the pooling kernel
      (false: the two products outside it, the form before the gated kernel).
    - `stacked_projection`: device types on which `blocks.project` stacks the projections of one
      input into one product (a cast and a launch each saved on a GPU; nothing gained on a CPU).
    - `folded`: whether bidirectional Zformer/Fastformer take their folded form where it does fewer
      FLOPs (fp32/fp64 inputs outside autocast).
    - `folded_autocast`: (attention type, device types) pairs: where a type takes its folded form
      under bf16 autocast too; a module's own `folded_autocast_devices`, where set, overrides it.
    - `pooled_output`: whether bidirectional fastformer from N >= D (where the folded form is not
      taken) computes W_r and the residual as one batched product per sequence.
    - `zformer_causal_block`: Zformer's causal form runs in blocks of this many tokens (quadratic
      inside a block, recurrent across blocks: autograd keeps O(N block)); inputs up to one block
      without a state take the quadratic form alone.
    - `fastformer_causal_quadratic`: Fastformer's causal poolings without a state take a softmax
      over the (N, N) causal pattern up to this many tokens (four operations where the prefix sums
      take ten); its 2 N^2 D FLOPs per pooling are N / D of one D x D projection's.
    - `fused_min_pairs`: linear attention's kernel runs one program per (sequence, head) pair
      (fused) from this many pairs; None: the GPU's number of multiprocessors (interpreted: always).
    - `pool_chunk`: rows per program of the bidirectional pooling kernels (a positive multiple of
      64, fixed so padding keeps every real row in its slice), or None for one program per pair
      where the pairs fill the GPU. Short slices put many programs' loads in flight at once.
    - `paired_shared_backward`: whether the shared pooling's backward holds each direction and its
      gradient in one tile where they fit (up to 8 heads).
    - `few_rows`: inputs of 1 to this many fp32 rows take the transposed product in the opt-in CPU
      layers (`hf_zformer.cpu_speedups.FewRowsLinear`, outside this folder); 0 turns that rule off,
      and None leaves the choice to that module (from the CPU vendor). Nothing in this folder reads it.
    - `experimental`: `Experimental`.
    """

    backend: str = "auto"
    kernel_devices: tuple[str, ...] = ("cuda",)
    plain_operations: tuple[str, ...] = ()
    kernel_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    pool_kernel_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    shared_pool_fp32: bool = False
    fla_devices: tuple[str, ...] = ("cuda",)
    gate_in_kernel: bool = True
    stacked_projection: tuple[str, ...] = ("cuda",)
    folded: bool = True
    folded_autocast: tuple[tuple[str, tuple[str, ...]], ...] = (("zformer", ("cpu",)), ("fastformer", ("cpu",)))
    pooled_output: bool = True
    zformer_causal_block: int = 64
    fastformer_causal_quadratic: int = 64
    fused_min_pairs: int | None = None
    pool_chunk: int | None = 128
    paired_shared_backward: bool = True
    few_rows: int | None = None
    experimental: Experimental = Experimental()

    def __post_init__(self):
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel backend {self.backend!r}: choose one of {', '.join(KERNEL_BACKENDS)}")
        if self.few_rows is not None and (not isinstance(self.few_rows, int) or self.few_rows < 0):
            raise ValueError(f"few_rows={self.few_rows!r}: a number of rows (0 turns the rule off) or None")

    def kernels_wanted(self, device_type: str, operation: str = "") -> bool:
        """Whether the backend sends calls of `operation` on `device_type` to their kernel at all."""
        backend = self.backend
        return backend == "triton" or (
            backend == "auto" and device_type in self.kernel_devices and operation not in self.plain_operations
        )

    def folded_autocast_devices(self, attention_type: str) -> tuple[str, ...]:
        """The device types on which `attention_type` takes its folded form under bf16 autocast."""
        return next((devices for kind, devices in self.folded_autocast if kind == attention_type), ())

    def stacks(self, device_type: str) -> bool:
        """Whether the projections of one input on `device_type` may run as one stacked product."""
        return self.backend != "torch" and device_type in self.stacked_projection

    def fused_product_wanted(self, device_type: str, dtype: torch.dtype) -> bool:
        """Whether `column_scaled_product` asks for its fused kernel (an experimental one)."""
        if self.backend == "triton":
            return True
        return self.backend == "auto" and device_type in self.experimental.fused_product and dtype != torch.float32

    def replaced(self, **changes) -> "Policy":
        """This policy with `changes`: any field, an `Experimental` field by its own name, and
        `folded_autocast` as a {type: devices} mapping merged into the pairs."""
        experimental = {name: changes.pop(name) for name in list(changes)
                        if name in Experimental.__dataclass_fields__}
        if experimental:
            changes["experimental"] = dataclasses.replace(changes.get("experimental", self.experimental),
                                                          **_tuples(experimental))
        if isinstance(changes.get("folded_autocast"), dict):
            merged = dict(self.folded_autocast)
            merged.update({kind: _devices(devices) for kind, devices in changes["folded_autocast"].items()})
            changes["folded_autocast"] = tuple(merged.items())
        return dataclasses.replace(self, **_tuples(changes))


_DEVICE_LISTS = {"kernel_devices", "plain_operations", "fla_devices", "stacked_projection", "fused_product"}


def _tuples(changes: dict) -> dict:
    """Device lists given as a string or a list, as tuples."""
    return {name: _devices(value) if name in _DEVICE_LISTS else value for name, value in changes.items()}


def _environment_backend() -> str:
    name = os.environ.get("HF_ZFORMER_KERNELS", "auto").strip().lower() or "auto"
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"HF_ZFORMER_KERNELS={name!r}: choose one of {', '.join(KERNEL_BACKENDS)}")
    return name


DEFAULT = Policy(backend=_environment_backend())
_active = DEFAULT


def active() -> Policy:
    """The policy in force."""
    return _active


def set_policy(policy: Policy) -> Policy:
    """Put `policy` in force for this process; returns the previous one, to restore it."""
    global _active
    if not isinstance(policy, Policy):
        raise TypeError(f"set_policy: a Policy, not {type(policy).__name__}")
    previous, _active = _active, policy
    return previous


@contextlib.contextmanager
def use_policy(policy: Policy | None = None, **changes):
    """Within a `with` block, `policy` (default: the one in force) with `changes` (`Policy.replaced`),
    restored on exit, e.g. `with use_policy(fused_product=("cuda",)):` or `with
    use_policy(stacked_projection=(), folded_autocast={"fastformer": ()}):`. Yields the policy."""
    chosen = (policy or _active).replaced(**changes)
    previous = set_policy(chosen)
    try:
        yield chosen
    finally:
        set_policy(previous)


def kernel_backend() -> str:
    """The backend in force ('auto', 'torch' or 'triton')."""
    return _active.backend


def set_kernel_backend(name: str) -> str:
    """Choose the backend for this process: 'auto', 'torch' or 'triton' (module docstring). Returns
    the previous choice, to restore it."""
    previous = _active.backend
    set_policy(_active.replaced(backend=name))
    return previous


@contextlib.contextmanager
def use_kernel_backend(name: str):
    """`set_kernel_backend(name)` for the duration of a `with` block, e.g. to time or check the plain
    torch forms against the fast ones: `with use_kernel_backend("torch"): model(**batch)`."""
    previous = set_kernel_backend(name)
    try:
        yield
    finally:
        set_kernel_backend(previous)
