"""Session 19 (2026-11-25): zformer's short form with Q, K, V projected straight into head-major
batches (H, B*N, d) by one `baddbmm` each over the (shared, expanded) input, instead of a Linear and a
head-batch copy. One module (bidirectional / causal / cross), 4 x 32 tokens, forward + backward, paired
rounds; fp64 equality of outputs and gradients first. Run: `python docs/bench/s19_components/head_major.py 300`."""
import sys, time, statistics, torch
from hf_zformer.modeling.configuration_zformer import ZformerConfig
from hf_zformer.modeling import attention as A
from hf_zformer.modeling.attention import ZformerAttention
from hf_zformer.memory import retain_freed_memory; retain_freed_memory()
from hf_zformer.benchmark import paired_ratio_interval
torch.set_num_threads(2)
old = ZformerAttention._short_context


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


cfg = ZformerConfig(hidden_size=512, num_attention_heads=8, attention_type='zformer', attention_probs_dropout_prob=0.0)
x = torch.randn(4, 32, 512); mem = torch.randn(4, 32, 512)
for role in ('self', 'causal', 'cross'):
    torch.manual_seed(0); m = ZformerAttention(cfg, is_causal=role == 'causal', is_cross=role == 'cross', layer_idx=0).double()
    torch.nn.init.constant_(m.log_scale, 1.0)
    outs = []
    for f in (old, head_major):
        ZformerAttention._short_context = f; m.zero_grad()
        h = x.double().clone().requires_grad_(True); e = mem.double().clone().requires_grad_(True)
        o = m(h, None, memory=e)[0] if role == 'cross' else m(h)[0]
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        outs.append([o.detach(), h.grad, e.grad if role == 'cross' else None] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*outs):
        if a is not None: torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
print('fp64 equal')
mods = {}
for role in ('self', 'causal', 'cross'):
    torch.manual_seed(0); mods[role] = ZformerAttention(cfg, is_causal=role == 'causal', is_cross=role == 'cross', layer_idx=0)
def run(role):
    for p in mods[role].parameters(): p.grad = None
    h = x.clone().requires_grad_(True)
    if role == 'cross': e = mem.clone().requires_grad_(True); out = mods[role](h, None, memory=e)[0]
    else: out = mods[role](h)[0]
    out.sum().backward()
T = {}
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
    for role in mods:
        for name, f in (('old', old), ('new', head_major)):
            ZformerAttention._short_context = f
            t0 = time.perf_counter(); run(role); d = time.perf_counter() - t0
            if it >= 20: T.setdefault((role, name), []).append(d)
for role in mods:
    print(role, round(statistics.median(T[role, 'old']) * 1e3, 3), round(statistics.median(T[role, 'new']) * 1e3, 3),
          [round(v, 3) for v in paired_ratio_interval(T[role, 'new'], T[role, 'old'])])
