"""The backend switch of the fast forms (`hf_zformer.modeling.ops`, "Backends"): `torch` runs plain
torch everywhere (no GPU kernels, no transposed few-row product, no tied-embedding gradient
function) with the same results; `auto` takes each fast form where it applies; bad names are refused."""

import pytest
import torch
from conftest import TINY, random_batch
from transformers import AutoConfig, AutoModelForMaskedLM

from hf_zformer.modeling import blocks, dispatch, modeling_zformer, ops, policy


def test_torch_backend_takes_the_plain_product_for_few_rows(monkeypatch):
    from hf_zformer import cpu_speedups

    calls = []
    original = cpu_speedups.transposed_linear
    monkeypatch.setattr(cpu_speedups, "transposed_linear", lambda *a: calls.append(1) or original(*a))
    layer = cpu_speedups.FewRowsLinear(8, 16)
    x = torch.randn(2, 8)
    with policy.use_policy(few_rows=4):  # the AMD rule, on any machine
        fast = layer(x)
        assert calls == [1]
        with ops.use_kernel_backend("torch"):
            plain = layer(x)
    assert calls == [1]
    torch.testing.assert_close(plain, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=0, rtol=0)
    torch.testing.assert_close(fast, plain)


def test_torch_backend_trains_tied_embeddings_through_plain_autograd(monkeypatch):
    calls = []
    original = modeling_zformer._TiedLookups.apply
    monkeypatch.setattr(modeling_zformer._TiedLookups, "apply", lambda *a: calls.append(1) or original(*a))
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(AutoConfig.for_model("zformer", **TINY)).train()
    ids, mask = random_batch([7, 5])
    grads = {}
    for backend in ("auto", "torch"):
        model.zero_grad()
        with ops.use_kernel_backend(backend):
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[backend] = model.zformer.embeddings.word_embeddings.weight.grad.clone()
    assert calls == [1]  # auto only
    torch.testing.assert_close(grads["torch"], grads["auto"], atol=1e-6, rtol=1e-5)


def test_use_kernel_backend_restores_the_choice_and_refuses_unknown_names():
    before = ops.kernel_backend()
    with ops.use_kernel_backend("torch"):
        assert ops.kernel_backend() == "torch" and policy.active().backend == "torch"
    assert ops.kernel_backend() == before
    with pytest.raises(ValueError, match="'fast'.*auto, torch, triton"):
        ops.set_kernel_backend("fast")
    assert ops.kernel_backend() == before


def test_an_interpreter_too_old_for_the_kernels_is_named(monkeypatch):
    """Under TRITON_INTERPRET=1 with a triton older than 3.7 (whose interpreter stops at the kernels'
    loop bounds): `triton` refuses, naming the version and the remedy; `auto` takes the torch form."""
    from types import SimpleNamespace

    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(dispatch, "TRITON_INTERPRETED", True)
    monkeypatch.setattr(dispatch, "TRITON_RUNNABLE", False)
    monkeypatch.setattr(dispatch, "TRITON_VERSION", (3, 6))
    tensor = torch.zeros(2, 4, 8)
    with ops.use_kernel_backend("triton"):
        with pytest.raises(RuntimeError, match=r"triton 3\.6's interpreter .*cannot run the kernels.*triton>=3\.7"):
            dispatch.kernel_applies("linear_attention", tensor)
    on_cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.float32, shape=(2, 4, 8))
    with ops.use_kernel_backend("auto"):
        assert dispatch.kernel_applies("linear_attention", on_cuda) is False
