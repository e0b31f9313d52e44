"""Fastformer's column-scaled products in their torch forms (`ops.py` gathers the names):

- `column_scaled(weight, scales, dtype)`, (B, O, I) = weight diag(scales[b]) (W_r diag(k_g)); on
  CUDA one kernel whose backward reads the output's gradient once (`triton_product.py`).
- `column_scaled_product(base, rows, weight, scales)`: base + (rows diag(scales[b])) weight^T, the
  batched product over that map, or one fused kernel that forms no map (an experimental one: the
  policy's `experimental.fused_product`).

Their paths: `column_scaled_path`, `column_scaled_product_path`.

This file ships to the Hugging Face Hub with every checkpoint: torch and siblings only.
"""

import torch

from .dispatch import kernel_applies
from .policy import active
from .triton_product import column_scale_kernel, product_fits, scaled_product_kernel


def column_scaled(weight, scales, dtype: torch.dtype):
    """weight (O, I) with its columns scaled per sequence, (B, O, I) = weight diag(scales[b]) for
    scales (B, I), in `dtype` (Fastformer's W_r diag(k_g)). On CUDA one kernel (`column_scale_kernel`:
    each product in fp32, rounded once; the backward reads the output's gradient once for both
    gradients); else the weight and the scales cast to `dtype` and multiplied (five passes over
    (B, O, I) in the backward where the kernel makes one)."""
    if column_scaled_path(weight, scales) == "triton":
        return column_scale_kernel(weight, scales, dtype)
    return weight.to(dtype) * scales.to(dtype)[:, None, :]


def column_scaled_path(weight, scales) -> str:
    """The path `column_scaled` takes: 'triton' or 'torch'."""
    return "triton" if kernel_applies("column_scale", weight, scales, width_ok=lambda width: width >= 1) else "torch"


def column_scaled_product(base, rows, weight, scales):
    """(B, N, O) = base + (rows diag(scales[b])) weight^T per sequence, in rows' dtype, for rows and
    base (B, N, I) and (B, N, O), weight (O, I) and scales (B, I) (Fastformer's r = q + W_r (k_g * v)).
    The torch form is one batched product whose accumulator starts from base, over the map
    `column_scaled(weight, scales)` (B, O, I); the fused kernel (`scaled_product_kernel`, an
    experimental one: 16-bit rows under `auto` on the device types of the policy's
    `experimental.fused_product`, none by default) scales the rows as it loads them and writes no
    map: a (B, O, I) write and read fewer, forward."""
    if column_scaled_product_path(base, rows, weight, scales) == "triton":
        return scaled_product_kernel(base, rows, weight, scales)
    return torch.baddbmm(base, rows, column_scaled(weight, scales, rows.dtype).transpose(1, 2))


def column_scaled_product_path(base, rows, weight, scales) -> str:
    """The path `column_scaled_product` takes: 'triton' (the fused kernel) or 'torch' (a batched
    product over the map `column_scaled` forms, whose own path is `column_scaled_path`)."""
    return "triton" if _product_kernel_applies(base, rows, weight, scales) else "torch"


def _product_kernel_applies(base, rows, weight, scales) -> bool:
    if not active().fused_product_wanted(rows.device.type, rows.dtype):
        return False
    return base.dtype == rows.dtype and kernel_applies("scaled_product", rows, base, weight, scales,
                                                        width_ok=lambda width: width >= 1, fits=product_fits)
