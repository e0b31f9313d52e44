"""Command-line arguments of the training scripts (library side, never shipped).

* argument groups and their validation (:func:`add_data_args`, :func:`add_model_args`,
  :func:`add_training_args`, :func:`validate_args`) so that bad arguments fail before any training;
* :func:`parse_config_overrides` / :func:`build_config`: ``"k=v,..."`` typed by the config field.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ..folders import check_output_dir
from ..modeling.configuration_zformer import ATTENTION_TYPES, CAUSAL_ATTENTION_TYPES, ZformerConfig
from .checkpoints import RESUMABLE_ARGS, TRAINING_STATE_FILE, check_checkpoint, latest_checkpoint, run_identity
from .evaluation import add_evaluation_args

__all__ = [
    "SCHEDULER_TYPES",
    "add_data_args",
    "add_model_args",
    "add_training_args",
    "build_config",
    "check_finite_floats",
    "earlier_run_files",
    "parse_config_overrides",
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
    group.add_argument("--lowercase", action="store_true",
                       help="Train an uncased tokenizer (text lowercased after NFKC); only with a tokenizer trained here.")
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
    group.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="Start a new run in an --output_dir that holds an earlier run: its checkpoints, best model and "
        "evaluation history are deleted first. Without it such a folder is refused (resume it instead).",
    )
    group.add_argument("--with_tracking", action="store_true", help="Log metrics through accelerate's trackers.")
    group.add_argument(
        "--report_to", default="tensorboard", help='Trackers for --with_tracking: "tensorboard", "wandb", ..., or "all".'
    )
    group.add_argument("--logging_steps", type=int, default=50, help="Log the training loss every N optimizer steps.")
    group.add_argument("--verbose", action="store_true",
                       help="Log accelerate's environment at the start and the process rank in every line (both "
                       "are on by default only when more than one process runs).")
    group.add_argument(
        "--cpu_allocator",
        default="retain",
        choices=("retain", "system"),
        help='"retain" (default): the C allocator keeps freed memory for the next step instead of returning it '
        "to the system, so a step does not pay page faults to touch its activations again (faster CPU training; "
        'Linux/glibc only, and not when MALLOC_TRIM_THRESHOLD_ or MALLOC_MMAP_THRESHOLD_ is set). "system": '
        "leave the allocator as it is.",
    )
    group.add_argument("--push_to_hub", action="store_true", help="Upload the output folder to the Hub at the end.")
    group.add_argument("--hub_model_id", default=None, help="Repository of --push_to_hub, e.g. me/imdb-zformer.")
    group.add_argument("--hub_token", default=None, help="Token of --push_to_hub (default: the cached login).")
    add_evaluation_args(parser.add_argument_group("evaluation"))


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace, seq2seq: bool) -> argparse.Namespace:
    """Check the arguments shared by the scripts; ``parser.error`` (exit code 2) with a clear
    message on the first problem. Also builds the model config of a new model once, so invalid
    model settings (``ValueError`` of the config class) surface here, before any data is read."""
    _check_data_source(parser, args)
    _check_ranges(parser, args)
    check_finite_floats(parser, args)
    _check_outputs(parser, args)
    _check_inputs(parser, args)
    _check_new_model(parser, args, seq2seq)
    args.run_args = run_identity(args)
    _check_run_folder(parser, args)
    return args


def _check_data_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One data source, and the folder or files it names exist."""
    sources = [f"--{name}" for name in ("dataset_name", "data_dir", "train_file") if getattr(args, name, None)]
    if len(sources) > 1:
        parser.error(f"{' and '.join(sources)} are exclusive: give one dataset source")
    if not sources:
        files = " or --train_file (local file)" if hasattr(args, "train_file") else ""
        parser.error(f"no data: pass --dataset_name (Hub) or --data_dir (local folder){files}")
    if args.data_dir and not Path(args.data_dir).expanduser().is_dir():
        parser.error(f"--data_dir {args.data_dir!r} is not a directory")
    for name in ("train_file", "validation_file"):
        if getattr(args, name, None) and not Path(getattr(args, name)).expanduser().is_file():
            parser.error(f"--{name} {getattr(args, name)!r} is not a file")


