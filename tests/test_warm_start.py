"""Warm start: the BERT-family architecture options, and converting BERT / RoBERTa / DistilBERT
checkpoints into Zformer-family models (hf_zformer.convert_pretrained)."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_checkpoint_saved_before_the_bert_options_loads_with_identical_outputs():
    """tests/fixtures/zformer-c2c5a7e was saved by the code at commit c2c5a7e (before post-LayerNorm,
    token types, embedding LayerNorm, position offsets and the pooler head existed; made by
    make_zformer_c2c5a7e.py): its config lacks every new field and must give the same outputs."""
    folder = FIXTURES / "zformer-c2c5a7e"
    expected = json.loads((folder / "expected.json").read_text())
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(expected["input_ids"]),
            attention_mask=torch.tensor(expected["attention_mask"]),
            output_hidden_states=True,
        )
    torch.testing.assert_close(out.logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.hidden_states[-1], torch.tensor(expected["last_hidden_state"]), rtol=0, atol=1e-6)
