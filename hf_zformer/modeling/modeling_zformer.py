"""Zformer-family models: embeddings, pre-LayerNorm Transformer layers with a choice of attention
per layer, the encoder, and task heads, following transformers 5 conventions.

This file ships to the Hugging Face Hub with every checkpoint (with `attention.py` and
`configuration_zformer.py`): torch, transformers and siblings only.
"""

import math

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput

from .attention import ATTENTION_CLASSES, FastformerAttention, XformerAttention, ZformerAttention
from .configuration_zformer import FastformerConfig, ZformerConfig


def sinusoidal_table(length: int, width: int) -> torch.Tensor:
    """Fixed sinusoidal positions (length, width): sin on even, cos on odd channels."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : width // 2]
    return table


class ZformerEmbeddings(nn.Module):
    """Token embeddings (scaled by sqrt(D) when `scale_embedding`) merged with absolute positions,
    sinusoidal or learned, by addition or by concatenation followed by a projection back to D."""

    def __init__(self, config):
        super().__init__()
        width = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.embed_scale = math.sqrt(width) if config.scale_embedding else 1.0
        self.max_length = config.max_position_embeddings
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        else:
            self.register_buffer("sinusoidal", sinusoidal_table(self.max_length, width), persistent=False)
        self.merge = nn.Linear(2 * width, width) if config.position_embedding_merge == "concat" else None
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def positions(self, start: int, length: int) -> torch.Tensor:
        if start + length > self.max_length:
            raise ValueError(
                f"sequence of {start + length} tokens is longer than max_position_embeddings={self.max_length}"
            )
        if hasattr(self, "position_embeddings"):
            return self.position_embeddings.weight[start : start + length]
        return self.sinusoidal[start : start + length]

    def forward(self, input_ids=None, inputs_embeds=None, past_length: int = 0) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        tokens = inputs_embeds * self.embed_scale  # (B, N, D)
        positions = self.positions(past_length, tokens.shape[1]).to(tokens.dtype)[None]  # (1, N, D)
        if self.merge is None:
            hidden = tokens + positions
        else:
            hidden = self.merge(torch.cat([tokens, positions.expand_as(tokens)], dim=-1))
        return self.dropout(hidden)


class ZformerFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = ACT2FN[config.hidden_act]
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states):
        return self.dropout(self.output(self.dropout(self.activation(self.intermediate(hidden_states)))))


class ZformerLayer(GradientCheckpointingLayer):
    """Pre-LayerNorm encoder layer: x + Attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, config, attention_type: str, layer_idx: int):
        super().__init__()
        self.attention_type = attention_type
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = ATTENTION_CLASSES[attention_type](config, layer_idx=layer_idx)
        self.attention_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.feed_forward_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = ZformerFeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        context, _ = self.attention(self.attention_norm(hidden_states), attention_mask)
        hidden_states = hidden_states + self.dropout(self.attention_output(context))
        return hidden_states + self.feed_forward(self.feed_forward_norm(hidden_states))


class ZformerPreTrainedModel(PreTrainedModel):
    config: ZformerConfig
    base_model_prefix = "zformer"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _no_split_modules = ["ZformerLayer", "ZformerDecoderLayer"]

    def __init__(self, config, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # Saved checkpoints load with trust_remote_code=True through every Auto class we support.
        config.auto_map = auto_map_for(config.model_type)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, ZformerAttention):
            init.constant_(module.log_scale, math.log(module.scale_init))
        elif isinstance(module, XformerAttention):
            init.normal_(module.sequence_projection, mean=0.0, std=std)
        elif isinstance(module, FastformerAttention) and module.additive:
            init.normal_(module.query_score, mean=0.0, std=std)
            init.normal_(module.key_score, mean=0.0, std=std)
        elif isinstance(module, ZformerEmbeddings) and hasattr(module, "sinusoidal"):
            init.copy_(module.sinusoidal, sinusoidal_table(*module.sinusoidal.shape))
        elif isinstance(module, ZformerLMHead):
            init.zeros_(module.bias)


def _hidden_mask(attention_mask, input_ids, inputs_embeds):
    """(B, N) 0/1 padding mask; all ones when none is given."""
    if attention_mask is not None:
        return attention_mask
    reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
    return torch.ones(reference.shape[:2], dtype=torch.long, device=reference.device)


class ZformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            ZformerLayer(config, attention_type, i) for i, attention_type in enumerate(config.layer_attention_types())
        )
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, output_hidden_states=False):
        all_hidden = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden = all_hidden[:-1] + (hidden_states,)
        return hidden_states, all_hidden


