"""Fastformer's column-scaled products as fused Triton kernels:

- `column_scale_kernel(weight, scales, dtype)`: W_r diag(k_g) per sequence, each product in fp32
  rounded once (`_column_scale`); the backward reads the output's gradient once for the weight's
  gradient (summed over the batch in a fixed order) and the scales' (`_column_scale_backward`).
- `scaled_product_kernel(base, rows, weight, scales)`: r = q + (v diag(k_g)) W_r^T per sequence
  as one matrix product (`_scaled_product`): the rows scaled as they are loaded, the accumulator
  starting from q's tile, no (B, D, D) map written or read; its backward goes through the map.
  An experimental kernel: the policy takes it on no default path (`policy.Experimental`).

`ops.column_scaled` and `ops.column_scaled_product` dispatch. Operators: `OPERATORS`.

This file ships to the Hugging Face Hub with every checkpoint and imports where triton is not
installed (`triton_launch.AVAILABLE` is then False and nothing here may be called)."""

import types

import torch

from .policy import INTERPRETED, active
from .triton_launch import (
    AVAILABLE,
    Tensor,
    as_operators,
    custom_op,
    fits,
    needs_graph,
    sequences_per_tile,
    tile,
    tl,
    triton,
)

if AVAILABLE:

    @triton.jit
    def _column_scale(W, K, OUT, rows, cols, BO: tl.constexpr, BI: tl.constexpr):
        """One (BO, BI) tile of sequence b's OUT[b] = W diag(K[b]), the product in fp32, rounded once
        to OUT's dtype (W (rows, cols) and K (B, cols) contiguous)."""
        ob, ib, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ro, ri = ob * BO + tl.arange(0, BO), ib * BI + tl.arange(0, BI)
        inside = (ro[:, None] < rows) & (ri[None, :] < cols)
        tile = ro[:, None] * cols + ri[None, :]
        w = tl.load(W + tile, mask=inside, other=0.0).to(tl.float32)
        k = tl.load(K + b * cols + ri, mask=ri < cols, other=0.0).to(tl.float32)
        tl.store(OUT + b.to(tl.int64) * rows * cols + tile, (w * k[None, :]).to(OUT.dtype.element_ty), mask=inside)

    @triton.jit
    def _column_scale_backward(G, W, K, GW, GK, batch, rows, cols, sgb, sgo, sgi,
                               BO: tl.constexpr, BI: tl.constexpr, BB: tl.constexpr):
        """For one (BO, BI) tile, over the batch BB sequences at a time (their loads in flight
        together; the sum in a fixed order): dW = sum_b G[b] diag(K[b]), and this tile's share of dK[b] =
        sum_o G[b] * W (GK (row tiles, B, cols), summed over the tiles after)."""
        ob, ib = tl.program_id(0), tl.program_id(1)
        ro, ri, rb = ob * BO + tl.arange(0, BO), ib * BI + tl.arange(0, BI), tl.arange(0, BB)
        inside = (ro[:, None] < rows) & (ri[None, :] < cols)
        w = tl.load(W + ro[:, None] * cols + ri[None, :], mask=inside, other=0.0).to(tl.float32)
        grad_w = tl.zeros((BO, BI), dtype=tl.float32)
        tile_g = G + ro[:, None] * sgo + ri[None, :] * sgi
        for first in range(0, batch, BB):
            b = first + rb
            columns = (b[:, None] < batch) & (ri[None, :] < cols)  # (BB, BI)
            g = tl.load(tile_g[None, :, :] + b.to(tl.int64)[:, None, None] * sgb,  # 64-bit: B D^2 may pass 2^31
                        mask=(b[:, None, None] < batch) & inside[None, :, :], other=0.0).to(tl.float32)
            k = tl.load(K + b[:, None] * cols + ri[None, :], mask=columns, other=0.0).to(tl.float32)
            grad_w += tl.sum(g * k[:, None, :], axis=0)
            tl.store(GK + (ob * batch + b[:, None]) * cols + ri[None, :], tl.sum(g * w[None, :, :], axis=1),
                     mask=columns)
        tl.store(GW + ro[:, None] * cols + ri[None, :], grad_w, mask=inside)

    @triton.jit
    def _scaled_product(V, K, W, Q, OUT, length, outs, ins, svb, svn, svi, sqb, sqn, sqo,
                        BM: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, EXACT: tl.constexpr):
        """One (BM, BO) tile of sequence b's OUT[b] = Q[b] + (V[b] diag(K[b])) W^T: the rows of V
        scaled by K on load and rounded once to V's dtype (as the product u = k_g * v would be), W
        read in its own dtype and rounded to V's, the product summed in fp32 from Q's tile (in
        fp32 on CUDA cores where EXACT: fp32 inputs, and the interpreter, whose 16-bit products are
        wrong), rounded once to OUT's dtype (W (outs, ins), K (B, ins) and OUT contiguous)."""
        tile, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # 64-bit: B N D may pass 2^31
        row_tiles = tl.cdiv(length, BM)
        rm, ro = (tile % row_tiles) * BM + tl.arange(0, BM), (tile // row_tiles) * BO + tl.arange(0, BO)
        rows, columns = rm < length, ro < outs
        acc = tl.load(Q + b * sqb + rm[:, None] * sqn + ro[None, :] * sqo, mask=rows[:, None] & columns[None, :],
                      other=0.0).to(tl.float32)
        for first in range(0, ins, BI):
            ri = first + tl.arange(0, BI)
            inner = ri < ins
            v = tl.load(V + b * svb + rm[:, None] * svn + ri[None, :] * svi, mask=rows[:, None] & inner[None, :],
                        other=0.0)
            k = tl.load(K + b * ins + ri, mask=inner, other=0.0).to(tl.float32)
            u = (v.to(tl.float32) * k[None, :]).to(V.dtype.element_ty)
            w = tl.load(W + ro[None, :] * ins + ri[:, None], mask=inner[:, None] & columns[None, :],
                        other=0.0).to(V.dtype.element_ty)  # (BI, BO): W^T's tile
            if EXACT:
                acc += tl.dot(u.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(u, w)
        tl.store(OUT + (b * length + rm[:, None]) * outs + ro[None, :], acc.to(OUT.dtype.element_ty),
                 mask=rows[:, None] & columns[None, :])


# the scaled product: its fixed tiles, whatever the widths (`policy.Experimental.product_tiles`)
PRODUCT_SHARED = 115_200


# Tile of the column scaling (`column_scale_kernel`): 32 x 32 gives a 512-wide layer's weight 256
# programs, each walking the batch in its backward, `SCALE_BATCH` sequences at a time (one at a
# time, ptxas kept one tile's load in flight: 40 loads one after another at batch 40).
_SCALE_BLOCK = 32
SCALE_BATCH = 4


def _column_scale_forward(weight, scales, dtype: torch.dtype) -> torch.Tensor:
    """(B, O, I) = weight (O, I) diag(scales[b]) in `dtype`."""
    weight, scales = weight.contiguous(), scales.contiguous()
    (rows, cols), batch = weight.shape, scales.shape[0]
    out = torch.empty(batch, rows, cols, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(rows, _SCALE_BLOCK), triton.cdiv(cols, _SCALE_BLOCK), batch)
    _column_scale[grid](weight, scales, out, rows, cols, BO=_SCALE_BLOCK, BI=_SCALE_BLOCK)
    return out


def _column_scale_grads(grad, weight, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """(dweight, dscales) of `_column_scale_forward`, summed in fp32 and returned in the operands'
    dtypes, from the output's gradient (any strides)."""
    weight, scales = weight.contiguous(), scales.contiguous()
    (rows, cols), batch = weight.shape, scales.shape[0]
    tiles = triton.cdiv(rows, _SCALE_BLOCK)
    grad_weight = torch.empty(rows, cols, dtype=torch.float32, device=weight.device)
    shares = torch.empty(tiles, batch, cols, dtype=torch.float32, device=weight.device)
    _column_scale_backward[(tiles, triton.cdiv(cols, _SCALE_BLOCK))](
        grad, weight, scales, grad_weight, shares, batch, rows, cols, *grad.stride(), BO=_SCALE_BLOCK,
        BI=_SCALE_BLOCK, BB=sequences_per_tile(batch, SCALE_BATCH),
    )
    grad_scales = shares[0] if tiles == 1 else shares.sum(0)
    return grad_weight.to(weight.dtype), grad_scales.to(scales.dtype)


class _ColumnScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scales, dtype):
        ctx.save_for_backward(weight, scales)
        return _column_scale_forward(weight, scales, dtype)

    @staticmethod
    def backward(ctx, grad):
        return *_column_scale_grads(grad, *ctx.saved_tensors), None


def column_scale_kernel(weight, scales, dtype: torch.dtype) -> torch.Tensor:
    """`ops.column_scaled`: (B, O, I) = weight (O, I) diag(scales[b]) for scales (B, I), each
    element's product in fp32 rounded once to `dtype`; the backward reads the output's gradient
    once for both gradients (the weight's summed over the batch in a fixed order)."""
    if as_operators():
        return OPERATORS.column_scale(weight, scales, dtype)
    if needs_graph(weight, scales):
        return _ColumnScale.apply(weight, scales, dtype)
    return _column_scale_forward(weight, scales, dtype)


# Tiles of the scaled product (`scaled_product_kernel`) where fp32 rows make the products exact on
# CUDA cores, (rows, outputs, inner width, warps, pipeline stages); 16-bit rows take the policy's
# `experimental.product_tiles` (tensor-core tiles; the interpreter too: its products are exact anyway).
_PRODUCT_EXACT_TILES = (64, 64, 16, 4, 2)


def _product_tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    return _PRODUCT_EXACT_TILES if dtype == torch.float32 and not INTERPRETED else active().experimental.product_tiles


def _scaled_product_forward(base, rows, weight, scales) -> torch.Tensor:
    """(B, N, O) = base + (rows diag(scales[b])) weight^T in rows' dtype, for rows and base of any strides."""
    weight, scales = weight.contiguous(), scales.contiguous()
    (batch, length, ins), outs = rows.shape, weight.shape[0]
    out = torch.empty(batch, length, outs, dtype=rows.dtype, device=rows.device)
    bm, bo, bi, warps, stages = _product_tiles(rows.dtype)
    grid = (triton.cdiv(length, bm) * triton.cdiv(outs, bo), batch)
    _scaled_product[grid](rows, scales, weight, base, out, length, outs, ins, *rows.stride(), *base.stride(),
                          BM=bm, BO=bo, BI=bi, EXACT=rows.dtype == torch.float32 or INTERPRETED,
                          num_warps=warps, num_stages=stages)
    return out


def _scaled_product_grads(grad, rows, weight, scales, column_scale=None, column_scale_grads=None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drows, dweight, dscales) of `_scaled_product_forward` (base's gradient is `grad` itself),
    through the (B, O, I) map weight diag(scales[b]), formed again: drows = grad map, and the map's
    gradient grad^T rows to both of the column scaling's. The column scaling and its gradients run
    as `column_scale(weight, scales, dtype)` and `column_scale_grads(grad, weight, scales)`: by
    default the launching functions, the operators in the operator's backward."""
    scaled = (column_scale or _column_scale_forward)(weight, scales, grad.dtype)
    grad_scaled = torch.bmm(grad.transpose(1, 2), rows.to(grad.dtype))
    return torch.bmm(grad, scaled), *(column_scale_grads or _column_scale_grads)(grad_scaled, weight, scales)


class _ScaledProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, rows, weight, scales):
        ctx.save_for_backward(rows, weight, scales)
        return _scaled_product_forward(base, rows, weight, scales)

    @staticmethod
    def backward(ctx, grad):
        return grad, *_scaled_product_grads(grad, *ctx.saved_tensors)


def scaled_product_kernel(base, rows, weight, scales) -> torch.Tensor:
    """`ops.column_scaled_product`: (B, N, O) = base + (rows diag(scales[b])) weight^T for rows
    (B, N, I), weight (O, I) and scales (B, I), in one launch: the scaled rows rounded once to their
    dtype on load, the sum in fp32 from base's tile, no (B, O, I) map and no scaled copy of the rows
    written. The backward forms the map once (`_column_scale`) for the rows' gradient and reads its
    gradient once for the weight's and the scales' (`_column_scale_backward`)."""
    if as_operators():
        return OPERATORS.scaled_product(base, rows, weight, scales)
    if needs_graph(base, rows, weight, scales):
        return _ScaledProduct.apply(base, rows, weight, scales)
    return _scaled_product_forward(base, rows, weight, scales)


def product_fits(limit: int | None = None) -> bool:
    """Whether `scaled_product_kernel`'s tiles fit `limit` bytes of shared memory (None: no limit)."""
    return fits(PRODUCT_SHARED, limit)


def _column_scale_op(weight: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    return _column_scale_forward(weight, scales, dtype)


def _fake_column_scale(weight, scales, dtype):
    return weight.new_empty(scales.shape[0], *weight.shape, dtype=dtype)


def _column_scale_grads_op(grad: Tensor, weight: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    return _column_scale_grads(grad, weight, scales)


def _fake_column_scale_grads(grad, weight, scales):
    return torch.empty_like(weight), torch.empty_like(scales)


def _scaled_product_op(base: Tensor, rows: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return _scaled_product_forward(base, rows, weight, scales)


def _fake_scaled_product(base, rows, weight, scales):
    return rows.new_empty(*rows.shape[:2], weight.shape[0])


def _save_operands(ctx, inputs, output):
    """The column scaling's weight and scales, for its backward."""
    ctx.save_for_backward(*inputs[:2])


def _save_product_operands(ctx, inputs, output):
    """The scaled product's rows, weight and scales, for its backward."""
    ctx.save_for_backward(*inputs[1:])


def _column_scale_operator_backward(ctx, grad):
    return *OPERATORS.column_scale_grads(grad, *ctx.saved_tensors), None


def _scaled_product_operator_backward(ctx, grad):
    """`_scaled_product_grads` through operators a compiler or a counter sees one by one: the map's
    column scaling, the two batched products, and the scaling's gradients."""
    return grad, *_scaled_product_grads(grad, *ctx.saved_tensors, OPERATORS.column_scale, OPERATORS.column_scale_grads)


def _register_operators():
    """The column scaling's forward and gradient operators and the scaled product's, each forward's
    backward through operators a compiler or a counter sees one by one."""
    column_scale = custom_op("column_scale", _column_scale_op, _fake_column_scale)
    column_scale.register_autograd(_column_scale_operator_backward, setup_context=_save_operands)
    scaled_product = custom_op("scaled_product", _scaled_product_op, _fake_scaled_product)
    scaled_product.register_autograd(_scaled_product_operator_backward, setup_context=_save_product_operands)
    return types.SimpleNamespace(
        column_scale=column_scale, scaled_product=scaled_product,
        column_scale_grads=custom_op("column_scale_grads", _column_scale_grads_op, _fake_column_scale_grads),
    )


OPERATORS = _register_operators() if AVAILABLE else None
