"""Building blocks of the attention family: head reshapes, masks, fp32 sums under autocast, the
residual add, and the projections' stacked and folded forms.

This file ships to the Hugging Face Hub with every checkpoint: torch and stdlib only, plain
`nn.Linear` and `nn.Dropout` layers (machine-specific layer forms are the installed package's
opt-in `hf_zformer.cpu_speedups`).
"""

import contextlib

import torch
from torch import nn

from .policy import active

def at_least_fp32(*tensors):
    """The tensors in at least fp32 (fp64 stays fp64), for sums over the sequence. fp32/fp64
    tensors come back as they are, without a dispatched no-op conversion (decoding steps make many
    such calls: see docs/benchmarks.md, "Short inputs")."""
    return [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in tensors]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x as autocast's products take it: an fp32 tensor under autocast cast once to autocast's dtype
    (each product would cast it again, a pass over x each time), anything else as it is."""
    device_type = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(device_type):
        return x
    return x.to(torch.get_autocast_dtype(device_type))


def no_autocast(device_type: str):
    """A context that disables autocast for fp32 sums; nothing to enter when autocast is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H * d) -> (B, H, N, d)"""
    batch, length, width = x.shape
    return x.view(batch, length, num_heads, width // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, N, H * d)"""
    batch, heads, length, dim = x.shape
    return x.transpose(1, 2).reshape(batch, length, heads * dim)


def per_head_product(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, d) @ matrix (B, H, d, e) -> (B, H, N, e) as one `torch.bmm` over (B * H)-batched
    views. x is copied only where its layout needs it (N > 1 split heads); a decoding step's single
    token is a view. A 4-D `matmul` makes the same product with broadcasting views around it, an
    extra ~5 dispatched operators that every decoding step pays per layer."""
    batch, heads, length, dim = x.shape
    product = torch.bmm(x.reshape(batch * heads, length, dim), matrix.reshape(batch * heads, dim, -1))
    return product.view(batch, heads, length, -1)


def zero_padding(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero `x` (B, N, ...) at padded positions so sums over the sequence ignore them."""
    if attention_mask is None:
        return x
    return x * attention_mask.to(x.dtype).view(*attention_mask.shape, *([1] * (x.dim() - 2)))


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, dim: int = -1, dtype=None,
                   may_be_empty: bool = True) -> torch.Tensor:
    """softmax of `scores` along `dim` over the positions where the boolean `mask` (broadcastable to
    `scores`; the result takes the broadcast shape) is True. Where it is True nowhere (an
    all-padding row) the weights are all zero, so the pooled or attended context is zero, and finite
    gradients flow: masked scores are set to the lowest finite value, not -inf (a softmax over only
    -inf is NaN), and zeroed after the softmax. Elsewhere the result is exactly that of -inf masking
    (exp underflows to 0 at masked positions). `may_be_empty=False` (the caller knows every row has
    a True position) skips that zeroing pass."""
    if mask is None:
        return torch.softmax(scores, dim=dim, dtype=dtype)
    blocked = ~mask
    weights = torch.softmax(scores.masked_fill(blocked, torch.finfo(scores.dtype).min), dim=dim, dtype=dtype)
    return weights.masked_fill(blocked, 0.0) if may_be_empty else weights


def drop_full_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """None when `attention_mask` has no padding (saves masking passes over the sequence). Reading the
    answer waits for the device (a host synchronisation), so models call it once per forward, where a
    mask enters the stack, never per layer. During CUDA-graph capture the read fails the capture, as
    any host synchronisation does: a graph replays whatever its buffer holds later."""
    if attention_mask is None or torch.compiler.is_compiling():
        return attention_mask
    return attention_mask if _read_mask(attention_mask) else None


def _read_mask(attention_mask: torch.Tensor) -> bool:
    """Whether `attention_mask` has padding, in one read back to the host, which also refuses a mask
    that is not 0/1 (a fractional or additive mask would weigh tokens, or be taken as real tokens)."""
    if attention_mask.dtype == torch.bool:
        return not bool(attention_mask.all())
    not_binary = ((attention_mask != 0) & (attention_mask != 1)).any()
    state = int(not_binary * 2 + (attention_mask == 0).any())  # 1: padding, 2/3: a value other than 0 and 1
    if state >= 2:
        value = attention_mask[(attention_mask != 0) & (attention_mask != 1)][0].item()
        raise ValueError(
            f"attention_mask must hold only 1 (a real token) and 0 (padding), but it holds {value} "
            f"({attention_mask.dtype}): a fractional or additive mask is not supported"
        )
    return bool(state)


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                 attention_mask: torch.Tensor | None = None, *, past_length: int = 0, cached_batch: int | None = None,
                 prefix: str = "") -> None:
    """ValueError naming the shapes when the inputs of a forward do not fit together: `input_ids`
    (B, N) or `inputs_embeds` (B, N, D) with N >= 1, an `attention_mask` (B, N), or (B, past + N)
    after `past_length` cached tokens, and a cache filled by a batch of `cached_batch` rows (None:
    empty) that must be B. Shapes only: nothing is read back from the device. `prefix` names the
    decoder's inputs of an encoder-decoder (`decoder_`)."""
    if input_ids is None and inputs_embeds is None:
        return  # the forward names what is missing
    name, tensor, dims = ((f"{prefix}input_ids", input_ids, 2) if input_ids is not None
                          else (f"{prefix}inputs_embeds", inputs_embeds, 3))
    shape = tuple(tensor.shape)
    if tensor.dim() != dims:
        expected = "(batch, tokens)" if dims == 2 else "(batch, tokens, hidden_size)"
        raise ValueError(f"{name} has shape {shape}; expected {expected} (one sequence is a batch of one: "
                         f"{name}[None])")
    batch, length = shape[:2]
    if length == 0:
        raise ValueError(f"{name} has shape {shape}: an empty sequence; give at least one token")
    if cached_batch is not None and cached_batch != batch:
        raise ValueError(f"the cache holds a batch of {cached_batch} sequences, but {name} has shape {shape} (a batch "
                         f"of {batch}): a cache continues the batch that filled it; start a new one for another batch")
    if attention_mask is not None:
        columns = [length] + ([past_length + length] if past_length else [])
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in columns:
            cached = f" after {past_length} cached tokens" if past_length else ""
            raise ValueError(
                f"{prefix}attention_mask has shape {tuple(attention_mask.shape)}, but {name} has shape {shape}"
                f"{cached}: expected {' or '.join(f'({batch}, {c})' for c in columns)}, 1 at real tokens and 0 at "
                "padding"
            )


