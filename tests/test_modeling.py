"""Encoder models through the public Auto API, for every attention type."""

import json

import pytest
import torch
from conftest import ATTENTION_TYPES, TINY, CountedOps, random_batch, repad, run_isolated, tiny_config
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
)

import hf_zformer
import model_kinds

AUTO_CLASSES = [AutoModel, AutoModelForSequenceClassification, AutoModelForMaskedLM]
HYBRID = ["fastformer", "xformer"]  # a per-layer list: one entry per layer


def _output(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _real(tensor, mask):
    """Per-token outputs at real positions; pooled (B, C) outputs unchanged."""
    return tensor[mask.bool()] if tensor.dim() == 3 else tensor


def _check_padding_invariance(model):
    ids, mask = random_batch([7, 10, 3])
    base = _output(model, ids, mask)
    # extra padding
    padded = _output(model, *repad(ids, mask, 23))
    torch.testing.assert_close(_real(padded, repad(ids, mask, 23)[1]), _real(base, mask), atol=1e-4, rtol=1e-4)
    # a padded row vs the same row alone, unpadded
    alone = _output(model, ids[2:3, :3], mask[2:3, :3])
    torch.testing.assert_close(_real(base[2:3], mask[2:3]), _real(alone, mask[2:3, :3]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES + [HYBRID])
@pytest.mark.parametrize("auto_class", AUTO_CLASSES, ids=lambda c: c.__name__)
def test_padding_invariance(attention_type, auto_class):
    _check_padding_invariance(auto_class.from_config(tiny_config(attention_type=attention_type)).eval())


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("pooling", ["first", "attention"])
def test_padding_invariance_of_classifier_poolings(attention_type, pooling):
    config = tiny_config(attention_type=attention_type, classifier_pooling=pooling)
    _check_padding_invariance(AutoModelForSequenceClassification.from_config(config).eval())


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_every_parameter_gets_a_gradient(attention_type, pooling):
    # DDP without find_unused_parameters needs every parameter in the graph.
    config = tiny_config(attention_type=attention_type, classifier_pooling=pooling, position_embedding_type="learned",
                         position_embedding_merge="concat")
    for auto_class in AUTO_CLASSES:
        model = auto_class.from_config(config).train()
        ids, mask = random_batch([9, 5])
        out = _output(model, ids, mask)
        out.float().pow(2).mean().backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, f"{auto_class.__name__}: no gradient for {missing}"


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_heads_losses(attention_type):
    ids, mask = random_batch([6, 4, 8])
    mlm = AutoModelForMaskedLM.from_config(tiny_config(attention_type=attention_type))
    labels = ids.masked_fill(mask == 0, -100)
    assert mlm(input_ids=ids, attention_mask=mask, labels=labels).loss > 0
    assert mlm.lm_head.decoder.weight is mlm.zformer.embeddings.word_embeddings.weight  # tied

    for problem, labels, num_labels in [
        ("single_label_classification", torch.tensor([0, 2, 1]), 3),
        ("regression", torch.tensor([0.5, -1.0, 2.0]), 1),
        ("multi_label_classification", torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]), 2),
    ]:
        clf = AutoModelForSequenceClassification.from_config(
            tiny_config(attention_type=attention_type, num_labels=num_labels)
        )
        out = clf(input_ids=ids, attention_mask=mask, labels=labels)
        assert clf.config.problem_type == problem
        assert out.logits.shape == (3, num_labels) and torch.isfinite(out.loss)


def test_outputs_hidden_states_and_tuples():
    model = AutoModel.from_config(tiny_config(attention_type="zformer")).eval()
    ids, mask = random_batch([5, 3])
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    as_tuple = model(input_ids=ids, attention_mask=mask, return_dict=False)
    assert len(as_tuple) == 1
    torch.testing.assert_close(as_tuple[0], out.last_hidden_state)
    # heads: the fields that are set, in order (loss first when labels are given)
    for head in (AutoModelForSequenceClassification, AutoModelForMaskedLM):
        torch.manual_seed(0)
        model_head = head.from_config(tiny_config(attention_type="zformer")).eval()
        labels = torch.tensor([0, 1]) if head is AutoModelForSequenceClassification else ids
        as_dict = model_head(input_ids=ids, attention_mask=mask, labels=labels)
        loss, logits = model_head(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
        torch.testing.assert_close(loss, as_dict.loss)
        torch.testing.assert_close(logits, as_dict.logits)
        (logits_only,) = model_head(input_ids=ids, attention_mask=mask, return_dict=False)
        torch.testing.assert_close(logits_only, as_dict.logits)
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state, out.last_hidden_state)
    with pytest.raises(ValueError, match="exactly one"):
        model(attention_mask=mask)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        model(input_ids=torch.ones(1, 65, dtype=torch.long))


def test_fastformer_model_type():
    config = AutoConfig.for_model("fastformer", **TINY)
    assert isinstance(config, hf_zformer.FastformerConfig) and config.attention_type == "fastformer"
    model = AutoModelForSequenceClassification.from_config(config)
    assert isinstance(model, hf_zformer.FastformerForSequenceClassification)
    assert all(type(layer.attention).__name__ == "FastformerAttention" for layer in model.zformer.encoder.layers)


