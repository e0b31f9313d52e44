"""Command-line arguments of the training scripts (library side, never shipped).

* one dataclass per concern -- :class:`ModelArguments`, :class:`DataArguments`,
  :class:`TrainingArguments`, :class:`EvaluationArguments` -- and :class:`RunArguments`, which holds
  them with the script's own arguments (its ``task`` dataclass) and gives the flat flag form back
  (:meth:`RunArguments.flags`: what checkpoints and ``training_args.json`` store);
  :class:`ModelEvaluationArguments` is ``scripts/evaluate_model.py``'s own;
* argument groups (:func:`add_data_args`, :func:`add_model_args`, :func:`add_training_args`) and
  :func:`parse_run_args`, which builds a :class:`RunArguments` from the command line and validates it
  once (:func:`validate_args`), so that bad arguments fail before any training;
* :func:`parse_config_overrides` / :func:`build_config`: ``"k=v,..."`` typed by the config field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.splits import DEFAULT_GROUP_COLUMN
from ..folders import check_output_dir
from ..modeling.configuration_zformer import ATTENTION_TYPES, CAUSAL_ATTENTION_TYPES, ZformerConfig
from .checkpoints import RESUMABLE_ARGS, TRAINING_STATE_FILE, check_checkpoint, latest_checkpoint, run_identity
from .evaluation import add_evaluation_args

__all__ = [
    "SCHEDULER_TYPES",
    "DataArguments",
    "EvaluationArguments",
    "ModelArguments",
    "ModelEvaluationArguments",
    "RunArguments",
    "TrainingArguments",
    "add_data_args",
    "add_model_args",
    "add_training_args",
    "build_config",
    "check_finite_floats",
    "earlier_run_files",
    "parse_config_overrides",
    "parse_run_args",
    "resume_conflicts",
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


@dataclass
class ModelArguments:
    """The model a run trains: a pretrained one, or a new one from its attention and config flags."""

    model_name_or_path: str | None = None
    attention_type: str | None = None
    decoder_attention_type: str | None = None  # seq2seq scripts only, where it defaults to "full"
    config_overrides: str | None = None
    tokenizer_name: str | None = None
    vocab_size: int = 8000
    lowercase: bool = False
    trust_remote_code: bool = False
    #: the parsed ``--config_overrides`` of a new model (filled in by :func:`validate_args`)
    config_kwargs: dict[str, Any] = field(default_factory=dict, init=False, repr=False)


@dataclass
class DataArguments:
    """Where the data comes from and how much of it is used."""

    dataset_name: str | None = None
    dataset_config_name: str | None = None
    data_dir: str | None = None
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    preprocessing_num_workers: int | None = None


@dataclass
class TrainingArguments:
    """The loop: output folder, batches, optimizer and schedule, checkpoints, logging, the Hub."""

    output_dir: str
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 64
    learning_rate: float = 5e-4
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    num_train_epochs: int = 3
    max_train_steps: int | None = None
    gradient_accumulation_steps: int = 1
    lr_scheduler_type: str = "linear"
    num_warmup_steps: int = 0
    seed: int = 42
    checkpointing_steps: int | str | None = None  # optimizer steps, or "epoch"
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False
    with_tracking: bool = False
    report_to: str = "tensorboard"
    logging_steps: int = 50
    verbose: bool = False
    cpu_allocator: str = "retain"
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None


@dataclass
class EvaluationArguments:
    """Validation during training, the split it is carved with and the result records."""

    eval_steps: int | None = None
    save_best: bool = False
    split_seed: int = 42
    results_file: str | None = None


@dataclass
class ModelEvaluationArguments:
    """``scripts/evaluate_model.py``'s own arguments (its ``task`` in a :class:`RunArguments`): the
    split scored, the columns and lengths of each task and the length buckets; the model, data,
    output folder, batches and seeds are the training scripts' concerns."""

    split: str | None = None
    source_lang: str = "de"
    target_lang: str = "en"
    text_column: str = "text"
    label_column: str = "label"
    max_source_length: int = 128
    max_target_length: int | None = None
    num_beams: int | None = None
    max_length: int | None = None
    truncation_side: str | None = None
    group_column: str = DEFAULT_GROUP_COLUMN
    length_buckets: list[int] | None = None


