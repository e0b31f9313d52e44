"""The code a checkpoint ships (`hf_zformer/modeling/`) is plain torch and transformers, with plain
`nn.Linear` and `nn.Dropout` layers; the machine-specific layer forms are the opt-in
`hf_zformer.cpu_speedups`, which computes what the plain layers do and leaves the state dict as it is."""

import ast
import copy
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, tiny_config
from transformers import AutoModelForSeq2SeqLM

from hf_zformer import cpu_speedups, disable_cpu_speedups, enable_cpu_speedups, use_cpu_speedups
from hf_zformer.modeling.policy import use_policy

SHIPPED = sorted((REPO_ROOT / "hf_zformer" / "modeling").glob("*.py"))

# What the shipped code must not read: the machine it runs on, torch's private C bindings, tensors'
# version counters, and modules' hook dictionaries (torch's internals, which change between versions).
FORBIDDEN = {
    "the CPU's description": re.compile(r"cpuinfo|platform\.processor"),
    "torch._C": re.compile(r"torch\._C\b"),
    "a version counter": re.compile(r"\._version\b"),
    "a hook dictionary": re.compile(r"\b_(global_)?(forward|backward)(_pre)?_hooks\b"),
    "a weak tensor-keyed cache": re.compile(r"WeakTensorKeyDictionary"),
}
# The Triton kernels' count of active Python dispatch modes (a counter of operations, fake tensors),
# under which they run as operators: torch has no public call that counts them, and the read falls
# back to none where a torch version lacks it.
ALLOWED = set()


def test_the_shipped_code_reads_no_machine_and_no_torch_internals():
    found = [f"{path.name}:{number}: {what}: {line.strip()}"
             for path in SHIPPED for number, line in enumerate(path.read_text().splitlines(), 1)
             if line.strip() not in ALLOWED
             for what, pattern in FORBIDDEN.items() if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_shipped_code_subclasses_neither_linear_nor_dropout():
    """Its layers are torch's own `nn.Linear` and `nn.Dropout`: no subclass, no replaced `__call__`."""
    found = []
    for path in SHIPPED:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(base).rpartition(".")[2] for base in node.bases}
            if bases & {"Linear", "Dropout"}:
                found.append(f"{path.name}: class {node.name}({', '.join(sorted(bases))})")
            if any(isinstance(item, ast.FunctionDef) and item.name == "__call__" for item in node.body):
                found.append(f"{path.name}: {node.name}.__call__")
    assert not found, found


def test_a_model_builds_plain_layers():
    model = AutoModelForSeq2SeqLM.from_config(tiny_config(decoder_attention_type="zformer"))
    kinds = {type(module) for module in model.modules()}
    assert torch.nn.Linear in kinds and torch.nn.Dropout in kinds
    assert not kinds & {cpu_speedups.FewRowsLinear, cpu_speedups.SkippingDropout}


def test_few_row_rule_is_on_for_amd_cpus_only(monkeypatch, tmp_path):
    """The default few-row rule follows the CPU vendor (the policy's `few_rows` overrides it): the transposed product is the faster one on an AMD
    EPYC and 2-3x slower on an Intel Xeon (docs/benchmarks.md)."""
    import platform

    assert cpu_speedups.default_few_rows("AuthenticAMD") == 4
    assert cpu_speedups.default_few_rows("GenuineIntel") == 0 and cpu_speedups.default_few_rows("") == 0
    assert cpu_speedups.MACHINE_FEW_ROWS == cpu_speedups.default_few_rows(cpu_speedups.cpu_vendor())  # at import
    assert cpu_speedups.few_rows() == cpu_speedups.MACHINE_FEW_ROWS  # the policy leaves it to the machine
    for rows in (0, 7):
        with use_policy(few_rows=rows):
            assert cpu_speedups.few_rows() == rows
    with pytest.raises(ValueError, match="few_rows=-1"):
        with use_policy(few_rows=-1):
            pass
    real = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    named = [line for line in real if line.startswith("vendor_id")]  # x86 Linux; absent on ARM
    if named:
        assert cpu_speedups.cpu_vendor() == named[0].partition(":")[2].strip() != ""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_speedups.cpu_vendor(str(cpuinfo)) == "AuthenticAMD"
    # without /proc/cpuinfo (Windows, macOS): the vendor from platform.processor(), "" when it names none
    missing = str(tmp_path / "absent")
    monkeypatch.setattr(platform, "processor", lambda: "AMD64 Family 25 Model 1 Stepping 1, AuthenticAMD")
    assert cpu_speedups.cpu_vendor(missing) == "AuthenticAMD"
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    assert cpu_speedups.cpu_vendor(missing) == ""


