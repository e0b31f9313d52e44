"""Arguments of the conversion scripts, one dataclass per concern, each checked once where it is
built (``check()``: ``ValueError`` naming the flag, which the scripts turn into a usage error).

* :class:`ConversionArguments` -- ``scripts/convert_checkpoint.py``: the source, the attention it
  gets, the head, the output folder, and its :class:`DistillationArguments`;
* :class:`LinearizationArguments` -- ``scripts/linearize_decoder.py``: the source, the texts and
  the run, with its stages, :class:`TransferArguments` (stage 1) and :class:`FinetuneArguments`
  (stage 2); :meth:`LinearizationArguments.flags` is the flat form ``run_args.json`` stores.

Field names are the flag names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .distillation import Distillation

__all__ = [
    "ConversionArguments",
    "DistillationArguments",
    "FinetuneArguments",
    "LinearizationArguments",
    "TransferArguments",
    "evaluation_name",
]


def _pick(cls, flags: dict[str, Any], **parts: Any):
    """``cls`` built from the entries of ``flags`` it has a field for, and ``parts``."""
    own = {f.name for f in dataclasses.fields(cls)} - set(parts)
    return cls(**{k: v for k, v in flags.items() if k in own}, **parts)


@dataclass
class DistillationArguments:
    """Attention distillation after the conversion (``--distill_*``; none without ``--distill_file``)."""

    distill_file: str | None = None
    distill_text_column: str = "text"
    # the defaults are the library's own (`Distillation`), not a second copy of them
    distill_steps: int = Distillation.steps
    distill_model_steps: int = Distillation.model_steps
    distill_batch_size: int = Distillation.batch_size
    distill_max_length: int = Distillation.max_length
    distill_learning_rate: float = Distillation.learning_rate
    distill_attention_weight_loss: float = Distillation.attention_weight_loss
    distill_max_documents: int | None = None
    seed: int = 0
    distill_device: str = "auto"

    def check(self) -> None:
        """Ranges and the device (the same check as the Python API, before the documents are read)."""
        for name in ("distill_steps", "distill_batch_size", "distill_max_length", "distill_max_documents"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if self.distill_model_steps < 0:
            raise ValueError(f"--distill_model_steps must be >= 0, got {self.distill_model_steps}")
        if not math.isfinite(self.distill_learning_rate) or not self.distill_learning_rate > 0:
            raise ValueError(f"--distill_learning_rate must be a finite number > 0, got {self.distill_learning_rate}")
        if not math.isfinite(self.distill_attention_weight_loss) or self.distill_attention_weight_loss < 0:
            raise ValueError(f"--distill_attention_weight_loss must be a finite number >= 0, got "
                             f"{self.distill_attention_weight_loss}")
        if self.distill_device != "auto":
            from .distillation import check_device

            try:
                check_device(self.distill_device)
            except ValueError as error:
                raise ValueError(f"--distill_device: {error}") from None

    def device(self) -> str:
        """--distill_device with "auto" resolved: "cuda" when a CUDA GPU is there, else "cpu"."""
        if self.distill_device != "auto":
            return self.distill_device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ConversionArguments:
    """What ``convert_checkpoint.py`` converts, into what, and where it writes it."""

    model_name_or_path: str
    output_dir: str
    attention_type: list[str] = field(default_factory=lambda: ["full"])
    task: str | None = None
    classifier_pooling: str | None = None
    num_labels: int | None = None
    tokenizer_name: str | None = None
    base_model: str | None = None
    config_overrides: str | None = None
    overwrite: bool = False
    distillation: DistillationArguments = field(default_factory=DistillationArguments)

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> ConversionArguments:
        """Built from the flat ``{flag name: value}`` of a parsed command line, and checked."""
        args = _pick(cls, flags, distillation=_pick(DistillationArguments, flags))
        args.check()
        return args

    def check(self) -> None:
        """Ranges, the distillation and the output folder, before any work (``ValueError``)."""
        from .convert import check_conversion_output

        if self.num_labels is not None and self.num_labels < 2:  # as run_classification.py's --num_labels
            raise ValueError(f"--num_labels must be >= 2, got {self.num_labels}: one class makes the classifier a "
                             "regression on the labels (MSE), which the classification script refuses too")
        self.distillation.check()
        # before any work: the conversion and distillation must not be thrown away at the end
        check_conversion_output(self.output_dir, overwrite=self.overwrite, model_name_or_path=self.model_name_or_path,
                                tokenizer_name=self.tokenizer_name, prefix="--",
                                distill_file=self.distillation.distill_file)

    @property
    def layer_attention(self) -> str | list[str]:
        """--attention_type as the converter takes it: one type, or one per layer."""
        return self.attention_type[0] if len(self.attention_type) == 1 else self.attention_type


@dataclass
class TransferArguments:
    """Stage 1 of a linearization: attention transfer (0 steps: skipped)."""

    steps: int = 400
    learning_rate: float = 1e-2


@dataclass
class FinetuneArguments:
    """Stage 2 of a linearization: next-token fine-tuning, LoRA or every weight, optionally
    distilling the source's logits (0 steps: skipped). ``finetune_learning_rate`` None takes the
    method's default when built (1e-3 for LoRA, 5e-5 for full fine-tuning)."""

    finetune_steps: int = 0
    finetune_method: str = "lora"
    finetune_learning_rate: float | None = None
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: list[str] | None = None
    finetune_new_attention: bool = True
    distill_weight: float = 0.0
    distill_temperature: float = 2.0

    def __post_init__(self) -> None:
        if self.finetune_learning_rate is None:
            self.finetune_learning_rate = 1e-3 if self.finetune_method == "lora" else 5e-5
        if self.lora_targets is None:
            from .decoder_finetune import LORA_TARGETS

            self.lora_targets = list(LORA_TARGETS)


