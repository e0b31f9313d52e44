"""Attention transfer for converted Llama-family decoders (`hf_zformer.conversion.decoder_transfer`) and
scripts/linearize_decoder.py end to end on a tiny random Llama with a word-level tokenizer."""

import gzip
import json
import math
import sys

import pytest
import torch
import warm_scripts
from conftest import REPO_ROOT
from transformers import AutoModelForCausalLM
from test_llama_decoder import tiny_llama

from hf_zformer.conversion.convert_decoder import attention_calls, convert_causal_lm, full_attention_copy
from hf_zformer.conversion.decoder_finetune import peft_available
from hf_zformer.conversion.decoder_transfer import AttentionTransfer, layer_errors, new_attention_parameters, perplexity


def hedgehog_window(source=None, sinks=0, horizon=0, rotary_maps=True):
    return convert_causal_lm("tiny", source=source or tiny_llama(), attention_type=["zformer", "full", "fastformer"],
                             attention_window=[4, 0, 0], attention_sinks=sinks, feature_map_horizon=horizon,
                             rotary_feature_maps=rotary_maps)


@pytest.mark.parametrize("sinks,horizon,rotary_maps", [(0, 0, True), (2, 0, True), (2, 8, True), (2, 8, False)],
                         ids=["window", "window-and-sinks", "fading", "fading-unrotated-maps"])
def test_only_the_new_attention_parameters_train_and_the_fit_improves(sinks, horizon, rotary_maps):
    model = hedgehog_window(sinks=sinks, horizon=horizon, rotary_maps=rotary_maps)
    reference = full_attention_copy(model)
    names = set(new_attention_parameters(model))
    assert names == {
        "model.layers.0.self_attn.query_map.weight", "model.layers.0.self_attn.query_map.bias",
        "model.layers.0.self_attn.key_map.weight", "model.layers.0.self_attn.key_map.bias",
        "model.layers.0.self_attn.window_gate", "model.layers.2.self_attn.query_score",
        "model.layers.2.self_attn.key_score", "model.layers.2.self_attn.transform.weight",
    } | ({"model.layers.0.self_attn.log_horizon"} if horizon else set())
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
    (tmp_path / "reviews").mkdir()
    with gzip.open(tmp_path / "reviews" / "test.jsonl.gz", "wt") as handle:
        for _ in range(20):
            handle.write(json.dumps({"text": words(12)}) + "\n")
    method = "lora" if peft_available() else "full"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "linearize_decoder.py"), "--model_name_or_path",
               str(tmp_path / "llama"), "--attention_type", "zformer", "--config_overrides", "attention_window=4",
               "--train_file", str(tmp_path / "train.jsonl.gz"), "--eval_file", str(tmp_path / "eval.txt.gz"),
               str(tmp_path / "reviews" / "test.jsonl.gz"), "--steps", "4", "--batch_size", "2", "--block_size", "16",
               "--finetune_steps", "4", "--finetune_method", method, "--distill_weight", "0.5",
               "--eval_block_size", "32", "--eval_blocks", "3", "--log_every", "2", "--checkpoint_every", "2",
               "--output_dir", str(tmp_path / "run")]
    result = warm_scripts.run_python(command, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "attention transfer step 4/4 error" in result.stdout
    assert "fine-tuning step 4/4 loss" in result.stdout and "distillation" in result.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    texts = {f"{tmp_path.name}/eval", "reviews/test"}  # folder/file names the evaluation texts
    assert set(results["perplexity"]) == {"source", "converted", "transferred", "finetuned"}
    assert all(set(scores) == texts for scores in results["perplexity"].values())
    assert results["config"]["attention_window"] == 4 and results["transfer"]["steps"] == 4
    assert results["finetune"]["method"] == method and results["finetune"]["distill_weight"] == 0.5
    for scores in results["perplexity"].values():
        for entry in scores.values():
            assert entry["tokens"] == 3 * 31 and entry["value"] > 1
    # the source's number is the source's own perplexity on those blocks
    tokenizer = _word_tokenizer()
    eval_ids = torch.tensor(tokenizer(gzip.open(tmp_path / "eval.txt.gz", "rt").read())["input_ids"])
    assert results["perplexity"]["source"][f"{tmp_path.name}/eval"]["value"] == pytest.approx(
        perplexity(source, eval_ids, 32, 3)[0], rel=1e-3)
    # each stage's model is saved, loads with remote code, and scores what the run measured
    finetuned = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "finetuned", trust_remote_code=True)
    assert results["perplexity"]["finetuned"][f"{tmp_path.name}/eval"]["value"] == pytest.approx(
        perplexity(finetuned, eval_ids, 32, 3)[0], rel=1e-3)
    assert (tmp_path / "run" / "transferred" / "config.json").exists()
    assert set(results["greedy_samples"]["This movie was"]) == set(results["perplexity"])
    # started again: resumes from the checkpoints (nothing left to train) and keeps the numbers
    again = warm_scripts.run_python(command, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "attention transfer: resumed from" in again.stdout and "fine-tuning: resumed from" in again.stdout
    assert "at step 4" in again.stdout
    assert json.loads((tmp_path / "run" / "results.json").read_text())["perplexity"] == results["perplexity"]
    changed = [part if part != "4" else "5" for part in command]  # --steps 5: another run
    refused = warm_scripts.run_python(changed, timeout=300)
    assert refused.returncode != 0 and "holds a run with other arguments" in refused.stderr
    # stage 2 alone from the transferred model of that run, the source not scored again
    alone = [part if part != str(tmp_path / "run") else str(tmp_path / "stage2") for part in command]
    alone[alone.index("--steps") + 1] = "0"
    alone += ["--init_model", str(tmp_path / "run" / "transferred"), "--skip_scores", "source"]
    result = warm_scripts.run_python(alone, timeout=300)
    assert result.returncode == 0, result.stderr
    second = json.loads((tmp_path / "stage2" / "results.json").read_text())
    assert set(second["perplexity"]) == {"init_model", "finetuned"}
    assert second["perplexity"]["init_model"] == {t: {**e, "seconds": second["perplexity"]["init_model"][t]["seconds"]}
                                                  for t, e in results["perplexity"]["transferred"].items()}
    # a folder of the user's files is refused before any work and left as it was
    users = tmp_path / "notes"
    users.mkdir()
    (users / "todo.txt").write_text("mine")
    foreign = [part if part != str(tmp_path / "run") else str(users) for part in command]
    refused = warm_scripts.run_python(foreign, timeout=300)
    assert refused.returncode != 0 and "did not write" in refused.stderr
    assert sorted(p.name for p in users.iterdir()) == ["todo.txt"]


@pytest.mark.parametrize("flags, message", [
    (["--distill_weight", "1.5"], "--distill_weight must be in [0, 1], got 1.5"),
    (["--finetune_steps", "-2"], "--finetune_steps must be >= 0, got -2"),
    (["--finetune_learning_rate", "nan"], "--finetune_learning_rate must be a finite number > 0, got nan"),
    (["--lora_rank", "0"], "--lora_rank must be >= 1, got 0"),
    (["--finetune_method", "qlora"], "invalid choice: 'qlora'"),
    (["--eval_file", "x/a/valid.txt", "y/a/valid.txt.gz"], "two files share the name"),
    (["--device", "tpu9"], "--device 'tpu9' is not a device"),
    pytest.param(["--device", "cuda"], "--device cuda: CUDA is not available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")),
])
def test_linearize_script_names_bad_arguments(flags, message, capsys):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import linearize_decoder

    base = ["--model_name_or_path", "m", "--train_file", "t.jsonl", "--eval_file", "e.txt", "--output_dir", "o"]
    with pytest.raises(SystemExit):
        linearize_decoder.parse_args(base + flags)
    assert message in capsys.readouterr().err


