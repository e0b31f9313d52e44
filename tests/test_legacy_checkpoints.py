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
