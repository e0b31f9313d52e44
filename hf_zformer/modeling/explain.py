"""`explain(model, inputs)`: the path each attention layer's operations would take for these inputs
under the execution policy in force (`policy.py`), worked out from shapes, dtypes and device types
alone: no kernel runs, no tensor is computed, and the device may be one this machine lacks
(`explain(model, inputs, device="cuda", autocast=torch.bfloat16)` answers for a GPU from a CPU).

Each answer comes from the same predicates the forward calls (`ops.*_path`, `ops.causal_form`,
`ops.causal_pool_form`, `attention.use_folded_form`, `attention.steady_decoding`,
`blocks.stacks_projections`), asked with descriptions of the tensors (`TensorSpec`) instead of the
tensors. The forms (`policy.FORMS`): `torch`, `folded`, `triton`, `fla`; besides them a module's
`form` is `plain`, `pooled` (fastformer's pooled output), `windowed` (zformer with a softmax
window) or `memory` (with a recall memory besides it, `attention_memory.py`, torch alone), and a
projection `stacked` (one product for q, k and v) or `torch`.

Causal layers, those of encoder-decoders' decoders and of Llama-family decoders
(`attention_llama`: `q_proj`, `k_proj`, `v_proj` one product each, then the type's
`causal_context`), report:

- softmax attention: `softmax_attention`, the name of transformers' attention function that runs
  (`sdpa`, ...);
- zformer: `linear_attention` (`fla` or `torch`) and, for the torch form, `causal_form`:
  `quadratic` (no state in or out, up to the policy's `zformer_causal_block` tokens), `blocks`
  (`causal_linear_attention`), `step` (one token against the state), or, for a windowed layer's
  feature-map part, `state` (every token older than the window already in the state);
- windowed zformer: `windowed_attention`, `decode_step` (`windowed_decode_step`: one token, the
  window full of real tokens, every sink before it) or `general` (`windowed_linear_attention`,
  with the feature-map part's `linear_attention` where it has older tokens);
- fastformer: `causal_softmax_pool` (`triton`, the prefix-pooling kernel, or `torch`) and, for the
  torch form, `causal_form`: `quadratic` or `prefix` (prefix sums).

A decoding step is a call of one new token after `past` cached tokens: `explain(model, ids[:, :1],
past=P)` (or `inputs` holding the cache itself, whose `get_seq_length()` gives P). Without `past`
or a cache, a call is a prompt: with the model's `use_cache` it keeps its state (as `generate()`'s
first call), with `use_cache=False` (or labels) it does not. An `attention_mask` in `inputs` with
padding is read as the models read it; without one, no padding is assumed.

Nothing imports this module at run time: it is a report, not a step of the forward.
"""

