"""The fused Triton kernels (`hf_zformer/modeling/triton_ops.py`) against the fp64 torch forms and
the naive references of `ops.py`: outputs and gradients, padded and unpadded, inputs laid out as the
attention classes hand them over (head views of the projections).

Without a GPU they run through triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on
a GPU machine the same tests run the compiled kernels on CUDA:

    python -m pytest tests/test_kernels.py
"""

import pytest
import torch

from hf_zformer.modeling import (
    dispatch,
    ops,
    ops_linear_attention,
    ops_pooling,
    ops_product,
    policy,
    triton_launch,
    triton_linear_attention,
    triton_ops,
    triton_pooling,
    triton_prefix_pool,
    triton_product,
    triton_shared_pool,
)
from hf_zformer.modeling.attention import FastformerAttention, ZformerAttention
from conftest import tiny_config

pytestmark = pytest.mark.skipif(not triton_ops.RUNNABLE, reason="triton is not installed" if not triton_ops.AVAILABLE
                                else ops.interpreter_too_old())

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _set_policy(monkeypatch, **changes):
    """The policy in force with `changes`, for the rest of the test."""
    monkeypatch.setattr(policy, "_active", policy.active().replaced(**changes))


@pytest.fixture(params=["fused", "split"])
def kernels(request, monkeypatch):
    """The kernel backend for the test (the previous choice restored after it), in both launch
    plans of linear attention: one program per (sequence, head), and sums split over slices of the
    sequence (the pooling's plan is the policy's `pool_chunk`: slices of 128 rows)."""
    _set_policy(monkeypatch, fused_min_pairs=0 if request.param == "fused" else 10**9)
    previous = ops.set_kernel_backend("triton")
    yield
    ops.set_kernel_backend(previous)


@pytest.fixture
def triton_backend():
    """The kernel backend for a test of a kernel with one launch plan: the poolings' slices are the
    policy's `pool_chunk` whatever its `fused_min_pairs` says (`kernels` would run each such test
    twice alike)."""
    previous = ops.set_kernel_backend("triton")
    yield
    ops.set_kernel_backend(previous)


def _heads(batch, length, heads, dim, generator, dtype=torch.float32, offset=0.0):
    """(B, H, N, d) as the classes pass it: a head view of a (B, N, H * d) projection (strided)."""
    x = torch.randn(batch, length, heads * dim, generator=generator) + offset
    return x.to(DEVICE, dtype).view(batch, length, heads, dim).transpose(1, 2).requires_grad_()


def _mask(batch, length, real):
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, count in enumerate(real):
        mask[row, :count] = 1
    return mask.to(DEVICE)


def _fp64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _grads(outputs, inputs, seed=5):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs.shape, generator=generator).to(outputs.device, outputs.dtype)
    return torch.autograd.grad((outputs * weight).sum(), inputs, allow_unused=True, retain_graph=True)


