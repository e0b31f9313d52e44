"""Checkpoints saved by earlier code load with identical outputs (tests/fixtures, each made by the
script beside it at the commit in its name)."""

import json
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
