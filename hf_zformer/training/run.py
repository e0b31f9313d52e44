"""Setting up and finishing a training script's run (library side, never shipped).

* :func:`start_run` -- accelerator (:func:`make_accelerator`), logging, seed, and the output
  directory (created, locked against a second run, what an interrupted save left recovered, with
  ``--overwrite_output_dir`` the files an earlier run recorded deleted: :mod:`hf_zformer.folders`);
* :func:`data_errors`, :func:`subsample` and :func:`load_tokenizer` (given, or trained on the data
  by the main process);
* :func:`finish_run` -- ``save_pretrained`` + tokenizer + ``training_args.json`` + ``all_results.json``
  + model card + push, the card recording the :func:`command_line` that made the run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import folders
from ..hub import weights_failure
from .checkpoints import TrainingDiverged, require_finite
from .feedback import get_logger, setup_logging, show_bars
from ..memory import retain_freed_memory
from .results import save_training_args

if TYPE_CHECKING:
    from .arguments import ModelArguments, RunArguments, TrainingArguments

__all__ = [
    "command_line",
    "data_errors",
    "finish_run",
    "load_tokenizer",
    "lock_output_dir",
    "make_accelerator",
    "pretrained_tokenizer",
    "start_run",
    "subsample",
    "write_errors",
]

LOCK_FILE = ".lock"  # in --output_dir; holds the pid of the run that owns the folder
RUN_FILES = folders.RUN_FILES


def make_accelerator(training: TrainingArguments):
    """The scripts' ``Accelerator``. A multi-process launch on a machine without accelerator
    (``accelerate launch --multi_gpu --num_processes N`` on CPU) becomes DDP over gloo: accelerate
    only picks its MULTI_CPU mode when asked for ``cpu=True``, and would otherwise run N
    independent single-process jobs."""
    from accelerate import Accelerator

    has_accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    problem = precision_problem(precision, has_accelerator)
    if problem:
        usage_error(problem)
    try:
        accelerator = Accelerator(
            cpu=multi_process and not has_accelerator,
            gradient_accumulation_steps=training.gradient_accumulation_steps,
            log_with=training.report_to if training.with_tracking else None,
            project_dir=training.output_dir,
        )
    except ValueError as error:  # e.g. fp8 without transformer_engine or torchao
        usage_error(f"--mixed_precision {precision}: {str(error).splitlines()[0]}")
    if accelerator.mixed_precision == "fp16" and not accelerator.native_amp:  # a device without fp16 autocast
        usage_error(precision_problem("fp16", False))
    return accelerator


PRECISIONS = ("no", "fp16", "bf16", "fp8")  # accelerate's --mixed_precision choices


def precision_problem(precision: str, has_accelerator: bool) -> str | None:
    """Why the mixed precision ``precision`` (accelerate's ``--mixed_precision``, as its launcher
    passes it: ``ACCELERATE_MIXED_PRECISION``) cannot run here, or None. On a CPU, accelerate takes
    fp16 but runs fp32 (its records would say fp16), and fp8 needs an NVIDIA GPU of compute
    capability 8.9 or newer. A value that is none of accelerate's (``no``, ``fp16``, ``bf16``,
    ``fp8``) ran fp32 and was recorded as given."""
    if precision not in PRECISIONS:
        return (f"--mixed_precision {precision!r} (ACCELERATE_MIXED_PRECISION) is none of {', '.join(PRECISIONS)}: "
                "accelerate would run fp32 and the records would name it; launch with one of them")
    if precision == "fp16" and not has_accelerator:
        return ("--mixed_precision fp16 needs a GPU: on the CPU accelerate would run fp32 and record it as fp16; "
                "launch with --mixed_precision bf16 (which the CPU runs) or no (fp32)")
    if precision == "fp8" and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        return ("--mixed_precision fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (H100, L4, RTX 40xx) "
                "and transformer_engine or torchao; launch with --mixed_precision bf16 or no (fp32)")
    return None



def start_run(training: TrainingArguments, logger_name: str):
    """What every script does first: the Accelerator, logging (quiet on non-main processes), the
    seed, and the output directory (created by the main process, seen by all). Returns
    ``(accelerator, logger)``."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(training)
    setup_logging(accelerator)
    logger = get_logger(logger_name, accelerator, training.verbose)
    if accelerator.num_processes > 1 or training.verbose:  # accelerate's environment, worth reading with several processes
        logger.info(accelerator.state, main_process_only=True)
    if training.cpu_allocator == "retain" and retain_freed_memory():
        logger.info("C allocator: freed memory is kept for reuse (--cpu_allocator retain)", main_process_only=True)
    set_seed(training.seed)
    problem = _prepare_output_dir(training, accelerator, logger)
    from accelerate.utils import broadcast_object_list

    problem = broadcast_object_list([problem])[0]
    if problem:
        raise SystemExit(f"error: {problem}")
    accelerator.wait_for_everyone()
    return accelerator, logger


