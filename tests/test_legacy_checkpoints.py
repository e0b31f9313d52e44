"""Checkpoints saved by earlier code load with identical outputs (tests/fixtures, each made by the
script beside it at the commit in its name)."""

import json
import re
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_seq2seq_saved_before_the_attention_owned_its_output_projection_loads_with_identical_outputs():
    """seq2seq-9c39eed has the keys `*.self_attention_output.*` / `*.cross_attention_output.*` (now
    `*.self_attention.output.*`, ...): renamed on load, logits and beam search outputs unchanged."""
    folder = FIXTURES / "seq2seq-9c39eed"
    expected = json.loads((folder / "expected.json").read_text())
    model, info = AutoModelForSeq2SeqLM.from_pretrained(folder, output_loading_info=True)
    model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = {k: torch.tensor(expected[k]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(**batch, decoder_input_ids=torch.tensor(expected["decoder_input_ids"])).logits
        generated = model.generate(**batch, max_new_tokens=6, min_new_tokens=6, num_beams=2)
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-5)
    assert generated.tolist() == expected["generated"]


def test_old_checkpoints_load_through_remote_code_with_identical_outputs(tmp_path):
    """The same old checkpoints with today's modeling files beside them (as the Hub serves a model
    re-uploaded with new code), loaded with trust_remote_code=True in a process without hf_zformer."""
    import shutil

    from conftest import REPO_ROOT, run_isolated

    for name in ("seq2seq-9c39eed", "zformer-c2c5a7e"):
        shutil.copytree(FIXTURES / name, tmp_path / name)
        for source in (REPO_ROOT / "hf_zformer" / "modeling").glob("*.py"):
            if source.name != "__init__.py":
                shutil.copy(source, tmp_path / name / source.name)
    run_isolated(
        """
        import json, torch
        from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification
        for name, auto in (("seq2seq-9c39eed", AutoModelForSeq2SeqLM),
                           ("zformer-c2c5a7e", AutoModelForSequenceClassification)):
            expected = json.load(open(name + "/expected.json"))
            model, info = auto.from_pretrained(name, trust_remote_code=True, output_loading_info=True)
            assert model.__module__.startswith("transformers_modules"), model.__module__
            assert not info["missing_keys"] and not info["unexpected_keys"], info
            batch = {k: torch.tensor(expected[k]) for k in ("input_ids", "attention_mask")}
            if "decoder_input_ids" in expected:
                batch["decoder_input_ids"] = torch.tensor(expected["decoder_input_ids"])
            with torch.no_grad():
                logits = model.eval()(**batch).logits
            torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-5)
        """,
        cwd=tmp_path,
    )


def _make_log_scale_scalar(folder) -> int:
    """Rewrite `folder`'s model.safetensors with every `log_scale` as a 0-d tensor, as versions before
    0.2.0 saved it. Returns how many were rewritten."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    names = [name for name in tensors if name.endswith("log_scale")]
    for name in names:
        assert tensors[name].shape == (1,), (name, tensors[name].shape)
        tensors[name] = tensors[name].reshape(())
    save_file(tensors, path, metadata={"format": "pt"})
    return len(names)


def _log_scales(model):
    return {name: p for name, p in model.named_parameters() if name.endswith("log_scale")}


def test_scalar_log_scale_of_earlier_versions_loads_as_shape_one_with_identical_outputs(tmp_path):
    """A checkpoint whose `log_scale` is 0-d (saved before 0.2.0) loads into today's (1,) parameter with
    the same outputs, every model kind, through from_pretrained, load_state_dict and remote code; saved
    again, it is (1,)."""
    from conftest import run_isolated
    from model_kinds import AUTO_CLASSES, batch, model
    from safetensors.torch import load_file

    expected, inputs = {}, {}
    for kind, auto_class in AUTO_CLASSES.items():
        original = model(kind, "zformer").eval()
        with torch.no_grad():
            for parameter in _log_scales(original).values():
                parameter.uniform_(1.0, 3.0)  # not the initial value: the loaded one must be used
        inputs[kind] = batch(kind)
        with torch.no_grad():
            expected[kind] = original(**inputs[kind]).logits
        original.save_pretrained(tmp_path / kind)
        assert _make_log_scale_scalar(tmp_path / kind) > 0

        loaded, info = auto_class.from_pretrained(tmp_path / kind, output_loading_info=True)
        assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
        assert all(p.shape == (1,) for p in _log_scales(loaded).values())
        with torch.no_grad():
            assert torch.equal(loaded.eval()(**inputs[kind]).logits, expected[kind]), kind
        loaded.save_pretrained(tmp_path / f"{kind}-again")
        saved = load_file(tmp_path / f"{kind}-again" / "model.safetensors")
        assert all(saved[name].shape == (1,) for name in saved if name.endswith("log_scale"))

        scalar_state = {name: (t.reshape(()) if name.endswith("log_scale") else t)
                        for name, t in original.state_dict().items()}
        fresh = model(kind, "zformer", seed=1).eval()
        fresh.load_state_dict(scalar_state)
        with torch.no_grad():
            assert torch.equal(fresh(**inputs[kind]).logits, expected[kind]), kind

    torch.save(inputs, tmp_path / "inputs.pt")
    run_isolated(
        f"""
        import torch, transformers
        inputs, results = torch.load("inputs.pt"), {{}}
        for kind, auto in {({kind: cls.__name__ for kind, cls in AUTO_CLASSES.items()})!r}.items():
            model, info = getattr(transformers, auto).from_pretrained(kind, trust_remote_code=True,
                                                                      output_loading_info=True)
            assert model.__module__.startswith("transformers_modules"), model.__module__
            assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
            assert all(p.shape == (1,) for n, p in model.named_parameters() if n.endswith("log_scale"))
            with torch.no_grad():
                results[kind] = model.eval()(**inputs[kind]).logits
        torch.save(results, "remote.pt")
        """,
        cwd=tmp_path,
    )
    remote = torch.load(tmp_path / "remote.pt")
    for kind, logits in expected.items():
        assert torch.equal(remote[kind], logits), kind


def test_registered_key_patterns_each_name_a_saved_key_of_every_model_kind(tmp_path):
    """transformers checks that every pattern of a model type's registered mapping names a key the
    model saves; the 0-d `log_scale` reshape joins only the loads of models that have one."""
    from model_kinds import cases, model
    from safetensors.torch import load_file
    from transformers.conversion_mapping import get_model_conversion_mapping

    for kind, attention in cases():
        built = model(kind, attention)
        built.save_pretrained(tmp_path / f"{kind}-{attention}")
        saved = load_file(tmp_path / f"{kind}-{attention}" / "model.safetensors")
        for conversion in get_model_conversion_mapping(built, add_legacy=False):
            for pattern in conversion.source_patterns:
                assert any(re.search(pattern, key) for key in saved), (kind, attention, conversion)
