"""Whether a call runs its Triton kernel (`kernel_applies`): where the execution policy
(`policy.py`) sends calls of the operation on that device to the kernels, checked against what this
machine can run (triton installed; CUDA, or its interpreter under `TRITON_INTERPRET=1`; a triton
recent enough), the dtypes the policy lists, the kernel's widths and the GPU's shared memory. A call
the kernels do not cover takes the torch form, the reason logged once at debug level
(`torch_form`); under the backend `triton` one that cannot run raises instead. The `ops_*.py`
modules ask it through their `*_path` functions, and so does `explain.py`.

This file ships to the Hugging Face Hub with every checkpoint: torch and siblings only.
"""

import torch
from transformers.utils import logging

from .policy import INTERPRETED as TRITON_INTERPRETED
from .policy import active
from .triton_launch import AVAILABLE as TRITON_AVAILABLE
from .triton_launch import RUNNABLE as TRITON_RUNNABLE
from .triton_launch import VERSION as TRITON_VERSION
from .triton_launch import shared_memory_limit, supported_width


logger = logging.get_logger(__name__)


_reported: set[str] = set()


def torch_form(reason: str) -> bool:
    if reason not in _reported:
        _reported.add(reason)
        logger.debug(f"hf_zformer kernels: the torch form runs ({reason})")
    return False


def interpreter_too_old() -> str:
    """Why the kernels cannot run here (`triton_launch.RUNNABLE` false): the interpreter's version, and the remedy."""
    version = ".".join(map(str, TRITON_VERSION))
    return (f"triton {version}'s interpreter (TRITON_INTERPRET=1) cannot run the kernels; from triton 3.7 on "
            "it can (pip install 'triton>=3.7')")


def kernel_applies(operation: str, *tensors: torch.Tensor, width_ok=supported_width, fits=None) -> bool:
    """Whether `operation` runs its Triton kernel on these inputs: where the policy sends calls on
    their device to the kernels (`policy.Policy.kernels_wanted`), in its dtypes, with `width_ok` of
    each last dimension, and `fits(limit)` of the kernel's tiles against the GPU's shared memory
    (`triton_launch.shared_memory_limit`); `False` means the torch form, with the reason logged once at
    debug level. The tensors may be anything with a device, a dtype and a shape (`explain.py`)."""
    policy = active()
    device = tensors[0].device
    if not policy.kernels_wanted(device.type, operation):
        return False  # the torch forms are the device's own
    forced = policy.backend == "triton"
    if not TRITON_AVAILABLE:
        if forced:
            raise RuntimeError("HF_ZFORMER_KERNELS=triton: triton is not installed (pip install triton)")
        return torch_form("triton is not installed")
    if device.type != "cuda" and not TRITON_INTERPRETED:
        raise RuntimeError(f"HF_ZFORMER_KERNELS=triton on a {device.type} tensor: the kernels need CUDA, or "
                           "TRITON_INTERPRET=1 set before the first import to run them on the CPU")
    if not TRITON_RUNNABLE:
        if forced:
            raise RuntimeError(f"HF_ZFORMER_KERNELS=triton: {interpreter_too_old()}")
        return torch_form(interpreter_too_old())
    dtypes = policy.pool_kernel_dtypes if operation == "direction_pool" else policy.kernel_dtypes
    if any(t.dtype not in dtypes for t in tensors):
        return torch_form(f"{operation} in {tensors[0].dtype}")
    if not all(width_ok(t.shape[-1]) for t in tensors):
        return torch_form(f"{operation} with widths {sorted({t.shape[-1] for t in tensors})}")
    if fits is not None and not fits(shared_memory_limit(device)):
        return torch_form(f"{operation} with widths {sorted({t.shape[-1] for t in tensors})}: no shared-memory "
                           f"bound of its kernel's tiles fits {device}")
    return True
