"""Zformer-family models: embeddings, pre- or post-LayerNorm Transformer layers with a choice of
attention per layer, the encoder, and task heads, following transformers 5 conventions.

This file ships to the Hugging Face Hub with every checkpoint (with `attention.py` and
`configuration_zformer.py`): torch, transformers and siblings only.
"""

import copy
import dataclasses
import math

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
)

from .attention import ATTENTION_CLASSES, Attention, HedgehogFeatureMap
from .blocks import (
    add_into_fresh,
    at_least_fp32,
    check_inputs,
    drop_full_mask,
    masked_softmax,
    plain_linears,
    zero_padding,
)
from .cache_zformer import ZformerCache, record_forward
from .configuration_zformer import CAUSAL_ATTENTION_TYPES, FastformerConfig, ZformerConfig
from .policy import kernel_backend


def sinusoidal_table(length: int, width: int) -> torch.Tensor:
    """Fixed sinusoidal positions (length, width): sin on even, cos on odd channels."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : width // 2]
    return table


def position_ids_from_mask(attention_mask: torch.Tensor, past_length: int = 0, offset: int = 0) -> torch.Tensor:
    """Positions (B, N) of the tokens under `attention_mask` (B, N), 1 at real tokens: a real token's
    position is `offset` + `past_length` + the number of real tokens before it in its row; padding
    gets position 0 (its embedding never reaches a real token). Left, right or no padding thus give
    every real token the same position.

    `past_length` counts the tokens a decoding cache already holds (all real). A causal model whose
    cache holds left padding instead passes the mask of past and new tokens together and keeps the
    last N columns. `offset` shifts the positions of real tokens (RoBERTa-style tables start at
    padding_idx + 1).
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - mask + (past_length + offset)) * mask


class ZformerEmbeddings(nn.Module):
    """Token embeddings (scaled by sqrt(D) when `scale_embedding`) merged with absolute positions,
    sinusoidal or learned, by addition or by concatenation followed by a projection back to D; plus
    token type embeddings (`type_vocab_size` > 0) and a LayerNorm (`embedding_layer_norm`), as BERT.
    Positions are given per token (`position_ids`, see `position_ids_from_mask`)."""

    def __init__(self, config):
        super().__init__()
        width = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.embed_scale = math.sqrt(width) if config.scale_embedding else 1.0
        self.max_length = config.max_position_embeddings
        self.offset = config.position_offset
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        else:
            self.register_buffer("sinusoidal", sinusoidal_table(self.max_length, width), persistent=False)
        self.merge = nn.Linear(2 * width, width) if config.position_embedding_merge == "concat" else None
        self.type_vocab_size = config.type_vocab_size
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width) if config.type_vocab_size else None
        self.layer_norm = nn.LayerNorm(width, eps=config.layer_norm_eps) if config.embedding_layer_norm else None
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def positions(self, position_ids: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
        """Position vectors (B, N, D) of `position_ids` (B, N) (or (1, N), shared by the batch).
        `max_position`: a bound on the ids the caller knows (the models derive the ids from the
        mask); within the table it spares the range check its host synchronisation."""
        checked = max_position is not None and max_position < self.max_length
        if not checked and not torch.compiler.is_compiling():  # a clear error instead of an index error (a device assert on GPU)
            low, high = (int(v) for v in torch.aminmax(position_ids))
            if high >= self.max_length:
                raise ValueError(
                    f"position {high} (a sequence of {high + 1 - self.offset} tokens from position_offset="
                    f"{self.offset}) is beyond max_position_embeddings={self.max_length}"
                )
            if low < 0:
                raise ValueError(f"position_ids must be non-negative; got {low}")
        if hasattr(self, "position_embeddings"):
            return self.position_embeddings(position_ids)
        return nn.functional.embedding(position_ids, self.sinusoidal)

    def token_types(self, token_type_ids: torch.Tensor | None, reference: torch.Tensor) -> torch.Tensor | None:
        """Token type vectors (B, N, D), type 0 where `token_type_ids` is None; None without token
        type embeddings, where only all-zero `token_type_ids` are accepted (BERT tokenizers send them
        for one segment; any other id would be silently ignored)."""
        if self.token_type_embeddings is None:
            if token_type_ids is not None and bool(token_type_ids.any()):
                raise ValueError(
                    "token_type_ids has non-zero ids, but this model has no token type embeddings "
                    "(type_vocab_size=0); pass all zeros or no token_type_ids"
                )
            return None
        if token_type_ids is None:
            return self.token_type_embeddings.weight[0].expand_as(reference)
        if token_type_ids.shape != reference.shape[:2]:
            raise ValueError(
                f"token_type_ids has shape {tuple(token_type_ids.shape)}; expected {tuple(reference.shape[:2])}"
            )
        if not torch.compiler.is_compiling():
            low, high = (int(v) for v in torch.aminmax(token_type_ids))
            if low < 0 or high >= self.type_vocab_size:
                raise ValueError(
                    f"token_type_ids holds {low if low < 0 else high}, outside [0, type_vocab_size="
                    f"{self.type_vocab_size})"
                )
        return self.token_type_embeddings(token_type_ids)

    def forward(self, position_ids: torch.Tensor, input_ids=None, inputs_embeds=None, token_type_ids=None,
                max_position: int | None = None):
        """position_ids (B, N) or (1, N); input_ids (B, N) or inputs_embeds (B, N, D); token_type_ids
        (B, N) or None; `max_position` (see `positions`). Returns the embeddings (B, N, D)."""
        if inputs_embeds is None:
            # A fresh tensor, scaled and shifted in place: every (B, N, D) buffer not allocated saves
            # a pass of page faults on long inputs.
            tokens = self.word_embeddings(input_ids)
            if self.embed_scale != 1.0:
                tokens.mul_(self.embed_scale)
        else:
            tokens = inputs_embeds * self.embed_scale  # (B, N, D); the caller's tensor is left alone
        if position_ids.dim() != 2 or position_ids.shape[1] != tokens.shape[1] or position_ids.shape[0] not in (
            1, tokens.shape[0]
        ):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected (batch, length) = "
                f"{tuple(tokens.shape[:2])}"
            )
        types = self.token_types(token_type_ids, tokens)  # checked before `tokens` changes in place
        positions = self.positions(position_ids, max_position).to(tokens.dtype)  # (B or 1, N, D)
        if self.merge is None:
            hidden = tokens.add_(positions)
        else:
            hidden = self.merge(torch.cat([tokens, positions.expand_as(tokens)], dim=-1))
        if types is not None:
            hidden = hidden.add_(types.to(hidden.dtype))
        if self.layer_norm is not None:
            hidden = self.layer_norm(hidden)
        return self.dropout(hidden)