def test_hybrid_layers_use_their_types():
    model = AutoModel.from_config(tiny_config(attention_type=HYBRID))
    assert [type(layer.attention).__name__ for layer in model.encoder.layers] == [
        "FastformerAttention",
        "XformerAttention",
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=30), "hidden_size=30 is not divisible by num_attention_heads=4"),
        (dict(attention_type="linear"), "attention_type='linear'"),
        (dict(attention_type=["full"]), "attention_type has 1 entries"),
        (dict(attention_type=["full", "bogus"]), r"attention_type\[1\]='bogus'"),
        (dict(attention_type="xformer", xformer_alpha=3), "xformer_alpha=3"),
        (dict(attention_type="xformer", xformer_alpha=16), "xformer_alpha=16"),
        (dict(attention_type="xformer", xformer_beta=1), "xformer_beta=1"),
        (dict(attention_type="xformer", max_position_embeddings=0), "max_position_embeddings=0"),
        (dict(decoder_attention_type="xformer"), "xformer cannot be causal"),
        (dict(num_decoder_layers=2, decoder_attention_type=["full", "xformer"]), "xformer cannot be causal"),
        (dict(fastformer_pooling="max"), "fastformer_pooling='max'"),
        (dict(position_embedding_type="rotary"), "position_embedding_type='rotary'"),
        (dict(position_embedding_merge="expand"), "position_embedding_merge='expand'"),
        (dict(classifier_pooling="cls"), "classifier_pooling='cls'"),
        (dict(cross_attention_type="fastformer"), "cross_attention_type='fastformer'"),
        (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob=1.5"),
        (dict(zformer_scale_init=0), "zformer_scale_init=0"),
        (dict(pad_token_id=500), "pad_token_id=500"),
        (dict(num_attention_heads=0), "num_attention_heads=0"),
        (dict(attention_type="fastformer", fastformer_share_qv="false"), "fastformer_share_qv='false' must be True or False"),
        (dict(scale_embedding=1), "scale_embedding=1 must be True or False"),
    ],
)
def test_bad_configs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


@pytest.mark.parametrize("field, off, on", [("zformer_normalization", "none", "tokens"),
                                           ("fastformer_global_value", False, True)])
def test_a_config_with_a_removed_option_is_refused(tmp_path, field, off, on):
    """Development versions had `zformer_normalization` ("none" = the plain sum, "tokens" = a mean)
    and `fastformer_global_value`; neither beat the model without it and both were removed. A folder
    saved with the "off" value loads as before; one saved with the option on is refused by name
    instead of silently computing a different function."""
    from transformers import AutoConfig

    tiny_config(attention_type="zformer").save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, field: off}))
    assert AutoConfig.from_pretrained(tmp_path).attention_type == "zformer"
    (tmp_path / "config.json").write_text(json.dumps({**saved, field: on}))
    with pytest.raises(ValueError, match=f"{field}={on!r}: this option .* removed"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_save_load_identical(tmp_path, attention_type):
    ids, mask = random_batch([6, 9])
    for auto_class in AUTO_CLASSES:
        model = auto_class.from_config(tiny_config(attention_type=attention_type)).eval()
        model.save_pretrained(tmp_path / auto_class.__name__)
        loaded = auto_class.from_pretrained(tmp_path / auto_class.__name__).eval()
        assert type(loaded) is type(model)
        torch.testing.assert_close(_output(loaded, ids, mask), _output(model, ids, mask), atol=0, rtol=0)


def test_remote_code_round_trip_in_clean_process(tmp_path):
    """Every type and head reloads with trust_remote_code=True where hf_zformer is not importable."""
    ids, mask = random_batch([6, 9])
    expected = {}
    for attention_type in ATTENTION_TYPES:
        for auto_class in AUTO_CLASSES:
            name = f"{attention_type}-{auto_class.__name__}"
            model = auto_class.from_config(tiny_config(attention_type=attention_type)).eval()
            model.save_pretrained(tmp_path / name)
            expected[name] = _output(model, ids, mask)
    fast = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("fastformer", **TINY)).eval()
    fast.save_pretrained(tmp_path / "fastformer-type")
    expected["fastformer-type-AutoModelForSequenceClassification"] = _output(fast, ids, mask)

    saved = json.loads((tmp_path / "full-AutoModel" / "config.json").read_text())
    assert set(saved["auto_map"]) == {
        "AutoConfig", "AutoModel", "AutoModelForSequenceClassification", "AutoModelForMaskedLM",
        "AutoModelForSeq2SeqLM", "AutoModelForCausalLM",
    }
    assert sorted(p.name for p in (tmp_path / "full-AutoModel").glob("*.py")) == [
        "attention.py", "attention_memory.py", "attention_registry.py", "blocks.py", "cache_zformer.py",
        "configuration_zformer.py", "dispatch.py", "modeling_zformer.py", "ops.py", "ops_linear_attention.py",
        "ops_pooling.py", "ops_product.py", "policy.py", "triton_launch.py", "triton_linear_attention.py",
        "triton_pooling.py", "triton_prefix_pool.py", "triton_product.py", "triton_shared_pool.py",
    ]
    torch.save({"ids": ids, "mask": mask}, tmp_path / "batch.pt")
    run_isolated(
        """
        sys.modules["triton"] = None  # as where triton is not installed: the shipped kernels module still imports
        import importlib
        import torch, transformers
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForMaskedLM
        batch = torch.load("batch.pt")
        results = {}
        for name in %r:
            folder = name if not name.startswith("fastformer-type") else "fastformer-type"
            auto_class = getattr(transformers, name.split("-")[-1])
            model = auto_class.from_pretrained(folder, trust_remote_code=True).eval()
            assert model.__module__.startswith("transformers_modules"), model.__module__
            package = model.__module__.rsplit(".", 1)[0]
            assert not importlib.import_module(package + ".triton_launch").AVAILABLE
            out = model(input_ids=batch["ids"], attention_mask=batch["mask"])
            results[name] = out.logits if hasattr(out, "logits") else out.last_hidden_state
        torch.save(results, "remote.pt")
        """
        % (list(expected),),
        cwd=tmp_path,
    )
    remote = torch.load(tmp_path / "remote.pt")
    for name, value in expected.items():
        torch.testing.assert_close(remote[name], value, atol=0, rtol=0, msg=name)