def test_a_stage_state_is_tensors_and_json_and_a_pickle_is_never_run(tmp_path, capsys):
    """The resume state round-trips through safetensors (nothing unpickled); a transfer_state.pt of
    an earlier version holding code is refused with one error line, the code not run."""
    from test_guards import RunsCode

    from hf_zformer.conversion.decoder_transfer import load_state, save_state

    model = convert_causal_lm("tiny", source=tiny_llama(), attention_type="zformer")
    transfer = AttentionTransfer(model, full_attention_copy(model), steps=4)
    transfer.step(torch.randint(5, 97, (2, 16), generator=torch.Generator().manual_seed(0)))
    save_state(transfer.state_dict(), tmp_path / "transfer_state.safetensors")
    again = AttentionTransfer(model, full_attention_copy(model), steps=4)
    again.load_state_dict(load_state(tmp_path / "transfer_state.safetensors"))
    assert again.completed == 1 and again.optimizer.state_dict()["param_groups"] == \
        transfer.optimizer.state_dict()["param_groups"]
    assert all(torch.equal(again.parameters[n], p) for n, p in transfer.parameters.items())
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import linearize_decoder

    canary = tmp_path / "code-ran"
    torch.save({"completed": RunsCode(canary)}, tmp_path / "transfer_state.pt")
    with pytest.raises(SystemExit) as stop:
        linearize_decoder.load_state(tmp_path / "transfer_state.pt")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "transfer_state.pt cannot be resumed" in err and not canary.exists()
    assert len(err.strip().splitlines()) == 1, err