class _TiedLookups(torch.autograd.Function):
    """Token lookups of an embedding matrix that an output projection shares, with one gradient
    buffer. forward(weight, padding_idx, *ids) -> (weight[ids] for each ids tensor..., an alias of
    `weight` for the projection). The backward adds each lookup's row gradients (none at
    `padding_idx`, as `nn.Embedding`) into the projection's weight gradient, a (vocab, D) tensor that
    the projection's backward has just made. Plain autograd instead zero-fills one more (vocab, D)
    buffer per lookup and adds them all: two such passes per lookup, for a few hundred rows."""

    @staticmethod
    def forward(ctx, weight, padding_idx, *ids):
        ctx.save_for_backward(*ids)
        ctx.padding_idx = padding_idx
        return (*(nn.functional.embedding(token_ids, weight) for token_ids in ids), weight.view_as(weight))

    @staticmethod
    def backward(ctx, *grads):
        *lookup_grads, weight_grad = grads  # materialized: zeros for an output the loss did not use
        # The alias feeds only the head's product, whose backward hands us a tensor of its own making
        # (autograd keeps no other reference): ours to add into, unless the backward is itself
        # differentiated (create_graph=True), which needs an out-of-place graph.
        in_place = not torch.is_grad_enabled() and weight_grad.is_contiguous()
        for token_ids, grad in zip(ctx.saved_tensors, lookup_grads):
            token_ids, grad = token_ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
            if ctx.padding_idx is not None:
                grad = grad.masked_fill((token_ids == ctx.padding_idx)[:, None], 0.0)
            if in_place:  # deterministic on CPU and CUDA, unlike index_add_
                weight_grad.index_put_((token_ids,), grad.to(weight_grad.dtype), accumulate=True)
            else:  # double backward (create_graph=True), or a gradient that is not ours to change
                weight_grad = weight_grad.index_put((token_ids,), grad.to(weight_grad.dtype), accumulate=True)
        return (weight_grad, None, *([None] * len(ctx.saved_tensors)))


def tied_lookups(head: nn.Module, *lookups):
    """Training-time token embeddings of weights shared with an output projection: `lookups` are
    (embedding module, token ids (B, N)) pairs. Where every module's weight is `head`'s (tied
    embeddings), it is a plain `Parameter` being trained, and the head a bias-free `nn.Linear` used as
    it is (`blocks.plain_linears`), returns (the unscaled token embeddings (B, N, D) of each pair...,
    the weight that `head_logits` applies in place of the head's) from one `_TiedLookups` call. The gradient is plain autograd's, less one zero-filled (vocab, D)
    buffer and its addition per lookup. Otherwise (no gradient, untied weights, ids missing,
    sharded weights such as DeepSpeed ZeRO-3's, which are gathered per module; the backend `torch`,
    `policy.set_kernel_backend`) returns None: the modules look up their tokens as usual."""
    weight = getattr(head, "weight", None)
    if not (
        kernel_backend() != "torch"
        and torch.is_grad_enabled()
        and plain_linears(head)
        and head.bias is None
        and type(weight) is nn.Parameter
        and weight.requires_grad
        and not hasattr(weight, "ds_id")
        and all(
            token_ids is not None and module.weight is weight and module.max_norm is None and not module.sparse
            and module.padding_idx == lookups[0][0].padding_idx
            for module, token_ids in lookups
        )
    ):
        return None
    return _TiedLookups.apply(weight, lookups[0][0].padding_idx, *(token_ids for _, token_ids in lookups))


