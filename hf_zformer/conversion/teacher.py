"""Knowledge distillation from a fine-tuned teacher classifier (library side, never shipped).

``run_classification.py --teacher_model_name_or_path T`` trains its model (the student) on the
loss of :class:`TeacherLoss`:

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))   (mean over every text)
         + (1 - alpha) * cross-entropy(student, label)                      (mean over labelled texts)

with ``T`` the temperature (the ``T^2`` keeps the gradient's size independent of it, as in Hinton
et al., 2015). Texts of ``--unlabeled_file`` join the training set with the label -100: they add
only the teacher term, which is how a fine-tuned full-attention model passes what it learned on
the labelled data to a linear-attention student on any amount of unlabeled text.

The teacher runs in eval mode (no dropout) without gradients, on the batch the student sees, so it
needs the student's vocabulary (one tokenizer for both) and its classes; :func:`load_teacher`
checks both and names the mismatch. It runs under the run's mixed precision (``autocast``, the
scripts pass ``accelerator.autocast``), as the student does: in fp32 its forward pass would cost
as much as the student's bf16 forward and backward together.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

IGNORE_LABEL = -100  # the label of an unlabeled text: it only learns from the teacher


def load_teacher(path: str, student_config, device, *, max_length: int | None = None, trust_remote_code: bool = False):
    """The fine-tuned classifier at ``path`` (folder or Hub id), frozen, in eval mode on ``device``.
    ``ValueError`` naming the problem when there is no model at ``path``, when it is not a trained
    classifier (a masked-LM or base folder would get a random classifier), when its vocabulary or
    classes differ from ``student_config``'s, or when it has fewer positions than ``max_length``."""
    from transformers import AutoModelForSequenceClassification

    where = f"--teacher_model_name_or_path {path}"
    try:
        teacher, loading = AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=trust_remote_code, dtype=torch.float32, output_loading_info=True
        )
    except OSError as error:
        raise ValueError(f"{where}: no model there ({str(error).splitlines()[0]})") from None
    untrained = [key for key in loading["missing_keys"] if key.split(".")[0] in ("classifier", "pooler", "score")]
    if untrained:
        raise ValueError(f"{where} is not a trained classifier: {', '.join(untrained[:3])} would start random "
                         f"(it is a {', '.join(teacher.config.architectures or ['model'])} checkpoint); pass the "
                         "output folder of a fine-tuned classification run")
    for field, meaning in (("vocab_size", "vocabulary (tokenizer)"), ("num_labels", "number of classes")):
        ours, theirs = getattr(student_config, field), getattr(teacher.config, field)
        if ours != theirs:
            raise ValueError(f"{where}: its {field} is {theirs}, the model's is {ours}; "
                             f"teacher and student need one {meaning}")
    positions = getattr(teacher.config, "max_position_embeddings", None)
    if max_length is not None and positions is not None:
        room = positions - getattr(teacher.config, "position_offset", 0)
        if room < max_length:
            raise ValueError(f"{where} holds {room} tokens (max_position_embeddings={positions}) but --max_length is "
                             f"{max_length}: lower --max_length to {room} or pass a teacher with more positions")
    teacher.requires_grad_(False)
    return teacher.eval().to(device)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      alpha: float, temperature: float) -> torch.Tensor:
    """The loss of the module docstring for logits ``(B, K)`` and ``labels`` ``(B,)`` (-100: no
    label). Computed in fp32; a batch with no labelled text has only the teacher term."""
    student, teacher = student_logits.float(), teacher_logits.float()
    soft = F.kl_div(F.log_softmax(student / temperature, dim=-1), F.log_softmax(teacher / temperature, dim=-1),
                    reduction="none", log_target=True).sum(-1).mean()
    loss = alpha * temperature**2 * soft
    labelled = labels != IGNORE_LABEL
    if alpha < 1 and bool(labelled.any()):
        loss = loss + (1 - alpha) * F.cross_entropy(student[labelled], labels[labelled])
    return loss


#: The highest distillation temperature accepted. Distillation uses 1-20 (Hinton et al., 2015); far
#: above, both softened distributions are uniform to float32's precision (nothing is taught) and the
#: T^2 factor overflows (at T=1e30 the loss is NaN, which reads as a divergence).
MAX_TEMPERATURE = 100.0


def temperature_problem(temperature: float) -> str | None:
    """Why ``temperature`` cannot be a distillation temperature (a phrase), or None."""
    if not 0 < temperature <= MAX_TEMPERATURE:
        return (f"must be in (0, {MAX_TEMPERATURE:g}], got {temperature:g} (distillation uses 1-20; far above, "
                "the softened distributions are uniform to float precision and T^2 overflows the loss)")
    return None


class TeacherLoss:
    """``loss_fn(model, batch)`` for :func:`hf_zformer.training.train`: the student's forward on
    ``batch`` (input_ids, attention_mask, labels) and the teacher's, combined by
    :func:`distillation_loss`."""

    def __init__(self, teacher, alpha: float = 0.5, temperature: float = 2.0,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"distillation alpha must be in [0, 1], got {alpha}")
        if temperature_problem(temperature):
            raise ValueError(f"distillation temperature {temperature_problem(temperature)}")
        self.teacher, self.alpha, self.temperature, self.autocast = teacher, alpha, temperature, autocast

    def __call__(self, model, batch) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad(), self.autocast():
            teacher_logits = self.teacher(**inputs).logits
        return distillation_loss(model(**inputs).logits, teacher_logits, batch["labels"], self.alpha, self.temperature)
