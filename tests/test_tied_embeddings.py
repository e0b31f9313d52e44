"""Tied embeddings trained through `tied_lookups`: one autograd Function makes the token lookups and
hands the LM head the shared weight, so the lookups' row gradients land in the head's weight
gradient. Every gradient must equal the one plain autograd gives (the shortcut switched off)."""

import pytest
import torch
from conftest import TINY, random_batch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

from hf_zformer.modeling import modeling_zformer

AUTO_CLASSES = {"seq2seq": AutoModelForSeq2SeqLM, "causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM}


def _model(kind, **overrides):
    extra = {"seq2seq": {"num_decoder_layers": 2}, "causal": {"attention_type": "zformer"}, "masked": {}}[kind]
    config = AutoConfig.for_model("zformer", **{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    return AUTO_CLASSES[kind].from_config(config).double().train()


def _inputs(kind):
    """A padded batch with the pad id (0) also at a real position, where `nn.Embedding` gives its row no
    lookup gradient; it is a target label too (the head's gradient reaches its row)."""
    ids, mask = random_batch([9, 5, 7], seed=3)
    ids[0, 1] = 0
    if kind == "seq2seq":
        labels, _ = random_batch([6, 3, 8], pad_to=8, seed=4)
        labels[0, 2] = 0  # a target that is the pad token: its row gets head and lookup gradients
        return dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(labels == 0, -100))
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "masked":
        labels[:, ::2] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _gradients(model, inputs, loss_of=lambda output: output.loss):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model(**inputs))
    loss.backward()
    return loss.detach(), _grads(model)


def _plain(monkeypatch):
    monkeypatch.setattr(modeling_zformer, "tied_lookups", lambda head, *lookups: None)


def _count_calls(monkeypatch):
    calls = []
    original = modeling_zformer._TiedLookups.apply

    def counting(*args):
        calls.append(len(args) - 2)  # the number of lookups
        return original(*args)

    monkeypatch.setattr(modeling_zformer._TiedLookups, "apply", counting)
    return calls


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close_grads(grads, plain_grads, rtol=1e-10, atol=1e-13):
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=rtol, atol=atol, msg=name)


def _with_and_without(monkeypatch, run):
    """`run()` with the shortcut, then with it switched off."""
    shortcut = run()
    _plain(monkeypatch)
    return shortcut, run()


def _assert_same(first, second):
    (loss, grads), (plain_loss, plain_grads) = first, second
    torch.testing.assert_close(loss, plain_loss, rtol=1e-12, atol=0)
    _assert_close_grads(grads, plain_grads)


@pytest.mark.parametrize("kind, lookups", [("seq2seq", 2), ("causal", 1), ("masked", 1)])
def test_gradients_equal_plain_autograd(monkeypatch, kind, lookups):
    model, inputs = _model(kind), _inputs(kind)
    with monkeypatch.context() as patch:
        calls = _count_calls(patch)
        shortcut = _gradients(model, inputs)
    assert calls == [lookups]
    _plain(monkeypatch)
    _assert_same(shortcut, _gradients(model, inputs))
    embedding = model.get_input_embeddings().weight
    assert embedding.grad[5:].abs().sum() > 0  # the test has something to compare


def test_masked_lm_scoring_only_labelled_positions(monkeypatch):
    model, inputs = _model("masked"), _inputs("masked")
    inputs["labelled_logits_only"] = True
    _assert_same(*_with_and_without(monkeypatch, lambda: _gradients(model, inputs)))


def test_seq2seq_with_encoder_outputs_given_looks_up_the_target_only(monkeypatch):
    model, inputs = _model("seq2seq"), _inputs("seq2seq")
    encoder_outputs = model.get_encoder()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    given = dict(inputs, input_ids=None, encoder_outputs=encoder_outputs)  # its graph serves both passes
    with monkeypatch.context() as patch:
        calls = _count_calls(patch)
        model.zero_grad(set_to_none=True)
        model(**given).loss.backward(retain_graph=True)
        shortcut = _grads(model)
    assert calls == [1]
    _plain(monkeypatch)
    model.zero_grad(set_to_none=True)
    model(**given).loss.backward()
    _assert_close_grads(shortcut, _grads(model))


def test_accumulates_across_backward_passes(monkeypatch):
    """Two micro-batches into .grad (gradient accumulation) give what plain autograd gives."""
    model = _model("seq2seq")
    batches = [_inputs("seq2seq"), {**_inputs("seq2seq"), "labels": _inputs("seq2seq")["labels"].flip(0)}]

    def accumulate():
        model.zero_grad(set_to_none=True)
        for batch in batches:
            model(**batch).loss.backward()
        return _grads(model)

    _assert_close_grads(*_with_and_without(monkeypatch, accumulate))


def test_double_backward_equals_plain(monkeypatch):
    """A gradient penalty differentiates the backward (create_graph=True): then the Function adds out
    of place, and the second-order gradients match plain autograd's."""
    model, inputs = _model("causal"), _inputs("causal")

    def penalised():
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        embedding = model.get_input_embeddings().weight
        (grad,) = torch.autograd.grad(loss, embedding, create_graph=True)
        (loss + grad.pow(2).sum()).backward()
        return _grads(model)

    _assert_close_grads(*_with_and_without(monkeypatch, penalised), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["no_grad", "frozen_embeddings", "untied"])
def test_not_taken_where_it_does_not_apply(monkeypatch, case):
    model = _model("seq2seq", **({"tie_word_embeddings": False} if case == "untied" else {}))
    inputs = _inputs("seq2seq")
    if case == "frozen_embeddings":
        model.get_input_embeddings().weight.requires_grad_(False)
    calls = _count_calls(monkeypatch)
    if case == "no_grad":
        with torch.no_grad():
            model(**inputs)
    else:
        _gradients(model, inputs)
    assert calls == []


def test_bf16_autocast_matches_plain(monkeypatch):
    """Under autocast the head multiplies a bf16 copy of the alias; its gradient comes back in fp32."""
    model, inputs = _model("seq2seq"), _inputs("seq2seq")
    model.float()

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _gradients(model, inputs)

    (loss, grads), (plain_loss, plain_grads) = _with_and_without(monkeypatch, run)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    _assert_close_grads(grads, plain_grads, rtol=1e-5, atol=1e-7)
