"""Result records of training runs, appended to a shared JSON list file (``--results_file``).

One record per run and evaluation (split x metric x decoding), with what is needed to compare runs
and reproduce them: task, attention types, split, metric, value, beams, epochs, seed, code commit,
base model, 95% bootstrap interval, ... (the fields are documented in ``docs/results.md``).

* :func:`append_records` -- read-modify-write of the list under an exclusive lock, written to a
  temporary file and renamed into place, so concurrent runs never lose each other's records and a
  crash never leaves a truncated file;
* :func:`bootstrap_ci`, :func:`accuracy_ci`, :func:`bleu_ci`, :func:`perplexity_ci` -- seeded
  percentile bootstrap over examples (BLEU: over sentences, re-computing corpus BLEU from
  per-sentence n-gram statistics; perplexity: over equal-length blocks);
* :func:`run_fields` -- the fields every record of a run shares; :func:`save_training_args` stores
  the arguments in the run's folder, from which :func:`evaluation_fields` gives a later evaluation
  of that folder the same recipe fields (precision, teacher, distillation, base model).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_RESAMPLES",
    "accuracy_ci",
    "append_records",
    "TRAINING_ARGS_FILE",
    "base_model_of",
    "distillation_of",
    "bleu_ci",
    "bootstrap_ci",
    "config_summary",
    "evaluation_fields",
    "git_commit",
    "machine",
    "perplexity_ci",
    "read_records",
    "run_fields",
    "save_training_args",
    "task_name",
    "teacher_of",
    "training_run_of",
]

#: The file in a training run's output folder that holds the arguments that defined the run.
TRAINING_ARGS_FILE = "training_args.json"

#: Bootstrap resamples of :func:`accuracy_ci` / :func:`bleu_ci` (1,000 BLEU resamples of 1,000
#: sentences take well under a second: the n-gram statistics are extracted once).
DEFAULT_RESAMPLES = 1000


# --------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a results file (``[]`` when it does not exist or is empty).

    Raises ``ValueError`` when the file is not a JSON list of objects (it is never overwritten then)."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    if not text.strip():
        return []
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"results file {path} is not valid JSON ({err}); fix or move it, it was left unchanged") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(
            f"results file {path} must hold a JSON list of objects (records), found a {type(records).__name__}; "
            "it was left unchanged"
        )
    return records


def check_results_file(path: str | os.PathLike, output_dir: str | os.PathLike | None = None) -> None:
    """Before a run: ``ValueError`` naming ``path`` unless :func:`append_records` can extend it at
    the end (a new file whose folder can be made, or a JSON list of objects) and it is no file the
    run writes itself: a name the library owns (:data:`hf_zformer.folders.OWNED`) inside ``output_dir``,
    or a file in a folder of such a name (a checkpoint, ``best/``), which the run replaces."""
    from ..folders import owned

    path = Path(path).expanduser()
    if output_dir is not None:
        top = Path(output_dir).expanduser().resolve()
        where = path.parent.resolve() / path.name
        if top in where.parents and owned(where.relative_to(top).parts[0]):  # that file, or in a folder it replaces
            raise ValueError(f"results file {path} is {where.relative_to(top)} of --output_dir {str(output_dir)!r}, "
                             "a file the run writes itself; pass a path outside --output_dir or of another name")
    for part in path.parents:
        if part.exists() and not part.is_dir():
            raise ValueError(f"results file {path}: {part} is a file, not a folder")
    for link in (path, _lock_path(path)):  # the file is replaced by a new one, the lock opened: never a link
        if link.is_symlink():
            raise ValueError(f"results file {path}: {link} is a symbolic link (to {os.readlink(link)!r}); the "
                             "library never writes through a link nor replaces one: pass the file itself")
    if path.is_dir():
        raise ValueError(f"results file {path} is a directory; pass the path of a .json file")
    try:
        read_records(path)
    except UnicodeDecodeError:
        raise ValueError(f"results file {path} is not UTF-8 text (not a JSON list of records); it was left "
                         "unchanged") from None


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive advisory lock on ``path.lock`` (POSIX ``flock``; no lock where unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: best effort
        yield
        return
    # opened as it is (a file of that name is never truncated), never through a link
    with os.fdopen(os.open(_lock_path(path), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def append_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append ``records`` to the JSON list in ``path`` (created with its folder if missing); returns
    the whole list. Holds a lock during read-modify-write and writes atomically (temporary file in
    the same folder, fsync, rename), so earlier records are never lost; a failed write (the disk
    full, a read-only folder) leaves the file as it was and raises
    :class:`hf_zformer.folders.WriteFailed` naming the path and the errno."""
    from ..folders import WriteFailed

    path = Path(path)
    try:
        return _append(path, [dict(r) for r in records])
    except WriteFailed:
        raise
    except OSError as error:
        raise WriteFailed(error, path) from None


