"""Fastformer's softmax poolings in their torch forms, each with the naive reference the tests
compare it with in fp64, forward and backward (`ops.py` gathers the names):

- `softmax_pool(scores, values, mask, state, *, causal, return_state) -> (pooled, state)`,
  reference `softmax_pool_reference`: pooled_i = sum_j softmax_j(scores) values_j over the real
  positions j that i sees; `state` is (log-sum-exp of the scores so far (B, H, 1, 1), the pooling
  so far (B, H, 1, d)). Its causal kernel is `triton_prefix_pool.py` (`softmax_pool_path`).
- `direction_pool(values, direction, mask, scale, gate)`, reference `direction_pool_reference`:
  `softmax_pool` with the scores scale values_j . u, so a fused kernel reads the values once and
  no (B, H, N, 1) scores are formed; a gate (B, H, d) pools the rows gate * values_j without
  forming them (the key pooling's q_g * k_i). Values (B, 1, N, D) are shared by H directions (B or
  1, H, D): the folded form pools the layer's input once per head. Its kernels are
  `triton_pooling.py` and `triton_shared_pool.py` (`direction_pool_path`).

The kernels run where the execution policy (`policy.py`) and `dispatch.py` send a call. Sums over
the sequence run in fp32 with autocast off (fp64 stays fp64).

This file ships to the Hugging Face Hub with every checkpoint: torch and siblings only.
"""

import torch

from .blocks import at_least_fp32, masked_softmax, no_autocast
from .dispatch import kernel_applies
from .policy import active
from .triton_launch import FLOOR as KERNEL_FLOOR
from .triton_pooling import direction_pool_kernel
from .triton_prefix_pool import prefix_fits, prefix_pool_kernel
from .triton_shared_pool import shared_fits, shared_pool_kernel


def softmax_pool(scores, values, mask=None, state=None, *, causal=False, return_state=False):
    """Fastformer's sequence operation (see the module docstring). scores (B, H, N, 1), values
    (B, H, N, d), mask (B, N), 1/True at real tokens, or None; state (lse (B, H, 1, 1), pooled
    (B, H, 1, d)) of earlier tokens or None (causal only). Returns (pooled: (B, H, 1, d) pooled over
    all real tokens, or (B, H, N, d) with `causal`; the state including these tokens when
    `return_state`, else None). A causal position with no real token yet pools to zero.

    The form: bidirectional, one masked softmax; causal without a state, the Triton kernel where
    kernels apply (`prefix_pool_kernel`, one launch forward and one backward; its state only
    outside autograd); else up to the policy's `fastformer_causal_quadratic` tokens without a state (and none asked
    for) a softmax over the causal pattern (`causal_softmax_pool`); otherwise prefix sums from the
    state (`prefix_pool`, a four-operation update for one new token).
    """
    if not causal:
        if state is not None or return_state:
            raise ValueError("softmax_pool: a state belongs to the causal form (causal=True)")
        weights = masked_softmax(scores, None if mask is None else mask.bool()[:, None, :, None], dim=2)
        return weights.transpose(-1, -2) @ values, None
    if softmax_pool_path(scores, values, state is not None, causal=True, return_state=return_state) == "triton":
        pooled, lse = prefix_pool_kernel(scores, values, mask)
        if not return_state:
            return pooled, None
        last = lse[:, :, -1:, None]  # "nothing seen yet" in the torch form's spelling: the lowest float
        return pooled, (torch.where(last > KERNEL_FLOOR, last, torch.finfo(last.dtype).min), pooled[:, :, -1:])
    if causal_pool_form(scores.shape[2], state is not None, return_state) == "quadratic":
        return causal_softmax_pool(scores, values, mask), None
    if mask is not None:
        scores = scores.masked_fill(~mask.bool()[:, None, :, None], float("-inf"))
    pooled, after = prefix_pool(scores, values, state)
    return pooled, after if return_state else None


def softmax_pool_path(scores, values, has_state: bool = False, *, causal: bool = False,
                      return_state: bool = False) -> str:
    """The path `softmax_pool` takes: 'triton' (the causal kernel, `prefix_pool_kernel`, without a
    state in) or 'torch'."""
    if causal and not has_state and _prefix_kernel_applies(scores, values, return_state):
        return "triton"
    return "torch"