def head_logits(head: nn.Module, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """`head(hidden)`, or with `weight`, the tied weight as `tied_lookups` returns it, in place of the head's."""
    return head(hidden) if weight is None else nn.functional.linear(hidden, weight)


class ZformerFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = ACT2FN[config.hidden_act]
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        activation_dropout = config.activation_dropout
        self.activation_dropout = nn.Dropout(
            config.hidden_dropout_prob if activation_dropout is None else activation_dropout
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states):
        return self.dropout(self.output(self.activation_dropout(self.activation(self.intermediate(hidden_states)))))


def norm_input(norm: nn.LayerNorm, hidden_states: torch.Tensor, post_norm: bool) -> torch.Tensor:
    """A branch's input: LN(x) in a pre-LayerNorm layer, x itself in a post-LayerNorm one."""
    return hidden_states if post_norm else norm(hidden_states)


def residual(branch: torch.Tensor, hidden_states: torch.Tensor, norm: nn.LayerNorm, post_norm: bool) -> torch.Tensor:
    """x + branch (written into the fresh branch output, `add_into_fresh`), then LN in a
    post-LayerNorm layer (BERT: LN(x + branch))."""
    hidden_states = add_into_fresh(branch, hidden_states)
    return norm(hidden_states) if post_norm else hidden_states


class ZformerShortConv(nn.Module):
    """Centred depthwise convolution over the sequence (`encoder_conv_size` taps, odd): output i is
    sum_k weight[k] * x_{i+k-c}, c = size // 2, per channel, with x = 0 beyond both ends and at
    padding, so a row's real tokens get the same outputs whatever its padding (left or right).
    Fastformer mixes tokens only through pooled vectors, the same for every token; this gives each
    token its neighbours exactly. Initialised as the identity (weight[c] = 1): a new model starts
    as the same model without it."""

    def __init__(self, config):
        super().__init__()
        self.size = config.encoder_conv_size
        self.weight = nn.Parameter(torch.empty(self.size, config.hidden_size))  # weight[k]: tap of x_{i+k-c}

    def forward(self, hidden_states, attention_mask=None):
        """hidden_states (B, N, D); attention_mask (B, N), 1 at real tokens, or None."""
        hidden_states = zero_padding(hidden_states, attention_mask)
        length, half = hidden_states.shape[1], self.size // 2
        window = nn.functional.pad(hidden_states, (0, 0, half, half))  # (B, N + size - 1, D)
        weight = self.weight.to(hidden_states.dtype)
        output = hidden_states * weight[half]
        for k in range(self.size):
            if k != half:
                output = torch.addcmul(output, window[:, k : k + length], weight[k])
        return output


class ZformerCausalConv(nn.Module):
    """Causal depthwise convolution over the sequence (`decoder_conv_size` taps): output i is
    sum_k weight[k] * x_{i-k}, per channel, with x = 0 before the first token and at padding, so a
    row's real tokens get the same outputs whatever its (left) padding. Linear attention sees its
    prefix only through a fixed-size sum or pooling; this gives it the last few tokens exactly, as
    the short convolutions of H3, Mamba or GLA do. Initialised as the identity (weight[0] = 1): a new
    model starts as the same model without it. With a cache, the last `size - 1` inputs carry over
    to the next call (`ZformerCache.conv_state`)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.size = config.decoder_conv_size
        self.layer_idx = layer_idx
        self.weight = nn.Parameter(torch.empty(self.size, config.hidden_size))  # weight[k]: tap of x_{i-k}

    def forward(self, hidden_states, attention_mask=None, cache=None):
        """hidden_states (B, N, D); attention_mask (B, past + N), 1 at real tokens, or None."""
        length = hidden_states.shape[1]
        if attention_mask is not None:
            hidden_states = zero_padding(hidden_states, attention_mask[:, -length:])
        past = None if cache is None else cache.conv_state(self.layer_idx)
        if past is None:
            past = hidden_states.new_zeros(hidden_states.shape[0], self.size - 1, hidden_states.shape[2])
        window = torch.cat([past.to(hidden_states.dtype), hidden_states], dim=1)  # (B, size - 1 + N, D)
        if cache is not None:
            cache.update_conv(window[:, length:], self.layer_idx)  # the last size - 1 inputs
        weight = self.weight.to(hidden_states.dtype)
        output = hidden_states * weight[0]
        for k in range(1, self.size):
            output = torch.addcmul(output, window[:, self.size - 1 - k : self.size - 1 - k + length], weight[k])
        return output


class ZformerLayer(GradientCheckpointingLayer):
    """Pre-LayerNorm encoder layer: x + W_o Attn(LN(x)), then x + FFN(LN(x)); or, with
    `layer_norm_position="post"` (BERT), LN(x + W_o Attn(x)), then LN(x + FFN(x)).

    The attention applies its own output projection W_o (`attention.output`; the folded bidirectional
    forms merge it into their per-sequence map), and each residual is added in place to its branch's
    fresh output (`add_into_fresh`; out of place when autocast made the branch bf16/fp16, so the
    residual stream stays fp32), so a layer allocates no (B, N, D) buffer for the sums: on long
    inputs such a buffer costs as much as a LayerNorm, mostly in page faults. The same holds for
    the decoder. With `encoder_conv_size` > 0 the attention's input first goes through a
    `ZformerShortConv`."""

    def __init__(self, config, attention_type: str, layer_idx: int):
        super().__init__()
        self.attention_type = attention_type
        self.post_norm = config.layer_norm_position == "post"
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.short_conv = ZformerShortConv(config) if config.encoder_conv_size else None
        self.attention = ATTENTION_CLASSES[attention_type](config, layer_idx=layer_idx)
        self.feed_forward_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = ZformerFeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
    ):
        """position_ids (B, N): xformer indexes its sequence projection by position. Returns the new
        hidden states, and with `output_attentions` (full attention only) also the attention weights
        (B, H, N, N)."""
        post = self.post_norm
        attention_input = norm_input(self.attention_norm, hidden_states, post)
        if self.short_conv is not None:
            attention_input = self.short_conv(attention_input, attention_mask)
        branch, weights = self.attention(
            attention_input, attention_mask, position_ids=position_ids, output_attentions=output_attentions
        )
        hidden_states = residual(self.dropout(branch), hidden_states, self.attention_norm, post)
        branch = self.feed_forward(norm_input(self.feed_forward_norm, hidden_states, post))
        hidden_states = residual(branch, hidden_states, self.feed_forward_norm, post)
        return (hidden_states, weights) if output_attentions else hidden_states


class ZformerPreTrainedModel(PreTrainedModel):
    config: ZformerConfig
    base_model_prefix = "zformer"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_attention_backend = True
    # The layers device maps keep whole and FSDP wraps one by one (accelerate's default wrap classes): each
    # model names only the layer classes it has, since accelerate refuses a class the model lacks.
    _no_split_modules = ["ZformerLayer"]
    # The heads with a loss take Trainer's `num_items_in_batch` (`mean_loss`); forwards have no **kwargs.
    accepts_loss_kwargs = True

    # The kind of model a class builds, which its config must say (`is_encoder_decoder`); None: either.
    _is_encoder_decoder: bool | None = None

    def __init__(self, config, *inputs, **kwargs):
        # The config validates itself at construction; fields set afterwards are checked here, with the
        # same errors naming field and value (instead of a failure deep inside a layer).
        config._validate()
        # What the model settles in its config (its kind; the attention dropout default, now that the
        # layers to build are known; the `auto_map` through which saved checkpoints load with
        # trust_remote_code=True, every Auto class we support) goes into a copy where it changes
        # anything: the caller's config stays as it was, for the next model built from it. The
        # classes build their parts from `self.config`.
        is_encoder_decoder = config.is_encoder_decoder if self._is_encoder_decoder is None else self._is_encoder_decoder
        auto_map = auto_map_for(config.model_type)
        if (config.is_encoder_decoder != is_encoder_decoder or config.attention_probs_dropout_prob is None
                or getattr(config, "auto_map", None) != auto_map):
            config = copy.deepcopy(config)
            config.is_encoder_decoder = is_encoder_decoder
            config.resolve_attention_dropout()
            config.auto_map = auto_map
        super().__init__(config, *inputs, **kwargs)

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """transformers' loading, with the reshape of a 0-d `log_scale` (checkpoints saved before 0.2.0,
        `ScalarToVector`) where the model has one."""
        if any(name.endswith("log_scale") for name, _ in model.named_parameters()):
            scalar_log_scale = WeightConverter("log_scale", "log_scale", operations=[ScalarToVector()])
            load_config = dataclasses.replace(
                load_config, weight_mapping=[*(load_config.weight_mapping or []), scalar_log_scale]
            )
        return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args,
                                                      **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Attention):  # each type's own parameters
            module.init_parameters(std)
        elif isinstance(module, HedgehogFeatureMap):  # the identity map: W = I, b = 0
            init.copy_(module.weight, torch.eye(module.weight.shape[-1]).expand_as(module.weight))
            init.zeros_(module.bias)
        elif isinstance(module, ZformerEmbeddings) and hasattr(module, "sinusoidal"):
            init.copy_(module.sinusoidal, sinusoidal_table(*module.sinusoidal.shape))
        elif isinstance(module, ZformerLMHead):
            init.zeros_(module.bias)
        elif isinstance(module, ZformerShortConv):  # the identity: only the centre tap
            taps = torch.zeros_like(module.weight)
            taps[module.size // 2] = 1.0
            init.copy_(module.weight, taps)
        elif isinstance(module, ZformerCausalConv):  # the identity: only the current token's tap
            taps = torch.zeros_like(module.weight)
            taps[0] = 1.0
            init.copy_(module.weight, taps)


def _hidden_mask(attention_mask, input_ids, inputs_embeds):
    """(B, N) 0/1 padding mask; all ones when none is given."""
    if attention_mask is not None:
        return attention_mask
    reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
    return torch.ones(reference.shape[:2], dtype=torch.long, device=reference.device)


def _refuse_head_masks(**masks):
    for name, mask in masks.items():
        if mask is not None:
            raise ValueError(f"{name} is not supported: Zformer-family attention has no per-head weights to mask")


def _check_right_padded(name, mask):
    """A causal decoder is exact with right padding only (real tokens never see later padding)."""
    if mask is not None and bool((mask[:, 1:].long() > mask[:, :-1].long()).any()):
        raise ValueError(
            f"{name} must be right-padded (each row ones, then zeros): the causal decoder does not mask "
            f"padding, it relies on padding coming after every real token"
        )


def mean_loss(criterion, num_items_in_batch, *inputs, **options) -> torch.Tensor:
    """`criterion(**options)(*inputs)`, the mean over this batch; when Trainer passes
    `num_items_in_batch` (the label count of all gradient-accumulation micro-batches), the sum
    divided by it instead, so accumulated gradients equal those of one large batch."""
    if num_items_in_batch is None:
        return criterion(**options)(*inputs)
    return criterion(reduction="sum", **options)(*inputs) / num_items_in_batch


def final_norm(config) -> nn.LayerNorm | None:
    """The LayerNorm after the last layer of a pre-LayerNorm stack (post-LayerNorm layers end normalised)."""
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.layer_norm_position == "pre" else None


class ZformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        if any(config.layer_windows()):
            raise ValueError(f"attention_window={config.attention_window!r}: a softmax window is a causal language "
                             "model's option (ZformerForCausalLM); an encoder has none")
        self.layers = nn.ModuleList(
            ZformerLayer(config, attention_type, i) for i, attention_type in enumerate(config.layer_attention_types())
        )
        self.final_norm = final_norm(config)

    def forward(
        self, hidden_states, attention_mask, position_ids, output_hidden_states=False, output_attentions=False
    ):
        """Returns (hidden states, all hidden states or None, all attention weights or None)."""
        if output_attentions:
            for i, layer in enumerate(self.layers):
                if layer.attention_type != "full":
                    raise ValueError(
                        f"output_attentions=True: layer {i} has attention_type={layer.attention_type!r}, which "
                        f"forms no attention matrix; only 'full' layers return attention weights"
                    )
        all_hidden = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_attentions:
                hidden_states, weights = layer(hidden_states, attention_mask, position_ids, output_attentions=True)
                all_attentions += (weights,)
            else:
                hidden_states = layer(hidden_states, attention_mask, position_ids)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
            if output_hidden_states:
                all_hidden = all_hidden[:-1] + (hidden_states,)
        return hidden_states, all_hidden, all_attentions


class ZformerModel(ZformerPreTrainedModel):
    """The bare encoder: embeddings, layers of the configured attention types, final LayerNorm
    (pre-LayerNorm layers only)."""

    def __init__(self, config):
        super().__init__(config)
        config = self.config
        self.embeddings = ZformerEmbeddings(config)
        self.encoder = ZformerEncoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def _layer_positions(self, position_ids, attention_mask, offset: int):
        """The positions the layers get: only xformer layers read them (to pick columns of their
        sequence projection), and they take their cheaper shared slice when `position_ids` is None.
        So None when no layer is xformer, or when every real token sits at the column of its index
        (no left padding): settled here once per forward instead of once per xformer layer (a host
        synchronisation each)."""
        if "xformer" not in self.config.layer_attention_types():
            return None
        if torch.compiler.is_compiling():
            return position_ids
        columns = torch.arange(offset, offset + position_ids.shape[1], device=position_ids.device)
        at_column = position_ids == columns
        if attention_mask is not None:
            at_column |= ~attention_mask.bool()  # padding's column does not matter (its inputs are zeroed)
        return None if bool(at_column.all()) else position_ids

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        head_mask: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ):
        """input_ids (B, N) or inputs_embeds (B, N, D); attention_mask (B, N), 1 at real tokens (padding
        on either side); position_ids (B, N), by default the number of real tokens before each token
        (`position_ids_from_mask`, from `position_offset`). `token_type_ids` (B, N): segment ids below
        `type_vocab_size` (type 0 when None); with `type_vocab_size=0` they must be all zeros.
        `head_mask` is refused. `output_attentions=True` returns the softmax weights (B, H, N, N) of
        every layer, and raises when a layer is not `full`. Returns
        `BaseModelOutput(last_hidden_state (B, N, D), hidden_states, attentions)`."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        check_inputs(input_ids, inputs_embeds, attention_mask)
        _refuse_head_masks(head_mask=head_mask)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        offset = self.config.position_offset
        # Masks and positions are settled once per forward, not per layer: without padding the layers
        # get no mask (no masking passes; SDPA's unmasked kernel) and the default positions.
        attention_mask = drop_full_mask(attention_mask)
        layer_positions, max_position = position_ids, None
        if position_ids is None:
            max_position = offset + length - 1
            if attention_mask is None:
                position_ids = torch.arange(offset, offset + length, device=self.embeddings.word_embeddings.weight.device)[None]
            else:
                position_ids = layer_positions = position_ids_from_mask(attention_mask, offset=offset)
        hidden_states = self.embeddings(
            position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
            max_position=max_position,
        )  # checks given position_ids first
        if layer_positions is not None:
            layer_positions = self._layer_positions(layer_positions, attention_mask, offset)
        hidden_states, all_hidden, attentions = self.encoder(
            hidden_states, attention_mask, layer_positions, output_hidden_states, output_attentions
        )
        output = BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden, attentions=attentions)
        return output if return_dict else output.to_tuple()


