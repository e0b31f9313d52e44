"""Fastformer's bidirectional direction pooling as fused Triton kernels, forward and backward:
`direction_pool_kernel(values, direction, mask, scale, gate)`, `sum_j softmax_j(values_j . u)
values_j` over the real positions by an online softmax (`_pool`: one program per slice of the
policy's `pool_chunk` rows, the slices merged in order, `merge_pools`; one per pair where the
sequence fits one slice); the backward (`_pool_backward`) reads the values once more:
dx_j = w_j g + w_j (g . x_j - g . pooled) u, du = sum_j w_j (g . x_j - g . pooled) x_j. A gate
(the key pooling's q_g) is applied inside the launch. `ops.direction_pool` dispatches; the pooling
of shared rows along every head's direction is `triton_shared_pool.py`, the causal pooling
`triton_prefix_pool.py`. Operators: `OPERATORS`.

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
    fused,
    heads_last,
    kept,
    load_tile,
    mask_arguments,
    needs_graph,
    register_family,
    sequences_per_tile,
    slices,
    tile,
    tl,
    triton,
)

if AVAILABLE:

    @triton.jit
    def _pool(X, U, GATE, M, MAX, SUM, ACC, POOLED, LSE, length, chunk, scale, sxb, sxh, sxn, sxd, sub, suh,
              smb, smn, heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr, HAS_GATE: tl.constexpr, FINAL: tl.constexpr):
        """An online softmax over the rows of slice s: the running max of the scores x_n . (scale u),
        the sum of exp(score - max) and of exp(score - max) x_n. FINAL (one slice: the whole
        sequence): the pooling and log-sum-exp themselves (+inf where no token is real), else the
        slice's three sums. HAS_GATE: the rows are gate * x_n (GATE (B H, D) fp32), read as x_n
        along gate * u, the pooling multiplied by the gate at the end."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rd = tl.arange(0, BD)
        if HAS_DIRECTION:
            u = tl.load(U + b * sub + h * suh + rd, mask=rd < D, other=0.0).to(tl.float32) * scale
            if HAS_GATE:
                u = u * tl.load(GATE + bh * D + rd, mask=rd < D, other=0.0)
        top = tl.full((1,), FLOOR_CONSTANT, tl.float32)
        total = tl.zeros((1,), dtype=tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = load_tile(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            if HAS_DIRECTION:
                scores = tl.sum(x * u[None, :], axis=1)
            else:
                scores = tl.zeros((BLOCK_N,), dtype=tl.float32)
            scores = tl.where(keep, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=0))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top)  # 0 at padding
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale + tl.sum(weights[:, None] * x, axis=0)
            top = new_top
        one = tl.arange(0, 1)
        if FINAL:
            _store_pool(POOLED, LSE, GATE, bh, top, total, acc, rd, D, HAS_GATE)
        else:
            index = bh * tl.num_programs(0) + part
            tl.store(MAX + index + one, top)
            tl.store(SUM + index + one, total)
            tl.store(ACC + index * BD + rd, acc)

    @triton.jit
    def _store_pool(POOLED, LSE, GATE, bh, top, total, acc, rd, D: tl.constexpr, HAS_GATE: tl.constexpr):
        """The pooling acc / total (times the gate) and log-sum-exp of pair bh; a row without a real
        token pools to 0 with lse = +inf (zero weight everywhere in the backward)."""
        empty = total == 0
        pooled = acc / tl.where(empty, 1.0, total)
        if HAS_GATE:
            pooled = pooled * tl.load(GATE + bh * D + rd, mask=rd < D, other=0.0)
        tl.store(POOLED + bh * D + rd, pooled, mask=rd < D)
        tl.store(LSE + bh + tl.arange(0, 1), tl.where(empty, float("inf"), top + tl.log(tl.where(empty, 1.0, total))))

    @triton.jit
    def merge_pools(MAX, SUM, ACC, POOLED, LSE, GATE, parts, D: tl.constexpr, BD: tl.constexpr,
                     HAS_GATE: tl.constexpr):
        """The pooling and log-sum-exp of each (b, h) from its slices' online softmaxes, merged in
        order (trailing slices of padding change nothing, exactly); `_store_pool` writes them."""
        bh = tl.program_id(0)
        rd = tl.arange(0, BD)
        one = tl.arange(0, 1)
        top = tl.full((1,), FLOOR_CONSTANT, tl.float32)
        total = tl.zeros((1,), dtype=tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
        for part in range(0, parts):
            index = bh * parts + part
            part_top = tl.load(MAX + index + one)
            new_top = tl.maximum(top, part_top)
            old, new = tl.exp(top - new_top), tl.exp(part_top - new_top)
            total = total * old + tl.load(SUM + index + one) * new
            acc = acc * old + tl.load(ACC + index * BD + rd) * new
            top = new_top
        _store_pool(POOLED, LSE, GATE, bh, top, total, acc, rd, D, HAS_GATE)

    @triton.jit
    def _pool_backward(X, U, GATE, M, G, LSE, P, DX, DU, PP, length, chunk, scale,
                       sxb, sxh, sxn, sxd, sub, suh, smb, smn, sdb, sdh, sdn, sdd,
                       heads: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_MASK: tl.constexpr, HAS_DIRECTION: tl.constexpr, HAS_GATE: tl.constexpr):
        """dx_n = w_n g + t_n (scale u) and scale sum_n t_n x_n (the gradient of u) over slice s,
        t_n = w_n (g . x_n - g . pooled), w_n = exp(x_n . (scale u) - lse) (0 at padding); g . pooled
        from the forward's output P (B H, D). HAS_GATE: g is the output's gradient times the gate, u
        the direction times the gate (g . pooled is still the output's gradient . P), and the slice's
        share of the ungated pooling, sum_n w_n x_n, goes to PP for the gate's gradient."""
        part, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rd = tl.arange(0, BD)
        g = tl.load(G + bh * D + rd, mask=rd < D, other=0.0)
        lse = tl.load(LSE + bh)
        g_pooled = tl.sum(g * tl.load(P + bh * D + rd, mask=rd < D, other=0.0))
        if HAS_GATE:
            gate = tl.load(GATE + bh * D + rd, mask=rd < D, other=0.0)
            g = g * gate
        if HAS_DIRECTION:
            u = tl.load(U + b * sub + h * suh + rd, mask=rd < D, other=0.0).to(tl.float32) * scale
            if HAS_GATE:
                u = u * gate
        du = tl.zeros((BD,), dtype=tl.float32)
        pooled = tl.zeros((BD,), dtype=tl.float32)
        start = part * chunk
        for offset in range(start, tl.minimum(start + chunk, length), BLOCK_N):
            rows = offset + tl.arange(0, BLOCK_N)
            inside = rows < length
            keep = kept(M, smb, smn, b, rows, length, HAS_MASK)
            x = load_tile(X + b * sxb + h * sxh, rows, keep, rd, D, sxn, sxd).to(tl.float32)
            if HAS_DIRECTION:
                scores = tl.sum(x * u[None, :], axis=1)
            else:
                scores = tl.zeros((BLOCK_N,), dtype=tl.float32)
            weights = tl.where(keep, tl.exp(scores - lse), 0.0)
            t = weights * (tl.sum(x * g[None, :], axis=1) - g_pooled)
            dx = weights[:, None] * g[None, :]
            if HAS_DIRECTION:
                dx += t[:, None] * u[None, :]
                du += tl.sum(t[:, None] * x, axis=0)
            if HAS_GATE:
                pooled += tl.sum(weights[:, None] * x, axis=0)
            tl.store(DX + b * sdb + h * sdh + rows[:, None] * sdn + rd[None, :] * sdd, dx.to(DX.dtype.element_ty),
                     mask=inside[:, None] & (rd[None, :] < D))
        index = bh * tl.num_programs(0) + part
        if HAS_DIRECTION:
            tl.store(DU + index * BD + rd, du * scale)
        if HAS_GATE:
            tl.store(PP + index * BD + rd, pooled)

    @triton.jit
    def _gate_grads(DU, PP, G, U, GATE, DGATE, DDIR, batch, parts, sub, suh, heads: tl.constexpr,
                    D: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr, HAS_DIRECTION: tl.constexpr,
                    SHARED: tl.constexpr):
        """The gated pooling's small gradients for head h from the slices' sums (in order), BB
        sequences per (BB, BD) tile: the gate's, g * pooled + du * u, and the direction's, du * gate
        (summed over the batch where one direction (SHARED) serves every sequence); du is the
        gradient of the gated direction u * gate."""
        h = tl.program_id(0)
        rd, rb = tl.arange(0, BD), tl.arange(0, BB)
        shared = tl.zeros((BD,), dtype=tl.float32)
        for first in range(0, batch, BB):
            b = first + rb
            bh = b * heads + h
            cells = (b[:, None] < batch) & (rd[None, :] < D)
            row = bh[:, None] * D + rd[None, :]
            slices = (bh[:, None] * parts) * BD + rd[None, :]
            pooled = tl.zeros((BB, BD), dtype=tl.float32)
            du = tl.zeros((BB, BD), dtype=tl.float32)
            for part in range(0, parts):
                pooled += tl.load(PP + slices + part * BD, mask=cells, other=0.0)
                if HAS_DIRECTION:
                    du += tl.load(DU + slices + part * BD, mask=cells, other=0.0)
            grad_gate = tl.load(G + row, mask=cells, other=0.0) * pooled
            if HAS_DIRECTION:
                u = tl.load(U + b[:, None] * sub + h * suh + rd[None, :], mask=cells, other=0.0).to(tl.float32)
                grad_gate += du * u
                grad_direction = du * tl.load(GATE + row, mask=cells, other=0.0)
                if SHARED:
                    shared += tl.sum(grad_direction, axis=0)
                else:
                    tl.store(DDIR + row, grad_direction, mask=cells)
            tl.store(DGATE + row, grad_gate, mask=cells)
        if HAS_DIRECTION and SHARED:
            tl.store(DDIR + h * D + rd, shared, mask=rd < D)
else:
    merge_pools = None  # what triton_shared_pool.py imports


def _direction_strides(direction):
    """(batch stride, head stride) of a direction (B or 1, H, d): one row is shared by the batch."""
    if direction is None:
        return 0, 0
    return (0 if direction.shape[0] == 1 else direction.stride(0)), direction.stride(1)


def pool_slices(values) -> tuple[int, int]:
    """(slices, rows per slice) of a pooling, by the policy's `pool_chunk` (rows per program, or
    None for one program per pair where the pairs fill the GPU); one slice is the whole sequence."""
    batch, heads, length, _ = values.shape
    whole = 1, max(BLOCK_N, triton.cdiv(length, BLOCK_N) * BLOCK_N)
    chunk = active().pool_chunk
    if chunk is None:
        return whole if fused(batch * heads, values.device) else slices(length)
    if chunk <= 0 or chunk % BLOCK_N:  # a slice ends inside a tile: rows counted twice
        raise ValueError(f"policy pool_chunk={chunk}: a positive multiple of {BLOCK_N} rows, or None")
    return whole if length <= chunk else (triton.cdiv(length, chunk), chunk)


def _pool_forward(values, direction, mask, scale: float = 1.0, gate=None):
    """(pooled (B, H, d) fp32, log-sum-exp (B, H) fp32, +inf where a row has no real token), the
    scores x_n . u multiplied by `scale`; with a gate (B, H, d) fp32, the pooling of gate * x_n."""
    batch, heads, length, dim = values.shape
    parts, chunk = pool_slices(values)
    pooled = torch.empty(batch, heads, dim, dtype=torch.float32, device=values.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=values.device)
    shape = (batch * heads, parts)
    if parts == 1:
        top = total = acc = pooled  # unused: the kernel writes the pooling itself
    else:
        top, total = (torch.empty(shape, dtype=torch.float32, device=values.device) for _ in range(2))
        acc = torch.empty(*shape, tile(dim), dtype=torch.float32, device=values.device)
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, values)
    gate_ptr = pooled if gate is None else gate
    _pool[(parts, batch * heads)](
        values, values if direction is None else direction, gate_ptr, mask_ptr, top, total, acc, pooled, lse,
        length, chunk, float(scale), *values.stride(), *_direction_strides(direction), smb, smn, heads=heads, D=dim,
        BD=tile(dim), BLOCK_N=BLOCK_N, HAS_MASK=has_mask, HAS_DIRECTION=direction is not None,
        HAS_GATE=gate is not None, FINAL=parts == 1,
    )
    if parts > 1:
        merge_pools[(batch * heads,)](top, total, acc, pooled, lse, gate_ptr, parts, D=dim, BD=tile(dim),
                                       HAS_GATE=gate is not None)
    return pooled, lse


