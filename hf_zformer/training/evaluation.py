"""Validation inside the training loop: when to evaluate, the evaluation history, the best checkpoint.

:class:`EvalTracker` is what :func:`hf_zformer.training.train` calls around its loop:

* :meth:`EvalTracker.due` -- evaluate every ``--eval_steps`` optimizer steps (and after every
  epoch, never twice at the same step);
* :meth:`EvalTracker.evaluate` -- runs the script's ``evaluate_fn``, appends ``{"step", "epoch",
  metrics}`` to ``output_dir/eval_history.jsonl`` and, with ``--save_best``, saves the model and
  tokenizer into ``output_dir/best`` (atomically) when the validation metric improves;
* :meth:`EvalTracker.state` / :meth:`EvalTracker.restore` -- the best value and step travel in the
  checkpoint's training state; on resume the history is cut back to the checkpoint's step, so the
  evaluations that the resumed run repeats are not written twice;
* :meth:`EvalTracker.load_best` -- at the end, put the best weights back into the model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import folders
from .checkpoints import require_finite, shared_staging_dir

__all__ = ["BEST_DIR", "HISTORY_FILE", "EvalTracker", "add_evaluation_args", "read_history"]

HISTORY_FILE = "eval_history.jsonl"
BEST_DIR = "best"
BEST_STATE_FILE = "best_state.json"


def add_evaluation_args(group) -> None:
    """``--eval_steps``, ``--save_best``, ``--split_seed`` and ``--results_file`` (argument group or parser)."""
    group.add_argument(
        "--eval_steps", type=int, default=None,
        help="Also evaluate on the validation split every N optimizer steps (default: after each epoch only). "
        f"Every evaluation is appended to output_dir/{HISTORY_FILE}.",
    )
    group.add_argument(
        "--save_best", action="store_true",
        help=f"Keep the model with the best validation metric (bleu for translation, accuracy for classification: "
        f"higher is better; perplexity for language modelling: lower is better) in output_dir/{BEST_DIR}; at the end "
        "the final model in output_dir is that best one and the test split is scored on it.",
    )
    group.add_argument(
        "--split_seed", type=int, default=42,
        help="Seed of the validation split carved from train (and of --max_eval_samples), independent of --seed, "
        "so runs with different --seed are scored on the same validation rows.",
    )
    group.add_argument(
        "--results_file", default=None,
        help="Append this run's result records to this JSON list file (e.g. docs/results.json; fields in docs/results.md).",
    )


def read_history(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``output_dir/eval_history.jsonl`` (empty when there is none)."""
    path = Path(output_dir) / HISTORY_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class EvalTracker:
    """Evaluation schedule, history and best checkpoint of one training run (see the module doc).

    ``args``: the run's :class:`~.arguments.RunArguments` (output folder, tracking,
    ``--eval_steps``, ``--save_best``). ``metric`` names the key of ``evaluate_fn()``'s result that ``--save_best`` optimises: maximises
    (``"bleu"``, ``"accuracy"``) or, with ``greater_is_better=False``, minimises (``"perplexity"``);
    ``tokenizer`` is saved next to the best model."""

    def __init__(self, args, accelerator, model, evaluate_fn: Callable[[], dict[str, float]], *,
                 metric: str | None, greater_is_better: bool = True, tokenizer=None, updates_per_epoch: int = 1,
                 logger=None):
        self.accelerator = accelerator
        self.model = model
        self.evaluate_fn = evaluate_fn
        self.metric = metric
        self.greater_is_better = greater_is_better
        self.tokenizer = tokenizer
        self.updates_per_epoch = max(updates_per_epoch, 1)
        self.logger = logger
        self.output_dir = Path(args.training.output_dir)
        self.with_tracking = args.training.with_tracking
        self.eval_steps = args.evaluation.eval_steps
        self.save_best = args.evaluation.save_best
        if self.save_best and not metric:
            raise ValueError("--save_best needs the name of the validation metric to optimise")
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.best_metrics: dict[str, Any] = {}
        self.last_step: int | None = None
        self.last_metrics: dict[str, Any] = {}
        self.eval_runtime_s = 0.0

    # ---- resume
    def state(self) -> dict[str, Any]:
        """What goes into the checkpoint's training state (nothing before the first evaluation)."""
        if self.best_step is None:
            return {}
        return {"best_metric": self.best_value, "best_step": self.best_step, "best_metrics": self.best_metrics}

    def restore(self, state: dict[str, Any], completed_steps: int, checkpoint: str | os.PathLike | None = None) -> None:
        """Take the best value/step back from a checkpoint's training state, and drop the history
        records written after the checkpoint (the resumed run evaluates those steps again). A run
        resumed into another output folder copies the checkpoint's run's history and best model."""
        self.best_value = state.get("best_metric")
        self.best_step = state.get("best_step")
        self.best_metrics = state.get("best_metrics") or {}
        source = Path(checkpoint).resolve().parent if checkpoint is not None else self.output_dir.resolve()
        if source != self.output_dir.resolve() and self.accelerator.is_main_process:
            if (source / HISTORY_FILE).is_file() and not (self.output_dir / HISTORY_FILE).exists():
                shutil.copyfile(source / HISTORY_FILE, self.output_dir / HISTORY_FILE)
            copy_best = self.save_best and self._saved_best_step(source) == self.best_step
            if copy_best and not (self.output_dir / BEST_DIR).exists():
                shutil.copytree(source / BEST_DIR, self.output_dir / BEST_DIR)
            folders.record(self.output_dir, HISTORY_FILE, BEST_DIR)
        self.accelerator.wait_for_everyone()
        kept = [r for r in read_history(self.output_dir) if r["step"] <= completed_steps]
        if kept:
            self.last_step = kept[-1]["step"]
        if self.accelerator.is_main_process and (self.output_dir / HISTORY_FILE).is_file():
            tmp = self.output_dir / f"{folders.STAGING_PREFIX}{HISTORY_FILE}"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.output_dir / HISTORY_FILE)
        self.accelerator.wait_for_everyone()

    # ---- schedule
    def due(self, completed_steps: int) -> bool:
        """Whether ``--eval_steps`` asks for an evaluation after this optimizer step."""
        return bool(self.eval_steps) and completed_steps % self.eval_steps == 0 and completed_steps != self.last_step

    def evaluate(self, completed_steps: int, epoch: int | None = None, *, again: bool = False) -> dict[str, Any] | None:
        """Evaluate (unless this step was already evaluated: returns None), record, keep the best.
        ``epoch`` is given for the end-of-epoch evaluation; the record's ``epoch`` is fractional
        (optimizer steps / steps per epoch) either way. ``again``: evaluate even an evaluated step
        (a run resumed at its very end), without recording it twice."""
        repeated = completed_steps == self.last_step
        if repeated and not again:
            return None
        started = time.perf_counter()
        metrics = dict(self.evaluate_fn())
        self.last_step = completed_steps
        record = {"step": completed_steps, "epoch": round(completed_steps / self.updates_per_epoch, 4),
                  **({"end_of_epoch": epoch} if epoch is not None else {}), **metrics}
        if self.accelerator.is_main_process and not repeated:
            with open(self.output_dir / HISTORY_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
            folders.record(self.output_dir, HISTORY_FILE)
        prefixed = {f"eval_{k}": v for k, v in metrics.items()}
        if self.logger is not None:
            where = f"epoch {epoch} (step {completed_steps})" if epoch is not None else f"step {completed_steps} evaluation"
            self.logger.info(f"{where}: {prefixed}")
        if self.metric and self.metric in metrics and not repeated and math.isfinite(metrics[self.metric]):
            value = metrics[self.metric]  # a NaN metric (a diverged model) is never the best
            if self.best_value is None or (value > self.best_value if self.greater_is_better else value < self.best_value):
                self.best_value, self.best_step, self.best_metrics = value, completed_steps, metrics
                if self.save_best:
                    self._save_best()
        self.last_metrics = metrics
        self.eval_runtime_s += time.perf_counter() - started
        if self.with_tracking:
            self.accelerator.log(prefixed, step=completed_steps)
        return metrics

    # ---- best checkpoint
    def _save_best(self) -> None:
        accelerator = self.accelerator
        final = self.output_dir / BEST_DIR
        require_finite(self.model, "the best model")
        tmp = shared_staging_dir(accelerator, self.output_dir, BEST_DIR)
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(self.model).save_pretrained(
            tmp,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(self.model),
        )
        if accelerator.is_main_process:
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            state = {"best_metric": self.best_value, "best_step": self.best_step, "metric": self.metric,
                     "greater_is_better": self.greater_is_better, "metrics": self.best_metrics}
            (tmp / BEST_STATE_FILE).write_text(json.dumps(state, indent=2))
            folders.replace_atomically(tmp, final)
            folders.record(self.output_dir, BEST_DIR)
        accelerator.wait_for_everyone()
        if self.logger is not None:
            self.logger.info(f"new best {self.metric} {self.best_value:.4f} at step {self.best_step}: saved {final}")

    @staticmethod
    def _saved_best_step(run_dir: Path) -> int | None:
        state = run_dir / BEST_DIR / BEST_STATE_FILE
        return json.loads(state.read_text()).get("best_step") if state.is_file() else None

    def load_best(self) -> bool:
        """Load the weights of ``output_dir/best`` into the (prepared) model; False without one, or
        when it is not the model of the tracked best step (warning; the final weights stay)."""
        path = self.output_dir / BEST_DIR
        if not self.save_best or self.best_step is None:
            return False
        saved_step = self._saved_best_step(self.output_dir)
        if saved_step != self.best_step:
            if self.logger is not None:
                self.logger.warning(f"{path} holds step {saved_step}, the best evaluation was step {self.best_step}: "
                                    "the final model stays the last one")
            return False
        unwrapped = self.accelerator.unwrap_model(self.model)
        best = type(unwrapped).from_pretrained(path, dtype=next(unwrapped.parameters()).dtype)
        unwrapped.load_state_dict(best.state_dict())
        del best
        if self.logger is not None:
            self.logger.info(f"final model: the best one, step {self.best_step} ({self.metric} {self.best_value})")
        return True

    def summary(self) -> dict[str, Any]:
        """``best_step`` and ``best_eval_<metric>`` for ``all_results.json`` (empty before any evaluation)."""
        if self.best_step is None:
            return {}
        return {"best_step": self.best_step, f"best_eval_{self.metric}": self.best_value}
