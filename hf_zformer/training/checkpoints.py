"""Resumable checkpoints of the training loop (library side, never shipped): :func:`save_checkpoint`
(``accelerator.save_state`` into a marked staging folder, then an atomic rename), :func:`load_checkpoint`,
:func:`check_checkpoint` (a damaged one named before any work), :func:`latest_checkpoint` and
:func:`clean_stale_checkpoints` (what an interrupted save left behind)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import numbers
import zipfile
from pathlib import Path
from typing import Any

import torch

from .. import folders

__all__ = [
    "TRAINING_STATE_FILE",
    "TrainingDiverged",
    "check_checkpoint",
    "clean_stale_checkpoints",
    "latest_checkpoint",
    "RESUMABLE_ARGS",
    "load_checkpoint",
    "require_finite",
    "run_identity",
    "save_checkpoint",
    "shared_staging_dir",
]

TRAINING_STATE_FILE = "training_state.json"

# Arguments that may differ between a run and its resumption: where the run is written and reported,
# how often it is saved, how it is launched and logged; every other argument defines the run (`run_identity`).
RESUMABLE_ARGS = frozenset({
    "resume_from_checkpoint", "output_dir", "overwrite_output_dir", "checkpointing_steps", "logging_steps",
    "with_tracking", "report_to", "verbose", "skip_test",
    "push_to_hub", "hub_model_id", "hub_token", "preprocessing_num_workers", "per_device_eval_batch_size",
    "cpu_allocator", "results_file", "trust_remote_code",
})


class TrainingDiverged(RuntimeError):
    """The loss or the weights of a run became NaN or infinite; nothing from that point is saved."""


def require_finite(model, what: str) -> None:
    """Raise :class:`TrainingDiverged` naming ``what`` and the first offending parameter when any
    parameter of ``model`` (this process's shard) holds a NaN or an infinity: a diverged model is
    never written as a checkpoint, a best model or a final model."""
    name = non_finite_parameter(model)
    if name is not None:
        raise TrainingDiverged(f"not saving {what}: parameter {name} holds NaN or infinite values (the run "
                               "diverged; lower --learning_rate or keep --max_grad_norm > 0)")


def non_finite_parameter(model) -> str | None:
    """The name of the first parameter of ``model`` that holds a NaN or an infinity, or None."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param.detach()).all()):
            return name
    return None


def shared_staging_dir(accelerator, parent: str | os.PathLike, target: str) -> Path:
    """A staging folder for ``parent/target`` (:func:`hf_zformer.folders.staging_dir`: unique name,
    the library's marker), made by the main process; every process gets its path."""
    from accelerate.utils import broadcast_object_list

    made = [str(folders.staging_dir(parent, target)) if accelerator.is_main_process else None]
    return Path(broadcast_object_list(made)[0])


def save_checkpoint(accelerator, output_dir: str | os.PathLike, name: str, state: dict[str, Any]) -> Path:
    """Save a resumable checkpoint ``output_dir/name`` atomically.

    Every process calls this (``save_state`` writes one RNG file per process). Everything goes to a
    marked staging folder first (:func:`shared_staging_dir`); the main process adds
    ``training_state.json`` (step counter, epoch, batches done in the epoch), renames the folder
    into place and records it in the run folder's marker, so a crash never leaves a half-written
    ``name`` behind, and only what the library wrote is ever cleaned.
    """
    final = Path(output_dir) / name
    tmp = shared_staging_dir(accelerator, output_dir, name)
    accelerator.wait_for_everyone()
    with _explain_disk_full(output_dir, f"checkpoint {name}", cleanup=tmp if accelerator.is_main_process else None):
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / TRAINING_STATE_FILE).write_text(json.dumps(state, indent=2))
            folders.replace_atomically(tmp, final)
            folders.record(output_dir, name)
    accelerator.wait_for_everyone()
    return final


@contextlib.contextmanager
def _explain_disk_full(folder: str | os.PathLike, what: str, cleanup: Path | None = None):
    """Turn ``OSError(ENOSPC)`` into a message that says the disk is full and names ``folder``
    (removing the partial ``cleanup`` folder to give the space back)."""
    try:
        yield
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        if cleanup is not None:
            folders.discard(cleanup)
        raise OSError(
            errno.ENOSPC,
            f"The disk is full: no space left on the device of {folder} while writing {what}. "
            "Free space there or pass another --output_dir.",
        ) from error