class ZformerPooler(nn.Module):
    """Sequence pooling for classification: masked mean (as the FastFormer-pytorch reference code
    pools), the first real token (the first column with right padding), additive attention pooling
    (the official Fastformer: softmax_i(w . tanh(W h_i))), or BERT's pooler: activation(W h_first +
    b), with tanh (BERT's pooler, RoBERTa's classification head) or ReLU (DistilBERT's pre_classifier)."""

    def __init__(self, config):
        super().__init__()
        self.mode = config.classifier_pooling
        if self.mode == "attention":
            self.projection = nn.Linear(config.hidden_size, config.hidden_size)
            self.score = nn.Linear(config.hidden_size, 1, bias=False)
        elif self.mode == "pooler":
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.activation = ACT2FN[config.pooler_activation]

    def forward(self, hidden_states, attention_mask):
        if self.mode in ("first", "pooler"):  # argmax: the first real token, column 0 without left padding
            rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            first = hidden_states[rows, attention_mask.argmax(1)]
            return first if self.mode == "first" else self.activation(self.dense(first))
        mask = attention_mask.to(hidden_states.dtype)[..., None]  # (B, N, 1)
        if self.mode == "mean":
            return (hidden_states * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        (scores,) = at_least_fp32(self.score(torch.tanh(self.projection(hidden_states))))  # (B, N, 1)
        weights = masked_softmax(scores, mask != 0, dim=1).to(hidden_states.dtype)  # all padding: zero weights
        return (weights * hidden_states).sum(1)


def classification_loss(config, logits, labels, num_items_in_batch=None):
    """Regression, single-label or multi-label loss, chosen like transformers' heads (`mean_loss`)."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        if config.num_labels == 1:
            return mean_loss(MSELoss, num_items_in_batch, logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
        return mean_loss(MSELoss, num_items_in_batch, logits, labels.to(logits.dtype))
    if config.problem_type == "single_label_classification":
        return mean_loss(CrossEntropyLoss, num_items_in_batch, logits.view(-1, config.num_labels), labels.reshape(-1))
    return mean_loss(BCEWithLogitsLoss, num_items_in_batch, logits, labels.to(logits.dtype))


class ZformerForSequenceClassification(ZformerPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        config = self.config
        self.num_labels = config.num_labels
        self.zformer = ZformerModel(config)
        self.pooler = ZformerPooler(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        position_ids=None,
        token_type_ids=None,
        head_mask=None,
        labels=None,
        num_items_in_batch=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
    ):
        """The arguments of `ZformerModel.forward`, and labels: (B,) class ids, (B,) / (B, num_labels)
        floats for regression, or (B, num_labels) multi-hot floats for multi-label classification;
        `num_items_in_batch` (from Trainer) normalises the summed loss instead of the batch mean."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        attention_mask = _hidden_mask(attention_mask, input_ids, inputs_embeds)
        outputs = self.zformer(
            input_ids, attention_mask, inputs_embeds, position_ids, token_type_ids, head_mask,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
        )
        pooled = self.pooler(outputs.last_hidden_state, attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = classification_loss(self.config, logits, labels, num_items_in_batch) if labels is not None else None
        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()  # the fields that are set, in order


class ZformerLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> projection onto the vocabulary (tied to the input embeddings)."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states, decoder_weight=None):
        """`decoder_weight`: the tied weight as `tied_lookups` returns it (None: `decoder.weight`)."""
        hidden = self.layer_norm(self.activation(self.dense(hidden_states)))
        logits = head_logits(self.decoder, hidden, decoder_weight)
        return logits + self.bias

    def resize_bias(self, vocab_size: int):
        """Grow (zeros for the new tokens) or cut `bias` to `vocab_size` entries, the rest kept."""
        old = self.bias
        if old.shape[0] == vocab_size:
            return
        new = old.new_zeros(vocab_size)
        kept = min(vocab_size, old.shape[0])
        with torch.no_grad():
            new[:kept] = old[:kept]
        self.bias = nn.Parameter(new, requires_grad=old.requires_grad)


class ZformerForMaskedLM(ZformerPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "zformer.embeddings.word_embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        config = self.config
        self.zformer = ZformerModel(config)
        self.lm_head = ZformerLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers resizes the tied embedding matrix; the output bias (`lm_head.bias`, a separate
        parameter so checkpoint keys stay as they are) follows here."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.lm_head.resize_bias(embeddings.weight.shape[0])
        return embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        position_ids=None,
        token_type_ids=None,
        head_mask=None,
        labels=None,
        num_items_in_batch=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        labelled_logits_only=False,
    ):
        """The arguments of `ZformerModel.forward`, and labels (B, N): token ids to predict, -100 where
        no prediction is scored; `num_items_in_batch` (from Trainer) normalises the summed loss.

        `labelled_logits_only=True` (needs `labels`) projects onto the vocabulary only the positions
        that are scored: `logits` is then (number of labels != -100, vocab_size), in row-major order
        of those positions, and the loss is the same. Pretraining masks ~15% of the tokens, so this
        skips ~85% of the largest product of a small model (`scripts/run_mlm.py` trains this way)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labelled_logits_only and labels is None:
            raise ValueError("labelled_logits_only=True needs labels (the positions to project)")
        check_inputs(input_ids, inputs_embeds, attention_mask)
        tied = None if inputs_embeds is not None else tied_lookups(
            self.lm_head.decoder, (self.zformer.embeddings.word_embeddings, input_ids))
        if tied is not None:
            (inputs_embeds, head_weight), input_ids = tied, None
        outputs = self.zformer(
            input_ids, attention_mask, inputs_embeds, position_ids, token_type_ids, head_mask,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
        )
        hidden = outputs.last_hidden_state
        if labelled_logits_only:
            scored = labels != -100
            hidden, labels = hidden[scored], labels[scored]
        logits = self.lm_head(hidden) if tied is None else self.lm_head(hidden, head_weight)
        loss = None
        if labels is not None:
            (flat,) = at_least_fp32(logits.reshape(-1, logits.shape[-1]))  # bf16 up to fp32; fp64 stays fp64
            loss = mean_loss(CrossEntropyLoss, num_items_in_batch, flat, labels.reshape(-1))
        output = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


# ----------------------------------------------------------------------------------------------
# encoder-decoder
# ----------------------------------------------------------------------------------------------


class ZformerDecoderLayer(GradientCheckpointingLayer):
    """Decoder layer: causal self-attention, cross-attention to the encoder (encoder-decoders only),
    FFN; each a residual branch with pre- or post-LayerNorm (`layer_norm_position`), as in `ZformerLayer`.
    With `decoder_conv_size` > 0 the self-attention's input first goes through a `ZformerCausalConv`."""

    def __init__(self, config, attention_type: str, layer_idx: int, cross_attention: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.post_norm = config.layer_norm_position == "post"
        width, eps = config.hidden_size, config.layer_norm_eps
        self.self_attention_norm = nn.LayerNorm(width, eps=eps)
        self.short_conv = ZformerCausalConv(config, layer_idx) if config.decoder_conv_size else None
        # a zformer layer's softmax window (causal LM) comes from the config, as its cache layer's
        self.self_attention = ATTENTION_CLASSES[attention_type](config, is_causal=True, layer_idx=layer_idx)
        if cross_attention:
            self.cross_attention_norm = nn.LayerNorm(width, eps=eps)
            cross_class = ATTENTION_CLASSES[config.cross_attention_type]
            self.cross_attention = cross_class(config, is_cross=True, layer_idx=layer_idx)
        else:
            self.cross_attention = None
        self.feed_forward_norm = nn.LayerNorm(width, eps=eps)
        self.feed_forward = ZformerFeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None):
        """hidden_states (B, N, D); attention_mask (B, past + N) or None; encoder states (B, S, D) and
        mask (B, S) for cross-attention; past_key_values: the `ZformerCache` when decoding."""
        post = self.post_norm
        attention_input = norm_input(self.self_attention_norm, hidden_states, post)
        if self.short_conv is not None:
            attention_input = self.short_conv(attention_input, attention_mask, past_key_values)
        branch, _ = self.self_attention(attention_input, attention_mask, cache=past_key_values)
        hidden_states = residual(self.dropout(branch), hidden_states, self.self_attention_norm, post)
        if self.cross_attention is not None:
            branch, _ = self.cross_attention(
                norm_input(self.cross_attention_norm, hidden_states, post), memory=encoder_hidden_states,
                memory_mask=encoder_attention_mask, cache=past_key_values,
            )
            hidden_states = residual(self.dropout(branch), hidden_states, self.cross_attention_norm, post)
        branch = self.feed_forward(norm_input(self.feed_forward_norm, hidden_states, post))
        return residual(branch, hidden_states, self.feed_forward_norm, post)


class ZformerDecoder(ZformerPreTrainedModel):
    """Embeddings, causal layers (with cross-attention when `cross_attention`), final LayerNorm:
    the decoder of the encoder-decoder, and the whole stack of a causal language model (whose
    zformer layers may take a softmax window from the config, `attention_window`). A model of its
    own, as transformers' decoders are: the causal language model's base model, and built from a
    config alone, the decoder of the config's kind (`is_encoder_decoder`)."""

    _no_split_modules = ["ZformerDecoderLayer"]

    def __init__(self, config, layer_types: list[str] | None = None, cross_attention: bool | None = None):
        super().__init__(config)
        config = self.config
        cross_attention = config.is_encoder_decoder if cross_attention is None else cross_attention
        layer_types = config.layer_attention_types(decoder=cross_attention) if layer_types is None else layer_types
        self.layer_types = layer_types
        self.cross_attention = cross_attention
        self.embeddings = ZformerEmbeddings(config)
        self.layers = nn.ModuleList(
            ZformerDecoderLayer(config, kind, i, cross_attention) for i, kind in enumerate(layer_types)
        )
        # each layer's softmax window as its attention took it (0: none), for the cache's layers
        self.windows = [getattr(layer.self_attention, "window", 0) for layer in self.layers]
        self.final_norm = final_norm(config)
        self.position_offset = config.position_offset
        self.conv_size = config.decoder_conv_size
        self.post_init()

    def new_cache(self) -> ZformerCache:
        return ZformerCache(self.layer_types, cross_attention=self.cross_attention, windows=self.windows,
                            conv_size=self.conv_size)

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, inputs_embeds=None, position_ids=None, token_type_ids=None,
                output_hidden_states=False):
        """input_ids (B, N) or inputs_embeds (B, N, D); attention_mask (B, N) or (B, past + N), 1 at
        real tokens (the cache's tokens included), or None (no padding). Positions continue from the
        cache: each row's real tokens get consecutive positions whatever its (left) padding
        (`position_ids_from_mask` over the whole mask); `position_ids` (B, N) overrides them.
        Returns (hidden states (B, N, D), all hidden states or None)."""
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
        length = reference.shape[1]
        record_forward(past_key_values, self.forward, length, masks=dict(attention_mask=attention_mask),
                       tokens=dict(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                                   token_type_ids=token_type_ids),
                       fixed=dict(encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, past_key_values=past_key_values))
        if attention_mask is not None and attention_mask.shape[1] == length and past_length:
            # the new tokens' mask only: the cached tokens were all real
            past_mask = attention_mask.new_ones(attention_mask.shape[0], past_length)
            attention_mask = torch.cat([past_mask, attention_mask], 1)
        if attention_mask is not None and attention_mask.shape[1] != past_length + length:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns; expected {length} (the new tokens) or "
                f"{past_length + length} (the {past_length} cached tokens and the new ones)"
            )
        # Masks and positions are settled once per forward (per decoding step), not per layer.
        attention_mask = drop_full_mask(attention_mask)
        encoder_attention_mask = drop_full_mask(encoder_attention_mask)
        max_position = None
        if position_ids is None:
            first = past_length + self.position_offset
            max_position = first + length - 1  # a bound: each row has at most past + N real tokens
            if attention_mask is None:
                position_ids = torch.arange(first, first + length, device=reference.device)[None]
            else:
                position_ids = position_ids_from_mask(attention_mask, offset=self.position_offset)[:, past_length:]
        hidden_states = self.embeddings(position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds,
                                        token_type_ids=token_type_ids, max_position=max_position)
        all_hidden = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                  past_key_values)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
            if output_hidden_states:
                all_hidden = all_hidden[:-1] + (hidden_states,)
        return hidden_states, all_hidden


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs from labels: prepend the start token, drop the last label, -100 -> pad."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