class ZformerModel(ZformerPreTrainedModel):
    """The bare encoder: embeddings, layers of the configured attention types, final LayerNorm."""

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = ZformerEmbeddings(config)
        self.encoder = ZformerEncoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """input_ids (B, N) or inputs_embeds (B, N, D); attention_mask (B, N), 1 at real tokens.
        Returns `BaseModelOutput(last_hidden_state (B, N, D), hidden_states)`."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        attention_mask = _hidden_mask(attention_mask, input_ids, inputs_embeds)
        hidden_states = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)
        hidden_states, all_hidden = self.encoder(hidden_states, attention_mask, output_hidden_states)
        if not return_dict:
            return tuple(v for v in (hidden_states, all_hidden) if v is not None)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden)


class ZformerPooler(nn.Module):
    """Sequence pooling for classification: masked mean (the FastFormer seed), the first token, or
    additive attention pooling (the official Fastformer: softmax_i(w . tanh(W h_i)))."""

    def __init__(self, config):
        super().__init__()
        self.mode = config.classifier_pooling
        if self.mode == "attention":
            self.projection = nn.Linear(config.hidden_size, config.hidden_size)
            self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states, attention_mask):
        if self.mode == "first":
            return hidden_states[:, 0]
        mask = attention_mask.to(hidden_states.dtype)[..., None]  # (B, N, 1)
        if self.mode == "mean":
            return (hidden_states * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        scores = self.score(torch.tanh(self.projection(hidden_states))).float()  # (B, N, 1)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        weights = torch.softmax(scores, dim=1).to(hidden_states.dtype)
        return (weights * hidden_states).sum(1)


def classification_loss(config, logits, labels):
    """Regression, single-label or multi-label loss, chosen like transformers' heads."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        if config.num_labels == 1:
            return MSELoss()(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
        return MSELoss()(logits, labels.to(logits.dtype))
    if config.problem_type == "single_label_classification":
        return CrossEntropyLoss()(logits.view(-1, config.num_labels), labels.view(-1))
    return BCEWithLogitsLoss()(logits, labels.to(logits.dtype))


class ZformerForSequenceClassification(ZformerPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
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
        labels=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        """labels (B,) class ids, (B,) / (B, num_labels) floats for regression, or (B, num_labels)
        multi-hot floats for multi-label classification."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        attention_mask = _hidden_mask(attention_mask, input_ids, inputs_embeds)
        outputs = self.zformer(
            input_ids, attention_mask, inputs_embeds, output_hidden_states=output_hidden_states, return_dict=True
        )
        pooled = self.pooler(outputs.last_hidden_state, attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = classification_loss(self.config, logits, labels) if labels is not None else None
        if not return_dict:
            output = (logits,) + ((outputs.hidden_states,) if outputs.hidden_states is not None else ())
            return ((loss,) + output) if loss is not None else output
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


class ZformerLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> projection onto the vocabulary (tied to the input embeddings)."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states):
        return self.decoder(self.layer_norm(self.activation(self.dense(hidden_states)))) + self.bias


class ZformerForMaskedLM(ZformerPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "zformer.embeddings.word_embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.zformer = ZformerModel(config)
        self.lm_head = ZformerLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        labels=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        """labels (B, N): token ids to predict, -100 where no prediction is scored."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.zformer(
            input_ids, attention_mask, inputs_embeds, output_hidden_states=output_hidden_states, return_dict=True
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.config.vocab_size).float(), labels.view(-1))
        if not return_dict:
            output = (logits,) + ((outputs.hidden_states,) if outputs.hidden_states is not None else ())
            return ((loss,) + output) if loss is not None else output
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


# ----------------------------------------------------------------------------------------------
# "fastformer" model type: the same classes bound to FastformerConfig
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


# Auto class -> model class name (without the model-type prefix) for every Auto class we support.
AUTO_CLASSES = {
    "AutoModel": "Model",
    "AutoModelForSequenceClassification": "ForSequenceClassification",
    "AutoModelForMaskedLM": "ForMaskedLM",
}
MODEL_TYPE_PREFIX = {"zformer": "Zformer", "fastformer": "Fastformer"}


def auto_map_for(model_type: str) -> dict:
    """The `auto_map` of a saved checkpoint: every supported Auto class, for remote-code loading."""
    prefix = MODEL_TYPE_PREFIX[model_type]
    auto_map = {"AutoConfig": f"configuration_zformer.{prefix}Config"}
    for auto_class, suffix in AUTO_CLASSES.items():
        auto_map[auto_class] = f"modeling_zformer.{prefix}{suffix}"
    return auto_map


def _model_classes():
    """(auto class name, model class) for every model class in this file."""
    for prefix in MODEL_TYPE_PREFIX.values():
        for auto_class, suffix in AUTO_CLASSES.items():
            yield auto_class, globals()[f"{prefix}{suffix}"]


for _auto_class, _model_class in _model_classes():
    _model_class.register_for_auto_class(_auto_class)
ZformerConfig.register_for_auto_class("AutoConfig")
FastformerConfig.register_for_auto_class("AutoConfig")

__all__ = [
    "ZformerPreTrainedModel",
    "ZformerModel",
    "ZformerForSequenceClassification",
    "ZformerForMaskedLM",
    "FastformerModel",
    "FastformerForSequenceClassification",
    "FastformerForMaskedLM",
]