def _check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Counts, seeds, rates and --checkpointing_steps (an int from here on, or "epoch")."""
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
    for name in ("seed", "split_seed"):  # numpy's generators take 0 .. 2**32 - 1
        if not 0 <= getattr(args, name) < 2**32:
            parser.error(f"--{name} must be in 0..{2**32 - 1}, got {getattr(args, name)}")
    if not (args.tokenizer_name or args.model_name_or_path):  # a tokenizer is trained on the data
        from ..tokenization import SPECIAL_TOKENS

        if args.vocab_size <= len(SPECIAL_TOKENS):
            parser.error(f"--vocab_size must be > {len(SPECIAL_TOKENS)} (the special tokens) for the tokenizer trained "
                         f"on the data, got {args.vocab_size}")
    if args.num_warmup_steps < 0:
        parser.error(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}")
    if args.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {args.learning_rate}")
    for name in ("weight_decay", "max_grad_norm"):  # a negative decay grows the weights; a negative norm means nothing
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.checkpointing_steps is not None:
        if args.checkpointing_steps != "epoch":
            if not args.checkpointing_steps.isdigit() or int(args.checkpointing_steps) < 1:
                parser.error(f'--checkpointing_steps must be a positive integer or "epoch", got {args.checkpointing_steps!r}')
            args.checkpointing_steps = int(args.checkpointing_steps)


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--output_dir, --results_file and --resume_from_checkpoint, before any work."""
    try:  # new, empty or the library's; never an input of the run (folders.check_output_dir)
        args.output_dir = str(check_output_dir(
            args.output_dir, overwrite=args.overwrite_output_dir, name="--output_dir", whole=False,
            resume=bool(args.resume_from_checkpoint), inputs=run_inputs(args)))
    except ValueError as error:
        parser.error(str(error))
    if getattr(args, "results_file", None):  # found at the end of a long run otherwise
        from .results import check_results_file

        try:
            check_results_file(args.results_file)
        except ValueError as error:
            parser.error(f"--results_file: {error}")
    if args.resume_from_checkpoint and args.resume_from_checkpoint != "latest":
        if not (Path(args.resume_from_checkpoint) / TRAINING_STATE_FILE).is_file():
            parser.error(
                f"--resume_from_checkpoint {args.resume_from_checkpoint!r} is not a checkpoint folder "
                f"(no {TRAINING_STATE_FILE}); checkpoints are the step_N/epoch_N folders of --output_dir"
            )


def _check_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Tracking, the Hub repository, the tokenizer's source and the saved configs the run reads."""
    if args.with_tracking:
        problem = _tracker_problem(args.report_to)
        if problem:
            parser.error(problem)
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id (the repository to create, e.g. your-name/imdb-zformer)")
    brought = args.tokenizer_name or args.model_name_or_path
    if getattr(args, "lowercase", False) and brought:
        flag = "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path"
        parser.error(f"--lowercase trains an uncased tokenizer, but {flag} {brought!r} brings its own tokenizer: drop one")
    for flag, folder in run_inputs(args).items():  # a saved config that fails validation: named, before any work
        if flag != "--tokenizer_name" and Path(folder).expanduser().is_dir():
            _check_saved_config(parser, flag, folder, args.trust_remote_code)


def _check_new_model(parser: argparse.ArgumentParser, args: argparse.Namespace, seq2seq: bool) -> None:
    """A pretrained model, or the flags of a new one: its config is built once here, so an invalid
    setting is named before any data is read."""
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