_CONCERNS = {"model": ModelArguments, "data": DataArguments, "training": TrainingArguments,
             "evaluation": EvaluationArguments}


def _flag_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


@dataclass
class RunArguments:
    """Everything a training script was asked to do: the shared concerns and the script's own
    ``task`` arguments (a dataclass of the script, or None)."""

    model: ModelArguments
    data: DataArguments
    training: TrainingArguments
    evaluation: EvaluationArguments
    task: Any = None

    @classmethod
    def from_flags(cls, flags: dict[str, Any], task: type | None = None) -> RunArguments:
        """Split the flat ``{flag name: value}`` of a parsed command line into the concerns; the
        flags no concern names go to ``task`` (a dataclass, whose ``__post_init__`` validates them:
        ``ValueError``)."""
        parts = {name: concern(**{k: flags[k] for k in _flag_names(concern) if k in flags})
                 for name, concern in _CONCERNS.items()}
        shared = {k for concern in _CONCERNS.values() for k in _flag_names(concern)}
        own = {k: v for k, v in flags.items() if k not in shared}
        if own and task is None:
            raise TypeError(f"flags without a concern and no task class: {sorted(own)}")
        return cls(**parts, task=task(**own) if task is not None else None)

    def flags(self) -> dict[str, Any]:
        """The run's arguments flat, by flag name, as the command line gave them (after validation):
        the form checkpoints (``run_args``) and ``training_args.json`` store."""
        flat: dict[str, Any] = {}
        for part in (self.data, self.task, self.model, self.training, self.evaluation):
            if part is not None:
                flat.update({name: getattr(part, name) for name in _flag_names(type(part))})
        if flat.get("decoder_attention_type") is None:  # no such flag outside the seq2seq scripts
            flat.pop("decoder_attention_type", None)
        return flat

    def identity(self) -> dict[str, Any]:
        """The arguments that define the run (``checkpoints.run_identity``), stored in every checkpoint."""
        return run_identity(self.flags())


def parse_run_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, seq2seq: bool,
                   task: type | None = None,
                   check: Callable[[RunArguments], None] | None = None) -> RunArguments:
    """Parse ``argv`` with ``parser`` (built with :func:`add_data_args`, :func:`add_model_args`,
    :func:`add_training_args` and the script's own flags, those of the ``task`` dataclass) into a
    :class:`RunArguments`, validated once: the task's own checks and ``check`` (the script's checks
    across concerns) raise ``ValueError``, which becomes ``parser.error`` (exit code 2), then
    :func:`validate_args`."""
    namespace = parser.parse_args(argv)
    check_finite_floats(parser, namespace)
    try:
        args = RunArguments.from_flags(vars(namespace), task)
        if check is not None:
            check(args)
    except ValueError as error:
        parser.error(str(error))
    return validate_args(parser, args, seq2seq)


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


def validate_args(parser: argparse.ArgumentParser, args: RunArguments, seq2seq: bool) -> RunArguments:
    """Check the arguments shared by the scripts; ``parser.error`` (exit code 2) with a clear
    message on the first problem. Also builds the model config of a new model once, so invalid
    model settings (``ValueError`` of the config class) surface here, before any data is read.
    What it settles stays in ``args``: ``--checkpointing_steps`` as an int (or "epoch"),
    ``--output_dir`` as checked, the parsed ``--config_overrides`` (``args.model.config_kwargs``)."""
    _check_data_source(parser, args)
    _check_ranges(parser, args)
    _check_outputs(parser, args)
    _check_inputs(parser, args)
    _check_new_model(parser, args, seq2seq)
    _check_run_folder(parser, args)
    return args


