"""Configuration of the Zformer family (full, Zformer, Xformer and Fastformer attention).

This file ships to the Hugging Face Hub with every saved checkpoint: it imports only the
standard library, transformers and `attention_registry` (standard library only).
"""

import math

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .attention_registry import attention_types

# Views of the one table of attention types (`attention_registry`), read at each use: every type,
# those with an exact causal form, those that can be cross-attention, and those that form attention
# probabilities (which `attention_probs_dropout_prob` drops; BERT's rate is their default).
ATTENTION_TYPES = attention_types()
CAUSAL_ATTENTION_TYPES = attention_types(causal=True)
CROSS_ATTENTION_TYPES = attention_types(cross=True)
PROBABILITY_ATTENTION_TYPES = attention_types(probabilities=True)
DEFAULT_ATTENTION_DROPOUT = 0.1
POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned")
POSITION_EMBEDDING_MERGES = ("add", "concat")
FASTFORMER_POOLINGS = ("additive", "mean")
ZFORMER_FEATURE_MAPS = ("identity", "hedgehog")
CLASSIFIER_POOLINGS = ("mean", "first", "attention", "pooler")
POOLER_ACTIVATIONS = ("tanh", "relu", "gelu")
LAYER_NORM_POSITIONS = ("pre", "post")


def _check_choice(field, value, choices):
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not supported; choose one of {list(choices)}")


# (field, its "off" value, what it did): options of earlier versions, refused when set
REMOVED_OPTIONS = (
    ("zformer_normalization", "none", "each output row divided by its token count"),
    ("fastformer_global_value", False, "a pooled global value added to every fastformer token's mix"),
)


def _check_positive(field, value, allow_zero=False):
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{field}={value!r} must be a {'non-negative' if allow_zero else 'positive'} integer")


def _check_probability(field, value):
    if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
        raise ValueError(f"{field}={value!r} must be a probability in [0, 1)")


def _per_layer(field, value, num_layers, choices):
    """Expand `value` (one type, or a list with one type per layer) into a validated list."""
    if isinstance(value, str):
        _check_choice(field, value, choices)
        return [value] * num_layers
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field}={value!r} must be one of {list(choices)} or a list with one entry per layer")
    if len(value) != num_layers:
        raise ValueError(f"{field} has {len(value)} entries ({list(value)}) but the model has {num_layers} layers")
    for i, entry in enumerate(value):
        _check_choice(f"{field}[{i}]", entry, choices)
    return list(value)


def check_attention_sinks(sinks, windows: list[int]) -> None:
    """`attention_sinks`: a non-negative integer, non-zero only where some layer has a softmax window."""
    if not (isinstance(sinks, int) and not isinstance(sinks, bool) and sinks >= 0):
        raise ValueError(f"attention_sinks={sinks!r} must be a non-negative integer (0: no sinks)")
    if sinks and not any(windows):
        raise ValueError(f"attention_sinks={sinks} needs a softmax window (attention_window); no layer has one")

