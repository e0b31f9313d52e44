"""Self-attention of Llama-family decoders (`modeling_zformer_llama`): rotary positions and grouped
key/value heads around the sequence operations of `ops.py`.

Every class keeps Llama's projections and names (`q_proj`, `k_proj`, `v_proj`, `o_proj`; query
heads H, key/value heads H_kv dividing H), so a Llama checkpoint's attention weights load as they
are, and follows one protocol: `forward(hidden_states (B, N, D), position_embeddings (cos, sin),
attention_mask (B, past + N) 1 at real tokens or None, cache) -> (B, N, D)`. Decoding state lives
in the cache layer of the module's `layer_idx` (`cache_zformer_llama.ZformerLlamaCache`): keys and
values for softmax attention, a fixed-size state for the others.

- `RotarySoftmaxAttention` ("full"): the source's attention, exactly.
- `RotaryLinearAttention` ("zformer"): linear attention over the rotated queries and keys, with the
  identity map (`Q (K^T V) / (sqrt(d_h) s)`) or the Hedgehog map (normalised), optionally with a
  softmax window over the last W tokens sharing the Hedgehog weights' normalisation
  (`windowed_linear_attention`).
- `RotaryFastformerAttention` ("fastformer"): causal additive attention (prefix softmax poolings).

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

import math

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from .attention import HedgehogFeatureMap, windowed_self_attention
from .attention_memory import memory_self_attention
from .blocks import at_least_fp32, merge_heads, new_tokens_mask, no_autocast
from .ops import linear_attention, normalize, softmax_pool, windowed_linear_attention, with_ones


class RotaryAttention(nn.Module):
    """Llama's projections, rotary positions and grouped key/value heads; subclasses attend."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.groups = self.num_heads // self.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def _heads(self, projection: nn.Linear, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, N, D) through `projection`, as (B, heads, N, d_h)."""
        batch, length, _ = x.shape
        return projection(x).view(batch, length, heads, self.head_dim).transpose(1, 2)

    def projections(self, hidden_states, position_embeddings, rotate: bool = True):
        """Queries (B, H, N, d), keys and values (B, H_kv, N, d); queries and keys rotated unless
        `rotate=False`."""
        query = self._heads(self.q_proj, hidden_states, self.num_heads)
        key = self._heads(self.k_proj, hidden_states, self.num_key_value_heads)
        value = self._heads(self.v_proj, hidden_states, self.num_key_value_heads)
        if rotate:
            cos, sin = position_embeddings
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None) -> torch.Tensor:
        """(B, N, D) -> (B, N, D), through `o_proj`; see the module docstring."""
        context = self.context(hidden_states, position_embeddings, attention_mask, cache)  # (B, H, N, d)
        return self.o_proj(merge_heads(context.to(hidden_states.dtype)))

    def context(self, hidden_states, position_embeddings, attention_mask, cache) -> torch.Tensor:
        raise NotImplementedError

    def _layer(self, cache):
        return None if cache is None else cache.layers[self.layer_idx]


class RotarySoftmaxAttention(RotaryAttention):
    """Llama's softmax attention: softmax(q k^T / sqrt(d_h)) v over the keys j <= i, keys and values
    of the H_kv heads shared by H / H_kv query heads. Keys and values append to the layer's
    `DynamicLayer` (`cache.update`). A padded query sees itself, so that every output is finite."""

    def context(self, hidden_states, position_embeddings, attention_mask, cache):
        query, key, value = self.projections(hidden_states, position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # (B, H_kv, past + N, d)
        queries, keys = query.shape[2], key.shape[2]
        key, value = repeat_kv(key, self.groups), repeat_kv(value, self.groups)
        mask = attention_mask  # None when it had no padding (the model drops a full mask once per forward)
        if mask is None and queries == keys:
            return nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scaling)
        if mask is not None and mask.shape[1] != keys:
            raise ValueError(f"attention_mask covers {mask.shape[1]} tokens, the keys {keys} (cached and new tokens)")
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
        if mask is not None:
            itself = torch.zeros_like(allowed).diagonal_scatter(
                torch.ones(queries, dtype=torch.bool, device=query.device), keys - queries)
            allowed = (allowed & mask.bool()[:, None, None, :]) | itself
        return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=self.scaling)