def _check_data_source(parser: argparse.ArgumentParser, args: RunArguments) -> None:
    """One data source, and the folder or files it names exist (``--train_file`` and
    ``--validation_file``: the language-modelling scripts' documents, in their ``task``)."""
    data, files = args.data, {name: getattr(args.task, name, None) for name in ("train_file", "validation_file")}
    given = {"dataset_name": data.dataset_name, "data_dir": data.data_dir, "train_file": files["train_file"]}
    sources = [f"--{name}" for name, value in given.items() if value]
    if len(sources) > 1:
        parser.error(f"{' and '.join(sources)} are exclusive: give one dataset source")
    if not sources:
        named = " or --train_file (local file)" if hasattr(args.task, "train_file") else ""
        parser.error(f"no data: pass --dataset_name (Hub) or --data_dir (local folder){named}")
    if data.data_dir and not Path(data.data_dir).expanduser().is_dir():
        parser.error(f"--data_dir {data.data_dir!r} is not a directory")
    for name, value in files.items():
        if value and not Path(value).expanduser().is_file():
            parser.error(f"--{name} {value!r} is not a file")
    if files["validation_file"] and files["train_file"] and (
            Path(files["validation_file"]).expanduser().resolve() == Path(files["train_file"]).expanduser().resolve()):
        parser.error(f"--validation_file {files['validation_file']!r} is --train_file: the validation would score the "
                     "training texts; drop it (--validation_split_percentage carves a validation split from the "
                     "training file) or pass other texts")


def _at_least(parser: argparse.ArgumentParser, least: int, **values: int | None) -> None:
    """``parser.error`` for the first of ``values`` (by flag name) that is set and below ``least``."""
    for name, value in values.items():
        if value is not None and value < least:
            parser.error(f"--{name} must be >= {least}, got {value}")


def _check_ranges(parser: argparse.ArgumentParser, args: RunArguments) -> None:
    """Counts, seeds, rates and --checkpointing_steps (an int from here on, or "epoch")."""
    model, data, training, evaluation = args.model, args.data, args.training, args.evaluation
    _at_least(parser, 1, per_device_train_batch_size=training.per_device_train_batch_size,
              per_device_eval_batch_size=training.per_device_eval_batch_size,
              gradient_accumulation_steps=training.gradient_accumulation_steps,
              num_train_epochs=training.num_train_epochs, vocab_size=model.vocab_size,
              logging_steps=training.logging_steps, max_train_steps=training.max_train_steps,
              max_train_samples=data.max_train_samples, max_eval_samples=data.max_eval_samples,
              eval_steps=evaluation.eval_steps)
    for name, value in (("seed", training.seed), ("split_seed", evaluation.split_seed)):  # numpy: 0 .. 2**32 - 1
        if not 0 <= value < 2**32:
            parser.error(f"--{name} must be in 0..{2**32 - 1}, got {value}")
    if not (model.tokenizer_name or model.model_name_or_path):  # a tokenizer is trained on the data
        from ..tokenization import SPECIAL_TOKENS

        if model.vocab_size <= len(SPECIAL_TOKENS):
            parser.error(f"--vocab_size must be > {len(SPECIAL_TOKENS)} (the special tokens) for the tokenizer trained "
                         f"on the data, got {model.vocab_size}")
    if training.num_warmup_steps < 0:
        parser.error(f"--num_warmup_steps must be >= 0, got {training.num_warmup_steps}")
    if training.learning_rate <= 0:
        parser.error(f"--learning_rate must be > 0, got {training.learning_rate}")
    for name in ("weight_decay", "max_grad_norm"):  # a negative decay grows the weights; a negative norm means nothing
        if getattr(training, name) < 0:
            parser.error(f"--{name} must be >= 0, got {getattr(training, name)}")
    steps = training.checkpointing_steps
    if steps is not None and steps != "epoch" and not isinstance(steps, int):
        if not steps.isdigit() or int(steps) < 1:
            parser.error(f'--checkpointing_steps must be a positive integer or "epoch", got {steps!r}')
        training.checkpointing_steps = int(steps)


