"""The models on an accelerator behave as on the CPU.

`HF_ZFORMER_TEST_DEVICE` picks the device (default `cpu`; `cuda` on a GPU machine):

    HF_ZFORMER_TEST_DEVICE=cuda python -m pytest tests/test_device.py

Every model kind x attention type runs in fp64 on that device and must give the CPU's outputs and
gradients (each fast form a device may take checked against the CPU forms, which tests/test_attention.py
checks against the equations); padding stays exactly invisible, a causal model does not see the
future and decoding with the cache equals one pass, all on the device. Last, autocast (bf16, and
fp16 where the device has it) stays close to fp32 for every attention type at long inputs: the
sums over the sequence must stay fp32, or fp16 overflows. On the CPU the lengths are short (the
test then guards the checks themselves); on CUDA they are 4,096 and 16,384 tokens.
"""

import os

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM
from model_kinds import ATTENTIONS, batch, cases, model, rows

from hf_zformer.modeling.attention import (
    FastformerAttention,
    FullAttention,
    XformerAttention,
    ZformerAttention,
)
from conftest import tiny_config

DEVICE = torch.device(os.environ.get("HF_ZFORMER_TEST_DEVICE", "cpu"))
ON_CPU = DEVICE.type == "cpu"


def _to(inputs: dict, device) -> dict:
    return {name: value.to(device) for name, value in inputs.items()}


def _pair(kind, attention):
    """The same fp64 model on the CPU and on DEVICE."""
    cpu = model(kind, attention).double().eval()
    other = model(kind, attention).double().eval().to(DEVICE)
    return cpu, other


@pytest.mark.parametrize("kind, attention", cases())
def test_outputs_and_gradients_equal_the_cpu(kind, attention):
    cpu, other = _pair(kind, attention)
    inputs = batch(kind)
    cpu_out = cpu(**inputs)
    dev_out = other(**_to(inputs, DEVICE))
    torch.testing.assert_close(dev_out.logits.cpu(), cpu_out.logits, atol=1e-9, rtol=1e-9)
    cpu_out.loss.backward()
    dev_out.loss.backward()
    cpu_grads = dict(cpu.named_parameters())
    tied = {name for name, _ in cpu.named_parameters() if name.endswith("word_embeddings.weight")}
    for name, parameter in other.named_parameters():
        if cpu_grads[name].grad is None:
            assert parameter.grad is None, name
            continue
        # The embedding matrix an LM head shares gathers its gradient from the head's product and every
        # lookup (index_put_ with accumulation): on an H200 in fp64 it agreed with the CPU to 1e-9 to
        # 2e-8 of its largest entry, every other gradient to 1e-9. 1e-7 is still below fp32's rounding.
        tolerance = 1e-7 if name in tied and kind != "classification" else 1e-9
        difference = (parameter.grad.cpu() - cpu_grads[name].grad).abs().max().item()
        scale = 1 + cpu_grads[name].grad.abs().max().item()
        assert difference <= tolerance * scale, f"{name}: gradients differ by {difference:.3e}"


@pytest.mark.parametrize("kind, attention", [c for c in cases() if c[0] != "seq2seq"])
def test_extra_padding_changes_nothing_on_the_device(kind, attention):
    net = model(kind, attention).double().eval().to(DEVICE)
    inputs = rows(batch(kind), 0, 2)
    inputs.pop("labels")
    wide = {name: torch.nn.functional.pad(value, (0, 7)) for name, value in inputs.items()}
    with torch.no_grad():
        narrow_out = net(**_to(inputs, DEVICE)).logits
        wide_out = net(**_to(wide, DEVICE)).logits
    if kind == "classification":
        torch.testing.assert_close(wide_out, narrow_out, atol=1e-12, rtol=1e-12)
        return
    real = inputs["attention_mask"].bool().to(DEVICE)
    width = real.shape[1]
    torch.testing.assert_close(wide_out[:, :width][real], narrow_out[real], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("attention", [a for a in ATTENTIONS if a != "xformer"])
def test_causal_model_neither_peeks_nor_drifts_with_the_cache(attention):
    net = model("causal", attention).double().eval().to(DEVICE)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 61, (2, 12), generator=generator).to(DEVICE)
    changed = ids.clone()
    changed[:, 8:] = torch.randint(5, 61, (2, 4), generator=generator).to(DEVICE)
    with torch.no_grad():
        one_pass = net(input_ids=ids).logits
        future_changed = net(input_ids=changed).logits
        torch.testing.assert_close(future_changed[:, :8], one_pass[:, :8], atol=1e-12, rtol=1e-12)
        out = net(input_ids=ids[:, :5], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for i in range(5, 12):
            out = net(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), one_pass, atol=1e-10, rtol=1e-10)


