"""The attention family: full (softmax), Zformer, Xformer and Fastformer.

Every class follows one protocol (`Attention`): the same constructor and forward, its own output
projection `output` (so the folded bidirectional forms can merge it into their per-sequence
matrix, `_apply_folded`); the layer adds the residual. Shared building blocks (head reshapes, masks,
the projections' stacked form) are in `blocks.py`. `attention_mask` is a `(B, N)` tensor, 1/True at real tokens and
0/False at padding; padded positions never influence real ones, so outputs at real positions are
exactly invariant to extra padding. Sums over the sequence run in fp32 with autocast disabled
(linear-attention sums overflow fp16 and lose precision in bf16).

Causal (decoder) forms keep their state in a cache (`cache_zformer.ZformerCache`) whose size, for
Zformer and Fastformer, does not depend on the number of tokens seen: feeding a sequence in one
call or token by token gives the same outputs. Their core (`Attention.causal_context`, on heads)
is also the core of the Llama-family decoders' attention, which adapts these classes to Llama's
projections, rotary positions and grouped key/value heads (`attention_llama.RotaryAttention`).

Each type is registered in the one table of attention types (`attention_registry`), from which
every list of types and `ATTENTION_CLASSES` are derived; docs/models.md says how to add one.

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, repeat_kv, rotate_half
from transformers.utils import logging

from .attention_memory import memory_self_attention
from .attention_registry import AttentionClasses, attention_types, register_attention
from .blocks import (
    add_into_fresh,
    at_least_fp32,
    autocast_input,
    masked_softmax,
    merge_heads,
    new_tokens_mask,
    no_autocast,
    plain_linears,
    project,
    split_heads,
    stacks_projections,
    zero_padding,
)
from .cache_zformer import FastformerStateLayer, ZformerStateLayer
from .ops import (
    add_key_value_products,
    column_scaled,
    column_scaled_product,
    direction_pool,
    direction_scores,
    hedgehog_features,
    linear_attention,
    normalize,
    normalized_attention_weights,
    shared_rows,
    softmax_pool,
    windowed_decode_step,
    windowed_linear_attention,
    with_ones,
)
from .policy import active

logger = logging.get_logger(__name__)


_LIVE = object()  # `use_folded_form`'s autocast: the state in force


def use_folded_form(hidden_states: torch.Tensor, pays_off: bool, *layers: nn.Module,
                    autocast_devices: tuple[str, ...] = (), autocast_dtype=_LIVE) -> bool:
    """Whether bidirectional Zformer/Fastformer self-attention takes its folded form (see
    `ZformerAttention._folded`): where the policy's `folded` allows it, only where it does fewer
    FLOPs (`pays_off`, long sequences), with the projections `layers` plain `nn.Linear`s (the form
    reads their weights: an adapter, or a forward of its own, on one keeps the layers' own forward:
    `blocks.plain_linears`), and in fp32/fp64 outside autocast, or under bf16 autocast on the device
    types `autocast_devices` (the module's `folded_autocast`, from the policy's `folded_autocast`).
    Elsewhere under autocast the plain form keeps its low-precision projections and fp32 sequence
    sums, which on CUDA run as the fused kernels (docs/benchmarks.md, "On a GPU"). `autocast_dtype`
    (None: autocast off) stands in for the autocast state in force where given (`explain.py` asks
    about other devices)."""
    if not pays_off or not active().folded or not plain_linears(*layers):
        return False
    device_type = hidden_states.device.type
    if autocast_dtype is _LIVE:
        autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    if autocast_dtype is not None:  # bf16 only: fp16's range would overflow zformer's Gram sum
        return device_type in autocast_devices and autocast_dtype == torch.bfloat16
    return hidden_states.dtype in (torch.float32, torch.float64)


def _apply_folded(x: torch.Tensor, matrix: torch.Tensor, offset: torch.Tensor, output: nn.Module,
                  fold: bool) -> torch.Tensor:
    """`output(x @ matrix^T + offset)`: the output of a folded attention form, through its output projection.

    x (B, N, D); matrix (B, D, D) and offset (B, D) map every token of a sequence. A Linear
    projection y = W c + b of that output is itself one per-sequence map (W matrix, W offset + b),
    which costs 2 D^3 FLOPs per sequence instead of 2 N D^2, and saves a (B, N, D) intermediate: it
    is folded in where `fold` (the type's `folds_output_projection`), and applied afterwards
    otherwise (or when `output` is not a plain `Linear`: an adapter or a forward of its own is kept).
    """
    if fold and plain_linears(output):
        return torch.baddbmm(output(offset)[:, None, :], x, (output.weight @ matrix).transpose(1, 2))
    return output(torch.baddbmm(offset[:, None, :], x, matrix.transpose(1, 2)))


class Attention(nn.Module):
    """The protocol every attention type follows (BART-style: one class for every role it can play).

    `Attention(config, is_causal=False, is_cross=False, layer_idx=None)`: bidirectional
    self-attention by default; `is_causal=True` for decoder self-attention (output i sees tokens
    j <= i only); `is_cross=True` for attention from the decoder to `memory` (the encoder's output).
    A type that cannot play a role raises a ValueError naming it (`CAN_BE_CAUSAL`, `CAN_BE_CROSS`).
    `layer_idx` is the layer's index in a decoding cache.

    `forward(hidden_states, attention_mask, memory, memory_mask, cache, position_ids, output_attentions)`
    returns `(output (B, N, D), weights or None)`. The output has been through the attention's own
    output projection `output` (W_o); the layer adds the residual. Masks are 1/True at real tokens:
    `attention_mask` (B, past + N) covers the tokens a causal cache already holds and the N new ones
    (past = 0 without a cache), `memory_mask` (B, Nk) the memory. A mask is used as given: pass None
    where there is no padding (the unmasked forms are the fastest; the models drop a mask without
    padding once per forward, `blocks.drop_full_mask`, so that no layer reads a mask back to the host,
    which would wait for the GPU once per layer). Decoding state lives in `cache` (a
    `ZformerCache`): full attention's keys/values through `cache.update(...)`, a Zformer or Fastformer
    layer's fixed-size state read from and stored into `cache.layers[layer_idx]`, cross-attention's
    projected memory through `cache.update_memory(...)`. The cache only stores.
    `context(...)` gives the output before W_o (the plain form).

    A type defines its parts in `build_projections` (W_q, W_k, W_v: `_QKVAttention`'s) and
    `build_parameters` (its own), their initial values in `init_parameters`, and its causal
    self-attention on heads in `causal_context`: the core that the Llama-family adapters call too
    (`attention_llama`), with their own projections in place of `build_projections`'.
    """

    # The type's facts, as its entry in `attention_registry` has them (`register_attention` refuses a
    # class that disagrees; a type not declared there takes its facts from these): whether it can be
    # causal, cross-attention, and whether `attention_probs_dropout_prob` drops something here (types
    # that form no attention probabilities ignore it, and say so once when training with it above zero).
    ATTENTION_TYPE: str | None = None  # its name in the registry
    CAN_BE_CAUSAL = True
    CAN_BE_CROSS = True
    HAS_ATTENTION_DROPOUT = True
    # The type's name in the execution policy's `folded_autocast` (policy.py).
    POLICY_NAME = ""
    # Device types on which this module takes its folded form (`_folded_output`) under autocast too
    # (`use_folded_form`), where set on the module (the benchmark's `<type>_folded` / `<type>_plain`
    # set it); None: the policy's `folded_autocast` for the type (`folded_autocast`).
    folded_autocast_devices: tuple[str, ...] | None = None

    def __init__(self, config, *, is_causal: bool = False, is_cross: bool = False, layer_idx: int | None = None):
        super().__init__()
        kind = type(self).__name__
        if is_causal and is_cross:
            raise ValueError(f"{kind}: is_causal=True and is_cross=True: cross-attention sees the whole memory")
        if is_causal and not self.CAN_BE_CAUSAL:
            raise ValueError(f"{kind} cannot be causal (is_causal=True): it has no exact causal form")
        if is_cross and not self.CAN_BE_CROSS:
            raise ValueError(f"{kind} cannot be cross-attention (is_cross=True)")
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.is_causal = is_causal
        self.is_cross = is_cross
        self.layer_idx = layer_idx
        self.groups = 1  # query heads per key/value head (grouped heads: the Llama-family adapters)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)  # W_o
        self.build_projections(config)
        self.build_parameters(config)
        # A rate the model's every attention ignores (no layer of it forms probabilities) is worth a
        # warning; in a model with full or Xformer layers it drops theirs.
        ignored = not self.HAS_ATTENTION_DROPOUT and not config.forms_attention_probabilities()
        self.ignored_dropout = float(config.attention_probs_dropout_prob or 0.0) if ignored else 0.0

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache=None,
        position_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, N, D) -> (output (B, N, D), None); see the class docstring."""
        if output_attentions:
            raise ValueError(f"output_attentions=True: {type(self).__name__} forms no attention matrix")
        if self.training and self.ignored_dropout and not torch.compiler.is_compiling():
            logger.warning_once(
                f"attention_probs_dropout_prob={self.ignored_dropout} does nothing in this model: "
                f"{type(self).__name__} forms no attention probabilities to drop, nor does any other layer "
                "(hidden_dropout_prob still applies). Set attention_probs_dropout_prob=0 to silence this."
            )
        if not (self.is_causal or self.is_cross):
            folded = self._folded_output(hidden_states, attention_mask)
            if folded is not None:
                return folded, None
        context = self.context(hidden_states, attention_mask, memory, memory_mask, cache, position_ids)
        return self.output(context), None

    def folded_autocast(self) -> tuple[str, ...]:
        """The device types on which this module takes its folded form under bf16 autocast."""
        own = self.folded_autocast_devices
        return own if own is not None else active().folded_autocast_devices(self.POLICY_NAME)

    def context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None) -> torch.Tensor:
        """The attention's output before its output projection (B, N, D)."""
        raise NotImplementedError

    def build_projections(self, config) -> None:
        """The input projections (built after W_o, before `build_parameters`); none by default."""

    def build_parameters(self, config) -> None:
        """The type's own modules and parameters besides its projections; none by default."""

    def init_parameters(self, std: float) -> None:
        """Set the parameters of `build_parameters` to their initial values (the models'
        `_init_weights`, under no_grad; `std` the config's `initializer_range`). `Linear` layers
        are the model's to initialise."""

    def causal_context(self, query, key, value, attention_mask, cache, rotate=None) -> torch.Tensor:
        """Causal self-attention of N new tokens on heads, the core of both model families: query
        (B, H, N, d), key and value (B, H / groups, N, d) (each key/value head serves `groups` query
        heads); attention_mask (B, past + N) 1 at real tokens, or None; `cache` the decoding cache or
        None. `rotate(query, key) -> (query, key)` applies rotary positions (the Llama-family
        adapters pass it; None: no positions), which the type applies where its form takes them.
        Returns the context (B, N, H d) before the output projection, in the type's precision
        (the caller casts it)."""
        raise NotImplementedError(f"{type(self).__name__} has no causal form")

    def _folded_output(self, hidden_states, attention_mask) -> torch.Tensor | None:
        """The bidirectional output in a folded form (the output projection merged into another
        product) where one pays off, else None."""
        return None

    @classmethod
    def folded_form_pays_off(cls, length: int, width: int, **structure) -> bool:
        """Whether bidirectional self-attention over `length` tokens of `width` does fewer FLOPs in
        the type's folded form (`_folded_output`) than in its plain one; False for a type without
        one. `structure` names the layer's own choices that change the count (Fastformer's number of
        projections). The module takes the form where `use_folded_form` also allows it (precision,
        plain layers); the benchmarks' executed FLOP counts read this same rule."""
        return False

    @classmethod
    def folds_output_projection(cls, batch: int, length: int, width: int) -> bool:
        """Whether the folded form, where taken for a (batch, length, width) input, merges the output
        projection W_o into its per-sequence map (with a plain `Linear` as W_o) rather than applying
        it to every token."""
        return False

    def _project_memory(self, memory: torch.Tensor, memory_mask: torch.Tensor | None):
        """Cross-attention: what the memory (B, Nk, D) becomes for every later query, stored in the
        cache at the first decoding step (keys and values, or K^T V). Types with a cross form define it."""
        raise NotImplementedError(f"{type(self).__name__} has no cross-attention form")

    def _require_memory(self, memory, cache) -> None:
        if memory is None and (cache is None or not cache.has_memory(self.layer_idx)):
            raise ValueError(f"{type(self).__name__} is cross-attention: pass `memory` (the encoder states)")

    def _memory(self, memory, memory_mask, cache):
        """Cross-attention: the projected memory (`_project_memory`), computed at the first decoding
        step and kept in the cache."""
        self._require_memory(memory, cache)
        if cache is not None and cache.has_memory(self.layer_idx):
            return cache.memory(self.layer_idx)
        projected = self._project_memory(memory, memory_mask)
        if cache is not None:
            cache.update_memory(projected, self.layer_idx)
        return projected


class _QKVAttention(Attention):
    """Query/key/value projections D -> D, shared by full, Zformer and Fastformer attention."""

    def build_projections(self, config) -> None:
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)


# ----------------------------------------------------------------------------------------------
# full softmax attention
# ----------------------------------------------------------------------------------------------


def einsum_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Reference softmax attention written with einsum (`attn_implementation="eager"`).

    query (B, H, Nq, d), key/value (B, H, Nk, d); `attention_mask` is boolean, broadcastable to
    (B, H, Nq, Nk), True where attending is allowed. Masked positions get exactly zero weight (the
    transformer-with-einsum reference code's 1e-12 fill let padding leak into the softmax); a query
    with no allowed key gets a zero context (`masked_softmax`), as SDPA gives. Returns (B, Nq, H, d)
    like transformers' attention functions.
    """
    scores = torch.einsum("bhid,bhjd->bhij", query, key) * scaling
    probs = masked_softmax(scores, attention_mask, dtype=torch.float32).to(value.dtype)  # no key: zero weights
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.einsum("bhij,bhjd->bhid", probs, value)
    return output.transpose(1, 2).contiguous(), probs


class FullAttention(_QKVAttention):
    """Softmax attention, `softmax(Q K^T / sqrt(d_h) + mask) V`, through transformers'
    `ALL_ATTENTION_FUNCTIONS` (fused `scaled_dot_product_attention` by default).

    Causal self-attention appends its keys/values (B, H, N, d) to the cache (a transformers
    `DynamicLayer`, `cache.update(keys, values, layer_idx)`) and attends to all of them; as
    cross-attention the keys/values of the memory are computed once and kept in the cache.
    """

    def build_parameters(self, config) -> None:
        self.config = config
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_probs_dropout_prob

    def _project_memory(self, memory: torch.Tensor, memory_mask: torch.Tensor | None):
        """Keys and values (B, H, Nk, d) of `memory` (B, Nk, D)."""
        return tuple(split_heads(t, self.num_heads) for t in project(memory, self.key, self.value))

    def forward(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None, output_attentions=False):
        """As `Attention.forward`; with `output_attentions` the softmax weights (B, H, N, Nk) come
        second, computed through the einsum reference (SDPA returns none)."""
        context, weights = self._attend(hidden_states, attention_mask, memory, memory_mask, cache, output_attentions)
        return self.output(context), weights  # Q, K and V are freed by now

    def context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None):
        return self._attend(hidden_states, attention_mask, memory, memory_mask, cache)[0]

    def _attend(self, hidden_states, attention_mask, memory, memory_mask, cache, output_attentions=False):
        if self.is_cross:
            query = split_heads(self.query(hidden_states), self.num_heads)  # (B, H, Nq, d)
            key, value = self._memory(memory, memory_mask, cache)
            key_mask = memory_mask
        else:
            query, key, value = (
                split_heads(t, self.num_heads) for t in project(hidden_states, self.query, self.key, self.value)
            )
            key, value = self._cached(key, value, cache)
            key_mask = attention_mask
        return self._softmax(query, key, value, key_mask, output_attentions)

    def causal_context(self, query, key, value, attention_mask, cache, rotate=None):
        if rotate is not None:
            query, key = rotate(query, key)
        return self._softmax(query, *self._cached(key, value, cache), attention_mask)[0]

    def _cached(self, key, value, cache):
        """Self-attention's keys and values (B, H, past + N, d): the new ones appended to the cache's
        (`cache.update`), each key/value head repeated for its `groups` query heads."""
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        return repeat_kv(key, self.groups), repeat_kv(value, self.groups)

    def _attention_function(self, output_attentions: bool) -> Callable:
        """The softmax attention's implementation: the config's (`attn_implementation`), the einsum
        reference for the weights."""
        if output_attentions:
            return einsum_attention_forward
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, einsum_attention_forward)

    def _softmax(self, query, key, value, key_mask, output_attentions=False):
        """Softmax attention of query (B, H, Nq, d) over key and value (B, H, Nk, d) with key_mask
        (B, Nk) or None, causal for a causal module (the last Nq keys are the queries' own tokens):
        (context (B, Nq, H d), weights or None)."""
        batch, _, q_len, _ = query.shape
        k_len = key.shape[2]
        if key_mask is not None and key_mask.shape[1] != k_len:
            raise ValueError(
                f"the attention mask covers {key_mask.shape[1]} tokens, the keys {k_len} (cached and new tokens)"
            )
        mask = None if key_mask is None else key_mask.bool().view(batch, 1, 1, k_len)
        attention_function = self._attention_function(output_attentions)
        # Causal attention over the whole sequence without padding: the kernel's own causal mode
        # (no (N, N) mask to build; SDPA picks its causal flash kernel). With a cache (k_len > q_len)
        # or padding the mask is explicit: the kernels align `is_causal` to the top left.
        fused_causal = (
            self.is_causal and mask is None and q_len == k_len and attention_function is not einsum_attention_forward
        )
        if self.is_causal and not fused_causal and (q_len > 1 or mask is not None):
            causal = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
            if mask is not None:  # every query sees itself: a padded query attends to something (finite output)
                causal_mask = mask & causal
                itself = torch.zeros_like(causal).diagonal_scatter(
                    torch.ones(q_len, dtype=torch.bool, device=query.device), k_len - q_len)
                mask = causal_mask | itself
            else:
                mask = causal.view(1, 1, q_len, k_len)
        if mask is not None:
            mask = mask.expand(batch, 1, q_len, k_len)

        output, weights = attention_function(
            self,
            query,
            key,
            value,
            mask,
            dropout=self.dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=fused_causal,  # otherwise causality is in `mask`
        )
        return output.reshape(batch, q_len, -1), weights if output_attentions else None


# ----------------------------------------------------------------------------------------------
# Zformer: softmax-free linear attention
# ----------------------------------------------------------------------------------------------


class HedgehogFeatureMap(nn.Module):
    """A learned feature map per head, phi(x) = [softmax(W_h x + b_h), softmax(-(W_h x + b_h))]
    (`ops.hedgehog_features`; Hedgehog, Zhang et al., ICLR 2024). W_h (d_h x d_h) starts as the
    identity and b_h at zero. x (B, H, N, d_h) -> (B, H, N, 2 d_h) in fp32."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1))  # W (H, d, d)
        self.bias = nn.Parameter(torch.zeros(num_heads, head_dim))  # b (H, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hedgehog_features(x, self.weight, self.bias)


def windowed_self_attention(query, key, value, attention_mask, layer, window: int, query_map: "HedgehogFeatureMap",
                            key_map: "HedgehogFeatureMap", window_gate: torch.Tensor, scaling: float,
                            groups: int = 1, sinks: int = 0, decay: torch.Tensor | None = None,
                            feature_inputs: tuple | None = None) -> torch.Tensor:
    """Causal self-attention with a softmax window of `window` tokens and the Hedgehog map beyond it
    (`ops.windowed_linear_attention`), reading and writing a decoding cache layer: the one form of
    every zformer layer with `attention_window` (`ZformerAttention`, `attention_llama.RotaryLinearAttention`).

    query (B, H, N, d); key and value (B, H / groups, N, d) of the N new tokens (each key/value head
    serves `groups` query heads); attention_mask (B, >= past + N) 1 at real tokens, or None;
    `layer` the cache layer (`cache_zformer.WindowedStateLayer`: the last W - 1 keys and values, the
    state over the older tokens, the sinks) or None; softmax share sigmoid(`window_gate`) (H,). With
    `sinks` S > 0 the first S real tokens of each sequence stay softmax keys of every later query
    (`sink_slots`). With `decay` (H,) the feature-map weights fade by that factor per token of age
    (`ops.windowed_linear_attention`). `feature_inputs` = (queries (B, H, N, d), keys (B, H / groups,
    N, d)) are what the feature maps read instead of `query` and `key` (a Llama layer's unrotated
    projections: a feature-map part free of absolute positions); the cache then keeps the window's
    such keys too (`feature_keys`), each read by the map when it leaves the window. Returns the
    context (B, H, N, d) in fp32 (fp64 for fp64 inputs) and stores the new state in `layer`."""
    length = query.shape[2]
    seen = 0 if layer is None else layer.num_tokens  # tokens before these, padding included
    repeat = (lambda t: t.repeat_interleave(groups, 1)) if groups > 1 else (lambda t: t)  # transformers' repeat_kv
    if steady_decoding(layer, length, attention_mask, window, sinks, seen):
        return _decode_step(query, key, value, layer, window, query_map, key_map, window_gate, scaling, sinks, repeat,
                            decay, feature_inputs)
    new_key, new_value = key, value
    feature_query, feature_key = (query, None) if feature_inputs is None else feature_inputs
    if layer is not None and layer.keys is not None:  # the last window - 1 tokens before these
        key, value = torch.cat([layer.keys, key], 2), torch.cat([layer.values, value], 2)
        if feature_key is not None:
            feature_key = torch.cat([layer.feature_keys, feature_key], 2)
    total = key.shape[2]
    mask = None if attention_mask is None else attention_mask[:, attention_mask.shape[1] - total :]
    if mask is not None and mask.shape[1] != total:
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens, fewer than the {total} "
                         "cached and new ones")
    repeated_key, repeated_value = repeat(key), repeat(value)
    # phi(k) of the keys that leave the window in this call, the only ones the feature-map part reads
    # (decoding: one key, not the window's W - 1)
    leaving = max(total - (window - 1), 0)
    key_features = key_map(repeated_key[:, :, :leaving] if feature_key is None else repeat(feature_key[:, :, :leaving]))
    if mask is not None:  # phi(0) is not zero
        key_features = key_features * mask[:, :leaving].to(key_features.dtype)[:, None, :, None]
    sink_state = None
    if sinks:
        sink_state = sink_slots(layer, attention_mask, new_key, new_value, seen, sinks)
        key_positions = torch.arange(seen + length - total, seen + length - total + leaving, device=key.device)
        is_sink = (key_positions[None, :, None] == sink_state[2][:, None, :]).any(-1)  # (B, leaving)
        key_features = key_features * (~is_sink).to(key_features.dtype)[:, None, :, None]
    context, state = windowed_linear_attention(
        query, repeated_key, repeated_value, query_map(feature_query), key_features, mask,
        None if layer is None else layer.state, window, torch.sigmoid(window_gate), scaling,
        return_state=layer is not None,
        sinks=None if sink_state is None else (repeat(sink_state[0]), repeat(sink_state[1]), sink_state[2]),
        position=seen + length - total, decay=decay,
    )
    if layer is not None:
        # the cache keeps the last window - 1 keys (all of them while fewer were seen)
        layer.store(state, key[:, :, leaving:], value[:, :, leaving:], length,
                    None if feature_key is None else feature_key[:, :, leaving:])
        if sink_state is not None:
            layer.sink_keys, layer.sink_values, layer.sink_index = sink_state
    return context


def steady_decoding(layer, length: int, attention_mask, window: int, sinks: int, seen: int) -> bool:
    """Whether this call is one decoding step in the steady state (`ops.windowed_decode_step`): one
    new token, the cache holding the W - 1 tokens before it, all real, and every sink before the
    window (sink index <= seen - W), so that no key of the step is masked."""
    if layer is None or length != 1 or layer.keys is None or layer.keys.shape[2] != window - 1:
        return False
    if attention_mask is not None and not bool(attention_mask[:, attention_mask.shape[1] - window :].all()):
        return False
    if sinks:
        index = layer.sink_index
        return index is not None and bool(((index >= 0) & (index <= seen - window)).all())
    return True


def _decode_step(query, key, value, layer, window, query_map, key_map, window_gate, scaling, sinks, repeat, decay,
                 feature_inputs):
    """`windowed_self_attention` for a steady-state decoding step: the sinks, the cached W - 1 tokens
    and the new one in one concatenation, attended to by `ops.windowed_decode_step`; the oldest
    window token moves into the feature-map state, the cache keeps the last W - 1."""
    parts_key, parts_value = [layer.keys, key], [layer.values, value]
    if sinks:
        parts_key.insert(0, layer.sink_keys)
        parts_value.insert(0, layer.sink_values)
    keys, values = torch.cat(parts_key, 2), torch.cat(parts_value, 2)  # (B, H_kv, S + W, d)
    feature_query, feature_keys = query, None
    if feature_inputs is not None:
        feature_query, feature_keys = feature_inputs[0], torch.cat([layer.feature_keys, feature_inputs[1]], 2)
    context = windowed_decode_step(query, keys, values, query_map(feature_query), layer.state,
                                   torch.sigmoid(window_gate), scaling)
    leaving_key, leaving_value = keys[:, :, sinks : sinks + 1], values[:, :, sinks : sinks + 1]  # never a sink here
    if feature_keys is not None:
        leaving_key = feature_keys[:, :, :1]
    state = layer.state
    if decay is not None and state is not None:  # one token older
        state = state * decay.to(state.dtype).view(1, -1, 1, 1)
    state = add_key_value_products(state, key_map(repeat(leaving_key)), with_ones(at_least_fp32(
        repeat(leaving_value))[0]))
    layer.store(state, keys[:, :, sinks + 1 :], values[:, :, sinks + 1 :], 1,
                None if feature_keys is None else feature_keys[:, :, 1:])
    return context


def sink_slots(layer, attention_mask, key, value, seen: int, sinks: int):
    """The attention sinks after N new tokens: (keys, values (B, H_kv, S, d), token index (B, S),
    -1 for a slot still empty): the first S real tokens of each row. Slots filled by earlier calls
    stay as `layer` keeps them (`sink_keys`, `sink_values`, `sink_index`); the others take the next
    real tokens among these, by the last N columns of `attention_mask` (all real without one), from
    their `key`, `value` (B, H_kv, N, d); `seen` tokens came before them."""
    batch, length = key.shape[0], key.shape[2]
    real = key.new_ones(batch, length, dtype=torch.bool) if attention_mask is None else \
        attention_mask[:, attention_mask.shape[1] - length :].bool()
    kept = layer is not None and layer.sink_index is not None
    filled = layer.sink_index >= 0 if kept else real.new_zeros(batch, sinks)
    if kept and bool(filled.all()):  # every row has its sinks (each decoding step after the prompt)
        return layer.sink_keys, layer.sink_values, layer.sink_index
    rank = filled.sum(1, keepdim=True) + real.long().cumsum(1)  # (B, N): real tokens so far, up to each new one
    hits = [(rank == slot + 1) & real for slot in range(sinks)]
    found = torch.stack([torch.where(h.any(1), h.long().argmax(1), -1) for h in hits], 1)  # (B, S) in these tokens
    new = ~filled & (found >= 0)
    index = torch.where(new, found + seen, layer.sink_index if kept else -1)
    where = found.clamp_min(0)[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
    new_keys, new_values = key.gather(2, where), value.gather(2, where)
    old_keys = layer.sink_keys if kept else torch.zeros_like(new_keys)
    old_values = layer.sink_values if kept else torch.zeros_like(new_values)
    fill = new[:, None, :, None]
    return torch.where(fill, new_keys, old_keys), torch.where(fill, new_values, old_values), index


class ZformerAttention(_QKVAttention):
    """Zformer linear attention (the Zformer_Pytorch code): with Q = X W_q / sqrt(d_h),
    K = X W_k, V = X W_v per head, `out = Q (K^T V) / s`, `s` a learnable scalar (init
    `config.zformer_scale_init`). K^T V is d_h x d_h: cost O(N d_h^2), linear in N.

    `s` is stored as `log_scale = log(s)`: the gradient of the loss with respect to `s` itself is
    ~1/s^2 (tiny at s = 700), below Adam's epsilon, so `s` would never move; in log space each
    optimizer step changes `s` by a relative amount.

    Causal form: `out_i = q_i (sum_{j<=i} k_j^T v_j) / s`, with the running sum as recurrent state
    (B, H, d_h, d_h) in fp32. As cross-attention K^T V of the source is computed once.

    Bidirectional self-attention on sequences longer than the width takes a folded form with the
    same result (`_folded`): 4 N D^2 + 2 D^3 FLOPs per sequence instead of 6 N D^2 + 4 N D d_h.

    With `config.zformer_feature_map="hedgehog"` it is normalised linear attention over learned
    feature maps (`HedgehogFeatureMap`, one for the queries, one for the keys):

        out_i = sum_j (phi(q_i) . phi(k_j)) v_j / sum_j (phi(q_i) . phi(k_j))   over the real keys j

    computed by the same `linear_attention` on phi(Q), phi(K) and [V, 1] (the state per head,
    (2 d_h, d_h + 1), holds S = sum_j phi(k_j) v_j^T and, as its last column, z = sum_j phi(k_j)),
    then the ratio (`ops.normalize`); a query with no real key gets zero. Still O(N d_h^2), causal
    with a constant-size cache. phi takes q and k as projected, without 1/sqrt(d_h): any fixed
    factor is a rescaling of W that training absorbs. Each output is a convex combination of the
    values, as in softmax attention, so there is no scale `s` (no `log_scale`) and no folded form.

    Causal self-attention with the Hedgehog map may take a softmax window (`window` W > 0, from
    `config.attention_window` of a causal language model): the last W tokens, the query's own
    included, get softmax weights exp(q_i . k_j / sqrt(d_h)), the older ones the feature map's,
    both in one normalisation with shares g and 1 - g per head (g = sigmoid(`window_gate`), 0.5 at
    init; `windowed_self_attention`). The decoding cache then keeps the last W - 1 keys and values
    besides the state: still constant in the generated length.
    """

    HAS_ATTENTION_DROPOUT = False
    POLICY_NAME = "zformer"

    def build_parameters(self, config) -> None:
        self.scale_init = float(config.zformer_scale_init)
        # the layer's softmax window (`config.attention_window` of a causal LM; models that cannot
        # take one refuse a non-zero value when they are built)
        causal, layer_idx = self.is_causal and not self.is_cross, self.layer_idx
        windows = config.layer_windows() if causal and layer_idx is not None else []
        window = windows[layer_idx] if layer_idx is not None and layer_idx < len(windows) else 0
        if window and not (self.is_causal and config.zformer_feature_map == "hedgehog"):
            raise ValueError(f"ZformerAttention: window={window} needs causal self-attention with "
                             f"zformer_feature_map='hedgehog' (is_causal={self.is_causal}, zformer_feature_map="
                             f"{config.zformer_feature_map!r})")
        self._build_window(config, window)
        self._build_feature_maps(config)

    def _build_feature_maps(self, config) -> None:
        """The Hedgehog maps of queries and keys, or the scale `log_scale` of the identity map."""
        if config.zformer_feature_map == "hedgehog":
            self.query_map = HedgehogFeatureMap(self.num_heads, self.head_dim)
            self.key_map = HedgehogFeatureMap(self.num_heads, self.head_dim)
            self.register_parameter("log_scale", None)  # normalised outputs need no scale
            return
        self.query_map = self.key_map = None
        # Shape (1,), not 0-d: FSDP (fully_shard and FullyShardedDataParallel) refuses scalar parameters.
        self.log_scale = nn.Parameter(torch.full((1,), math.log(self.scale_init)))

    def _build_window(self, config, window: int) -> None:
        """The softmax window's parts: `window_gate`, the sinks and, from the fields only
        Llama-family configs have (0 or True elsewhere), the recall memory, the fading feature-map
        weights (`log_horizon`) and whether the maps read rotated inputs."""
        self.window = window
        self.sinks = config.attention_sinks if window else 0
        if window:  # Shape (H,): the softmax share of each head, sigmoid(0) = 0.5 at init
            self.window_gate = nn.Parameter(torch.zeros(self.num_heads))
        else:
            self.register_parameter("window_gate", None)
        self.rotary_maps = getattr(config, "rotary_feature_maps", True) or not window
        self.memory = getattr(config, "attention_memory", 0) if window else 0
        self.memory_chunk = getattr(config, "attention_memory_chunk", 0)
        if self.memory and getattr(config, "attention_memory_positions", "text") == "cache":
            # rotary positions by place in the cache (`rotate_at`): the model's rotation, at any position
            self.memory_rotary = LlamaRotaryEmbedding(config)
        else:
            self.memory_rotary = None
        self.horizon_init = getattr(config, "feature_map_horizon", 0) if window else 0
        if self.horizon_init:  # log of each head's time constant (tokens) for the feature-map part's fading
            self.log_horizon = nn.Parameter(torch.full((self.num_heads,), math.log(self.horizon_init)))
        else:
            self.register_parameter("log_horizon", None)

    def init_parameters(self, std: float) -> None:
        if self.log_scale is not None:
            init.constant_(self.log_scale, math.log(self.scale_init))
        if self.window_gate is not None:  # the softmax share of each head, sigmoid(0) = 0.5
            init.zeros_(self.window_gate)
        if self.log_horizon is not None:
            init.constant_(self.log_horizon, math.log(self.horizon_init))

    def rotate_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., K, d) rotated as the model rotates a token at each of `positions` (K,)."""
        cos, sin = self.memory_rotary(x, positions[None])  # (1, K, d)
        return x * cos[0].to(x.dtype) + rotate_half(x) * sin[0].to(x.dtype)

    def decay(self) -> torch.Tensor | None:
        """Per head, the factor exp(-1 / tau) by which a feature-map weight fades per token of age
        (tau = exp(`log_horizon`)), or None without fading."""
        return None if self.log_horizon is None else torch.exp(-torch.exp(-self.log_horizon))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints saved before 0.2.0 hold a 0-d `log_scale` (from_pretrained reshapes it with a
        # WeightConverter, modeling_zformer.py; this covers `load_state_dict`).
        key = prefix + "log_scale"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        """1 / (sqrt(d_h) s), both scalings in one factor (shape (1,), `dtype`)."""
        scale = torch.exp(math.log(self.head_dim**-0.5) - self.log_scale)  # log_scale: fp32 parameter
        return scale if scale.dtype == dtype else scale.to(dtype)

    def _project_memory(self, memory: torch.Tensor, memory_mask: torch.Tensor | None) -> torch.Tensor:
        """K^T V (B, H, d, d) in fp32 over the real positions of `memory` (B, Nk, D); with a feature
        map phi(K)^T [V, 1] (B, H, 2 d, d + 1)."""
        return add_key_value_products(None, *self._keys_values(memory, memory_mask))

    def _keys_values(self, x: torch.Tensor, mask: torch.Tensor | None):
        """K (zero at padding) and V (B, H, N, d) of `x` (B, N, D); with a feature map phi(K) (zero at
        padding, B, H, N, 2 d) and [V, 1] (B, H, N, d + 1), in fp32."""
        return self._key_value_heads(*project(x, self.key, self.value), mask)

    def _key_value_heads(self, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None):
        """`_keys_values` from the projections K and V (B, N, D)."""
        if self.key_map is None:
            return split_heads(zero_padding(key, mask), self.num_heads), split_heads(value, self.num_heads)
        key = self.key_map(split_heads(key, self.num_heads))
        if mask is not None:  # after phi: phi(0) is not zero
            key = key * mask.to(key.dtype)[:, None, :, None]
        return key, with_ones(at_least_fp32(split_heads(value, self.num_heads))[0])

    def attention_weights(self, hidden_states, attention_mask=None, memory=None, memory_mask=None) -> torch.Tensor:
        """The weights a_ij (B, H, N, Nk) of the feature-map form, built explicitly (quadratic,
        `ops.normalized_attention_weights`): over the memory for cross-attention, causal for a causal
        module (without a cache). `context` merges `a @ V` over heads. Distillation fits them to
        softmax attention's weights."""
        if self.key_map is None:
            raise ValueError("attention_weights: zformer_feature_map='identity' forms no normalised weights")
        source, mask = (memory, memory_mask) if self.is_cross else (hidden_states, attention_mask)
        if self.is_causal:
            mask = new_tokens_mask(mask, hidden_states.shape[1])
        query_features = self.query_map(split_heads(self.query(hidden_states), self.num_heads))
        key_features = self.key_map(split_heads(self.key(source), self.num_heads))
        return normalized_attention_weights(query_features, key_features, mask, causal=self.is_causal)

    def output_and_weights(self, hidden_states, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (B, N, D), weights a_ij (B, H, N, N)) of bidirectional self-attention with a feature
        map, from one computation of phi(Q) and phi(K): the output is W_o merge(a V), what `forward`
        returns (its linear form sums the same terms in another order). Distillation fits both."""
        if self.is_causal or self.is_cross:
            raise ValueError("output_and_weights: bidirectional self-attention only (an encoder layer)")
        weights = self.attention_weights(hidden_states, attention_mask)
        value = split_heads(self.value(hidden_states), self.num_heads)
        context = (weights @ at_least_fp32(value)[0]).to(value.dtype)
        return self.output(merge_heads(context)), weights

    @classmethod
    def folded_form_pays_off(cls, length: int, width: int, **structure) -> bool:
        # fewer FLOPs when N > D: 2 N D^2 saved against 2 D^3 + 4 D^2 d_h - 4 N D d_h added
        return length > width

    @classmethod
    def folds_output_projection(cls, batch: int, length: int, width: int) -> bool:
        # W_o joins the per-sequence map for 2 D^3 per sequence where applying it costs 2 N D^2
        return length > width

    def _folded_output(self, hidden_states, attention_mask):
        pays_off = self.folded_form_pays_off(*hidden_states.shape[1:])
        if self.key_map is None and use_folded_form(hidden_states, pays_off, self.query, self.key, self.value,
                                                    autocast_devices=self.folded_autocast()):
            return self._folded(hidden_states, attention_mask)
        return None

    def context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None):
        """The plain form: Q against the sum of k^T v through `ops.linear_attention`, which picks the
        order and blocks. Self-attention takes the keys of the sequence; a causal module decoding
        with a cache starts from the sum over earlier tokens in its cache layer and stores the sum
        including the new ones. Cross-attention takes the memory's keys, or with a cache its K^T V
        computed at the first step and kept (`_memory`). With a feature map the same calls take
        phi(Q), phi(K) and [V, 1], and the result is normalised (`ops.normalize`)."""
        if self.is_cross:
            projected = self.query(hidden_states)
        else:  # K and V of the sequence itself (B, N, D)
            projected, key_proj, value_proj = project(hidden_states, self.query, self.key, self.value)
        if self.is_causal:
            heads = (split_heads(t, self.num_heads) for t in (projected, key_proj, value_proj))
            return self.causal_context(*heads, attention_mask, cache).to(projected.dtype)
        query = split_heads(projected, self.num_heads)
        if self.query_map is None:
            scale = self._scale(hidden_states.dtype)  # 1 / (sqrt(d_h) s)
        else:  # phi(Q) (B, H, N, 2 d) in fp32; normalised outputs need no scale
            query, scale = self.query_map(query), None
        if self.is_cross and cache is not None:
            stored = self._memory(memory, memory_mask, cache)  # K^T V of the memory, (B, H, d, d)
            context, _ = linear_attention(query, None, None, state=stored, scale=scale)
        elif self.is_cross:
            self._require_memory(memory, None)
            context, _ = linear_attention(query, *self._keys_values(memory, None), memory_mask, scale=scale)
        else:
            context, _ = linear_attention(query, *self._key_value_heads(key_proj, value_proj, None), attention_mask,
                                          scale=scale)
        if self.query_map is not None:
            with no_autocast(context.device.type):
                context = normalize(context)
        if context.dtype != projected.dtype:
            context = context.to(projected.dtype)
        return merge_heads(context)

    def causal_context(self, query, key, value, attention_mask, cache, rotate=None):
        """Q against the prefix sums of k^T v (`ops.linear_attention`), starting from the cache
        layer's sum over earlier tokens and storing the sum including the new ones; with a feature
        map over phi(Q), phi(K) and [V, 1], normalised. With a window, `_windowed`. Rotary positions
        apply to the queries and keys the maps read, unless the windowed maps read unrotated ones
        (`rotary_maps=False`)."""
        layer = None if cache is None else cache.layers[self.layer_idx]
        feature_inputs, rotate_at = None, None
        if rotate is not None and self.memory_rotary is not None:
            # positions by place in the cache: the memory rotates the softmax keys and queries when it
            # reads them; the maps read what they read otherwise
            feature_inputs, rotate_at = (rotate(query, key) if self.rotary_maps else (query, key)), self.rotate_at
        elif rotate is not None:
            if not self.rotary_maps:  # the maps read the unrotated projections, the softmax the rotated ones
                feature_inputs = (query, key)
            query, key = rotate(query, key)
        if self.window:
            return merge_heads(self._windowed(query, key, value, attention_mask, layer, feature_inputs, rotate_at))
        key, value = repeat_kv(key, self.groups), repeat_kv(value, self.groups)
        length = query.shape[2]
        if self.query_map is None:  # 1 / (sqrt(d_h) s)
            keys, values, scale = key, value, self._scale(self.log_scale.dtype)
        else:  # phi(Q), phi(K) (B, H, N, 2 d) in fp32 and [V, 1]; normalised outputs need no scale
            query, keys, values, scale = self.query_map(query), self.key_map(key), with_ones(at_least_fp32(value)[0]), None
        context, state = linear_attention(query, keys, values, new_tokens_mask(attention_mask, length),
                                          None if layer is None else layer.state, causal=True, scale=scale,
                                          return_state=layer is not None)
        if layer is not None:
            layer.store(state, length)
        if self.query_map is not None:
            with no_autocast(context.device.type):
                context = normalize(context)
        return merge_heads(context)

    def _windowed(self, query, key, value, attention_mask, layer, feature_inputs, rotate_at=None):
        """Causal self-attention with the softmax window (`windowed_self_attention`), or with the
        recall memory besides it (`attention_memory.memory_self_attention`): context (B, H, N, d)."""
        if self.memory:
            return memory_self_attention(query, key, value, attention_mask, layer, window=self.window, sinks=self.sinks,
                                         slots=self.memory, chunk=self.memory_chunk, query_map=self.query_map,
                                         key_map=self.key_map, window_gate=self.window_gate,
                                         scaling=self.head_dim**-0.5, groups=self.groups, decay=self.decay(),
                                         feature_inputs=feature_inputs, rotate_at=rotate_at)
        return windowed_self_attention(query, key, value, attention_mask, layer, self.window, self.query_map,
                                       self.key_map, self.window_gate, self.head_dim**-0.5, groups=self.groups,
                                       sinks=self.sinks, decay=self.decay(), feature_inputs=feature_inputs)

    def _folded(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Bidirectional self-attention `Q (K^T V) / s` folded into one (D, D) matrix per sequence.

        Write [W | b] for a projection with its bias as a column (D, D+1) and x' = [x; 1]. Over the
        real positions (mask m_i), per head h,
            K^T V = sum_i m_i k_i v_i^T = [W_k | b_k]_h S [W_v | b_v]_h^T,   S = sum_i m_i x'_i x'_i^T,
        where S (D+1, D+1) holds the Gram matrix G = sum_i m_i x_i x_i^T, t = sum_i m_i x_i and the
        number of real tokens. Then out_i = (W_q x_i + b_q) K^T V / (sqrt(d_h) s) = x_i A + c, with
        [A; c] per head = [W_q | b_q]_h^T K^T V / (sqrt(d_h) s). Cost 4 N D^2 (G and x_i A) + 2 D^3
        instead of the 6 N D^2 of three projections: K and V are never formed, and the output
        projection joins the per-sequence map (`_apply_folded`). The sums over the sequence run in
        the input's precision (fp32 or fp64); under autocast (`folded_autocast`) X is cast
        once, G is one product in autocast's dtype (fp32 accumulation), and the (D + 1)-wide algebra
        runs in fp32.
        """
        x = autocast_input(hidden_states)  # (B, N, D); under autocast cast once for both products over it
        batch, length, width = x.shape
        heads, dim = self.num_heads, self.head_dim
        masked = zero_padding(x, attention_mask)
        key, value, query = (torch.cat([p.weight, p.bias[:, None]], 1) for p in (self.key, self.value, self.query))
        with no_autocast(x.device.type):  # the (D + 1, D + 1) algebra in the weights' precision
            gram = (masked.transpose(1, 2) @ x).to(key.dtype)  # G (B, D, D)
            total = masked.sum(1, keepdim=True, dtype=key.dtype)  # t (B, 1, D)
            if attention_mask is None:
                count = key.new_full((batch, 1, 1), float(length))
            else:
                count = attention_mask.sum(1).to(key.dtype).view(batch, 1, 1)
            moments = torch.cat([torch.cat([gram, total], 1), torch.cat([total, count], 2).transpose(1, 2)], 2)  # S
            value_moments = (value @ moments).view(batch, heads, dim, width + 1)  # [W_v | b_v] S, per head
            kv_t = value_moments @ key.view(heads, dim, width + 1).transpose(1, 2)  # (K^T V)^T (B, H, d, d)
            kv_t = kv_t * self._scale(kv_t.dtype)
            folded = (kv_t @ query.view(heads, dim, width + 1)).view(batch, width, width + 1)  # [A^T | c]
        return _apply_folded(x, folded[:, :, :width].to(x.dtype), folded[:, :, width], self.output,
                             self.folds_output_projection(batch, length, width))  # (B, N, D)


# ----------------------------------------------------------------------------------------------
# Xformer: Linformer-like attention with keys projected from queries
# ----------------------------------------------------------------------------------------------


class XformerAttention(Attention):
    """Xformer attention (Xformer_Pytorch). Q' = X W_q has width D / alpha. A projection E along
    the sequence (max_position_embeddings -> k = ceil(max_position_embeddings / beta) rows, no bias)
    is shared by keys and values: K = E Q', V = E X, summing over real positions only, so k does
    not depend on the padded length. Q' and K split into H heads of D / (alpha H), V into H heads of
    D / H; softmax attention of every query over the k compressed keys. Bidirectional
    self-attention only: E mixes future tokens into every key (no causal form), and it indexes
    positions of the sequence itself (no cross form).
    """

    CAN_BE_CAUSAL = False
    CAN_BE_CROSS = False

    def build_parameters(self, config) -> None:
        self.query_width = config.hidden_size // config.xformer_alpha
        self.scaling = (self.query_width // self.num_heads) ** -0.5
        self.max_length = config.max_position_embeddings
        self.position_offset = config.position_offset  # the column of a first token (RoBERTa-style tables)
        self.compressed_length = math.ceil(config.max_position_embeddings / config.xformer_beta)
        self.query = nn.Linear(config.hidden_size, self.query_width)
        self.sequence_projection = nn.Parameter(torch.empty(self.compressed_length, self.max_length))  # E
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def init_parameters(self, std: float) -> None:
        init.normal_(self.sequence_projection, mean=0.0, std=std)

    def context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None):
        """`position_ids` (B, N) (or (1, N)): the column of E each token uses, by default its index
        plus `position_offset`."""
        length = hidden_states.shape[1]
        if position_ids is None and length + self.position_offset > self.max_length:
            raise ValueError(
                f"xformer attention got a sequence of {length} tokens, more than max_position_embeddings="
                f"{self.max_length} - position_offset={self.position_offset}"
            )
        return self._attend(hidden_states, attention_mask, position_ids)

    def _projection(self, length, attention_mask, position_ids):
        """E restricted to the tokens' positions: (k, N) when every real token sits at the column of
        its index + `position_offset` (no left padding: one matrix for the batch), else (B, k, N)."""
        offset = self.position_offset
        if position_ids is not None and not torch.compiler.is_compiling():
            columns = torch.arange(offset, offset + length, device=position_ids.device)
            at_column = position_ids == columns
            if attention_mask is not None:
                at_column |= ~attention_mask.bool()  # padding's column does not matter (zeroed inputs)
            if bool(at_column.all()):
                position_ids = None
        if position_ids is None:
            return self.sequence_projection[:, offset : offset + length]
        return self.sequence_projection[:, position_ids].transpose(0, 1)

    def _attend(self, hidden_states, attention_mask, position_ids):
        length = hidden_states.shape[1]
        query = zero_padding(self.query(hidden_states), attention_mask)  # (B, N, D/alpha)
        inputs = zero_padding(hidden_states, attention_mask)  # (B, N, D)
        projection = self._projection(length, attention_mask, position_ids)  # E (k, N) or (B, k, N)
        with no_autocast(hidden_states.device.type):
            projection, query32, inputs = at_least_fp32(projection, query, inputs)
            key = projection @ query32  # (B, k, D/alpha)
            value = projection @ inputs  # (B, k, D)
        query, key, value = (split_heads(t.to(query.dtype), self.num_heads) for t in (query, key, value))
        # Fused attention (no (B, H, N, k) score matrix: storage linear in N) needs query/key heads as
        # wide as value heads: zero channels leave the scores unchanged.
        padding = value.shape[-1] - query.shape[-1]
        if padding:
            query, key = nn.functional.pad(query, (0, padding)), nn.functional.pad(key, (0, padding))
        context = nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout.p if self.training else 0.0, scale=self.scaling
        )  # (B, H, N, D/H)
        return merge_heads(context)


# ----------------------------------------------------------------------------------------------
# Fastformer: additive attention
# ----------------------------------------------------------------------------------------------


class FastformerAttention(_QKVAttention):
    """Fastformer additive attention (Wu et al. 2021, arXiv 2108.09084), per head:

        alpha_i = softmax_i(w_q . q_i / sqrt(d_h));  q_g = sum_i alpha_i q_i
        p_i = q_g * k_i;  beta_i = softmax_i(w_k . p_i / sqrt(d_h));  k_g = sum_i beta_i p_i
        u_i = k_g * v_i;  r_i = W_r u_i + q_i

    `fastformer_pooling="mean"` replaces both softmax poolings by the plain mean over real tokens
    (as FastFormer-pytorch does; w_q and w_k then do not exist). `fastformer_share_qv=True` uses the
    query projection for the values (the official code). Cost O(N D). Self-attention only: the pooled
    global query mixes with each token's own key (no cross form).

    Causal form: the poolings become prefix poolings (a log-sum-exp and the pooling so far per head),
    an O(1) state per generated token; with a cache, each pooling starts from its state in the
    cache layer (`query_pool`, `key_pool`) and both new states are stored there. Without a cache, up to
    the policy's `fastformer_causal_quadratic` tokens pool through a softmax over the causal pattern instead
    (`ops.causal_softmax_pool`, fewer operations on short inputs).

    Bidirectional attention on all but short sequences takes a folded form with the same result
    (`_folded`): 2 N D^2 + 2 D^3 FLOPs per sequence instead of the 8 N D^2 of four projections, in
    fp32, and under bf16 autocast on the devices of `folded_autocast` (CPUs). Where that
    form is not taken (autocast on CUDA), inputs at least as long as the width take the pooled
    output (`_pooled_output`): W_r and the residual as one batched product per sequence.
    """

    HAS_ATTENTION_DROPOUT = False
    CAN_BE_CROSS = False
    POLICY_NAME = "fastformer"

    def build_parameters(self, config) -> None:
        if config.fastformer_share_qv:
            self.value = None
        self.additive = config.fastformer_pooling == "additive"
        if self.additive:
            self.query_score = nn.Parameter(torch.empty(self.num_heads, self.head_dim))  # w_q per head
            self.key_score = nn.Parameter(torch.empty(self.num_heads, self.head_dim))  # w_k per head
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)  # W_r

    def init_parameters(self, std: float) -> None:
        if self.additive:
            init.normal_(self.query_score, mean=0.0, std=std)
            init.normal_(self.key_score, mean=0.0, std=std)

    def _scores(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """(B, H, N, d) -> pooling scores (B, H, N, 1), w_h . x_i / sqrt(d_h) per head
        (`ops.direction_scores`); zero scores (no weight) give the plain mean."""
        return direction_scores(x, None if weight is None else (weight * self.head_dim**-0.5)[None])

    @classmethod
    def folded_form_pays_off(cls, length: int, width: int, *, projections: int = 4, **structure) -> bool:
        # fewer FLOPs when 2 (projections - 1) N D^2 > 2 D^3 (`projections`: 3 with a shared query/value)
        return (projections - 1) * length > width

    @classmethod
    def folds_output_projection(cls, batch: int, length: int, width: int) -> bool:
        # W_o W_q and W_o W_r, formed once per call for 4 D^3, where applying W_o costs 2 B N D^2
        return batch * length >= 2 * width

    def _folded_output(self, hidden_states, attention_mask):
        length, width = hidden_states.shape[1:]
        layers = [layer for layer in (self.query, self.key, self.value, self.transform) if layer is not None]
        pays_off = self.folded_form_pays_off(length, width, projections=len(layers))
        if use_folded_form(hidden_states, pays_off, *layers, autocast_devices=self.folded_autocast()):
            return self._folded(hidden_states, attention_mask)
        if self._takes_pooled_output(length, width):
            return self._pooled_output(hidden_states, attention_mask)
        return None

    def context(self, hidden_states, attention_mask=None, memory=None, memory_mask=None, cache=None,
                position_ids=None):
        """The plain form: the projections and two (prefix) poolings."""
        w_q, w_k = self._score_weights()
        if self.value is None:
            query_proj, key_proj = project(hidden_states, self.query, self.key)
            value_proj = query_proj
        else:
            query_proj, key_proj, value_proj = project(hidden_states, self.query, self.key, self.value)
        query, key, value = (split_heads(t, self.num_heads) for t in (query_proj, key_proj, value_proj))
        if self.is_causal:
            return self.causal_context(query, key, value, attention_mask, cache)
        global_key = self._pooled_key(query, key, w_q, w_k, attention_mask)  # (B, H, 1, d)
        return self._mixed(global_key, value, query_proj)

    def causal_context(self, query, key, value, attention_mask, cache, rotate=None):
        """The prefix poolings (`_causal_pooled_key`) and the mix. Rotary positions do not apply: the
        poolings mix positions into one vector per head, which rotations would scramble."""
        key, value = repeat_kv(key, self.groups), repeat_kv(value, self.groups)
        global_key = self._causal_pooled_key(query, key, *self._score_weights(), attention_mask, cache, query.shape[2])
        return self._mixed(global_key, value, merge_heads(query))

    def _mixed(self, global_key, value, query_proj):
        """r_i = W_r u_i + q_i (B, N, D), u_i = k_g * v_i per head: global_key (B, H, 1 or N, d), value
        (B, H, N, d), query_proj (B, N, D)."""
        if global_key.dtype != value.dtype:
            global_key = global_key.to(value.dtype)
        mixed_value = merge_heads(global_key * value)  # u_i  (B, N, D)
        return add_into_fresh(self.transform(mixed_value), query_proj)  # r_i = W_r u_i + q_i

    def _score_weights(self):
        """(w_q, w_k) of the additive poolings, or (None, None) for the plain mean."""
        return (self.query_score, self.key_score) if self.additive else (None, None)

    def _takes_pooled_output(self, length: int, width: int) -> bool:
        """Whether bidirectional attention over `length` tokens of `width` takes `_pooled_output`:
        where the policy's `pooled_output` allows it and its (B, D, D) map is no larger than v
        (N >= D; on shorter inputs building the map costs more than the passes it saves), with a value
        projection, a bias on W_r, and plain `Linear` layers as W_q, W_k, W_v and W_r (adapters and
        forwards of their own keep the layers' forward; W_o may be anything: `_pooled_output` calls it)."""
        layers = (self.query, self.key, self.value, self.transform)
        return length >= width and active().pooled_output and self.value is not None and self.transform.bias is not None and (
            plain_linears(*layers)
        )

    def _pooled_output(self, hidden_states, attention_mask):
        """Bidirectional attention's output W_o r_i + b_o, r_i = W_r (k_g * v_i) + b_r + q_i, with
        one batched product per sequence for r and W_r's bias moved into the output projection's:

            W_o r_i + b_o = W_o (q_i + (W_r diag(k_g)) v_i) + (W_o b_r + b_o).

        The product's accumulator starts from q. Against u_i = k_g * v_i, W_r u_i and the residual
        add, no element-wise pass over a (B, N, D) tensor is left, forward or backward (on a GPU those
        passes are a large share of the module's time: docs/benchmarks.md); W_r diag(k_g) is
        (B, D, D), no larger than v where this form is taken (`_takes_pooled_output`), and the
        product is `ops.column_scaled_product` (where its fused kernel runs, no map is formed). b_r joins
        the output's bias rather than q's, so that q rounded to bf16 keeps its own precision. Where
        W_o is not a plain `Linear` (an adapter, a forward of its own, or set aside as the benchmarks' level
        `attention` does), b_r is added to r in place, one element-wise pass instead of the plain
        form's two (the multiply and the residual add), and W_o runs as it is. Where the projections
        are one stacked product (`stacks_projections`: on CUDA), b_r joins b_q in that product's bias
        instead, for no pass at all: q_i + b_r pools to q_g + b_r along w_q (the scores move by the
        same w_q . b_r at every token, which the softmax ignores), so b_r is taken off the (B, H, d)
        pooling, and the accumulator q_i + b_r gives r_i itself (q_i + b_r rounded to bf16 together,
        as the plain form's r_i is)."""
        batch = hidden_states.shape[0]
        layers = (self.query, self.key, self.value)
        folds_bias = plain_linears(self.output)  # b_r into W_o's bias
        shifted = not folds_bias and stacks_projections(hidden_states, *layers)  # b_r into q's
        bias = torch.cat([self.query.bias + self.transform.bias, self.key.bias, self.value.bias]) if shifted else None
        query_proj, key_proj, value_proj = project(hidden_states, *layers, bias=bias)
        query, key = split_heads(query_proj, self.num_heads), split_heads(key_proj, self.num_heads)
        global_key = self._pooled_key(query, key, *self._score_weights(), attention_mask,
                                      self.transform.bias if shifted else None)  # k_g (B, H, 1, d)
        # r_i (- b_r unless shifted) = q_i + W_r diag(k_g) v_i, in the projections' (autocast's) precision
        context = column_scaled_product(query_proj, value_proj, self.transform.weight, global_key.reshape(batch, -1))
        if not folds_bias:
            return self.output(context if shifted else context.add_(self.transform.bias))  # a fresh tensor: in place
        w_o, b_o = self.output.weight, self.output.bias
        with no_autocast(context.device.type):  # W_o b_r + b_o in the weights' precision, one operation
            bias = w_o @ self.transform.bias if b_o is None else torch.addmv(b_o, w_o, self.transform.bias)
        return nn.functional.linear(context, w_o, bias)  # W_o is a plain nn.Linear: `plain_linears`

    def _pooled_key(self, query, key, w_q, w_k, attention_mask, query_shift=None):
        """k_g (B, H, 1, d) of bidirectional attention, both poolings by `ops.direction_pool`:
        q_g pools q_i along w_q, then k_g pools p_i = q_g * k_i along w_k, with q_g as the pooling's
        gate: w_k . (q_g * k_i) = (w_k * q_g) . k_i, so k_g = q_g * (the pooling of k_i along
        w_k * q_g) and p_i is never formed. The poolings apply the 1/sqrt(d_h) score scale and the
        gate themselves (in the kernel: no operation of their own). `query_shift` (D,): a constant
        the queries carry (q_i + shift), taken off their pooling."""
        scale = self.head_dim**-0.5
        global_query = direction_pool(query, None if w_q is None else w_q[None], attention_mask, scale).squeeze(2)
        if query_shift is not None:
            global_query = global_query - query_shift.view(self.num_heads, self.head_dim)
        return direction_pool(key, None if w_k is None else w_k[None], attention_mask, scale, global_query)

    def _causal_pooled_key(self, query, key, w_q, w_k, attention_mask, cache, length):
        """k_g (B, H, N, d) of causal attention: prefix poolings (`ops.softmax_pool`), each starting
        from its state in the cache layer when there is one, and storing the new states there."""
        with no_autocast(query.device.type):
            query32, key32 = at_least_fp32(query, key)
            mask = new_tokens_mask(attention_mask, length)
            mask = None if mask is None else mask.bool()  # once for both poolings
            layer = cache.layers[self.layer_idx] if cache is not None else None
            keep = layer is not None
            global_query, query_pool = softmax_pool(  # q_g per position (B, H, N, d)
                self._scores(query32, w_q), query32, mask, layer.query_pool if keep else None, causal=True,
                return_state=keep,
            )
            mixed = global_query * key32  # p_i  (B, H, N, d)
            global_key, key_pool = softmax_pool(
                self._scores(mixed, w_k), mixed, mask, layer.key_pool if keep else None, causal=True,
                return_state=keep,
            )
            if keep:
                layer.store(query_pool, key_pool, length)
        return global_key

    def _folded(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Bidirectional Fastformer with every step linear in the tokens x_i, per head:

            w_q . q_i = x_i . (W_q^T w_q) + const        (scores without forming Q; a constant
                                                          shift per head leaves the softmax unchanged)
            q_g = sum_i alpha_i q_i = W_q (sum_i alpha_i x_i) + b_q      (sum_i alpha_i = 1)
            w_k . (q_g * k_i) = x_i . (W_k^T (w_k * q_g)) + const
            k_g = sum_i beta_i (q_g * k_i) = q_g * (W_k (sum_i beta_i x_i) + b_k)
            r_i = W_r (k_g * (W_v x_i + b_v)) + b_r + W_q x_i + b_q = (W_r diag(k_g) W_v + W_q) x_i + c

        (with the 1/sqrt(d_h) score scaling). Both poolings read X itself, every head along its own
        direction (`ops.direction_pool` of shared rows: on CUDA one fused kernel for bf16 rows). The output is one
        (D, D) matrix per sequence applied to X, with the output projection folded in through
        W_o W_q and W_o W_r, formed once per call (`_folded_output_maps`): per sequence 2 D^3 FLOPs
        for the map and 2 N D^2 to apply it, plus 8 N D H for the scores and poolings, instead of
        10 N D^2 for five projections; Q, K, V and the other (B, N, D) intermediates are never formed.
        Under autocast (`folded_autocast`) X is cast once, the per-sequence vectors stay
        fp32 and the two matrix products run in autocast's dtype.
        """
        x = autocast_input(hidden_states)  # (B, N, D); read by every step, so cast once under autocast
        batch, length, width = x.shape
        heads, dim = self.num_heads, self.head_dim
        value_layer = self.query if self.value is None else self.value
        w_q, w_k = self.query.weight.view(heads, dim, width), self.key.weight.view(heads, dim, width)
        b_q, b_k = self.query.bias.view(heads, dim), self.key.bias.view(heads, dim)
        scale = dim**-0.5
        rows = shared_rows(hidden_states, x, heads if self.additive else 1)[:, None]  # the poolings' (B, 1, N, D)
        with no_autocast(x.device.type):  # the per-sequence vectors in the weights' precision
            direction = torch.einsum("hkD,hk->hD", w_q, self.query_score)[None] * scale if self.additive else None
            pooled = direction_pool(rows, direction, attention_mask).squeeze(2).expand(batch, heads, width)
            if attention_mask is not None:  # sum_i alpha_i is 0, not 1, in a row without real tokens: q_g = 0
                b_q = b_q * attention_mask.bool().any(-1)[:, None, None].to(b_q.dtype)  # (B, 1, 1) * (H, d)
            global_query = torch.einsum("hkD,bhD->bhk", w_q, pooled.to(w_q.dtype)) + b_q  # q_g (B, H, d)
            if self.additive:
                direction = torch.einsum("hkD,bhk->bhD", w_k, self.key_score * global_query * scale)
                pooled = direction_pool(rows, direction, attention_mask).squeeze(2)
            global_key = global_query * (torch.einsum("hkD,bhD->bhk", w_k, pooled.to(w_k.dtype)) + b_k)  # k_g
            fold_output = plain_linears(self.output) and self.folds_output_projection(batch, length, width)
            left_q, left_r, bias = self._folded_output_maps(fold_output)
            dtype = x.dtype
            scaled = column_scaled(left_r, global_key.reshape(batch, width), dtype)  # (W_o) W_r diag(k_g)
            matrix = torch.baddbmm(left_q.to(dtype), scaled, value_layer.weight.to(dtype).expand(batch, -1, -1))
            offset = (scaled @ value_layer.bias.to(dtype)).to(bias.dtype) + bias  # c (B, D)
            out = torch.baddbmm(offset.to(dtype)[:, None, :], x, matrix.transpose(1, 2))  # (B, N, D)
        return out if fold_output else self.output(out)

    def _folded_output_maps(self, fold_output: bool):
        """(A, R, b) of the folded form's map A + R diag(k_g) W_v and offset R diag(k_g) b_v + b: with
        the output projection folded in, (W_o W_q, W_o W_r, W_o (b_q + b_r) + b_o), two (D, D)
        products per call where applying W_o would cost 2 N D^2 per sequence (`folds_output_projection`);
        else (W_q, W_r, b_q + b_r). The two orders give the same function; under bf16 they round
        differently (about 1e-3 relative), so a sequence's bf16 output can differ at that level
        between a batch that folds and one that does not."""
        bias = self.query.bias + self.transform.bias
        if not fold_output:
            return self.query.weight, self.transform.weight, bias
        w_o = self.output.weight
        bias = w_o @ bias if self.output.bias is None else torch.addmv(self.output.bias, w_o, bias)
        return w_o @ self.query.weight, w_o @ self.transform.weight, bias


register_attention("full", FullAttention)
register_attention("zformer", ZformerAttention, cache_layer=ZformerStateLayer)
register_attention("xformer", XformerAttention)
register_attention("fastformer", FastformerAttention, cache_layer=FastformerStateLayer)

# type name -> `Attention` class, a view of the registry (a type registered later is in it too)
ATTENTION_CLASSES = AttentionClasses(attention_types(), lambda entry: entry.encoder)
