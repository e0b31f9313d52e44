"""The benchmark's traffic counter: what each operation reads and writes, the kernels counted as
operators, training steps counted with their backward, and the copy bandwidth."""

import pytest
import torch

import benchmarks
from benchmarks.cases import BenchCase, build_module, make_config
from benchmarks.harness import _make_inputs, _make_step
from hf_zformer.modeling import triton_ops


def test_tensor_bytes_count_addressed_elements_once():
    x = torch.zeros(4, 8)
    assert benchmarks.tensor_bytes(x) == 4 * 8 * 4
    assert benchmarks.tensor_bytes(x[:, :2]) == 4 * 2 * 4  # a slice: its own elements
    assert benchmarks.tensor_bytes(x.t()) == 4 * 8 * 4
    bias = torch.zeros(8, dtype=torch.bfloat16)
    assert benchmarks.tensor_bytes(bias.expand(100, 8)) == 8 * 2  # broadcast rows count once
    assert benchmarks.tensor_bytes(torch.zeros(0, 3)) == 0


def test_each_operation_reads_its_inputs_and_writes_its_outputs_once():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    target = torch.empty(4, 8)
    size = 4 * 8 * 4
    with benchmarks.TrafficCounter() as counter:
        x.t()  # a view: nothing moves
        x.view(8, 4)
        torch.empty(100)  # an allocation: nothing moves
        z = x + y  # reads two, writes one
        z.add_(y)  # reads both, writes z
        target.copy_(x)  # writes target without reading it
        torch.zeros_like(x)  # reads no input
        torch.mm(x, y.t())  # (4, 8) @ (8, 4): both operands read, a (4, 4) written
        torch._foreach_add_([z, target], [x, y])  # writes z and target in place, returning nothing
    names = [name for name, _, _ in counter.records]
    assert names == ["aten.add.Tensor", "aten.add_.Tensor", "aten.copy_.default", "aten.zeros_like.default",
                     "aten.mm.default", "aten._foreach_add_.List"]
    assert [(read, wrote) for _, read, wrote in counter.records] == [
        (2 * size, size), (2 * size, size), (size, size), (0, size), (2 * size, 4 * 4 * 4), (4 * size, 2 * size)]
    assert counter.operations == 6
    assert counter.bytes == counter.bytes_read + counter.bytes_written == 11 * size + 6 * size + 64


def _step(attention_type: str, mode: str, dtype: str = "fp32"):
    case = BenchCase("attention", attention_type, mode, 2, 16, 32, 2, dtype, "cpu", True)
    config = make_config(attention_type, 16, 32, 2)
    torch.manual_seed(0)
    module = build_module(attention_type, config, "attention", torch.device("cpu"))
    step = _make_step(module, _make_inputs(case, config, torch.device("cpu")), case, torch.device("cpu"))
    step()  # a training step makes its output gradient on its first call
    return step


def test_a_training_step_counts_its_backward():
    forward = benchmarks.count_traffic(_step("fastformer", "forward"))
    train = benchmarks.count_traffic(_step("fastformer", "train"))
    assert train.operations > 2 * forward.operations and train.bytes > 2 * forward.bytes
    assert any("backward" in name or name.startswith("aten.mm") for name, _, _ in train.records)
    again = benchmarks.count_traffic(_step("fastformer", "train"))
    assert (again.operations, again.bytes) == (train.operations, train.bytes)  # a count, not a timing


@pytest.mark.skipif(not triton_ops.RUNNABLE, reason="the kernels need triton (its interpreter here)")
def test_the_kernels_count_as_their_operators():
    """Under a dispatch mode each kernel family runs as its operator, forward and backward: the
    counter sees the pooling whole, and the result and gradients are those of the eager call."""
    torch.manual_seed(0)
    values = torch.randn(2, 2, 40, 16, requires_grad=True)
    direction = torch.randn(1, 2, 16, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0

    def run():
        pooled = triton_ops.direction_pool_kernel(values, direction, mask)
        grads = torch.autograd.grad(pooled.square().sum(), (values, direction))
        return pooled, *grads

    expected = run()
    with benchmarks.TrafficCounter() as counter:
        counted = run()
    for a, b in zip(expected, counted):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    names = [name for name, _, _ in counter.records]
    namespace = triton_ops.operator_namespace()
    assert f"{namespace}.direction_pool.default" in names and f"{namespace}.direction_pool_grads.default" in names
    read = dict((name, read) for name, read, _ in counter.records)[f"{namespace}.direction_pool.default"]
    assert read == benchmarks.tensor_bytes(values) + benchmarks.tensor_bytes(direction) + benchmarks.tensor_bytes(mask)
    # the log-sum-exp output takes no gradient, and none is filled with zeros for it
    assert not any(name.startswith(("aten.zeros", "aten.zero_", "aten.fill_")) for name in names), names


@pytest.mark.skipif(not triton_ops.RUNNABLE, reason="the kernels need triton (its interpreter here)")
def test_the_kernels_trace_with_fake_tensors():
    """Fake tensors hold no data to launch a kernel on: under their mode the operators' fake
    implementations give the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        values = torch.empty(2, 3, 40, 16, dtype=torch.bfloat16)
        pooled = triton_ops.direction_pool_kernel(values, torch.empty(1, 3, 16))
    assert pooled.shape == (2, 3, 16) and pooled.dtype == torch.float32


def test_copy_bandwidth_is_measured():
    measured = benchmarks.measure_copy_bandwidth(torch.device("cpu"), size_bytes=2**22, repeats=2)
    assert measured["size_bytes"] == 2**22 and measured["seconds"] > 0
    assert measured["bytes_per_s"] == pytest.approx(2 * 2**22 / measured["seconds"])


def test_the_grid_reports_operations_bytes_and_their_share_of_the_bandwidth():
    results = benchmarks.sweep(["full", "fastformer"], [16], widths=[32], heads=[2], batch=2, modes=["forward"],
                               repeats=1, measure_memory=False, progress=False)
    benchmarks.set_bandwidth_fractions(results, 1e9)
    for r in results:
        assert r.status == "ok" and r.operations > 0 and r.bytes > 0
        assert r.bandwidth_fraction == pytest.approx(r.bytes / (r.time_ms / 1e3) / 1e9)
    assert " · bw " in benchmarks.markdown_table(results)
    skipped = benchmarks.sweep(["full"], [16], widths=[32], heads=[2], batch=2, repeats=1, measure_memory=False,
                               progress=False, measure_traffic=False)
    benchmarks.set_bandwidth_fractions(skipped, 1e9)
    assert (skipped[0].operations, skipped[0].bytes, skipped[0].bandwidth_fraction) == (None, None, None)
    assert " · bw " not in benchmarks.markdown_table(skipped) and "copy bandwidth" not in benchmarks.markdown_table(skipped)