def _direction_pool_grads(values, direction, mask, pooled, lse, grad, scale: float = 1.0, gate=None):
    """(dvalues stored heads-last in the values' dtype, du in the direction's dtype or None without
    a direction, the gate's gradient (B, H, d) fp32 or None without a gate) from the forward's
    inputs, output and log-sum-exp and the output's gradient."""
    batch, heads, length, dim = values.shape
    grad, pooled = grad.float().contiguous(), pooled.contiguous()  # (B, H, d): the kernel takes g . pooled
    parts, chunk = pool_slices(values)
    grad_values = heads_last(batch, heads, length, dim, values)
    partial = torch.empty(batch * heads, parts, tile(dim), dtype=torch.float32, device=values.device)
    shares = partial if gate is None else torch.empty_like(partial)  # the gate's: the ungated pooling's
    mask_ptr, smb, smn, has_mask = mask_arguments(mask, values)
    _pool_backward[(parts, batch * heads)](
        values, values if direction is None else direction, pooled if gate is None else gate, mask_ptr, grad, lse,
        pooled, grad_values, partial, shares, length, chunk, float(scale), *values.stride(),
        *_direction_strides(direction), smb, smn, *grad_values.stride(), heads=heads, D=dim, BD=tile(dim),
        BLOCK_N=BLOCK_N, HAS_MASK=has_mask, HAS_DIRECTION=direction is not None, HAS_GATE=gate is not None,
    )
    if gate is not None:
        return grad_values, *_gate_grads_of(partial, shares, grad, direction, gate, parts)
    if direction is None:
        return grad_values, None, None
    grad_direction = (partial[:, 0] if parts == 1 else partial.sum(1))[:, :dim].view(batch, heads, dim)
    if direction.shape[0] == 1 and batch > 1:
        grad_direction = grad_direction.sum(0, keepdim=True)
    return grad_values, grad_direction.to(direction.dtype), None