def causal_pool_form(length: int, has_state: bool, return_state: bool = False) -> str:
    """The torch form causal `softmax_pool` takes over `length` new tokens: 'quadratic' (no state in
    or out, up to the policy's `fastformer_causal_quadratic` tokens: `causal_softmax_pool`) or
    'prefix' (prefix sums from the state, `prefix_pool`)."""
    if not has_state and not return_state and length <= active().fastformer_causal_quadratic:
        return "quadratic"
    return "prefix"


def _prefix_kernel_applies(scores, values, return_state: bool) -> bool:
    """Whether causal pooling without a state runs the Triton kernel (`prefix_pool_kernel`): where
    kernels apply, and not for a state that autograd must trace (the kernel's log-sum-exp carries
    no gradient; a prefill under autograd is rare)."""
    if return_state and torch.is_grad_enabled() and (scores.requires_grad or values.requires_grad):
        return False
    return kernel_applies("prefix_pool", values, fits=lambda limit: prefix_fits(values.shape[-1], limit))


def direction_pool(values, direction=None, mask=None, scale: float = 1.0, gate=None):
    """Bidirectional softmax pooling whose scores are a projection of the values themselves:
    pooled = sum_j softmax_j(scale values_j . u) values_j over the real positions j. values (B, H,
    N, d), direction u (B or 1, H, d), or None for zero scores (the plain mean), mask (B, N), 1/True
    at real tokens, or None; `scale` a number (the kernel applies it to u itself: no operation of
    its own). Returns (B, H, 1, d) in fp32 (fp64 stays fp64); zero for a row with no real token.
    Fastformer's two poolings both take this form (w . q_i, and w . (q_g * k_i) = (w * q_g) . k_i).

    `gate` (B, H, d) or None: the rows pooled are gate * values_j. The pooling is computed as
    gate * (the pooling of values_j along gate * u), so the gated rows are never formed; in the
    kernel the two products are part of the launch (Fastformer's key pooling, gate = q_g).

    Values (B, 1, N, D) are one sequence shared by the H directions (B or 1, H, D): each head pools
    the whole rows along its own direction (Fastformer's folded form pools the layer's input this
    way); without a direction that is the plain mean, H = 1.

    The Triton kernel where the policy sends the call to it (`direction_pool_path`;
    `shared_pool_kernel` for shared values), the gate inside the launch unless the policy's
    `gate_in_kernel` is off; else `softmax_pool` over the scores (shared values: two batched products)."""
    shared = values.shape[1] == 1 and (direction is None or direction.shape[1] > 1)
    if not shared and kernel_applies("direction_pool", values):
        if gate is None or active().gate_in_kernel:
            return direction_pool_kernel(values, direction, mask, scale, gate)[:, :, None]
        direction = None if direction is None else direction * gate
        return gate[:, :, None] * direction_pool_kernel(values, direction, mask, scale)[:, :, None]
    if gate is not None:  # the torch forms: the gate's two products
        direction = None if direction is None else direction * gate
    direction = _scaled(direction, scale)
    if shared:  # a view both ways (no copy in the backward)
        pooled = _shared_direction_pool(values.squeeze(1), direction, mask)
    else:
        with no_autocast(values.device.type):
            values = at_least_fp32(values)[0]
            pooled = softmax_pool(direction_scores(values, direction), values, mask)[0]
    return pooled if gate is None else gate[:, :, None] * pooled


def direction_pool_path(values, direction_heads: int | None) -> str:
    """The path `direction_pool` takes on values (B, H, N, d) along a direction of
    `direction_heads` heads (None: no direction, the mean): 'triton' or 'torch'. Shared rows
    (B, 1, N, D) take the copy `shared_rows` chooses, whose path this is when `values` is that copy."""
    if values.shape[1] == 1 and (direction_heads is None or direction_heads > 1):
        return "triton" if _shared_kernel_applies(values, direction_heads or 1) else "torch"
    return "triton" if kernel_applies("direction_pool", values) else "torch"


def _scaled(direction, scale: float):
    """direction * scale, where the torch forms apply the scale (one multiply of the small direction)."""
    return direction if direction is None or scale == 1 else direction * scale