def test_text_classification_pipeline(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = "<pad> <s> </s> <unk> <mask> good bad movie great awful plot".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    config = tiny_config(attention_type="fastformer", vocab_size=len(words), id2label={0: "NEG", 1: "POS"},
                         label2id={"NEG": 0, "POS": 1})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    classify = pipeline("text-classification", model=str(tmp_path))
    results = classify(["good movie", "awful plot great"])
    assert [r["label"] in {"NEG", "POS"} for r in results] == [True, True]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_trainer_step(tmp_path, attention_type):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids, mask = random_batch([7, 5, 9, 4], pad_to=9)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": [0, 1, 1, 0]})
    model = AutoModelForSequenceClassification.from_config(tiny_config(attention_type=attention_type))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", learning_rate=1e-2,
    )
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 1 and result.training_loss > 0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_bf16_autocast_close_to_fp32(attention_type):
    model = AutoModelForSequenceClassification.from_config(tiny_config(attention_type=attention_type)).eval()
    ids, mask = random_batch([12, 30], pad_to=40)
    reference = _output(model, ids, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = _output(model, ids, mask)
        hidden = model.zformer(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    torch.testing.assert_close(low.float(), reference, atol=3e-2, rtol=3e-2)
    # the residual stream stays fp32: bf16 branch outputs are added out of place, not into the branch
    assert [h.dtype for h in hidden] == [torch.float32] * len(hidden)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_gradient_checkpointing_equals_plain_backward(attention_type):
    ids, mask = random_batch([8, 5])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = AutoModelForMaskedLM.from_config(tiny_config(attention_type=attention_type)).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.is_activation_checkpointing
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


# All-padding rows (attention_mask all zeros): an empty pooling or attention gives a zero context,
# so such a row is finite and leaves the other rows (and the batch loss) as they were.
EMPTY_ROW_CASES = [
    *[(dict(attention_type=t, classifier_pooling=p), "sdpa")
      for t in ATTENTION_TYPES for p in ("mean", "first", "attention")],
    (dict(attention_type="full"), "eager"),
    (dict(attention_type="full", classifier_pooling="attention"), "eager"),
    (dict(attention_type="fastformer", fastformer_pooling="mean"), "sdpa"),
    (dict(attention_type="fastformer", fastformer_share_qv=True), "sdpa"),
]


def _empty_row_batch(width):
    """Two real rows (one of `width` tokens) and a third, all-padding row."""
    return random_batch([width, 5, 0])


@pytest.mark.parametrize("overrides, implementation", EMPTY_ROW_CASES)
@pytest.mark.parametrize("width", [9, 40])  # 40 > hidden_size: zformer/fastformer take their folded forms
def test_all_padding_row_is_finite_and_changes_nothing(overrides, implementation, width):
    ids, mask = _empty_row_batch(width)
    for auto_class in AUTO_CLASSES:
        torch.manual_seed(0)
        model = auto_class.from_config(tiny_config(**overrides), attn_implementation=implementation).eval()
        out = _output(model, ids, mask)
        assert torch.isfinite(out).all(), auto_class.__name__
        without = _output(model, ids[:2], mask[:2])
        torch.testing.assert_close(_real(out[:2], mask[:2]), _real(without, mask[:2]), atol=1e-5, rtol=1e-5)
        out.float().pow(2).mean().backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f"{auto_class.__name__}: non-finite gradients for {bad}"
    model = AutoModelForSequenceClassification.from_config(tiny_config(**overrides), attn_implementation=implementation)
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1])).loss)


# Positions come from the attention mask (the number of real tokens before a token), so left,
# right and no padding give every real token the same position and the same output.