# Elements of one (sequences, head width) tile of `_gate_grads`: its programs, one per head, walk the
# batch a tile of sequences at a time, so that loads of many sequences are in flight at once (one
# sequence at a time, each program waited on about (slices / 4 + 1) loads per sequence in turn:
# ptxas unrolls the loop over slices by 4).
GATE_TILE = 4096


def _gate_batch_rows(batch: int, width: int) -> int:
    """Sequences per tile of `_gate_grads`: up to `GATE_TILE` elements."""
    return sequences_per_tile(batch, GATE_TILE // tile(width))


def _gate_grads_of(partial, shares, grad, direction, gate, parts):
    """(du or None, dgate) of a gated pooling from the backward's sums per slice (`_gate_grads`)."""
    batch, heads, dim = gate.shape
    grad_gate = torch.empty_like(gate)
    grad_direction = None
    if direction is not None:
        grad_direction = torch.empty(direction.shape, dtype=torch.float32, device=gate.device)
    _gate_grads[(heads,)](
        partial, shares, grad, gate if direction is None else direction, gate, grad_gate,
        grad_gate if grad_direction is None else grad_direction, batch, parts, *_direction_strides(direction),
        heads=heads, D=dim, BD=tile(dim), BB=_gate_batch_rows(batch, dim), HAS_DIRECTION=direction is not None,
        SHARED=direction is not None and direction.shape[0] == 1,
    )
    return (None if direction is None else grad_direction.to(direction.dtype)), grad_gate


class _DirectionPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, direction, mask, scale, gate):
        pooled, lse = _pool_forward(values, direction, mask, scale, gate)
        ctx.save_for_backward(values, direction, mask, pooled, lse, gate)
        ctx.scale = scale
        return pooled

    @staticmethod
    def backward(ctx, grad):
        values, direction, mask, pooled, lse, gate = ctx.saved_tensors
        grad_values, grad_direction, grad_gate = _direction_pool_grads(values, direction, mask, pooled, lse, grad,
                                                                       ctx.scale, gate)
        return grad_values, grad_direction, None, None, grad_gate