# The name of the decoding state: transformers 5.24 renamed `past_key_values` to `cache` (generate()
# passes it to forward() and reads it from the outputs under the new name; the old name is
# deprecated there). Our forwards accept both names; outputs and generate() use the installed one.
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


def cache_extent(cache) -> dict:
    """`past_length` and `cached_batch` of a decoding cache (None: nothing cached), for `check_inputs`."""
    if cache is None:
        return {}
    batch = cache.batch_size() if hasattr(cache, "batch_size") else None
    return {"past_length": cache.get_seq_length(), "cached_batch": batch}


def decoding_state(past_key_values, cache):
    """The decoding state passed as `past_key_values` (transformers <= 5.23) or `cache` (>= 5.24)."""
    if past_key_values is not None and cache is not None:
        raise ValueError("pass the decoding state once, as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values


def generation_cache(cache, generation_config):
    """`cache`, new for `generate()`, in recording mode when the model drafts for another one: generate()
    then crops the drafted tokens the other model rejects (`ZformerCache.activate_past_recording`)."""
    if getattr(generation_config, "is_assistant", False):
        cache.activate_past_recording(recurrent_states_to_keep=generation_config.num_assistant_tokens)
    return cache


# What transformers' text-generation pipeline asks for when its call names no length; a refusal of
# this many new tokens says so, since the user may not have asked for it.
PIPELINE_NEW_TOKENS = 256


class ZformerGenerationMixin(GenerationMixin):
    """`generate()` for models with a `ZformerDecoder` (`self.decoder`): it decodes with the
    decoder's `ZformerCache`, which knows the kind of every layer (no DynamicCache). The prompt of a
    decoder-only model may be token ids or embeddings (`inputs_embeds`, with or without a cache of
    earlier steps). A request the model cannot finish is refused before the first step: an empty
    prompt, or a length past the decoder's positions (a default length is cut to them instead)."""

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length,
                                  model_input_name, input_ids_length, inputs_tensor):
        generation_config = super()._prepare_generated_length(
            generation_config, has_default_max_length, has_default_min_length, model_input_name, input_ids_length,
            inputs_tensor,
        )
        # The tokens the decoder holds: the prompt and the new tokens. A decoder-only model's prompt may
        # come as embeddings, without (or beside) input_ids, which then hold only the generated tokens:
        # max_length counts from input_ids.
        prompt = input_ids_length
        if model_input_name == "inputs_embeds" and not self.config.is_encoder_decoder:
            prompt = max(prompt, inputs_tensor.shape[1])
        new_tokens = generation_config.max_length - input_ids_length
        if prompt == 0:
            raise ValueError("generate() got an empty prompt (input_ids of length 0, no inputs_embeds): give at least "
                             f"one token, e.g. the BOS token (bos_token_id={self.config.bos_token_id})")
        limit = self.config.max_position_embeddings - self.config.position_offset
        if prompt >= limit:  # no room for a new token, whatever length was asked for
            raise ValueError(
                f"generate() got a prompt of {prompt} tokens, but the model holds {limit} positions "
                f"(max_position_embeddings={self.config.max_position_embeddings}): shorten the prompt to at most "
                f"{limit - 1} tokens to generate any"
            )
        if prompt + new_tokens > limit:
            if has_default_max_length and generation_config.max_new_tokens is None:
                generation_config.max_length = input_ids_length + limit - prompt  # the default, not asked for: cut
            else:
                asked = (f"max_length={generation_config.max_length}" if generation_config.max_new_tokens is None else
                         f"{prompt} prompt tokens + max_new_tokens={generation_config.max_new_tokens}")
                pipeline_default = generation_config.max_new_tokens == PIPELINE_NEW_TOKENS
                raise ValueError(
                    f"generate() would reach {prompt + new_tokens} tokens ({asked}), past the {limit} "
                    f"positions of the model (max_position_embeddings={self.config.max_position_embeddings}): ask for "
                    f"at most {limit - prompt} new tokens"
                    + (f" ({PIPELINE_NEW_TOKENS} new tokens is also what transformers' text-generation pipeline asks "
                       "for when its call names no length: pass max_new_tokens=... to the call)" if pipeline_default
                       else "")
                )
        return generation_config

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        if model_kwargs.get(CACHE_FIELD) is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                    f"Zformer-family decoders decode with their ZformerCache"
                )
            model_kwargs[CACHE_FIELD] = generation_cache(self.decoder.new_cache(), generation_config)
            return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )


