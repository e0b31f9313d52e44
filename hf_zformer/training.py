"""Shared machinery of the training/evaluation scripts in ``scripts/`` (library side, never shipped).

The scripts follow transformers' ``examples/pytorch/*_no_trainer.py``: a plain Accelerate loop that
runs unchanged on one process, N GPUs (DDP, FSDP, DeepSpeed) or N CPU processes (gloo), with mixed
precision and the process count chosen by ``accelerate launch``. This module holds what both
scripts need:

* argument groups and their validation (:func:`add_data_args`, :func:`add_model_args`,
  :func:`add_training_args`, :func:`validate_args`) so that bad arguments fail before any training;
* :func:`parse_config_overrides` / :func:`build_config`: ``"k=v,..."`` typed by the config field;
* batching: :class:`LengthGroupedBatchSampler` (length-bucketed, seeded per epoch, resumable) and
  :func:`pad_collate` (dynamic padding per batch);
* checkpoints: :func:`save_checkpoint` (``accelerator.save_state`` into a temporary folder, then an
  atomic rename) and :func:`load_checkpoint`;
* :func:`start_run` (accelerator, logging, seed, output directory), :func:`subsample` and
  :func:`load_tokenizer` (given, or trained on the data by the main process);
* feedback: progress bars on a terminal only (:func:`show_bars`), plain log lines in log files
  (:func:`progress` for evaluation/generation loops, a line every ``--logging_steps`` in training);
* :func:`train` -- the loop itself (gradient accumulation, clipping, per-epoch evaluation,
  step/epoch checkpointing, exact resume with ``skip_first_batches``);
* :func:`finish_run` -- ``save_pretrained`` + tokenizer + ``all_results.json`` + model card + push.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .evaluation import EvalTracker, add_evaluation_args, replace_atomically
from .modeling.configuration_zformer import ATTENTION_TYPES, CAUSAL_ATTENTION_TYPES, ZformerConfig

__all__ = [
    "LengthGroupedBatchSampler",
    "add_data_args",
    "add_model_args",
    "add_training_args",
    "build_config",
    "finish_run",
    "load_checkpoint",
    "load_tokenizer",
    "pad_collate",
    "parse_config_overrides",
    "progress",
    "save_checkpoint",
    "start_run",
    "subsample",
    "train",
    "validate_args",
]

SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
TRAINING_STATE_FILE = "training_state.json"
LOCK_FILE = ".lock"  # in --output_dir; holds the pid of the run that owns the folder


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------


def add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--dataset_name", default=None, help="Hugging Face Hub dataset name (exclusive with --data_dir).")
    group.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration name.")
    group.add_argument("--data_dir", default=None, help="Local dataset directory (exclusive with --dataset_name).")
    group.add_argument("--max_train_samples", type=int, default=None, help="Truncate the training set (debugging).")
    group.add_argument("--max_eval_samples", type=int, default=None, help="Truncate the validation/test sets.")
    group.add_argument("--preprocessing_num_workers", type=int, default=None, help="Processes for dataset.map.")


def add_model_args(parser: argparse.ArgumentParser, seq2seq: bool) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model_name_or_path",
        default=None,
        help="Fine-tune this checkpoint (folder or Hub id). Without it a new model is built from "
        "--attention_type and --config_overrides.",
    )
    group.add_argument("--attention_type", default=None, choices=ATTENTION_TYPES, help="Encoder attention of a new model.")
    if seq2seq:
        group.add_argument(
            "--decoder_attention_type",
            default="full",
            choices=CAUSAL_ATTENTION_TYPES,
            help="Causal decoder self-attention of a new model.",
        )
    group.add_argument(
        "--config_overrides",
        default=None,
        help='Config fields of a new model, "k=v,k2=v2" (e.g. "hidden_size=256,num_hidden_layers=3"); values are '
        "typed by the field's default; a per-layer list is written a|b|c.",
    )
    group.add_argument("--tokenizer_name", default=None, help="Tokenizer folder/Hub id (default: the model's, or train one).")
    group.add_argument("--vocab_size", type=int, default=8000, help="Vocabulary size of a tokenizer trained on the data.")
    group.add_argument("--trust_remote_code", action="store_true", help="Allow remote code of Hub checkpoints.")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--output_dir", required=True, help="Where the model, results and checkpoints go.")
    group.add_argument("--per_device_train_batch_size", type=int, default=32)
    group.add_argument("--per_device_eval_batch_size", type=int, default=64)
    group.add_argument("--learning_rate", type=float, default=5e-4)
    group.add_argument("--weight_decay", type=float, default=0.01)
    group.add_argument("--max_grad_norm", type=float, default=1.0, help="Gradient clipping (0: off).")
    group.add_argument("--num_train_epochs", type=int, default=3)
    group.add_argument("--max_train_steps", type=int, default=None, help="Overrides --num_train_epochs.")
    group.add_argument("--gradient_accumulation_steps", type=int, default=1)
    group.add_argument("--lr_scheduler_type", default="linear", choices=SCHEDULER_TYPES)
    group.add_argument("--num_warmup_steps", type=int, default=0)
    group.add_argument("--seed", type=int, default=42)
    group.add_argument(
        "--checkpointing_steps", default=None, help='Save a resumable checkpoint every N optimizer steps, or "epoch".'
    )
    group.add_argument(
        "--resume_from_checkpoint",
        default=None,
        help='Checkpoint folder to resume from, or "latest" for the newest one in --output_dir.',
    )
    group.add_argument("--with_tracking", action="store_true", help="Log metrics through accelerate's trackers.")
    group.add_argument(
        "--report_to", default="tensorboard", help='Trackers for --with_tracking: "tensorboard", "wandb", ..., or "all".'
    )
    group.add_argument("--logging_steps", type=int, default=50, help="Log the training loss every N optimizer steps.")
    group.add_argument("--push_to_hub", action="store_true", help="Upload the output folder to the Hub at the end.")
    group.add_argument("--hub_model_id", default=None, help="Repository of --push_to_hub, e.g. me/imdb-zformer.")
    group.add_argument("--hub_token", default=None, help="Token of --push_to_hub (default: the cached login).")
    add_evaluation_args(parser.add_argument_group("evaluation"))


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace, seq2seq: bool) -> argparse.Namespace:
    """Check the arguments shared by the scripts; ``parser.error`` (exit code 2) with a clear
    message on the first problem. Also builds the model config of a new model once, so invalid
    model settings (``ValueError`` of the config class) surface here, before any data is read."""
    if args.dataset_name and args.data_dir:
        parser.error("--dataset_name and --data_dir are exclusive: give one dataset source")
    if not args.dataset_name and not args.data_dir:
        parser.error("no data: pass --dataset_name (Hub) or --data_dir (local folder)")
    if args.data_dir and not Path(args.data_dir).expanduser().is_dir():
        parser.error(f"--data_dir {args.data_dir!r} is not a directory")
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "num_train_epochs",
        "vocab_size",
        "logging_steps",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("max_train_steps", "max_train_samples", "max_eval_samples", "eval_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.num_warmup_steps < 0:
        parser.error(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.checkpointing_steps is not None:
        if args.checkpointing_steps != "epoch":
            if not args.checkpointing_steps.isdigit() or int(args.checkpointing_steps) < 1:
                parser.error(f'--checkpointing_steps must be a positive integer or "epoch", got {args.checkpointing_steps!r}')
            args.checkpointing_steps = int(args.checkpointing_steps)
    if args.resume_from_checkpoint and args.resume_from_checkpoint != "latest":
        if not (Path(args.resume_from_checkpoint) / TRAINING_STATE_FILE).is_file():
            parser.error(
                f"--resume_from_checkpoint {args.resume_from_checkpoint!r} is not a checkpoint folder "
                f"(no {TRAINING_STATE_FILE}); checkpoints are the step_N/epoch_N folders of --output_dir"
            )
    if args.with_tracking:
        problem = _tracker_problem(args.report_to)
        if problem:
            parser.error(problem)
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id (the repository to create, e.g. your-name/imdb-zformer)")
    if args.model_name_or_path:
        if args.attention_type or args.config_overrides or (seq2seq and args.decoder_attention_type != "full"):
            parser.error(
                "--model_name_or_path fine-tunes an existing model; --attention_type, --decoder_attention_type and "
                "--config_overrides only describe a new model: drop one side"
            )
    else:
        if not args.attention_type:
            parser.error(f"pass --model_name_or_path, or --attention_type (one of {list(ATTENTION_TYPES)}) for a new model")
        try:
            args.config_kwargs = parse_config_overrides(args.config_overrides)
            build_config(args, vocab_size=max(args.vocab_size, 8), seq2seq=seq2seq)
        except ValueError as error:
            parser.error(f"invalid model configuration: {error}")
    return args


def _tracker_problem(report_to: str) -> str | None:
    """Why accelerate cannot log to ``--report_to`` (it would silently skip the tracker), or None."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = [str(getattr(t, "value", t)) for t in get_available_trackers()]
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if names == ["all"]:
        return None if available else "--with_tracking --report_to all: no tracker is installed (e.g. pip install tensorboard)"
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            return f"--report_to {name!r} is not a tracker accelerate knows; choose from {sorted(LOGGER_TYPE_TO_CLASS)}"
        if name not in available:
            return (f"--with_tracking logs to {name!r}, which is not installed: pip install {name} "
                    "(or drop --with_tracking, or pick an installed tracker with --report_to)")
    return None