def _check_outputs(parser: argparse.ArgumentParser, args: RunArguments) -> None:
    """--output_dir, --results_file and --resume_from_checkpoint, before any work."""
    from .. import folders

    training = args.training
    try:  # new, empty or the library's; never an input of the run, data included (folders.check_output_dir)
        output_dir = check_output_dir(
            training.output_dir, overwrite=training.overwrite_output_dir, name="--output_dir", whole=False,
            resume=bool(training.resume_from_checkpoint),
            inputs={**run_inputs(args.flags()), **data_inputs(args.flags())})
        adopting = []
        if training.resume_from_checkpoint and output_dir.is_dir() and folders.read_marker(output_dir) is None:
            adopting = [path.name for path in earlier_run_files(output_dir)]  # a run of a version without markers
            folders.check_adoptable(output_dir, adopting)
        lock = output_dir / ".lock"  # a run of this library holds it: say so, not "somebody else's file"
        if folders.lock_holder(lock) is not None:
            raise ValueError(f"--output_dir {output_dir} is in use by another run (pid {folders.lock_holder(lock)}, lock "
                             f"file {lock}): two runs in one folder overwrite each other's checkpoints and results; "
                             "wait for it to end or stop it, or pass another --output_dir")
        # nothing of the user's under a name the run writes, no link, and a folder that takes a write
        folders.check_writes(output_dir, folders.RUN_FILES, listed=adopting)
        training.output_dir = str(output_dir)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.evaluation.results_file:  # found at the end of a long run otherwise
        from .results import check_results_file

        try:
            check_results_file(args.evaluation.results_file, training.output_dir)
        except ValueError as error:
            parser.error(f"--results_file: {error}")
    resume = training.resume_from_checkpoint
    if resume and resume != "latest" and not (Path(resume) / TRAINING_STATE_FILE).is_file():
        parser.error(
            f"--resume_from_checkpoint {resume!r} is not a checkpoint folder "
            f"(no {TRAINING_STATE_FILE}); checkpoints are the step_N/epoch_N folders of --output_dir"
        )


def _check_inputs(parser: argparse.ArgumentParser, args: RunArguments) -> None:
    """Tracking, the Hub repository, the tokenizer's source and the saved configs the run reads."""
    model, training = args.model, args.training
    if training.with_tracking:
        problem = _tracker_problem(training.report_to)
        if problem:
            parser.error(problem)
    if training.push_to_hub and not training.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id (the repository to create, e.g. your-name/imdb-zformer)")
    brought = model.tokenizer_name or model.model_name_or_path
    if model.lowercase and brought:
        flag = "--tokenizer_name" if model.tokenizer_name else "--model_name_or_path"
        parser.error(f"--lowercase trains an uncased tokenizer, but {flag} {brought!r} brings its own tokenizer: drop one")
    for flag, folder in run_inputs(args.flags()).items():  # a saved config that fails validation: named, before any work
        if flag != "--tokenizer_name" and Path(folder).expanduser().is_dir():
            _check_saved_config(parser, flag, folder, model.trust_remote_code)


def _check_new_model(parser: argparse.ArgumentParser, args: RunArguments, seq2seq: bool) -> None:
    """A pretrained model, or the flags of a new one: its config is built once here, so an invalid
    setting is named before any data is read."""
    model = args.model
    if model.model_name_or_path:
        if model.attention_type or model.config_overrides or (seq2seq and model.decoder_attention_type != "full"):
            parser.error(
                "--model_name_or_path fine-tunes an existing model; --attention_type, --decoder_attention_type and "
                "--config_overrides only describe a new model: drop one side"
            )
    else:
        if not model.attention_type:
            parser.error(f"pass --model_name_or_path, or --attention_type (one of {list(ATTENTION_TYPES)}) for a new model")
        from ..tokenization import PAD_ID

        trained = not model.tokenizer_name  # the tokenizer trained on the data: its size and pad id are known
        try:
            model.config_kwargs = parse_config_overrides(model.config_overrides)
            config = build_config(model, vocab_size=max(model.vocab_size, 8) if trained else 8, seq2seq=seq2seq,
                                  **({"pad_token_id": PAD_ID} if trained else {}))
        except ValueError as error:
            parser.error(f"invalid model configuration: {error}")
        problem = _script_config_problem(config, seq2seq)
        if problem:
            parser.error(f"invalid model configuration: {problem}")