def direction_pool_kernel(values, direction=None, mask=None, scale: float = 1.0, gate=None) -> torch.Tensor:
    """Bidirectional `ops.direction_pool`: sum_j softmax_j(scale values_j . u) values_j over the real
    positions. values (B, H, N, d), direction u (B or 1, H, d) or None (the plain mean), mask (B, N)
    or None; the scale multiplies u inside the kernel. With a gate (B, H, d), the rows pooled are
    gate * values_j: the kernel reads values_j along gate * u and multiplies the pooling by the
    gate (no (B, H, N, d) product is formed). Returns (B, H, d) in fp32; zero for a row with no
    real token."""
    direction = None if direction is None else direction.contiguous()
    gate = None if gate is None else gate.float().contiguous()
    scale = float(scale)
    if as_operators():
        return OPERATORS.direction_pool(values, direction, mask, scale, gate)[0]
    if needs_graph(values, direction, gate):
        return _DirectionPool.apply(values, direction, mask, scale, gate)
    return _pool_forward(values, direction, mask, scale, gate)[0]  # inference: no autograd node


def _direction_pool_op(values: Tensor, direction: Optional[Tensor], mask: Optional[Tensor],
                       scale: float = 1.0, gate: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _pool_forward(values, direction, mask, scale, gate)


def _direction_pool_grads_op(values: Tensor, direction: Optional[Tensor], mask: Optional[Tensor], gate: Optional[Tensor],
                             pooled: Tensor, lse: Tensor, grad: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    grad_values, grad_direction, grad_gate = _direction_pool_grads(values, direction, mask, pooled, lse, grad, scale,
                                                                   gate)
    return (grad_values, values.new_empty(0) if grad_direction is None else grad_direction.contiguous(),
            values.new_empty(0) if grad_gate is None else grad_gate)


def _fake_direction_pool_grads(values, direction, mask, gate, pooled, lse, grad, scale):
    return (heads_last(*values.shape, values), fake_direction_grad(values, direction),
            values.new_empty(0) if gate is None else torch.empty_like(gate))


def fake_direction_grad(values, direction):
    """du as the kernels return it: (1 or B, H, d) as u is, or an empty tensor without u."""
    if direction is None:
        return values.new_empty(0)
    rows = 1 if direction.shape[0] == 1 else values.shape[0]
    return direction.new_empty(rows, *direction.shape[1:])


def fake_pool(values, direction, mask, scale=1.0, gate=None):
    """(pooled (B, H, d), log-sum-exp (B, H)), fp32; the shared pooling's H is its directions'."""
    heads = values.shape[1] if values.dim() == 4 else direction.shape[1]
    return (values.new_empty(values.shape[0], heads, values.shape[-1], dtype=torch.float32),
            values.new_empty(values.shape[0], heads, dtype=torch.float32))


def _direction_pool_operator_backward(ctx, grad, _):
    values, direction, mask, gate, pooled, lse = ctx.saved_tensors
    (scale,) = ctx.flags
    grad_values, grad_direction, grad_gate = OPERATORS.direction_pool_grads(values, direction, mask, gate, pooled, lse,
                                                                            grad, scale)
    return (grad_values, None if direction is None else grad_direction, None, None,
            None if gate is None else grad_gate)


def _register_operators():
    """This family's forward and gradient operators (`triton_launch.register_family`)."""
    operators = register_family(
        "direction_pool", _direction_pool_op, fake_pool,
        _direction_pool_operator_backward, _direction_pool_grads_op, _fake_direction_pool_grads,
    )
    return types.SimpleNamespace(**operators)


OPERATORS = _register_operators() if AVAILABLE else None