def _prepare_output_dir(training: TrainingArguments, accelerator, logger) -> str | None:
    """The main process creates, marks, locks and recovers ``--output_dir`` (adopting or clearing
    an earlier run) and checks the Hub repository; what went wrong, for every process to raise
    (no process is left waiting), or None."""
    if not accelerator.is_main_process:
        return None
    output_dir = training.output_dir
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        if not folders.files_under(output_dir):  # marked before the lock file makes it non-empty,
            folders.record(output_dir)  # so the other processes' check never sees a foreign folder
        lock_output_dir(output_dir)
        folders.recover(output_dir, logger=logger)
        if training.resume_from_checkpoint and folders.read_marker(output_dir) is None:
            adopt_earlier_run(output_dir)
        if training.overwrite_output_dir and not training.resume_from_checkpoint:
            clear_earlier_run(output_dir, logger)
        folders.record(output_dir, LOCK_FILE)
        if training.push_to_hub:
            from ..hub import check_push_access

            check_push_access(training.hub_model_id, token=training.hub_token)
    except (RuntimeError, OSError, ValueError) as error:
        return str(error)
    return None


def clear_earlier_run(output_dir: str | os.PathLike, logger=None) -> None:
    """``--overwrite_output_dir``: delete, file by file, what earlier runs recorded in the marker of
    ``output_dir`` (:func:`hf_zformer.folders.remove_recorded`), so a new run neither resumes nor
    extends them; anything else in the folder stays."""
    folders.remove_recorded(output_dir, keep=(LOCK_FILE,), logger=logger)


def adopt_earlier_run(output_dir: str | os.PathLike) -> None:
    """Resuming a run folder written before folders carried the library's marker: mark its
    checkpoints, ``best/`` and evaluation history (``arguments.earlier_run_files``) as the library's,
    so they can be replaced as the run goes on. Nothing else in the folder is claimed."""
    from .arguments import earlier_run_files

    folders.adopt(output_dir, [path.name for path in earlier_run_files(output_dir)])


_LOCKS: dict[str, Any] = {}  # lock file -> its open handle, held (locked) until the process exits


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """Make this process the only run writing ``output_dir``: an exclusive ``flock`` on
    ``output_dir/.lock`` (which records our pid), held until the process exits, when the file is
    removed (:func:`_release_lock`); taking it again in the same process is a no-op. Raises
    ``RuntimeError`` naming the folder and the pid of the run that holds it. (No locking where
    ``fcntl`` does not exist, i.e. on Windows.)"""
    try:
        import fcntl
    except ImportError:
        return
    path = (Path(output_dir) / LOCK_FILE).resolve()
    if str(path) in _LOCKS:
        return
    while True:  # opened without truncating it, never through a link
        handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644), "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise RuntimeError(
                f"--output_dir {output_dir} is in use by another run (pid {owner}, lock file {path}): two runs in one "
                "folder overwrite each other's checkpoints and results. Wait for it to end or stop it, or pass "
                "another --output_dir."
            ) from None
        with contextlib.suppress(FileNotFoundError):  # a run that ended removes its file: lock the one at path
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    if not _LOCKS:
        atexit.register(_release_locks)
    _LOCKS[str(path)] = handle


def _release_locks() -> None:
    """At exit (a finished run, an error, Ctrl-C): remove this process's lock files, then unlock.
    A run that opened the file meanwhile sees that it was removed and locks a new one."""
    for path, handle in _LOCKS.items():
        with contextlib.suppress(OSError):
            os.unlink(path)
        handle.close()
    _LOCKS.clear()


@contextlib.contextmanager
def data_errors():
    """Stop the script as for a bad argument (:func:`usage_error`: one ``error:`` line, exit code 2)
    with the message of a data problem instead of a traceback: the loaders' ``ValueError`` /
    ``FileNotFoundError`` name the file, line and value, their ``ConnectionError`` the Hub dataset
    that could not be reached and ``--data_dir`` as the way to local data."""
    try:
        yield
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        usage_error(str(error).strip())


@contextlib.contextmanager
def write_errors():
    """Stop the script with one ``error:`` line (exit code 2) naming the path and the errno when a
    write fails (:class:`hf_zformer.folders.WriteFailed`: the disk full, a read-only folder); what
    was there before is unchanged."""
    try:
        yield
    except folders.WriteFailed as error:
        usage_error(str(error))