class RotaryLinearAttention(RotaryAttention):
    """Zformer linear attention over the rotated queries and keys (keys and values of the H_kv
    heads repeated to the H query heads), causal with a constant-size state.

    - `zformer_feature_map="identity"`: out_i = q_i (sum_{j<=i} k_j^T v_j) / (sqrt(d_h) s), `s` a
      learnable scale per layer (stored as `log_scale`); state (B, H, d, d).
    - `"hedgehog"`: normalised attention over phi(q), phi(k), one `HedgehogFeatureMap` for the
      queries and one for the keys (per query head, identity at init); state (B, H, 2 d, d + 1).
      With a window W (`attention_window`), the last W tokens take softmax weights instead, sharing
      the normalisation (`windowed_linear_attention`, share g = sigmoid(`window_gate`) per head,
      0.5 at init); the cache then keeps the last W - 1 rotated keys and values besides the state.
      With `feature_map_horizon` the feature-map weights fade with age, exp(-age / tau) per head,
      tau learned (`log_horizon`, starting at the configured number of tokens). With
      `rotary_feature_maps=False` the maps of a windowed layer read the unrotated queries and keys:
      the feature-map part then does not depend on absolute positions.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.window = config.layer_windows()[layer_idx]
        self.sinks = config.attention_sinks if self.window else 0
        if config.zformer_feature_map == "hedgehog":
            self.query_map = HedgehogFeatureMap(self.num_heads, self.head_dim)
            self.key_map = HedgehogFeatureMap(self.num_heads, self.head_dim)
            self.register_parameter("log_scale", None)
        else:
            self.query_map = self.key_map = None
            self.log_scale = nn.Parameter(torch.full((1,), math.log(config.zformer_scale_init)))
        if self.window:
            self.window_gate = nn.Parameter(torch.zeros(self.num_heads))
        else:
            self.register_parameter("window_gate", None)
        self.rotary_maps = config.rotary_feature_maps or not self.window
        self.memory = config.attention_memory if self.window else 0
        self.memory_chunk = config.attention_memory_chunk
        self.horizon_init = config.feature_map_horizon if self.window else 0
        if self.horizon_init:  # log of each head's time constant (tokens) for the feature-map part's fading
            self.log_horizon = nn.Parameter(torch.full((self.num_heads,), math.log(self.horizon_init)))
        else:
            self.register_parameter("log_horizon", None)

    def decay(self) -> torch.Tensor | None:
        """Per head, the factor exp(-1 / tau) by which a feature-map weight fades per token of age
        (tau = exp(`log_horizon`)), or None without fading."""
        return None if self.log_horizon is None else torch.exp(-torch.exp(-self.log_horizon))

    def context(self, hidden_states, position_embeddings, attention_mask, cache):
        length = hidden_states.shape[1]
        layer = self._layer(cache)
        if self.window:
            return self._windowed(hidden_states, position_embeddings, attention_mask, layer)
        query, key, value = self.projections(hidden_states, position_embeddings)
        key, value = repeat_kv(key, self.groups), repeat_kv(value, self.groups)
        mask = new_tokens_mask(attention_mask, length)
        state = None if layer is None else layer.state
        if self.query_map is None:
            scale = torch.exp(math.log(self.scaling) - self.log_scale)  # 1 / (sqrt(d_h) s)
            context, state = linear_attention(query, key, value, mask, state, causal=True, scale=scale,
                                              return_state=layer is not None)
        else:
            key_features = self._key_features(key, mask)
            context, state = linear_attention(self.query_map(query), key_features, with_ones(at_least_fp32(value)[0]),
                                              None, state, causal=True, return_state=layer is not None)
            with no_autocast(context.device.type):
                context = normalize(context)
        if layer is not None:
            layer.store(state, length)
        return context

    def _key_features(self, key, mask):
        """phi(k) (B, H, N, 2 d), zero at padding (phi(0) is not zero)."""
        features = self.key_map(key)
        return features if mask is None else features * mask.to(features.dtype)[:, None, :, None]

    def _windowed(self, hidden_states, position_embeddings, attention_mask, layer):
        query, key, value = self.projections(hidden_states, position_embeddings, rotate=self.rotary_maps)
        feature_inputs = None
        if not self.rotary_maps:  # the maps read the unrotated projections, the softmax the rotated ones
            feature_inputs = (query, key)
            query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if self.memory:
            return memory_self_attention(query, key, value, attention_mask, layer, window=self.window, sinks=self.sinks,
                                         slots=self.memory, chunk=self.memory_chunk, query_map=self.query_map,
                                         key_map=self.key_map, window_gate=self.window_gate, scaling=self.scaling,
                                         groups=self.groups, decay=self.decay(), feature_inputs=feature_inputs)
        return windowed_self_attention(query, key, value, attention_mask, layer, self.window, self.query_map,
                                       self.key_map, self.window_gate, self.scaling, groups=self.groups,
                                       sinks=self.sinks, decay=self.decay(), feature_inputs=feature_inputs)


class RotaryFastformerAttention(RotaryAttention):
    """Causal Fastformer (additive) attention on Llama's projections, per query head (keys and
    values of the H_kv heads repeated): alpha = prefix softmax of w_q . q_i / sqrt(d_h), global query
    q_g,i = sum_{j<=i} alpha_j q_j; p_i = q_g,i * k_i; global key k_g,i likewise from p with w_k;
    r_i = W_r (k_g,i * v_i) + q_i, then `o_proj`. The projections are not rotated: the poolings mix
    positions into one vector per head, which rotations would scramble. w_q and w_k start at zero
    (mean poolings), W_r (`transform`, no bias) at the model's init. State: the two poolings'
    log-sum-exp and running pooling per head (`FastformerStateLayer`)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.query_score = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.key_score = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        width = self.num_heads * self.head_dim
        self.transform = nn.Linear(width, width, bias=False)

    def _scores(self, x, weight):
        return (x * (weight * self.scaling).to(x.dtype)[:, None, :]).sum(-1, keepdim=True)

    def context(self, hidden_states, position_embeddings, attention_mask, cache):
        query, key, value = self.projections(hidden_states, position_embeddings, rotate=False)
        key, value = repeat_kv(key, self.groups), repeat_kv(value, self.groups)
        length = hidden_states.shape[1]
        layer = self._layer(cache)
        mask = new_tokens_mask(attention_mask, length)
        mask = None if mask is None else mask.bool()
        keep = layer is not None
        with no_autocast(hidden_states.device.type):
            query32, key32 = at_least_fp32(query, key)
            global_query, query_pool = softmax_pool(self._scores(query32, self.query_score), query32, mask,
                                                    layer.query_pool if keep else None, causal=True, return_state=keep)
            mixed = global_query * key32
            global_key, key_pool = softmax_pool(self._scores(mixed, self.key_score), mixed, mask,
                                                layer.key_pool if keep else None, causal=True, return_state=keep)
        if keep:
            layer.store(query_pool, key_pool, length)
        mixed_value = (global_key.to(value.dtype) * value)  # (B, H, N, d)
        transformed = self.transform(merge_heads(mixed_value))  # (B, N, H d)
        batch = hidden_states.shape[0]
        return transformed.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2) + query


LLAMA_ATTENTION_CLASSES = {
    "full": RotarySoftmaxAttention,
    "zformer": RotaryLinearAttention,
    "fastformer": RotaryFastformerAttention,
}

__all__ = ["LLAMA_ATTENTION_CLASSES", "RotarySoftmaxAttention", "RotaryLinearAttention", "RotaryFastformerAttention",
           "windowed_linear_attention"]