def _config_fields() -> dict[str, Any]:
    """``{field: default}`` of every dataclass field of :class:`ZformerConfig`."""
    import dataclasses

    fields = {}
    for field in dataclasses.fields(ZformerConfig):
        if field.name.startswith("_") or not field.init:
            continue
        if field.default is not dataclasses.MISSING:
            fields[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            fields[field.name] = field.default_factory()
        else:
            fields[field.name] = None
    return fields


def _convert(key: str, raw: str, default: Any) -> Any:
    text = raw.strip()
    if text.lower() in ("none", "null"):
        return None
    if "|" in text:  # per-layer list, e.g. attention_type=fastformer|full
        return [part.strip() for part in text.split("|")]
    try:
        if isinstance(default, bool):
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        raise ValueError(f"config override {key}={raw!r}: expected a {type(default).__name__}") from None
    if default is None:  # optional field without a typed default: int, then float, else str
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
    return text


def parse_config_overrides(overrides: str | None) -> dict[str, Any]:
    """Parse ``"k=v,k2=v2"`` into typed config kwargs.

    Each value is converted to the type of the :class:`ZformerConfig` field's default (int, float,
    bool as true/false, str); ``none`` for optional fields; ``a|b|c`` for per-layer lists (e.g.
    ``attention_type=fastformer|full``). Unknown keys raise ``ValueError`` listing the valid ones.
    """
    if not overrides:
        return {}
    fields = _config_fields()
    result: dict[str, Any] = {}
    for item in overrides.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"config override {item!r} is not of the form key=value")
        key, value = (part.strip() for part in item.split("=", 1))
        if key not in fields:
            raise ValueError(
                f"unknown config field {key!r} in --config_overrides; valid fields: {', '.join(sorted(fields))}"
            )
        result[key] = _convert(key, value, fields[key])
    return result