def _script_config_problem(config, seq2seq: bool) -> str | None:
    """What makes a valid config wrong for the training scripts (the library accepts it), or None."""
    if not config.return_dict:
        return ("return_dict=False: the scripts read the model's outputs by name (loss, logits); drop it from "
                "--config_overrides")
    if config.is_encoder_decoder and not seq2seq:
        return ("is_encoder_decoder=True: this script's model is no encoder-decoder, and evaluation would take it "
                "for a translation model; drop it from --config_overrides")
    return None


def data_inputs(flags: dict[str, Any]) -> dict[str, Any]:
    """The local data a run reads (``{"--flag": path}``, from its flat ``flags``): its
    ``--output_dir`` must not be or hold them (``--overwrite_output_dir`` would delete a data file
    that an earlier run wrote there, before reading it)."""
    names = ("data_dir", "train_file", "validation_file", "unlabeled_file")
    return {f"--{name}": flags[name] for name in names if flags.get(name)}


def run_inputs(flags: dict[str, Any]) -> dict[str, Any]:
    """The model folders a run reads (``{"--flag": value}``, from its flat ``flags``), which its
    ``--output_dir`` must not be or hold (the data needs no entry: a data folder is never empty,
    and has no marker)."""
    names = ("model_name_or_path", "teacher_model_name_or_path", "tokenizer_name")
    return {f"--{name}": flags[name] for name in names if flags.get(name)}


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
    """``parser.error`` when any float argument of ``parser`` is NaN or infinite in the parsed
    ``args`` (``--learning_rate inf`` would pass a ``> 0`` check and train to NaN)."""
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


def resume_conflicts(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The arguments on which a checkpoint's stored ``run_args`` (flat, by flag name, of any
    version) and this run's identity (:meth:`RunArguments.identity`) differ, one line each; a flag
    one side lacks counts as ``None`` there."""
    keys = sorted((set(saved) | set(now)) - RESUMABLE_ARGS)
    return [f"--{k} {saved.get(k)!r} there, {now.get(k)!r} now" for k in keys if saved.get(k) != now.get(k)]


def _check_run_folder(parser: argparse.ArgumentParser, args: RunArguments) -> None:
    """Before any work: a resumed checkpoint must belong to a run with these arguments, and a new
    run must not start in a folder that holds an earlier run (unless --overwrite_output_dir)."""
    training = args.training
    if training.resume_from_checkpoint:
        path = Path(training.resume_from_checkpoint)
        if training.resume_from_checkpoint == "latest":
            path = latest_checkpoint(training.output_dir)
            if path is None:
                parser.error(f"--resume_from_checkpoint latest: --output_dir {training.output_dir!r} holds no "
                             "checkpoint yet (they are written every --checkpointing_steps); start the run without it")
        try:  # a damaged checkpoint (its state, a missing or truncated file) is named before any work
            saved = check_checkpoint(path, processes=int(os.environ.get("WORLD_SIZE", "1"))).get("run_args")
        except ValueError as error:
            parser.error(f"--resume_from_checkpoint {str(path)!r} cannot be resumed: {error}")
        if saved is None:  # written before checkpoints carried their run's arguments
            return
        differ = resume_conflicts(saved, args.identity())
        if differ:
            parser.error(f"--resume_from_checkpoint {str(path)!r} belongs to a run with other arguments: "
                         f"{'; '.join(differ)}. Resume with that run's arguments, or start a new run in another "
                         "--output_dir")
        return
    earlier = earlier_run_files(training.output_dir)
    if earlier and not training.overwrite_output_dir:
        names = ", ".join(p.name for p in earlier[:4]) + (", ..." if len(earlier) > 4 else "")
        parser.error(f"--output_dir {training.output_dir!r} holds an earlier run ({names}): resume it with "
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
    fields = {}
    for entry in dataclasses.fields(config_class):
        if entry.name.startswith("_") or not entry.init:
            continue
        if entry.default is not dataclasses.MISSING:
            fields[entry.name] = entry.default
        elif entry.default_factory is not dataclasses.MISSING:
            fields[entry.name] = entry.default_factory()
        else:
            fields[entry.name] = None
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


MAPPING_FIELDS = frozenset({"id2label", "label2id"})  # config fields no "k=v" can write
#: Config fields the library sets itself, which an override would not set (saving writes its own
#: value) or would set against what the run records: why each is refused in --config_overrides.
LIBRARY_FIELDS = {
    "architectures": "save_pretrained writes the model's class there",
    "transformers_version": "save_pretrained writes the installed version there",
    "dtype": ("the weights would be made, trained and saved in that type while the run records its "
              "--mixed_precision; pass accelerate's --mixed_precision instead"),
}


def parse_config_overrides(overrides: str | None, config_class=ZformerConfig) -> dict[str, Any]:
    """Parse ``"k=v,k2=v2"`` into typed config kwargs of ``config_class`` (default :class:`ZformerConfig`;
    :class:`ZformerLlamaConfig` for Llama-family decoders).

    Each value is converted to the type of the config field's default (int, float,
    bool as true/false, str); ``none`` for optional fields (a string field keeps the word:
    ``hidden_act=none`` is the string); ``a|b|c`` for per-layer lists (e.g.
    ``attention_type=fastformer|full``). Unknown keys raise ``ValueError`` listing the valid ones, as do
    the fields the library sets itself (:data:`LIBRARY_FIELDS`) and mappings.
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
        if key in LIBRARY_FIELDS:
            raise ValueError(f"config field {key!r} is set by the library, not by --config_overrides: "
                             f"{LIBRARY_FIELDS[key]}; drop it")
        if key in MAPPING_FIELDS:
            raise ValueError(f"config field {key!r} is a mapping, which --config_overrides cannot write; the classes "
                             "and their names come from the data (run_classification.py: --num_labels, --label_names)")
        result[key] = _convert(key, value, fields[key])
    return result