class ZformerForConditionalGeneration(ZformerPreTrainedModel, ZformerGenerationMixin):
    """Encoder-decoder for translation/summarisation. The encoder takes any attention type (or a
    per-layer list); decoder self-attention is `full`, `zformer` or `fastformer` in causal form;
    cross-attention is `full` or `zformer`. One embedding matrix is shared by source, target and
    the output projection (joint vocabulary).

    `generate()` supports greedy, beam search and sampling. Zformer/Fastformer decoders keep a
    recurrent state whose size does not depend on the generated length (see `ZformerCache`).
    The source may be padded on either side; decoder inputs must be right-padded (causality then
    hides padding from real tokens; `decoder_attention_mask` is checked for that).
    """

    _tied_weights_keys = {
        "decoder.embeddings.word_embeddings.weight": "encoder.embeddings.word_embeddings.weight",
        "lm_head.weight": "encoder.embeddings.word_embeddings.weight",
    }
    _no_split_modules = ["ZformerLayer", "ZformerDecoderLayer"]
    # The base model is the encoder, a `ZformerModel`: its checkpoint loads into `encoder.*`
    base_model_prefix = "encoder"
    _is_encoder_decoder = True

    def __init__(self, config):
        if config.num_decoder_layers < 1:  # no layer, no cross-attention: the output would ignore the source
            raise ValueError(f"num_decoder_layers={config.num_decoder_layers}: an encoder-decoder needs at least one "
                             "decoder layer, whose cross-attention reads the source")
        super().__init__(config)
        config = self.config
        self.encoder = ZformerModel(config)
        self.decoder = ZformerDecoder(config)  # with cross-attention: the config is an encoder-decoder's
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_encoder(self, modality=None):
        return self.encoder

    def get_input_embeddings(self):
        return self.encoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.encoder.embeddings.word_embeddings = value
        self.decoder.embeddings.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor):
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def _tied_inputs(self, input_ids, decoder_input_ids):
        """(source embeddings or None, target embeddings, the LM head's weight) looked up through
        `tied_lookups` (the source only when `input_ids` is given: the encoder runs), or None where
        it does not apply."""
        lookups = [(self.decoder.embeddings.word_embeddings, decoder_input_ids)]
        if input_ids is not None:
            lookups.insert(0, (self.encoder.embeddings.word_embeddings, input_ids))
        tied = tied_lookups(self.lm_head, *lookups)
        if tied is None:
            return None
        *token_embeddings, head_weight = tied
        return (token_embeddings[0] if input_ids is not None else None), token_embeddings[-1], head_weight

    def _refuse_attention_outputs(self, decoder_attention_mask, output_attentions) -> None:
        _check_right_padded("decoder_attention_mask", decoder_attention_mask)
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if output_attentions:
            raise ValueError(
                "output_attentions=True is not supported by the encoder-decoder; the encoder's weights (full "
                "layers) come from model.get_encoder()(..., output_attentions=True)"
            )

    def _loss(self, logits, labels, num_items_in_batch) -> torch.Tensor:
        (flat,) = at_least_fp32(logits.view(-1, logits.shape[-1]))  # bf16 up to fp32; fp64 stays fp64
        return mean_loss(CrossEntropyLoss, num_items_in_batch, flat, labels.reshape(-1),
                         label_smoothing=self.config.label_smoothing)

    def _encoder_outputs(self, encoder_outputs, input_ids, attention_mask, inputs_embeds, token_type_ids,
                         output_hidden_states) -> BaseModelOutput:
        """The encoder's outputs: given (a tuple becomes a `BaseModelOutput`), or computed."""
        if encoder_outputs is None:
            return self.encoder(
                input_ids, attention_mask, inputs_embeds, token_type_ids=token_type_ids,
                output_hidden_states=output_hidden_states, return_dict=True,
            )
        return encoder_outputs if isinstance(encoder_outputs, BaseModelOutput) else BaseModelOutput(*encoder_outputs)

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, decoder_input_ids, decoder_inputs_embeds,
                      decoder_attention_mask, cache, output_attentions, with_source: bool) -> None:
        """`forward`'s inputs fit together (the source's only when the encoder runs), before any work."""
        if with_source:
            check_inputs(input_ids, inputs_embeds, attention_mask)
        check_inputs(decoder_input_ids, decoder_inputs_embeds, decoder_attention_mask, prefix="decoder_",
                     **cache_extent(cache))
        self._refuse_attention_outputs(decoder_attention_mask, output_attentions)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        past_key_values: ZformerCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch=None,
        token_type_ids: torch.LongTensor | None = None,
        head_mask: torch.Tensor | None = None,
        decoder_head_mask: torch.Tensor | None = None,
        cross_attn_head_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: ZformerCache | None = None,
    ):
        """input_ids/attention_mask (B, S): the source, padded on either side (encoder positions come
        from the mask); decoder_input_ids (B, T), or `labels` (B, T) shifted right;
        `decoder_attention_mask` (B, T, or B, past + T while generating) must be right-padded;
        `past_key_values` (or `cache`, transformers' name since 5.24): the decoding state of earlier
        steps (decoder positions continue from its length). `token_type_ids` go to the encoder (all
        zeros when `type_vocab_size=0`); head masks and `output_attentions=True` are refused.
        Returns `Seq2SeqLMOutput` with logits (B, T, vocab) and the loss when labels are given
        (normalised by `num_items_in_batch` when Trainer passes it)."""
        _refuse_head_masks(
            head_mask=head_mask, decoder_head_mask=decoder_head_mask, cross_attn_head_mask=cross_attn_head_mask
        )
        past_key_values = decoding_state(past_key_values, cache)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        use_cache = (use_cache if use_cache is not None else self.config.use_cache) and labels is None
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        self._check_inputs(input_ids if encoder_outputs is None else None, inputs_embeds, attention_mask,
                           decoder_input_ids, decoder_inputs_embeds, decoder_attention_mask,
                           past_key_values if use_cache else None, output_attentions, encoder_outputs is None)
        head_weight = None
        if inputs_embeds is None and decoder_inputs_embeds is None:
            embedded = self._tied_inputs(input_ids if encoder_outputs is None else None, decoder_input_ids)
            if embedded is not None:  # the same embeddings, with a cheaper gradient
                source_embeds, decoder_inputs_embeds, head_weight = embedded
                decoder_input_ids = None
                if encoder_outputs is None:
                    inputs_embeds, input_ids = source_embeds, None
        encoder_outputs = self._encoder_outputs(encoder_outputs, input_ids, attention_mask, inputs_embeds,
                                                token_type_ids, output_hidden_states)
        encoder_hidden = encoder_outputs.last_hidden_state
        if use_cache and past_key_values is None:
            past_key_values = self.decoder.new_cache()
        hidden_states, decoder_hidden = self.decoder(
            decoder_input_ids, None, encoder_hidden, attention_mask, past_key_values if use_cache else None,
            decoder_inputs_embeds, output_hidden_states=output_hidden_states)
        logits = head_logits(self.lm_head, hidden_states, head_weight)
        output = Seq2SeqLMOutput(
            loss=None if labels is None else self._loss(logits, labels, num_items_in_batch),
            logits=logits,
            decoder_hidden_states=decoder_hidden,
            encoder_last_hidden_state=encoder_hidden,
            encoder_hidden_states=encoder_outputs.hidden_states,
            **{CACHE_FIELD: past_key_values if use_cache else None},
        )
        return output if return_dict else output.to_tuple()


