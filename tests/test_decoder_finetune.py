"""Stage 2 of linearizing a decoder (`hf_zformer.conversion.decoder_finetune`): next-token fine-tuning with LoRA
or every weight, distillation from the source's logits, resume, and the merged model's round trip,
on a tiny random Llama converted to Hedgehog zformer with a window."""

import pytest
import torch
from test_llama_decoder import tiny_llama

from hf_zformer.conversion import decoder_finetune
from hf_zformer.conversion.convert_decoder import convert_causal_lm
from hf_zformer.conversion.decoder_finetune import Finetuning, next_token_losses

needs_peft = pytest.mark.skipif(not decoder_finetune.peft_available(), reason="LoRA needs peft")
METHODS = [pytest.param("lora", marks=needs_peft), "full"]


def hedgehog_window(source):
    return convert_causal_lm("tiny", source=source, attention_type=["zformer", "zformer", "full"],
                             zformer_feature_map="hedgehog", attention_window=[4, 4, 0])


def batches(count, length=20):
    return [torch.randint(5, 97, (2, length), generator=torch.Generator().manual_seed(i)) for i in range(count)]


@pytest.mark.parametrize("method", METHODS)
def test_finetuning_lowers_the_loss_and_trains_what_it_names(method):
    source = tiny_llama()
    model = hedgehog_window(source)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = batches(1)[0]
    torch.manual_seed(0)
    finetuning = Finetuning(model, steps=25, learning_rate=1e-2 if method == "lora" else 1e-3, method=method)
    with torch.no_grad():
        before = float(finetuning.losses(ids)["next_token"])
    for _ in range(25):
        losses = finetuning.step(ids)
    assert losses["distillation"] is None and losses["loss"] == losses["next_token"]
    with torch.no_grad():
        after = float(finetuning.losses(ids)["next_token"])
    assert after < 0.7 * before, (before, after)
    merged = finetuning.merged_model()
    assert type(merged).__name__ == "ZformerLlamaForCausalLM"
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, weights[n])}
    maps = {n for n in weights if any(part in n for part in ("query_map", "key_map", "window_gate"))}
    assert maps <= changed
    if method == "lora":  # merged adapters change the targeted projections of every layer, nothing else
        projections = {n for n in weights if any(f"self_attn.{t}." in n for t in ("q_proj", "k_proj", "v_proj", "o_proj"))}
        assert changed == maps | projections
    else:
        assert {n for n in weights if "mlp" in n} <= changed


def test_distillation_is_the_scaled_kl_to_the_teacher():
    student = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0))
    teacher = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    ce, kl = next_token_losses(student, ids, mask, teacher, temperature=2.0)
    terms = []
    for b, length in ((0, 6), (1, 4)):  # predicted tokens: positions 0..length-2
        for t in range(length - 1):
            p, q = torch.softmax(teacher[b, t] / 2, -1), torch.softmax(student[b, t] / 2, -1)
            terms.append(4 * float((p * (p / q).log()).sum()))
    assert float(kl) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    expected_ce = torch.cat([torch.nn.functional.cross_entropy(student[0, :5], ids[0, 1:], reduction="none"),
                             torch.nn.functional.cross_entropy(student[1, :3], ids[1, 1:4], reduction="none")]).mean()
    assert float(ce) == pytest.approx(float(expected_ce), rel=1e-5)
    assert float(next_token_losses(student, ids, None, student)[1]) == pytest.approx(0, abs=1e-6)


def test_distillation_mixes_the_losses_and_pulls_towards_the_source():
    source = tiny_llama()
    ids = batches(1)[0]
    model = hedgehog_window(source)
    finetuning = Finetuning(model, steps=20, learning_rate=1e-3, method="full", teacher=source, distill_weight=0.25)
    with torch.no_grad():
        losses = finetuning.losses(ids)
    assert float(losses["loss"]) == pytest.approx(0.75 * float(losses["next_token"]) + 0.25 * float(losses["distillation"]),
                                                  rel=1e-6)
    only_kl = Finetuning(hedgehog_window(source), steps=20, learning_rate=1e-3, method="full", teacher=source,
                         distill_weight=1.0)
    with torch.no_grad():
        before = float(only_kl.losses(ids)["distillation"])
    for _ in range(20):
        only_kl.step(ids)
    with torch.no_grad():
        assert float(only_kl.losses(ids)["distillation"]) < 0.5 * before


