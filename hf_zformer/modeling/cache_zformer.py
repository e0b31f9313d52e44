"""The decoding cache of Zformer-family decoders: a transformers `Cache` with one layer per decoder
layer (transformers' `DynamicLayer` for full attention, a fixed-size recurrent layer for Zformer
and Fastformer, one of transformers' linear-attention cache layers) and, for encoder-decoders, the
projected encoder states of each cross-attention. In recording mode (assisted decoding) it crops
back to any token of the forwards since its last crop.

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin

from .attention_registry import attention_type


class RecurrentLayer(LinearAttentionCacheLayerMixin):
    """A cache layer whose state has a fixed size (no sequence axis): `tensors()` lists it. It is a
    transformers linear-attention cache layer (`LinearAttentionCacheLayerMixin`), so transformers'
    generic cache code tells it from a key/value layer: its state tensors, batch first, are
    `recurrent_states` (one entry per tensor), it has no `conv_states` (a causal convolution's
    inputs live in the cache's `conv_layers`) and no keys and values to read. It counts the tokens
    it has seen (padding included, as a `DynamicLayer` does), so `get_seq_length` works when every
    layer is recurrent. Beam search and batch selection index the state's batch axis. A running sum
    cannot drop its last tokens by itself: `crop` is the cache's (`ZformerCache.crop`, which
    restores a recorded state and reads the kept tokens again), and the layer's own refuses."""

    is_compileable = False
    supports_early_init = False

    def __init__(self):
        self.num_tokens = 0
        self.is_initialized = False
        self.device = None
        self.dtype = None
        self.record_past = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor = None, **kwargs) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def state_tensors(self) -> list[torch.Tensor]:
        """The state as batched tensors (B, ...), what `recurrent_states` shows."""
        return self.tensors()

    # transformers' linear-attention layer interface, read-only views of the state
    @property
    def number_of_states(self) -> int:
        return max(1, len(self.state_tensors()))

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:
        held = self.state_tensors()
        return {i: held[i] if i < len(held) else None for i in range(self.number_of_states)}

    @property
    def has_previous_state(self) -> dict[int, bool]:
        return {i: tensor is not None for i, tensor in self.recurrent_states.items()}

    @property
    def is_recurrent_states_initialized(self) -> dict[int, bool]:
        return self.has_previous_state

    @property
    def conv_states(self) -> dict[int, None]:
        return dict.fromkeys(range(self.number_of_states))

    @property
    def is_conv_states_initialized(self) -> dict[int, bool]:
        return dict.fromkeys(range(self.number_of_states), False)

    @property
    def conv_kernel_size(self) -> dict[int, None]:
        return dict.fromkeys(range(self.number_of_states))

    @property
    def is_croppable(self) -> bool:
        return False  # alone; the cache crops (`ZformerCache.is_croppable`)

    def batch_rows(self) -> int | None:
        """The rows of the batch that filled the layer, or None while it is empty."""
        held = self.tensors()
        return held[0].shape[0] if held else None

    def _map(self, function) -> None:
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} keeps a fixed-size state, not keys and values: its attention "
                        "computes the state and calls `store`")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs):
        raise TypeError(f"{type(self).__name__} has no convolution state: its attention computes the state and "
                        "calls `store`")

    update_recurrent_state = update_conv_state

    def increase_count(self, state_idx: int = 0):
        raise TypeError(f"{type(self).__name__} counts its tokens in `store`")

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs):
        self.record_past = True
        self.recurrent_states_to_keep = recurrent_states_to_keep

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            self._map(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(f"{type(self).__name__} is a running sum: it cannot drop its last tokens by itself "
                             "(the cache can, in recording mode: `ZformerCache.crop`)")


class ZformerStateLayer(RecurrentLayer):
    """Causal Zformer's state: `state`, the running sum of k_j^T v_j per head (B, H, d_h, d_h) in
    fp32, or None before the first token. The attention computes it (`add_key_value_products`) and
    stores it here."""

    def __init__(self):
        super().__init__()
        self.state: torch.Tensor | None = None

    def store(self, state: torch.Tensor, new_tokens: int) -> None:
        """Keep `state`, the sum over every token so far, `new_tokens` of them new."""
        if not self.is_initialized:
            self.lazy_initialization(state, state)
        self.state = state
        self.num_tokens += new_tokens

    def tensors(self):
        return [] if self.state is None else [self.state]

    def _map(self, function):
        if self.state is not None:
            self.state = function(self.state)


class FastformerStateLayer(RecurrentLayer):
    """Causal Fastformer's state: for each of its two prefix poolings, `query_pool` and `key_pool`,
    the log-sum-exp of the scores so far (B, H, 1, 1) and the pooling so far (B, H, 1, d_h)
    (`prefix_pool`'s state), or None before the first token. The attention computes them and
    stores them here."""

    def __init__(self):
        super().__init__()
        self.query_pool: tuple[torch.Tensor, torch.Tensor] | None = None
        self.key_pool: tuple[torch.Tensor, torch.Tensor] | None = None

    def store(self, query_pool: tuple[torch.Tensor, torch.Tensor], key_pool: tuple[torch.Tensor, torch.Tensor],
              new_tokens: int) -> None:
        """Keep both poolings' states over every token so far, `new_tokens` of them new."""
        if not self.is_initialized:
            self.lazy_initialization(*query_pool)
        self.query_pool, self.key_pool = query_pool, key_pool
        self.num_tokens += new_tokens

    def tensors(self):
        return [t for state in (self.query_pool, self.key_pool) if state is not None for t in state]

    def _map(self, function):
        if self.query_pool is not None:
            self.query_pool = tuple(function(t) for t in self.query_pool)
        if self.key_pool is not None:
            self.key_pool = tuple(function(t) for t in self.key_pool)


class WindowedStateLayer(RecurrentLayer):
    """A zformer layer with a softmax window of W tokens: `keys`, `values` (B, H_kv, <= W - 1, d),
    the keys (rotated, in a Llama-family decoder) and the values of the last W - 1 tokens, and
    `state` (B, H, F, d + 1) in fp32, sum phi(k_j) [v_j, 1]^T over every older token (None before the first token),
    and with attention sinks `sink_keys`, `sink_values` (B, H_kv, S, d) and `sink_index` (B, S) of
    the first S real tokens (-1 for a slot still empty), and where the feature maps read other keys
    than the softmax (a Llama layer's unrotated ones) `feature_keys` (B, H_kv, <= W - 1, d) of the
    window's tokens. The attention (`attention.windowed_self_attention`) reads them, computes the
    next ones and stores them here."""

    FIELDS = ("keys", "values", "state", "sink_keys", "sink_values", "sink_index", "feature_keys")

    def __init__(self):
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.sink_index: torch.Tensor | None = None
        self.feature_keys: torch.Tensor | None = None

    def store(self, state: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_tokens: int,
              feature_keys: torch.Tensor | None = None) -> None:
        """Keep the state over the tokens before the window and the window's keys and values (and
        the keys its feature maps read, when they are others), `new_tokens` of the tokens seen
        being new."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.state, self.keys, self.values, self.feature_keys = state, keys, values, feature_keys
        self.num_tokens += new_tokens

    def tensors(self):
        return [t for t in (getattr(self, name) for name in self.FIELDS) if t is not None]

    def _map(self, function):
        for name in self.FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, function(getattr(self, name)))


class SideLayer:
    """Decoding state of a decoder layer beside its self-attention's, `value` (a tensor, a tuple of
    them, or None before the first step), batch first: a cross-attention's projected memory
    (keys/values (B, H, Nk, d) for full attention, K^T V (B, H, d, d) for Zformer), stored at the first
    decoding step, or a causal convolution's last `size - 1` inputs (B, size - 1, D)
    (`decoder_conv_size`). Beam search maps every tensor of it."""

    def __init__(self):
        self.value = None

    def _map(self, function):
        if self.value is not None:
            self.value = tuple(function(t) for t in self.value) if isinstance(self.value, tuple) else function(
                self.value
            )

    def tensors(self) -> list[torch.Tensor]:
        if self.value is None:
            return []
        return list(self.value) if isinstance(self.value, tuple) else [self.value]


def _layer_state(layer) -> dict:
    """A cache layer's attributes as they are now: its tensors are replaced by later calls, never
    written in place, so references keep them (a recall-memory layer's per-row dicts are copied)."""
    state = dict(vars(layer))
    if state.get("rows") is not None:
        state["rows"] = [dict(row) for row in state["rows"]]
    return state


class RecordedCall:
    """A decoder forward of `length` new tokens, as a recording cache keeps it (`ZformerCache.record_call`):
    `forward` and its inputs: `tokens` those with the new tokens on axis 1 (ids, embeddings,
    positions; None stays None), `masks` those whose last columns are the new tokens (all the tokens
    so far, or only the new ones), `fixed` the others (the cache, encoder states, flags)."""

    def __init__(self, forward, length: int, tokens: dict, masks: dict, fixed: dict):
        self.forward, self.length, self.tokens, self.masks, self.fixed = forward, length, tokens, masks, fixed


def record_forward(cache, forward, length: int, tokens: dict, masks: dict, fixed: dict) -> None:
    """At the start of a decoder forward: a recording cache keeps it (`ZformerCache.record_call`), since
    a crop may read its tokens again; any other cache (or None) nothing."""
    if getattr(cache, "record_past", False):
        cache.record_call(RecordedCall(forward, length, tokens, masks, fixed))


def replay(calls: list[RecordedCall], keep: int) -> None:
    """Run the first `keep` new tokens of consecutive recorded forwards again, in one forward (without
    gradients): their token inputs joined, each mask as the last forward gave it (or joined, when the
    forwards passed only the new tokens' columns), cut to the kept tokens."""
    drop = sum(call.length for call in calls) - keep
    last = calls[-1]
    inputs = dict(calls[0].fixed)
    for name in last.tokens:
        parts = [call.tokens[name] for call in calls]
        inputs[name] = None if any(part is None for part in parts) else torch.cat(parts, 1)[:, :keep]
    for name, mask in last.masks.items():
        if mask is not None and mask.shape[1] == last.length:  # only the new tokens' columns
            mask = torch.cat([call.masks[name] for call in calls], 1)
        inputs[name] = None if mask is None else mask[:, : mask.shape[1] - drop]
    with torch.no_grad():
        last.forward(**inputs)


def self_attention_layer(kind: str, window: int = 0):
    """The cache layer of causal self-attention of type `kind`: a `WindowedStateLayer` with a softmax
    window, else the type's fixed-size state (its `cache_layer` in `attention_registry`), or keys and
    values (`DynamicLayer`) for a type without one."""
    if window:
        return WindowedStateLayer()
    make = attention_type(kind).cache_layer
    return DynamicLayer() if make is None else make()


class ZformerCache(Cache):
    """Decoding state of a Zformer-family decoder, what `generate()` passes as `past_key_values`.

    `layers[i]` holds decoder layer i's causal self-attention: a transformers `DynamicLayer` of keys
    and values for `full` layers (it grows with the output), a `ZformerStateLayer` or
    `FastformerStateLayer` for `zformer` / `fastformer` layers (fixed size). With
    `cross_attention=True` (encoder-decoders) `memory_layers[i]` keeps layer i's projected encoder
    states. Attention modules reach it through `update` (self-attention) and `update_memory` /
    `memory` (cross-attention); beam search reorders both parts. The cache computes nothing: a full
    layer's `update` stores keys/values and returns them all (transformers' protocol); a Zformer or
    Fastformer layer is read and written by its attention (`layers[i].state`, `.query_pool`,
    `.key_pool`, `.store(...)`). A zformer layer with a softmax window gets a `WindowedStateLayer`
    (the window's last keys and values and the state over older tokens: also fixed size). With
    `conv_size` > 0, `conv_layers[i]` keeps the last inputs of layer i's causal convolution
    (`conv_state` / `update_conv`). Beam search reorders every part. In recording mode
    (`activate_past_recording`, for assisted decoding) `crop` restores the state before the forwards
    since the last crop and reads the kept tokens again.

    Args:
        layer_types: the decoder's attention type per layer (`"full"`, `"zformer"`, `"fastformer"` or
            another causal type of `attention_registry`, whose layer `self_attention_layer` builds).
        cross_attention: whether the decoder has cross-attention.
        windows: the softmax window of each layer (0: none), or None (no layer has one).
        conv_size: the decoder's `decoder_conv_size` (0: no convolution).
    """

    def __init__(self, layer_types: list[str], cross_attention: bool = False, windows: list[int] | None = None,
                 conv_size: int = 0):
        windows = [0] * len(layer_types) if windows is None else windows
        layers = [self_attention_layer(kind, window) for kind, window in zip(layer_types, windows, strict=True)]
        super().__init__(layers=layers)
        self.memory_layers = [SideLayer() for _ in layer_types] if cross_attention else []
        self.conv_layers = [SideLayer() for _ in layer_types] if conv_size else []
        self.record_past = False
        self.recurrent_states_to_keep = None
        self._recorded = None  # (every layer's state before the first of them, [RecordedCall]) since the last crop
        self._replaying = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Full self-attention of layer `layer_idx`: stores the new tokens' keys/values (B, H, N, d) and
        returns all of them (B, H, past + N, d)."""
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens layer `layer_idx` has seen: every layer counts them, a fixed-size one too
        (transformers' own `Cache` asks a key/value layer instead before 5.25)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length) if layer_idx < len(self.layers) else (query_length, 0)

    def has_memory(self, layer_idx: int) -> bool:
        return layer_idx < len(self.memory_layers) and self.memory_layers[layer_idx].value is not None

    def memory(self, layer_idx: int):
        return self.memory_layers[layer_idx].value

    def update_memory(self, memory, layer_idx: int) -> None:
        """Store cross-attention layer `layer_idx`'s projected encoder states."""
        self.memory_layers[layer_idx].value = memory

    def conv_state(self, layer_idx: int) -> torch.Tensor | None:
        """Layer `layer_idx`'s last convolution inputs (B, size - 1, D), None before the first call."""
        return self.conv_layers[layer_idx].value

    def update_conv(self, state: torch.Tensor, layer_idx: int) -> None:
        self.conv_layers[layer_idx].value = state

    def batch_size(self) -> int | None:
        """The batch the cache was filled with (the rows of its state), or None while it is empty."""
        for layer in self.layers:
            if isinstance(layer, RecurrentLayer):
                if layer.batch_rows() is not None:
                    return layer.batch_rows()
            elif layer.is_initialized and layer.keys is not None:
                return layer.keys.shape[0]
        for layer in (*self.memory_layers, *self.conv_layers):
            if layer.tensors():
                return layer.tensors()[0].shape[0]
        return None

    def self_attention_numel(self) -> int:
        """Elements held by the self-attention layers (causal convolutions included): constant in the
        generated length for Zformer and Fastformer layers, growing for full attention."""
        total = sum(t.numel() for layer in self.conv_layers for t in layer.tensors())
        for layer in self.layers:
            if isinstance(layer, RecurrentLayer):
                total += sum(t.numel() for t in layer.tensors())
            elif layer.is_initialized:
                total += layer.keys.numel() + layer.values.numel()
        return total

    def _map_side_layers(self, function):
        for layer in (*self.memory_layers, *self.conv_layers):
            layer._map(function)

    def reset(self):
        super().reset()
        for layer in (*self.memory_layers, *self.conv_layers):
            layer.value = None
        self._recorded = None

    # Speculative (assisted) decoding: a crop back to any of the tokens of the forwards since the last crop.

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs):
        """Recording mode, which `generate()` turns on for assisted decoding (and for the draft model's
        cache): from then on `crop(-n)` can drop the last n tokens of the forwards run since the last
        crop. At the first such forward the cache keeps every layer's state as it was (a fixed-size
        copy of references: states are replaced, never written in place) and each forward leaves its
        inputs (`record_call`); `crop(-n)` restores the kept state and runs the tokens that stay
        through the decoder again, in one forward.
        Between two crops the cache thus holds one state besides its own and the inputs of the
        recorded forwards (a verification step's draft tokens): constant in the generated length.
        `recurrent_states_to_keep` (the draft length transformers passes) is kept for transformers'
        `get_recurrent_states_to_keep`; any crop within the recorded tokens works."""
        self.record_past = True
        self.recurrent_states_to_keep = recurrent_states_to_keep
        for layer in self.layers:
            if isinstance(layer, RecurrentLayer):
                layer.activate_past_recording(recurrent_states_to_keep)

    def record_call(self, call: RecordedCall) -> None:
        """Called by the decoder at the start of each forward: in recording mode, keep every layer's
        state before the first forward since the last crop, and the forward's inputs."""
        if not self.record_past or self._replaying:
            return
        if self._recorded is None:
            self._recorded = ([_layer_state(layer) for layer in self._all_layers()], [])
        self._recorded[1].append(call)

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can drop tokens: in recording mode always; otherwise when every layer keeps keys
        and values (`DynamicLayer`) and no causal convolution keeps inputs."""
        return self.record_past or (not self.conv_layers and all(isinstance(layer, DynamicLayer) for layer in self.layers))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers' convention: a negative count). In
        recording mode (`activate_past_recording`) any count up to the tokens of the forwards since
        the last crop: the state before them comes back and the tokens that stay are read again; a
        crop of 0 only ends the recorded span. Otherwise transformers' crop of each layer, which a
        fixed-size state refuses."""
        if not self.record_past:
            super().crop(tokens_to_remove)
            return
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass the number of tokens to drop as a negative count")
        drop = -tokens_to_remove
        if drop and self._recorded is None:
            raise ValueError(f"crop({tokens_to_remove}): no forward was recorded since the last crop, so there are no "
                             "tokens to drop")
        total = sum(call.length for call in self._recorded[1]) if drop else 0
        if drop > total:
            raise ValueError(f"crop({tokens_to_remove}): the forwards since the last crop read {total} tokens; a "
                             "fixed-size state can only go back within them")
        recorded, self._recorded = self._recorded, None
        if drop == 0:
            return
        saved, calls = recorded
        for layer, state in zip(self._all_layers(), saved, strict=True):
            layer.__dict__.clear()
            layer.__dict__.update(state)
        if drop == total:  # back to the state before them: nothing to read again
            return
        self._replaying = True
        try:
            replay(calls, total - drop)
        finally:
            self._replaying = False

    def _all_layers(self) -> list:
        return [*self.layers, *self.memory_layers, *self.conv_layers]

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._map_side_layers(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_side_layers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._map_side_layers(lambda t: t[indices])


__all__ = ["ZformerCache", "ZformerStateLayer", "FastformerStateLayer", "WindowedStateLayer"]