def run_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The model folders a run reads (``{"--flag": value}``), which its ``--output_dir`` must not be
    or hold (the data needs no entry: a data folder is never empty, and has no marker)."""
    names = ("model_name_or_path", "teacher_model_name_or_path", "tokenizer_name")
    return {f"--{name}": getattr(args, name) for name in names if getattr(args, name, None)}


def _check_saved_config(parser: argparse.ArgumentParser, flag: str, folder: str, trust_remote_code: bool) -> None:
    """``parser.error`` naming ``flag`` and the field when the ``config.json`` of the model folder
    ``folder`` does not load (an invalid or non-finite value, an option of an earlier version)."""
    from transformers import AutoConfig

    if not (Path(folder).expanduser() / "config.json").is_file():
        return  # named later, where the folder is loaded (no model there)
    try:
        AutoConfig.from_pretrained(Path(folder).expanduser(), trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as error:
        if "trust_remote_code" not in str(error):
            parser.error(f"{flag} {folder!r}: its config.json does not load: {str(error).splitlines()[0]}")


def check_finite_floats(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` when any float argument of ``parser`` is NaN or infinite (``--learning_rate
    inf`` would pass a ``> 0`` check and train to NaN)."""
    for action in parser._actions:
        if action.type is not float:
            continue
        value = getattr(args, action.dest, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                parser.error(f"{action.option_strings[0]} must be a finite number, got {item}")


def earlier_run_files(output_dir: str | Path) -> list[Path]:
    """What a run leaves in ``output_dir`` that a new run must not mix with its own: checkpoints
    (folders with a training state), the best model and the evaluation history."""
    from .evaluation import BEST_DIR, HISTORY_FILE

    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in sorted(folder.iterdir()) if (p / TRAINING_STATE_FILE).is_file() and not p.name.startswith(".")]
    return found + [folder / name for name in (BEST_DIR, HISTORY_FILE) if (folder / name).exists()]


def _check_run_folder(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any work: a resumed checkpoint must belong to a run with these arguments, and a new
    run must not start in a folder that holds an earlier run (unless --overwrite_output_dir)."""
    if args.resume_from_checkpoint:
        path = Path(args.resume_from_checkpoint)
        if args.resume_from_checkpoint == "latest":
            path = latest_checkpoint(args.output_dir)
            if path is None:
                parser.error(f"--resume_from_checkpoint latest: --output_dir {args.output_dir!r} holds no checkpoint "
                             "yet (they are written every --checkpointing_steps); start the run without it")
        try:  # a damaged checkpoint (its state, a missing or truncated file) is named before any work
            saved = check_checkpoint(path).get("run_args")
        except ValueError as error:
            parser.error(f"--resume_from_checkpoint {str(path)!r} cannot be resumed: {error}")
        if saved is None:  # written before checkpoints carried their run's arguments
            return
        keys = sorted((set(saved) | set(args.run_args)) - RESUMABLE_ARGS)
        differ = [f"--{k} {saved.get(k)!r} there, {args.run_args.get(k)!r} now" for k in keys
                  if saved.get(k) != args.run_args.get(k)]
        if differ:
            parser.error(f"--resume_from_checkpoint {str(path)!r} belongs to a run with other arguments: "
                         f"{'; '.join(differ)}. Resume with that run's arguments, or start a new run in another "
                         "--output_dir")
        return
    earlier = earlier_run_files(args.output_dir)
    if earlier and not args.overwrite_output_dir:
        names = ", ".join(p.name for p in earlier[:4]) + (", ..." if len(earlier) > 4 else "")
        parser.error(f"--output_dir {args.output_dir!r} holds an earlier run ({names}): resume it with "
                     "--resume_from_checkpoint latest, pass --overwrite_output_dir to delete it and start anew, "
                     "or choose another folder")


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


def _config_fields(config_class=ZformerConfig) -> dict[str, Any]:
    """``{field: default}`` of every dataclass field of ``config_class``."""
    import dataclasses

    fields = {}
    for field in dataclasses.fields(config_class):
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
    if text.lower() in ("none", "null") and not isinstance(default, str):
        return None  # a string field keeps the word: hidden_act=none is the string "none"
    if "|" in text:  # per-layer list, e.g. attention_type=fastformer|full, attention_window=64|0
        return [_convert(key, part, default) for part in text.split("|")]
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


def parse_config_overrides(overrides: str | None, config_class=ZformerConfig) -> dict[str, Any]:
    """Parse ``"k=v,k2=v2"`` into typed config kwargs of ``config_class`` (default :class:`ZformerConfig`;
    :class:`ZformerLlamaConfig` for Llama-family decoders).

    Each value is converted to the type of the config field's default (int, float,
    bool as true/false, str); ``none`` for optional fields (a string field keeps the word:
    ``hidden_act=none`` is the string); ``a|b|c`` for per-layer lists (e.g.
    ``attention_type=fastformer|full``). Unknown keys raise ``ValueError`` listing the valid ones.
    """
    if not overrides:
        return {}
    fields = _config_fields(config_class)
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