def subsample(raw, limits: dict[str, int | None], seed: int) -> None:
    """Keep a seeded random ``limit`` rows of each split in ``limits`` (``--max_*_samples``), in place."""
    for split, limit in limits.items():
        if limit is not None and limit < len(raw[split]):
            raw[split] = raw[split].shuffle(seed=seed).select(range(limit))


def load_tokenizer(args: RunArguments, accelerator, raw, **train_kwargs):
    """``--tokenizer_name`` or the base model's tokenizer; without either, one trained on ``raw``
    by the main process (:func:`hf_zformer.tokenization.train_tokenizer` with ``train_kwargs``)
    and saved in ``--output_dir``, where every process loads it from."""
    from transformers import AutoTokenizer

    from ..tokenization import train_tokenizer

    model, output_dir = args.model, args.training.output_dir
    source = model.tokenizer_name or model.model_name_or_path
    if source:
        return pretrained_tokenizer(model, source)
    if accelerator.is_main_process:
        logging.getLogger(__name__).info(f"training a {model.vocab_size}-token tokenizer on the training texts")
        started = time.perf_counter()
        with folders.recording(output_dir):
            train_tokenizer(raw, vocab_size=model.vocab_size, save_dir=output_dir, show_progress=show_bars(),
                            lowercase=model.lowercase, **train_kwargs)
        logging.getLogger(__name__).info(f"tokenizer trained in {time.perf_counter() - started:.0f} s")
    accelerator.wait_for_everyone()
    return AutoTokenizer.from_pretrained(output_dir)



TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")


def usage_error(message: str):
    """Stop a script as argparse does for a bad argument: ``error: message`` on stderr, exit code 2."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def pretrained_tokenizer(model: ModelArguments, source: str):
    """The tokenizer of ``source`` (``--tokenizer_name`` or ``--model_name_or_path``), refused with
    a clear error when the folder has none (a folder written by ``model.save_pretrained`` alone)
    or when it cannot be the model's (far fewer tokens than the model's vocabulary)."""
    from transformers import AutoConfig, AutoTokenizer

    from ..tokenization import fits_vocabulary

    flag = "--tokenizer_name" if model.tokenizer_name else "--model_name_or_path"
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        usage_error(f"{flag} {source!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): save the "
                    "tokenizer into it (tokenizer.save_pretrained) or pass --tokenizer_name with the tokenizer the "
                    "model was trained with")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as error:
        usage_error(f"{flag} {source!r}: no tokenizer could be loaded ({str(error).splitlines()[0]})")
    if model.model_name_or_path:
        with contextlib.suppress(OSError, ValueError):
            vocab_size = AutoConfig.from_pretrained(model.model_name_or_path,
                                                    trust_remote_code=model.trust_remote_code).vocab_size
            if not fits_vocabulary(tokenizer, vocab_size):
                usage_error(f"{flag} {source!r}: its tokenizer has {len(tokenizer)} tokens for a model vocabulary "
                            f"of {vocab_size}, so it is not the model's; pass --tokenizer_name with the tokenizer "
                            "the model was trained with")
    return tokenizer


NEW_HEADS = ("classifier", "pooler", "lm_head", "score")  # parts a script may start fresh on a pretrained body


def load_pretrained(auto_class, name_or_path: str, **kwargs):
    """``auto_class.from_pretrained(name_or_path, **kwargs)``, refused (exit code 2) when weights of
    the model's body are missing: a folder of another kind (a classifier given to the causal-LM
    script) would otherwise load nothing and silently train from scratch. Task heads
    (:data:`NEW_HEADS`) may start fresh."""
    try:
        model, loading = auto_class.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    except Exception as error:  # noqa: BLE001  (a pickle refused, a truncated file, a missing shard)
        usage_error(f"--model_name_or_path {name_or_path!r}: its weights cannot be loaded ({weights_failure(error)})")
    missing = sorted(key for key in loading["missing_keys"] if not set(key.split(".")) & set(NEW_HEADS))
    if missing:
        found = ", ".join(getattr(model.config, "architectures", None) or ["another kind of model"])
        usage_error(f"--model_name_or_path {name_or_path!r} ({found}) lacks {len(missing)} weights of a "
                    f"{type(model).__name__} (e.g. {', '.join(missing[:3])}): it is not a checkpoint this script can "
                    "continue from; pass a folder of this task, or train a new model with --attention_type")
    require_finite_weights(model, f"--model_name_or_path {name_or_path!r}")
    return model


def require_finite_weights(model, source: str) -> None:
    """Stop (exit code 2) when a loaded model holds a NaN or an infinity: named as the source's
    fault (``source``: the flag and folder), before a first step would call it a divergence."""
    from .checkpoints import non_finite_parameter

    name = non_finite_parameter(model)
    if name is not None:
        usage_error(f"{source}: its parameter {name} holds NaN or infinite values, so the model it loads is "
                    "broken before any training; pass a model whose weights are finite")


def require_pad_token(tokenizer, model: ModelArguments) -> None:
    """Stop (exit code 2) when the tokenizer has no pad token: the batches are padded with it."""
    if tokenizer.pad_token_id is None:
        usage_error(f"the tokenizer of {model.tokenizer_name or model.model_name_or_path} has no pad token, which "
                    "pads the batches: pass a tokenizer that has one (tokenizer.pad_token = ..., then save it)")


def new_model_config(model: ModelArguments, vocab_size: int, seq2seq: bool, **extra):
    """:func:`hf_zformer.training.arguments.build_config` for the tokenizer the run loaded; a value
    of ``--config_overrides`` the tokenizer cannot take stops the run as a bad argument (exit code 2)."""
    from .arguments import build_config

    try:
        return build_config(model, vocab_size=vocab_size, seq2seq=seq2seq, **extra)
    except ValueError as error:
        usage_error(f"invalid model configuration: {error}")


def fit_to_positions(flag: str, asked: int, config, logger) -> int:
    """``asked`` tokens (the value of ``flag``: a length the script cuts texts or blocks to), cut to
    the positions the model holds (``max_position_embeddings`` less ``position_offset``), with a
    warning when that cuts."""
    offset = getattr(config, "position_offset", 0)
    fits = min(asked, config.max_position_embeddings - offset)
    if fits < asked:
        held = f"max_position_embeddings={config.max_position_embeddings}" + (
            f" less position_offset={offset}" if offset else "")
        logger.warning(f"{flag} {asked} > the model's {fits} positions ({held}): cut to {fits} tokens")
    return fits


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


def results_to_write(results: dict[str, Any], path: Path, logger) -> dict[str, Any]:
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
    args: RunArguments,
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
    ``--data_dir`` folder or ``--train_file``, with ``--dataset_config_name``), the model (``--hub_model_id``, else the
    output folder, which its usage snippet loads: ``--output_dir`` as given) and the base model from
    ``args``; ``card_kwargs`` adds the script's task, metric, languages and usage example."""
    from .. import hub

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    try:
        require_finite(model, "the final model")
    except TrainingDiverged as error:
        raise SystemExit(f"error: {error}") from None
    from accelerate.utils import broadcast_object_list

    from .checkpoints import shared_staging_dir

    training = args.training
    staging = shared_staging_dir(accelerator, training.output_dir, "final")
    problem = None
    try:  # written whole into a staging folder, then moved into place: never half a model
        with folders.writing(training.output_dir, staging=staging) if accelerator.is_main_process \
                else contextlib.nullcontext(staging):
            _write_final(args, accelerator, model, unwrapped, tokenizer, results, card_kwargs, staging, logger)
    except (OSError, ValueError) as error:  # the disk full, a read-only folder: the earlier files stay
        problem = str(error)
    problem = broadcast_object_list([problem])[0]
    if problem:
        usage_error(f"the final model was not saved: {problem}")
    if accelerator.is_main_process and training.push_to_hub:
        url = hub.push_to_hub(training.output_dir, training.hub_model_id, token=training.hub_token)
        logger.info(f"pushed to {url}")
    if accelerator.is_main_process:
        logger.info(f"saved the model, tokenizer, results and model card to {training.output_dir}")
    accelerator.wait_for_everyone()


