"""Fine-tuning of a converted Llama-family decoder after attention transfer (LoLCATs' second stage):
next-token loss on training text, optionally mixed with distillation from the source's logits.

`Finetuning(model, steps=...)` trains either low-rank adapters on the attention projections
(`method="lora"`, through `peft`, the ecosystem's LoRA; `pip install peft` or the `decoders` extra)
or every weight of the model (`method="full"`, no extra package). With `new_attention=True` (the
default) the new attention parameters of the converted layers (feature maps, window shares,
Fastformer's pooling vectors) train as well. With a `teacher` (the source, or any causal LM over the
same vocabulary) and `distill_weight=w > 0` the loss is

    (1 - w) * next-token cross-entropy + w * T^2 * KL(softmax(teacher / T) || softmax(student / T))

per predicted token (T = `temperature`). `merged_model()` folds the adapters into the projection
weights and returns a plain `ZformerLlamaForCausalLM` (saves and loads like any converted model).
"""

from __future__ import annotations

import importlib.util

import torch

from .decoder_transfer import TrainingStage, new_attention_parameters

FINETUNE_METHODS = ("lora", "full")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def peft_available() -> bool:
    """Whether the `peft` package (LoRA) is installed."""
    return importlib.util.find_spec("peft") is not None


def next_token_losses(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      teacher_logits: torch.Tensor | None = None, temperature: float = 1.0):
    """(cross-entropy, KL or None): the mean next-token cross-entropy of `logits` (batch, length,
    vocabulary) on `input_ids` and, with `teacher_logits`, the mean T^2-scaled
    KL(teacher || student) at temperature T, both over the predicted tokens whose input and target
    are real (attention_mask 1)."""
    predicted = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    weights = torch.ones(targets.shape, device=logits.device)
    if attention_mask is not None:
        weights = (attention_mask[:, 1:] * attention_mask[:, :-1]).to(weights.dtype)
    count = weights.sum().clamp_min(1)
    ce = torch.nn.functional.cross_entropy(predicted.flatten(0, 1), targets.flatten(), reduction="none")
    ce = (ce * weights.flatten()).sum() / count
    if teacher_logits is None:
        return ce, None
    teacher = torch.log_softmax(teacher_logits[:, :-1].float() / temperature, dim=-1)
    student = torch.log_softmax(predicted / temperature, dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return ce, (kl * weights).sum() / count * temperature**2


class Finetuning(TrainingStage):
    """AdamW on `model` with next-token loss (and distillation from `teacher` when `distill_weight`
    > 0), `steps` steps at `learning_rate` (5% linear warm-up, then cosine decay to a tenth;
    gradients clipped to norm 1). method "lora": adapters of rank `lora_rank` (scale
    `lora_alpha` / `lora_rank`, no dropout) on the `lora_targets` linear layers of every decoder
    layer, the base weights frozen; method "full": every weight trains. `step(ids, mask)` takes one
    step and returns {"loss", "next_token", "distillation"}; `state_dict` / `load_state_dict` hold
    what a resumed run needs."""

    label = "fine-tuning"

    def __init__(self, model, *, steps: int, learning_rate: float = 1e-3, method: str = "lora", lora_rank: int = 8,
                 lora_alpha: float = 16.0, lora_targets=LORA_TARGETS, new_attention: bool = True, teacher=None,
                 distill_weight: float = 0.0, temperature: float = 2.0):
        if method not in FINETUNE_METHODS:
            raise ValueError(f"fine-tuning: method={method!r} is not one of {FINETUNE_METHODS}")
        if steps < 1 or not learning_rate > 0:
            raise ValueError(f"fine-tuning: steps={steps} must be >= 1 and learning_rate={learning_rate} > 0")
        if not 0 <= distill_weight <= 1:
            raise ValueError(f"fine-tuning: distill_weight={distill_weight} must be in [0, 1]")
        if distill_weight > 0 and teacher is None:
            raise ValueError(f"fine-tuning: distill_weight={distill_weight} needs a teacher model")
        if not temperature > 0:
            raise ValueError(f"fine-tuning: temperature={temperature} must be > 0")
        self.steps, self.method, self.teacher = steps, method, teacher
        self.distill_weight, self.temperature = distill_weight, temperature
        for parameter in model.parameters():
            parameter.requires_grad_(method == "full")
        if method == "lora":
            if lora_rank < 1:
                raise ValueError(f"fine-tuning: lora_rank={lora_rank} must be >= 1")
            if not peft_available():
                raise ValueError("fine-tuning: method='lora' needs the peft package (pip install peft, or "
                                 "hf_zformer[decoders]); method='full' needs none")
            names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)}
            unknown = sorted(set(lora_targets) - names)
            if not lora_targets or unknown:
                raise ValueError(f"fine-tuning: lora_targets={list(lora_targets)} names no linear layer of the model "
                                 f"({unknown or 'none given'}; the model's: {sorted(names)})")
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, bias="none",
                                target_modules=list(lora_targets))
            self.model = get_peft_model(model, config)
        else:
            self.model = model
        self.base = model
        if new_attention:
            for parameter in new_attention_parameters(model).values():
                parameter.requires_grad_(True)
        self.parameters = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        if teacher is not None:
            for parameter in teacher.parameters():
                parameter.requires_grad_(False)
            teacher.eval()
        self.model.eval()  # no dropout: a resumed run repeats the same steps
        self._start_optimizer(steps, learning_rate)

    def trainable_count(self) -> int:
        return sum(p.numel() for p in self.parameters.values())

    def losses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        teacher_logits = None
        if self.distill_weight > 0:
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        ce, kl = next_token_losses(logits, input_ids, attention_mask, teacher_logits, self.temperature)
        loss = ce if kl is None else (1 - self.distill_weight) * ce + self.distill_weight * kl
        return {"loss": loss, "next_token": ce, "distillation": kl}

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, float | None]:
        losses = self.losses(input_ids, attention_mask)
        self._descend(losses["loss"])
        return {name: None if value is None else float(value.detach()) for name, value in losses.items()}

    def merged_model(self):
        """The fine-tuned model as a plain `ZformerLlamaForCausalLM` (eval mode): for LoRA the
        adapters folded into the projection weights (after which this object takes no more steps),
        for full fine-tuning the model itself."""
        model = self.model.merge_and_unload() if self.method == "lora" else self.model
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        return model.eval()


__all__ = ["FINETUNE_METHODS", "LORA_TARGETS", "Finetuning", "next_token_losses", "peft_available"]