def left_pad(ids, mask):
    """The same batch with its padding moved to the left of every row."""
    shifts = (mask.shape[1] - mask.sum(1)).tolist()
    return (torch.stack([row.roll(s) for row, s in zip(ids, shifts)]),
            torch.stack([row.roll(s) for row, s in zip(mask, shifts)]))


POSITION_VARIANTS = [dict(), dict(position_embedding_type="learned", position_embedding_merge="concat")]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES + [HYBRID])
@pytest.mark.parametrize("positions", POSITION_VARIANTS, ids=["sinusoidal-add", "learned-concat"])
@pytest.mark.parametrize("pooling", ["mean", "first", "attention"])
def test_left_padding_equals_right_padding_and_no_padding(attention_type, positions, pooling):
    ids, mask = random_batch([7, 10, 3], pad_to=12)
    left_ids, left_mask = left_pad(ids, mask)
    classes = AUTO_CLASSES if pooling == "mean" else [AutoModelForSequenceClassification]
    for auto_class in classes:
        torch.manual_seed(0)
        config = tiny_config(attention_type=attention_type, classifier_pooling=pooling, **positions)
        model = auto_class.from_config(config).eval()
        right = _output(model, ids, mask)
        left = _output(model, left_ids, left_mask)
        torch.testing.assert_close(_real(left, left_mask), _real(right, mask), atol=1e-5, rtol=1e-5)
        for row, length in enumerate(mask.sum(1).tolist()):
            alone = _output(model, ids[row : row + 1, :length], mask[row : row + 1, :length])
            torch.testing.assert_close(_real(left[row : row + 1], left_mask[row : row + 1]),
                                       _real(alone, mask[row : row + 1, :length]), atol=1e-5, rtol=1e-5)


def test_layer_positions_are_settled_once_per_forward(monkeypatch):
    """Xformer layers get positions only where they need them (left padding); whether they do is
    settled once per forward by the model, not once per layer (a host synchronisation each)."""
    from hf_zformer.modeling.modeling_zformer import position_ids_from_mask

    ids, mask = random_batch([7, 10, 3], pad_to=12)
    left_ids, left_mask = left_pad(ids, mask)
    model = AutoModel.from_config(tiny_config(attention_type=["xformer", "zformer"])).eval()
    seen = []
    for layer in model.encoder.layers:
        original = layer.forward
        monkeypatch.setattr(layer, "forward", lambda *a, _f=original, **k: seen.append(a[2]) or _f(*a, **k))
    model(input_ids=ids, attention_mask=mask)  # right padding: every real token at its column
    assert seen == [None, None]
    seen.clear()
    model(input_ids=left_ids, attention_mask=left_mask)
    assert all(torch.equal(p, position_ids_from_mask(left_mask)) for p in seen) and len(seen) == 2
    plain = AutoModel.from_config(tiny_config(attention_type="zformer")).eval()
    assert plain._layer_positions(position_ids_from_mask(left_mask), left_mask, 0) is None  # no xformer layer


@pytest.mark.parametrize("kind,attention", model_kinds.cases())
def test_host_reads_do_not_grow_with_depth(kind, attention):
    """A training step on a padded batch (forward and backward, at lengths where the folded forms
    apply) reads values back to the host only where the masks enter the model, never per layer:
    two more layers add no read."""
    inputs = model_kinds.batch(kind, rows=3)
    inputs = {name: torch.cat([value[:, :1].expand(-1, 24), value], 1) if value.dim() == 2 else value
              for name, value in inputs.items()}  # 24 real tokens first: past the width, the folded forms apply
    reads, shallow = [], model_kinds.config(kind, attention)
    for layers in (2, 4):
        per_layer = {field: getattr(shallow, field) * (layers // 2) for field in
                     ("attention_type", "decoder_attention_type", "cross_attention_type")
                     if isinstance(getattr(shallow, field, None), list)}  # a hybrid's list, one entry per layer
        model = model_kinds.model(kind, attention, num_hidden_layers=layers, num_decoder_layers=layers,
                                  max_position_embeddings=64, **per_layer)
        with _host_reads() as counter:
            model(**{name: value.clone() for name, value in inputs.items()}).loss.backward()
        reads.append(counter.count)
    assert 0 < reads[0] == reads[1], reads


def _host_reads():
    """A counter of reads of a value back to the host (`bool(t)`, `int(t)`, `t.item()`): on a GPU each
    waits for the queue. Under inference mode `bool(t)` reaches the dispatcher as `is_nonzero`, and
    `int(t)` as `item`."""
    reads = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.item.default)
    return CountedOps(lambda func, _: func in reads)


