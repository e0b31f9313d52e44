"""What both converters share (BERT-family :mod:`.convert` and Llama-family :mod:`.convert_decoder`):
the source types that go to the decoder converter, the calibration text, and the output folder's
check (before any work) and atomic write (after it)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .. import folders

logger = logging.getLogger(__name__)

# causal LMs of these types go to the decoder converter (hf_zformer.conversion.convert_decoder)
DECODER_SOURCE_TYPES = ("llama", "mistral", "qwen2")

# Zformer's scale s is chosen on this text (see `calibrate_zformer_scales`): plain English prose,
# about 128 tokens for BERT's WordPiece vocabulary, the length s is matched at.
CALIBRATION_TEXT = (
    "The film opens on a quiet street in a small town, where nothing much has happened for years. "
    "Then a stranger arrives with a suitcase full of letters, and the neighbours start to talk. "
    "The acting is warm and unhurried, the camera lingers on faces rather than on events, and the "
    "music stays in the background. Some viewers will find the pace too slow; others will be glad of "
    "a story that trusts its audience. By the end, the letters have been delivered, a few secrets "
    "have come out, and the town looks a little different, though the street is as quiet as before. "
    "It is not a perfect film, but it is an honest one, and I would watch it again."
)


def check_conversion_output(output_dir, *, overwrite: bool, model_name_or_path, tokenizer_name=None,
                            prefix: str = "", distill_file=None) -> Path:
    """Before any work: restore what an interrupted replacement of ``output_dir`` left (a backup
    whose folder is missing is renamed back: :func:`hf_zformer.folders.recover`), then check that
    the converted model may be written there (:func:`hf_zformer.folders.check_output_dir`: new,
    empty, or with ``overwrite`` a folder holding only what the library wrote; never the source
    or the tokenizer folder, nor a folder holding the distillation's text). ``prefix`` is put before
    the argument names in messages (``--``). A staging folder of a conversion still running (another
    converter writing the same folder) is left to it."""
    path = Path(str(output_dir)).expanduser() if output_dir is not None and str(output_dir).strip() else None
    if path is not None and path.parent.is_dir() and not path.is_symlink():
        folders.recover(path.parent, target=path.name, logger=logger)
    inputs = {f"{prefix}model_name_or_path": model_name_or_path, f"{prefix}tokenizer_name": tokenizer_name,
              f"{prefix}distill_file": distill_file}
    return folders.check_output_dir(output_dir, overwrite=overwrite, name=f"{prefix}output_dir", inputs=inputs)


def save_converted(model, tokenizer, card: str, output_dir: Path):
    """Write the folder atomically: into a marked staging sibling, moved into place when complete
    (:func:`hf_zformer.folders.replace_atomically`, which replaces only a folder the library wrote).
    A model with a NaN or infinite weight is never written."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param.detach()).all()):
            raise ValueError(f"not writing {output_dir}: parameter {name} holds NaN or infinite values (a source "
                             "with non-finite weights, or a diverged distillation: lower distill_learning_rate)")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = folders.staging_dir(output_dir.parent, output_dir.name)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / "README.md").write_text(card)
        folders.replace_atomically(staging, output_dir)
    finally:
        folders.discard(staging)  # a staging folder holds only what was written into it here
