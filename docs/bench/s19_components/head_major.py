"""Session 19 (2026-11-25): zformer's short form with Q, K, V projected straight into head-major
batches (H, B*N, d) by one `baddbmm` each over the (shared, expanded) input, instead of a Linear and a
head-batch copy. One module (bidirectional / causal / cross), 4 x 32 tokens, forward + backward, paired
rounds; fp64 equality of outputs and gradients first. Run: `python docs/bench/s19_components/head_major.py 300`."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s18_components"))
from short_context_module import compare_module  # noqa: E402  (the fp64 check and the paired loop)


def project(linear, x2d, heads):
    """x2d (M, D) -> (H, M, d) = x W_h^T + b_h for every head h, one baddbmm."""
    out_features, width = linear.weight.shape
    weight = linear.weight.view(heads, out_features // heads, width).transpose(1, 2)
    return torch.baddbmm(linear.bias.view(heads, 1, -1), x2d.expand(heads, *x2d.shape), weight)


def head_major(self, hidden_states, source, source_mask):
    heads = self.num_heads
    batch, length, width = hidden_states.shape
    source_length = source.shape[1]
    query = project(self.query, hidden_states.reshape(-1, width), heads).view(heads * batch, length, -1)
    key = project(self.key, source.reshape(-1, width), heads).view(heads * batch, source_length, -1)
    if source_mask is not None:
        key = key * source_mask.to(key.dtype).repeat(heads, 1)[:, :, None]
    value = project(self.value, source.reshape(-1, width), heads).view(heads * batch, source_length, -1)
    scores = torch.bmm(query, key.transpose(1, 2)) * self._scale(query.dtype)
    if self.is_causal and length > 1:
        scores = scores.tril_()
    context = torch.bmm(scores, value)  # (H * B, N, d)
    return context.view(heads, batch, length, -1).permute(1, 2, 0, 3).reshape(batch, length, width)


if __name__ == "__main__":
    compare_module(head_major, int(sys.argv[1]) if len(sys.argv) > 1 else 200)
