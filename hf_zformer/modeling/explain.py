"""`explain(model, inputs)`: the path each attention layer's operations would take for these inputs
under the execution policy in force (`policy.py`), worked out from shapes, dtypes and device types
alone: no kernel runs, no tensor is computed, and the device may be one this machine lacks
(`explain(model, inputs, device="cuda", autocast=torch.bfloat16)` answers for a GPU from a CPU).

Each answer comes from the same predicates the forward calls (`ops.*_path`,
`attention.use_folded_form`, `blocks.stacks_projections`), asked with descriptions of the tensors
(`TensorSpec`) instead of the tensors. The forms (`policy.FORMS`): `torch`, `folded`, `triton`,
`fla`; besides them a module's `form` is `plain` or `pooled` (fastformer's pooled output) and a
projection `stacked` (one product for q, k and v) or `torch`.

Nothing imports this module at run time: it is a report, not a step of the forward.
"""

import dataclasses

import torch

from .attention import Attention, FastformerAttention, FullAttention, ZformerAttention, use_folded_form
from .blocks import stacks_projections
from .ops import (
    column_scaled_path,
    column_scaled_product_path,
    direction_pool_path,
    linear_attention_path,
    softmax_pool_path,
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the path predicates read of a tensor: its shape, dtype, device and whether autograd
    records it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    def numel(self) -> int:
        total = 1
        for size in self.shape:
            total *= size
        return total

    def like(self, *shape: int, dtype: torch.dtype | None = None) -> "TensorSpec":
        """Another tensor on this device: `shape`, in `dtype` (default: this one's)."""
        return TensorSpec(tuple(shape), dtype or self.dtype, self.device, self.requires_grad)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One forward call as a layer sees it."""

    hidden: TensorSpec  # the layer's input (B, N, D) in the residual stream's dtype
    low: torch.dtype  # the projections' dtype (autocast's, else the stream's)
    autocast: torch.dtype | None
    memory_length: int  # cross-attention's memory (the encoder's tokens)
    has_state: bool  # a cache with earlier tokens
    return_state: bool  # a cache that keeps this call's state


def explain(model: torch.nn.Module, inputs, *, device=None, dtype: torch.dtype | None = None, autocast="live",
            grad: bool | None = None, show: bool = False) -> list[dict]:
    """For each attention layer of `model` (its `Attention` modules, in order), a dict: `layer` (the
    module's name), `type`, `role` (self, causal or cross), `device`, `dtype`, `autocast`, `length`,
    `width`, and `paths`, {operation: form}. `inputs`: the keyword arguments of a forward call
    (`input_ids` or `inputs_embeds`, `decoder_input_ids` for an encoder-decoder's decoder,
    `past_key_values`, `use_cache`), or one tensor (ids (B, N) or hidden states (B, N, D)).

    `device` (default: the model's), `dtype` (the residual stream's; default: the model's),
    `autocast` (an autocast dtype, or None for none; default: the autocast in force on that device
    type) and `grad` (whether autograd records; default: grad mode on and trainable parameters)
    describe the call asked about. `show` prints one line per layer too."""
    parameter = next(model.parameters())
    device = torch.device(device) if device is not None else parameter.device
    dtype = dtype or parameter.dtype
    if autocast == "live":
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    if grad is None:
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    batch, length, decoder_length = _lengths(inputs)
    config = getattr(model, "config", None)
    has_state = _get(inputs, "past_key_values") is not None
    keeps = bool(_get(inputs, "use_cache", getattr(config, "use_cache", False))) and _get(inputs, "labels") is None
    rows = []
    with torch.set_grad_enabled(grad):
        for name, module in model.named_modules():
            if not isinstance(module, Attention):
                continue
            own = decoder_length if module.is_causal or module.is_cross else length
            hidden = TensorSpec((batch, own, module.num_heads * module.head_dim), dtype, device, grad)
            # a causal layer's cache holds earlier tokens or keeps this call's; a cross layer's, the memory's K^T V
            cached = has_state and module.is_causal or keeps and module.is_cross
            call = _Call(hidden, autocast or dtype, autocast, length, cached, keeps and module.is_causal)
            rows.append({"layer": name, "type": type(module).__name__, "role": _role(module), "device": device.type,
                         "dtype": str(dtype).removeprefix("torch."),
                         "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
                         "length": own, "width": hidden.shape[-1], "paths": layer_paths(module, call)})
    if show:
        print(format_report(rows))
    return rows


def format_report(rows: list[dict]) -> str:
    """`explain`'s rows as text, one line per layer."""
    lines = []
    for row in rows:
        autocast = f" autocast {row['autocast']}" if row["autocast"] else ""
        paths = ", ".join(f"{operation}={form}" for operation, form in row["paths"].items())
        lines.append(f"{row['layer'] or '(module)'} [{row['type']}, {row['role']}, {row['device']} {row['dtype']}"
                     f"{autocast}, N={row['length']}, D={row['width']}]: {paths}")
    return "\n".join(lines)


def _get(inputs, key: str, default=None):
    return inputs.get(key, default) if isinstance(inputs, dict) else default


def _lengths(inputs) -> tuple[int, int, int]:
    """(batch, tokens, the decoder's tokens) of a forward call's inputs."""
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids" if inputs.dim() == 2 else "inputs_embeds": inputs}
    tokens = next((inputs[k] for k in ("input_ids", "inputs_embeds", "hidden_states") if inputs.get(k) is not None),
                  None)
    if tokens is None:
        raise ValueError("explain: inputs need input_ids, inputs_embeds or hidden_states")
    decoder = next((inputs[k] for k in ("decoder_input_ids", "decoder_inputs_embeds") if inputs.get(k) is not None),
                   tokens)
    return tokens.shape[0], tokens.shape[1], decoder.shape[1]


def _role(module: Attention) -> str:
    return "cross" if module.is_cross else "causal" if module.is_causal else "self"


def layer_paths(module: Attention, call: _Call) -> dict[str, str]:
    """{operation: form} of one attention module for one call (see `explain`)."""
    if isinstance(module, ZformerAttention):
        return _zformer_paths(module, call)
    if isinstance(module, FastformerAttention):
        return _fastformer_paths(module, call)
    paths = {"form": "plain"}
    if isinstance(module, FullAttention):
        if not module.is_cross:
            paths["projection"] = _projection(call.hidden, module.query, module.key, module.value)
        paths["softmax_attention"] = module.config._attn_implementation
    return paths


def _projection(hidden: TensorSpec, *layers) -> str:
    return "stacked" if stacks_projections(hidden, *layers) else "torch"


def _folded(module: Attention, call: _Call, pays_off: bool, *layers) -> bool:
    if module.is_causal or module.is_cross:
        return False
    return use_folded_form(call.hidden, pays_off, *layers, autocast_devices=module.folded_autocast(),
                           autocast_dtype=call.autocast)


def _heads(module: Attention, call: _Call, width: int, length: int | None = None, dtype=None) -> TensorSpec:
    """A (B, H, N, width) tensor of the module's heads."""
    hidden = call.hidden
    return hidden.like(hidden.shape[0], module.num_heads, length or hidden.shape[1], width, dtype=dtype or call.low)


def _zformer_paths(module: ZformerAttention, call: _Call) -> dict[str, str]:
    layers = (module.query, module.key, module.value)
    if module.key_map is None and _folded(module, call, module.folded_form_pays_off(*call.hidden.shape[1:]), *layers):
        return {"form": "folded"}
    paths = {"form": "plain"}
    if not module.is_cross:
        paths["projection"] = _projection(call.hidden, *layers)
    keys = call.memory_length if module.is_cross else call.hidden.shape[1]
    dim = module.head_dim
    if module.query_map is None:
        query, key, value = _heads(module, call, dim), _heads(module, call, dim, keys), _heads(module, call, dim, keys)
    else:  # phi(Q), phi(K) (2 d) and [V, 1] (d + 1) in fp32
        features = torch.promote_types(call.low, torch.float32)
        query, key = _heads(module, call, 2 * dim, dtype=features), _heads(module, call, 2 * dim, keys, features)
        value = _heads(module, call, dim + 1, keys, features)
    if module.window:  # the older tokens' feature-map part: causal linear attention over the features
        paths["linear_attention"] = linear_attention_path(query, key, value, call.has_state, causal=True)
        return paths
    if module.is_cross and call.has_state:  # the cached memory alone, no new keys
        key = value = None
    paths["linear_attention"] = linear_attention_path(query, key, value, call.has_state, causal=module.is_causal,
                                                      return_state=call.return_state)
    return paths


def _fastformer_paths(module: FastformerAttention, call: _Call) -> dict[str, str]:
    batch, length, width = call.hidden.shape
    layers = [layer for layer in (module.query, module.key, module.value, module.transform) if layer is not None]
    heads = module.num_heads if module.additive else None  # the poolings' directions
    if _folded(module, call, module.folded_form_pays_off(length, width, projections=len(layers)), *layers):
        low = call.hidden.like(batch, 1, length, width, dtype=call.low)  # the cast copy, shared by the heads
        rows = low if low.dtype == call.hidden.dtype or direction_pool_path(low, heads) == "triton" else (
            call.hidden.like(batch, 1, length, width))
        weight = _parameter(module.transform.weight, call)
        return {"form": "folded", "shared_direction_pool": direction_pool_path(rows, heads),
                "column_scale": column_scaled_path(weight, weight.like(batch, width))}
    pooled = not module.is_causal and module._takes_pooled_output(length, width)
    paths = {"form": "pooled" if pooled else "plain"}
    paths["projection"] = _projection(call.hidden, *layers[:-1])
    head = _heads(module, call, module.head_dim)
    if module.is_causal:  # both poolings in fp32 (scores (B, H, N, 1))
        values = head.like(*head.shape, dtype=torch.promote_types(call.low, torch.float32))
        paths["causal_softmax_pool"] = softmax_pool_path(values.like(*head.shape[:3], 1), values, call.has_state,
                                                         causal=True, return_state=call.return_state)
        return paths
    paths["direction_pool"] = direction_pool_path(head, 1 if module.additive else None)
    if pooled:
        weight = _parameter(module.transform.weight, call)
        scales = weight.like(batch, width, dtype=torch.promote_types(call.low, torch.float32))
        projected = call.hidden.like(batch, length, width, dtype=call.low)
        paths["fused_product"] = column_scaled_product_path(projected, projected, weight, scales)
        if paths["fused_product"] != "triton":
            paths["column_scale"] = column_scaled_path(weight, scales)
    return paths


def _parameter(parameter: torch.Tensor, call: _Call) -> TensorSpec:
    """A parameter as a call on `call`'s device sees it."""
    return TensorSpec(tuple(parameter.shape), parameter.dtype, call.hidden.device, parameter.requires_grad)
