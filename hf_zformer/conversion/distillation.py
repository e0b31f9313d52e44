"""Attention distillation: fit converted attention layers to the softmax attention they replace.

After `convert_pretrained` has turned a BERT-family checkpoint into a Zformer-family model, the
new attention layers (zformer, fastformer, xformer) only start near what the source computed.
`distill_attention` trains their parameters, and nothing else, on unlabeled text so that their
outputs match those of `reference`, the exact full-attention copy of the source; `Distillation`
holds the settings. `encoder_attention_calls` records a reference's attention calls, which the
calibration in `hf_zformer.conversion.convert` replays too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


@dataclass
class Distillation:
    """Attention transfer on unlabeled text after conversion (`distill_attention`).

    `texts` are the documents (e.g. the 50,000 unlabeled IMDB reviews), drawn with `seed` in batches
    of `batch_size` truncated to `max_length` tokens; the first `eval_texts` are held out to measure
    the fit. Two phases, each with AdamW at `learning_rate` (5% warm-up, linear decay): `steps` of
    layer-wise fitting (each converted layer's attention on the source's inputs), then
    `model_steps` of whole-model fitting (the converted model on its own inputs, every layer's
    output pulled towards the source's), which corrects what the layers' errors add up to. `source`
    names where the texts came from (e.g. the file); the model card's metadata records it with the
    settings.

    `attention_weight_loss` weighs a second layer-wise loss for layers whose attention forms
    normalised weights a_ij (zformer with `zformer_feature_map="hedgehog"`): the cross-entropy
    -sum_j t_ij log a_ij between the source's softmax weights t_ij = softmax_j(q_i . k_j / sqrt(d_h))
    (over real keys, from the source layer's own q and k on the same input) and a_ij, averaged over
    real query tokens and heads (Hedgehog's loss), added to the output error (weights and outputs
    together, as in LoLCATs). 0 fits the outputs only; other layers always fit outputs only.

    `device` is where the distillation runs (``"cuda"``: minutes instead of an hour at the recipe's
    sizes); `None` runs it where the model is. The model and the reference move there for the
    distillation and back to where they were afterwards."""

    texts: Sequence[str]
    steps: int = 300
    model_steps: int = 0
    batch_size: int = 16
    max_length: int = 256
    learning_rate: float = 1e-3
    seed: int = 0
    eval_texts: int = 32
    source: str | None = None
    attention_weight_loss: float = 1.0
    device: str | torch.device | None = None

    def __post_init__(self):
        if self.device is not None:
            check_device(self.device)
        for name in ("steps", "batch_size", "max_length", "eval_texts"):
            if getattr(self, name) < 1:
                raise ValueError(f"Distillation: {name} must be >= 1, got {getattr(self, name)}")
        if self.model_steps < 0:
            raise ValueError(f"Distillation: model_steps must be >= 0, got {self.model_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"Distillation: learning_rate must be > 0, got {self.learning_rate}")
        if not self.attention_weight_loss >= 0:
            raise ValueError(f"Distillation: attention_weight_loss must be >= 0, got {self.attention_weight_loss}")
        if len(self.texts) <= self.eval_texts:
            raise ValueError(f"Distillation: {len(self.texts)} texts given; it needs more than eval_texts="
                             f"{self.eval_texts} (held out to measure the fit) to train on")


def check_device(device) -> torch.device:
    """`device` as a `torch.device`; `ValueError` naming it when torch does not know it or it is a
    CUDA device on a machine without one."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"Distillation: device={device!r} is not a torch device ({error})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Distillation: device={device!r}, but torch.cuda.is_available() is False")
    return resolved


class _Call(NamedTuple):
    """One recorded encoder attention call of the reference: `args` and `kwargs` replay it, `output`
    (B, N, D) is what it returned, `layer_input` (B, N, D) is what entered the layer's input
    convolution (`encoder_conv_size`; None without one), so a student's convolution can be fitted
    together with its attention."""

    args: tuple
    kwargs: dict
    output: torch.Tensor
    layer_input: torch.Tensor | None


def encoder_attention_calls(reference, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[int, _Call]:
    """Every encoder attention call of `reference` on a batch, by layer index (`_Call`)."""
    calls, conv_inputs = {}, {}

    def record(module, args, kwargs, output, i):
        calls[i] = _Call(args, kwargs, output[0], conv_inputs.get(i))

    hooks = []
    for i, layer in enumerate(reference.base_model.encoder.layers):
        hooks.append(layer.attention.register_forward_hook(lambda *call, i=i: record(*call, i), with_kwargs=True))
        if layer.short_conv is not None:
            hooks.append(layer.short_conv.register_forward_pre_hook(
                lambda module, args, i=i: conv_inputs.__setitem__(i, args[0])))
    try:
        reference.base_model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def _replayed_args(layer, call: _Call) -> tuple:
    """The positional arguments with which `layer`'s attention replays `call`: the recorded ones, or,
    when the layer has an input convolution, its own convolution of what entered the reference
    layer's (the attention's input where the reference has none)."""
    if layer.short_conv is None:
        return call.args
    mask = call.args[1] if len(call.args) > 1 else call.kwargs.get("attention_mask")
    layer_input = call.args[0] if call.layer_input is None else call.layer_input
    return (layer.short_conv(layer_input, mask), *call.args[1:])


def relative_error(output: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """||output - target||^2 / ||target||^2 over the real tokens (weights (B, N, 1))."""
    return ((output - target).square() * weights).sum() / (target.square() * weights).sum().clamp_min(1e-12)


def relative_errors(model, calls, layers, attention_mask) -> list[torch.Tensor]:
    """Per layer in `layers`: the relative squared error of the attention output, the student's
    attention replaying the teacher's recorded call."""
    return layer_losses(model, None, calls, layers, attention_mask)[0]


def _forms_weights(model, i: int) -> bool:
    """Whether encoder layer i's attention forms normalised weights a_ij (zformer with a feature map)."""
    return getattr(model.base_model.encoder.layers[i].attention, "key_map", None) is not None


def layer_losses(model, reference, calls, layers, attention_mask) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer in `layers`, the student's attention replaying the reference's recorded call:
    (the relative squared error of its output, the cross-entropy between the reference layer's
    softmax weights and its normalised weights). The cross-entropy is averaged over real query
    tokens and heads (`Distillation.attention_weight_loss`); it is zero for a layer that forms no
    weights, and not computed (an empty list) when `reference` is None. A layer with weights gets
    output and weights from one computation of its features (`output_and_weights`)."""
    real = attention_mask.to(torch.float32)  # (B, N): the query tokens that count
    errors, cross_entropies = [], []
    for i in layers:
        layer, call = model.base_model.encoder.layers[i], calls[i]
        args = _replayed_args(layer, call)
        if reference is None or not _forms_weights(model, i):
            output = layer.attention(*args, **call.kwargs)[0]
            if reference is not None:
                cross_entropies.append(torch.zeros((), device=attention_mask.device))
        else:
            mask = call.args[1] if len(call.args) > 1 else call.kwargs.get("attention_mask")
            with torch.no_grad():  # the source's softmax weights (B, H, N, N), from its own attention
                target = reference.base_model.encoder.layers[i].attention(
                    call.args[0], mask, output_attentions=True)[1].float()
            output, weights = layer.attention.output_and_weights(args[0], mask)
            # a_ij is zero only where t_ij is (padded keys): the clamp keeps 0 * log(0) at 0
            cross_entropy = -(target * torch.log(weights.clamp_min(torch.finfo(weights.dtype).tiny))).sum(-1)  # (B, H, N)
            cross_entropies.append((cross_entropy.mean(1) * real).sum() / real.sum().clamp_min(1.0))
        errors.append(relative_error(output, call.output, real[..., None]))
    return errors, cross_entropies


def hidden_state_errors(model, reference, input_ids, attention_mask, first: int) -> list[torch.Tensor]:
    """Per layer from `first` (the first converted one) on: the relative squared error of the
    layer's output when the model runs on its own, against the reference's."""
    weights = attention_mask.to(torch.float32)[..., None]
    with torch.no_grad():
        targets = reference.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       output_hidden_states=True).hidden_states
    outputs = model.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    return [relative_error(outputs[i + 1], targets[i + 1], weights) for i in range(first, len(outputs) - 1)]


def distill_attention(model, reference, tokenizer, distillation: Distillation, progress: bool = True) -> dict:
    """Fit the attention of every non-full layer of `model` to the softmax attention it replaced.

    `reference` is the exact full-attention copy of the source (same weights everywhere but the
    attention types). Only the converted layers' attention parameters train, with the input
    convolution in front of each (`encoder_conv_size`: the identity at conversion, so it can learn
    the local mixing that fastformer's pooled vectors lack); embeddings, feed-forward blocks,
    LayerNorms, heads and full layers stay the source's. Dropout is off. The
    loss of both phases is a mean over layers of relative squared errors, so every layer counts
    alike whatever its output size.

    1. Layer-wise (`distillation.steps`): a batch runs through `reference`; each converted layer's
       attention replays the reference layer's call (same input, through the layer's own
       convolution when it has one; same mask and positions) and its output
       is pulled towards the softmax output. Layers learn independently, from the source's inputs.
    2. Whole model (`distillation.model_steps`, optional): the model runs on its own and the output
       of every layer from the first converted one on is pulled towards the reference's. Small
       per-layer errors compound through the stack (all-MiniLM-L6-v2 with fastformer after phase 1:
       attention errors 5-11% per layer, yet the last layer's mean-pooled output only 0.63 cosine
       to the source's); this phase fits what the layers produce together.

    Calibration (`calibrate_zformer_scales`, `calibrate_fastformer_sizes`) only matches each
    output's size; this matches the outputs themselves, on text like the task's. Returns the fit
    on the held-out documents: `{"layers": [...], "before": [...], "after": [...]}` (each
    converted layer's attention error on the source's inputs) and `"last_layer_before"` /
    `"last_layer_after"` (the relative error of the model's last hidden states), and `"max_length"`,
    the documents' length cap (`distillation.max_length` or the model's positions, the lower)."""
    layers = [i for i, layer in enumerate(model.base_model.encoder.layers) if layer.attention_type != "full"]
    if not layers:
        raise ValueError("distill_attention: every layer of the model has full attention; nothing to distill")
    if tokenizer is None:
        raise ValueError("distill_attention needs the source's tokenizer to encode the texts; none was found")
    texts = list(distillation.texts)
    held_out, train_texts = texts[: distillation.eval_texts], texts[distillation.eval_texts :]
    generator = torch.Generator().manual_seed(distillation.seed)
    config = model.config  # documents longer than the model's positions are cut to them
    max_length = min(distillation.max_length, config.max_position_embeddings - config.position_offset)
    device = next(model.parameters()).device if distillation.device is None else check_device(distillation.device)

    def encode(batch):
        encoded = tokenizer(batch, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    weighted = [i for i in layers if _forms_weights(model, i)]  # layers with an attention-weight loss

    def attention_losses(ids, mask):
        """(output errors, attention-weight cross-entropies) per layer, each (len(layers),)."""
        with torch.no_grad():
            calls = encoder_attention_calls(reference, ids, mask)
        errors, weight_losses = layer_losses(model, reference if weighted else None, calls, layers, mask)
        errors = torch.stack(errors)
        return errors, torch.stack(weight_losses) if weighted else torch.zeros_like(errors)

    def attention_loss(ids, mask):
        errors, weight_losses = attention_losses(ids, mask)
        return errors + distillation.attention_weight_loss * weight_losses if weighted else errors

    def model_loss(ids, mask):
        return torch.stack(hidden_state_errors(model, reference, ids, mask, layers[0]))

    def fit_on_held_out():
        return _held_out_fit(attention_losses, model_loss, encode, held_out, distillation.batch_size, len(layers))

    def train(loss_of, steps, description):
        batches = _batches(train_texts, distillation.batch_size, encode, generator)
        _train(loss_of, batches, trainable, steps, distillation.learning_rate, description, progress)

    trainable = [p for i in layers for p in _distilled_parameters(model.base_model.encoder.layers[i])]
    with _training_only(model, reference, trainable), _moved_to(device, model, reference):
        before, last_before, weights_before = fit_on_held_out()
        train(attention_loss, distillation.steps, "distilling attention, layer by layer")
        if distillation.model_steps:
            train(model_loss, distillation.model_steps, "distilling attention, whole model")
        after, last_after, weights_after = fit_on_held_out()
    logger.info(f"attention distillation, relative error per layer {layers}: before {before}, after {after}; "
                f"of the last hidden states: before {last_before}, after {last_after}")
    report = {"layers": layers, "before": before, "after": after, "last_layer_before": last_before,
              "last_layer_after": last_after, "max_length": max_length}
    if weighted:
        weights_before = [w if i in weighted else None for i, w in zip(layers, weights_before)]
        weights_after = [w if i in weighted else None for i, w in zip(layers, weights_after)]
        logger.info(f"attention distillation, attention-weight cross-entropy per layer {layers} (None: no "
                    f"feature map): before {weights_before}, after {weights_after}")
        report.update(attention_weight_loss=distillation.attention_weight_loss,
                      weight_loss_before=weights_before, weight_loss_after=weights_after)
    return report


def _distilled_parameters(layer) -> list[torch.nn.Parameter]:
    """What distillation trains in a converted layer: its attention and, when it has one, the input
    convolution in front of it (`encoder_conv_size`, the identity at conversion)."""
    modules = [layer.attention] if layer.short_conv is None else [layer.short_conv, layer.attention]
    return [p for module in modules for p in module.parameters()]


def _held_out_fit(attention_losses, model_loss, encode, texts: list[str], batch_size: int,
                  n_layers: int) -> tuple[list[float], float, list[float]]:
    """The mean of each converted layer's attention error, of the last hidden states' error and of
    each layer's attention-weight cross-entropy (0 without a feature map) on `texts`, in batches of
    `batch_size` (no gradients), rounded to 4 digits."""
    attention, weights, last, count = torch.zeros(n_layers), torch.zeros(n_layers), 0.0, 0
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            ids, mask = encode(texts[start : start + batch_size])
            errors, weight_losses = attention_losses(ids, mask)
            attention += errors.cpu()
            weights += weight_losses.cpu()
            last += float(model_loss(ids, mask)[-1])
            count += 1
    rounded = [round(float(e) / count, 4) for e in attention], [round(float(e) / count, 4) for e in weights]
    return rounded[0], round(last / count, 4), rounded[1]


def _batches(texts: list[str], batch_size: int, encode, generator: torch.Generator):
    """Endless encoded batches of `batch_size` texts drawn (with replacement) with `generator`."""
    while True:
        picks = torch.randint(len(texts), (batch_size,), generator=generator).tolist()
        yield encode([texts[j] for j in picks])


def _train(loss_of: Callable, batches, trainable: list[torch.nn.Parameter], steps: int, learning_rate: float,
           description: str, progress: bool) -> None:
    """`steps` of AdamW on the mean of `loss_of(ids, mask)` over `batches` (5% linear warm-up, then
    linear decay; gradients clipped to norm 1)."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, (steps - step) / (steps - warmup + 1)))
    )
    bar = tqdm(range(steps), desc=description, disable=not progress)
    for _ in bar:
        loss = loss_of(*next(batches)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")


@contextlib.contextmanager
def _moved_to(device: torch.device, *modules: torch.nn.Module):
    """Within: `modules` on `device`; afterwards each back where its parameters were. Moving keeps the
    parameter objects (`Module.to` changes their data in place), so an optimizer built inside and
    the caller's references stay valid."""
    homes = [next(module.parameters()).device for module in modules]
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module, home in zip(modules, homes):
            module.to(home)


@contextlib.contextmanager
def _training_only(model, reference, trainable: list[torch.nn.Parameter]):
    """Within: `model` and `reference` in eval mode (no dropout: the student fits the teacher's
    deterministic outputs) and only `trainable` requiring gradients; afterwards every parameter's
    `requires_grad` and the model's mode are restored."""
    was_training = model.training
    model.eval()
    reference.eval()
    flags = {p: p.requires_grad for p in model.parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in trainable:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter, flag in flags.items():
            parameter.requires_grad_(flag)
        model.train(was_training)
