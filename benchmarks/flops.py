"""FLOP accounting of the attention benchmark: nominal counts (the design's equations) and the
counts hf_zformer's implementation executes (its folded forms do less work), per call and per
timed step, and the FLOP/s fractions of the measured matmul rate."""

from __future__ import annotations

import math

import torch

from hf_zformer.modeling.attention import ATTENTION_CLASSES
from hf_zformer.modeling.ops import quadratic_order_pays_off

from .cases import TYPES, BenchCase, BenchResult, attention_of, folds_under_autocast, make_config

def attention_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config=None) -> int:
    """Nominal forward FLOPs of one self-attention call (a multiply-add counts 2), by the equations
    of the design (whatever an implementation executes):

    - projections: a Linear D -> D' on B*N tokens costs 2 B N D D'.
    - full / full_eager: Q, K, V projections + Q K^T + P V = 6 B N D^2 + 4 B N^2 D (softmax ignored).
    - zformer: Q, K, V projections + K^T V + Q (K^T V) = 6 B N D^2 + 4 B N D d_h. With the hedgehog
      feature map (`zformer_feature_map="hedgehog"`), the two per-head maps W_h (d_h x d_h) on queries
      and keys, 4 B N D d_h, and the sums run over 2 d_h features against [V, 1]: phi(K)^T [V, 1]
      and phi(Q) (.) 2 x 2 B N H 2 d_h (d_h + 1) = 8 B N D (d_h + 1).
    - xformer: Q' (D -> D/alpha) + K = E Q' + V = E X + scores + P V with k = ceil(max_pos / beta)
      compressed keys: 2 B N D^2/alpha + 2 B k N (D/alpha + D + D/alpha + D).
    - fastformer: Q, K, V (unless shared with Q) and W_r projections, 2 B N D^2 each, plus the
      O(B N D) pooling/elementwise work: 2 scores + 2 poolings (2 B N D each) + 3 elementwise
      (B N D each) = 11 B N D.
    """
    config = config if config is not None else make_config(attention_type, length, width, heads)
    b, n, d = batch, length, width
    head_dim = d // heads
    if attention_type in ("full", "full_eager"):
        return 6 * b * n * d * d + 4 * b * n * n * d
    if attention_type == "zformer" and _hedgehog(config):
        return 6 * b * n * d * d + 4 * b * n * d * head_dim + 8 * b * n * d * (head_dim + 1)
    if attention_type == "zformer":
        return 6 * b * n * d * d + 4 * b * n * d * head_dim
    if attention_type == "xformer":
        query_width = d // config.xformer_alpha
        k = math.ceil(config.max_position_embeddings / config.xformer_beta)
        return 2 * b * n * d * query_width + 2 * b * k * n * (2 * query_width + 2 * d)
    if attention_type == "fastformer":
        return 2 * _fastformer_projections(config) * b * n * d * d + 11 * b * n * d
    raise ValueError(f"unknown attention type {attention_type!r}; choose one of {list(TYPES)}")


def dense_flops(batch: int, length: int, width: int, ffn: int) -> int:
    """The rest of a layer around its attention: output projection 2 B N D^2 + feed-forward 4 B N D I."""
    return 2 * batch * length * width * width + 4 * batch * length * width * ffn


def layer_flops(attention_type: str, batch: int, length: int, width: int, heads: int, ffn: int, config=None) -> int:
    """Nominal forward FLOPs of one (self-attention) layer: `attention_flops` + `dense_flops`."""
    return attention_flops(attention_type, batch, length, width, heads, config) + dense_flops(batch, length, width, ffn)


def token_attention_flops(attention_type: str, context: int, width: int, heads: int, config=None) -> int:
    """Nominal forward FLOPs of one causal self-attention step (one new token, cache on) that attends
    to `context` tokens: `attention_flops` of one token, and full attention scores and sums over
    all `context` keys (4 D per further key)."""
    flops = attention_flops(attention_type, 1, 1, width, heads, config)
    if attention_type in ("full", "full_eager"):
        flops += 4 * (context - 1) * width
    return flops


