"""Session 18 (2026-11-25), tried and not kept: Zformer's short form `(Q K^T) V` as one autograd Function
(head-batch copies fused with the dtype cast, the scale applied in place, its gradient one `dot`, all
gradients written contiguous). Equal to `ZformerAttention._short_context` in fp64 (short_context_module.py)."""
import math, torch
from torch.autograd.function import once_differentiable

def _to_heads(x, heads, dtype):
    """(B, N, H*d) -> new (B*H, N, d) in `dtype`: the head-batch copy and the dtype cast in one pass."""
    batch, length, width = x.shape
    out = x.new_empty((batch, heads, length, width // heads), dtype=dtype)
    out.copy_(x.view(batch, length, heads, width // heads).transpose(1, 2))
    return out.view(batch * heads, length, width // heads)

def _from_heads(x, batch, dtype):
    """(B*H, N, d) -> new (B, N, H*d) in `dtype`."""
    bh, length, dim = x.shape
    heads = bh // batch
    out = x.new_empty((batch, length, heads, dim), dtype=dtype)
    out.copy_(x.view(batch, heads, length, dim).transpose(1, 2))
    return out.view(batch, length, heads * dim)

class ShortLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, log_scale, log_factor, heads, causal):
        batch, head_dim = query.shape[0], query.shape[2] // heads
        dtype = torch.promote_types(query.dtype, torch.float32)
        scale = torch.exp(log_factor - log_scale.detach().to(dtype))
        scale_scores = key.shape[1] <= head_dim
        q = _to_heads(query, heads, dtype)
        k = _to_heads(key, heads, dtype)
        v = _to_heads(value, heads, dtype)
        if not scale_scores:
            q.mul_(scale)
        scores = torch.bmm(q, k.transpose(1, 2))
        if scale_scores:
            scores.mul_(scale)
        if causal and scores.shape[1] > 1:
            scores.tril_()
        context = torch.bmm(scores, v)
        ctx.save_for_backward(q, k, v, scores, scale)
        ctx.meta = (batch, heads, causal, scale_scores, query.dtype, key.dtype, value.dtype, log_scale.dtype)
        return _from_heads(context, batch, query.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, scores, scale = ctx.saved_tensors
        batch, heads, causal, scale_scores, qd, kd, vd, ld = ctx.meta
        g = _to_heads(grad, heads, scores.dtype)
        grad_scores = torch.bmm(g, v.transpose(1, 2))
        grad_value = torch.bmm(scores.transpose(1, 2), g)
        grad_log_scale = -torch.dot(grad_scores.view(-1), scores.view(-1))
        if causal and grad_scores.shape[1] > 1:
            grad_scores.tril_()
        if scale_scores:
            grad_scores.mul_(scale)
        grad_query = torch.bmm(grad_scores, k)
        if not scale_scores:
            grad_query.mul_(scale)
        grad_key = torch.bmm(grad_scores.transpose(1, 2), q)
        return (_from_heads(grad_query, batch, qd), _from_heads(grad_key, batch, kd), _from_heads(grad_value, batch, vd),
                grad_log_scale.to(ld), None, None, None)

def new_short_context(self, hidden_states, source, source_mask):
    from hf_zformer.modeling import attention as A
    with A._no_autocast(hidden_states.device.type):
        return ShortLinearAttention.apply(self.query(hidden_states), A._zero_padding(self.key(source), source_mask),
                                          self.value(source), self.log_scale, math.log(self.head_dim**-0.5),
                                          self.num_heads, self.is_causal)