@pytest.mark.parametrize("attention", ["full", "zformer", "fastformer"])
def test_an_encoder_decoder_reads_its_source_mask_once_per_stack(attention):
    """The source mask enters the encoder and the decoder's cross-attention: a training step on a
    padded batch reads it back once in each stack, and a decoding step (as generation calls it,
    encoder outputs given) once, never per layer."""
    from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

    model = model_kinds.model("seq2seq", attention)
    inputs = model_kinds.batch("seq2seq", rows=3)
    with _host_reads() as counter:
        model(**inputs).loss.backward()
    assert counter.count == 2
    model.eval()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
        token, cache = torch.full((3, 1), model.config.decoder_start_token_id), None
        with _host_reads() as counter:
            for _ in range(3):
                output = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=token,
                               past_key_values=cache, use_cache=True)
                token, cache = output.logits[:, -1:].argmax(-1), getattr(output, CACHE_FIELD)
        assert counter.count == 3


def test_a_mask_is_read_at_every_call():
    """`drop_full_mask` reads the mask each time it is called (a mask written in place in between
    gives the new answer), in one read back to the host."""
    from hf_zformer.modeling.blocks import drop_full_mask

    mask = torch.ones(2, 4, dtype=torch.long)
    mask[1, 2:] = 0
    with _host_reads() as counter:
        assert drop_full_mask(mask) is mask and drop_full_mask(mask) is mask
    assert counter.count == 2
    mask[1, 2:] = 1  # no padding left
    assert drop_full_mask(mask) is None
    mask[0, 3] = 0
    assert drop_full_mask(mask) is mask
    with torch.inference_mode():
        assert drop_full_mask(torch.ones(2, 4)) is None


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_explicit_position_ids(attention_type):
    from hf_zformer.modeling.modeling_zformer import position_ids_from_mask

    ids, mask = random_batch([7, 10, 3])
    left_ids, left_mask = left_pad(ids, mask)
    positions = position_ids_from_mask(left_mask)
    assert positions[2].tolist() == [0] * 7 + [0, 1, 2]
    assert position_ids_from_mask(left_mask, past_length=4, offset=2)[2].tolist() == [0] * 7 + [6, 7, 8]
    for auto_class in AUTO_CLASSES:
        model = auto_class.from_config(tiny_config(attention_type=attention_type)).eval()
        derived = _output(model, left_ids, left_mask)
        given = model(input_ids=left_ids, attention_mask=left_mask, position_ids=positions)
        given = given.logits if hasattr(given, "logits") else given.last_hidden_state
        torch.testing.assert_close(given, derived, atol=0, rtol=0)
        shifted = model(input_ids=left_ids, attention_mask=left_mask, position_ids=positions + 5)
        shifted = shifted.logits if hasattr(shifted, "logits") else shifted.last_hidden_state
        assert not torch.allclose(_real(shifted, left_mask), _real(derived, left_mask))
        with pytest.raises(ValueError, match="max_position_embeddings=64"):
            model(input_ids=left_ids, attention_mask=left_mask, position_ids=positions + 60)
        with pytest.raises(ValueError, match="position_ids"):
            model(input_ids=left_ids, attention_mask=left_mask, position_ids=positions - 1)
        with pytest.raises(ValueError, match="position_ids"):
            model(input_ids=left_ids, attention_mask=left_mask, position_ids=positions[:, :4])


# Nothing silently swallowed: every argument is used, or refused with an error that names it.


def _zformer_model(auto_class):
    return auto_class.from_config(tiny_config(attention_type="zformer")).eval()


@pytest.mark.parametrize("auto_class", AUTO_CLASSES, ids=lambda c: c.__name__)
def test_unknown_keyword_argument_raises(auto_class):
    ids, mask = random_batch([5, 3])
    with pytest.raises(TypeError, match="bogus_argument"):
        _zformer_model(auto_class)(input_ids=ids, attention_mask=mask, bogus_argument=1)


@pytest.mark.parametrize("auto_class", AUTO_CLASSES, ids=lambda c: c.__name__)
def test_head_mask_raises(auto_class):
    ids, mask = random_batch([5, 3])
    with pytest.raises(ValueError, match="head_mask"):
        _zformer_model(auto_class)(input_ids=ids, attention_mask=mask, head_mask=torch.ones(2, 4))