import dataclasses

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import (
    Attention,
    FastformerAttention,
    FullAttention,
    ZformerAttention,
    einsum_attention_forward,
    steady_decoding,
    use_folded_form,
)
from .attention_llama import RotaryAttention
from .blocks import stacks_projections
from .ops import (
    causal_form,
    causal_pool_form,
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
    past: int = 0  # the tokens a causal layer's cache holds before this call
    mask: torch.Tensor | None = None  # the attention mask (B, past + N) where it holds padding


def explain(model: torch.nn.Module, inputs, *, past: int | None = None, device=None, dtype: torch.dtype | None = None,
            autocast="live", grad: bool | None = None, show: bool = False) -> list[dict]:
    """For each attention layer of `model` (its `Attention` modules, in order), a dict: `layer` (the
    module's name), `type`, `role` (self, causal or cross), `device`, `dtype`, `autocast`, `length`,
    `width`, `past` (the tokens a causal layer's cache holds before the call), and `paths`,
    {operation: form}. `inputs`: the keyword arguments of a forward call
    (`input_ids` or `inputs_embeds`, `decoder_input_ids` for an encoder-decoder's decoder,
    `past_key_values` or `cache`, `use_cache`, `attention_mask`), or one tensor (ids (B, N) or
    hidden states (B, N, D)).

    `past`: the tokens a decoding cache holds before these inputs (a decoding step: one new token
    and `past=P`, with a cache that keeps its state); None (the default): those of the cache in
    `inputs` (`get_seq_length()`), 0 without one. `past > 0` implies a cache. Padding is read from
    `inputs`' `attention_mask` where given (as the models do, `blocks.drop_full_mask`).

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
    cache = next((_get(inputs, k) for k in ("past_key_values", "cache") if _get(inputs, k) is not None), None)
    if past is None:
        past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    keeps = bool(_get(inputs, "use_cache", getattr(config, "use_cache", False))) and (
        _get(inputs, "labels") is None or cache is not None) or past > 0
    mask = _get(inputs, "attention_mask")
    mask = None if mask is None or bool(mask.all()) else mask  # as the models keep it (`blocks.drop_full_mask`)
    rows = []
    with torch.set_grad_enabled(grad):
        for name, module in model.named_modules():
            if not isinstance(module, Attention):
                continue
            own = decoder_length if module.is_causal or module.is_cross else length
            hidden = TensorSpec((batch, own, module.num_heads * module.head_dim), dtype, device, grad)
            # a causal layer's cache holds earlier tokens or keeps this call's; a cross layer's, the memory's K^T V
            cached = keeps and (past > 0 and module.is_causal or module.is_cross)
            call = _Call(hidden, autocast or dtype, autocast, length, cached, keeps and module.is_causal,
                         past if keeps else 0, mask)
            rows.append({"layer": name, "type": type(module).__name__, "role": _role(module), "device": device.type,
                         "dtype": str(dtype).removeprefix("torch."),
                         "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
                         "length": own, "width": hidden.shape[-1], "past": call.past if module.is_causal else 0,
                         "paths": layer_paths(module, call)})
    if show:
        print(format_report(rows))
    return rows


def format_report(rows: list[dict]) -> str:
    """`explain`'s rows as text, one line per layer."""
    lines = []
    for row in rows:
        autocast = f" autocast {row['autocast']}" if row["autocast"] else ""
        paths = ", ".join(f"{operation}={form}" for operation, form in row["paths"].items())
        past = f", past={row['past']}" if row.get("past") else ""
        lines.append(f"{row['layer'] or '(module)'} [{row['type']}, {row['role']}, {row['device']} {row['dtype']}"
                     f"{autocast}, N={row['length']}{past}, D={row['width']}]: {paths}")
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
    if isinstance(module, RotaryAttention):
        return _rotary_paths(module, call)
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
    if module.is_causal:
        return {**paths, **_causal_zformer_paths(module, call, query, key, value)}
    if module.is_cross and call.has_state:  # the cached memory alone, no new keys
        key = value = None
    paths["linear_attention"] = linear_attention_path(query, key, value, call.has_state)
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
    if module.is_causal:
        return {**paths, **_causal_pool_paths(module, call)}
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


def _causal_pool_paths(module: FastformerAttention, call: _Call) -> dict[str, str]:
    """Causal fastformer's prefix poolings (`causal_context`): both in fp32, scores (B, H, N, 1)."""
    head = _heads(module, call, module.head_dim)
    values = head.like(*head.shape, dtype=torch.promote_types(call.low, torch.float32))
    path = softmax_pool_path(values.like(*head.shape[:3], 1), values, call.has_state, causal=True,
                             return_state=call.return_state)
    paths = {"causal_softmax_pool": path}
    if path == "torch":
        paths["causal_form"] = causal_pool_form(head.shape[2], call.has_state, call.return_state)
    return paths


def _causal_zformer_paths(module: ZformerAttention, call: _Call, query, key, value) -> dict[str, str]:
    """Causal zformer (`causal_context`) on its heads as `linear_attention` sees them (query, key and
    value: the H query heads, the key/value heads repeated), or its windowed or memory form."""
    if module.window and module.memory:  # `attention_memory.memory_self_attention`: torch alone
        return {"form": "memory", "memory_attention": "torch",
                "memory_positions": "text" if module.memory_rotary is None else "cache"}
    if module.window:
        return {"form": "windowed", **_windowed_paths(module, call)}
    paths = {"linear_attention": linear_attention_path(query, key, value, call.has_state, causal=True,
                                                       return_state=call.return_state)}
    if paths["linear_attention"] == "torch":
        paths["causal_form"] = causal_form(query.shape[2], call.has_state, call.return_state)
    return paths


def _windowed_paths(module: ZformerAttention, call: _Call) -> dict[str, str]:
    """`windowed_self_attention`: the steady decoding step, or the general form, whose feature-map
    part over the tokens older than the window runs causal linear attention (fading weights: the
    torch blocks), the state alone, or nothing while every key lies in the window."""
    length, window = call.hidden.shape[1], module.window
    cached = min(call.past, window - 1)  # the cache keeps the last W - 1 keys
    if call.return_state:  # the cache layer as `steady_decoding` reads it: its keys and its sinks' token indices
        batch = call.hidden.shape[0]
        keys = call.hidden.like(batch, module.num_heads, cached, module.head_dim) if call.past else None
        sinks = None  # the first S tokens, those seen so far (padding aside)
        if module.sinks:
            sinks = torch.tensor([slot if slot < call.past else -1 for slot in range(module.sinks)])
        layer = _CacheLayer(keys, None if sinks is None else sinks.expand(batch, -1))
        if steady_decoding(layer, length, call.mask, window, module.sinks, call.past):
            return {"windowed_attention": "decode_step"}
    paths = {"windowed_attention": "general"}
    older = cached + length - window  # keys some query sees through the feature map
    if older > 0 and module.log_horizon is not None:
        return {**paths, "linear_attention": "torch", "causal_form": "blocks"}
    if older > 0:  # phi(Q), the shifted phi(K) and [V, 1] in fp32
        features = torch.promote_types(call.low, torch.float32)
        query = _heads(module, call, 2 * module.head_dim, dtype=features)
        value = _heads(module, call, module.head_dim + 1, dtype=features)
        paths["linear_attention"] = linear_attention_path(query, query, value, call.has_state, causal=True)
        if paths["linear_attention"] == "torch":
            paths["causal_form"] = causal_form(length, call.has_state)
    elif call.has_state:  # every older token is in the state: phi(Q) against it
        paths.update(linear_attention="torch", causal_form="state")
    return paths


@dataclasses.dataclass(frozen=True)
class _CacheLayer:
    """What `steady_decoding` reads of a windowed cache layer."""

    keys: TensorSpec | None
    sink_index: torch.Tensor | None


def _rotary_paths(module: RotaryAttention, call: _Call) -> dict[str, str]:
    """A Llama-family layer (`attention_llama`): `q_proj`, `k_proj`, `v_proj` one product each, then
    its type's `causal_context`. The rotary tables are in the residual stream's dtype, so the rotated
    queries and keys are in the wider of it and the projections' (values: the projections')."""
    paths = {"form": "plain", "projection": "torch"}
    if isinstance(module, FullAttention):
        paths["softmax_attention"] = _attention_name(module._attention_function(False))
    elif isinstance(module, FastformerAttention):
        paths.update(_causal_pool_paths(module, call))
    elif isinstance(module, ZformerAttention):
        dim, rotated = module.head_dim, torch.promote_types(call.low, call.hidden.dtype)
        if module.query_map is None:
            query, key, value = (_heads(module, call, dim, dtype=rotated), _heads(module, call, dim, dtype=rotated),
                                 _heads(module, call, dim))
        else:  # phi(Q), phi(K) (2 d) and [V, 1] (d + 1) in fp32
            features = torch.promote_types(rotated, torch.float32)
            query = _heads(module, call, 2 * dim, dtype=features)
            key, value = query, _heads(module, call, dim + 1, dtype=features)
        paths.update(_causal_zformer_paths(module, call, query, key, value))
    return paths


def _attention_name(function) -> str:
    """The name transformers' `ALL_ATTENTION_FUNCTIONS` gives an attention function ('eager': the
    einsum reference)."""
    if function is einsum_attention_forward:
        return "eager"
    return next((name for name in ALL_ATTENTION_FUNCTIONS.keys() if ALL_ATTENTION_FUNCTIONS[name] is function),
                getattr(function, "__name__", "custom"))