# ----------------------------------------------------------------------------------------------
# decoder-only language model
# ----------------------------------------------------------------------------------------------


def causal_lm_loss(logits, labels, num_items_in_batch=None, shift_labels=None) -> torch.Tensor:
    """Next-token cross-entropy: the logits at position i score labels[i + 1] (labels are the input
    ids, -100 where nothing is scored: transformers' convention); `mean_loss` normalisation.
    `shift_labels` (B, N), when given, are the targets already aligned with the logits (position i
    scores shift_labels[i]) and `labels` are not read: under sequence or context parallelism Trainer
    shifts the whole sequence before sharding it, so each shard's last token is scored against the
    next shard's first."""
    if shift_labels is None:
        logits, shift_labels = logits[:, :-1], labels[:, 1:]
    (flat,) = at_least_fp32(logits.reshape(-1, logits.shape[-1]))  # fp64 stays fp64
    return mean_loss(CrossEntropyLoss, num_items_in_batch, flat, shift_labels.reshape(-1).to(flat.device))


class ZformerForCausalLM(ZformerPreTrainedModel, ZformerGenerationMixin):
    """Decoder-only language model: embeddings, `num_hidden_layers` causal layers of the per-layer
    `attention_type` (`"full"`, `"zformer"` or `"fastformer"`, or a list mixing them), final
    LayerNorm, and an output projection tied to the input embeddings (`tie_word_embeddings`).

    Inputs may be padded on either side (`attention_mask`, 1 at real tokens): padding never reaches
    a real token, and each row's real tokens get positions 0, 1, ... (`position_ids_from_mask`), so
    a left-padded batch gives every row the outputs it gets alone; `generate()` continues each
    row's positions from its own length. Decoding state (`ZformerCache`): keys/values growing with
    the text for `full` layers, a fixed-size state for `zformer` / `fastformer` layers. Zformer
    layers with the hedgehog map may add a softmax window over the last tokens (`attention_window`),
    whose keys and values the state then keeps too: still constant in the generated length.
    """

    _tied_weights_keys = {"lm_head.weight": "decoder.embeddings.word_embeddings.weight"}
    _no_split_modules = ["ZformerDecoderLayer"]
    base_model_prefix = "decoder"  # the stack below the head
    _is_encoder_decoder = False

    def __init__(self, config):
        layer_types = config.layer_attention_types()
        for i, kind in enumerate(layer_types):
            if kind not in CAUSAL_ATTENTION_TYPES:
                raise ValueError(
                    f"attention_type={config.attention_type!r}: layer {i} is {kind!r}, which cannot be causal; a "
                    f"causal language model takes {list(CAUSAL_ATTENTION_TYPES)}"
                )
        super().__init__(config)
        config = self.config
        self.decoder = ZformerDecoder(config, layer_types)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.decoder.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.decoder.embeddings.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: ZformerCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch=None,
        token_type_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        cache: ZformerCache | None = None,
        shift_labels: torch.LongTensor | None = None,
    ):
        """input_ids (B, N) or inputs_embeds (B, N, D); attention_mask (B, N), or (B, past + N) with a
        cache (what `generate()` passes), 1 at real tokens, padding on either side; position_ids
        (B, N) by default from the mask. `past_key_values` (or `cache`, transformers' name since 5.24):
        the `ZformerCache` of earlier calls (a new one when `use_cache` and none is given). labels
        (B, N): the input ids, -100 where not scored; shifted inside; or `shift_labels` (B, N), targets
        already shifted (`causal_lm_loss`), which take their place. `logits_to_keep` > 0 computes
        only the last ones. Returns
        `CausalLMOutputWithPast(loss, logits (B, N, vocab), the cache, hidden_states)`, the cache under
        `CACHE_FIELD` (`cache` from transformers 5.24, `past_key_values` before)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        past_key_values = decoding_state(past_key_values, cache)
        check_inputs(input_ids, inputs_embeds, attention_mask, **cache_extent(past_key_values))
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if output_attentions:
            raise ValueError("output_attentions=True is not supported by the causal language model")
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        scored = labels is not None or shift_labels is not None
        if scored and past_key_values is None:
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = self.decoder.new_cache()
        if not use_cache:
            past_key_values = None
        tied = None if inputs_embeds is not None else tied_lookups(
            self.lm_head, (self.decoder.embeddings.word_embeddings, input_ids))
        if tied is not None:  # the same embeddings, with a cheaper gradient
            (inputs_embeds, head_weight), input_ids = tied, None
        hidden_states, all_hidden = self.decoder(
            input_ids, attention_mask, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            position_ids=position_ids, token_type_ids=token_type_ids, output_hidden_states=output_hidden_states,
        )
        kept = hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
        logits = head_logits(self.lm_head, kept, None if tied is None else head_weight)
        loss = causal_lm_loss(logits, labels, num_items_in_batch, shift_labels) if scored else None
        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=all_hidden, **{CACHE_FIELD: past_key_values}
        )
        return output if return_dict else output.to_tuple()


# ----------------------------------------------------------------------------------------------
# "fastformer" model type: the same classes bound to FastformerConfig (the generative ones name the
# generation mixin among their direct bases, as transformers expects of every generative class)
# ----------------------------------------------------------------------------------------------


class FastformerModel(ZformerModel):
    config: FastformerConfig
    config_class = FastformerConfig


class FastformerForSequenceClassification(ZformerForSequenceClassification):
    config: FastformerConfig
    config_class = FastformerConfig


class FastformerForMaskedLM(ZformerForMaskedLM):
    config: FastformerConfig
    config_class = FastformerConfig


class FastformerForConditionalGeneration(ZformerForConditionalGeneration, ZformerGenerationMixin):
    config: FastformerConfig
    config_class = FastformerConfig


class FastformerForCausalLM(ZformerForCausalLM, ZformerGenerationMixin):
    config: FastformerConfig
    config_class = FastformerConfig


# The one registration table: Auto class -> (model class of type "zformer", of type "fastformer").
# It feeds the Auto registration on import of hf_zformer (`register_auto_classes`) and the `auto_map`
# of saved checkpoints (remote-code loading).
AUTO_CLASSES = {
    "AutoModel": (ZformerModel, FastformerModel),
    "AutoModelForSequenceClassification": (ZformerForSequenceClassification, FastformerForSequenceClassification),
    "AutoModelForMaskedLM": (ZformerForMaskedLM, FastformerForMaskedLM),
    "AutoModelForSeq2SeqLM": (ZformerForConditionalGeneration, FastformerForConditionalGeneration),
    "AutoModelForCausalLM": (ZformerForCausalLM, FastformerForCausalLM),
}
CONFIG_CLASSES = (ZformerConfig, FastformerConfig)


def auto_map_for(model_type: str) -> dict:
    """The `auto_map` of a saved checkpoint: every supported Auto class, for remote-code loading."""
    column = [config.model_type for config in CONFIG_CLASSES].index(model_type)
    auto_map = {"AutoConfig": f"configuration_zformer.{CONFIG_CLASSES[column].__name__}"}
    for auto_class, model_classes in AUTO_CLASSES.items():
        auto_map[auto_class] = f"modeling_zformer.{model_classes[column].__name__}"
    return auto_map


def register_auto_classes():
    """Register both model types with transformers' Auto classes (exist_ok: importing twice is fine)."""
    import transformers

    for column, config_class in enumerate(CONFIG_CLASSES):
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_class, model_classes in AUTO_CLASSES.items():
            getattr(transformers, auto_class).register(config_class, model_classes[column], exist_ok=True)