def _shared_kernel_applies(values, heads: int) -> bool:
    """Whether `direction_pool` of shared rows runs `shared_pool_kernel` (`_shared_direction_pool`)."""
    policy = active()
    if values.dtype == torch.float32 and not (policy.shared_pool_fp32 or policy.backend == "triton"):
        return False
    return kernel_applies("direction_pool", values, width_ok=lambda width: width >= 1,
                           fits=lambda limit: shared_fits(values.shape[-1], heads, limit))


def shared_rows(values, low_precision, heads: int):
    """Which copy of shared rows (B, N, D) `direction_pool` along `heads` directions should read:
    `low_precision` (the autocast copy, half the bytes) where the kernel takes it, else `values`
    itself, which the torch form sums without making an fp32 copy (the faster on a CPU under bf16
    autocast: docs/benchmarks.md, "Mixed precision on CPUs")."""
    if low_precision is values or _shared_kernel_applies(low_precision, heads):
        return low_precision
    return values


def _shared_direction_pool(values, direction, mask):
    """`direction_pool` of values (B, N, D) shared by the directions (B or 1, H, D) -> (B, H, 1, D).
    The kernel takes 16-bit rows (its products in tf32, exact for them); fp32 rows, whose products
    the kernel would run exactly on CUDA cores, take the torch form's batched products unless the
    backend `triton` forces the kernel (the tests)."""
    if _shared_kernel_applies(values, 1 if direction is None else direction.shape[1]):
        return shared_pool_kernel(values, direction, mask)[:, :, None]
    with no_autocast(values.device.type):
        values = at_least_fp32(values)[0]
        if direction is None:
            scores = values.new_zeros(values.shape[0], 1, values.shape[1])
        else:
            scores = direction.to(values.dtype) @ values.transpose(1, 2)  # (B, H, N)
        weights = masked_softmax(scores, None if mask is None else mask.bool()[:, None, :])
        return (weights @ values)[:, :, None]


def direction_scores(values, direction):
    """values_j . u (B, H, N, 1) in the values' dtype, u (B or 1, H, d): a product and a sum over d,
    on the values' own strided layout (no copy); zeros without a direction (the plain mean). Each
    score is a d_h-term dot product, too small for BLAS: a `bmm` over the heads or one product with a
    block-diagonal (D, H) matrix is the slower, forward and backward (docs/benchmarks.md, "Short
    inputs")."""
    if direction is None:
        return values.new_zeros(*values.shape[:-1], 1)
    return (values * direction.to(values.dtype)[:, :, None, :]).sum(-1, keepdim=True)


def direction_pool_reference(values, direction=None, mask=None, scale: float = 1.0, gate=None):
    """`direction_pool` computed naively, through `softmax_pool_reference` over the scores (shared
    values broadcast to every direction; gated values formed)."""
    direction = _scaled(direction, scale)
    if values.shape[1] == 1 and direction is not None:
        values = values.expand(-1, direction.shape[1], -1, -1)
    if gate is not None:
        values = values * gate[:, :, None, :]
    return softmax_pool_reference(direction_scores(values, direction), values, mask)[0]


