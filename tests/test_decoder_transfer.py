"""Attention transfer for converted Llama-family decoders (`hf_zformer.decoder_transfer`) and
scripts/linearize_decoder.py end to end on a tiny random Llama with a word-level tokenizer."""

import gzip
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from test_llama_decoder import tiny_llama

from hf_zformer.convert_decoder import attention_calls, convert_causal_lm, full_attention_copy
from hf_zformer.decoder_transfer import AttentionTransfer, layer_errors, new_attention_parameters, perplexity


def hedgehog_window(source=None):
    return convert_causal_lm("tiny", source=source or tiny_llama(), attention_type=["zformer", "full", "fastformer"],
                             attention_window=[4, 0, 0])


def test_only_the_new_attention_parameters_train_and_the_fit_improves():
    model = hedgehog_window()
    reference = full_attention_copy(model)
    names = set(new_attention_parameters(model))
    assert names == {
        "model.layers.0.self_attn.query_map.weight", "model.layers.0.self_attn.query_map.bias",
        "model.layers.0.self_attn.key_map.weight", "model.layers.0.self_attn.key_map.bias",
        "model.layers.0.self_attn.window_gate", "model.layers.2.self_attn.query_score",
        "model.layers.2.self_attn.key_score", "model.layers.2.self_attn.transform.weight",
    }
    before_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(5, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = layer_errors(model, reference, ids)
    transfer = AttentionTransfer(model, reference, steps=30, learning_rate=3e-2)
    for _ in range(30):
        transfer.step(ids)
    with torch.no_grad():
        after = layer_errors(model, reference, ids)
    assert after.shape == (2,) and bool((after < 0.8 * before).all()), (before, after)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before_weights[n])}
    assert changed == names
    # the full layer is still the source's: its attention output is the reference's exactly
    with torch.no_grad():
        args, expected = attention_calls(reference, ids, None)[1]
        torch.testing.assert_close(model.model.layers[1].self_attn(*args), expected)


def test_resumed_transfer_continues_exactly():
    source = tiny_llama()
    batches = [torch.randint(5, 97, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def run(stop_at=None, state=None):
        torch.manual_seed(0)  # fastformer's W_r starts at a random init
        model = hedgehog_window(source)
        transfer = AttentionTransfer(model, full_attention_copy(model), steps=6)
        if state is not None:
            transfer.load_state_dict(state)
        while transfer.completed < (stop_at or 6):
            transfer.step(batches[transfer.completed])
        return model, transfer

    straight, _ = run()
    _, half = run(stop_at=3)
    resumed, _ = run(state=half.state_dict())
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    model = hedgehog_window(source)
    with pytest.raises(ValueError, match="does not match the model"):
        AttentionTransfer(convert_causal_lm("tiny", source=source, attention_type="zformer"), full_attention_copy(model),
                          steps=2).load_state_dict(half.state_dict())
    with pytest.raises(ValueError, match="nothing to fit"):
        AttentionTransfer(convert_causal_lm("tiny", source=source), full_attention_copy(model), steps=2)


def test_perplexity_is_the_mean_block_loss():
    model = convert_causal_lm("tiny", source=tiny_llama())
    tokens = torch.randint(5, 97, (50,), generator=torch.Generator().manual_seed(0))
    value, losses = perplexity(model, tokens, 16)
    assert len(losses) == 3  # 48 of the 50 tokens
    with torch.no_grad():
        expected = [float(model(input_ids=tokens[i * 16 : (i + 1) * 16][None],
                                labels=tokens[i * 16 : (i + 1) * 16][None]).loss) for i in range(3)]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert value == pytest.approx(math.exp(sum(expected) / 3), rel=1e-5)
    assert perplexity(model, tokens, 16, max_blocks=1)[1] == pytest.approx(expected[:1], rel=1e-5)
    with pytest.raises(ValueError, match="make no block of 64"):
        perplexity(model, tokens, 64)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"] + [f"w{i}" for i in range(92)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_linearize_script_end_to_end_and_resume(tmp_path):
    source = tiny_llama(tie_word_embeddings=True)
    source.save_pretrained(tmp_path / "llama")
    _word_tokenizer().save_pretrained(tmp_path / "llama")
    generator = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 92, (n,), generator=generator))

    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as handle:
        for _ in range(40):
            handle.write(json.dumps({"text": words(30)}) + "\n")
    with gzip.open(tmp_path / "eval.txt.gz", "wt") as handle:
        handle.write(words(200) + "\n")
    command = [sys.executable, str(REPO_ROOT / "scripts" / "linearize_decoder.py"), "--model_name_or_path",
               str(tmp_path / "llama"), "--attention_type", "zformer", "--config_overrides", "attention_window=4",
               "--train_file", str(tmp_path / "train.jsonl.gz"), "--eval_file", str(tmp_path / "eval.txt.gz"),
               "--steps", "4", "--batch_size", "2", "--block_size", "16", "--eval_block_size", "32",
               "--eval_blocks", "3", "--log_every", "2", "--checkpoint_every", "2", "--output_dir",
               str(tmp_path / "run")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step 4/4 error" in result.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert set(results["perplexity"]) == {"source", "converted", "transferred"}
    assert results["config"]["attention_window"] == 4 and results["steps"] == 4
    for entry in results["perplexity"].values():
        assert entry["tokens"] == 3 * 31 and entry["value"] > 1
    # the source's number is the source's own perplexity on those blocks
    tokenizer = _word_tokenizer()
    eval_ids = torch.tensor(tokenizer(gzip.open(tmp_path / "eval.txt.gz", "rt").read())["input_ids"])
    assert results["perplexity"]["source"]["value"] == pytest.approx(perplexity(source, eval_ids, 32, 3)[0], rel=1e-3)
    assert set(results["greedy_samples"]) and (tmp_path / "run" / "model" / "config.json").exists()
    # started again: resumes from the checkpoint (nothing left to train) and keeps the numbers
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "at step 4" in again.stdout
    assert json.loads((tmp_path / "run" / "results.json").read_text())["perplexity"] == results["perplexity"]
    changed = [part if part != "4" else "5" for part in command]  # --steps 5: another run
    refused = subprocess.run(changed, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "holds a run with other arguments" in refused.stderr
    # a folder of the user's files is refused before any work and left as it was
    users = tmp_path / "notes"
    users.mkdir()
    (users / "todo.txt").write_text("mine")
    foreign = [part if part != str(tmp_path / "run") else str(users) for part in command]
    refused = subprocess.run(foreign, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "did not write" in refused.stderr
    assert sorted(p.name for p in users.iterdir()) == ["todo.txt"]
