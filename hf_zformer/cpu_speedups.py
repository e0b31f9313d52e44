"""Opt-in layer forms that make a model faster on some CPUs, kept out of the code a checkpoint ships
(``modeling/``, which builds plain ``nn.Linear`` and ``nn.Dropout`` layers).

``enable_cpu_speedups(model)`` changes, in place, the class of every plain ``nn.Linear`` and
``nn.Dropout`` inside ``model`` to a subclass with a faster forward; parameters, buffers and
state-dict keys stay as they are, so the model saves and loads as before, and
``disable_cpu_speedups(model)`` changes them back. Any model may take them (our models, BART, a
Llama): each layer computes what the plain one does.

- **Few-row projections** (``FewRowsLinear``): for 1 to ``few_rows()`` rows of fp32 on the CPU, with
  ``in_features <= out_features`` (``takes_transposed_form``), y = x W^T + b is computed as
  (W x^T + b)^T: the weight becomes the BLAS call's left operand and the few rows its narrow right
  one. On AMD EPYC CPUs torch's BLAS computes ``x @ W^T`` for 2-4 rows through a general matrix
  product path that streams the weight several times slower than ``W @ x^T``, and a single row
  takes a vector path about half as fast as the two-column product, so one row is sent as two (the
  row twice; the copy's column is dropped). Per output the same sum in another order (agreement to
  fp32 rounding). A decoding step of batch B sends B rows through every projection, so greedy
  generation at batch 1-4 gains most. It stays off for narrowing projections (the FFN's down
  projection), where it was slower at one thread, and on other CPUs, where the plain product is the
  fast one (``default_few_rows``: 4 on AMD CPUs, 0 elsewhere; the execution policy's ``few_rows``
  chooses otherwise, e.g. ``with use_policy(few_rows=0):``; ``scripts/benchmark_linear.py --form
  transposed`` checks a machine). The kernel backend
  ``torch`` (``ops.set_kernel_backend``) turns it off with the other fast forms, to compare.
- **Inactive dropouts skipped** (``SkippingDropout``): in eval mode or at p = 0 a dropout returns its
  input without a module call; a decoding step of a 6-layer decoder otherwise dispatches about 25
  identity dropouts. Hooks on a dropout then do not run while it is inactive.

The library's training, evaluation and benchmark scripts enable them on the models they build.
Measured in docs/benchmarks.md ("Generation and memory", "Opt-in CPU speed-ups").
"""

import contextlib
import platform

import torch
from torch import nn

from .modeling.policy import active


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel", ...; "" when the system does not say):
    from `cpuinfo` on Linux, else from `platform.processor()` (Windows names it there)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    processor = platform.processor()
    return next((vendor for vendor in ("AuthenticAMD", "GenuineIntel") if vendor in processor), "")


def default_few_rows(vendor: str) -> int:
    """The few-row rule's rows for a CPU vendor: 4 on AMD, where torch's BLAS multiplies 2-4 rows by a weight
    faster as `W x^T` than as `x W^T`; 0 (the rule off) elsewhere: on an Intel Xeon with AMX the
    plain product is the fast one (docs/benchmarks.md, "Generation and memory")."""
    return 4 if vendor == "AuthenticAMD" else 0


# this machine's few-row rule (`default_few_rows`), read once when the module loads
MACHINE_FEW_ROWS = default_few_rows(cpu_vendor())


def few_rows() -> int:
    """Inputs of at most this many rows (tokens x batch) take `FewRowsLinear`'s transposed product on
    the CPU (0: the rule off): the policy's `few_rows` where set, else this machine's default."""
    chosen = active().few_rows
    return MACHINE_FEW_ROWS if chosen is None else chosen


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as (W x^T + b)^T, a single row sent as two (see the module)."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features
    flat = x.reshape(rows, in_features)
    if rows == 1:
        flat = flat.expand(2, in_features).contiguous()
    columns = flat.t()  # (in, rows): a transposed view, the layout the fast path takes
    product = torch.mm(weight, columns) if bias is None else torch.addmm(bias[:, None], weight, columns)  # (out, rows)
    return product[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


def takes_transposed_form(in_features: int, out_features: int, rows: int) -> bool:
    """`FewRowsLinear`'s rule for fp32 inputs on the CPU: 1 to `few_rows()` rows, and no narrowing projection."""
    return 0 < rows <= few_rows() and in_features <= out_features


class FewRowsLinear(nn.Linear):
    """`nn.Linear` whose few-row fp32 products on the CPU take the transposed form (see the module)."""

    linear_product = True  # computes nn.Linear's product: the models' stacked and folded forms may read its weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.dim() > 0
            and x.shape[-1] == self.in_features
            and takes_transposed_form(self.in_features, self.out_features, x.numel() // self.in_features)
            and not torch.is_autocast_enabled("cpu")
            and active().backend != "torch"  # the plain product, to compare
        ):
            return transposed_linear(x, weight, bias)
        return nn.functional.linear(x, weight, bias)


class SkippingDropout(nn.Dropout):
    """`nn.Dropout` that, inactive (eval mode or p = 0), returns its input without a module call."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) if self.training and self.p > 0 else x


# plain class -> its faster subclass; `disable_cpu_speedups` reads it backwards
SPEEDUPS = {nn.Linear: FewRowsLinear, nn.Dropout: SkippingDropout}


def _swap_classes(model: nn.Module, classes: dict) -> list[nn.Module]:
    """Give each module of `model` whose class is a key of `classes` the class it maps to; returns them."""
    swapped = [module for module in model.modules() if type(module) in classes]
    for module in swapped:
        module.__class__ = classes[type(module)]
    return swapped


def enable_cpu_speedups(model: nn.Module) -> nn.Module:
    """Give every plain `nn.Linear` and `nn.Dropout` of `model` its faster form (see the module), in
    place; returns `model`. Subclasses of those (quantised or adapted layers) are left as they are."""
    _swap_classes(model, SPEEDUPS)
    return model


def disable_cpu_speedups(model: nn.Module) -> nn.Module:
    """Undo `enable_cpu_speedups`: the layers back to plain `nn.Linear` and `nn.Dropout`; returns `model`."""
    _swap_classes(model, {faster: plain for plain, faster in SPEEDUPS.items()})
    return model


@contextlib.contextmanager
def use_cpu_speedups(model: nn.Module):
    """`enable_cpu_speedups(model)` for the duration of a `with` block; the layers it changed are
    plain again afterwards."""
    swapped = _swap_classes(model, SPEEDUPS)
    try:
        yield model
    finally:
        for module in swapped:
            module.__class__ = type(module).__base__
