"""Configuration of Llama-family decoders with Zformer-family attention (model type `"zformer_llama"`).

This file ships to the Hugging Face Hub with every saved checkpoint: it imports only the
standard library, transformers and its configuration siblings (no torch module).
"""

from transformers import LlamaConfig

from .attention_registry import attention_types
from .configuration_zformer import check_attention_sinks

# Every type with a causal form has a Llama-family class (`attention_llama`); a view of the one
# table (`attention_registry`).
LLAMA_ATTENTION_TYPES = attention_types(causal=True)
LLAMA_FEATURE_MAPS = ("identity", "hedgehog")
MEMORY_POSITIONS = ("text", "cache")  # where a recall memory's keys are read (`attention_memory_positions`)


def _per_layer_list(field, value, num_layers, check):
    """`value` (one entry, or a list with one entry per layer) as a list of `num_layers` entries,
    each passed through `check(name, entry)`."""
    entries = list(value) if isinstance(value, (list, tuple)) else [value] * num_layers
    if len(entries) != num_layers:
        raise ValueError(f"{field} has {len(entries)} entries ({entries}) but the model has {num_layers} layers")
    for i, entry in enumerate(entries):
        check(f"{field}[{i}]" if isinstance(value, (list, tuple)) else field, entry)
    return entries


def _check_type(name, entry):
    if entry not in LLAMA_ATTENTION_TYPES:
        raise ValueError(f"{name}={entry!r} is not supported; choose one of {list(LLAMA_ATTENTION_TYPES)}")


def _check_window(name, entry):
    if not (isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0):
        raise ValueError(f"{name}={entry!r} must be a non-negative integer (0: no softmax window)")


