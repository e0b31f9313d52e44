"""Memory traffic of the attention benchmark: the bytes one call moves, counted operation by
operation as PyTorch dispatches them (`count_traffic`), and each case's fraction of the machine's
copy bandwidth (`set_bandwidth_fractions`; `harness.measure_copy_bandwidth`).

The count is a model of the traffic, not a hardware counter: every dispatched operation reads each
tensor it is given once and writes each tensor it returns once. Views and other operations that
return their input's memory move nothing; allocations move nothing; `zeros_like` and its kin read
no input; an operation that overwrites a tensor (`copy_`, `fill_`, `zero_`, an `out=` argument)
does not read it first. Caches are ignored
(a product's operands are counted once, as if tiles were never fetched twice), so the count is
about what a GPU's memory serves when every operation streams its operands from it. hf_zformer's
Triton kernels run as operators under the counter (`triton_launch.as_operators`) and count as one
operation each: their inputs and outputs, not what a kernel keeps in its own scratch. Kernels
launched outside PyTorch's dispatcher (flash-linear-attention's) are not seen.

Besides bytes, the counter keeps the number of operations: on a GPU each is at least one kernel
launch, the host work that bounds eager calls on short inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# operations that only allocate
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"})
# operations that read only their input's shape, dtype and device, and write a new tensor
LIKE_FACTORIES = frozenset({"new_full", "new_zeros", "new_ones", "zeros_like", "ones_like", "full_like", "rand_like",
                            "randn_like", "randint_like"})
# in-place operations that overwrite the tensor they write without reading it
OVERWRITES = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "resize_"})


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the elements `tensor` addresses: a broadcast dimension (stride 0) counts once, so an
    expanded bias counts its own size, not the size it is expanded to."""
    if tensor.numel() == 0:
        return 0
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int | None:
    """The identity of the memory `tensor` views (also of fake tensors, whose data pointers are 0)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensors without a storage (subclasses)
        return None


class TrafficCounter(TorchDispatchMode):
    """Within the block, counts `operations`, `bytes_read` and `bytes_written` of every operation
    dispatched, in this thread and in autograd's backward (see the module's docstring); `records`
    lists each counted operation as (name, bytes read, bytes written), in order."""

    def __init__(self):
        super().__init__()
        self.operations = self.bytes_read = self.bytes_written = 0
        self.records: list[tuple[str, int, int]] = []

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        return out

    def _count(self, func, args, kwargs, out):
        name = func.overloadpacket.__name__
        if name in ALLOCATIONS:
            return
        written, overwritten = self._written(func, args, kwargs)
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if not written:
            storages = {_storage(t) for t in inputs}
            if all(_storage(t) in storages for t in outputs):  # a view, or metadata: no data moves
                return
        read = 0 if name in LIKE_FACTORIES else sum(tensor_bytes(t) for t in inputs if id(t) not in overwritten)
        # what it returns, and what it writes in place without returning it (`_foreach_add_`)
        results = {id(t): t for t in [*outputs, *(t for t in inputs if id(t) in written)]}
        wrote = sum(tensor_bytes(t) for t in results.values())
        self.operations += 1
        self.bytes_read += read
        self.bytes_written += wrote
        self.records.append((str(func), read, wrote))

    @staticmethod
    def _written(func, args, kwargs) -> tuple[set[int], set[int]]:
        """ids of the arguments the operation writes, and of those it overwrites without reading."""
        written, overwritten = set(), set()
        overwrites = func.overloadpacket.__name__ in OVERWRITES
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name, args[index] if index < len(args) and not argument.kwarg_only else None)
            for tensor in _tensors(value):
                written.add(id(tensor))
                if overwrites or argument.name.startswith("out"):
                    overwritten.add(id(tensor))
        return written, overwritten


def count_traffic(step: Callable[[], None]) -> TrafficCounter:
    """One call of `step` under a `TrafficCounter`; returns the counter."""
    counter = TrafficCounter()
    with counter:
        step()
    return counter


def set_bandwidth_fractions(results: list, bytes_per_s: float):
    """bandwidth_fraction = the bytes a call moves (`TrafficCounter`) per second of its measured time
    / the machine's copy bandwidth."""
    for r in results:
        if r.status == "ok" and r.time_ms and r.bytes:
            r.bandwidth_fraction = r.bytes / (r.time_ms / 1e3) / bytes_per_s
