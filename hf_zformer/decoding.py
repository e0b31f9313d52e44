"""Greedy decoding with a fixed-shape step, replayed as a CUDA graph on a GPU.

A Zformer or Fastformer decoder carries a state whose size does not depend on the length generated,
so every decoding step runs the same kernels on tensors of the same shapes. `StepDecoder` keeps
that state, the next input token and its position in buffers that never move, and runs each step
into them; on a CUDA device it captures the step once as a CUDA graph and then replays it, so a
token costs one graph launch instead of the host work of an eager forward (hundreds of small
kernel launches, which bound decoding on a GPU). On a CPU the same step runs eagerly.

    from hf_zformer.decoding import greedy_generate

    tokens = greedy_generate(model, input_ids, attention_mask, max_new_tokens=256)

`greedy_generate` returns what `model.generate(..., do_sample=False, num_beams=1)` returns (the
prompt and the new tokens for a causal LM, the decoder start token and the new tokens for an
encoder-decoder). Decoders whose self-attention keeps keys and values (`full` layers) grow with
the output and are refused; cross-attention of any type is fine (its memory is fixed after the
first step).
"""

from __future__ import annotations

import torch

from .modeling.blocks import drop_full_mask
from .modeling.cache_zformer import ZformerStateLayer
from .modeling.modeling_zformer import CACHE_FIELD, ZformerForCausalLM, ZformerForConditionalGeneration


def _point_at(layer, buffers: list[torch.Tensor]) -> None:
    """Make a recurrent cache layer hold `buffers` (in the order of its `tensors()`) as its state."""
    if isinstance(layer, ZformerStateLayer):
        (layer.state,) = buffers
    else:
        layer.query_pool, layer.key_pool = tuple(buffers[:2]), tuple(buffers[2:])