def build_config(args: argparse.Namespace, vocab_size: int, seq2seq: bool, **extra: Any) -> ZformerConfig:
    """The config of a new model: ``--attention_type`` (+ ``--decoder_attention_type``), the parsed
    ``--config_overrides`` (which win), the tokenizer's vocabulary size and ``extra`` task fields."""
    kwargs: dict[str, Any] = {"attention_type": args.attention_type, "vocab_size": vocab_size, **extra}
    if seq2seq:
        kwargs["decoder_attention_type"] = args.decoder_attention_type
    kwargs.update(getattr(args, "config_kwargs", None) or parse_config_overrides(args.config_overrides))
    return ZformerConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# batching
# --------------------------------------------------------------------------------------------


class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length, in a random order that depends only on ``(seed, epoch)``.

    Each epoch: shuffle all indices, cut them into buckets of ``batch_size * bucket_batches``
    examples, sort every bucket by length, cut buckets into batches, shuffle the batches. Padding
    then stays small while the data order stays random. The order is a pure function of the epoch
    (:meth:`use_epoch`; not named ``set_epoch``, which accelerate calls with its own iteration count that
    restarts at 0 in a resumed run), so a resumed run sees the same batches; it consumes no global RNG.
    Without ``shuffle`` the batches are the dataset sorted by length (for evaluation).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 bucket_batches: int = 50, drop_last: bool = False):
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.bucket_batches = bucket_batches
        self.drop_last = drop_last
        self.epoch = 0

    def use_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        n = len(self.lengths)
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: -self.lengths[i])
            return [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        indices = torch.randperm(n, generator=generator).tolist()
        bucket = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, n, bucket):
            chunk = sorted(indices[start : start + bucket], key=lambda i: -self.lengths[i])
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        permutation = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in permutation]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.lengths) // self.batch_size
        return math.ceil(len(self.lengths) / self.batch_size)