@pytest.mark.parametrize("auto_class", AUTO_CLASSES, ids=lambda c: c.__name__)
def test_token_type_ids_zeros_accepted_non_zero_raise(auto_class):
    model = _zformer_model(auto_class)
    ids, mask = random_batch([5, 3])
    # all zeros (what BERT tokenizers send for one segment) is accepted and changes nothing
    zeros = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    torch.testing.assert_close(zeros[0], model(input_ids=ids, attention_mask=mask)[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="token_type_ids"):
        model(input_ids=ids, attention_mask=mask, token_type_ids=torch.ones_like(ids))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_output_attentions_of_full_layers(implementation):
    ids, mask = random_batch([6, 4])
    for auto_class in AUTO_CLASSES:
        model = auto_class.from_config(tiny_config(attention_type="full"), attn_implementation=implementation).eval()
        plain = model(input_ids=ids, attention_mask=mask)
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        torch.testing.assert_close(out[0], plain[0], atol=1e-6, rtol=1e-6)
        assert len(out.attentions) == TINY["num_hidden_layers"]
        for weights in out.attentions:
            assert weights.shape == (2, TINY["num_attention_heads"], 6, 6)
            torch.testing.assert_close(weights.sum(-1), torch.ones(2, TINY["num_attention_heads"], 6))
            assert weights[1, :, :, 4:].abs().max() == 0  # padded keys get no weight
        assert len(model(input_ids=ids, attention_mask=mask, output_attentions=True, return_dict=False)) == 2
    # the weights are those of the layer's softmax: recompute the first layer's by hand
    model = AutoModel.from_config(tiny_config(attention_type="full")).eval()
    layer = model.encoder.layers[0]
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    x = layer.attention_norm(out.hidden_states[0])
    heads = TINY["num_attention_heads"]
    q = layer.attention.query(x).view(2, 6, heads, -1).transpose(1, 2)
    k = layer.attention.key(x).view(2, 6, heads, -1).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    expected = torch.softmax(scores.masked_fill(mask[:, None, None, :] == 0, float("-inf")), -1)
    torch.testing.assert_close(out.attentions[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_type", ["zformer", "xformer", "fastformer", ["full", "fastformer"]])
def test_output_attentions_raises_for_layers_without_attention_matrix(attention_type):
    model = AutoModelForSequenceClassification.from_config(tiny_config(attention_type=attention_type))
    ids, mask = random_batch([5, 3])
    kind = attention_type if isinstance(attention_type, str) else attention_type[1]
    with pytest.raises(ValueError, match=f"output_attentions.*{kind}"):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


@pytest.mark.parametrize("auto_class", [AutoModelForSequenceClassification, AutoModelForMaskedLM],
                         ids=lambda c: c.__name__)
def test_loss_is_normalised_by_num_items_in_batch(auto_class):
    """Trainer passes num_items_in_batch (the label count over all gradient-accumulation micro-batches):
    the loss is then the sum over this micro-batch divided by it, as transformers' heads do."""
    model = auto_class.from_config(tiny_config(attention_type="fastformer", num_labels=3)).eval()
    ids, mask = random_batch([6, 4, 5])
    if auto_class is AutoModelForMaskedLM:
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.tensor([0, 2, 1])
    count = int((labels != -100).sum())
    mean = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    summed = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(4 * count)).loss
    torch.testing.assert_close(summed, mean / 4)
    assert model.accepts_loss_kwargs  # Trainer then leaves the gradient-accumulation scaling to this loss


def test_fill_mask_pipeline_with_token_type_ids(tmp_path):
    """A BERT-style tokenizer sends token_type_ids (all zeros): the pipeline runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, pipeline

    words = "<pad> <s> </s> <unk> <mask> good bad movie great awful plot".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        mask_token="<mask>", model_input_names=["input_ids", "token_type_ids",
                                                                                "attention_mask"])
    assert "token_type_ids" in tokenizer("good movie")
    model = AutoModelForMaskedLM.from_config(tiny_config(attention_type="full", vocab_size=len(words)))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    fill = pipeline("fill-mask", model=str(tmp_path), top_k=2)
    assert len(fill("good <mask> plot")) == 2


@pytest.mark.parametrize("new_size, multiple, expected", [(120, None, 120), (50, None, 50), (100, 64, 128)])
@pytest.mark.parametrize("auto_class", AUTO_CLASSES, ids=lambda c: c.__name__)
def test_resize_token_embeddings(tmp_path, auto_class, new_size, multiple, expected):
    model = auto_class.from_config(tiny_config(attention_type="zformer")).eval()
    keys = set(model.state_dict())
    if auto_class is AutoModelForMaskedLM:
        with torch.no_grad():
            model.lm_head.bias.normal_()
        old_bias = model.lm_head.bias.detach().clone()
    model.resize_token_embeddings(new_size, pad_to_multiple_of=multiple)
    assert model.get_input_embeddings().weight.shape[0] == expected == model.config.vocab_size
    ids, mask = random_batch([6, 4], vocab_size=40)
    ids[0, 0] = expected - 1  # a token only the resized table has
    out = _output(model, ids, mask)
    if auto_class is AutoModelForMaskedLM:
        assert out.shape == (2, 6, expected) and model.lm_head.bias.shape == (expected,)
        kept = min(expected, TINY["vocab_size"])
        torch.testing.assert_close(model.lm_head.bias[:kept], old_bias[:kept], atol=0, rtol=0)
        assert model.lm_head.decoder.weight is model.get_input_embeddings().weight  # still tied
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=ids).loss)
    assert set(model.state_dict()) == keys  # checkpoint keys unchanged
    model.save_pretrained(tmp_path)
    loaded = auto_class.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_output(loaded, ids, mask), out, atol=0, rtol=0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_attention_heads", 5, "hidden_size=32 is not divisible by num_attention_heads=5"),
        ("attention_type", "linear", "attention_type='linear'"),
        ("decoder_attention_type", "xformer", "xformer cannot be causal"),
        ("pad_token_id", 500, "pad_token_id=500"),
    ],
)
def test_config_fields_set_after_construction_are_validated_when_the_model_is_built(field, value, message):
    from transformers import AutoModelForSeq2SeqLM

    for auto_class in [*AUTO_CLASSES, AutoModelForSeq2SeqLM]:
        config = tiny_config(attention_type="zformer")
        setattr(config, field, value)
        with pytest.raises(ValueError, match=message):
            auto_class.from_config(config)


@pytest.mark.parametrize("attention_type, warns", [("zformer", True), ("fastformer", True), ("full", False),
                                                   ("xformer", False)])
def test_attention_dropout_a_type_cannot_use_is_named_once_when_training(attention_type, warns, monkeypatch):
    """Zformer and Fastformer form no attention probabilities: `attention_probs_dropout_prob` > 0 does
    nothing there, and the first training forward says so (once); evaluation and p = 0 stay silent."""
    from transformers import AutoModel

    from hf_zformer.modeling import attention as attention_module

    messages = []
    monkeypatch.setattr(attention_module.logger, "warning_once", lambda message: messages.append(message))
    ids = torch.randint(5, 97, (2, 6))
    for p, training in ((0.1, False), (0.0, True), (0.1, True)):
        model = AutoModel.from_config(tiny_config(attention_type=attention_type, attention_probs_dropout_prob=p))
        model.train(training)
        model(input_ids=ids)
    assert len(messages) == (2 if warns else 0)  # one per layer of the p = 0.1 training model (2 layers)
    if warns:
        assert "attention_probs_dropout_prob=0.1 does nothing in this model" in messages[0] and "silence" in messages[0]


@pytest.mark.parametrize("auto, types, expected", [
    ("AutoModelForSequenceClassification", dict(attention_type="fastformer"), 0.0),
    ("AutoModelForCausalLM", dict(attention_type="zformer"), 0.0),
    ("AutoModelForSequenceClassification", dict(attention_type=["zformer", "full"]), 0.1),
    ("AutoModelForSequenceClassification", dict(attention_type="xformer"), 0.1),
    ("AutoModelForSeq2SeqLM", dict(attention_type="zformer", decoder_attention_type="zformer"), 0.1),  # full cross
    ("AutoModelForSeq2SeqLM", dict(attention_type="zformer", decoder_attention_type="zformer",
                                   cross_attention_type="zformer"), 0.0),
])
def test_attention_dropout_default_follows_the_layers_built(auto, types, expected, monkeypatch, tmp_path):
    """The default rate is BERT's 0.1 where a layer forms attention probabilities and 0 where none
    does: the model computes what the former default 0.1 computed, a linear model trains without a
    warning about a value nobody set, and the saved config holds the rate."""
    import transformers

    from hf_zformer.modeling import attention as attention_module

    messages = []
    monkeypatch.setattr(attention_module.logger, "warning_once", lambda message: messages.append(message))
    config = tiny_config(**types, num_decoder_layers=1, attention_probs_dropout_prob=None)
    assert config.attention_probs_dropout_prob is None
    model = getattr(transformers, auto).from_config(config).train()
    assert model.config.attention_probs_dropout_prob == expected
    ids = torch.randint(5, 97, (2, 6))
    extra = {"labels": ids} if auto == "AutoModelForSeq2SeqLM" else {}
    model(input_ids=ids, **extra)
    assert not messages  # hybrids too: the rate drops the probabilities of their full layers
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_probs_dropout_prob"] == expected
    explicit = getattr(transformers, auto).from_config(tiny_config(**types, num_decoder_layers=1,
                                                                   attention_probs_dropout_prob=0.1))
    assert explicit.config.attention_probs_dropout_prob == 0.1  # a value that was set stays


def test_types_with_attention_dropout_are_those_the_config_names():
    from hf_zformer.modeling import ATTENTION_CLASSES
    from hf_zformer.modeling.configuration_zformer import PROBABILITY_ATTENTION_TYPES

    assert {kind for kind, cls in ATTENTION_CLASSES.items() if cls.HAS_ATTENTION_DROPOUT} == set(PROBABILITY_ATTENTION_TYPES)


@pytest.mark.parametrize("kind", ["masked", "seq2seq", "causal", "classification"])
def test_fp64_model_keeps_fp64_losses_and_pooling(kind):
    """Losses and attention-pooling scores go up to fp32 under bf16/fp16 but never down: an fp64 model
    (gradient checks, the device test) gets an fp64 loss equal to the cross-entropy of its own logits."""
    from model_kinds import batch, model

    overrides = {"classifier_pooling": "attention"} if kind == "classification" else {}
    net = model(kind, "zformer", **overrides).double().eval()
    inputs = batch(kind)
    out = net(**inputs)
    assert out.loss.dtype == torch.float64 and out.logits.dtype == torch.float64
    logits, labels = out.logits, inputs["labels"]
    if kind == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    torch.testing.assert_close(out.loss, expected, rtol=1e-13, atol=0)


def test_fp64_attention_pooling_equals_an_fp64_softmax():
    """The attention pooling of an fp64 model weighs tokens by an fp64 softmax of its scores over the
    real tokens (scores are raised to fp32 under bf16, never lowered): equal to the direct
    computation to fp64 precision, which scores rounded to fp32 would miss by ~1e-8."""
    from model_kinds import batch, model

    net = model("classification", "zformer", classifier_pooling="attention").double().eval()
    inputs = batch("classification")
    hidden = net.zformer(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    pooler = net.pooler
    scores = pooler.score(torch.tanh(pooler.projection(hidden))).squeeze(-1)  # (B, N), fp64
    weights = torch.softmax(scores.masked_fill(inputs["attention_mask"] == 0, float("-inf")), dim=1)
    expected = (weights[..., None] * hidden).sum(1)
    torch.testing.assert_close(pooler(hidden, inputs["attention_mask"]), expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind", list(model_kinds.AUTO_CLASSES))
def test_inputs_that_do_not_fit_are_named_with_their_shapes(kind):
    """A 1-D input, an empty sequence, a mask of another shape, a cache of another batch and a
    mask that is not 0/1 (it changed the outputs) were bare shape errors or silently taken."""
    from hf_zformer.modeling.modeling_zformer import CACHE_FIELD

    model = model_kinds.model(kind, "zformer").eval()
    ids = torch.randint(5, 61, (2, 6))
    extra = {"decoder_input_ids": torch.ones(2, 3, dtype=torch.long)} if kind == "seq2seq" else {}
    cases = [
        (dict(input_ids=ids[0]), r"input_ids has shape \(6,\); expected \(batch, tokens\)"),
        (dict(input_ids=ids[:, :0]), r"input_ids has shape \(2, 0\): an empty sequence"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 5)),
         r"attention_mask has shape \(2, 5\), but input_ids has shape \(2, 6\): expected \(2, 6\)"),
        (dict(input_ids=ids, attention_mask=torch.ones(3, 6)), r"attention_mask has shape \(3, 6\)"),
    ]
    for mask_value in (0.5, float("-inf"), 2):
        mask = torch.ones(2, 6)
        mask[1, 3:] = mask_value
        cases.append((dict(input_ids=ids, attention_mask=mask),
                      f"attention_mask must hold only 1 \\(a real token\\) and 0 \\(padding\\), but it holds "
                      f"{mask_value}"))
    with torch.no_grad():
        for inputs, message in cases:
            with pytest.raises(ValueError, match=message):
                model(**inputs, **extra)
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])  # 0/1 as long, float or bool: taken alike
        outputs = [model(input_ids=ids, attention_mask=m, **extra).logits for m in (mask, mask.float(), mask.bool())]
        assert all(torch.equal(outputs[0], other) for other in outputs[1:])
        if kind in ("causal", "seq2seq"):
            decoder = "decoder_input_ids" if kind == "seq2seq" else "input_ids"
            first = {"input_ids": ids, decoder: ids[:, :3]} if kind == "seq2seq" else {"input_ids": ids}
            cache = getattr(model(**first, use_cache=True), CACHE_FIELD)
            more = torch.randint(5, 61, (3, 6))
            step = {"input_ids": more, decoder: more[:, :1]} if kind == "seq2seq" else {"input_ids": more[:, :1]}
            with pytest.raises(ValueError, match=f"the cache holds a batch of 2 sequences, but {decoder} has shape "
                                                 r"\(3, 1\) \(a batch of 3\)"):
                model(**step, past_key_values=cache, use_cache=True)


def _every_class():
    from hf_zformer.modeling import modeling_zformer

    return [cls for pair in modeling_zformer.AUTO_CLASSES.values() for cls in pair]


@pytest.mark.parametrize("model_class", _every_class(), ids=lambda cls: cls.__name__)
def test_building_a_model_leaves_its_config_as_it_was(model_class):
    """What a model settles in its config (an encoder-decoder or not, the attention dropout default,
    the auto_map) goes into its own copy: a config builds every class the same, in any order."""
    config = model_class.config_class(**{**TINY, "attention_type": "zformer", "decoder_attention_type": "full",
                                         "num_decoder_layers": 1, "attention_probs_dropout_prob": None})
    before = config.to_dict()
    model = model_class(config)
    assert config.to_dict() == before
    assert model.config.is_encoder_decoder == ("ConditionalGeneration" in model_class.__name__)
    assert model.config.attention_probs_dropout_prob is not None and model.config.auto_map
    for name, module in model.named_modules():
        if isinstance(module, hf_zformer.ZformerPreTrainedModel):
            assert module.config is model.config, name  # parts read the settings of the model they are in


def test_generative_classes_name_the_generation_mixin_among_their_bases():
    """transformers expects each generative class to inherit the generation mixin directly."""
    classes = [*_every_class(), hf_zformer.ZformerLlamaForCausalLM, hf_zformer.ZformerLlamaModel]
    generative = [cls for cls in classes if cls.can_generate()]
    assert {cls.__name__ for cls in generative} == {
        "ZformerForConditionalGeneration", "FastformerForConditionalGeneration", "ZformerForCausalLM",
        "FastformerForCausalLM", "ZformerLlamaForCausalLM"}
    for cls in generative:
        assert "GenerationMixin" in str(cls.__bases__), cls.__bases__