def causal_softmax_pool(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`prefix_pool` without a state, in the quadratic form: output i is sum_{j<=i} softmax_j(scores)
    values_j over the real positions j <= i (mask (B, N), 1 at real tokens, or None), zero where
    there is none yet. scores (B, H, N, 1), values (B, H, N, d); returns (B, H, N, d). Each row's
    softmax takes its own max, so no position underflows against a later, larger score."""
    length = scores.shape[2]
    allowed = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril_()  # j <= i
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]  # (B, 1, N, N)
    # without padding every row holds its own position; with it, a row can have no real token yet
    weights = masked_softmax(scores.transpose(-1, -2), allowed, may_be_empty=mask is not None)  # (B, H, N, N)
    return weights @ values


def prefix_pool(scores, values, state=None):
    """Causal pooling by prefix sums: output i pools positions j <= i. scores (B, H, N, 1), -inf at
    padding; values (B, H, N, d); state = (log-sum-exp of the scores so far (B, H, 1, 1), the
    pooling so far (B, H, 1, d)) of the positions before these, or None. Returns (pooled (B, H, N,
    d), the state after them).

    A single new token (a decoding step) with a state takes four operations: its share of the
    softmax a = exp(s - lse'), lse' = logaddexp(lse, s), moves the pooling towards its value,
    pooled' = pooled + a (v - pooled) (`torch.lerp`). Per-call overhead dominates decoding
    (docs/benchmarks.md). A block of tokens takes prefix sums under a running max, which starts at
    the lowest finite float, not -inf: padding (-inf) then gets weight exp(-inf) = 0 and never
    makes a NaN, without a guard. A state is the same thing with max = lse, denominator 1 and
    numerator = pooled, and "nothing seen yet" is lse = the lowest float, pooled = 0. The state keeps
    the sequence axis (size 1)."""
    length = values.shape[2]
    floor = torch.finfo(scores.dtype).min
    if state is not None and length == 1:  # a decoding step
        old_lse, old_pooled = state
        lse = torch.logaddexp(old_lse, scores)  # (B, H, 1, 1); unchanged by padding (-inf)
        pooled = torch.lerp(old_pooled, values, torch.exp(scores - lse))  # the new token's share: 0 at padding
        return pooled, (lse, pooled)
    if state is None:  # nothing before: the prefix sums alone
        new_max = scores.amax(dim=2, keepdim=True).clamp_min(floor)
        weights = torch.exp(scores - new_max)  # (B, H, N, 1)
        den, num = weights.cumsum(dim=2), (weights * values).cumsum(dim=2)
    else:
        old_lse, old_pooled = state
        new_max = torch.maximum(old_lse, scores.amax(dim=2, keepdim=True))
        rescale = torch.exp(old_lse - new_max)  # the earlier tokens' total weight (0 if all were padding)
        weights = torch.exp(scores - new_max)  # (B, H, N, 1)
        den = weights.cumsum(dim=2) + rescale  # (B, H, N, 1)
        num = torch.addcmul((weights * values).cumsum(dim=2), old_pooled, rescale)  # (B, H, N, d)
    # A prefix with no real token yet (only padding) has den = 0 and pools to zero. Every other den
    # is positive (>= 1 from the running max's own token on), so clamping den to the tiniest float
    # changes nothing else: one operation where no gradient is needed. Under autograd the clamp would
    # give -num / den^2 = 0/0 = NaN gradients there; dividing by 1 instead keeps them zero.
    if num.requires_grad or den.requires_grad:
        pooled = num / torch.where(den > 0, den, 1.0)
    else:
        pooled = num / den.clamp_min(torch.finfo(den.dtype).tiny)
    # log(0) = -inf where only padding was seen: the floor again
    lse = (new_max + torch.log(den[:, :, -1:])).clamp_min(floor)
    return pooled, (lse, pooled[:, :, -1:])


def softmax_pool_reference(scores, values, mask=None, state=None, *, causal=False, return_state=False):
    """`softmax_pool` computed naively: for each position, a softmax over the scores it sees, the
    earlier tokens' state entering as one more score (its log-sum-exp) with its pooling as value."""
    batch, heads, length, dim = values.shape
    keep = torch.ones(batch, length, dtype=torch.bool) if mask is None else mask.bool().cpu()

    def pool(b, h, last):
        """The pooling of row (b, h) over the real positions up to `last` and the state."""
        terms = [(scores[b, h, j, 0], values[b, h, j]) for j in range(last + 1) if keep[b, j]]
        if state is not None:  # "nothing seen yet" (the lowest float) weighs nothing beside a real token
            terms.append((state[0][b, h, 0, 0], state[1][b, h, 0]))
        if not terms:
            return values.new_zeros(dim), values.new_tensor(torch.finfo(values.dtype).min)
        logits = torch.stack([s for s, _ in terms])
        return torch.softmax(logits, 0) @ torch.stack([v for _, v in terms]), torch.logsumexp(logits, 0)

    rows = range(length) if causal else [length - 1]
    pooled = values.new_zeros(batch, heads, len(rows), dim)
    lse = values.new_zeros(batch, heads, 1, 1)
    for b in range(batch):
        for h in range(heads):
            for row, last in enumerate(rows):
                pooled[b, h, row], total = pool(b, h, last)
            lse[b, h, 0, 0] = total
    return pooled, ((lse, pooled[:, :, -1:].clone()) if return_state else None)
