"""Attention transfer for converted Llama-family decoders (`ZformerLlamaForCausalLM`): train only
the new attention parameters so that each converted layer's attention output matches the softmax
attention output of the source on the same input (LoLCATs' first stage).

`reference` is the exact full-attention copy of the source (`convert_decoder.full_attention_copy`
of the freshly converted model). Each step runs a batch through it, recording every layer's
attention input (after the RMSNorm, with the rotary table and the mask) and softmax output; each
converted layer's attention replays the call and its output is pulled towards the recorded one.
The loss is the mean over converted layers of the relative squared error ||y - t||^2 / ||t||^2
(`distillation._relative_error`), so every layer counts alike whatever its output size. Layers
learn independently, from the source's own hidden states; embeddings, MLPs, norms, the q/k/v/o
projections and full layers stay the source's.

`perplexity` scores a causal LM on one token stream cut into equal blocks (the same blocks for
every model compared).
"""

from __future__ import annotations

import json
import math

import torch

from .convert_decoder import attention_calls
from .distillation import relative_error

# the parameters a converted layer adds to Llama's attention (by attribute name)
NEW_ATTENTION_PARAMETERS = ("query_map", "key_map", "window_gate", "log_horizon", "log_scale", "query_score",
                            "key_score", "transform")


def warmup_cosine(optimizer, steps: int):
    """The learning-rate schedule of both stages: linear warm-up over the first 5% of `steps`, then a
    cosine decay to a tenth of the peak at the last step."""
    warmup = max(1, steps // 20)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def converted_layers(model) -> list[int]:
    """The indices of the layers of `model` whose attention is not "full"."""
    return [i for i, layer in enumerate(model.model.layers) if layer.attention_type != "full"]


def new_attention_parameters(model) -> dict[str, torch.nn.Parameter]:
    """{name: parameter} of the new attention parameters of every converted layer: Hedgehog maps,
    the window share, the identity map's scale, Fastformer's pooling vectors and W_r."""
    found = {}
    for i in converted_layers(model):
        attention = model.model.layers[i].self_attn
        for attribute in NEW_ATTENTION_PARAMETERS:
            part = getattr(attention, attribute, None)
            if isinstance(part, torch.nn.Parameter):
                found[f"model.layers.{i}.self_attn.{attribute}"] = part
            elif isinstance(part, torch.nn.Module):
                for name, parameter in part.named_parameters():
                    found[f"model.layers.{i}.self_attn.{attribute}.{name}"] = parameter
    return found


def layer_errors(model, reference, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The relative squared error of each converted layer's attention output against the softmax
    output of `reference` on the same input, over the real tokens: (number of converted layers,)."""
    with torch.no_grad():
        calls = attention_calls(reference, input_ids, attention_mask)
    weights = (torch.ones(input_ids.shape, device=input_ids.device) if attention_mask is None
               else attention_mask.to(torch.float32))[..., None]
    errors = []
    for i in converted_layers(model):
        args, target = calls[i]
        output = model.model.layers[i].self_attn(*args)
        errors.append(relative_error(output.float(), target.float(), weights))
    return torch.stack(errors)


def save_state(state, path) -> None:
    """Write ``state`` (tensors in dicts, lists and tuples of plain values: a stage's
    :meth:`TrainingStage.state_dict`) to the safetensors file ``path``: the tensors as tensors, the
    structure around them as JSON in the file's metadata. Nothing in it is code, so loading it
    (:func:`load_state`) runs nothing."""
    from safetensors.torch import save_file

    tensors = {}

    def encode(value):
        if isinstance(value, torch.Tensor):
            tensors[str(len(tensors))] = value.detach().cpu().clone().contiguous()
            return {"tensor": str(len(tensors) - 1)}
        if isinstance(value, dict):
            return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return {type(value).__name__: [encode(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"{type(value).__name__} in a training state: only tensors and plain values are saved")

    structure = json.dumps(encode(state))
    save_file(tensors, str(path), metadata={"structure": structure})


def load_state(path):
    """What :func:`save_state` wrote to ``path``."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        structure = json.loads(handle.metadata()["structure"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}

    def decode(value):
        if not isinstance(value, dict):
            return value
        (kind, inner), = value.items()
        if kind == "tensor":
            return tensors[inner]
        if kind == "dict":
            return {decode(k): decode(v) for k, v in inner}
        return (tuple if kind == "tuple" else list)(decode(v) for v in inner)

    return decode(structure)


class TrainingStage:
    """What both stages share: AdamW (no weight decay) on `self.parameters` ({name: parameter}) under
    `warmup_cosine`, steps with gradients clipped to norm 1, and the state a resumed run needs (the
    trained parameters, the optimizer, the scheduler and the step count)."""

    label = "training"

    def _start_optimizer(self, steps: int, learning_rate: float) -> None:
        self.optimizer = torch.optim.AdamW(list(self.parameters.values()), lr=learning_rate, weight_decay=0.0)
        self.scheduler = warmup_cosine(self.optimizer, steps)
        self.completed = 0

    def _descend(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.parameters.values()), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.completed += 1

    def state_dict(self) -> dict:
        return {"parameters": {name: p.detach().clone() for name, p in self.parameters.items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "completed": self.completed}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.parameters) ^ set(state["parameters"])
        if missing:
            raise ValueError(f"{self.label} state does not match the model: parameters {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter.copy_(state["parameters"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.completed = state["completed"]


class AttentionTransfer(TrainingStage):
    """AdamW on the new attention parameters of `model` (everything else frozen) against
    `reference`, `steps` steps at `learning_rate` (5% linear warm-up, then cosine decay to a tenth;
    gradients clipped to norm 1). `step(ids, mask)` takes one step and returns the per-layer errors;
    `state_dict` / `load_state_dict` hold what a resumed run needs."""

    label = "attention transfer"

    def __init__(self, model, reference, *, steps: int, learning_rate: float = 1e-2):
        if not converted_layers(model):
            raise ValueError("attention transfer: every layer of the model has full attention; nothing to fit")
        if steps < 1 or not learning_rate > 0:
            raise ValueError(f"attention transfer: steps={steps} must be >= 1 and learning_rate={learning_rate} > 0")
        self.model, self.reference, self.steps = model, reference, steps
        self.parameters = new_attention_parameters(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for parameter in self.parameters.values():
            parameter.requires_grad_(True)
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        model.eval()
        reference.eval()
        self._start_optimizer(steps, learning_rate)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[float]:
        errors = layer_errors(self.model, self.reference, input_ids, attention_mask)
        self._descend(errors.mean())
        return [float(e) for e in errors.detach()]


@torch.no_grad()
def perplexity(model, token_ids: torch.Tensor, block_size: int, max_blocks: int | None = None,
               progress=None) -> tuple[float, list[float]]:
    """Perplexity of `model` on `token_ids` (1-D), cut into consecutive blocks of `block_size`
    tokens (the remainder dropped), the first `max_blocks` of them: exp of the mean next-token loss
    over every predicted token (block_size - 1 per block). Returns (perplexity, the mean loss of
    each block), the latter for `results.perplexity_ci`, computed on the model's device.
    `progress(done, total)` is called after each block."""
    blocks = token_ids[: token_ids.numel() // block_size * block_size].view(-1, block_size)
    if max_blocks is not None:
        blocks = blocks[:max_blocks]
    if len(blocks) == 0:
        raise ValueError(f"perplexity: {token_ids.numel()} tokens make no block of {block_size}")
    model.eval()
    blocks = blocks.to(next(model.parameters()).device)
    losses = []
    for i, block in enumerate(blocks):
        logits = model(input_ids=block[None], use_cache=False).logits[0, :-1].float()
        losses.append(float(torch.nn.functional.cross_entropy(logits, block[1:])))
        if progress is not None:
            progress(i + 1, len(blocks))
    return math.exp(sum(losses) / len(losses)), losses


__all__ = ["AttentionTransfer", "TrainingStage", "converted_layers", "layer_errors", "load_state",
           "new_attention_parameters", "perplexity", "save_state", "warmup_cosine"]