def clean_stale_checkpoints(output_dir: str | os.PathLike, logger=None) -> None:
    """Undo what an interrupted :func:`save_checkpoint` left in ``output_dir``
    (:func:`hf_zformer.folders.recover`): marked staging folders are removed, a marked backup is
    renamed back when its checkpoint is missing. Folders without the library's marker are kept."""
    folders.recover(output_dir, logger=logger)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The most recent complete checkpoint folder in ``output_dir`` (by modification time)."""
    candidates = [p for p in Path(output_dir).glob("*") if (p / TRAINING_STATE_FILE).is_file() and not p.name.startswith(".")]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


#: The fields of ``training_state.json`` and the kind of value each holds (``*``: always present).
_STATE_FIELDS = {
    "completed_steps*": "count", "epoch*": "count", "batches_done*": "count", "loss_count": "count",
    "loss_sum": "number", "train_runtime_s": "number", "best_metric": "number or null",
    "best_step": "count or null", "best_metrics": "object", "run_args": "object",
}


def _is_kind(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or null")
    if kind.startswith("count"):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind.startswith("number"):
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, dict)


def _incomplete(file: Path) -> str | None:
    """Why ``file``, a weight or state file of a checkpoint, cannot be loaded whole (None when it
    can): ``.safetensors`` files must cover what their header declares, the ``.bin`` / ``.pt`` /
    ``.pkl`` files ``torch.save`` writes are zip archives, whose directory is at their very end."""
    if file.stat().st_size == 0:
        return "it is empty"
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), "pt"):
                return None
        except Exception as error:  # noqa: BLE001  (SafetensorError is not importable by name everywhere)
            return f"truncated or damaged ({str(error).splitlines()[0]})"
    if file.suffix in (".bin", ".pt", ".pkl") and not zipfile.is_zipfile(file):
        return "truncated or damaged (not a complete archive written by torch.save)"
    return None


#: What a random-generator state file of ``accelerator.save_state`` holds (restored on resume).
RNG_FIELDS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def _unsafe(file: Path) -> str | None:
    """Why the ``torch.save`` file ``file`` is not loaded (None when it may be): a pickle holding
    anything but tensors and plain values (code that would run) is refused as accelerate's
    ``load_state`` refuses it, named here instead of a traceback; a random-generator state must hold
    the generators (accelerate would otherwise resume without them, saying so only at INFO level)."""
    from accelerate.utils import load

    try:
        loaded = load(str(file), map_location="cpu", mmap=True)
    except Exception as error:  # noqa: BLE001  (UnpicklingError, or what a damaged archive raises)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        why = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0])
        return (f"holds objects other than tensors and plain values ({why}); it is not unpickled, as it could "
                "run code: resume a checkpoint this library wrote")
    if file.name.startswith("random_states_") and not (isinstance(loaded, dict) and set(RNG_FIELDS) <= set(loaded)):
        return f"holds no random-generator state ({', '.join(RNG_FIELDS)}): the run cannot go on as it would have"
    return None


def check_checkpoint(path: str | os.PathLike, processes: int = 1) -> dict[str, Any]:
    """The training state of the checkpoint folder ``path``, after checking that resuming it can
    work: ``training_state.json`` is a JSON object with the fields a resume reads, the folder holds
    the model's weights, the optimizer's and the schedule's states (as ``accelerator.save_state``
    writes them: ``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``; FSDP's and
    DeepSpeed's own files count) and the random generators' state of each of ``processes``, no
    weight or state file is truncated, and none of its pickles holds more than tensors and plain
    values. Raises ``ValueError`` naming the file and what is wrong, so a damaged or untrusted
    checkpoint stops a script before any work."""
    folder = Path(path)
    state_file = folder / TRAINING_STATE_FILE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{state_file} cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{state_file} line {error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{state_file}: expected a JSON object, got {type(state).__name__}")
    for field, kind in _STATE_FIELDS.items():
        name = field.rstrip("*")
        if name not in state:
            if field.endswith("*"):
                raise ValueError(f"{state_file}: the field {name!r} is missing")
        elif not _is_kind(state[name], kind):
            expected = {"count": "a count (an integer >= 0)", "number": "a number", "object": "a JSON object"}[
                kind.split()[0]]
            raise ValueError(f"{state_file}: {name!r} is {state[name]!r}, expected {expected}"
                             + (" or null" if kind.endswith("or null") else ""))
    names = {entry.name for entry in folder.iterdir()}
    needed = {"model.safetensors": ("the model's weights", ("model.safetensors", "model-", "pytorch_model")),
              "optimizer.bin": ("the optimizer's state", ("optimizer",)),
              "scheduler.bin": ("the learning-rate schedule's state", ("scheduler",))}
    if any((folder / name).is_dir() and name.startswith("pytorch_model") for name in names):
        needed = {"model.safetensors": needed["model.safetensors"]}  # DeepSpeed's folder holds the rest
    for usual, (what, prefixes) in needed.items():
        if not any(name.startswith(prefixes) for name in names):
            raise ValueError(f"{folder} holds no {usual} ({what}): the checkpoint is incomplete")
    for index in range(processes):
        if f"random_states_{index}.pkl" not in names:
            raise ValueError(f"{folder} holds no random_states_{index}.pkl (the random generators of process "
                             f"{index}): resume with the number of processes that saved it")
    for file in sorted(folder.rglob("*")):
        problem = _incomplete(file) if file.is_file() and not file.name.startswith(".") else None
        if problem is None and file.is_file() and file.suffix in (".bin", ".pt", ".pkl"):
            problem = _unsafe(file)
        if problem:
            raise ValueError(f"{file}: {problem}")
    return state


def load_checkpoint(accelerator, path: str | os.PathLike) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG states; returns the saved training state."""
    accelerator.load_state(str(path))
    return json.loads((Path(path) / TRAINING_STATE_FILE).read_text())


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_identity(flags: dict[str, Any]) -> dict[str, Any]:
    """The arguments that define a run (all of its flat ``{flag name: value}`` but
    :data:`RESUMABLE_ARGS`), as JSON values. Stored in every checkpoint as ``run_args``; resuming
    with other values is refused (``arguments.validate_args``)."""
    return {key: _json(value) for key, value in sorted(flags.items()) if key not in RESUMABLE_ARGS}
