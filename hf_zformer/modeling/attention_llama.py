"""Self-attention of Llama-family decoders (`modeling_zformer_llama`): adapters of the attention
types of `attention.py` to Llama's projections, rotary positions and grouped key/value heads.

Every class keeps Llama's projections and names (`q_proj`, `k_proj`, `v_proj`, `o_proj`; query
heads H, key/value heads H_kv dividing H), so a Llama checkpoint's attention weights load as they
are, and follows one protocol: `forward(hidden_states (B, N, D), position_embeddings (cos, sin),
attention_mask (B, past + N) 1 at real tokens or None, cache) -> (B, N, D)`. Between the
projections and `o_proj` it runs its type's causal core, `Attention.causal_context`, the one the
encoder-decoders' decoder layers run (the class is the type's `attention.Attention` class with
`RotaryAttention` in front), given the rotation to apply where the type's form takes positions.
Decoding state lives in the cache layer of the module's `layer_idx`
(`cache_zformer_llama.ZformerLlamaCache`): keys and values for softmax attention, a fixed-size
state for the others.

- `RotarySoftmaxAttention` ("full"): the source's attention, exactly.
- `RotaryLinearAttention` ("zformer"): linear attention over the rotated queries and keys, with the
  identity map (`Q (K^T V) / (sqrt(d_h) s)`) or the Hedgehog map (normalised), optionally with a
  softmax window over the last W tokens sharing the Hedgehog weights' normalisation
  (`windowed_linear_attention`), sinks, fading feature-map weights and a recall memory.
- `RotaryFastformerAttention` ("fastformer"): causal additive attention (prefix softmax poolings).
- Any other causal type: its generic adapter (`rotary_adapter`), its own parameters built by the
  type's `build_parameters`.

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

from functools import partial

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .attention import FastformerAttention, FullAttention, ZformerAttention
from .attention_registry import AttentionClasses, attention_types, register_attention
from .blocks import split_heads
from .ops import windowed_linear_attention


class RotaryAttention(nn.Module):
    """The Llama-family adapter: Llama's projections, rotary positions and grouped key/value heads
    around the causal core of the attention class it precedes (`class X(RotaryAttention,
    SomeAttention)`). It takes the place of `Attention.__init__` (no W_o `output`, no role: causal
    self-attention) and of its `forward`; the type's own parameters come from its
    `build_parameters` after the projections."""

    def __init__(self, config, layer_idx: int):
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        self.is_causal, self.is_cross = True, False
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
        self.build_parameters(config)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None) -> torch.Tensor:
        """(B, N, D) -> (B, N, D): the unrotated queries (B, H, N, d), keys and values (B, H_kv, N, d)
        through the type's `causal_context` with the rotation by `position_embeddings` (cos, sin),
        then `o_proj`."""
        query = split_heads(self.q_proj(hidden_states), self.num_heads)
        key = split_heads(self.k_proj(hidden_states), self.num_key_value_heads)
        value = split_heads(self.v_proj(hidden_states), self.num_key_value_heads)
        cos, sin = position_embeddings
        context = self.causal_context(query, key, value, attention_mask, cache,
                                      rotate=partial(apply_rotary_pos_emb, cos=cos, sin=sin))  # (B, N, H d)
        return self.o_proj(context.to(hidden_states.dtype))


class RotarySoftmaxAttention(RotaryAttention, FullAttention):
    """Llama's softmax attention: softmax(q k^T / sqrt(d_h)) v over the keys j <= i, keys and values
    of the H_kv heads shared by H / H_kv query heads, through `scaled_dot_product_attention`. Keys
    and values append to the layer's `DynamicLayer` (`cache.update`). A padded query sees itself,
    so that every output is finite."""

    def build_parameters(self, config) -> None:
        self.dropout = 0.0

    def _attention_function(self, output_attentions: bool):
        return ALL_ATTENTION_FUNCTIONS["sdpa"]


class RotaryLinearAttention(RotaryAttention, ZformerAttention):
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
      the feature-map part then does not depend on absolute positions. With `attention_memory`,
      a recall memory besides the window (`attention_memory.py`).
    """

    def build_parameters(self, config) -> None:
        self.scale_init = float(config.zformer_scale_init)
        self._build_feature_maps(config)
        self._build_window(config, config.layer_windows()[self.layer_idx])


class RotaryFastformerAttention(RotaryAttention, FastformerAttention):
    """Causal Fastformer (additive) attention on Llama's projections, per query head (keys and
    values of the H_kv heads repeated): alpha = prefix softmax of w_q . q_i / sqrt(d_h), global query
    q_g,i = sum_{j<=i} alpha_j q_j; p_i = q_g,i * k_i; global key k_g,i likewise from p with w_k;
    r_i = W_r (k_g,i * v_i) + q_i, then `o_proj`. The projections are not rotated: the poolings mix
    positions into one vector per head, which rotations would scramble. w_q and w_k start at zero
    (mean poolings), W_r (`transform`, no bias) at the model's init. State: the two poolings'
    log-sum-exp and running pooling per head (`FastformerStateLayer`)."""

    def build_parameters(self, config) -> None:
        self.additive = True
        self.query_score = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.key_score = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        width = self.num_heads * self.head_dim
        self.transform = nn.Linear(width, width, bias=False)

    def init_parameters(self, std: float) -> None:  # mean poolings at init
        init.zeros_(self.query_score)
        init.zeros_(self.key_score)


def rotary_adapter(attention_class: type) -> type:
    """The Llama-family class of an `Attention` class: `RotaryAttention` in front of it."""
    return type(f"Rotary{attention_class.__name__}", (RotaryAttention, attention_class),
                {"__doc__": f"`{attention_class.__name__}` adapted to Llama-family decoders (`RotaryAttention`)."})


def llama_attention_class(entry) -> type:
    """The Llama-family class of a registry entry: its own, or the generic adapter of its
    `Attention` class (made once, then kept in the entry)."""
    if entry.llama is None:
        if entry.encoder is None:
            raise ValueError(f"attention type {entry.name!r} has no Attention class to adapt")
        entry.llama = rotary_adapter(entry.encoder)
    return entry.llama


register_attention("full", llama=RotarySoftmaxAttention)
register_attention("zformer", llama=RotaryLinearAttention)
register_attention("fastformer", llama=RotaryFastformerAttention)

# type name -> Llama-family class, for every causal type: a view of the registry
LLAMA_ATTENTION_CLASSES = AttentionClasses(attention_types(causal=True), llama_attention_class)

__all__ = ["LLAMA_ATTENTION_CLASSES", "RotaryAttention", "RotarySoftmaxAttention", "RotaryLinearAttention",
           "RotaryFastformerAttention", "rotary_adapter", "windowed_linear_attention"]