# the order of linearize_decoder.py's flags, which run_args.json keeps
_LINEARIZATION_FLAGS = (
    "model_name_or_path", "gguf_file", "attention_type", "config_overrides", "init_model", "train_file",
    "text_column", "eval_file", "output_dir", "steps", "batch_size", "block_size", "learning_rate", "finetune_steps",
    "finetune_method", "finetune_learning_rate", "lora_rank", "lora_alpha", "lora_targets", "finetune_new_attention",
    "distill_weight", "distill_temperature", "eval_block_size", "eval_blocks", "skip_scores", "log_every",
    "checkpoint_every", "seed", "device",
)


@dataclass
class LinearizationArguments:
    """What ``linearize_decoder.py`` linearizes and on which texts, where the run goes, and its two stages."""

    model_name_or_path: str
    train_file: str
    eval_file: list[str]
    output_dir: str
    gguf_file: str | None = None
    attention_type: list[str] = field(default_factory=lambda: ["zformer"])
    config_overrides: str | None = None
    init_model: str | None = None
    text_column: str = "text"
    batch_size: int = 2
    block_size: int = 512
    eval_block_size: int = 1024
    eval_blocks: int = 32
    skip_scores: list[str] = field(default_factory=list)
    log_every: int = 5
    checkpoint_every: int = 25
    seed: int = 0
    device: str = "auto"
    transfer: TransferArguments = field(default_factory=TransferArguments)
    finetune: FinetuneArguments = field(default_factory=FinetuneArguments)

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> LinearizationArguments:
        """Built from the flat ``{flag name: value}`` of a parsed command line, and checked."""
        args = _pick(cls, flags, transfer=_pick(TransferArguments, flags), finetune=_pick(FinetuneArguments, flags))
        args.check()
        return args

    def flags(self) -> dict[str, Any]:
        """The arguments flat, by flag name, in the flags' order (stage 2's learning rate settled)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("transfer", "finetune")}
        flat = {**dataclasses.asdict(self.transfer), **dataclasses.asdict(self.finetune), **own}
        return {name: flat[name] for name in _LINEARIZATION_FLAGS}

    @property
    def layer_attention(self) -> str | list[str]:
        """--attention_type as the converter takes it: one type, or one per layer."""
        return self.attention_type[0] if len(self.attention_type) == 1 else self.attention_type

    def check(self) -> None:
        """Counts, rates and weights, peft, the device and the evaluation texts' names (``ValueError``
        on the first problem)."""
        from .decoder_finetune import peft_available

        flags = self.flags()
        for name in ("batch_size", "block_size", "eval_block_size", "eval_blocks", "log_every", "checkpoint_every",
                     "lora_rank"):
            if flags[name] < 1:
                raise ValueError(f"--{name} must be >= 1, got {flags[name]}")
        for name in ("steps", "finetune_steps"):
            if flags[name] < 0:
                raise ValueError(f"--{name} must be >= 0, got {flags[name]}")
        for name in ("learning_rate", "finetune_learning_rate", "lora_alpha", "distill_temperature"):
            if not (math.isfinite(flags[name]) and flags[name] > 0):
                raise ValueError(f"--{name} must be a finite number > 0, got {flags[name]}")
        finetune = self.finetune
        if not 0 <= finetune.distill_weight <= 1:
            raise ValueError(f"--distill_weight must be in [0, 1], got {finetune.distill_weight}")
        if finetune.finetune_steps and finetune.finetune_method == "lora" and not peft_available():
            raise ValueError("--finetune_method lora needs the peft package (pip install peft, or "
                             "hf_zformer[decoders]); --finetune_method full needs none")
        if self.device != "auto":
            _check_device(self.device)
        names = [evaluation_name(path) for path in self.eval_file]
        if len(set(names)) < len(names):
            raise ValueError(f"--eval_file {' '.join(self.eval_file)}: two files share the name {names} (folder/file)")


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:N, auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here")


def evaluation_name(path: str) -> str:
    """The key of an evaluation text in results.json: its folder and file name without extensions
    ("wikitext-2/valid", "imdb/test")."""
    path = Path(path)
    return f"{path.parent.name}/{path.name.split('.')[0]}"
