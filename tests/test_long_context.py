"""The long-context evaluation (`hf_zformer.conversion.long_context`, `scripts/evaluate_long_context.py`):
passkey prompts of exact lengths with the key at its depth, Wilson intervals, losses by position
bucket, cache bytes, the baselines, and the script end to end on a tiny converted decoder with a
recall memory: trials on file at once, resume, summary and records."""

import json

import pytest
import torch
from test_llama_decoder import KINDS, LLAMA, tiny_llama
from test_scripts import run_script, run_script_failing
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_zformer.conversion import long_context
from hf_zformer.conversion.convert_decoder import convert_causal_lm
from hf_zformer.conversion.long_context import (bucket_losses, cache_bytes, first_number, greedy_continuation,
                                                passkey_prompt, streaming_model, switch_off_state, trial_key,
                                                wilson_interval)

def tiny_tokenizer():
    """A byte-level BPE trained on the passkey texts (the 256 bytes, a few merges; ids 0-2: pad, bos, eos)."""
    corpus = [long_context.INSTRUCTION, long_context.FILLER * 3, long_context.KEY_SENTENCE.format(key="0123456789"),
              long_context.QUESTION]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_passkey_prompt_has_its_length_and_the_key_at_its_depth():
    tokenizer = tiny_tokenizer()
    for depth in (0.0, 0.5, 1.0):
        prompt = passkey_prompt(tokenizer, 2000, depth, "12345")
        ids = prompt.input_ids
        assert len(ids) <= 2000 and len(ids) > 2000 - len(tokenizer(long_context.FILLER)["input_ids"])
        assert tokenizer.decode(ids).endswith(long_context.QUESTION)
        after = tokenizer.decode(ids[prompt.key_position:])
        assert after.startswith(long_context.KEY_SENTENCE.format(key="12345"))
        share = prompt.key_position / len(ids)
        assert abs(share - depth) < 0.15, (depth, share)
    for bad, message in [(dict(depth=1.5), "depth=1.5"), (dict(key="12a45"), "must be digits"),
                         (dict(length=20), "length=20 tokens leave no room")]:
        with pytest.raises(ValueError, match=message):
            passkey_prompt(tokenizer, **{"length": 400, "depth": 0.5, "key": "12345", **bad})
    assert trial_key(0, 1024, 3) == trial_key(0, 1024, 3) != trial_key(1, 1024, 3)
    assert len(trial_key(0, 1024, 3)) == 5
    assert first_number(" 48213. Remember") == "48213" and first_number(" a key") is None


def test_wilson_interval():
    assert wilson_interval(0, 0) is None
    assert wilson_interval(10, 10) == [0.7225, 1.0]
    assert wilson_interval(0, 10) == [0.0, 0.2775]
    low, high = wilson_interval(9, 10)
    assert low < 0.9 < high


def test_bucket_losses_add_up_to_the_blocks_loss():
    model = tiny_llama()
    block = torch.randint(5, 97, (40,))
    sums = bucket_losses(model, block, edges=(0, 8, 20, 64))
    assert [n for _, n in sums] == [7, 12, 20]  # predicted tokens at positions 1..39
    with torch.no_grad():
        logits = model(input_ids=block[None]).logits[0, :-1]
    total = torch.nn.functional.cross_entropy(logits, block[1:], reduction="sum")
    assert abs(sum(s for s, _ in sums) - float(total)) < 1e-3


def test_cache_bytes_and_timing_of_a_greedy_continuation():
    source = tiny_llama()
    memory = convert_causal_lm("tiny", source=source, **KINDS["zformer-window-memory"])
    ids = torch.randint(5, 97, (30,)).tolist()
    kv = greedy_continuation(source, ids, 4)
    assert len(kv["tokens"]) == 4 and kv["ms_per_token"] > 0
    assert kv["cache_bytes"] == 3 * 2 * 2 * 30 * 8 * 4  # layers x (keys, values) x kv heads x tokens x d x fp32
    small = greedy_continuation(memory, ids, 4)
    assert 0 < small["cache_bytes"]
    longer = greedy_continuation(memory, ids * 4, 4)
    assert abs(longer["cache_bytes"] - small["cache_bytes"]) <= 3 * 3 * 2 * 8 * 4 * 2  # bounded: a chunk's tokens


