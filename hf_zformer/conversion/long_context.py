"""Long-context evaluation of causal LMs: passkey retrieval, perplexity by position, and the cost of
a decoding step and its cache at each length (`scripts/evaluate_long_context.py` runs it).

* Passkey retrieval: an instruction, the same filler sentences repeated, a sentence naming a
  5-digit key at a given depth of the text, and the question "What is the pass key? The pass key
  is"; the model continues greedily, and the trial counts when the first number it writes is the
  key (`passkey_prompt`, `passkey_trial`).
* Perplexity by position: the next-token loss of every token of a long block, pooled in position
  buckets (`bucket_losses`), so that what a model keeps beyond its softmax window shows as the
  loss of the late buckets.
* Baselines on the same texts: a converted model with its feature-map part switched off, so that
  only its softmax window and sinks attend (`switch_off_state`), and a source's own weights with
  attention masked to a window and sinks, with no training (StreamingLLM; `streaming_model`).
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass

import torch

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
BUCKETS = (0, 256, 1024, 2048, 4096, 8192)
GATE_OFF = 60.0  # sigmoid(60) = 1 - 9e-27: every window share at 1, the feature-map part off


@dataclass
class PasskeyPrompt:
    """The token ids of one passkey prompt, its key and where the key sentence starts."""

    input_ids: list[int]
    key: str
    key_position: int


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of about `length` tokens (never more) whose key sentence starts after a share
    `depth` (0..1) of the filler sentences. The parts are tokenized one by one and joined, so a
    prompt's length and the key's place are exact in tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be between 0 and 1")
    if not re.fullmatch(r"\d+", key):
        raise ValueError(f"key={key!r} must be digits")
    head = tokenizer(INSTRUCTION)["input_ids"]
    filler = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    sentence = tokenizer(KEY_SENTENCE.format(key=key), add_special_tokens=False)["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    room = length - len(head) - len(sentence) - len(question)
    if room < len(filler):
        raise ValueError(f"length={length} tokens leave no room for the filler ({len(head) + len(sentence) + len(question)}"
                         f" tokens of instruction, key and question)")
    repeats = room // len(filler)
    before = round(depth * repeats)
    ids = head + filler * before
    position = len(ids)
    ids += sentence + filler * (repeats - before) + question
    return PasskeyPrompt(ids, key, position)


def trial_key(seed: int, length: int, trial: int, digits: int = 5) -> str:
    """The key of one trial: a fixed function of `seed`, `length` and `trial`."""
    generator = random.Random(f"{seed}-{length}-{trial}")
    return str(generator.randrange(10 ** (digits - 1), 10**digits))


def cache_bytes(cache) -> int:
    """Bytes of every tensor a transformers cache holds (its layers' keys, values and states)."""
    seen, total = set(), 0

    def add(value):
        nonlocal total
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)):
            for item in value:
                add(item)

    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "tensors"):  # the fixed-size layers of this library list their tensors
            add(layer.tensors())
        else:
            add(list(vars(layer).values()))
    for side in (*getattr(cache, "memory_layers", []), *getattr(cache, "conv_layers", [])):
        add(side.tensors())
    return total


@torch.no_grad()
def greedy_continuation(model, input_ids: list[int], max_new_tokens: int) -> dict:
    """Greedy decoding of `max_new_tokens` tokens after `input_ids` (batch 1) with the model's cache:
    the new tokens, the prefill's seconds, the median ms per decoding step and the cache's bytes
    after the prompt."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    begin = time.perf_counter()
    output = model(input_ids=ids, use_cache=True)
    prefill = time.perf_counter() - begin
    cache = output.past_key_values
    size = cache_bytes(cache)
    token = output.logits[:, -1].argmax(-1, keepdim=True)
    new, steps = [int(token)], []
    for _ in range(max_new_tokens - 1):
        begin = time.perf_counter()
        output = model(input_ids=token, past_key_values=cache, use_cache=True)
        steps.append(time.perf_counter() - begin)
        cache = output.past_key_values
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        new.append(int(token))
    steps.sort()
    return {"tokens": new, "prefill_s": prefill, "ms_per_token": 1000 * steps[len(steps) // 2] if steps else None,
            "cache_bytes": size}


def first_number(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    match = re.search(r"\d+", text)
    return None if match is None else match.group(0)


def passkey_trial(model, tokenizer, length: int, depth: float, key: str, max_new_tokens: int = 8) -> dict:
    """One passkey trial: the prompt, the greedy answer and whether its first number is the key."""
    prompt = passkey_prompt(tokenizer, length, depth, key)
    run = greedy_continuation(model, prompt.input_ids, max_new_tokens)
    answer = tokenizer.decode(run.pop("tokens"), skip_special_tokens=True)
    return {"length": length, "tokens": len(prompt.input_ids), "depth": depth, "key": key,
            "key_position": prompt.key_position, "answer": answer, "correct": first_number(answer) == key, **run}


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson score interval of a proportion (None without trials)."""
    if trials == 0:
        return None
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


@torch.no_grad()
def bucket_losses(model, block: torch.Tensor, edges=BUCKETS) -> list[tuple[float, int]]:
    """The next-token loss of `block` (1-D token ids) in one forward without cache, summed per
    position bucket [edges[b], edges[b + 1]) of the predicted token: (sum of losses, tokens) per
    bucket."""
    device = next(model.parameters()).device
    block = block.to(device)
    logits = model(input_ids=block[None], use_cache=False).logits[0, :-1].float()
    losses = torch.nn.functional.cross_entropy(logits, block[1:], reduction="none")
    positions = torch.arange(1, block.numel(), device=device)
    sums = []
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (positions >= low) & (positions < high)
        sums.append((float(losses[inside].sum()), int(inside.sum())))
    return sums


def windowed_layers(model) -> list:
    """The attention modules of `model` that have a softmax window (zformer with `attention_window`)."""
    return [module for module in model.modules() if getattr(module, "window_gate", None) is not None]


@torch.no_grad()
def switch_off_state(model):
    """Set every window share to 1 (`window_gate` = 60), so that only the softmax window and the
    sinks attend; returns the model. Refused for a model without windowed layers."""
    layers = windowed_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no windowed zformer layer whose state could be switched off")
    for module in layers:
        module.window_gate.fill_(GATE_OFF)
    return model


def streaming_model(source, window: int, sinks: int, **config_overrides):
    """The source's own weights with every layer's attention masked to the last `window` tokens and
    the first `sinks` (StreamingLLM): a converted zformer model with its feature-map part off, no
    training. `config_overrides`: further `ZformerLlamaConfig` fields (`attention_memory`: the
    recall memory's keys join the window and sinks)."""
    from .convert_decoder import convert_causal_lm

    model = convert_causal_lm("source", "zformer", source=source, zformer_feature_map="hedgehog",
                              attention_window=window, attention_sinks=sinks, **config_overrides)
    return switch_off_state(model)


__all__ = ["BUCKETS", "DEPTHS", "PasskeyPrompt", "bucket_losses", "cache_bytes", "first_number", "greedy_continuation",
           "passkey_prompt", "passkey_trial", "streaming_model", "switch_off_state", "trial_key", "wilson_interval",
           "windowed_layers"]
