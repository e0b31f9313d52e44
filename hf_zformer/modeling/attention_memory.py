"""A windowed zformer layer with a recall memory: a fixed number of older tokens, per key/value head,
that stay softmax keys because the layer's linear state would recall them worst (LoLA-style sparse
memory, no training needed). `attention_llama.RotaryLinearAttention` runs it when
`attention_memory` > 0.

Each query i of a sequence attends with one normalisation to

- softmax keys, weight g exp(q_i . k_j / sqrt(d_h) - m_i): the first S real tokens (sinks), the M
  memory slots of its key/value head, and the recent tokens p <= j <= i, where p is the first token not yet
  placed; i - p + 1 is between W and W + C - 1 (W `attention_window`, C `attention_memory_chunk`).
  Queries and keys carry the rotary positions of their places in the text, or, with
  `attention_memory_positions="cache"`, of their places in the cache, as StreamingLLM positions its
  cache: the sinks at 0..S-1, the memory slots next in the order of their tokens, then the recent
  tokens, the query at its own place among them (the cache then keeps unrotated keys);
- the linear state, weight (1 - g) phi(q_i) . phi(k_j) r^(i - W - j), over every placed token that
  is in no memory slot (r the fading factor with `feature_map_horizon`, else 1).

Placement happens once C tokens have left the W-token window: those C tokens (sinks aside) and the
M memory tokens of each key/value head are scored by how badly a state holding all of them would
recall their value (self-recall), summed over the query heads that share the pair, || v_j - S_v^T phi(k_j) / s_z^T phi(k_j) ||^2 with (S_v, s_z) the state
plus every candidate's phi(k) [v, 1]^T at full weight (a faded weight would make the oldest held
tokens the worst recalled, and the memory would keep them for good); the M worst stay in memory,
the others join the state with their faded weights. A memory slot costs what a key/value pair of
the source's cache costs (and the key the maps read): the query heads of a group share it, as they
share the pair. The schedule depends only on a sequence's real tokens, so a prompt read at once or
in parts, with or without left padding, gives the same outputs, and the cache holds at most
S + M + W + C - 1 keys and values per key/value head besides the state: constant in the generated
length.

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

import torch

from .blocks import at_least_fp32, no_autocast
from .cache_zformer import RecurrentLayer


class MemoryStateLayer(RecurrentLayer):
    """Cache layer of a windowed zformer layer with a recall memory: one dict per batch row (rows
    differ in how many real tokens they have seen), fields `seen` and `placed` (counts of real
    tokens), `recent_keys`, `recent_values`, `recent_feature_keys` (H_kv, R, d), `sink_keys`,
    `sink_values` (H_kv, <= S, d), `memory_keys`, `memory_values`, `memory_feature_keys`
    (H_kv, <= M, d), `memory_index` (H_kv, <= M) and `state` (H, F, d + 1) in fp32 or None."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] | None = None

    def tensors(self):
        return [t for row in self.rows or [] for t in row.values() if isinstance(t, torch.Tensor)]

    def state_tensors(self):
        return []  # one dict per row, of shapes that differ between rows: nothing batched to show

    @property
    def has_previous_state(self) -> dict[int, bool]:
        return {0: self.rows is not None}

    def batch_rows(self) -> int | None:
        return None if self.rows is None else len(self.rows)

    def _map(self, function):
        for row in self.rows or []:
            for name, value in row.items():
                if isinstance(value, torch.Tensor):
                    row[name] = function(value)

    def _pick(self, indices: list[int]) -> None:
        self.rows = [dict(self.rows[i]) for i in indices]  # tensors are replaced, never written in place

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._pick(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._pick([i for i in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._pick(torch.arange(len(self.rows))[indices.cpu() if isinstance(indices, torch.Tensor) else indices].tolist())


def new_row(heads_kv: int, head_dim: int, device, dtype) -> dict:
    empty = torch.zeros(heads_kv, 0, head_dim, device=device, dtype=dtype)
    return {"seen": 0, "placed": 0, "recent_keys": empty, "recent_values": empty, "recent_feature_keys": empty,
            "sink_keys": empty, "sink_values": empty, "memory_keys": None, "memory_values": None,
            "memory_feature_keys": None, "memory_index": None, "state": None}


def memory_self_attention(query, key, value, attention_mask, layer, *, window: int, sinks: int, slots: int,
                          chunk: int, query_map, key_map, window_gate, scaling: float, groups: int,
                          decay: torch.Tensor | None = None, feature_inputs: tuple | None = None,
                          rotate_at=None) -> torch.Tensor:
    """The module docstring's attention for N new tokens. query (B, H, N, d), key and value (B, H_kv,
    N, d) rotated at their places in the text, or unrotated with `rotate_at(x, positions)` (positions
    by place in the cache, see the module); `feature_inputs` (queries, keys) what the maps read instead
    (unrotated) or None;
    attention_mask (B, >= N) 1 at real tokens or None; `layer` a `MemoryStateLayer` or None (a
    whole sequence without cache). Returns the context (B, H, N, d) in fp32, zero at padding."""
    batch, heads, length, head_dim = query.shape
    feature_query, feature_key = (query, key) if feature_inputs is None else feature_inputs
    with no_autocast(query.device.type):
        query, key, value, feature_query, feature_key = at_least_fp32(query, key, value, feature_query, feature_key)
        if layer is not None and layer.rows is None:
            layer.lazy_initialization(key, value)
            layer.rows = [new_row(key.shape[1], head_dim, key.device, key.dtype) for _ in range(batch)]
        rows = layer.rows if layer is not None else [new_row(key.shape[1], head_dim, key.device, key.dtype)
                                                     for _ in range(batch)]
        if len(rows) != batch:
            raise ValueError(f"the cache holds {len(rows)} sequences, this batch {batch}")
        real = None if attention_mask is None else attention_mask[:, attention_mask.shape[1] - length:].bool()
        share = torch.sigmoid(window_gate.float())[:, None, None]  # (H, 1, 1)
        context = query.new_zeros(batch, heads, length, head_dim)
        settings = dict(window=window, sinks=sinks, slots=slots, chunk=chunk, query_map=query_map, key_map=key_map,
                        share=share, scaling=scaling, groups=groups, decay=decay, rotate_at=rotate_at)
        for b, row in enumerate(rows):
            where = slice(None) if real is None else real[b].nonzero().squeeze(1)
            context[b, :, where] = _row(row, query[b][:, where], key[b][:, where], value[b][:, where],
                                        feature_query[b][:, where], feature_key[b][:, where], settings)
    if layer is not None:
        layer.num_tokens += length
    return context


def _row(row: dict, query, key, value, feature_query, feature_key, s: dict) -> torch.Tensor:
    """One sequence's real new tokens (query (H, L, d), the others (H_kv, L, d)) through the
    memory attention, segment by segment between placements; updates `row`, returns (H, L, d)."""
    outputs, start, length = [], 0, query.shape[1]
    while start < length:
        placement_at = row["placed"] + s["window"] + s["chunk"]  # real tokens seen when the next placement runs
        end = min(length, start + placement_at - row["seen"])
        outputs.append(_segment(row, query[:, start:end], key[:, start:end], value[:, start:end],
                                feature_query[:, start:end], feature_key[:, start:end], s))
        start = end
        if row["seen"] == placement_at:
            _place(row, s)
    return torch.cat(outputs, 1) if outputs else query.new_zeros(query.shape)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, 0) if groups > 1 else x


def _segment(row: dict, query, key, value, feature_query, feature_key, s: dict) -> torch.Tensor:
    """Queries of one segment (no placement inside it): softmax over the sinks, the memory and the
    recent tokens up to each query, plus the linear state faded to each query's position."""
    groups, count = s["groups"], query.shape[1]
    recent_keys = torch.cat([row["recent_keys"], key], 1)
    recent_values = torch.cat([row["recent_values"], value], 1)
    row["recent_feature_keys"] = torch.cat([row["recent_feature_keys"], feature_key], 1)
    row["recent_keys"], row["recent_values"] = recent_keys, recent_values
    keys, values = [row["sink_keys"], recent_keys], [row["sink_values"], recent_values]
    if row["memory_keys"] is not None:
        keys.insert(1, row["memory_keys"])
        values.insert(1, row["memory_values"])
    keys, values = torch.cat(keys, 1), _repeat(torch.cat(values, 1), groups)
    total, older = keys.shape[1], recent_keys.shape[1] - count  # recent tokens before this segment
    if s["rotate_at"] is not None:  # positions by place in the cache: key j at j, the queries last
        keys = s["rotate_at"](keys, torch.arange(total, device=query.device))
        query = s["rotate_at"](query, torch.arange(total - count, total, device=query.device))
    scores = torch.einsum("hqd,hkd->hqk", query, _repeat(keys, groups)) * s["scaling"]  # (H, L, K)
    # recent key r (the last recent_keys.shape[1] columns) is visible to query t when r <= older + t
    recent_index = torch.arange(recent_keys.shape[1], device=query.device)
    hidden = recent_index[None, :] > older + torch.arange(count, device=query.device)[:, None]
    mask = torch.zeros(count, total, dtype=torch.bool, device=query.device)
    mask[:, total - recent_keys.shape[1]:] = hidden
    scores = scores.masked_fill(mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = s["share"] * torch.exp(scores - top)
    numerator = torch.einsum("hqk,hkd->hqd", weights, values)
    denominator = weights.sum(-1, keepdim=True)
    state = row["state"]
    if state is not None:
        features = s["query_map"](feature_query[None])[0]  # (H, L, F)
        linear = torch.einsum("hqf,hfe->hqe", features, state)  # (H, L, d + 1), as seen by the first query
        if s["decay"] is not None:
            steps = torch.arange(count, device=query.device, dtype=state.dtype)
            linear = linear * (s["decay"].to(state.dtype)[:, None] ** steps[None, :])[..., None]
            row["state"] = state * (s["decay"].to(state.dtype) ** count)[:, None, None]
        numerator = numerator + (1 - s["share"]) * linear[..., :-1]
        denominator = denominator + (1 - s["share"]) * linear[..., -1:]
    row["seen"] += count
    return numerator / denominator


def _place(row: dict, s: dict) -> None:
    """The oldest `chunk` recent tokens leave: sinks to the sinks, the rest with the memory scored by
    their self-recall error (read back from the state plus every candidate); the `slots` worst
    recalled per key/value head (summed over its query heads) stay in memory, the others join the state with their faded weights."""
    chunk, groups, placed = s["chunk"], s["groups"], row["placed"]
    leaving = slice(0, chunk)
    keys, values = row["recent_keys"][:, leaving], row["recent_values"][:, leaving]
    feature_keys = row["recent_feature_keys"][:, leaving]
    for name in ("recent_keys", "recent_values", "recent_feature_keys"):
        row[name] = row[name][:, chunk:]
    row["placed"] = placed + chunk
    to_sinks = max(0, min(s["sinks"] - placed, chunk))
    if to_sinks:
        row["sink_keys"] = torch.cat([row["sink_keys"], keys[:, :to_sinks]], 1)
        row["sink_values"] = torch.cat([row["sink_values"], values[:, :to_sinks]], 1)
        keys, values, feature_keys = keys[:, to_sinks:], values[:, to_sinks:], feature_keys[:, to_sinks:]
    index = torch.arange(placed + to_sinks, placed + chunk, device=keys.device).expand(keys.shape[0], -1)
    if row["memory_keys"] is not None:
        keys = torch.cat([row["memory_keys"], keys], 1)
        values = torch.cat([row["memory_values"], values], 1)
        feature_keys = torch.cat([row["memory_feature_keys"], feature_keys], 1)
        index = torch.cat([row["memory_index"], index], 1)
    features = s["key_map"](_repeat(feature_keys, groups)[None])[0]  # (H, M + c, F)
    weight = torch.ones_like(features[..., 0])
    if s["decay"] is not None:  # token j as the next query (real index `seen`) sees it: r^(seen - W - j)
        age = (row["seen"] - s["window"] - _repeat(index, groups)).to(features.dtype)
        weight = s["decay"].to(features.dtype)[:, None] ** age
    pairs = _repeat(torch.cat([values, torch.ones_like(values[..., :1])], -1), groups)  # [v, 1] per query head
    # self-recall: each candidate read back from the state that holds every candidate (itself too), each
    # at full weight whatever its age, so that a token held long is ranked as a new one would be
    candidates = torch.einsum("hkf,hke->hfe", features, pairs)
    state = row["state"]
    recalled = torch.einsum("hkf,hfe->hke", features, candidates if state is None else state + candidates)
    error = (pairs[..., :-1] - recalled[..., :-1] / recalled[..., -1:].clamp_min(1e-30)).pow(2).sum(-1)
    error = error.view(keys.shape[0], groups, -1).sum(1)  # (H_kv, M + c): the heads that share the pair
    keep = min(s["slots"], keys.shape[1])
    kept = error.topk(keep, dim=1).indices.sort(1).values  # (H_kv, keep), in order of age
    stays = torch.zeros_like(error, dtype=torch.bool).scatter(1, kept, True)
    pick = lambda t: t.gather(1, kept[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
    row["memory_keys"], row["memory_values"] = pick(keys), pick(values)
    row["memory_feature_keys"], row["memory_index"] = pick(feature_keys), index.gather(1, kept)
    added = torch.einsum("hkf,hk,hke->hfe", features, weight * _repeat(~stays, groups).to(weight.dtype), pairs)
    row["state"] = added if state is None else state + added


__all__ = ["MemoryStateLayer", "memory_self_attention"]