def _append(path: Path, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    check_results_file(path)  # no link was put in place since the run started
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        merged = read_records(path) + new
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=2, ensure_ascii=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return merged


# --------------------------------------------------------------------------------------------
# confidence intervals
# --------------------------------------------------------------------------------------------


def bootstrap_ci(
    n: int,
    statistic: Callable[[np.ndarray], float],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> list[float] | None:
    """Percentile bootstrap interval ``[low, high]`` of ``statistic(indices)`` over ``n`` examples:
    ``resamples`` draws of ``n`` indices with replacement from a ``numpy`` generator seeded with
    ``seed``. None when ``n == 0``."""
    if n == 0 or resamples < 1:
        return None
    rng = np.random.default_rng(seed)
    values = np.array([statistic(rng.integers(0, n, n)) for _ in range(resamples)])
    alpha = (1.0 - confidence) / 2
    return [float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))]


def accuracy_ci(correct: Sequence[bool], **kwargs: Any) -> list[float] | None:
    """Bootstrap interval of the accuracy in % (see :func:`bootstrap_ci` for ``kwargs``)."""
    hits = np.asarray(correct, dtype=np.float64)
    interval = bootstrap_ci(len(hits), lambda idx: 100.0 * hits[idx].mean(), **kwargs)
    # accuracies are multiples of 100/n: rounding drops float noise (85.39899999999999), nothing else
    return None if interval is None else [round(bound, 4) for bound in interval]


def perplexity_ci(block_losses: Sequence[float], **kwargs: Any) -> list[float] | None:
    """Bootstrap interval of the perplexity exp(mean loss), resampling equal-length blocks (their
    mean token losses ``block_losses``; see :func:`bootstrap_ci` for ``kwargs``)."""
    losses = np.asarray(block_losses, dtype=np.float64)
    return bootstrap_ci(len(losses), lambda idx: float(np.exp(losses[idx].mean())), **kwargs)


def bleu_ci(predictions: Sequence[str], references: Sequence[str], *, lowercase: bool = False, **kwargs: Any):
    """Bootstrap interval of corpus BLEU (sacreBLEU defaults: 13a tokenization, exp smoothing),
    resampling sentences: per-sentence n-gram statistics are extracted once and summed per resample."""
    from sacrebleu.metrics import BLEU

    # per sentence: [hypothesis length, reference length, 4 matched n-gram counts, 4 n-gram totals]
    sentence = BLEU(lowercase=lowercase, effective_order=True)  # the order only changes sentence scores
    scores = (sentence.sentence_score(hypothesis, [reference]) for hypothesis, reference in zip(predictions, references))
    stats = np.asarray([[s.sys_len, s.ref_len, *s.counts, *s.totals] for s in scores], dtype=np.int64)

    def corpus_bleu(idx: np.ndarray) -> float:
        total = stats[idx].sum(axis=0).tolist()
        return BLEU.compute_bleu(correct=total[2:6], total=total[6:10], sys_len=total[0], ref_len=total[1],
                                 smooth_method="exp").score

    return bootstrap_ci(len(stats), corpus_bleu, **kwargs)