@pytest.mark.parametrize("in_features, out_features, bias", [(32, 32, True), (32, 96, False), (96, 32, True)])
def test_few_row_linear_equals_nn_linear(in_features, out_features, bias, monkeypatch, few_row_form):
    """`FewRowsLinear` takes its transposed product for 1-4 rows (not for in > out, fp64 or more rows)
    and gives nn.Linear's outputs and gradients, in every input shape, with nn.Linear's parameter names."""
    assert cpu_speedups.few_rows() == 4  # the fixture's, whatever this machine's default

    torch.manual_seed(0)
    layer = cpu_speedups.FewRowsLinear(in_features, out_features, bias=bias)
    reference = torch.nn.Linear(in_features, out_features, bias=bias)
    reference.load_state_dict(layer.state_dict())
    assert list(layer.state_dict()) == list(reference.state_dict())
    plain_calls = []
    plain = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: plain_calls.append(1) or plain(*a, **k))
    shapes = [(in_features,), (1, in_features), (1, 1, in_features), (2, 1, in_features), (3, in_features),
              (2, 2, in_features), (5, in_features), (3, 4, in_features), (0, in_features)]
    for shape in shapes:
        for dtype in (torch.float32, torch.float64):
            layer.to(dtype), reference.to(dtype)
            x = torch.randn(*shape, dtype=dtype, requires_grad=True)
            plain_calls.clear()
            y = layer(x)
            rows = x.numel() // in_features
            transposed = dtype == torch.float32 and in_features <= out_features and 1 <= rows <= cpu_speedups.few_rows()
            assert len(plain_calls) == (0 if transposed else 1), (shape, dtype)
            expected = reference(x)
            assert y.shape == expected.shape and y.is_contiguous()
            torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
            if rows:
                weights = torch.randn_like(expected)
                grads = torch.autograd.grad((y * weights).sum(), [x, layer.weight])
                expected_grads = torch.autograd.grad((expected * weights).sum(), [x, reference.weight])
                for got, want in zip(grads, expected_grads):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    layer.float()
    plain_calls.clear()
    with use_policy(few_rows=0):  # the rule turned off: nn.Linear's product for every input
        torch.testing.assert_close(layer(torch.ones(2, in_features)), reference.float()(torch.ones(2, in_features)))
    assert len(plain_calls) == 2
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # a wrong width is refused, not reshaped
        layer(torch.randn(2, in_features // 2))  # as many numbers as one row


def test_skipping_dropout_is_active_in_training_and_skipped_otherwise():
    """`SkippingDropout` returns its input untouched (no call) in eval mode or with p = 0, and drops
    in training mode like `nn.Dropout`."""
    x = torch.ones(64, 64)
    dropout = cpu_speedups.SkippingDropout(0.5)
    assert dropout.eval()(x) is x and cpu_speedups.SkippingDropout(0.0).train()(x) is x
    dropped = dropout.train()(x)
    assert (dropped == 0).any() and torch.allclose(dropped[dropped != 0], torch.full_like(dropped[dropped != 0], 2.0))


def _outputs_and_gradients(model, source, target):
    """(logits of a training forward, every parameter's gradient, logits of a decoding step)."""
    model.zero_grad()
    torch.manual_seed(1)  # the same dropout masks
    logits = model.train()(input_ids=source, labels=target).logits
    logits.sum().backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    with torch.no_grad():
        step = model.eval()(input_ids=source, decoder_input_ids=target[:, :1]).logits
    return logits.detach(), gradients, step


@pytest.mark.parametrize("attention_type", ["full", "zformer", "fastformer"])
def test_speedups_give_the_plain_models_outputs_gradients_and_state_dict(attention_type, few_row_form):
    """fp32 on the CPU, inputs of 1-4 rows (the transposed product) and dropout on in training: the
    model with the speed-ups gives the plain model's outputs and gradients, with the same state dict,
    and turns plain again."""
    torch.manual_seed(0)
    config = tiny_config(attention_type=attention_type, decoder_attention_type=attention_type,
                         hidden_dropout_prob=0.1)
    plain = AutoModelForSeq2SeqLM.from_config(config)
    faster = few_row_form(copy.deepcopy(plain))
    assert {type(m) for m in faster.modules()} >= {cpu_speedups.FewRowsLinear, cpu_speedups.SkippingDropout}
    assert not {torch.nn.Linear, torch.nn.Dropout} & {type(m) for m in faster.modules()}
    source, target = torch.randint(5, 97, (1, 4)), torch.randint(5, 97, (1, 3))
    want, got = _outputs_and_gradients(plain, source, target), _outputs_and_gradients(faster, source, target)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    state, reference = faster.state_dict(), plain.state_dict()
    assert list(state) == list(reference) and all(torch.equal(state[k], reference[k]) for k in reference)
    disable_cpu_speedups(faster)
    assert {type(m) for m in faster.modules()} == {type(m) for m in plain.modules()}


def test_use_cpu_speedups_restores_only_the_layers_it_changed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), cpu_speedups.FewRowsLinear(4, 4), torch.nn.Dropout(0.1))
    with use_cpu_speedups(model) as inside:
        assert inside is model
        assert [type(m) for m in model] == [cpu_speedups.FewRowsLinear, cpu_speedups.FewRowsLinear,
                                            cpu_speedups.SkippingDropout]
    assert [type(m) for m in model] == [torch.nn.Linear, cpu_speedups.FewRowsLinear, torch.nn.Dropout]
    assert enable_cpu_speedups(model) is model and disable_cpu_speedups(model) is model
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear, torch.nn.Dropout]


def test_the_documented_example_runs():
    """The example of docs/benchmarks.md, "Opt-in CPU speed-ups": the same tokens with and without."""
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    section = page[page.index("### Opt-in CPU speed-ups"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    exec(compile(block, "docs/benchmarks.md: Opt-in CPU speed-ups", "exec"), {})
