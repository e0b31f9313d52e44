"""The decoding cache of Llama-family decoders with Zformer-family attention
(`modeling_zformer_llama`): one layer per decoder layer, its size constant in the generated length
for every attention type but "full".

This file ships to the Hugging Face Hub with every checkpoint: torch, transformers and siblings only.
"""

from .attention_memory import MemoryStateLayer
from .cache_zformer import WindowedStateLayer, ZformerCache


class ZformerLlamaCache(ZformerCache):
    """Decoding state of a `ZformerLlamaForCausalLM`, what `generate()` passes as the cache:
    `layers[i]` is a transformers `DynamicLayer` (keys and values, growing) for a "full" layer, a
    `ZformerStateLayer` for a "zformer" layer without a window, a `WindowedStateLayer` for one
    with a window (a `MemoryStateLayer` when the layers keep a recall memory, `attention_memory` > 0),
    a `FastformerStateLayer` for a "fastformer" layer. Beam search reorders every
    layer; the cache only stores (the attention modules compute).

    Args:
        layer_types: the attention type of each layer.
        windows: the softmax window of each layer (0: none).
        memory: the `attention_memory` slots of the windowed layers (0: none).
    """

    def __init__(self, layer_types: list[str], windows: list[int], memory: int = 0):
        super().__init__(layer_types, windows=windows)
        if memory:
            self.layers = [MemoryStateLayer() if window else layer for layer, window in zip(self.layers, windows)]


__all__ = ["ZformerLlamaCache", "MemoryStateLayer", "WindowedStateLayer"]