def add_into_fresh(fresh: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`fresh + other`, written into `fresh` when it can hold the result: `fresh` must be a tensor
    that nothing else uses (a just-computed branch output, which autograd does not save). Saves
    allocating a (B, N, D) buffer, whose first touch is a pass of page faults on long inputs. Under
    autocast a bf16/fp16 branch meets an fp32 residual stream: then the sum is a new fp32 tensor, as
    `+` would give, so the stream never drops to low precision. Under autograd the sum is out of
    place too: `fresh` is usually a view (a Linear's 3-D output), and an in-place add on a view
    makes autograd zero-fill and copy a (B, N, D) gradient buffer in the backward (`CopySlices`),
    which costs more than the buffer it saved (docs/benchmarks.md, "Short inputs")."""
    if torch.is_grad_enabled() and (fresh.requires_grad or other.requires_grad):
        return fresh + other
    if fresh.shape == other.shape and (
        fresh.dtype == other.dtype or torch.promote_types(fresh.dtype, other.dtype) == fresh.dtype
    ):
        return fresh.add_(other)
    return fresh + other




def plain_linears(*layers: nn.Module) -> bool:
    """Whether every layer is an `nn.Linear` used as it is, so that its product may run outside its
    own forward (stacked with others, `project`; folded into another form): of the class `nn.Linear`
    itself, or of a subclass that declares the same product (`linear_product = True`, as the layers
    of `hf_zformer.cpu_speedups` do; adapters, sharding and quantisation replace the class with one
    that does not), without a forward of its own (accelerate's offloading replaces the instance's
    `forward`), and with plain tensors as weight and bias (quantisation in place swaps the weight for
    a tensor subclass; DeepSpeed ZeRO-3 marks its partitioned weights with `ds_id`). Forward hooks
    registered on such a layer do not run where its product is taken outside its forward."""
    for layer in layers:
        linear = type(layer) is nn.Linear or getattr(type(layer), "linear_product", False)
        if not linear or "forward" in vars(layer):
            return False
        for tensor in (layer.weight, layer.bias):
            if tensor is not None and (type(tensor) not in (nn.Parameter, torch.Tensor) or hasattr(tensor, "ds_id")):
                return False
    return True


def stacks_projections(x: torch.Tensor, *layers: nn.Module) -> bool:
    """Whether `project` runs `layers` on x as one product against their stacked weights (see there)."""
    return (
        len(layers) >= 2
        and active().stacks(x.device.type)
        and x.numel() // max(1, x.shape[-1]) >= x.shape[-1]
        and plain_linears(*layers)
        and len({layer.bias is None for layer in layers}) == 1
    )


def project(x: torch.Tensor, *layers: nn.Module, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x (..., D) through each of `layers` (D -> D_i), one output per layer.

    On CUDA (the policy's `stacked_projection`, policy.py), where every layer is a plain `nn.Linear` (`plain_linears`)
    and the input has at least as many rows as a layer has inputs, one product against the stacked
    weights (sum D_i, D) gives all the outputs, as column slices of one (..., sum D_i) tensor. Under
    autocast the fp32 input is then cast to the low precision once instead of once per projection
    (on a GPU each cast is a pass over the input, a sixth of the SDPA module's time:
    docs/benchmarks.md, "On a GPU"), one wide product runs nearer the matmul rate than several
    narrow ones, and the input's gradient comes from one product accumulated in fp32. Fewer rows
    (decoding steps) keep a product per layer: stacking copies the weights, more than such a product
    reads. So do CPUs (the casts it saves are a GPU cost, and a CPU's BLAS gains nothing from the
    wider product: docs/benchmarks.md), and the backend `torch` (`set_kernel_backend`), to
    compare. `bias` (sum D_i,): the stacked product's bias in place of the layers' own, for a caller
    that adds a term of its own to one output for free (`stacks_projections` must hold)."""
    if not stacks_projections(x, *layers):
        if bias is not None:
            raise ValueError("project(bias=...) needs the stacked product: check stacks_projections(x, *layers)")
        return tuple(layer(x) for layer in layers)
    weight = torch.cat([layer.weight for layer in layers])
    if bias is None and layers[0].bias is not None:
        bias = torch.cat([layer.bias for layer in layers])
    return nn.functional.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1)


def new_tokens_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The columns of `attention_mask` (B, past + N) that belong to the N new tokens."""
    return None if attention_mask is None else attention_mask[:, attention_mask.shape[1] - length :]