class ZformerLlamaConfig(LlamaConfig):
    r"""
    A Llama-family decoder (rotary positions, grouped key/value heads, RMSNorm, gated MLP: Llama,
    SmolLM, Mistral and, with `attention_bias=True`, Qwen2) whose self-attention is chosen per
    layer. Every field of [`LlamaConfig`] keeps its meaning; the weights carry Llama's names, so
    a Llama checkpoint loads as it is and the new attention parameters start at their init.

    Args:
        attention_type (`str` or `list[str]`): per layer, `"full"` (the source's softmax attention,
            exactly), `"zformer"` (linear attention over the rotated queries and keys, with the
            feature map `zformer_feature_map`) or `"fastformer"` (causal additive attention over the
            unrotated projections: prefix softmax poolings, a constant-size state).
        zformer_feature_map (`"identity"` or `"hedgehog"`, default `"hedgehog"`, the map that linearizes a
            pretrained model; `ZformerConfig`'s default is `"identity"`): `"identity"`: `Q (K^T V) / (sqrt(d_h) s)`,
            a learnable scale `s` per layer; `"hedgehog"`: normalised attention over the learned maps
            phi(x) = [softmax(W x + b), softmax(-(W x + b))] per head (identity at init).
        attention_window (`int` or `list[int]`): per layer, 0 or the number W of most recent tokens
            (the query's own included) that a hedgehog zformer layer attends to with softmax
            weights; older tokens enter through the feature map, and both kinds of weight share one
            normalisation (LoLCATs-style). The decoding state is then the last W keys and values plus
            the linear state: still constant in the generated length. Only zformer layers with the
            hedgehog map take a window.
        attention_sinks (`int`): 0 (default) or the number S of first tokens of each sequence (its first S
            real tokens, whatever the padding) that every windowed layer keeps as softmax keys for
            all later tokens (StreamingLLM's attention sinks): pretrained decoders put much of their
            attention on the first tokens, which a window alone loses. Needs a window; the decoding
            state gains their S keys and values, still constant in the generated length.
        feature_map_horizon (`int`): 0 (default) or a number of tokens tau: the feature-map weights of
            the tokens older than the window fade with their age, w * exp(-age / tau), tau learned per
            head from this start. Without it every older token keeps its full weight however old,
            and their total grows with the text; with it the total stays bounded. Needs a window;
            the decoding state keeps its size.
        rotary_feature_maps (`bool`, default `True`): whether the Hedgehog maps of windowed layers read
            the rotated queries and keys (as the softmax does) or, with `False`, the unrotated
            projections. A map of a rotated vector depends on the token's absolute position, which a
            model trained on short texts has not seen past their length; unrotated, the feature-map
            part is the same at every position (the window keeps the rotary positions). The cache
            then keeps the window's unrotated keys too. Needs a window.
        zformer_scale_init (`float`): initial `s` of identity-map zformer layers (the converter
            calibrates each layer's own).
        attention_memory (`int`): 0 (default) or a number M of older tokens per key/value head that every
            windowed layer keeps as softmax keys, chosen as the ones its linear state would recall
            worst (a recall memory, `attention_memory.py`): what the window drops is then not only
            in the state's blurred sum. Needs a window; the decoding state stays constant in the
            generated length (S + M + W + C - 1 keys and values per key/value head besides the state).
        attention_memory_chunk (`int`, default 64): C, how many tokens leave the window before they
            are placed in the memory or the state; until then they stay softmax keys.
        attention_memory_positions (`str`, default `"text"`): the rotary positions at which a layer with
            a recall memory reads its softmax keys: `"text"`, where each token stands in the text, or
            `"cache"`, its place in the cache (the sinks first, then the memory slots in the order of
            their tokens, then the recent tokens, each query at its own place among them), as
            StreamingLLM positions its cache: a long text then reads like one of S + M + W + C tokens.
            The cache keeps the keys unrotated and rotates them when they are read.
    """

    model_type = "zformer_llama"

    attention_type: str | list[str] = "full"
    zformer_feature_map: str = "hedgehog"
    attention_window: int | list[int] = 0
    attention_sinks: int = 0
    feature_map_horizon: int = 0
    rotary_feature_maps: bool = True
    zformer_scale_init: float = 1.0
    attention_memory: int = 0
    attention_memory_chunk: int = 64
    attention_memory_positions: str = "text"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self):
        """Raise a ValueError naming the field and value of the first invalid setting of the fields
        added to Llama's. Runs at construction and when a model is built from this config."""
        types = self.layer_attention_types()
        windows = self.layer_windows()
        if self.zformer_feature_map not in LLAMA_FEATURE_MAPS:
            raise ValueError(f"zformer_feature_map={self.zformer_feature_map!r} is not supported; choose one of "
                             f"{list(LLAMA_FEATURE_MAPS)}")
        for i, (kind, window) in enumerate(zip(types, windows)):
            if window and not (kind == "zformer" and self.zformer_feature_map == "hedgehog"):
                raise ValueError(
                    f"attention_window={self.attention_window!r}: layer {i} ({kind!r}, zformer_feature_map="
                    f"{self.zformer_feature_map!r}) has window {window}; only zformer layers with the hedgehog map "
                    "take a softmax window (its weights and the feature map's share one normalisation)"
                )
        check_attention_sinks(self.attention_sinks, windows)
        horizon = self.feature_map_horizon
        if not (isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 0):
            raise ValueError(f"feature_map_horizon={horizon!r} must be a non-negative integer (0: no fading)")
        if not isinstance(self.rotary_feature_maps, bool):
            raise ValueError(f"rotary_feature_maps={self.rotary_feature_maps!r} must be True or False")
        if not self.rotary_feature_maps and not any(windows):
            raise ValueError("rotary_feature_maps=False needs a softmax window (attention_window); no layer has one, "
                             "and a feature map without a window is the layer's only source of positions")
        if horizon and not any(windows):
            raise ValueError(f"feature_map_horizon={horizon} needs a softmax window (attention_window); no layer "
                             "has one, and without a window there is no older part to fade")
        for name in ("attention_memory", "attention_memory_chunk"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= (name != "attention_memory")):
                raise ValueError(f"{name}={value!r} must be an integer, at least {int(name != 'attention_memory')}")
        if self.attention_memory_positions not in MEMORY_POSITIONS:
            raise ValueError(f"attention_memory_positions={self.attention_memory_positions!r}: choose one of "
                             f"{list(MEMORY_POSITIONS)}")
        if self.attention_memory_positions == "cache" and not self.attention_memory:
            raise ValueError("attention_memory_positions='cache' reads a recall memory's keys; attention_memory=0 "
                             "keeps none (set attention_memory, or leave the positions at 'text')")
        if self.attention_memory and not any(windows):
            raise ValueError(f"attention_memory={self.attention_memory} needs a softmax window (attention_window); no "
                             "layer has one, and the memory keeps what leaves the window")
        if not (isinstance(self.zformer_scale_init, (int, float)) and self.zformer_scale_init > 0):
            raise ValueError(f"zformer_scale_init={self.zformer_scale_init!r} must be a positive number")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def layer_attention_types(self) -> list[str]:
        """The attention type of each layer."""
        return _per_layer_list("attention_type", self.attention_type, self.num_hidden_layers, _check_type)

    def layer_windows(self) -> list[int]:
        """The softmax window of each layer (0: none)."""
        return _per_layer_list("attention_window", self.attention_window, self.num_hidden_layers, _check_window)


__all__ = ["ZformerLlamaConfig"]