def _write_final(args, accelerator, model, unwrapped, tokenizer, results, card_kwargs, staging, logger) -> None:
    """The writing part of :func:`finish_run`: model, tokenizer, ``all_results.json``, model card,
    into ``staging`` (what becomes ``--output_dir``)."""
    from .. import hub

    output_dir, data = args.training.output_dir, args.data
    unwrapped.save_pretrained(
        staging,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(staging)
        save_training_args(args.flags(), staging)  # an evaluation of the folder records how it was trained
        results = results_to_write(results, Path(output_dir) / "all_results.json", logger)
        with open(staging / "all_results.json", "w") as f:
            json.dump(results, f, indent=2, allow_nan=False)
        hub_model_id = args.training.hub_model_id
        card = hub.model_card(
            config=unwrapped.config,
            results=results,
            command=command_line(args.training.hub_token),
            dataset_name=data.dataset_name or Path(data.data_dir or getattr(args.task, "train_file", None)).name,
            dataset_config=data.dataset_config_name,
            model_name=hub_model_id or Path(output_dir).name,
            model_id=hub_model_id or output_dir,  # the usage snippet loads this as written
            hub_dataset=bool(data.dataset_name),  # a --data_dir folder name is no Hub dataset id
            base_model=args.model.model_name_or_path,
            **card_kwargs,
        )
        (staging / "README.md").write_text(card)
        logger.info(f"results: {json.dumps(results)}")