for _auto_class, _model_classes in AUTO_CLASSES.items():
    for _model_class in _model_classes:
        _model_class.register_for_auto_class(_auto_class)
for _config_class in CONFIG_CLASSES:
    _config_class.register_for_auto_class("AutoConfig")

# Checkpoints saved before 0.2.0 hold each layer's output projection beside its attention
# (`attention_output`, `self_attention_output`, `cross_attention_output`); the attention owns it now
# (`attention.output`, ...). transformers renames the keys on load (from_pretrained, remote code
# included) and, as for its own legacy renames, a checkpoint re-saved keeps the layout it was loaded with.
#
# Checkpoints saved before 0.2.0 also hold Zformer's `log_scale` as a 0-d tensor; it has shape (1,) now
# (FSDP shards no 0-d parameter). `ScalarToVector` reshapes it on load; it is its own reverse, so a
# model is always saved with shape (1,). It joins the load of models that have a `log_scale`
# (`ZformerPreTrainedModel._load_pretrained_model`) rather than the model type's registered mapping:
# transformers expects every registered pattern to name keys of each model of the type, and a model
# of full, xformer, fastformer or hedgehog layers has no `log_scale`.


class ScalarToVector(ConversionOps):
    """A 0-d tensor as shape (1,); any other tensor unchanged."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.reshape(1) if tensor.dim() == 0 else tensor}

    @property
    def reverse_op(self) -> ConversionOps:
        return self


for _config_class in CONFIG_CLASSES:
    register_checkpoint_conversion_mapping(
        _config_class.model_type,
        [
            WeightRenaming(r"attention_output\.", "attention.output."),
        ],
        overwrite=True,
    )

__all__ = [
    "ZformerPreTrainedModel",
    "ZformerModel",
    "ZformerForSequenceClassification",
    "ZformerForMaskedLM",
    "FastformerModel",
    "FastformerForSequenceClassification",
    "FastformerForMaskedLM",
    "ZformerForConditionalGeneration",
    "FastformerForConditionalGeneration",
    "ZformerForCausalLM",
    "FastformerForCausalLM",
    "ZformerCache",
    "position_ids_from_mask",
]
