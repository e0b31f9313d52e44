"""Fastformer's folded form pools the layer's input itself along every head's direction: one
fused Triton kernel for all heads (`shared_pool_kernel(values, direction, mask)`), each tile of
rows read once, the scores against every head's direction and every head's share of the pooling
as two matrix products; its backward pairs each direction with its gradient in one tile where
they fit (`_shared_pool_backward_paired`, the policy's `paired_shared_backward`). Slices and their
merge are the direction pooling's (`triton_pooling.py`). Operators: `OPERATORS`.

This file ships to the Hugging Face Hub with every checkpoint and imports where triton is not
installed (`triton_launch.AVAILABLE` is then False and nothing here may be called)."""

import types
from typing import Optional

import torch

from .policy import active
from .triton_launch import (
    AVAILABLE,
    FLOOR_CONSTANT,
    BLOCK_N,
    Tensor,
    as_operators,
    bound,
    dot_fp32,
    fits,
    kept,
    launch_options,
    load_tile,
    mask_arguments,
    needs_graph,
    register_family,
    tile,
    tl,
    triton,
)
from .triton_pooling import fake_direction_grad, fake_pool, merge_pools, pool_slices

if AVAILABLE:

    @triton.jit
    def _dot32(a, b, DOT_FP32: tl.constexpr):
        """a @ b of fp32 tiles: exactly (DOT_FP32: fp32 inputs, the interpreter), else in tf32 (rows
        read from 16-bit inputs are exact in it; the other operand is rounded to 2^-11)."""
        if DOT_FP32:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b, input_precision="tf32")

    @triton.jit
    def _shared_tile(X, M, smb, smn, b, rows, length, rd, D, sxn, sxd, u, BLOCK_N: tl.constexpr,
                     BH: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr,
                     DOT_FP32: tl.constexpr):
        """(which rows are real, the tile of rows in fp32, their scores x_n . u_h against every
        direction (BLOCK_N, BH), zero without directions)."""
        keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
        x = load_tile(X, rows, keep, rd, D, sxn, sxd).to(tl.float32)
        if HAS_DIRECTION:
            scores = _dot32(x, tl.trans(u), DOT_FP32)
        else:
            scores = tl.zeros((BLOCK_N, BH), dtype=tl.float32)
        return keep, x, scores

    @triton.jit
    def _directions(U, b, sub, suh, rd, rh, columns, BH: tl.constexpr, BD: tl.constexpr,
                    HAS_DIRECTION: tl.constexpr):
        """The (BH, BD) fp32 directions of sequence b (zeros without directions: never read)."""
        if HAS_DIRECTION:
            return tl.load(U + b * sub + rh[:, None] * suh + rd[None, :], mask=columns, other=0.0).to(tl.float32)
        return tl.zeros((BH, BD), dtype=tl.float32)

    @triton.jit
    def _shared_pool(X, U, M, MAX, SUM, ACC, POOLED, LSE, length, chunk, sxb, sxn, sxd, sub, suh, smb, smn,
                     heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr,
                     FINAL: tl.constexpr, DOT_FP32: tl.constexpr):
        """`_pool` of one slice of one sequence along all `heads` directions at once: each tile of
        rows is read once, its scores against every direction are one matrix product and so is its
        share of every head's pooling. The slices' sums are stored per (b, h) as `_pool` stores
        them, so `merge_pools` merges them."""
        part, b = tl.program_id(0), tl.program_id(1)
        rd, rh = tl.arange(0, BD), tl.arange(0, BH)
        real_heads = rh < heads
        pairs = b * heads + rh  # (b, h) rows of the per-pair outputs
        columns = real_heads[:, None] & (rd[None, :] < D)
        u = _directions(U, b, sub, suh, rd, rh, columns, BH, BD, HAS_DIRECTION)
        top = tl.full((BH,), FLOOR_CONSTANT, tl.float32)
        total = tl.zeros((BH,), dtype=tl.float32)
        acc = tl.zeros((BH, BD), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep, x, scores = _shared_tile(X + b * sxb, M, smb, smn, b, rows, length, rd, D, sxn, sxd, u,
                                           BLOCK_N, BH, HAS_MASK, HAS_DIRECTION, DOT_FP32)
            scores = tl.where(keep[:, None], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=0))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top[None, :])  # (BLOCK_N, BH), 0 at padding
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale[:, None] + _dot32(tl.trans(weights), x, DOT_FP32)
            top = new_top
        if FINAL:
            empty = total == 0
            tl.store(POOLED + pairs[:, None] * D + rd[None, :], acc / tl.where(empty, 1.0, total)[:, None],
                     mask=columns)
            tl.store(LSE + pairs, tl.where(empty, float("inf"), top + tl.log(tl.where(empty, 1.0, total))),
                     mask=real_heads)
        else:
            index = pairs * tl.num_programs(0) + part
            tl.store(MAX + index, top, mask=real_heads)
            tl.store(SUM + index, total, mask=real_heads)
            tl.store(ACC + index[:, None] * BD + rd[None, :], acc, mask=real_heads[:, None])

    @triton.jit
    def _shared_pool_backward(X, U, M, G, LSE, P, DX, DU, length, chunk, sxb, sxn, sxd, sub, suh, smb, smn,
                              sdb, sdn, sdd, heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                              BH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                              HAS_DIRECTION: tl.constexpr, DOT_FP32: tl.constexpr):
        """`_pool_backward` of one slice along all directions: with w_nh = exp(x_n . u_h - lse_h) and
        t_nh = w_nh (g_h . x_n - g_h . pooled_h), dx_n = sum_h w_nh g_h + t_nh u_h (two matrix
        products per tile) and the slice's du_h = sum_n t_nh x_n; pooled_h from P (B H, D)."""
        part, b = tl.program_id(0), tl.program_id(1)
        rd, rh = tl.arange(0, BD), tl.arange(0, BH)
        real_heads = rh < heads
        pairs = b * heads + rh
        columns = real_heads[:, None] & (rd[None, :] < D)
        g = tl.load(G + pairs[:, None] * D + rd[None, :], mask=columns, other=0.0)
        lse = tl.load(LSE + pairs, mask=real_heads, other=float("inf"))  # no weight on padded heads
        g_pooled = tl.sum(g * tl.load(P + pairs[:, None] * D + rd[None, :], mask=columns, other=0.0), axis=1)
        u = _directions(U, b, sub, suh, rd, rh, columns, BH, BD, HAS_DIRECTION)
        du = tl.zeros((BH, BD), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep, x, scores = _shared_tile(X + b * sxb, M, smb, smn, b, rows, length, rd, D, sxn, sxd, u,
                                           BLOCK_N, BH, HAS_MASK, HAS_DIRECTION, DOT_FP32)
            weights = tl.where(keep[:, None], tl.exp(scores - lse[None, :]), 0.0)
            t = weights * (_dot32(x, tl.trans(g), DOT_FP32) - g_pooled[None, :])
            dx = _dot32(weights, g, DOT_FP32)
            if HAS_DIRECTION:
                dx += _dot32(t, u, DOT_FP32)
                du += _dot32(tl.trans(t), x, DOT_FP32)
            tl.store(DX + b * sdb + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=(rows < length)[:, None] & (rd[None, :] < D))
        if HAS_DIRECTION:
            tl.store(DU + ((b * tl.num_programs(0) + part) * BH + rh[:, None]) * BD + rd[None, :], du)

    @triton.jit
    def _shared_pool_backward_paired(X, U, M, G, LSE, P, DX, DU, length, chunk, sxb, sxn, sxd, sub, suh, smb,
                                     smn, sdb, sdn, sdd, heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                                     BH: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
                                     DOT_FP32: tl.constexpr):
        """`_shared_pool_backward` with directions, for at most BH / 2 heads: the directions and the
        gradients interleave in one (BH, BD) tile, rows (u_0, g_0, u_1, g_1, ...), so that one
        product per tile gives both x_n . u_h and x_n . g_h, one gives dx_n = sum_h t_nh u_h + w_nh g_h,
        and one du (its odd rows, sum_n w_nh x_n, are dropped). Against a tile for u and one for g,
        each padded to the 16 rows a product needs, this holds one (BH, BD) tile fewer and runs three
        products per tile instead of five."""
        part, b = tl.program_id(0), tl.program_id(1)
        HALF: tl.constexpr = BH // 2
        rd, rh, rp = tl.arange(0, BD), tl.arange(0, BH), tl.arange(0, HALF)
        head, is_u = rh // 2, rh % 2 == 0
        rows_ok = (head < heads)[:, None] & (rd[None, :] < D)
        u = tl.load(U + b * sub + head[:, None] * suh + rd[None, :], mask=rows_ok & is_u[:, None], other=0.0)
        g = tl.load(G + (b * heads + head[:, None]) * D + rd[None, :], mask=rows_ok & ~is_u[:, None], other=0.0)
        paired = u.to(tl.float32) + g  # (BH, BD): u_h in row 2h, g_h in row 2h + 1
        real_heads = rp < heads
        lse = tl.load(LSE + b * heads + rp, mask=real_heads, other=float("inf"))  # no weight on padded heads
        by_head = (b * heads + rp[:, None]) * D + rd[None, :]  # (HALF, BD) rows of g and the pooling per head
        head_ok = real_heads[:, None] & (rd[None, :] < D)
        g_pooled = tl.sum(tl.load(G + by_head, mask=head_ok, other=0.0) * tl.load(P + by_head, mask=head_ok, other=0.0),
                          axis=1)
        du = tl.zeros((BH, BD), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = load_tile(X + b * sxb, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            scores, x_g = tl.split(tl.reshape(_dot32(x, tl.trans(paired), DOT_FP32), (BLOCK_N, HALF, 2)))
            weights = tl.where(keep[:, None], tl.exp(scores - lse[None, :]), 0.0)
            t = weights * (x_g - g_pooled[None, :])
            coefficients = tl.reshape(tl.join(t, weights), (BLOCK_N, BH))  # (t_0, w_0, t_1, w_1, ...)
            dx = _dot32(coefficients, paired, DOT_FP32)
            du += _dot32(tl.trans(coefficients), x, DOT_FP32)
            tl.store(DX + b * sdb + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=(rows < length)[:, None] & (rd[None, :] < D))
        tl.store(DU + ((b * tl.num_programs(0) + part) * HALF + head[:, None]) * BD + rd[None, :], du,
                 mask=is_u[:, None])  # du_h, from row 2h


# the pooling across heads: heads x width (16 x 512 for 8 heads of a 512-wide layer)
SHARED_POOL_SHARED = ((4096, 98_304), (8192, 163_840))


def shared_pool_shared(width: int, heads: int) -> int | None:
    """The most shared memory `shared_pool_kernel`'s programs ask for with `heads` directions over
    rows `width` wide (`SHARED_POOL_SHARED`), or None past its largest tile: a program holds
    (heads, width) tiles (the directions, the pooling, in the backward the gradients too), padded to
    powers of two, of at most 8,192 elements (16 heads at width 512); the backward's 16 x 1,024
    tiles outgrow sm_90's shared memory."""
    return bound(SHARED_POOL_SHARED, tile(heads) * tile(width)) if width >= 1 else None


def shared_fits(width: int, heads: int, limit: int | None = None) -> bool:
    """Whether `shared_pool_kernel` takes `heads` directions over rows `width` wide within `limit`
    bytes of shared memory (None: no limit)."""
    return fits(shared_pool_shared(width, heads), limit)


def _shared_block(width: int, backward: bool = False) -> int:
    """Rows per tile of the shared pooling: 16,384 elements of a (rows, width) tile (8,192 in the
    backward, which holds more tiles beside it), at least 16 (a matrix product's smallest tile): 32
    and 16 at width 512. A divisor of the policy's `pool_chunk` and of `BLOCK_N`. At width 512 the
    backward's 32-row tiles asked 196,608 bytes of shared memory (sm_80 allows 166,912) and ptxas
    spilled registers; 16 rows ask 163,840."""
    return max(16, min(BLOCK_N, (8192 if backward else 16384) // tile(width)))


def _shared_launch(values, direction, mask, backward: bool = False):
    """The launch arguments of the shared pooling's forward (or `backward`)."""
    batch, length, dim = values.shape
    heads = direction.shape[1]
    parts, chunk = pool_slices(values[:, None])
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, values)
    sub = 0 if direction.shape[0] == 1 else direction.stride(0)
    constants = dict(heads=heads, D=dim, BD=tile(dim), BH=tile(heads), BLOCK_N=_shared_block(dim, backward), HAS_MASK=has_mask,
                     DOT_FP32=dot_fp32(values), **launch_options(dim))  # the rows' precision decides
    return parts, chunk, (mask_ptr,), (values.stride(0), values.stride(1), values.stride(2), sub, direction.stride(1),
                                       smb, smn), constants


def _shared_pool_forward(values, direction, mask, has_direction):
    """(pooled (B, H, D) fp32, log-sum-exp (B, H) fp32, +inf where a row has no real token)."""
    batch, length, dim = values.shape
    heads = direction.shape[1]
    parts, chunk, (mask_ptr,), strides, constants = _shared_launch(values, direction, mask)
    pooled = torch.empty(batch, heads, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=values.device)
    if parts == 1:
        top = total = acc = pooled  # unused: the kernel writes the pooling itself
    else:
        top, total = (torch.empty(batch * heads, parts, dtype=torch.float32, device=values.device) for _ in range(2))
        acc = torch.empty(batch * heads, parts, tile(dim), dtype=torch.float32, device=values.device)
    _shared_pool[(parts, batch)](values, direction, mask_ptr, top, total, acc, pooled, lse, length, chunk, *strides,
                                 HAS_DIRECTION=has_direction, FINAL=parts == 1, **constants)
    if parts > 1:
        merge_pools[(batch * heads,)](top, total, acc, pooled, lse, pooled, parts, D=dim, BD=tile(dim),
                                       HAS_GATE=False)
    return pooled, lse


def _paired_backward(heads: int) -> bool:
    """Whether the shared pooling's backward with `heads` directions takes
    `_shared_pool_backward_paired`: where the policy's `paired_shared_backward` allows it and each
    direction and its gradient fit one tile's rows (up to 8 heads, whose directions alone are padded
    to the 16 rows of a matrix product's tile)."""
    return active().paired_shared_backward and tile(2 * heads) == tile(heads)


def _shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction: bool):
    """(dvalues, contiguous in the values' dtype, du in the direction's dtype or None without a
    direction) of the shared pooling, from the forward's inputs and results and the gradient."""
    batch, length, dim = values.shape
    heads = direction.shape[1]
    grad, pooled = grad.float().contiguous(), pooled.contiguous()  # (B, H, D): the kernels take g . pooled
    parts, chunk, (mask_ptr,), strides, constants = _shared_launch(values, direction, mask, backward=True)
    grad_values = torch.empty_like(values, memory_format=torch.contiguous_format)
    paired = has_direction and _paired_backward(heads)
    rows = tile(heads) // 2 if paired else tile(heads)
    partial = torch.empty(batch, parts, rows, tile(dim), dtype=torch.float32, device=values.device)
    arguments = (values, direction, mask_ptr, grad, lse, pooled, grad_values, partial, length, chunk, *strides,
                 *grad_values.stride())
    if paired:
        _shared_pool_backward_paired[(parts, batch)](*arguments, **constants)
    else:
        _shared_pool_backward[(parts, batch)](*arguments, HAS_DIRECTION=has_direction, **constants)
    if not has_direction:
        return grad_values, None
    grad_direction = partial.sum(1)[:, :heads, :dim]
    if direction.shape[0] == 1:
        grad_direction = grad_direction.sum(0, keepdim=True)
    return grad_values, grad_direction.to(direction.dtype)


class _SharedPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, direction, mask, has_direction):
        pooled, lse = _shared_pool_forward(values, direction, mask, has_direction)
        ctx.has_direction = has_direction
        ctx.save_for_backward(values, direction, mask, pooled, lse)
        return pooled

    @staticmethod
    def backward(ctx, grad):
        return *_shared_pool_grads(*ctx.saved_tensors, grad, ctx.has_direction), None, None


def shared_pool_kernel(values, direction=None, mask=None) -> torch.Tensor:
    """Bidirectional `ops.direction_pool` of one sequence per batch row along several directions:
    pooled_h = sum_j softmax_j(values_j . u_h) values_j over the real positions. values (B, N, D),
    any strides; direction u (B or 1, H, D), or None for zero scores (the plain mean, H = 1); mask
    (B, N) or None. Returns (B, H, D) in fp32; zero for a row with no real token. One program per
    slice of `pool_chunk` rows reads each tile once for every head."""
    has_direction = direction is not None
    direction = values[:1, :1] if direction is None else direction.contiguous()  # a pointer never read
    if as_operators():
        return OPERATORS.shared_pool(values, direction, mask, has_direction)[0]
    if needs_graph(values, direction if has_direction else None):
        return _SharedPool.apply(values, direction, mask, has_direction)
    return _shared_pool_forward(values, direction, mask, has_direction)[0]


def _shared_pool_op(values: Tensor, direction: Tensor, mask: Optional[Tensor],
                    has_direction: bool) -> tuple[Tensor, Tensor]:
    return _shared_pool_forward(values, direction, mask, has_direction)


def _shared_pool_grads_op(values: Tensor, direction: Tensor, mask: Optional[Tensor], pooled: Tensor, lse: Tensor,
                          grad: Tensor, has_direction: bool) -> tuple[Tensor, Tensor]:
    grad_values, grad_direction = _shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction)
    return grad_values, values.new_empty(0) if grad_direction is None else grad_direction.contiguous()


def _fake_shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction):
    return (torch.empty_like(values, memory_format=torch.contiguous_format),
            fake_direction_grad(values, direction if has_direction else None))


def _shared_pool_operator_backward(ctx, grad, _):
    values, direction, mask, pooled, lse = ctx.saved_tensors
    (has_direction,) = ctx.flags
    grad_values, grad_direction = OPERATORS.shared_pool_grads(values, direction, mask, pooled, lse, grad, has_direction)
    return grad_values, grad_direction if has_direction else None, None, None


def _fake_shared_pool(values, direction, mask, has_direction):
    return fake_pool(values, direction, mask)


def _register_operators():
    """This family's forward and gradient operators (`triton_launch.register_family`)."""
    operators = register_family(
        "shared_pool", _shared_pool_op, _fake_shared_pool,
        _shared_pool_operator_backward, _shared_pool_grads_op, _fake_shared_pool_grads,
    )
    return types.SimpleNamespace(**operators)


OPERATORS = _register_operators() if AVAILABLE else None
