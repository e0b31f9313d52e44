"""torch.compile: a compiled model's eval outputs, training loss and gradients, and greedy generation equal
eager mode's. The default suite compiles with the `aot_eager` backend (graph capture and autograd tracing,
no code generation: seconds); the slow tests with `inductor`, the default backend, for every model kind
and attention type (tens of seconds per model on a CPU)."""

import pytest
import torch
from model_kinds import batch, cases, model

TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def fresh_compile():
    torch._dynamo.reset()  # no graph or recompile budget carried over from another model


def check_eval(kind, attention, backend):
    net = model(kind, attention).eval()
    inputs = batch(kind)
    with torch.no_grad():
        expected = net(**inputs).logits
        fresh_compile()
        compiled = torch.compile(net, backend=backend)
        torch.testing.assert_close(compiled(**inputs).logits, expected, **TOLERANCE)
        torch.testing.assert_close(compiled(**batch(kind, seed=1)).logits, net(**batch(kind, seed=1)).logits,
                                   **TOLERANCE)


def check_training_step(kind, attention, backend):
    net = model(kind, attention).train()
    inputs = batch(kind)
    loss = net(**inputs).loss
    loss.backward()
    expected = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    fresh_compile()
    compiled_loss = torch.compile(net, backend=backend)(**inputs).loss
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, **TOLERANCE)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def check_greedy_generation(kind, attention, backend):
    net = model(kind, attention).eval()
    inputs = batch(kind)
    inputs.pop("labels")
    if kind == "causal":  # prompts of one length: a causal LM continues after its last real token
        inputs = {name: value[:, :3] for name, value in inputs.items()}
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=0)
    expected = net.generate(**inputs, **options)
    fresh_compile()
    net.forward = torch.compile(net.forward, backend=backend)
    assert torch.equal(net.generate(**inputs, **options), expected)


@pytest.mark.parametrize("kind", ["classification", "seq2seq"])
def test_compiled_zformer_matches_eager_aot_eager(kind):
    check_eval(kind, "zformer", "aot_eager")
    check_training_step(kind, "zformer", "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("kind,attention", cases())
def test_inductor_eval_outputs_match_eager(kind, attention):
    check_eval(kind, attention, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["classification", "masked", "seq2seq", "causal"])
def test_inductor_training_step_matches_eager(kind):
    check_training_step(kind, "hybrid", "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("kind,attention", [("seq2seq", "zformer"), ("seq2seq", "full"), ("causal", "hybrid")])
def test_inductor_greedy_generation_matches_eager(kind, attention):
    check_greedy_generation(kind, attention, "inductor")


@pytest.mark.parametrize("kind", ["seq2seq", "causal"])
def test_gradient_checkpointing_under_compile_matches_eager(kind):
    """Recomputed layers (gradient checkpointing) and the tied-embedding lookups inside a compiled
    training step: loss and every gradient equal the plain eager step's."""
    net = model(kind, "zformer").train()
    inputs = batch(kind)
    loss = net(**inputs).loss
    loss.backward()
    expected = {name: p.grad.clone() for name, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fresh_compile()
    compiled_loss = torch.compile(net, backend="aot_eager")(**inputs).loss
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, **TOLERANCE)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("attention", ["full", "fastformer"])
def test_stacked_projections_and_pooled_output_compile(monkeypatch, attention):
    """The GPU's stacked query/key/value product (`blocks.project`, turned on for the CPU here) and
    fastformer's pooled output (40 tokens >= width 16; the fp32 folded form off) under
    torch.compile: the attention module's output and every gradient as in eager mode."""
    import hf_zformer.modeling.attention as attention_module
    import hf_zformer.modeling.blocks as blocks
    from conftest import tiny_config
    from hf_zformer.modeling.attention import ATTENTION_CLASSES

    from hf_zformer.modeling import policy

    monkeypatch.setattr(policy, "_active", policy.active().replaced(stacked_projection=("cuda", "cpu"), folded=False))
    stacked = []
    monkeypatch.setattr(attention_module, "project", lambda x, *layers, **kw: stacked.append(1) or blocks.project(
        x, *layers, **kw))
    config = tiny_config(hidden_size=16, num_attention_heads=2, attention_type=attention)
    torch.manual_seed(0)
    module = ATTENTION_CLASSES[attention](config)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    x = torch.randn(3, 40, 16, requires_grad=True)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 29:] = 0

    def run(function):
        out = function(x, mask)[0]
        return out, torch.autograd.grad(out.pow(2).sum(), [x, *module.parameters()])

    expected = run(module)
    assert stacked and (attention == "full" or module._takes_pooled_output(40, 16))
    fresh_compile()
    got = run(torch.compile(module, backend="aot_eager"))
    torch.testing.assert_close(got, expected, **TOLERANCE)
