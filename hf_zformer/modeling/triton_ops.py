"""The fused Triton kernels under one name, for the scripts and tests that drive them all: each
family lives in a module of its own, with its launches, its autograd function and its operators
beside its kernels, and the helpers they share in `triton_launch.py`:

- `triton_linear_attention.py`: Zformer's bidirectional linear attention (`linear_attention_kernel`);
- `triton_pooling.py`: Fastformer's direction pooling (`direction_pool_kernel`);
- `triton_shared_pool.py`: the pooling of shared rows along every head's direction (`shared_pool_kernel`);
- `triton_prefix_pool.py`: the causal (prefix) pooling (`prefix_pool_kernel`);
- `triton_product.py`: the column scaling and the experimental scaled product (`column_scale_kernel`,
  `scaled_product_kernel`).

`OPERATORS` holds every family's operators. The model code imports the families themselves
(`ops.py`), not this module.
"""

import types

from .policy import INTERPRETED  # noqa: F401
from .triton_launch import (  # noqa: F401
    AVAILABLE,
    FLOOR,
    INTERPRETER_MINIMUM,
    RUNNABLE,
    SHARED_MEMORY_BY_CAPABILITY,
    VERSION,
    fused,
    operator_namespace,
    shared_memory_limit,
    supported_width,
)
from .triton_linear_attention import OPERATORS as LINEAR_ATTENTION_OPERATORS
from .triton_linear_attention import (  # noqa: F401
    LINEAR_ATTENTION_SHARED,
    linear_attention_fits,
    linear_attention_kernel,
    linear_attention_shared,
    outer_sum,
    state_product,
)
from .triton_pooling import OPERATORS as POOLING_OPERATORS
from .triton_pooling import direction_pool_kernel  # noqa: F401
from .triton_prefix_pool import OPERATORS as PREFIX_POOL_OPERATORS
from .triton_prefix_pool import PREFIX_POOL_SHARED, prefix_fits, prefix_pool_kernel, prefix_shared  # noqa: F401
from .triton_product import OPERATORS as PRODUCT_OPERATORS
from .triton_product import PRODUCT_SHARED, column_scale_kernel, product_fits, scaled_product_kernel  # noqa: F401
from .triton_shared_pool import OPERATORS as SHARED_POOL_OPERATORS
from .triton_shared_pool import SHARED_POOL_SHARED, shared_fits, shared_pool_kernel, shared_pool_shared  # noqa: F401

FAMILIES = (LINEAR_ATTENTION_OPERATORS, POOLING_OPERATORS, SHARED_POOL_OPERATORS, PREFIX_POOL_OPERATORS,
            PRODUCT_OPERATORS)
OPERATORS = (types.SimpleNamespace(**{name: op for family in FAMILIES for name, op in vars(family).items()})
             if AVAILABLE else None)