def test_baselines_switch_the_feature_map_part_off():
    source = tiny_llama()
    streaming = streaming_model(source, window=4, sinks=1)
    assert all(torch.all(torch.sigmoid(m.window_gate) == 1) for m in long_context.windowed_layers(streaming))
    ids = torch.randint(5, 97, (1, 24))
    masked = torch.zeros(24, 24, dtype=torch.bool)
    for i in range(24):
        masked[i, max(0, i - 3) : i + 1] = True
        masked[i, 0] = True
    with torch.no_grad():
        # the source with its attention masked to the last 4 tokens and the first: by hand, layer by layer
        expected = windowed_source_logits(source, ids, masked)
        torch.testing.assert_close(streaming(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="has no windowed zformer layer"):
        switch_off_state(source)


def windowed_source_logits(source, ids, allowed):
    """The source's logits with every attention restricted to `allowed` (queries x keys)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.eager_attention_forward

    def masked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
        return original(module, query, key, value, bias, scaling, dropout=dropout, **kwargs)

    source.config._attn_implementation = "eager"
    modeling_llama.eager_attention_forward = masked
    try:
        return source(input_ids=ids).logits
    finally:
        modeling_llama.eager_attention_forward = original
        source.config._attn_implementation = "sdpa"


def run(*args, check=True):
    """The script in a process of its own (forked from the tests' warm interpreter)."""
    return (run_script if check else run_script_failing)("evaluate_long_context.py", *map(str, args))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny converted decoder with a recall memory, its source, both with the tiny tokenizer, and a text."""
    root = tmp_path_factory.mktemp("long_context")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "vocab_size": len(tokenizer)})).eval()
    source.save_pretrained(root / "source")
    tokenizer.save_pretrained(root / "source")
    model = convert_causal_lm("tiny", source=source, **KINDS["zformer-window-memory"])
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "text.txt").write_text(long_context.FILLER * 60)
    return root


def test_script_end_to_end_with_resume_and_records(folders, tmp_path):
    out, results = tmp_path / "out", tmp_path / "results.json"
    common = ["--model_name_or_path", folders / "model", "--lengths", 400, 480, "--trials", 2, "--eval_file",
              folders / "text.txt", "--ppl_lengths", 64, 128, "--ppl_blocks", 2,
              "--config_overrides", "attention_memory_positions=cache", "--output_dir", out]
    first = run(*common, "--results_file", results)
    lines = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in lines) == sorted(
        ["passkey-400-0", "passkey-400-1", "passkey-480-0", "passkey-480-1", "ppl-64-0", "ppl-64-1", "ppl-128-0", "ppl-128-1"])
    assert "passkey 4/4" in first.stdout and "perplexity at 128" in first.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passkey"]["400"]["trials"] == 2 and summary["passkey"]["400"]["cache_bytes"] > 0
    assert set(summary["perplexity"]["128"]["buckets"]) == {"0-256"}
    records = json.loads(results.read_text())
    assert {(r["task"], r["max_length"]) for r in records} == {("passkey", 400), ("passkey", 480), ("wikitext-2", 64),
                                                                ("wikitext-2", 128)}
    assert all(r["config"]["attention_memory"] == 2 and r["commit"] and r["machine"] for r in records)
    assert all(r["config"]["attention_memory_positions"] == "cache" for r in records)  # the whole recipe
    assert all(r["attention"] == "zformer" and r["split"] for r in records)  # the fields every record carries
    again = run(*common)  # resumed: nothing scored twice
    assert "resuming: 8 trials and blocks done" in again.stdout and "passkey 1/4" not in again.stdout
    other = run(*common[:-1], tmp_path / "out", "--trials", 3, check=False)
    assert other.returncode == 2 and "holds a run with other arguments" in other.stderr


def test_script_baselines_and_refusals(folders, tmp_path):
    state_off = run("--model_name_or_path", folders / "model", "--baseline", "state_off", "--lengths", 400, "--trials", 1,
                    "--output_dir", tmp_path / "off")
    assert "as baseline state_off" in state_off.stdout
    streaming = run("--model_name_or_path", folders / "source", "--baseline", "streaming", "--streaming_window", 8,
                    "--config_overrides", "attention_memory=2,attention_memory_chunk=4", "--lengths", 400, "--trials", 1,
                    "--output_dir", tmp_path / "stream")
    assert "as baseline streaming" in streaming.stdout
    refused = run("--model_name_or_path", folders / "source", "--baseline", "state_off", "--lengths", 400,
                  "--output_dir", tmp_path / "bad", check=False)
    assert refused.returncode == 2 and "has no windowed zformer layer" in refused.stderr
    for flags, message in [(["--depths", "1.5"], "--depths 1.5 must be between 0 and 1"),
                           (["--trials", "0"], "--trials 0 must be at least 1"),
                           (["--config_overrides", "nonsense=1"], "unknown config field 'nonsense'"),
                           (["--eval_file", folders / "text.txt", "--ppl_blocks", "50"], "fewer than --ppl_blocks 50"),
                           (["--lengths", "100"], "--lengths 100: length=100 tokens leave no room for the filler"),
                           (["--model_name_or_path", tmp_path / "missing"], "cannot be loaded")]:
        done = run("--model_name_or_path", folders / "model", "--lengths", 400, "--output_dir", tmp_path / flags[0][2:],
                   *flags, check=False)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr[-500:])