def _fastformer_projections(config) -> int:
    return 3 if config.fastformer_share_qv else 4


def _hedgehog(config) -> bool:
    return getattr(config, "zformer_feature_map", "identity") == "hedgehog"


def folded(attention_type: str, length: int, width: int, config, dtype: str = "fp32",
           under_autocast: bool = False) -> bool:
    """Whether hf_zformer's bidirectional zformer/fastformer take their folded form: the model's own
    rule (`modeling.attention.use_folded_form`: fp32 outside autocast; a bf16 benchmark runs its
    fp32 inputs under autocast, which keeps the plain form unless the type takes its folded form
    there too, `under_autocast`: `cases.folds_under_autocast`) given the class's own test that the
    folded form does fewer FLOPs (`folded_form_pays_off`). A zformer with a feature map has no
    folded form."""
    if (dtype != "fp32" and not under_autocast) or (attention_type == "zformer" and _hedgehog(config)):
        return False
    structure = {"projections": _fastformer_projections(config)} if attention_type == "fastformer" else {}
    kind = ATTENTION_CLASSES.get(attention_type)  # None for `full_eager`, which has no folded form either
    return kind is not None and kind.folded_form_pays_off(length, width, **structure)


def executed_attention_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config=None,
                             dtype: str = "fp32", under_autocast: bool = False) -> int:
    """Forward FLOPs that hf_zformer's implementation actually executes (matmuls only):

    - full, full_eager, and zformer/fastformer in their plain form: as `attention_flops`; zformer
      on short inputs (`quadratic_order_pays_off`: N < d_h) computes (Q K^T) V, 6 B N D^2 + 4 B N^2 D;
      with the hedgehog map (N < 2 d_h) the maps 4 B N D d_h plus 4 B N^2 D + 2 B N^2 (D + H).
    - zformer folded (`folded`: fp32, N > D): Gram matrix 2 B N D^2 + [W_v|b_v] S 2 B D (D+1)^2 + per-head
      products 4 B D (D+1) d_h + x_i A 2 B N D^2.
    - fastformer folded (`folded`; (projections - 1) N > D): 2 score products and 2 poolings
      (2 B H N D each) + W_r diag(k_g) W_v 2 B D^3 + x_i A 2 B N D^2.
    - xformer: as nominal, but fused attention scores run on value-wide heads (zero-padded query
      and key channels): scores cost 2 B N k D instead of 2 B N k D/alpha.
    """
    config = config if config is not None else make_config(attention_type, length, width, heads)
    b, n, d = batch, length, width
    if folded(attention_type, n, d, config, dtype, under_autocast):
        if attention_type == "zformer":
            return 4 * b * n * d * d + 2 * b * d * (d + 1) ** 2 + 4 * b * d * (d + 1) * (d // heads)
        return 8 * b * heads * n * d + 2 * b * d**3 + 2 * b * n * d * d
    if attention_type == "xformer":
        query_width = d // config.xformer_alpha
        k = math.ceil(config.max_position_embeddings / config.xformer_beta)
        return 2 * b * n * d * query_width + 2 * b * k * n * (query_width + 3 * d)
    if attention_type == "zformer" and _hedgehog(config) and quadratic_order_pays_off(n, n, 2 * (d // heads)):
        # (phi(Q) phi(K)^T) [V, 1] over 2 d_h features: 2 B H N^2 2 d_h + 2 B H N^2 (d_h + 1)
        return 6 * b * n * d * d + 4 * b * n * d * (d // heads) + 4 * b * n * n * d + 2 * b * n * n * (d + heads)
    if attention_type == "zformer" and not _hedgehog(config) and quadratic_order_pays_off(n, n, d // heads):
        return 6 * b * n * d * d + 4 * b * n * n * d
    return attention_flops(attention_type, batch, length, width, heads, config)


def executed_output_flops(attention_type: str, batch: int, length: int, width: int, config,
                          dtype: str = "fp32", under_autocast: bool = False) -> int:
    """Forward FLOPs that the attention's output projection executes: 2 B N D^2 applied to every
    token, unless a folded form merges it into its per-sequence matrix: zformer's when N > D, for
    2 B D^3; fastformer's through W_o W_q and W_o W_r, formed once per call for 4 D^3, when
    B N >= 2 D (`folds_output_projection`)."""
    b, n, d = batch, length, width
    if folded(attention_type, n, d, config, dtype, under_autocast) and (
        ATTENTION_CLASSES[attention_type].folds_output_projection(b, n, d)
    ):
        return 4 * d**3 if attention_type == "fastformer" else 2 * b * d**3  # once per call / per sequence
    return 2 * b * n * d * d


def module_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config,
                 executed: bool = False, dtype: str = "fp32", under_autocast: bool = False) -> int:
    """Forward FLOPs of the whole attention module: the attention (`attention_flops`, or
    `executed_attention_flops` when `executed`) and its output projection (2 B N D^2 nominal,
    `executed_output_flops` executed)."""
    if not executed:
        return attention_flops(attention_type, batch, length, width, heads, config) + 2 * batch * length * width**2
    return (executed_attention_flops(attention_type, batch, length, width, heads, config, dtype, under_autocast)
            + executed_output_flops(attention_type, batch, length, width, config, dtype, under_autocast))


def model_flops(attention_type: str, batch: int, length: int, width: int, heads: int, config,
                executed: bool = False, dtype: str = "fp32", under_autocast: bool = False) -> int:
    """Forward FLOPs of the one-layer model: the attention module (`module_flops`), the shrunk
    feed-forward (4 B N D I) and an input convolution of k taps (`encoder_conv_size`), 2 B N D k;
    embeddings and LayerNorms are ignored."""
    b, n, d = batch, length, width
    convolution = 2 * b * n * d * getattr(config, "encoder_conv_size", 0)
    feed_forward = 4 * b * n * d * config.intermediate_size
    return module_flops(attention_type, b, n, d, heads, config, executed, dtype, under_autocast) + feed_forward + convolution


def step_flops(forward_flops: int, mode: str) -> int:
    """FLOPs of one timed step: forward, or forward+backward counted as 3x forward (the backward
    of a matmul is two matmuls of the same size)."""
    return forward_flops if mode == "forward" else 3 * forward_flops


def case_flops(case: BenchCase, config=None) -> tuple[int, int]:
    """(nominal, executed) FLOPs of one timed call of `case`."""
    config = config if config is not None else make_config(case.attention_type, case.length, case.width, case.heads)
    # the torch forms of a type do its FLOPs
    kind = "full_eager" if case.attention_type == "full_eager" else attention_of(case.attention_type)
    shape = (kind, case.batch, case.length, case.width, case.heads, config)
    forced = folds_under_autocast(case.attention_type, torch.device(case.device).type)

    if case.level in ("model", "module"):
        count = model_flops if case.level == "model" else module_flops
        counts = count(*shape), count(*shape, executed=True, dtype=case.dtype, under_autocast=forced)
    else:
        counts = attention_flops(*shape), executed_attention_flops(*shape, dtype=case.dtype, under_autocast=forced)
    return tuple(step_flops(count, case.mode) for count in counts)


def set_flops_fractions(results: list[BenchResult], matmul_flops: float):
    """flops_fraction = nominal FLOPs per second / the measured matmul FLOP/s (can exceed 1 where
    the implementation does less work than the equations); executed_fraction the same with the
    FLOPs actually executed (the hardware efficiency)."""
    for r in results:
        if r.status == "ok" and r.time_ms:
            r.flops_fraction = r.flops / (r.time_ms / 1e3) / matmul_flops
            r.executed_fraction = r.executed_flops / (r.time_ms / 1e3) / matmul_flops
