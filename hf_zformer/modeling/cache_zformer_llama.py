"""The decoding cache of Llama-family decoders with Zformer-family attention
(`modeling_zformer_llama`): one layer per decoder layer, its size constant in the generated length
for every attention type but "full".

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .cache_zformer import FastformerStateLayer, RecurrentLayer, ZformerCache, ZformerStateLayer


class WindowedStateLayer(RecurrentLayer):
    """A zformer layer with a softmax window of W tokens: `keys`, `values` (B, H_kv, <= W - 1, d),
    the rotated keys and the values of the last W - 1 tokens, and `state` (B, H, F, d + 1) in fp32,
    sum phi(k_j) [v_j, 1]^T over every older token (None before the first token). The attention
    (`RotaryLinearAttention`) reads them, computes the next ones and stores them here."""

    def __init__(self):
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.state: torch.Tensor | None = None

    def store(self, state: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, new_tokens: int) -> None:
        """Keep the state over the tokens before the window and the window's keys and values,
        `new_tokens` of the tokens seen being new."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.state, self.keys, self.values = state, keys, values
        self.num_tokens += new_tokens

    def tensors(self):
        return [t for t in (self.keys, self.values, self.state) if t is not None]

    def _map(self, function):
        for name in ("keys", "values", "state"):
            if getattr(self, name) is not None:
                setattr(self, name, function(getattr(self, name)))


class ZformerLlamaCache(ZformerCache):
    """Decoding state of a `ZformerLlamaForCausalLM`, what `generate()` passes as the cache:
    `layers[i]` is a transformers `DynamicLayer` (keys and values, growing) for a "full" layer, a
    `ZformerStateLayer` for a "zformer" layer without a window, a `WindowedStateLayer` for one
    with a window, a `FastformerStateLayer` for a "fastformer" layer. Beam search reorders every
    layer; the cache only stores (the attention modules compute).

    Args:
        layer_types: the attention type of each layer.
        windows: the softmax window of each layer (0: none).
    """

    def __init__(self, layer_types: list[str], windows: list[int]):
        layers = []
        for kind, window in zip(layer_types, windows, strict=True):
            if kind == "full":
                layers.append(DynamicLayer())
            elif kind == "fastformer":
                layers.append(FastformerStateLayer())
            else:
                layers.append(WindowedStateLayer() if window else ZformerStateLayer())
        Cache.__init__(self, layers=layers)
        self.memory_layers = []


__all__ = ["ZformerLlamaCache", "WindowedStateLayer"]
