"""Benchmarks: speed and memory of the attention family against PyTorch's fused attention and transformers' models.
May import: hf_zformer (any floor), torch, transformers; outside the installed package, nothing in hf_zformer imports it.

The harness of `scripts/benchmark_attention.py` (beside `scripts/` in a checkout; never installed). Levels:

- ``"attention"``: the attention module alone, its output projection replaced by the identity (the
  timing experiment of the Zformer_Pytorch reference code). That code feeds a tensor of shape
  (n, batch, d); we create it in that layout and transpose it to our (B, N, D) layout *before* the
  timed region (`.transpose(0, 1).contiguous()`), so every type pays the same.
- ``"module"``: the same with the whole module, output projection included, as a model's layer
  calls it (the forms that merge the projection into another product, fastformer's pooled output
  through W_o's bias and the folded forms, can only do so here).
- ``"model"``: a one-layer ``ZformerModel`` with the feed-forward shrunk away
  (``intermediate_size=1``): embeddings, LayerNorms, attention, output projection and residuals.
- ``"seq2seq"`` (`seq2seq_benchmark`): training tokens/s and greedy-generation sentences/s of our
  encoder-decoder against transformers' ``BartForConditionalGeneration`` of identical size, with
  nominal FLOP ratios (`seq2seq_flops`), at one source/target length or swept over lengths
  (source = target = n, each length side by side; a plot of the ratios against n).
- ``"causal"`` (`causal_benchmark`): training and greedy-generation tokens/s, cache size and nominal
  FLOP ratios of our decoder-only LM (full, zformer, fastformer) against ``GPT2LMHeadModel`` of
  identical size.
- ``"classification"`` (`classification_benchmark`): inference and training tokens/s of our
  ``ZformerForSequenceClassification`` (full, zformer, fastformer, optionally xformer; BERT's
  post-LayerNorm, embeddings and pooler around the attention) against transformers'
  ``BertForSequenceClassification`` of identical size over lengths, with nominal and executed FLOP
  ratios (`classification_flops`) and a plot of the ratios against n.

Types: ``full`` (our `FullAttention` through transformers' SDPA integration, i.e. PyTorch's fused
`scaled_dot_product_attention`), ``full_eager`` (our einsum reference), ``zformer``, ``xformer`` and
``fastformer``. Modes: ``forward`` (under `torch.inference_mode`) and ``train`` (forward+backward).

Every configuration reports the median wall time of several timed calls after warm-up, the peak
extra memory of one call, and the achieved FLOP/s as a fraction of the measured matrix-multiply
FLOP/s of the machine (see `attention_flops` for the counting), and the operations and bytes one
call dispatches, with the bytes per second as a fraction of the machine's measured copy bandwidth
(`traffic`). Nothing is hard-coded: every number comes from the run that writes it.

The package: `cases` (what is measured), `harness` (machine measurements, timing, memory, the
side-by-side runs), `flops` (FLOP accounting), `traffic` (operations and memory traffic),
`seq2seq` (the encoder-decoder level), `causal` (the decoder-only level), `generation` (pretrained
causal LMs decoding in lockstep, one process each, for time per token and resident memory),
`classification` (the sequence-classification level) and `reports` (CSV/JSON/markdown/plots). Every public name is importable from `benchmarks`,
except those of `cpu_speedups_ab`, a script: the paired A/B of the opt-in CPU speed-ups against an earlier commit's modeling code.
"""

from .cases import BASELINE, DEFAULT_TYPES, DTYPES, GRID_LEVELS, LEVELS, MODES, TYPES, BenchCase, BenchResult, build_module, make_config
from .causal import (
    CAUSAL_KINDS,
    CAUSAL_MODELS,
    CausalResult,
    CausalShape,
    build_causal,
    cache_bytes,
    causal_benchmark,
    causal_flops,
)
from .classification import (
    CLASSIFICATION_KINDS,
    CLASSIFICATION_MODELS,
    ClassificationResult,
    ClassificationShape,
    build_classifier,
    classification_benchmark,
    classification_flops,
)
from .flops import (
    attention_flops,
    case_flops,
    dense_flops,
    executed_attention_flops,
    folded,
    layer_flops,
    model_flops,
    module_flops,
    set_flops_fractions,
    step_flops,
    token_attention_flops,
)
from .generation import (CausalStepper, LockstepModels, context_ids, greedy_samples, load_causal_lm, memory_status,
                         reset_peak)
from .harness import (
    INTERRUPTED,
    TIMING_ENVIRONMENT,
    add_speedups,
    available_memory_bytes,
    interrupt_on_terminate,
    load_average,
    machine_info,
    measure_copy_bandwidth,
    measure_matmul_flops,
    paired_ratio_interval,
    peak_memory_bytes,
    run_cases,
    sweep,
    synchronize,
)
from .reports import (
    CSV_FIELDS,
    causal_markdown,
    classification_markdown,
    classification_plot,
    command_line,
    markdown_header,
    markdown_table,
    plot,
    ratio_plot,
    seq2seq_markdown,
    seq2seq_plot,
    seq2seq_sweep_markdown,
    write_causal_reports,
    write_classification_reports,
    write_csv,
    write_json,
    write_reports,
    write_seq2seq_reports,
)
from .traffic import TrafficCounter, count_traffic, set_bandwidth_fractions, tensor_bytes
from .seq2seq import (SEQ2SEQ_DEFAULT_MODELS, SEQ2SEQ_MODELS, Seq2SeqResult, Seq2SeqShape, build_seq2seq,
                      seq2seq_benchmark, seq2seq_flops)

__all__ = [
    "BASELINE", "CAUSAL_KINDS", "CAUSAL_MODELS", "CLASSIFICATION_KINDS", "CLASSIFICATION_MODELS", "CSV_FIELDS",
    "DEFAULT_TYPES", "DTYPES", "GRID_LEVELS", "INTERRUPTED", "LEVELS", "MODES", "SEQ2SEQ_DEFAULT_MODELS", "SEQ2SEQ_MODELS", "TIMING_ENVIRONMENT", "TYPES", "BenchCase",
    "BenchResult", "TrafficCounter", "count_traffic", "measure_copy_bandwidth", "set_bandwidth_fractions", "tensor_bytes",
    "CausalResult", "CausalShape", "CausalStepper", "LockstepModels", "context_ids", "greedy_samples", "load_causal_lm",
    "memory_status", "reset_peak", "ClassificationResult", "ClassificationShape", "Seq2SeqResult", "Seq2SeqShape",
    "add_speedups", "attention_flops", "available_memory_bytes", "build_causal", "build_classifier", "build_module",
    "build_seq2seq", "cache_bytes", "case_flops", "causal_benchmark", "causal_flops", "causal_markdown",
    "classification_benchmark", "classification_flops", "classification_markdown", "classification_plot",
    "command_line", "dense_flops", "executed_attention_flops", "folded", "interrupt_on_terminate", "layer_flops", "load_average",
    "machine_info", "make_config", "markdown_header", "markdown_table", "measure_matmul_flops", "model_flops", "module_flops",
    "paired_ratio_interval", "peak_memory_bytes", "plot", "ratio_plot", "run_cases", "seq2seq_benchmark",
    "seq2seq_flops", "seq2seq_markdown", "seq2seq_plot", "seq2seq_sweep_markdown", "set_flops_fractions", "step_flops", "sweep",
    "synchronize", "token_attention_flops", "write_causal_reports", "write_classification_reports", "write_csv",
    "write_json", "write_reports", "write_seq2seq_reports",
]