def build_config(model: ModelArguments, vocab_size: int, seq2seq: bool, **extra: Any) -> ZformerConfig:
    """The config of a new model: ``--attention_type`` (+ ``--decoder_attention_type``), the parsed
    ``--config_overrides`` (which win), the tokenizer's vocabulary size and ``extra`` task fields
    (the tokenizer's ``pad_token_id`` among them). ``ValueError`` for an override the tokenizer or
    the task cannot take: a ``vocab_size`` below the tokenizer's, a ``pad_token_id`` other than
    its, an encoder-decoder (``seq2seq``) without decoder layers or declared not to be one."""
    kwargs: dict[str, Any] = {"attention_type": model.attention_type, "vocab_size": vocab_size, **extra}
    if seq2seq:
        kwargs["decoder_attention_type"] = model.decoder_attention_type
    overrides = model.config_kwargs or parse_config_overrides(model.config_overrides)
    if isinstance(overrides.get("vocab_size"), int) and overrides["vocab_size"] < vocab_size:
        raise ValueError(f"vocab_size={overrides['vocab_size']} is below the tokenizer's {vocab_size} tokens: their "
                         "ids would index past the embeddings; drop it (the tokenizer's size is the default), or train "
                         "a smaller tokenizer with --vocab_size")
    if "pad_token_id" in overrides and "pad_token_id" in extra and overrides["pad_token_id"] != extra["pad_token_id"]:
        raise ValueError(f"pad_token_id={overrides['pad_token_id']}, but the tokenizer pads with id "
                         f"{extra['pad_token_id']}, which the batches are padded with; drop it (the tokenizer's id is "
                         "the default)")
    if seq2seq and overrides.get("is_encoder_decoder") is False:
        raise ValueError("is_encoder_decoder=False: a translation model is an encoder-decoder, and would be saved as "
                         "one whatever the override says; drop it")
    kwargs.update(overrides)
    config = ZformerConfig(**kwargs)
    if seq2seq and config.num_decoder_layers < 1:
        raise ValueError(f"num_decoder_layers={config.num_decoder_layers}: a translation model needs at least one "
                         "decoder layer, whose cross-attention reads the source")
    return config
