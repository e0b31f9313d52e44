"""The sequence operations of the linear attention types, as pure functions of tensors, gathered
under one name (the attention classes, the scripts and the tests import them from here). Each
family lives in a module of its own with its naive references (loops over positions, written for
reading; the tests compare every fast form against them in fp64, forward and backward):

- `ops_linear_attention.py`: Zformer's `linear_attention`, the Hedgehog feature map
  (`hedgehog_features`, `normalize`, `normalized_attention_weights`) and the softmax window
  (`windowed_linear_attention`, `windowed_decode_step`);
- `ops_pooling.py`: Fastformer's `softmax_pool` (causal: prefix sums, or a quadratic form on short
  inputs) and `direction_pool` (per head, or shared rows along every head's direction);
- `ops_product.py`: Fastformer's column scaling W_r diag(k_g), `column_scaled`, and the product
  over it, `column_scaled_product`.

Softmax attention (full) runs through transformers' attention functions, with
`attention.einsum_attention_forward` as its reference.

**Backends.** Each operation has a torch form (every device and dtype, fp64 included) and, where
one exists, a fused Triton kernel, one module per family (`triton_linear_attention.py`,
`triton_pooling.py`, `triton_shared_pool.py`, `triton_prefix_pool.py`, `triton_product.py`, their
shared helpers in `triton_launch.py`), which runs on CUDA tensors in fp32/bf16 (fp16 for the
poolings) when triton is installed; causal linear attention over more than one token runs
flash-linear-attention's chunked kernel where `fla` is installed (`pip install hf_zformer[gpu]`).
Which form runs is the execution policy's choice (`policy.py`: one table by operation, device type,
dtype and width, with every threshold the forms read); each function asks it through a `*_path`
function (`linear_attention_path`, `softmax_pool_path`, `direction_pool_path`,
`column_scaled_path`, `column_scaled_product_path`) and `dispatch.kernel_applies`, which
`explain.py` asks too. The policy's backend, `auto` (the default: every fast form where it applies),
`torch` (plain torch everywhere: the reference to compare with) or `triton` (the kernels wherever
these apply, also on CPU tensors under `TRITON_INTERPRET=1`, as the tests run them), also governs
the device-specific fast forms outside these files: the GPU's stacked query/key/value product
(`blocks.project`), `blocks.Linear`'s transposed product for a few rows and the tied-embedding
gradient of `modeling_zformer.tied_lookups`; `HF_ZFORMER_KERNELS` (read at import),
`set_kernel_backend` or `use_kernel_backend` chooses it. A call a kernel does not cover (a state,
causal, fp64, an unsupported head width) takes the torch form; the reason is logged once at debug
level. Inside `torch.compile` the kernels run as operators the compiler calls without tracing into
them (each family's `OPERATORS`); fla's kernel runs in eager calls only.

This file ships to the Hugging Face Hub with every checkpoint: torch and siblings only.
"""

from .dispatch import interpreter_too_old  # noqa: F401
from .ops_linear_attention import (  # noqa: F401
    add_key_value_products,
    causal_form,
    causal_linear_attention,
    hedgehog_features,
    linear_attention,
    linear_attention_path,
    linear_attention_reference,
    normalize,
    normalized_attention_weights,
    quadratic_linear_attention,
    quadratic_order_pays_off,
    windowed_decode_step,
    windowed_linear_attention,
    with_ones,
)
from .ops_pooling import (  # noqa: F401
    causal_pool_form,
    causal_softmax_pool,
    direction_pool,
    direction_pool_path,
    direction_pool_reference,
    direction_scores,
    prefix_pool,
    shared_rows,
    softmax_pool,
    softmax_pool_path,
    softmax_pool_reference,
)
from .ops_product import (  # noqa: F401
    column_scaled,
    column_scaled_path,
    column_scaled_product,
    column_scaled_product_path,
)
from .policy import (  # noqa: F401  (the backend's controls are this module's public names too)
    KERNEL_BACKENDS,
    kernel_backend,
    set_kernel_backend,
    use_kernel_backend,
)