def pad_collate(pad_token_id: int, label_pad_id: int = -100) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Collate function padding each batch to its own longest sequence (right padding).

    Features: ``input_ids`` (pad ``pad_token_id``), ``attention_mask`` (pad 0), ``labels`` (a list:
    pad ``label_pad_id``; a scalar: stacked), other scalars (e.g. ``index``) stacked.
    """

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        for key in features[0]:
            values = [f[key] for f in features]
            if isinstance(values[0], (list, tuple)):
                pad = {"input_ids": pad_token_id, "attention_mask": 0, "labels": label_pad_id}.get(key, 0)
                width = max(len(v) for v in values)
                batch[key] = torch.tensor([list(v) + [pad] * (width - len(v)) for v in values], dtype=torch.long)
            else:
                batch[key] = torch.tensor(values)
        return batch

    return collate


def make_dataloader(dataset, lengths, batch_size, collate_fn, *, shuffle, seed):
    """DataLoader with length-grouped batches and its own RNG (iterating it never draws from the
    global torch RNG, which dropout uses: resumed runs stay bit-identical)."""
    sampler = LengthGroupedBatchSampler(lengths, batch_size, shuffle=shuffle, seed=seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_fn, generator=torch.Generator().manual_seed(seed)
    )
    return loader, sampler


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------


def save_checkpoint(accelerator, output_dir: str | os.PathLike, name: str, state: dict[str, Any]) -> Path:
    """Save a resumable checkpoint ``output_dir/name`` atomically.

    Every process calls this (``save_state`` writes one RNG file per process). Everything goes to
    ``output_dir/.tmp-name`` first; the main process adds ``training_state.json`` (step counter,
    epoch, batches done in the epoch) and renames the folder into place, so a crash never leaves a
    half-written ``name`` behind.
    """
    final = Path(output_dir) / name
    tmp = Path(output_dir) / f".tmp-{name}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    with _explain_disk_full(output_dir, f"checkpoint {name}", cleanup=tmp if accelerator.is_main_process else None):
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / TRAINING_STATE_FILE).write_text(json.dumps(state, indent=2))
            replace_atomically(tmp, final)
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
            shutil.rmtree(cleanup, ignore_errors=True)
        raise OSError(
            errno.ENOSPC,
            f"The disk is full: no space left on the device of {folder} while writing {what}. "
            "Free space there or pass another --output_dir.",
        ) from error


def clean_stale_checkpoints(output_dir: str | os.PathLike, logger=None) -> None:
    """Undo what an interrupted :func:`save_checkpoint` left in ``output_dir``: remove
    ``.tmp-NAME`` folders (partial saves) and ``.old-NAME`` folders (a replaced checkpoint), or
    rename ``.old-NAME`` back to ``NAME`` when the run died between the two renames and it is the
    only copy."""
    for stale in sorted(Path(output_dir).glob(".tmp-*")) + sorted(Path(output_dir).glob(".old-*")):
        if not stale.is_dir():
            continue
        final = stale.with_name(stale.name.removeprefix(".old-"))
        if stale.name.startswith(".old-") and not final.exists():
            os.replace(stale, final)
            action = f"restored as {final}"
        else:
            shutil.rmtree(stale)
            action = "removed"
        if logger is not None:
            logger.warning(f"stale checkpoint folder {stale} of an interrupted run: {action}")


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The most recent complete checkpoint folder in ``output_dir`` (by modification time)."""
    candidates = [p for p in Path(output_dir).glob("*") if (p / TRAINING_STATE_FILE).is_file() and not p.name.startswith(".")]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def load_checkpoint(accelerator, path: str | os.PathLike) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG states; returns the saved training state."""
    accelerator.load_state(str(path))
    return json.loads((Path(path) / TRAINING_STATE_FILE).read_text())


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


def make_accelerator(args: argparse.Namespace):
    """The scripts' ``Accelerator``. A multi-process launch on a machine without accelerator
    (``accelerate launch --multi_gpu --num_processes N`` on CPU) becomes DDP over gloo: accelerate
    only picks its MULTI_CPU mode when asked for ``cpu=True``, and would otherwise run N
    independent single-process jobs."""
    from accelerate import Accelerator

    has_accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(
        cpu=multi_process and not has_accelerator,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=args.report_to if args.with_tracking else None,
        project_dir=args.output_dir,
    )


def show_bars() -> bool:
    """Progress bars only when stderr is a terminal: in a log file every redraw of a bar would be
    kept (carriage returns), so there the scripts write plain log lines instead."""
    return sys.stderr.isatty()


class _TqdmHandler(logging.StreamHandler):
    """Log lines through ``tqdm.write``, which clears the progress bars first and redraws them
    after, so a log line never ends up glued to a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(accelerator) -> None:
    """INFO logs on the main process (errors only elsewhere). Progress bars (ours, datasets',
    transformers', the Hub's) on the main process of a terminal only (:func:`show_bars`)."""
    import datasets
    import huggingface_hub
    import transformers
    from huggingface_hub.utils import logging as hub_logging

    handler = _TqdmHandler() if show_bars() else logging.StreamHandler()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO, handlers=[handler])
    # These libraries print through their own handler and also propagate to the root one, which
    # showed every Hub warning twice: keep theirs only.
    datasets.utils.logging.disable_propagation()
    hub_logging.disable_propagation()
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        logging.getLogger().setLevel(logging.ERROR)
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
        hub_logging.set_verbosity_error()
    if not (accelerator.is_local_main_process and show_bars()):
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def speed_line(done: int, total: int | None, elapsed: float, unit: str, new: int | None = None) -> str:
    """``"12.30 steps/s, elapsed 0:00:01, ETA 0:00:02"`` after ``done`` of ``total`` items, ``new``
    of them (default: all) done in the last ``elapsed`` seconds."""
    new = done if new is None else new
    rate = new / elapsed if elapsed > 0 else float("nan")
    text = f"{rate:.2f} {unit}/s, elapsed {_clock(elapsed)}"
    if total is not None and rate > 0 and done < total:
        text += f", ETA {_clock((total - done) / rate)}"
    return text