class StepDecoder:
    """Greedy decoding of `model` (a `ZformerForCausalLM` / `FastformerForCausalLM`, or an
    encoder-decoder `Zformer/FastformerForConditionalGeneration`) from `input_ids` (B, N) with
    `attention_mask` (B, N) (padding on either side for a causal LM; the source's for an
    encoder-decoder), one token per `step()`.

    The constructor runs the prompt (causal LM) or the encoder and the decoder start token, followed
    by `decoder_prefix` (B, P) when given (encoder-decoder), eagerly: `tokens` then holds the first
    new token (B, 1). Each `step()` feeds
    `tokens` at `positions` and leaves the next token in `tokens` (a buffer reused by the next
    step: clone it to keep it). `graphs`: replay a CUDA graph of the step (default: on CUDA
    devices); the graph is captured after `warmup` eager steps and keeps the autocast setting that
    was active then. `max_new_tokens` bounds the positions the decoder will reach (checked here,
    once, against `max_position_embeddings`). `cache` is the model's `ZformerCache`, whose token
    count stays right, so `generate()` can continue from it."""

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int, graphs: bool | None = None, warmup: int = 2,
                 decoder_prefix: torch.Tensor | None = None):
        if not isinstance(model, (ZformerForCausalLM, ZformerForConditionalGeneration)):
            raise TypeError(f"StepDecoder decodes Zformer-family causal LMs and encoder-decoders, not {type(model).__name__}")
        kinds = model.decoder.layer_types
        full = [i for i, kind in enumerate(kinds) if kind == "full"]
        if full:
            raise ValueError(f"StepDecoder: decoder layers {full} have full self-attention, whose keys and values grow "
                             "with the output; a fixed-shape step needs zformer or fastformer layers (use generate())")
        windowed = [i for i, window in enumerate(getattr(model.decoder, "windows", [])) if window]
        if windowed:
            raise ValueError(f"StepDecoder: decoder layers {windowed} have a softmax window (attention_window), whose "
                             "kept keys grow until the window is full; a fixed-shape step needs layers without one "
                             "(use generate())")
        if max_new_tokens < 1 or warmup < 1:
            raise ValueError(f"StepDecoder: max_new_tokens={max_new_tokens} and warmup={warmup} must be >= 1")
        device = input_ids.device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda":
            raise ValueError(f"StepDecoder: graphs=True needs a CUDA device, the inputs are on {device}")
        self.model, self.decoder, self.warmup = model.eval(), model.decoder, warmup
        offset = model.config.position_offset
        with torch.inference_mode():
            if isinstance(model, ZformerForCausalLM):
                if decoder_prefix is not None:
                    raise ValueError("StepDecoder: decoder_prefix is an encoder-decoder's; a causal LM reads its whole "
                                     "prompt from input_ids")
                output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
                self.memory = self.memory_mask = None
                real = input_ids.shape[1] if attention_mask is None else attention_mask.sum(1, keepdim=True)
            else:
                start = torch.full((input_ids.shape[0], 1), model.config.decoder_start_token_id, device=device)
                if decoder_prefix is not None:
                    start = torch.cat([start, decoder_prefix.to(device)], 1)
                output = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=start,
                               use_cache=True)
                self.memory, self.memory_mask = output.encoder_last_hidden_state, drop_full_mask(attention_mask)
                real = start.shape[1]
            self.cache = getattr(output, CACHE_FIELD)
            self.tokens = output.logits[:, -1:].argmax(-1)  # (B, 1): the first new token
            self.positions = torch.zeros_like(self.tokens) + real + offset  # where `tokens` goes
        self.max_position = int(self.positions.max()) + max_new_tokens - 1
        if self.max_position >= model.config.max_position_embeddings:
            raise ValueError(f"StepDecoder: {max_new_tokens} new tokens reach position {self.max_position}, past "
                             f"max_position_embeddings={model.config.max_position_embeddings}")
        self.layers = list(self.cache.layers)
        self.buffers = [[t.clone() for t in layer.tensors()] for layer in self.layers]
        for layer, buffers in zip(self.layers, self.buffers):
            _point_at(layer, buffers)
        # the causal convolutions' last inputs (decoder_conv_size), fixed buffers as well
        self.conv_buffers = [layer.value.clone() for layer in self.cache.conv_layers]
        for layer, buffer in zip(self.cache.conv_layers, self.conv_buffers):
            layer.value = buffer
        self.steps, self.graph = 0, None

    def _step(self) -> None:
        """One token through the decoder, everything written into the fixed buffers."""
        hidden = self.decoder.embeddings(self.positions, input_ids=self.tokens, max_position=self.max_position)
        for layer in self.decoder.layers:
            hidden = layer(hidden, None, self.memory, self.memory_mask, self.cache)
        if self.decoder.final_norm is not None:
            hidden = self.decoder.final_norm(hidden)
        self.tokens.copy_(self.model.lm_head(hidden)[:, -1:].argmax(-1))
        self.positions.add_(1)
        for layer, buffers in zip(self.layers, self.buffers):
            for buffer, tensor in zip(buffers, layer.tensors()):
                buffer.copy_(tensor)
            _point_at(layer, buffers)
        for layer, buffer in zip(self.cache.conv_layers, self.conv_buffers):
            buffer.copy_(layer.value)
            layer.value = buffer

    def _capture(self) -> None:
        counts = [layer.num_tokens for layer in self.layers]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()  # recorded, not run: the replay that follows runs it
        for layer, count in zip(self.layers, counts):
            layer.num_tokens = count

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Decode one token; returns `tokens` (B, 1), the token to feed next (the buffer itself)."""
        counts = [layer.num_tokens for layer in self.layers]
        if not self.graphs or self.steps < self.warmup:
            if self.graphs:  # warm-up on a side stream, as CUDA graph capture asks
                stream = torch.cuda.Stream(self.tokens.device)
                stream.wait_stream(torch.cuda.current_stream(self.tokens.device))
                with torch.cuda.stream(stream):
                    self._step()
                torch.cuda.current_stream(self.tokens.device).wait_stream(stream)
            else:
                self._step()
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        for layer, count in zip(self.layers, counts):
            layer.num_tokens = count + 1
        self.steps += 1
        return self.tokens


@torch.inference_mode()
def greedy_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    max_new_tokens: int, eos_token_id: int | None = None, pad_token_id: int | None = None,
                    graphs: bool | None = None) -> torch.Tensor:
    """Greedy decoding through `StepDecoder` (a CUDA graph per step on a GPU): what
    `model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False, num_beams=1)`
    returns. A row that has produced `eos_token_id` continues with `pad_token_id` (default: the
    model's); decoding stops once every row has, or after `max_new_tokens`."""
    eos = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = model.config.pad_token_id if pad_token_id is None else pad_token_id
    decoder = StepDecoder(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, graphs=graphs)
    if isinstance(model, ZformerForCausalLM):
        start = input_ids
    else:
        start = torch.full((input_ids.shape[0], 1), model.config.decoder_start_token_id, device=input_ids.device)
    new = [decoder.tokens.clone()]
    finished = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens - 1):
        if eos is not None:
            finished |= new[-1] == eos
            if bool(finished.all()):
                break
        token = decoder.step().clone()
        new.append(token if eos is None else token.masked_fill(finished, pad))
    return torch.cat([start, *new], 1)


__all__ = ["StepDecoder", "greedy_generate"]