# --------------------------------------------------------------------------------------------
# run description
# --------------------------------------------------------------------------------------------


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding ``path`` (default: this package), or None."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU as ``lscpu`` names it, with its family and model numbers and the core count, e.g.
    ``"AMD EPYC (family 25 model 17), 2 cores"`` (the model name alone does not tell CPU generations
    apart on virtual machines), read from ``cpuinfo``; elsewhere :func:`platform.processor`. Plus
    ``" + <GPU name>"`` when CUDA is in use."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            if not line.strip():
                if fields:
                    break  # the first processor's block is enough
                continue
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    cpu = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if fields.get("cpu family") and fields.get("model"):
        cpu += f" (family {fields['cpu family']} model {fields['model']})"
    cores = os.cpu_count()
    if cores:
        cpu += f", {cores} core{'s' if cores > 1 else ''}"
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            return f"{cpu} + {torch.cuda.get_device_name(0)}"
    return cpu


def _flags(args) -> dict[str, Any]:
    """A run's arguments flat, by flag name: ``args`` is that mapping already (``RunArguments.flags()``,
    a stored ``training_args.json``) or a namespace of them."""
    return args if isinstance(args, Mapping) else vars(args)


def task_name(args) -> str:
    """``--data_dir``'s folder name, ``--train_file``'s folder and name (``imdb-unsup`` for
    ``imdb/unsup.jsonl.gz``) or ``--dataset_name``'s last part (``multi30k``, ``imdb``); ``args``
    as :func:`_flags` takes them."""
    flags = _flags(args)
    if flags.get("data_dir"):
        return Path(flags["data_dir"]).expanduser().resolve().name
    if flags.get("train_file"):
        path = Path(flags["train_file"]).expanduser().resolve()
        return f"{path.parent.name}-{path.name.split('.')[0]}"
    return str(flags.get("dataset_name")).rstrip("/").split("/")[-1]


def _card_metadata(name_or_path: str | None) -> dict:
    """The YAML metadata of a local folder's model card (README.md); {} for a Hub id or no card."""
    card = Path(name_or_path).expanduser() / "README.md" if name_or_path else None
    if card is None or not card.is_file():
        return {}
    from huggingface_hub import metadata_load

    return metadata_load(card) or {}


def base_model_of(name_or_path: str | None) -> str | None:
    """The pretrained checkpoint a run started from: for a local folder whose model card names a
    ``base_model`` (a folder written by :func:`hf_zformer.convert_pretrained`), that name; otherwise
    ``name_or_path`` itself (a Hub id, or ``None`` for a model trained from scratch)."""
    if not name_or_path:
        return None
    base = _card_metadata(name_or_path).get("base_model")
    if isinstance(base, list):  # the card format allows several
        base = base[0] if len(base) == 1 else None
    if isinstance(base, str) and base:
        return base
    return str(name_or_path)


def distillation_of(name_or_path: str | None) -> dict | None:
    """The attention distillation a converted folder went through (its card's ``distillation``
    metadata: source, steps, model_steps, batch_size, max_length, learning_rate), else ``None``."""
    distillation = _card_metadata(name_or_path).get("distillation")
    return distillation if isinstance(distillation, dict) else None


def _layer_types(value) -> str | None:
    if value is None:
        return None
    return "|".join(value) if isinstance(value, (list, tuple)) else str(value)


# Config entries that describe the checkpoint's bookkeeping or follow the tokenizer, not the model
# recipe: never recorded.
_NOT_RECIPE = frozenset({
    "_name_or_path", "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "id2label",
    "label2id", "return_dict", "output_attentions", "output_hidden_states", "problem_type", "model_type",
    "is_encoder_decoder", "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
})
_SIZES = ("hidden_size", "num_hidden_layers", "num_decoder_layers", "num_attention_heads", "intermediate_size",
          "vocab_size", "attention_type", "decoder_attention_type", "cross_attention_type")