class ZformerConfig(PreTrainedConfig):
    r"""
    Configuration for Zformer-family models: a BERT-sized Transformer encoder (and, for
    `ZformerForConditionalGeneration`, a decoder) whose self-attention is one of

    - `"full"`: softmax attention through transformers' attention functions (fused SDPA by default,
      `attn_implementation="eager"` for the einsum reference);
    - `"zformer"`: softmax-free linear attention `Q (K^T V) / s` with a learnable scale `s`;
    - `"xformer"`: Linformer-like attention whose keys are projected from the queries and whose
      keys/values are compressed along the sequence by a shared projection;
    - `"fastformer"`: additive attention (Wu et al. 2021).

    `attention_type` may also be a list with one entry per layer, for hybrid models.

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act,
        hidden_dropout_prob, attention_probs_dropout_prob, max_position_embeddings, initializer_range,
        layer_norm_eps: as in BERT. `attention_probs_dropout_prob` drops attention probabilities of
            full and Xformer layers; Zformer and Fastformer layers form none and ignore it (with a
            warning the first time such a model trains with it set above 0). Default `None`: BERT's
            0.1 when the model has a layer that forms probabilities, else 0, fixed when a model is
            built from the config (`resolve_attention_dropout`) and saved with it.
        attention_type (`str` or `list[str]`): encoder self-attention type(s).
        zformer_scale_init (`float`): initial value of Zformer's learnable output scale `s` (700, the
            value of the Zformer_Pytorch reference code).
        zformer_feature_map (`"identity"` or `"hedgehog"`): what Zformer applies to queries and keys.
            `"identity"`: `Q (K^T V) / s` as above. `"hedgehog"`: a learned map per head,
            phi(x) = [softmax(W x + b), softmax(-(W x + b))] (Hedgehog, Zhang et al. 2024; W starts
            as the identity, b at zero), and normalised attention
            out_i = sum_j (phi(q_i) . phi(k_j)) v_j / sum_j (phi(q_i) . phi(k_j)), still O(N d_h^2) and
            with a constant-size decoding state; no scale `s` (`zformer_scale_init` unused), 2 d_h (d_h + 1)
            more parameters per head. Applies to every zformer layer: encoder, decoder, cross-attention.
        xformer_alpha (`int`): Xformer divides the query/key width by `alpha`.
        xformer_beta (`int`): Xformer compresses the sequence from `max_position_embeddings` to
            `ceil(max_position_embeddings / beta)` keys (`beta > 1`).
        fastformer_pooling (`"additive"` or `"mean"`): softmax pooling of the paper, or the plain mean.
        fastformer_share_qv (`bool`): use the query projection as value projection (official code).
        position_embedding_type (`"sinusoidal"` or `"learned"`): absolute positions.
        position_embedding_merge (`"add"` or `"concat"`): add positions to the token embeddings, or
            concatenate them and project back to `hidden_size`.
        scale_embedding (`bool`): multiply token embeddings by `sqrt(hidden_size)`.
        classifier_pooling (`"mean"`, `"first"`, `"attention"` or `"pooler"`): how the sequence classifier
            pools tokens; `"pooler"` is BERT's pooler: the first token through a dense layer and
            `pooler_activation`.
        pooler_activation (`"tanh"`, `"relu"` or `"gelu"`): activation of the `"pooler"` pooling: `"tanh"`
            is BERT's pooler and RoBERTa's classification head, `"relu"` DistilBERT's pre_classifier.
        classifier_dropout (`float`, optional): dropout before the classifier (default `hidden_dropout_prob`).
        activation_dropout (`float`, optional): dropout after the feed-forward activation (default
            `hidden_dropout_prob`; BERT-family layers have none: 0.0).

        The fields below express BERT-family encoders exactly (see docs/warm_start.md); their
        defaults give the original Zformer architecture:

        layer_norm_position (`"pre"` or `"post"`): pre-LayerNorm layers, `x + Attn(LN(x))` then
            `x + FFN(LN(x))` and a final LayerNorm; or BERT's post-LayerNorm, `LN(x + Attn(x))` then
            `LN(x + FFN(x))`, without a final LayerNorm.
        type_vocab_size (`int`): number of token types (BERT's segment embeddings); 0: no token type
            embeddings, and `token_type_ids` must then be all zeros.
        embedding_layer_norm (`bool`): LayerNorm over the summed embeddings, before their dropout (BERT).
        position_offset (`int`): position of the first real token; RoBERTa's tables start at
            `padding_idx + 1` (2). A sequence may hold `max_position_embeddings - position_offset` tokens.
        attention_window (`int` or `list[int]`): for `ZformerForCausalLM` only, per layer (one value
            for all, or a list), 0 (default) or the number W of most recent tokens, the query's own
            included, that a zformer layer with the hedgehog map attends to with softmax weights
            exp(q_i . k_j / sqrt(d_h)); older tokens enter through the feature map, and both kinds of
            weight share one normalisation (LoLCATs-style), with a learned softmax share per head
            (0.5 at init). Costs O(N W d_h) more; the decoding state is then the last W - 1 keys and
            values plus the linear state, still constant in the generated length. Encoders and
            encoder-decoders refuse a window.
        attention_sinks (`int`): with `attention_window`, 0 (default) or the number S of first real
            tokens of each sequence that every windowed layer keeps as softmax keys for all later
            tokens (attention sinks, as StreamingLLM keeps them); the decoding state gains their keys
            and values, still constant in the generated length.
        encoder_conv_size (`int`): 0 (default) or the odd width (>= 3) of a centred depthwise
            convolution over the input of every encoder self-attention: token i sees
            `sum_k w_k * x_{i+k}`, |k| <= `encoder_conv_size // 2`, per channel, with zeros beyond the
            ends and at padding. Fastformer mixes tokens only through pooled vectors, the same for
            every token; this gives each token its neighbours exactly. It starts as the identity.
        num_decoder_layers (`int`): decoder depth of `ZformerForConditionalGeneration`.
        decoder_attention_type (`str` or `list[str]`): decoder self-attention, causal: `"full"`, `"zformer"`
            or `"fastformer"` (per layer allowed).
        cross_attention_type (`"full"` or `"zformer"`): decoder-to-encoder attention.
        decoder_conv_size (`int`): 0 (default) or the width (>= 2) of a causal depthwise convolution
            over the input of every decoder self-attention (causal language models and the decoders of
            encoder-decoders): token i sees `sum_k w_k * x_{i-k}`, k < `decoder_conv_size`, per
            channel, with zeros before the first token and at padding, so linear attention, which sees
            the prefix through a sum or a pooling, gets the last few tokens exactly. It starts as the
            identity, and decoding keeps each layer's last `decoder_conv_size - 1` inputs (a state of
            fixed size).
        label_smoothing (`float`): label smoothing of the seq2seq loss.

    Example:

    ```python
    >>> import hf_zformer
    >>> from transformers import AutoConfig, AutoModel
    >>> config = AutoConfig.for_model("zformer", attention_type="zformer", hidden_size=256,
    ...                               num_hidden_layers=2, num_attention_heads=4, intermediate_size=512)
    >>> model = AutoModel.from_config(config)
    ```
    """

    model_type = "zformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 16000
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float | None = None  # per the model's attention types: resolve_attention_dropout
    max_position_embeddings: int = 512
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    decoder_start_token_id: int | None = 1
    attention_type: str | list[str] = "zformer"
    zformer_scale_init: float = 700.0
    zformer_feature_map: str = "identity"
    attention_window: int | list[int] = 0
    attention_sinks: int = 0
    xformer_alpha: int = 2
    xformer_beta: int = 4
    fastformer_pooling: str = "additive"
    fastformer_share_qv: bool = False
    position_embedding_type: str = "sinusoidal"
    position_embedding_merge: str = "add"
    scale_embedding: bool = True
    classifier_pooling: str = "mean"
    pooler_activation: str = "tanh"
    classifier_dropout: float | None = None
    activation_dropout: float | None = None
    layer_norm_position: str = "pre"
    type_vocab_size: int = 0
    embedding_layer_norm: bool = False
    position_offset: int = 0
    encoder_conv_size: int = 0
    num_decoder_layers: int = 6
    decoder_attention_type: str | list[str] = "full"
    cross_attention_type: str = "full"
    decoder_conv_size: int = 0
    label_smoothing: float = 0.0
    use_cache: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self):
        """Raise a ValueError naming the field and value of the first invalid setting. Runs at
        construction and again when a model is built from this config."""
        self._check_sizes()
        encoder_types = self._check_attention_types()
        self._check_options()
        self._check_positions()
        if "xformer" in encoder_types:
            self._check_xformer()

    def _check_sizes(self):
        """Finite floats, positive sizes, heads that divide the width, probabilities, token ids."""
        for field, value in vars(self).items():  # NaN passes every comparison; infinity most
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{field}={value!r} must be a finite number")
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            _check_positive(field, getattr(self, field))
        _check_positive("num_decoder_layers", self.num_decoder_layers, allow_zero=True)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        for field in (
            "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "activation_dropout",
            "label_smoothing",
        ):
            _check_probability(field, getattr(self, field))
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps!r} must be positive")
        if not (isinstance(self.initializer_range, (int, float)) and self.initializer_range >= 0):
            raise ValueError(f"initializer_range={self.initializer_range!r} must be a non-negative number (the "
                             "standard deviation of the initial weights)")
        for field in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(f"{field}={value!r} must be None or a token id in [0, vocab_size={self.vocab_size})")

    def _check_attention_types(self) -> list[str]:
        """The attention types of every stack (per layer) and the options that depend on them;
        returns the encoder's, one per layer."""
        encoder_types = _per_layer("attention_type", self.attention_type, self.num_hidden_layers, ATTENTION_TYPES)
        decoder_value = self.decoder_attention_type
        kinds = [decoder_value] if isinstance(decoder_value, str) else decoder_value
        for kind in kinds if isinstance(kinds, (list, tuple)) else []:
            if kind in ATTENTION_TYPES and kind not in CAUSAL_ATTENTION_TYPES:
                raise ValueError(
                    f"decoder_attention_type={decoder_value!r}: {kind} cannot be causal (it has no exact causal form: "
                    f"its output would see later tokens); choose one of {list(CAUSAL_ATTENTION_TYPES)}"
                )
        _per_layer("decoder_attention_type", decoder_value, self.num_decoder_layers, CAUSAL_ATTENTION_TYPES)
        _check_choice("cross_attention_type", self.cross_attention_type, CROSS_ATTENTION_TYPES)
        _check_positive("encoder_conv_size", self.encoder_conv_size, allow_zero=True)
        if self.encoder_conv_size and (self.encoder_conv_size < 3 or self.encoder_conv_size % 2 == 0):
            raise ValueError(
                f"encoder_conv_size={self.encoder_conv_size} must be 0 (no convolution) or an odd width >= 3 "
                "(a window centred on each token)"
            )
        _check_positive("decoder_conv_size", self.decoder_conv_size, allow_zero=True)
        if self.decoder_conv_size == 1:
            raise ValueError(
                "decoder_conv_size=1 would only rescale each channel: use 0 (no convolution) or a width >= 2"
            )
        _check_choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        _check_choice("position_embedding_merge", self.position_embedding_merge, POSITION_EMBEDDING_MERGES)
        _check_choice("fastformer_pooling", self.fastformer_pooling, FASTFORMER_POOLINGS)
        _check_choice("zformer_feature_map", self.zformer_feature_map, ZFORMER_FEATURE_MAPS)
        used = {*encoder_types, *([decoder_value] if isinstance(decoder_value, str) else decoder_value),
                self.cross_attention_type}
        if self.zformer_feature_map != "identity" and "zformer" not in used:
            raise ValueError(
                f"zformer_feature_map={self.zformer_feature_map!r} applies to zformer layers and this config has "
                f"none (attention_type={self.attention_type!r}, decoder_attention_type={decoder_value!r}, "
                f"cross_attention_type={self.cross_attention_type!r}): make some layers zformer, or leave "
                "zformer_feature_map at 'identity'"
            )
        self._check_windows(encoder_types)
        check_attention_sinks(self.attention_sinks, self.layer_windows())
        return encoder_types

    def _check_windows(self, encoder_types: list[str]) -> None:
        """`attention_window`: a non-negative integer per layer, non-zero only on a zformer layer with
        the hedgehog map (the model classes that take no window refuse a non-zero one)."""
        for i, (kind, window) in enumerate(zip(encoder_types, self.layer_windows(), strict=True)):
            if window and not (kind == "zformer" and self.zformer_feature_map == "hedgehog"):
                raise ValueError(
                    f"attention_window={self.attention_window!r}: layer {i} ({kind!r}, zformer_feature_map="
                    f"{self.zformer_feature_map!r}) has window {window}; only zformer layers with the hedgehog map "
                    "take a softmax window (its weights and the feature map's share one normalisation)"
                )

    def layer_windows(self) -> list[int]:
        """The softmax window of each layer of a causal language model (0: none)."""
        value = self.attention_window
        windows = list(value) if isinstance(value, (list, tuple)) else [value] * self.num_hidden_layers
        if len(windows) != self.num_hidden_layers:
            raise ValueError(f"attention_window has {len(windows)} entries ({windows}) but the model has "
                             f"{self.num_hidden_layers} layers")
        for window in windows:
            if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
                raise ValueError(f"attention_window={value!r}: {window!r} must be a non-negative integer "
                                 "(0: no softmax window)")
        return windows

    def _check_options(self):
        """Choices, switches, the Zformer scale, and no option an earlier version removed."""
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not an activation transformers knows; choose one of "
                             f"{sorted(ACT2FN)}")
        _check_choice("classifier_pooling", self.classifier_pooling, CLASSIFIER_POOLINGS)
        _check_choice("pooler_activation", self.pooler_activation, POOLER_ACTIVATIONS)
        _check_choice("layer_norm_position", self.layer_norm_position, LAYER_NORM_POSITIONS)
        _check_positive("type_vocab_size", self.type_vocab_size, allow_zero=True)
        for switch in ("fastformer_share_qv", "scale_embedding", "embedding_layer_norm"):  # "no" would read as True
            if not isinstance(getattr(self, switch), bool):
                raise ValueError(f"{switch}={getattr(self, switch)!r} must be True or False")
        if not (isinstance(self.zformer_scale_init, (int, float)) and self.zformer_scale_init > 0):
            raise ValueError(f"zformer_scale_init={self.zformer_scale_init!r} must be a positive number")
        # Options of earlier versions, measured and removed because they did not win (hf_zformer
        # docs/results.md): a model trained with one does not compute the same function here.
        for field, off, what in REMOVED_OPTIONS:
            value = getattr(self, field, off)
            if value != off:
                raise ValueError(
                    f"{field}={value!r}: this option ({what}) was measured and removed, as it did not beat the "
                    "model without it (hf_zformer docs/results.md); a model trained with it does not compute "
                    "the same function here"
                )

    def _check_positions(self):
        _check_positive("max_position_embeddings", self.max_position_embeddings)
        _check_positive("position_offset", self.position_offset, allow_zero=True)
        if self.position_offset >= self.max_position_embeddings:
            raise ValueError(
                f"position_offset={self.position_offset} leaves no position for a token: it must be below "
                f"max_position_embeddings={self.max_position_embeddings}"
            )

    def _check_xformer(self):
        _check_positive("xformer_alpha", self.xformer_alpha)
        _check_positive("xformer_beta", self.xformer_beta)
        if self.xformer_beta < 2:
            raise ValueError(f"xformer_beta={self.xformer_beta} must be > 1 (it divides the sequence length)")
        query_width, rest = divmod(self.hidden_size, self.xformer_alpha)
        if rest or query_width % self.num_attention_heads:
            raise ValueError(
                f"xformer_alpha={self.xformer_alpha} must divide hidden_size={self.hidden_size} into a width "
                f"divisible by num_attention_heads={self.num_attention_heads}"
            )

    def resolve_attention_dropout(self) -> None:
        """Fix the default `attention_probs_dropout_prob=None` for the model being built: 0.1 when one
        of its attentions forms probabilities to drop (a full or xformer layer; for an encoder-decoder
        also the decoder and cross-attention), else 0.0, which the linear types would ignore anyway
        and warn about. Either way the model computes what it did with the former default of 0.1. An
        explicit value, and every saved config, is left as it is."""
        if self.attention_probs_dropout_prob is not None:
            return
        self.attention_probs_dropout_prob = DEFAULT_ATTENTION_DROPOUT if self.forms_attention_probabilities() else 0.0

    def forms_attention_probabilities(self) -> bool:
        """Whether a layer of the model forms attention probabilities (a full or Xformer layer; for an
        encoder-decoder also the decoder and cross-attention), the ones `attention_probs_dropout_prob`
        drops."""
        used = set(self.layer_attention_types())
        if self.is_encoder_decoder:
            used |= {*self.layer_attention_types(decoder=True), self.cross_attention_type}
        return bool(used & set(PROBABILITY_ATTENTION_TYPES))

    def layer_attention_types(self, decoder: bool = False) -> list[str]:
        """The attention type of each encoder (or decoder) layer, the single-string form expanded."""
        if decoder:
            return _per_layer(
                "decoder_attention_type", self.decoder_attention_type, self.num_decoder_layers, CAUSAL_ATTENTION_TYPES
            )
        return _per_layer("attention_type", self.attention_type, self.num_hidden_layers, ATTENTION_TYPES)


class FastformerConfig(ZformerConfig):
    r"""The Zformer architecture with Fastformer (additive) attention by default: model type `"fastformer"`.

    Accepts every argument of [`ZformerConfig`].
    """

    model_type = "fastformer"

    attention_type: str | list[str] = "fastformer"


__all__ = ["ZformerConfig", "FastformerConfig"]