@pytest.mark.parametrize("method", METHODS)
def test_resumed_finetuning_continues_exactly(method):
    source = tiny_llama()
    data = batches(6)

    def run(stop_at=6, state=None):
        torch.manual_seed(0)  # LoRA's A matrices start random
        finetuning = Finetuning(hedgehog_window(source), steps=6, learning_rate=5e-3, method=method, teacher=source,
                                distill_weight=0.5)
        if state is not None:
            finetuning.load_state_dict(state)
        while finetuning.completed < stop_at:
            finetuning.step(data[finetuning.completed])
        return finetuning

    straight = run().merged_model()
    half = run(stop_at=3).state_dict()
    resumed = run(state=half).merged_model()
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    other = Finetuning(hedgehog_window(source), steps=6, method="full" if method == "lora" else "lora") \
        if decoder_finetune.peft_available() else Finetuning(hedgehog_window(source), steps=6, method=method,
                                                              new_attention=False)
    with pytest.raises(ValueError, match="does not match the model"):
        other.load_state_dict(half)


@needs_peft
def test_merged_model_saves_loads_with_remote_code_and_equals_the_adapted_one(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_llama()
    torch.manual_seed(0)
    finetuning = Finetuning(hedgehog_window(source), steps=5, learning_rate=2e-2)
    for ids in batches(5):
        finetuning.step(ids)
    ids = batches(1, length=30)[0]
    with torch.no_grad():
        adapted = finetuning.model(input_ids=ids).logits
        assert any("lora" in n for n, _ in finetuning.model.named_parameters())
    merged = finetuning.merged_model()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "finetuned")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned", trust_remote_code=True)
    assert type(loaded).__name__ == "ZformerLlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits)
        # and it generates with its constant-size cache as the in-memory one does
        torch.testing.assert_close(loaded.generate(ids[:1, :6], max_new_tokens=5, do_sample=False),
                                   merged.generate(ids[:1, :6], max_new_tokens=5, do_sample=False))


def test_bad_arguments_name_the_value(monkeypatch):
    source = tiny_llama()
    model = hedgehog_window(source)
    for kwargs, message in (
        (dict(method="qlora"), "method='qlora'"),
        (dict(steps=0), "steps=0"),
        (dict(learning_rate=-1.0), "learning_rate=-1.0"),
        (dict(distill_weight=1.5, teacher=source), "distill_weight=1.5"),
        (dict(distill_weight=0.5), "distill_weight=0.5 needs a teacher"),
        (dict(temperature=0.0, teacher=source, distill_weight=0.5), "temperature=0.0"),
        (dict(method="full", lora_rank=0, steps=2), None),  # the rank matters to LoRA only
    ):
        kwargs = {"steps": 4, **kwargs}
        if message is None:
            Finetuning(hedgehog_window(source), **kwargs)
            continue
        with pytest.raises(ValueError, match=message):
            Finetuning(model, **kwargs)
    if decoder_finetune.peft_available():
        with pytest.raises(ValueError, match=r"lora_targets=\['gate', 'q_proj'\] names no linear layer.*'gate'"):
            Finetuning(hedgehog_window(source), steps=4, lora_targets=["gate", "q_proj"])
        with pytest.raises(ValueError, match="lora_rank=0"):
            Finetuning(hedgehog_window(source), steps=4, lora_rank=0)
    monkeypatch.setattr(decoder_finetune, "peft_available", lambda: False)
    with pytest.raises(ValueError, match="method='lora' needs the peft package"):
        Finetuning(hedgehog_window(source), steps=4)