# ----------------------------------------------------------------------------------------------
# linear attention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("queries, keys, dim, width", [
    (150, 150, 16, 32),  # self-attention
    (37, 600, 16, 32),  # cross-attention, keys in two slices
    (70, 70, 20, 21),  # widths padded to tiles (a feature map's [v, 1] is d + 1 wide)
    (40, 40, 72, 65),  # 128 x 128 tiles: the fused plan's forward with the split backward
])
def test_linear_attention_kernel_matches_fp64(kernels, with_mask, with_scale, queries, keys, dim, width):
    generator = torch.Generator().manual_seed(0)
    batch, heads = 2, 2
    query = _heads(batch, queries, heads, dim, generator)
    key = _heads(batch, keys, heads, dim, generator)
    value = _heads(batch, keys, heads, width, generator)
    mask = _mask(batch, keys, [keys - 11, keys // 3]) if with_mask else None
    scale = torch.tensor([0.37], device=DEVICE, requires_grad=True) if with_scale else None
    out, state = ops.linear_attention(query, key, value, mask, scale=scale)
    assert state is None and out.dtype == torch.float32 and out.shape == (batch, heads, queries, width)

    ops.set_kernel_backend("torch")
    inputs64 = _fp64(query, key, value) + (_fp64(scale) if with_scale else [])
    expected, _ = ops.linear_attention(*inputs64[:3], mask, scale=inputs64[3] if with_scale else None)
    assert _relative(out, expected) < 1e-6
    inputs = [query, key, value] + ([scale] if with_scale else [])
    # the scale's gradient is one fp32 sum over every (sequence, head, d, e) product, with cancellation
    tolerances = [1e-6] * 3 + [2e-5]
    for got, want, tolerance in zip(_grads(out, inputs), _grads(expected, inputs64), tolerances):
        assert _relative(got, want) < tolerance
    if with_mask:  # padding's keys and values get no gradient
        grads = _grads(out, [key, value])
        assert all(g[~mask.bool()[:, None, :, None].expand_as(g)].abs().max() == 0 for g in grads)


def test_linear_attention_kernel_matches_the_naive_reference(kernels):
    generator = torch.Generator().manual_seed(1)
    query, key, value = (_heads(2, 9, 2, 16, generator) for _ in range(3))
    mask = _mask(2, 9, [9, 4])
    scale = torch.tensor([1.7], device=DEVICE)
    out, _ = ops.linear_attention(query, key, value, mask, scale=scale)
    expected, _ = ops.linear_attention_reference(*(t.detach().cpu().double() for t in (query, key, value)),
                                                 mask.cpu(), scale=scale.cpu().double())
    assert _relative(out.cpu(), expected) < 1e-6


def test_linear_attention_kernel_in_bf16_stays_close(kernels):
    generator = torch.Generator().manual_seed(2)
    query, key, value = (_heads(2, 700, 4, 64, generator, torch.bfloat16, offset=1.0) for _ in range(3))
    mask = _mask(2, 700, [700, 333])
    out, _ = ops.linear_attention(query, key, value, mask)
    assert out.dtype == torch.bfloat16  # the caller casts to the projections' dtype anyway
    inputs64 = _fp64(query, key, value)
    expected, _ = ops.linear_attention(*inputs64, mask)  # fp64: the torch form
    assert _relative(out, expected) < 1e-2
    for got, want in zip(_grads(out, [query, key, value]), _grads(expected, inputs64)):
        assert _relative(got, want) < 2e-2


def test_linear_attention_kernel_extra_padding_changes_nothing(kernels):
    """Appended padding (here across a slice boundary) leaves real positions bit for bit the same."""
    generator = torch.Generator().manual_seed(3)
    query, key, value = (_heads(2, 600, 2, 16, generator) for _ in range(3))
    mask = _mask(2, 600, [600, 450])
    out, _ = ops.linear_attention(query, key, value, mask)
    padded = [torch.nn.functional.pad(t.detach(), (0, 0, 0, 500)) for t in (query, key, value)]
    wide, _ = ops.linear_attention(*padded, torch.nn.functional.pad(mask, (0, 500)))
    assert torch.equal(wide[:, :, :600], out.detach())


def test_linear_attention_kernel_in_16_row_tiles(kernels, monkeypatch):
    """The tiles fp32 inputs take on CUDA (`triton_linear_attention._linear_rows`; the interpreter keeps 64 rows
    otherwise): the same results against fp64, gradients included, and padding changes nothing."""
    rows = []
    monkeypatch.setattr(triton_linear_attention, "_linear_rows", lambda exact: rows.append(exact) or 16)
    test_linear_attention_kernel_matches_fp64(kernels, True, True, 150, 150, 16, 32)
    ops.set_kernel_backend("triton")
    test_linear_attention_kernel_extra_padding_changes_nothing(kernels)
    assert rows and all(rows)  # fp32 inputs: exact products


# ----------------------------------------------------------------------------------------------
# direction pooling
# ----------------------------------------------------------------------------------------------


def _assert_pool_matches_fp64(pooled, values, direction, mask, pool):
    """The kernel's pooling and gradients against `pool` (values, direction, mask) of the torch forms in
    fp64; with a mask, the third row is all padding and pools to zero."""
    ops.set_kernel_backend("torch")
    inputs = [values] + ([direction] if direction is not None else [])
    inputs64 = _fp64(*inputs)
    expected = pool(inputs64[0], inputs64[1] if direction is not None else None, mask)
    assert _relative(pooled, expected) < 1e-6
    if mask is not None:
        assert pooled[2].abs().max() == 0
    for got, want in zip(_grads(pooled, inputs), _grads(expected, inputs64)):
        assert torch.isfinite(got).all()
        assert _relative(got, want) < 1e-5


def _pool_inputs(batch, heads, length, dim, direction_rows, generator):
    """Values (B, H, N, d) as head views and a direction (direction_rows, H, d), or None (the mean)."""
    values = _heads(batch, length, heads, dim, generator)
    if direction_rows is None:
        return values, None
    return values, torch.randn(direction_rows, heads, dim, generator=generator).to(DEVICE).requires_grad_()


@pytest.mark.parametrize("direction_rows", [None, 1, 3])  # the mean, one direction per head, per sequence
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("dim", [32, 24])
def test_direction_pool_kernel_matches_fp64(triton_backend, direction_rows, with_mask, dim):
    batch, heads, length = 3, 2, 700
    values, direction = _pool_inputs(batch, heads, length, dim, direction_rows, torch.Generator().manual_seed(4))
    mask = _mask(batch, length, [length, 100, 0]) if with_mask else None  # an all-padding row
    pooled = ops.direction_pool(values, direction, mask)
    assert pooled.shape == (batch, heads, 1, dim) and pooled.dtype == torch.float32

    _assert_pool_matches_fp64(pooled, values, direction, mask, ops.direction_pool)


@pytest.mark.parametrize("direction_rows", [1, 3])
def test_direction_pool_kernel_applies_the_score_scale(triton_backend, direction_rows):
    """A scale multiplies the scores inside the kernel: the pooling and the gradients (the
    direction's included) of the scaled direction's, against the fp64 torch forms."""
    generator = torch.Generator().manual_seed(8)
    values = _heads(3, 300, 2, 24, generator)
    direction = torch.randn(direction_rows, 2, 24, generator=generator).to(DEVICE).requires_grad_()
    mask = _mask(3, 300, [300, 100, 0])
    pooled = ops.direction_pool(values, direction, mask, 0.2)
    unscaled = ops.direction_pool(values, direction, mask)
    assert _relative(pooled, unscaled) > 1e-3  # the scale changes the pooling
    _assert_pool_matches_fp64(pooled, values, direction, mask, lambda v, u, m: ops.direction_pool(v, u, m, 0.2))
    reference = ops.direction_pool_reference(values.detach().cpu().double(), direction.detach().cpu().double() * 0.2,
                                             mask.cpu())
    assert _relative(pooled.detach().cpu(), reference) < 1e-6


@pytest.mark.parametrize("direction_rows", [None, 1, 3])
@pytest.mark.parametrize("length", [100, 700])  # one slice of the policy's `pool_chunk`; several, merged
def test_direction_pool_kernel_pools_gated_rows(triton_backend, direction_rows, length):
    """A gate g (B, H, d): the pooling of the rows g * x_j, the gate applied inside the kernel, against
    the naive reference over the gated rows formed in fp64, and its gradients (the gate's and the
    direction's included) against the fp64 torch forms; a row of padding pools to zero."""
    generator = torch.Generator().manual_seed(12)
    batch, heads, dim = 3, 2, 24
    values, direction = _pool_inputs(batch, heads, length, dim, direction_rows, generator)
    gate = torch.randn(batch, heads, dim, generator=generator).to(DEVICE).requires_grad_()
    mask = _mask(batch, length, [length, length // 3, 0])
    pooled = ops.direction_pool(values, direction, mask, 0.3, gate)
    assert pooled.shape == (batch, heads, 1, dim) and pooled.dtype == torch.float32
    assert pooled[2].abs().max() == 0
    inputs = [values, gate] + ([direction] if direction is not None else [])
    inputs64 = _fp64(*inputs)
    reference = ops.direction_pool_reference(inputs64[0], inputs64[2] if direction is not None else None, mask, 0.3,
                                             inputs64[1])
    assert _relative(pooled, reference) < 1e-6
    ops.set_kernel_backend("torch")
    expected = ops.direction_pool(inputs64[0], inputs64[2] if direction is not None else None, mask, 0.3, inputs64[1])
    assert _relative(expected, reference) < 1e-12  # the torch forms' two products
    for got, want in zip(_grads(pooled, inputs), _grads(expected, inputs64), strict=True):
        assert torch.isfinite(got).all()
        assert _relative(got, want) < 1e-5


@pytest.mark.parametrize("direction_rows", [None, 1, 5])
def test_direction_pool_gate_gradients_walk_the_batch_in_tiles(triton_backend, monkeypatch, direction_rows):
    """The gate's and direction's gradients (`_gate_grads`) with the batch of 5 walked 2 sequences per
    tile (the last one partial), over several slices: the fp64 torch forms' gradients."""
    monkeypatch.setattr(triton_pooling, "GATE_TILE", 64)
    batch, heads, length, dim = 5, 2, 300, 24
    assert triton_pooling._gate_batch_rows(batch, dim) == 2
    generator = torch.Generator().manual_seed(16)
    values, direction = _pool_inputs(batch, heads, length, dim, direction_rows, generator)
    gate = torch.randn(batch, heads, dim, generator=generator).to(DEVICE).requires_grad_()
    mask = _mask(batch, length, [length, 200, 0, 130, 7])
    pooled = ops.direction_pool(values, direction, mask, 0.4, gate)
    inputs = [values, gate] + ([direction] if direction is not None else [])
    inputs64 = _fp64(*inputs)
    ops.set_kernel_backend("torch")
    expected = ops.direction_pool(inputs64[0], inputs64[2] if direction is not None else None, mask, 0.4, inputs64[1])
    assert _relative(pooled, expected) < 1e-6
    for got, want in zip(_grads(pooled, inputs), _grads(expected, inputs64), strict=True):
        assert _relative(got, want) < 1e-5


@pytest.mark.parametrize("with_direction", [False, True])
def test_direction_pool_gates_rows_shared_by_the_heads(triton_backend, with_direction):
    """Shared rows (B, 1, N, D) with a gate per head (B, H, D): each head pools gate_h * x_j, as the
    naive reference over the formed gated rows does (its own gradients included)."""
    generator = torch.Generator().manual_seed(15)
    batch, heads, length, dim = 2, 3, 90, 16
    values = _shared_rows(batch, length, dim, generator)[:, None]
    direction = torch.randn(1, heads, dim, generator=generator).to(DEVICE).requires_grad_() if with_direction else None
    gate = torch.randn(batch, heads, dim, generator=generator).to(DEVICE).requires_grad_()
    mask = _mask(batch, length, [length, 40])
    pooled = ops.direction_pool(values, direction, mask, 0.5, gate)
    assert pooled.shape == (batch, heads, 1, dim)
    inputs = [values, gate] + ([direction] if with_direction else [])
    inputs64 = _fp64(*inputs)
    expected = ops.direction_pool_reference(inputs64[0], inputs64[2] if with_direction else None, mask, 0.5,
                                            inputs64[1])
    assert _relative(pooled, expected) < 1e-6
    for got, want in zip(_grads(pooled, inputs), _grads(expected, inputs64), strict=True):
        assert _relative(got, want) < 1e-5


def test_direction_pool_kernel_matches_the_naive_reference(triton_backend):
    generator = torch.Generator().manual_seed(6)
    values = _heads(2, 11, 2, 16, generator)
    direction = torch.randn(2, 2, 16, generator=generator).to(DEVICE)
    mask = _mask(2, 11, [11, 5])
    pooled = ops.direction_pool(values, direction, mask)
    expected = ops.direction_pool_reference(values.detach().cpu().double(), direction.cpu().double(), mask.cpu())
    assert _relative(pooled.cpu(), expected) < 1e-6


def test_direction_pool_kernel_one_slice_and_many_agree_bit_for_bit(triton_backend):
    """100 real rows (one slice of `pool_chunk`) padded to 600 (five slices, merged): the same
    pooling and the same gradients at the real rows, exactly."""
    generator = torch.Generator().manual_seed(8)
    values = _heads(2, 100, 2, 16, generator)
    direction = torch.randn(1, 2, 16, generator=generator).to(DEVICE).requires_grad_()
    mask = _mask(2, 100, [100, 70])
    padded = torch.nn.functional.pad(values.detach(), (0, 0, 0, 500)).requires_grad_()
    short = ops.direction_pool(values, direction, mask)
    wide = ops.direction_pool(padded, direction, torch.nn.functional.pad(mask, (0, 500)))
    assert torch.equal(wide, short)
    wide_values, wide_direction = _grads(wide, [padded, direction])
    short_values, short_direction = _grads(short, [values, direction])
    assert torch.equal(wide_values[:, :, :100], short_values) and torch.equal(wide_direction, short_direction)


def test_pool_chunk_must_be_whole_tiles(triton_backend, monkeypatch):
    _set_policy(monkeypatch, pool_chunk=100)
    values = _heads(1, 300, 1, 16, torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="pool_chunk=100"):
        ops.direction_pool(values)


@pytest.mark.parametrize("chunk", [None, 128])  # rows per program (`pool_chunk`); None: the pairs' rule
def test_direction_pool_kernel_extra_padding_changes_nothing(kernels, monkeypatch, chunk):
    _set_policy(monkeypatch, pool_chunk=chunk)
    generator = torch.Generator().manual_seed(7)
    values = _heads(2, 600, 2, 16, generator)
    direction = torch.randn(1, 2, 16, generator=generator).to(DEVICE)
    mask = _mask(2, 600, [600, 450])
    pooled = ops.direction_pool(values, direction, mask)
    wide = ops.direction_pool(torch.nn.functional.pad(values.detach(), (0, 0, 0, 500)), direction,
                              torch.nn.functional.pad(mask, (0, 500)))
    assert torch.equal(wide, pooled.detach())


def _shared_rows(batch, length, dim, generator, dtype=torch.float32):
    """(B, 1, N, D) rows shared by every direction, a strided view (the layer input's first D columns)."""
    x = torch.randn(batch, length, dim + 8, generator=generator).to(DEVICE, dtype)[:, :, :dim]
    return x.detach().requires_grad_()


class _Launches:
    """Stands in for a triton kernel and counts its launches (`kernel[grid](...)`)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.parametrize("direction_rows", [None, 1, 3])  # the mean, one direction per head, per sequence
@pytest.mark.parametrize("with_mask", [False, True])
# dim 40: padded to a 64-wide tile; 8 heads: no padded head in the paired tile; 12: u and g in two tiles
@pytest.mark.parametrize("dim,heads", [(64, 5), (40, 5), (32, 8), (64, 12)])
def test_shared_pool_kernel_matches_fp64(triton_backend, monkeypatch, direction_rows, with_mask, dim, heads):
    """Fastformer's folded poolings: one sequence's rows pooled along every head's direction
    (`shared_pool_kernel`), 300 rows in three slices, against the torch form in fp64. Up to 8
    heads the backward pairs each direction with its gradient in one tile, beyond that not."""
    paired = _Launches(triton_shared_pool._shared_pool_backward_paired)
    monkeypatch.setattr(triton_shared_pool, "_shared_pool_backward_paired", paired)
    generator = torch.Generator().manual_seed(10)
    batch, length = 3, 300
    values = _shared_rows(batch, length, dim, generator)
    direction = None
    if direction_rows is not None:
        direction = (torch.randn(direction_rows, heads, dim, generator=generator) * 0.3).to(DEVICE).requires_grad_()
    mask = _mask(batch, length, [length, 70, 0]) if with_mask else None  # an all-padding row
    pooled = ops.direction_pool(values[:, None], direction, mask)
    assert pooled.shape == (batch, 1 if direction is None else heads, 1, dim) and pooled.dtype == torch.float32

    _assert_pool_matches_fp64(pooled, values, direction, mask, lambda v, *rest: ops.direction_pool(v[:, None], *rest))
    assert paired.count == (direction is not None and heads <= 8)


def test_shared_pool_kernel_matches_the_naive_reference_and_per_head_pooling(triton_backend):
    """The same pooling as the per-head kernel over the rows repeated for every head, and as the
    naive reference."""
    generator = torch.Generator().manual_seed(11)
    values = _shared_rows(2, 30, 16, generator)
    direction = torch.randn(2, 3, 16, generator=generator).to(DEVICE)
    mask = _mask(2, 30, [30, 9])
    pooled = ops.direction_pool(values[:, None], direction, mask)
    repeated = ops.direction_pool(values[:, None].expand(-1, 3, -1, -1), direction, mask)
    assert _relative(pooled, repeated) < 1e-6
    expected = ops.direction_pool_reference(values[:, None].detach().cpu().double(), direction.cpu().double(),
                                            mask.cpu())
    assert _relative(pooled.cpu(), expected) < 1e-6


def test_shared_pool_kernel_in_bf16_stays_close(triton_backend):
    generator = torch.Generator().manual_seed(12)
    values = _shared_rows(2, 200, 64, generator, dtype=torch.bfloat16)
    direction = (torch.randn(1, 4, 64, generator=generator) * 0.3).to(DEVICE)
    pooled = ops.direction_pool(values[:, None], direction, _mask(2, 200, [200, 120]))
    ops.set_kernel_backend("torch")
    expected = ops.direction_pool(values[:, None].detach().double(), direction.double(), _mask(2, 200, [200, 120]))
    assert pooled.dtype == torch.float32 and _relative(pooled, expected) < 2e-3  # tf32 products on CUDA


def test_shared_pool_kernel_extra_padding_changes_nothing(triton_backend):
    """100 real rows (one slice) padded to 600 (five, merged): the same pooling and gradients, exactly."""
    generator = torch.Generator().manual_seed(13)
    values = _shared_rows(2, 100, 32, generator)
    direction = torch.randn(2, 3, 32, generator=generator).to(DEVICE).requires_grad_()
    mask = _mask(2, 100, [100, 70])
    padded = torch.nn.functional.pad(values.detach(), (0, 0, 0, 500)).requires_grad_()
    short = ops.direction_pool(values[:, None], direction, mask)
    wide = ops.direction_pool(padded[:, None], direction, torch.nn.functional.pad(mask, (0, 500)))
    assert torch.equal(wide, short)
    wide_values, wide_direction = _grads(wide, [padded, direction])
    short_values, short_direction = _grads(short, [values, direction])
    assert torch.equal(wide_values[:, :100], short_values) and torch.equal(wide_direction, short_direction)
    assert wide_values[:, 100:].abs().max() == 0


def test_shared_rows_are_the_low_precision_copy_only_where_the_kernel_reads_them(triton_backend):
    """Fastformer's folded form pools its input: the bf16 copy where the kernel reads it (half the
    bytes), the fp32 input where the torch form sums it (no fp32 copy of the bf16 one)."""
    full = torch.randn(2, 30, 512).to(DEVICE)
    low = full.bfloat16()
    assert ops.shared_rows(full, low, 16) is low
    assert ops.shared_rows(full, low, 32) is full  # (32, 512) tiles: too large for the kernel
    assert ops.shared_rows(full, full, 16) is full
    ops.set_kernel_backend("torch")
    assert ops.shared_rows(full, low, 16) is full


def test_folded_fastformer_under_autocast_gives_the_torch_forms_results(triton_backend):
    """Under bf16 autocast the folded form's poolings through the kernel (reading the bf16 copy)
    against the torch form's (reading the fp32 input): outputs within bf16's rounding."""
    config = tiny_config(attention_type="fastformer", hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    module = FastformerAttention(config).to(DEVICE)
    torch.nn.init.normal_(module.query_score)
    torch.nn.init.normal_(module.key_score)
    module.folded_autocast_devices = (DEVICE.type,)
    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # B N >= 2 D: W_o folded in
    mask = _mask(3, 50, [50, 17, 1])
    outputs = []
    for backend in ("triton", "torch"):
        ops.set_kernel_backend(backend)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            outputs.append(module(x, mask)[0].float())
    real = mask.bool()
    assert _relative(outputs[0][real], outputs[1][real]) < 1e-2


def test_shared_pool_kernel_takes_tiles_up_to_8192_elements(triton_backend, monkeypatch):
    """(heads, width) tiles padded to powers of two: 16 heads at width 512, 32 at 256; wider ones
    (whose backward outgrows an H200's shared memory) take the torch form."""
    calls = []
    original = ops_pooling.shared_pool_kernel
    monkeypatch.setattr(ops_pooling, "shared_pool_kernel",
                        lambda *a, **k: calls.append((a[1].shape[1], a[0].shape[-1])) or original(*a, **k))
    generator = torch.Generator().manual_seed(14)
    for heads, dim in ((16, 512), (17, 512), (2, 513), (16, 1024), (32, 256)):
        values = torch.randn(1, 20, dim, generator=generator).to(DEVICE)
        ops.direction_pool(values[:, None], torch.randn(1, heads, dim, generator=generator).to(DEVICE) * 0.03)
    assert calls == [(16, 512), (32, 256)]


@pytest.mark.parametrize("limit,admitted", [
    (None, {"linear 64x64", "linear 128x65", "linear 192x97", "shared 16x512", "shared 8x256", "prefix 128",
            "prefix 256", "product"}),
    (232_448, {"linear 64x64", "linear 128x65", "linear 192x97", "shared 16x512", "shared 8x256", "prefix 128",
               "prefix 256", "product"}),
    (166_912, {"linear 64x64", "linear 128x65", "shared 16x512", "shared 8x256", "prefix 128", "prefix 256",
               "product"}),
    (101_376, {"linear 64x64", "shared 8x256", "prefix 128", "prefix 256"}),
    (40_000, {"prefix 128", "prefix 256"}),  # 16-row tiles at 256 (`triton_prefix_pool._prefix_rows`)
    (30_000, set()),
])
def test_kernels_run_only_where_their_shared_memory_fits_the_gpu(triton_backend, monkeypatch, limit, admitted):
    """Each kernel family's shared memory, bounded by its tile (`triton_ops.*_SHARED`), against the
    GPU's limit: H100/H200 (232,448 bytes), A100 (166,912), RTX 40xx / L4 (101,376); beyond it, or
    past the largest tile a family has a bound for, the torch form runs."""
    monkeypatch.setattr(dispatch, "shared_memory_limit", lambda device: limit)
    ran = []
    for module, name in ((ops_linear_attention, "linear_attention_kernel"), (ops_pooling, "shared_pool_kernel"),
                         (ops_pooling, "prefix_pool_kernel"), (ops_product, "scaled_product_kernel")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _name=name, _original=original, **k: ran.append(_name) or _original(*a, **k))

    def admits(label, call):
        ran.clear()
        call()
        return label if ran else None

    found = set()
    for dk, dv in ((64, 64), (128, 65), (192, 97), (256, 129)):
        q, k = (torch.randn(1, 1, 3, dk).to(DEVICE) for _ in range(2))
        v = torch.randn(1, 1, 3, dv).to(DEVICE)
        found.add(admits(f"linear {dk}x{dv}", lambda: ops.linear_attention(q, k, v)))
    for heads, dim in ((16, 512), (8, 256)):
        values = torch.randn(1, 3, dim).to(DEVICE).bfloat16()
        found.add(admits(f"shared {heads}x{dim}",
                         lambda: ops.direction_pool(values[:, None], torch.randn(1, heads, dim).to(DEVICE))))
    for width in (128, 256):
        values = torch.randn(1, 1, 3, width).to(DEVICE)
        found.add(admits(f"prefix {width}", lambda: ops.softmax_pool(values[..., :1], values, causal=True)))
    _, operands = _product_operands(1, 3, 8, 8, torch.float32)
    found.add(admits("product", lambda: ops.column_scaled_product(*operands)))  # fixed tiles, whatever the widths
    assert found - {None} == admitted


def test_shared_memory_limit_asks_triton_then_the_compute_capability(monkeypatch):
    """A CUDA device's limit comes from triton's device query, once per device; where the driver
    cannot say, from the compute capability's table (the smallest known for an unknown one)."""
    from types import SimpleNamespace

    driver = triton_launch.triton.runtime.driver
    previous = getattr(driver, "_active", None)
    asked = []

    def properties(index):
        asked.append(index)
        if index != 0:
            raise RuntimeError("no such query")
        return {"max_shared_mem": 232_448}

    monkeypatch.setattr(triton_launch, "INTERPRETED", False)
    monkeypatch.setattr(triton_launch, "_shared_memory", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {1: (8, 0), 2: (7, 5)}[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    driver.set_active(SimpleNamespace(utils=SimpleNamespace(get_device_properties=properties)))
    try:
        assert triton_ops.shared_memory_limit(torch.device("cuda")) == 232_448  # the current device, 0
        assert triton_ops.shared_memory_limit(torch.device("cuda")) == 232_448 and asked == [0]  # kept
        assert triton_ops.shared_memory_limit(torch.device("cuda", 1)) == 166_912  # an A100's, by its capability
        assert triton_ops.shared_memory_limit(torch.device("cuda", 2)) == 101_376  # unknown: the smallest
        assert triton_ops.shared_memory_limit(torch.device("cpu")) is None
    finally:
        driver._active = previous


def test_auto_backend_leaves_fp32_shared_rows_to_the_torch_form(monkeypatch):
    """Under `auto`, fp32 rows (the fp32 folded form) pool through the torch form's products, 16-bit
    rows through the kernel (on CUDA): the kernel's fp32 products would run exactly, off the tensor
    cores. Checked through the dispatch rule on the device's tensors."""
    previous = ops.set_kernel_backend("auto")
    try:
        monkeypatch.setattr(ops_pooling, "kernel_applies", lambda *args, **kwargs: True)
        rows = torch.randn(2, 30, 64)
        assert not ops_pooling._shared_kernel_applies(rows, 8)
        assert ops_pooling._shared_kernel_applies(rows.bfloat16(), 8)
    finally:
        ops.set_kernel_backend(previous)


# ----------------------------------------------------------------------------------------------
# causal (prefix) softmax pooling
# ----------------------------------------------------------------------------------------------


def _causal_pool_inputs(batch, heads, length, dim, seed, spread=3.0):
    generator = torch.Generator().manual_seed(seed)
    values = _heads(batch, length, heads, dim, generator)
    scores = (torch.randn(batch, heads, length, 1, generator=generator) * spread).to(DEVICE).requires_grad_()
    return scores, values


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("dim", [16, 24, 200])
def test_prefix_pool_kernel_matches_fp64(triton_backend, with_mask, dim):
    """Several tiles and a partial one; with the mask: left padding, a gap inside, an all-padding row.
    Heads 200 wide (256-wide tiles) take the shorter tiles of `triton_prefix_pool._prefix_rows`."""
    batch, heads, length = 3, 2, 150
    scores, values = _causal_pool_inputs(batch, heads, length, dim, seed=11)
    mask = None
    if with_mask:
        mask = _mask(batch, length, [length, 120, 0])
        mask[1, :9] = 0  # left padding: positions before the first real token pool to zero
        mask[1, 70:80] = 0
    pooled, _ = ops.softmax_pool(scores, values, mask, causal=True)
    assert pooled.shape == (batch, heads, length, dim) and pooled.dtype == torch.float32

    ops.set_kernel_backend("torch")
    scores64, values64 = _fp64(scores, values)
    expected, _ = ops.softmax_pool(scores64, values64, mask, causal=True)
    assert _relative(pooled, expected) < 1e-6
    if with_mask:
        assert pooled[2].abs().max() == 0 and pooled[1, :, :9].abs().max() == 0
    for got, want in zip(_grads(pooled, [scores, values]), _grads(expected, [scores64, values64])):
        assert torch.isfinite(got).all()
        assert _relative(got, want) < 1e-5


def test_prefix_pool_kernel_matches_the_naive_reference(triton_backend):
    scores, values = _causal_pool_inputs(2, 2, 70, 16, seed=12)
    mask = _mask(2, 70, [70, 33])
    pooled, _ = ops.softmax_pool(scores, values, mask, causal=True)
    expected, _ = ops.softmax_pool_reference(scores.detach().cpu().double(), values.detach().cpu().double(),
                                             mask.cpu(), causal=True)
    assert _relative(pooled.cpu(), expected) < 1e-6


def test_prefix_pool_kernel_keeps_large_score_ranges_finite(triton_backend):
    """Scores spread over hundreds of units (exp would overflow fp32 without the running maximum)."""
    scores, values = _causal_pool_inputs(1, 2, 200, 16, seed=13, spread=300.0)
    pooled, _ = ops.softmax_pool(scores, values, None, causal=True)
    ops.set_kernel_backend("torch")
    expected = ops.causal_softmax_pool(*_fp64(scores, values), None)  # each row with its own max
    # fp32 rounding of scores in the hundreds: exp(s - lse) is good to |s| x 6e-8
    assert torch.isfinite(pooled).all() and _relative(pooled, expected) < 1e-4
    for grad in _grads(pooled, [scores, values]):
        assert torch.isfinite(grad).all()


def test_prefix_pool_kernel_extra_padding_changes_nothing(triton_backend):
    scores, values = _causal_pool_inputs(2, 2, 130, 16, seed=14)
    mask = _mask(2, 130, [130, 90])
    pooled, _ = ops.softmax_pool(scores, values, mask, causal=True)
    pad = torch.nn.functional.pad
    wide, _ = ops.softmax_pool(pad(scores.detach(), (0, 0, 0, 70)), pad(values.detach(), (0, 0, 0, 70)),
                               pad(mask, (0, 70)), causal=True)
    assert torch.equal(wide[:, :, :130], pooled.detach())


def test_prefix_pool_kernel_state_continues_as_the_torch_forms(triton_backend):
    """A prefill's state (log-sum-exp, pooling) from the kernel, then decoding steps in the torch
    form: the same outputs as the torch form throughout, a row of padding only included."""
    scores, values = _causal_pool_inputs(2, 2, 90, 16, seed=15)
    mask = _mask(2, 90, [90, 0])
    with torch.no_grad():
        pooled, state = ops.softmax_pool(scores, values, mask, causal=True, return_state=True)
        previous = ops.set_kernel_backend("torch")
        expected, expected_state = ops.softmax_pool(scores, values, mask, causal=True, return_state=True)
        assert _relative(pooled, expected) < 1e-6
        torch.testing.assert_close(state[0], expected_state[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(state[1], expected_state[1], rtol=1e-5, atol=1e-6)
        step_scores, step_values = _causal_pool_inputs(2, 2, 1, 16, seed=16)
        step = ops.softmax_pool(step_scores, step_values, None, state, causal=True)[0]
        want = ops.softmax_pool(step_scores, step_values, None, expected_state, causal=True)[0]
        ops.set_kernel_backend(previous)
    torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the attention classes through the seam, and the dispatch rules
# ----------------------------------------------------------------------------------------------


def _assert_backends_agree(module, x, mask):
    """The module's outputs at real positions and its parameter gradients under the kernel backend
    equal the torch forms'."""
    results = {}
    for backend in ("torch", "triton"):
        previous = ops.set_kernel_backend(backend)
        try:
            module.zero_grad()
            out, _ = module(x, mask)
            out.backward(torch.ones_like(out))
            results[backend] = (out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()})
        finally:
            ops.set_kernel_backend(previous)
    (torch_out, torch_grads), (kernel_out, kernel_grads) = results["torch"], results["triton"]
    real = mask.bool()
    assert _relative(kernel_out[real], torch_out[real]) < 1e-5
    for name, grad in torch_grads.items():
        assert _relative(kernel_grads[name], grad) < 1e-4, name


@pytest.mark.parametrize("attention, options", [
    ("zformer", {}),
    ("zformer", {"zformer_feature_map": "hedgehog"}),
    ("fastformer", {}),
    ("fastformer", {"fastformer_share_qv": True}),
    ("fastformer", {"fastformer_pooling": "mean"}),
])
def test_attention_modules_give_the_torch_forms_results(attention, options):
    """A module under autocast-free fp32 with padding: the kernel backend's outputs and parameter
    gradients equal the torch forms' (the plain forms: inputs shorter than the width)."""
    config = tiny_config(attention_type=attention, hidden_size=64, num_attention_heads=4, **options)
    torch.manual_seed(0)
    module = (ZformerAttention if attention == "zformer" else FastformerAttention)(config).to(DEVICE)
    if attention == "fastformer" and module.additive:
        torch.nn.init.normal_(module.query_score)
        torch.nn.init.normal_(module.key_score)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = _mask(3, 40, [40, 17, 1])
    _assert_backends_agree(module, x, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention's kernels need CUDA")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_causal_linear_attention_through_fla_matches_fp64(kernels, dtype, tolerance):
    pytest.importorskip("fla")
    generator = torch.Generator().manual_seed(9)
    query, key, value = (_heads(2, 700, 4, 64, generator, dtype) for _ in range(3))
    mask = _mask(2, 700, [700, 500])
    scale = torch.tensor([0.05], device=DEVICE, requires_grad=True)
    state = torch.randn(2, 4, 64, 64, generator=generator).to(DEVICE)
    out, final = ops.linear_attention(query, key, value, mask, state, causal=True, scale=scale, return_state=True)
    inputs = [query, key, value, scale]
    ops.set_kernel_backend("torch")
    inputs64 = _fp64(*inputs)
    expected, expected_final = ops.linear_attention(*inputs64[:3], mask, state.double(), causal=True,
                                                    scale=inputs64[3], return_state=True)
    assert _relative(out, expected) < tolerance and _relative(final, expected_final) < tolerance
    for got, want in zip(_grads(out, inputs), _grads(expected, inputs64)):
        assert _relative(got, want) < tolerance


def test_causal_fastformer_module_gives_the_torch_forms_results():
    """Causal Fastformer attention over three tiles with padding: outputs and parameter gradients
    through the prefix-pooling kernel equal the torch forms'."""
    config = tiny_config(attention_type="fastformer", hidden_size=64, num_attention_heads=4,
                         max_position_embeddings=160)
    torch.manual_seed(0)
    module = FastformerAttention(config, is_causal=True).to(DEVICE)
    if module.additive:
        torch.nn.init.normal_(module.query_score)
        torch.nn.init.normal_(module.key_score)
    x = torch.randn(2, 150, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = _mask(2, 150, [150, 101])
    _assert_backends_agree(module, x, mask)


def test_kernels_are_called_where_they_apply_and_nowhere_else(kernels, monkeypatch):
    calls = []
    original = ops_linear_attention.linear_attention_kernel
    monkeypatch.setattr(ops_linear_attention, "linear_attention_kernel",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    generator = torch.Generator().manual_seed(8)
    query, key, value = (_heads(1, 20, 2, 16, generator) for _ in range(3))
    ops.linear_attention(query, key, value)
    assert len(calls) == 1
    ops.linear_attention(query, key, value, causal=True)  # no causal kernel: the torch form
    ops.linear_attention(*_fp64(query, key, value))  # fp64: the torch form
    ops.linear_attention(query, key, value, return_state=True)  # a state for a cache: the torch form
    pools = []
    original_pool = ops_pooling.prefix_pool_kernel
    monkeypatch.setattr(ops_pooling, "prefix_pool_kernel", lambda *a, **k: pools.append(1) or original_pool(*a, **k))
    scores = torch.randn(1, 2, 20, 1, device=DEVICE)
    ops.softmax_pool(scores, query, causal=True)  # causal pooling without a state: the kernel
    with torch.no_grad():  # a prefill's state outside autograd: the kernel too
        state = ops.softmax_pool(scores, query, causal=True, return_state=True)[1]
    ops.softmax_pool(scores[:, :, :1], query[:, :, :1], None, state, causal=True)  # from a state: the torch form
    ops.softmax_pool(scores, query, causal=True, return_state=True)  # a state under autograd: the torch form
    assert len(pools) == 2
    wide = [t.repeat(1, 1, 1, 17) for t in (query, key, value)]  # 272: wider than a tile
    ops.linear_attention(*wide)
    # fp16: attention outputs written in fp16 could overflow; the pooling's result is fp32
    assert not dispatch.kernel_applies("linear_attention", query.half())
    assert dispatch.kernel_applies("direction_pool", query.half())
    ops.set_kernel_backend("torch")
    ops.linear_attention(query, key, value)
    assert len(calls) == 1


def test_auto_backend_leaves_the_cpu_to_the_torch_forms(monkeypatch):
    previous = ops.set_kernel_backend("auto")
    try:
        monkeypatch.setattr(ops_linear_attention, "linear_attention_kernel", None)  # calling it would fail
        query = torch.randn(1, 2, 20, 16)
        out, _ = ops.linear_attention(query, query, query)
        assert out.shape == (1, 2, 20, 16)
    finally:
        ops.set_kernel_backend(previous)


# ----------------------------------------------------------------------------------------------
# torch.compile: the kernels as operators
# ----------------------------------------------------------------------------------------------


def _operator_cases():
    """(operator name, its inputs) for each family's forward: with and without a mask, a scale, a
    direction (one per sequence, one for the batch, none)."""
    generator = torch.Generator().manual_seed(21)
    mask = _mask(2, 70, [70, 50])
    query, key = _heads(2, 70, 2, 16, generator), _heads(2, 70, 2, 16, generator)
    value = _heads(2, 70, 2, 24, generator)
    scale = torch.tensor([0.3], device=DEVICE, requires_grad=True)
    rows = torch.randn(2, 70, 32, generator=generator).to(DEVICE).requires_grad_()
    directions = [torch.randn(n, 2, 24, generator=generator).to(DEVICE).requires_grad_() for n in (2, 1)]
    gate = torch.randn(2, 2, 24, generator=generator).to(DEVICE).requires_grad_()
    scores = torch.randn(2, 2, 70, 1, generator=generator).to(DEVICE).requires_grad_()
    return [
        ("linear_attention", (query, key, value, mask, scale)),
        ("linear_attention", (query, key, value, None, None)),
        ("direction_pool", (value, directions[0], mask, 1.0, None)),
        ("direction_pool", (value, directions[1], None, 0.125, None)),  # the score scale (Fastformer's 1/sqrt(d_h))
        ("direction_pool", (value, None, mask, 1.0, None)),
        ("direction_pool", (value, directions[1], mask, 0.125, gate)),  # gated rows (Fastformer's key pooling)
        # 3 directions per sequence: a padded tile of heads
        ("shared_pool", (rows, torch.randn(2, 3, 32, device=DEVICE, requires_grad=True), mask, True)),
        ("shared_pool", (rows, rows[:1, :1].detach(), None, False)),
        ("prefix_pool", (scores, value, mask)),
    ]


# 2 x 3 tiles of 32; one tile; a batch walked 4 sequences at a time, the last group partial
@pytest.mark.parametrize("rows, cols, batch", [(40, 70, 3), (16, 24, 2), (16, 24, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_scale_kernel_matches_fp64(kernels, rows, cols, batch, dtype):
    """`ops.column_scaled`: W diag(k_b) per sequence, each product rounded once to the output's
    dtype (on a GPU to nearest, so in bf16 no further from the fp64 result than the torch form's
    product of rounded operands; triton's interpreter truncates instead), and both gradients from a
    transposed output gradient (as the batched product that reads it returns one) against fp64."""
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(rows, cols, generator=generator).to(DEVICE).requires_grad_()
    scales = torch.randn(batch, cols, generator=generator).to(DEVICE).requires_grad_()
    out = ops.column_scaled(weight, scales, dtype)
    assert out.shape == (batch, rows, cols) and out.dtype == dtype
    weight64, scales64 = _fp64(weight, scales)
    expected = weight64[None] * scales64[:, None, :]
    ops.set_kernel_backend("torch")
    torch_form = ops.column_scaled(weight, scales, dtype)
    if not triton_ops.INTERPRETED:
        assert _relative(out, expected) <= _relative(torch_form, expected) + 1e-12
    assert _relative(out, expected) < (1e-7 if dtype == torch.float32 else 8e-3)
    grad = torch.randn(batch, cols, rows, generator=generator).to(DEVICE, dtype).transpose(1, 2)
    for got, want in zip(torch.autograd.grad(out, [weight, scales], grad),
                         torch.autograd.grad(expected, [weight64, scales64], grad.double()), strict=True):
        assert got.dtype == torch.float32 and _relative(got, want) < 1e-6


def test_column_scale_operator_passes_opcheck(kernels):
    """The column scaling's operator (schema, fake, autograd, a compiled trace) and its gradient
    operator's fake against the real gradients."""
    generator = torch.Generator().manual_seed(14)
    weight = torch.randn(40, 24, generator=generator).to(DEVICE).requires_grad_()
    scales = torch.randn(3, 24, generator=generator).to(DEVICE).requires_grad_()
    torch.library.opcheck(triton_ops.OPERATORS.column_scale, (weight, scales, torch.bfloat16))
    grad = torch.randn(3, 40, 24, generator=generator).to(DEVICE, torch.bfloat16)
    torch.library.opcheck(triton_ops.OPERATORS.column_scale_grads, (grad, weight, scales),
                          test_utils=("test_schema", "test_faketensor"))


def _product_operands(batch, length, ins, outs, dtype, seed=15):
    """(base, rows, weight, scales) of `ops.column_scaled_product` as fastformer hands them over:
    q and v slices of one stacked projection (B, N, 3 D), the fp32 weight W_r, the scales k_g (B, I)."""
    generator = torch.Generator().manual_seed(seed)
    stacked = torch.randn(batch, length, 2 * outs + ins, generator=generator).to(DEVICE, dtype).requires_grad_()
    base, rows = stacked[..., :outs], stacked[..., 2 * outs:]
    weight = (torch.randn(outs, ins, generator=generator) / ins**0.5).to(DEVICE).requires_grad_()
    scales = torch.randn(batch, ins, generator=generator).to(DEVICE, dtype).requires_grad_()
    return stacked, (base, rows, weight, scales)


def _product_fp64(base, rows, weight, scales):
    return base + (rows * scales[:, None, :]) @ weight.transpose(0, 1)


# 2 x 2 tiles of 128 rows and outputs, the inner width in 2 tiles of 64 (masks everywhere); one tile
@pytest.mark.parametrize("batch, length, ins, outs", [(2, 150, 80, 136), (3, 20, 24, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_product_kernel_matches_fp64(triton_backend, kernel_calls, batch, length, ins, outs, dtype):
    """`ops.column_scaled_product`'s kernel: q + (v diag(k_g)) W^T from strided slices of a stacked
    projection, output and the gradients of the stacked input, the weight and the scales against
    fp64; in bf16 (on a GPU) no further from fp64 than the torch form (the product over the
    rounded map) by more than about a bf16 rounding."""
    stacked, operands = _product_operands(batch, length, ins, outs, dtype)
    out = ops.column_scaled_product(*operands)
    assert kernel_calls == ["_scaled_product_forward"] and out.shape == (batch, length, outs) and out.dtype == dtype
    stacked64, weight64, scales64 = _fp64(stacked, operands[2], operands[3])
    expected = _product_fp64(stacked64[..., :outs], stacked64[..., 2 * outs:], weight64, scales64)
    leaves = [stacked, operands[2], operands[3]]
    wanted = _grads(expected, [stacked64, weight64, scales64])
    if dtype == torch.float32:
        assert _relative(out, expected) < 1e-6
        for got, want in zip(_grads(out, leaves), wanted, strict=True):
            assert _relative(got, want) < 1e-6
        return
    ops.set_kernel_backend("torch")
    torch_form = ops.column_scaled_product(*operands)
    pairs = [(out, torch_form, expected)] + list(zip(_grads(out, leaves), _grads(torch_form, leaves), wanted))
    for got, torch_got, want in pairs:
        if not triton_ops.INTERPRETED:  # the interpreter truncates to bf16 where a GPU rounds to nearest
            assert _relative(got, want) < _relative(torch_got, want) + 2e-3
        assert _relative(got, want) < 1.2e-2


def test_scaled_product_kernel_extra_padding_changes_nothing(triton_backend):
    """Each row's output is its own sum over fixed tiles of the inner width: rows appended (a longer
    padded batch) leave the first rows' outputs unchanged, bit for bit."""
    _, (base, rows, weight, scales) = _product_operands(2, 150, 80, 136, torch.float32)
    _, (more_base, more_rows, _, _) = _product_operands(2, 150 + 70, 80, 136, torch.float32, seed=16)
    with torch.no_grad():
        more_base[:, :150] = base
        more_rows[:, :150] = rows
        short = ops.column_scaled_product(base, rows, weight, scales)
        long = ops.column_scaled_product(more_base, more_rows, weight, scales)
    assert torch.equal(long[:, :150], short)


def test_scaled_product_kernel_runs_only_where_chosen(monkeypatch):
    """Under `auto` the fused product runs only on the device types of the policy's experimental
    `fused_product` (none by default) and only for bf16 rows; the backend `triton` runs it for fp32 rows too; a base of
    another dtype than the rows takes the torch form."""
    monkeypatch.setattr(ops_product, "kernel_applies", lambda *args, **kwargs: True)  # as on a GPU
    bf16 = _product_operands(1, 4, 8, 8, torch.bfloat16)[1]
    fp32 = _product_operands(1, 4, 8, 8, torch.float32)[1]
    device = bf16[1].device.type
    previous = ops.set_kernel_backend("auto")
    try:
        assert policy.DEFAULT.experimental.fused_product == ()
        assert not ops_product._product_kernel_applies(*bf16)
        _set_policy(monkeypatch, fused_product=(device,))
        assert ops_product._product_kernel_applies(*bf16) and not ops_product._product_kernel_applies(*fp32)
        ops.set_kernel_backend("triton")
        assert ops_product._product_kernel_applies(*fp32)
        assert not ops_product._product_kernel_applies(fp32[0], *bf16[1:])
    finally:
        ops.set_kernel_backend(previous)


@pytest.mark.parametrize("with_mask", [False, True])
def test_fastformer_pooled_output_through_the_fused_product(triton_backend, kernel_calls, monkeypatch, with_mask):
    """Bidirectional fastformer from N >= D (the pooled output, projections stacked as on CUDA, the
    folded form off): in fp32 the fused product's outputs and parameter gradients equal the torch
    forms'; under bf16 autocast, with W_o set aside (b_r in the stacked bias) and a large b_r, its
    output is (on a GPU) as close to fp64 as the torch forms' (centred, as the pooled output's
    precision test)."""
    _set_policy(monkeypatch, stacked_projection=("cuda", "cpu"), folded=False)
    config = tiny_config(attention_type="fastformer", hidden_size=64, num_attention_heads=4,
                         max_position_embeddings=128)
    torch.manual_seed(0)
    module = FastformerAttention(config).to(DEVICE)
    torch.nn.init.normal_(module.query_score)
    torch.nn.init.normal_(module.key_score)
    x = torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = _mask(2, 80, [80, 80 if not with_mask else 51])
    _assert_backends_agree(module, x, mask)
    assert kernel_calls.count("_scaled_product_forward") == 1
    module.output = torch.nn.Identity()
    with torch.no_grad():
        module.transform.bias.normal_(std=2.0)
    reference = module.double()(x.double(), mask)[0]
    module.float()
    errors = {}
    for backend in ("triton", "torch"):
        ops.set_kernel_backend(backend)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            low = module(x, mask)[0]
        centred = [t.double() - t.double().mean(1, keepdim=True) for t in (low, reference)]
        errors[backend] = _relative(centred[0][mask.bool()], centred[1][mask.bool()])
    assert kernel_calls.count("_scaled_product_forward") == 2 and errors["triton"] < 0.03, errors
    if not triton_ops.INTERPRETED:  # the interpreter truncates to bf16 where a GPU rounds to nearest
        assert errors["triton"] <= 1.1 * errors["torch"], errors


def test_scaled_product_operator_passes_opcheck(triton_backend):
    """The scaled product's operator: schema, fake, autograd (its backward through the column
    scaling's operators and two batched products) and a compiled trace; its gradients equal the
    eager autograd function's."""
    stacked, operands = _product_operands(2, 40, 24, 16, torch.float32)
    torch.library.opcheck(triton_ops.OPERATORS.scaled_product, operands)
    leaves = [stacked, *operands[2:]]
    eager = _grads(triton_product._ScaledProduct.apply(*operands), leaves)
    for got, want in zip(_grads(triton_ops.OPERATORS.scaled_product(*operands), leaves), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# linear attention's cases in both launch plans; the poolings' plans do not depend on `kernels`' choice
OPCHECK_CASES = [(case, plan) for case in range(9) for plan in (("fused", "split") if case < 2 else ("fused",))]


@pytest.mark.parametrize("case, kernels", OPCHECK_CASES, indirect=["kernels"])
def test_kernel_operators_pass_opcheck(case, kernels):
    """Each forward operator: its schema, fake implementation (shapes, dtypes, strides of the real
    outputs), autograd registration and a compiled trace with dynamic shapes (`torch.library.opcheck`);
    then its gradient operator's fake against the real gradients."""
    name, inputs = _operator_cases()[case]
    operator = getattr(triton_ops.OPERATORS, name)
    torch.library.opcheck(operator, inputs)
    outputs = operator(*inputs)
    tensors = [x for x in inputs if not isinstance(x, (bool, float))]
    flags = [x for x in inputs if isinstance(x, (bool, float))]
    saved = (*tensors, outputs[1]) if name == "linear_attention" else (*tensors, *outputs)  # as the backward's
    grads = getattr(triton_ops.OPERATORS, f"{name}_grads")
    torch.library.opcheck(grads, (*saved, torch.randn_like(outputs[0]), *flags),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The names of the launching functions behind the kernels' operators and autograd functions,
    in the order they are called (forward launches and gradients of each family)."""
    calls = []
    for module, names in ((triton_linear_attention, ("_linear_attention_forward", "_linear_attention_grads")),
                          (triton_pooling, ("_pool_forward", "_direction_pool_grads")),
                          (triton_shared_pool, ("_shared_pool_forward", "_shared_pool_grads")),
                          (triton_prefix_pool, ("_prefix_pool_forward", "_prefix_pool_grads")),
                          (triton_product, ("_scaled_product_forward",))):
        for name in names:
            original = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


@pytest.mark.parametrize("attention, options", [
    ("zformer", {}),  # linear attention
    ("zformer", {"zformer_feature_map": "hedgehog"}),  # fp32 features beside the values
    ("fastformer", {}),  # per-head pooling (plain form) or pooling across heads (folded form)
    ("fastformer", {"is_causal": True}),  # prefix pooling
])
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("backend, mode", [("aot_eager", None), ("inductor", None), ("inductor", "reduce-overhead")])
def test_compiled_modules_run_the_kernels(attention, options, folded, backend, mode, triton_backend, kernel_calls,
                                          monkeypatch):
    """A module compiled whole (`fullgraph=True`; `aot_eager` traces the graphs, `inductor` also
    generates the code around the operators and plans its buffers, on a GPU with `reduce-overhead`
    in CUDA graphs) calls the kernels' operators, forward and backward, and gives the eager
    kernels' outputs and gradients (padding included)."""
    if mode == "reduce-overhead" and DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    import hf_zformer.modeling.attention as attention_module

    options = dict(options)
    is_causal = options.pop("is_causal", False)
    if folded and (attention == "zformer" or is_causal):
        pytest.skip("no sequence kernel in zformer's folded form; no folded form of causal attention")
    if not folded:
        monkeypatch.setattr(attention_module, "use_folded_form", lambda *args, **kwargs: False)
    config = tiny_config(attention_type=attention, hidden_size=32, num_attention_heads=2, **options)
    torch.manual_seed(0)
    module = (ZformerAttention(config) if attention == "zformer" else FastformerAttention(config, is_causal=is_causal))
    module = module.to(DEVICE)
    for parameter in module.parameters():  # the pooling directions are left to the model's initialisation
        torch.nn.init.normal_(parameter, std=0.3)
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_()
    mask = _mask(2, 40, [40, 29])

    def run(function):
        out = function(x, mask)[0]
        return out, torch.autograd.grad((out * out).sum(), [x, *module.parameters()], allow_unused=True)

    expected, eager_calls = run(module), sorted(set(kernel_calls))
    assert any(name.endswith("_grads") for name in eager_calls)
    kernel_calls.clear()
    torch._dynamo.reset()
    got = run(torch.compile(module, backend=backend, mode=mode, fullgraph=True))
    assert sorted(set(kernel_calls)) == eager_calls
    # inductor reorders the sums around them: fp32 rounding, measured against each tensor's own size
    # (the gradients here span four orders of magnitude, so an element-wise tolerance would not do)
    got_out, got_grads = got
    assert _relative(got_out, expected[0]) < 1e-5
    for got_grad, want in zip(got_grads, expected[1], strict=True):
        assert (got_grad is None) == (want is None)
        assert want is None or _relative(got_grad, want) < 1e-5


def test_a_copy_of_the_kernels_registers_operators_of_its_own(monkeypatch):
    """A checkpoint's copy of the kernel modules (`trust_remote_code` imports them under another
    package) registers its operators in a namespace of its own, and a torch that refuses to
    redefine an operator gets a numbered namespace instead of an error."""
    import importlib
    import sys
    import types
    from pathlib import Path

    folder = types.ModuleType("checkpoint_folder")  # the copied folder, siblings and all
    folder.__path__ = [str(Path(triton_launch.__file__).parent)]
    monkeypatch.setitem(sys.modules, "checkpoint_folder", folder)
    for name in [name for name in sys.modules if name.startswith("checkpoint_folder.")]:
        monkeypatch.delitem(sys.modules, name)
    copy = importlib.import_module("checkpoint_folder.triton_prefix_pool")
    namespace = importlib.import_module("checkpoint_folder.triton_launch").operator_namespace()
    assert namespace == "checkpoint_folder_kernels" != triton_launch.operator_namespace()
    pooling = importlib.import_module("checkpoint_folder.triton_pooling")
    values = torch.randn(2, 1, 20, 16, device=DEVICE)
    pooled = pooling.OPERATORS.direction_pool(values, None, None)[0]
    torch.testing.assert_close(pooled, values.float().mean(2))

    define = torch.library.custom_op

    def refuse_redefinition(name, *args, **kwargs):  # as some torch versions answer a second definition
        if name.startswith(namespace + "::"):
            raise RuntimeError(f"Tried to register an operator ({name}) with the same name multiple times")
        return define(name, *args, **kwargs)

    try:
        torch.library.custom_op = refuse_redefinition
        operators = copy._register_operators()
    finally:
        torch.library.custom_op = define
    assert operators.prefix_pool is not copy.OPERATORS.prefix_pool
    assert hasattr(torch.ops.checkpoint_folder_kernels_1, "prefix_pool")


@pytest.mark.parametrize("kind, attention", [("classification", "zformer"), ("seq2seq", "fastformer")])
def test_compiled_models_train_through_the_kernels(kind, attention, triton_backend, kernel_calls):
    """A whole model compiled (embeddings, masks, every layer; the encoder-decoder's fastformer runs
    the pooling across heads and the decoder's prefix pooling): its training loss and gradients
    equal eager mode's with the kernels, and the compiled graphs call the same kernel operators."""
    from model_kinds import batch, model

    net = model(kind, attention).train().to(DEVICE)
    inputs = {name: value.to(DEVICE) for name, value in batch(kind).items()}
    loss = net(**inputs).loss
    loss.backward()
    expected = {name: p.grad.clone() for name, p in net.named_parameters()}
    eager_calls = sorted(set(kernel_calls))
    assert any(name.endswith("_grads") for name in eager_calls)
    kernel_calls.clear()
    net.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled_loss = torch.compile(net, backend="aot_eager")(**inputs).loss
    compiled_loss.backward()
    assert sorted(set(kernel_calls)) == eager_calls
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("attention", ["zformer", "fastformer"])
def test_kernels_under_selective_activation_checkpointing_give_the_plain_gradients(triton_backend, attention):
    """Selective activation checkpointing runs the layer under its own dispatch mode, where the
    kernels run as their operators: saving the kernels' outputs and recomputing the rest gives
    the gradients of a call without checkpointing, with padding."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    config = tiny_config(attention_type=attention, hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    module = {"zformer": ZformerAttention, "fastformer": FastformerAttention}[attention](config).to(DEVICE)
    module.folded_autocast_devices = ()  # the plain form, whose sequence operations are the kernels
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_()
    mask = _mask(2, 40, [40, 23])
    namespace = triton_ops.operator_namespace()
    seen = []

    def policy(ctx, op, *args, **kwargs):
        if str(op).startswith(namespace):
            seen.append(str(op))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def loss(inputs):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            return module(inputs, mask)[0].float().square().sum()

    expected = torch.autograd.grad(loss(x), [x, *module.parameters()])
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    got = torch.autograd.grad(checkpoint(loss, x, use_reentrant=False, context_fn=context), [x, *module.parameters()])
    assert seen, "the kernels did not run as operators under the checkpoint's mode"
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