def test_greedy_generation_equals_the_cpu():
    cpu, other = _pair("seq2seq", "zformer")
    inputs = rows(batch("seq2seq"), 0, 2)
    inputs.pop("labels")
    options = dict(max_new_tokens=8, do_sample=False, num_beams=2, decoder_start_token_id=2, pad_token_id=0)
    cpu_tokens = cpu.generate(**inputs, **options)
    dev_tokens = other.generate(**_to(inputs, DEVICE), **options)
    assert torch.equal(dev_tokens.cpu(), cpu_tokens)


ATTENTION_CLASSES = {
    "full": FullAttention,
    "zformer": ZformerAttention,
    "xformer": XformerAttention,
    "fastformer": FastformerAttention,
}
# (dtype, the largest relative error allowed against fp32): bf16 keeps 8 mantissa bits, fp16 11
AUTOCAST = [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)]
LENGTHS = [256] if ON_CPU else [4096, 16384]


def _autocast_cases():
    for attention in ATTENTION_CLASSES:
        for causal in (False, True):
            if causal and attention == "xformer":
                continue
            for dtype, tolerance in AUTOCAST:
                if ON_CPU and dtype == torch.float16:
                    continue  # fp16 autocast on the CPU is slow and not a configuration users run
                yield attention, causal, dtype, tolerance


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("attention, causal, dtype, tolerance", list(_autocast_cases()))
def test_autocast_stays_close_to_fp32_at_long_inputs(attention, causal, dtype, tolerance, length):
    width, heads = (128, 4) if ON_CPU else (512, 8)
    config = tiny_config(
        attention_type=attention,
        hidden_size=width,
        num_hidden_layers=1,
        num_attention_heads=heads,
        max_position_embeddings=length,
    )
    # the layer as a model initialises it (query/key scores, the sequence projection)
    torch.manual_seed(0)
    net = (AutoModelForCausalLM if causal else AutoModel).from_config(config)
    layer = next(m for m in net.modules() if isinstance(m, ATTENTION_CLASSES[attention])).eval().to(DEVICE)
    x = torch.randn(2, length, width, device=DEVICE)
    # text-like activations: a shared offset makes the sums over the sequence large, where fp16 overflows
    x = x + 3.0 * torch.randn(1, 1, width, device=DEVICE)
    mask = torch.ones(2, length, dtype=torch.long, device=DEVICE)
    mask[1, length - length // 4 :] = 0
    with torch.no_grad():
        reference, _ = layer(x, mask)
        with torch.autocast(DEVICE.type, dtype=dtype):
            low, _ = layer(x, mask)
    real = mask.bool()
    low, reference = low[real].float(), reference[real]
    assert torch.isfinite(low).all(), f"{attention}: non-finite outputs under {dtype} autocast"
    error = ((low - reference).norm() / reference.norm()).item()
    assert error < tolerance, f"{attention} causal={causal} {dtype} n={length}: relative error {error:.2e}"


def test_distillation_on_the_device_fits_as_on_the_cpu(tmp_path):
    """`Distillation(device=...)` runs the attention transfer on the device and gives the CPU's fit and
    weights (fp64); the model and its reference are back where they were afterwards."""
    import copy

    from test_convert import _sentences, make_source
    from transformers import AutoTokenizer

    import hf_zformer
    from hf_zformer.conversion.distillation import distill_attention

    folder, _ = make_source(tmp_path, "bert", "base")
    start = hf_zformer.convert_pretrained(folder, ["zformer", "fastformer"]).double()
    reference = hf_zformer.convert_pretrained(folder, "full").double()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    settings = dict(steps=6, model_steps=3, batch_size=8, learning_rate=3e-3, eval_texts=16)
    on_cpu, on_device = copy.deepcopy(start), copy.deepcopy(start)
    fit_cpu = distill_attention(on_cpu, reference, tokenizer, hf_zformer.Distillation(_sentences(60), **settings),
                                progress=False)
    fit_device = distill_attention(on_device, reference, tokenizer,
                                   hf_zformer.Distillation(_sentences(60), device=DEVICE, **settings), progress=False)
    assert fit_device == fit_cpu
    assert fit_cpu["after"] != fit_cpu["before"]  # it trained
    for model in (on_device, reference):
        assert {p.device.type for p in model.parameters()} == {"cpu"}
    for (name, a), b in zip(on_cpu.named_parameters(), on_device.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)