_DECODER_ONLY = ("num_decoder_layers", "decoder_attention_type", "cross_attention_type")


def config_summary(config) -> dict[str, Any]:
    """The model's sizes and attention types, then every other config entry whose value differs
    from the config class's default (``encoder_conv_size``, ``zformer_feature_map``, dropout, ...):
    the whole model recipe, without the checkpoint's bookkeeping (architectures, labels, versions).
    Decoder entries only for an encoder-decoder model."""
    values = config.to_dict()
    try:
        defaults = type(config)().to_dict()
    except Exception:  # a config class that needs arguments: record the sizes only
        defaults = values
    summary = {k: values[k] for k in _SIZES if k in values}
    summary.update({k: v for k, v in values.items()
                    if k not in summary and k not in _NOT_RECIPE and k in defaults and defaults[k] != v})
    if not getattr(config, "is_encoder_decoder", False):
        for key in _DECODER_ONLY:
            summary.pop(key, None)
    return summary


def _model_fields(args, config) -> dict[str, Any]:
    """The fields every record shares, whether a training run or an evaluation wrote it: the task,
    what the model is (attention, config, the folder it came from, its base model and distillation)
    and where it was measured (commit, date, machine)."""
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    flags = _flags(args)
    return {
        "task": task_name(flags),
        "attention": _layer_types(getattr(config, "attention_type", None)),
        "decoder_attention": _layer_types(getattr(config, "decoder_attention_type", None)) if seq2seq else None,
        "split_seed": flags.get("split_seed"),
        "commit": git_commit(),
        "base_model": base_model_of(flags["model_name_or_path"]),
        "distillation": distillation_of(flags["model_name_or_path"]),  # of a converted folder (its model card)
        "model_name_or_path": flags["model_name_or_path"],  # the folder or id the run loaded
        "config": config_summary(config),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def teacher_of(args, unlabeled_examples: int | None = None) -> dict[str, Any] | None:
    """The ``teacher`` field of a run's records: the teacher model, ``alpha``, ``temperature`` and
    the unlabeled texts added (``unlabeled_examples``, their count; default ``--max_unlabeled_samples``,
    else 0 without ``--unlabeled_file``). ``args``: the run's arguments, a namespace or the mapping
    :func:`save_training_args` stored. None for a run without ``--teacher_model_name_or_path``."""
    get = _flags(args).get
    if not get("teacher_model_name_or_path"):
        return None
    if unlabeled_examples is None:
        unlabeled_examples = get("max_unlabeled_samples") if get("unlabeled_file") else 0
    return {"model": get("teacher_model_name_or_path"), "alpha": get("distill_alpha"),
            "temperature": get("distill_temperature"), "unlabeled_examples": unlabeled_examples,
            "unlabeled_file": get("unlabeled_file")}


def save_training_args(args, output_dir: str | os.PathLike | None = None) -> Path:
    """Store the arguments that define a training run (``args`` as :func:`_flags` takes them;
    ``checkpoints.run_identity``: all but where it is written, logged and pushed; never a token) as
    :data:`TRAINING_ARGS_FILE` in its output folder (``output_dir``, default ``--output_dir``), so
    that an evaluation of the folder can record how the model was trained."""
    from .checkpoints import run_identity

    flags = _flags(args)
    path = Path(output_dir if output_dir is not None else flags["output_dir"]) / TRAINING_ARGS_FILE
    stored = run_identity(flags)
    path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return path


def training_run_of(name_or_path: str | None) -> tuple[Path | None, dict[str, Any], dict[str, Any]]:
    """The training run a saved folder comes from: ``(run folder, stored arguments, all_results)``.
    The folder itself when it holds :data:`TRAINING_ARGS_FILE` or ``all_results.json``, else for a
    ``best/`` model its parent run folder; ``(None, {}, {})`` for a Hub id or a folder no run wrote
    (a converted checkpoint)."""
    from .evaluation import BEST_DIR

    if not name_or_path:
        return None, {}, {}
    folder = Path(name_or_path).expanduser()
    candidates = [folder] + ([folder.parent] if folder.name == BEST_DIR else [])
    for candidate in candidates:
        stored = {}
        for name in (TRAINING_ARGS_FILE, "all_results.json"):
            with contextlib.suppress(OSError, ValueError):
                loaded = json.loads((candidate / name).read_text())
                stored[name] = loaded if isinstance(loaded, dict) else {}
        if stored:
            return candidate, stored.get(TRAINING_ARGS_FILE, {}), stored.get("all_results.json", {})
    return None, {}, {}


def evaluation_fields(args, config) -> dict[str, Any]:
    """The fields of a record written by ``scripts/evaluate_model.py`` for a saved model: those of
    :func:`_model_fields` and, from the training run that wrote the folder (:func:`training_run_of`),
    the recipe a training record of that run carries: base model and distillation of the folder it
    started from, teacher, mixed precision, seed, learning rate, epochs, steps and best step. A
    folder no run wrote (a converted checkpoint, a Hub id) names its own base model and distillation."""
    folder, trained_args, trained = training_run_of(_flags(args)["model_name_or_path"])
    fields = _model_fields(args, config)
    if trained_args:  # the folder the run started from (None: from scratch) names them
        origin = trained_args.get("model_name_or_path")
        fields.update(base_model=base_model_of(origin), distillation=distillation_of(origin))
    return {**fields, "epochs": trained.get("epoch"), "train_steps": trained.get("train_steps"),
            "best_step": trained.get("best_step"), "seed": trained_args.get("seed"),
            "learning_rate": trained_args.get("learning_rate"), "mixed_precision": trained.get("mixed_precision"),
            "teacher": teacher_of(trained_args, trained.get("unlabeled_examples")) if trained_args else None,
            "output_dir": str(folder) if folder is not None else None, "scored_by": "evaluate_model.py"}


def run_fields(args, config, results: dict[str, Any], *, max_length: int | None, wall_time_s: float,
               tokens_per_epoch: int | None = None, train_examples: int | None = None) -> dict[str, Any]:
    """The fields every record of one training run shares (``config``: the model's config;
    ``results``: :func:`hf_zformer.training.train`'s). ``train_examples``: the size of the training
    set after ``--max_train_samples`` (texts, sentence pairs or blocks), so that runs of one recipe on
    more or less data can be told apart and plotted. ``tokens_per_s`` is estimated as
    ``tokens_per_epoch`` (non-padding training tokens, source + target for translation) times the
    epochs trained, over the loop's time minus its evaluations."""
    flags = _flags(args)
    tokens_per_s = None
    train_time = (results.get("train_runtime_s") or 0.0) - (results.get("eval_runtime_s") or 0.0)
    if tokens_per_epoch and results.get("epoch") and train_time > 0:
        tokens_per_s = tokens_per_epoch * results["epoch"] / train_time
    return {
        **_model_fields(args, config),
        "epochs": results.get("epoch"),  # fractional: optimizer steps / steps per epoch
        "train_steps": results.get("train_steps"),
        "train_examples": train_examples,
        "seed": flags["seed"],
        "learning_rate": flags.get("learning_rate"),  # runs of one comparison may differ only in it
        "max_length": max_length,
        **({"truncation_side": flags["truncation_side"]} if flags.get("truncation_side") else {}),
        "best_step": results.get("best_step"),
        "wall_time_s": round(wall_time_s, 1),
        "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1),
        "mixed_precision": results.get("mixed_precision"),  # "no", "bf16" or "fp16": runs differ in it
        **({"compiled": results["compiled"]} if results.get("compiled") else {}),  # torch.compile's backend/mode
        "output_dir": str(flags["output_dir"]),
    }