def progress(iterable, *, desc: str, total: int | None = None, main: bool = True, every_s: float = 30.0):
    """Iterate ``iterable`` with feedback: a tqdm bar on a terminal (main process only; see
    :func:`show_bars`), else on the main process a log line every ``every_s`` seconds and one at
    the end, so that long evaluation or generation loops never run silently."""
    from tqdm.auto import tqdm

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if show_bars() or not main:
        with tqdm(iterable, desc=desc, total=total, disable=not main, leave=False, dynamic_ncols=True, unit="batch") as bar:
            yield from bar
        return
    log = logging.getLogger(__name__)
    log.info(f"{desc}: {total if total is not None else '?'} batches")
    started = last = time.perf_counter()
    done = 0
    for item in iterable:
        yield item
        done += 1
        if time.perf_counter() - last >= every_s:
            last = time.perf_counter()
            log.info(f"{desc}: {done}/{total or '?'} batches, {speed_line(done, total, last - started, 'batches')}")
    log.info(f"{desc}: done {done} batches, {speed_line(done, total, time.perf_counter() - started, 'batches')}")


def start_run(args: argparse.Namespace, logger_name: str):
    """What every script does first: the Accelerator, logging (quiet on non-main processes), the
    seed, and the output directory (created by the main process, seen by all). Returns
    ``(accelerator, logger)``."""
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed

    accelerator = make_accelerator(args)
    setup_logging(accelerator)
    logger = get_logger(logger_name)
    logger.info(accelerator.state, main_process_only=True)
    set_seed(args.seed)
    problem = None  # checked by the main process, raised by all (no process is left waiting)
    if accelerator.is_main_process:
        try:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            lock_output_dir(args.output_dir)
            clean_stale_checkpoints(args.output_dir, logger)
            if args.push_to_hub:
                from .hub import check_push_access

                check_push_access(args.hub_model_id, token=args.hub_token)
        except (RuntimeError, OSError) as error:
            problem = str(error)
    from accelerate.utils import broadcast_object_list

    problem = broadcast_object_list([problem])[0]
    if problem:
        raise SystemExit(f"error: {problem}")
    accelerator.wait_for_everyone()
    return accelerator, logger


_LOCKS: dict[str, Any] = {}  # lock file -> its open handle, held (locked) until the process exits


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """Make this process the only run writing ``output_dir``: an exclusive ``flock`` on
    ``output_dir/.lock`` (which records our pid), held until the process exits; taking it again in
    the same process is a no-op. Raises ``RuntimeError`` naming the folder and the pid of the run
    that holds it. (No locking where ``fcntl`` does not exist, i.e. on Windows.)"""
    try:
        import fcntl
    except ImportError:
        return
    path = (Path(output_dir) / LOCK_FILE).resolve()
    if str(path) in _LOCKS:
        return
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise RuntimeError(
            f"--output_dir {output_dir} is in use by another run (pid {owner}, lock file {path}): two runs in one "
            "folder overwrite each other's checkpoints and results. Wait for it to end or stop it, or pass another "
            "--output_dir."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _LOCKS[str(path)] = handle


@contextlib.contextmanager
def data_errors():
    """Stop the script with the message of a data problem (the loaders' ``ValueError`` /
    ``FileNotFoundError`` name the file, line and value) instead of a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None


def subsample(raw, limits: dict[str, int | None], seed: int) -> None:
    """Keep a seeded random ``limit`` rows of each split in ``limits`` (``--max_*_samples``), in place."""
    for split, limit in limits.items():
        if limit is not None and limit < len(raw[split]):
            raw[split] = raw[split].shuffle(seed=seed).select(range(limit))


def load_tokenizer(args: argparse.Namespace, accelerator, raw, **train_kwargs):
    """``--tokenizer_name`` or the base model's tokenizer; without either, one trained on ``raw``
    by the main process (:func:`hf_zformer.tokenization.train_tokenizer` with ``train_kwargs``)
    and saved in ``--output_dir``, where every process loads it from."""
    from transformers import AutoTokenizer

    from .tokenization import train_tokenizer

    source = args.tokenizer_name or args.model_name_or_path
    if source:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    if accelerator.is_main_process:
        train_tokenizer(raw, vocab_size=args.vocab_size, save_dir=args.output_dir, show_progress=show_bars(), **train_kwargs)
    accelerator.wait_for_everyone()
    return AutoTokenizer.from_pretrained(args.output_dir)


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases, norms and the Zformer scale (as in the examples)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate)


def _tracker_config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items() if k != "hub_token"}


def train(
    args: argparse.Namespace,
    accelerator,
    model,
    optimizer,
    train_dataloader,
    train_sampler: LengthGroupedBatchSampler,
    evaluate_fn: Callable[[], dict[str, float]],
    logger,
    *,
    tokenizer=None,
    best_metric: str | None = None,
) -> dict[str, Any]:
    """Run the training loop on prepared ``model``/``optimizer``/``train_dataloader``.

    Builds and prepares the LR scheduler, resumes from ``--resume_from_checkpoint``, evaluates with
    ``evaluate_fn`` (returns ``{"bleu": ...}``-style metrics) after every epoch and every
    ``--eval_steps`` (:class:`hf_zformer.evaluation.EvalTracker`: history file, ``--save_best`` on
    ``best_metric``, saved with ``tokenizer``), checkpoints every ``--checkpointing_steps``. Returns
    the last evaluation metrics prefixed ``eval_`` (with ``--save_best``: the best evaluation's, the
    last one's as ``last_eval_``, and the final model holds the best weights) plus ``best_step``,
    ``train_loss``, ``train_steps``, ``epoch``, ``train_runtime_s``, ``eval_runtime_s``.
    """
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    updates_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * updates_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / updates_per_epoch)
    # A prepared scheduler steps once per process per optimizer step (the examples' convention).
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    lr_scheduler = accelerator.prepare(lr_scheduler)

    if args.with_tracking:
        accelerator.init_trackers(Path(args.output_dir).name or "run", _tracker_config(args))

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(
        f"Training: {len(train_sampler.lengths)} examples, {args.num_train_epochs} epochs, {args.max_train_steps} "
        f"optimizer steps, batch {args.per_device_train_batch_size}/device x {accelerator.num_processes} processes x "
        f"{args.gradient_accumulation_steps} accumulation = {total_batch}"
    )

    tracker = EvalTracker(args, accelerator, model, evaluate_fn, metric=best_metric, tokenizer=tokenizer,
                          updates_per_epoch=updates_per_epoch, logger=logger)
    completed_steps, start_epoch, resume_batches = 0, 0, 0
    loss_sum, loss_count, runtime_before = 0.0, 0, 0.0  # whole-run statistics, carried by checkpoints
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest":
            path = latest_checkpoint(args.output_dir)
            if path is None:
                raise FileNotFoundError(f"--resume_from_checkpoint latest: no checkpoint in {args.output_dir}")
        state = load_checkpoint(accelerator, path)
        completed_steps, start_epoch, resume_batches = state["completed_steps"], state["epoch"], state["batches_done"]
        loss_sum, loss_count = state.get("loss_sum", 0.0), state.get("loss_count", 0)
        runtime_before = state.get("train_runtime_s", 0.0)
        tracker.restore(state, completed_steps, path)
        if resume_batches >= len(train_dataloader):
            start_epoch, resume_batches = start_epoch + 1, 0
        logger.info(f"Resumed from {path}: step {completed_steps}, epoch {start_epoch}, batch {resume_batches}")

    bars = show_bars()  # else (a log file): a plain line every --logging_steps instead of bar redraws
    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process or not bars, desc="train")
    progress.update(completed_steps)
    started, first_step = time.perf_counter(), completed_steps
    metrics: dict[str, Any] = {}
    running_loss, running_count, last_loss = torch.zeros((), device=accelerator.device), 0, float("nan")
    total_loss = torch.tensor(loss_sum, device=accelerator.device)  # this process's sum (mean over processes)

    def run_state(**position: int) -> dict[str, Any]:
        """A checkpoint's training state: the loop position plus the statistics of the run so far."""
        return {**position, "loss_sum": accelerator.gather(total_loss).mean().item(), "loss_count": loss_count,
                "train_runtime_s": runtime_before + time.perf_counter() - started}

    epoch = start_epoch
    for epoch in range(start_epoch, args.num_train_epochs):
        if completed_steps >= args.max_train_steps:
            break
        model.train()
        train_sampler.use_epoch(epoch)
        skip = resume_batches if epoch == start_epoch else 0
        loader = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for batches_done, batch in enumerate(loader, start=skip + 1):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            running_loss += loss.detach().float()
            running_count += 1
            total_loss += loss.detach().float()
            loss_count += 1
            if not accelerator.sync_gradients:
                continue
            completed_steps += 1
            progress.update(1)
            if completed_steps % args.logging_steps == 0 or completed_steps == args.max_train_steps:
                last_loss = accelerator.gather(running_loss).mean().item() / running_count
                running_loss.zero_()
                running_count = 0
                lr = lr_scheduler.get_last_lr()[0]
                progress.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}")
                if not bars:
                    speed = speed_line(completed_steps, args.max_train_steps, time.perf_counter() - started, "steps",
                                       new=completed_steps - first_step)
                    logger.info(f"step {completed_steps}/{args.max_train_steps}: loss {last_loss:.4f}, lr {lr:.3e}, {speed}")
                if args.with_tracking:
                    accelerator.log({"train_loss": last_loss, "lr": lr}, step=completed_steps)
            if tracker.due(completed_steps):
                tracker.evaluate(completed_steps)
            if isinstance(args.checkpointing_steps, int) and completed_steps % args.checkpointing_steps == 0:
                save_checkpoint(
                    accelerator,
                    args.output_dir,
                    f"step_{completed_steps}",
                    {**run_state(completed_steps=completed_steps, epoch=epoch, batches_done=batches_done), **tracker.state()},
                )
            if completed_steps >= args.max_train_steps:
                break
        tracker.evaluate(completed_steps, epoch)  # no-op when --eval_steps just evaluated this step
        metrics = {f"eval_{k}": v for k, v in tracker.last_metrics.items()}
        if args.with_tracking:
            accelerator.log({"epoch": epoch}, step=completed_steps)
        if args.checkpointing_steps == "epoch":
            save_checkpoint(
                accelerator,
                args.output_dir,
                f"epoch_{epoch}",
                {**run_state(completed_steps=completed_steps, epoch=epoch + 1, batches_done=0), **tracker.state()},
            )
    progress.close()
    final = run_state()
    if not metrics:  # resumed from a checkpoint at the very end: still report evaluation
        tracker.evaluate(completed_steps, again=True)
        metrics = {f"eval_{k}": v for k, v in tracker.last_metrics.items()}
    if tracker.load_best():
        metrics = {**{f"last_{k}": v for k, v in metrics.items()},
                   **{f"eval_{k}": v for k, v in tracker.best_metrics.items()}}
    if args.with_tracking:
        accelerator.end_training()
    return {
        **metrics,
        # mean loss over every batch of the whole run (resumed segments included); None if unknown
        "train_loss": final["loss_sum"] / loss_count if loss_count else None,
        "train_steps": completed_steps,
        # epochs trained, as a fraction (HF Trainer's convention): the same for a resumed run, which
        # an epoch index was not (resuming the final epoch checkpoint reported one more)
        "epoch": round(completed_steps / updates_per_epoch, 2),
        "train_runtime_s": round(final["train_runtime_s"], 1),
        "eval_runtime_s": round(tracker.eval_runtime_s, 1),
        **tracker.summary(),
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
    }


def command_line(secret: str | None = None) -> str:
    """The command that started this process, as it would be typed (``accelerate launch`` noted),
    with ``secret`` (the parsed ``--hub_token``, however the option was spelled) redacted."""
    argv = [Path(sys.argv[0]).as_posix()] + sys.argv[1:]
    for i, arg in enumerate(argv):  # never write a token into a model card
        if arg == "--hub_token" and i + 1 < len(argv):
            argv[i + 1] = "REDACTED"
        elif arg.startswith("--hub_token="):
            argv[i] = "--hub_token=REDACTED"
        elif secret and arg == secret:
            argv[i] = "REDACTED"
        elif secret and arg.startswith("-") and arg.endswith(f"={secret}"):
            argv[i] = arg[: -len(secret)] + "REDACTED"
    script = " ".join(shlex.quote(a) for a in argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ:
        options = []
        if world > 1:
            options.append(f"--multi_gpu --num_processes {world}")
        precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if precision != "no":
            options.append(f"--mixed_precision {precision}")
        return f"accelerate launch {' '.join(options)} {script}".replace("  ", " ")
    return f"python {script}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _results_to_write(results: dict[str, Any], path: Path, logger) -> dict[str, Any]:
    """``results`` as strict JSON: a non-finite number becomes ``None``, and a value this run could
    not measure (``None``, e.g. the loss after resuming a checkpoint that predates the run
    statistics) keeps the number an earlier run already wrote to ``path``: never replace good
    results with empty ones."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in results.items()}
    try:
        previous = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        previous = {}
    previous = previous if isinstance(previous, dict) else {}
    for key, value in clean.items():
        if value is None and _is_number(previous.get(key)):
            logger.warning(f"{key}: not measured by this run, keeping {previous[key]} from the existing {path}")
            clean[key] = previous[key]
    return clean


def finish_run(
    args: argparse.Namespace,
    accelerator,
    model,
    tokenizer,
    results: dict[str, Any],
    card_kwargs: dict[str, Any],
    logger,
) -> None:
    """Write the final model (loadable with ``trust_remote_code=True``), tokenizer,
    ``all_results.json`` and the model card into ``--output_dir``; push it if asked.

    The card names the dataset (``--dataset_name``, also listed as the card's Hub dataset, else the
    ``--data_dir`` folder, with ``--dataset_config_name``), the model (``--hub_model_id``, else the
    output folder, which its usage snippet loads: ``--output_dir`` as given) and the base model from
    ``args``; ``card_kwargs`` adds the script's task, metric, languages and usage example."""
    from . import hub

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        results = _results_to_write(results, Path(args.output_dir) / "all_results.json", logger)
        with open(Path(args.output_dir) / "all_results.json", "w") as f:
            json.dump(results, f, indent=2, allow_nan=False)
        card = hub.model_card(
            config=unwrapped.config,
            results=results,
            command=command_line(args.hub_token),
            dataset_name=args.dataset_name or Path(args.data_dir).name,
            dataset_config=args.dataset_config_name,
            model_name=args.hub_model_id or Path(args.output_dir).name,
            model_id=args.hub_model_id or args.output_dir,  # the usage snippet loads this as written
            hub_dataset=bool(args.dataset_name),  # a --data_dir folder name is no Hub dataset id
            base_model=args.model_name_or_path,
            **card_kwargs,
        )
        (Path(args.output_dir) / "README.md").write_text(card)
        logger.info(f"results: {json.dumps(results)}")
        if args.push_to_hub:
            url = hub.push_to_hub(args.output_dir, args.hub_model_id, token=args.hub_token)
            logger.info(f"pushed to {url}")
    accelerator.wait_for_everyone()
