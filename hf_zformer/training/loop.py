"""The training loop of the scripts in ``scripts/``: :func:`make_optimizer` and :func:`train`
(gradient accumulation, clipping, a log line every ``--logging_steps``, evaluation
(:class:`.evaluation.EvalTracker`), step/epoch checkpoints (:mod:`.checkpoints`), exact resume with
``skip_first_batches``). How a script uses this folder is in the package docstring.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .batching import LengthGroupedBatchSampler
from .checkpoints import TrainingDiverged, latest_checkpoint, load_checkpoint, require_finite, save_checkpoint
from .evaluation import EvalTracker
from .feedback import show_bars, speed_line

if TYPE_CHECKING:
    from .arguments import RunArguments, TrainingArguments

__all__ = ["make_optimizer", "train"]


def make_optimizer(model, training: TrainingArguments) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases, norms and the Zformer scale (as in the examples), in
    PyTorch's fused implementation where the parameters' device has one (CPU and CUDA): one kernel
    per step instead of ~10 per parameter tensor, 25-39 -> 7 ms per step for the d=256 3+3
    translation model on one CPU thread (docs/benchmarks.md, "Training scripts")."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device_types = {param.device.type for group in groups for param in group["params"]}
    fused = bool(device_types) and device_types <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, lr=training.learning_rate, fused=fused or None)


def compile_setting(accelerator) -> str | None:
    """How accelerate compiled the model (`accelerate launch --dynamo_backend inductor [--dynamo_mode
    reduce-overhead]`): "inductor", "inductor/reduce-overhead", ...; None for eager training."""
    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    backend = getattr(getattr(plugin, "backend", None), "value", None)
    if not backend or str(backend).upper() == "NO":
        return None
    mode = getattr(plugin, "mode", None)
    return str(backend).lower() + (f"/{mode}" if mode and mode != "default" else "")


def train(
    args: RunArguments,
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
    greater_is_better: bool = True,
    loss_fn: Callable[[Any, dict], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Run the training loop on prepared ``model``/``optimizer``/``train_dataloader``.

    Builds and prepares the LR scheduler, resumes from ``--resume_from_checkpoint``, evaluates with
    ``evaluate_fn`` (returns ``{"bleu": ...}``-style metrics) after every epoch and every
    ``--eval_steps`` (:class:`hf_zformer.training.evaluation.EvalTracker`: history file, ``--save_best`` on
    ``best_metric``, higher or, with ``greater_is_better=False``, lower is better, saved with ``tokenizer``), checkpoints every ``--checkpointing_steps``.
    The loss of a batch is ``loss_fn(model, batch)`` when given (e.g.
    :class:`hf_zformer.conversion.teacher.TeacherLoss`), else the model's own ``model(**batch).loss``. Returns
    the last evaluation metrics prefixed ``eval_`` (with ``--save_best``: the best evaluation's, the
    last one's as ``last_eval_``, and the final model holds the best weights) plus ``best_step``,
    ``train_loss``, ``train_steps``, ``epoch``, ``train_runtime_s``, ``eval_runtime_s``.
    """
    training = args.training
    plan = _plan_steps(training, len(train_dataloader))
    lr_scheduler = _make_scheduler(training, plan, accelerator, optimizer)
    if training.with_tracking:
        accelerator.init_trackers(Path(training.output_dir).name or "run", _tracker_config(args, plan))
    _log_plan(training, plan, accelerator, len(train_sampler.lengths), logger)
    tracker = EvalTracker(args, accelerator, model, evaluate_fn, metric=best_metric,
                          greater_is_better=greater_is_better, tokenizer=tokenizer,
                          updates_per_epoch=plan.updates_per_epoch, logger=logger)
    loop = _Loop(training, plan, accelerator, model, optimizer, lr_scheduler, tracker, logger, loss_fn,
                 args.identity())
    if training.resume_from_checkpoint:
        loop.resume(training.resume_from_checkpoint, len(train_dataloader))
    loop.start()
    metrics: dict[str, Any] = {}
    try:
        for epoch in range(loop.start_epoch, plan.num_train_epochs):
            if loop.completed_steps >= plan.max_train_steps:
                break
            metrics = loop.run_epoch(epoch, train_dataloader, train_sampler)
        return loop.finish(metrics, plan.updates_per_epoch)
    except TrainingDiverged as error:  # the run stops; what was saved before the divergence stays
        raise SystemExit(f"error: training diverged: {error}") from None


class _Plan(NamedTuple):
    """How long a run trains: ``--max_train_steps`` (from the epochs when not given) and the
    epochs that takes."""

    updates_per_epoch: int
    max_train_steps: int
    num_train_epochs: int


def _plan_steps(training: TrainingArguments, batches_per_epoch: int) -> _Plan:
    """Optimizer steps per epoch; ``--max_train_steps`` from the epochs, or the epochs from it."""
    updates_per_epoch = math.ceil(batches_per_epoch / training.gradient_accumulation_steps)
    max_train_steps = training.max_train_steps
    if max_train_steps is None:
        max_train_steps = training.num_train_epochs * updates_per_epoch
    return _Plan(updates_per_epoch, max_train_steps, math.ceil(max_train_steps / updates_per_epoch))


def _make_scheduler(training: TrainingArguments, plan: _Plan, accelerator, optimizer):
    from transformers import get_scheduler

    # A prepared scheduler steps once per process per optimizer step (the examples' convention).
    lr_scheduler = get_scheduler(
        training.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=training.num_warmup_steps * accelerator.num_processes,
        num_training_steps=plan.max_train_steps * accelerator.num_processes,
    )
    return accelerator.prepare(lr_scheduler)


def _log_plan(training: TrainingArguments, plan: _Plan, accelerator, examples: int, logger) -> None:
    batch, accumulation = training.per_device_train_batch_size, training.gradient_accumulation_steps
    total_batch = batch * accelerator.num_processes * accumulation
    logger.info(
        f"Training: {examples} examples, {plan.num_train_epochs} epochs, {plan.max_train_steps} "
        f"optimizer steps, batch {batch}/device x {accelerator.num_processes} processes x "
        f"{accumulation} accumulation = {total_batch}"
    )


def _tracker_config(args: RunArguments, plan: _Plan) -> dict[str, Any]:
    """The run's flags for the trackers, with the planned steps and epochs; never the Hub token."""
    flags = {**args.flags(), "max_train_steps": plan.max_train_steps, "num_train_epochs": plan.num_train_epochs}
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flags.items() if k != "hub_token"}


class _Loop:
    """One run of :func:`train`: its position (optimizer steps, epoch, batch), its loss statistics
    (carried by checkpoints over resumed segments) and the steps of an epoch: accumulate a batch,
    then after each optimizer update log, evaluate and checkpoint."""

    def __init__(self, training: TrainingArguments, plan: _Plan, accelerator, model, optimizer, lr_scheduler,
                 tracker: EvalTracker, logger, loss_fn=None, run_args: dict[str, Any] | None = None):
        self.training, self.plan, self.accelerator, self.model = training, plan, accelerator, model
        self.run_args = run_args or {}  # stored in every checkpoint: resuming with other arguments is refused
        self.loss_fn = loss_fn or (lambda model, batch: model(**batch).loss)
        self.optimizer, self.lr_scheduler, self.tracker, self.logger = optimizer, lr_scheduler, tracker, logger
        self.completed_steps, self.start_epoch, self.resume_batches = 0, 0, 0
        self.loss_sum, self.loss_count, self.runtime_before = 0.0, 0, 0.0  # whole-run statistics

    def resume(self, path, batches_per_epoch: int) -> None:
        """Restore the checkpoint ``path`` (``"latest"``: the newest in ``--output_dir``)."""
        if path == "latest":
            path = latest_checkpoint(self.training.output_dir)
            if path is None:
                raise FileNotFoundError(f"--resume_from_checkpoint latest: no checkpoint in {self.training.output_dir}")
        state = load_checkpoint(self.accelerator, path)
        self.completed_steps, self.start_epoch = state["completed_steps"], state["epoch"]
        self.resume_batches = state["batches_done"]
        self.loss_sum, self.loss_count = state.get("loss_sum", 0.0), state.get("loss_count", 0)
        self.runtime_before = state.get("train_runtime_s", 0.0)
        self.tracker.restore(state, self.completed_steps, path)
        if self.resume_batches >= batches_per_epoch:
            self.start_epoch, self.resume_batches = self.start_epoch + 1, 0
        self.logger.info(f"Resumed from {path}: step {self.completed_steps}, epoch {self.start_epoch}, "
                         f"batch {self.resume_batches}")

    def start(self) -> None:
        """Progress bar (a terminal only; else a log line every --logging_steps), clock and loss sums."""
        from tqdm.auto import tqdm

        self.bars = show_bars()
        self.progress = tqdm(range(self.plan.max_train_steps), desc="train",
                             disable=not self.accelerator.is_local_main_process or not self.bars)
        self.progress.update(self.completed_steps)
        self.started, self.first_step = time.perf_counter(), self.completed_steps
        device = self.accelerator.device
        self.running_loss, self.running_count = torch.zeros((), device=device), 0
        self.total_loss = torch.tensor(self.loss_sum, device=device)  # this process's sum (mean over processes)

    def run_epoch(self, epoch: int, train_dataloader, train_sampler) -> dict[str, Any]:
        """Train one epoch (the rest of it when resuming), evaluate, checkpoint; the eval_ metrics."""
        self.model.train()
        train_sampler.use_epoch(epoch)
        skip = self.resume_batches if epoch == self.start_epoch else 0
        loader = self.accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for batches_done, batch in enumerate(loader, start=skip + 1):
            if not self.accumulate(batch):
                continue
            self.after_update(epoch, batches_done)
            if self.completed_steps >= self.plan.max_train_steps:
                break
        self.tracker.evaluate(self.completed_steps, epoch)  # no-op when --eval_steps just evaluated this step
        metrics = {f"eval_{k}": v for k, v in self.tracker.last_metrics.items()}
        if self.training.with_tracking:
            self.accelerator.log({"epoch": epoch}, step=self.completed_steps)
        if self.training.checkpointing_steps == "epoch":
            self.checkpoint(f"epoch_{epoch}", epoch=epoch + 1, batches_done=0)
        return metrics

    def accumulate(self, batch) -> bool:
        """Forward and backward one batch (an optimizer step when the accumulation is complete);
        whether an optimizer step was taken."""
        accelerator, max_grad_norm = self.accelerator, self.training.max_grad_norm
        with accelerator.accumulate(self.model):
            loss = self.loss_fn(self.model, batch)
            self.check_loss(loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients and max_grad_norm > 0:
                accelerator.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.optimizer.step()
            self.lr_scheduler.step()
            self.optimizer.zero_grad()
        loss = loss.detach().float()
        self.running_loss += loss
        self.running_count += 1
        self.total_loss += loss
        self.loss_count += 1
        return accelerator.sync_gradients

    def check_loss(self, loss: torch.Tensor) -> None:
        """Stop the run (:class:`TrainingDiverged`, naming the step) when the loss of a batch is NaN
        or infinite on any process, before it reaches the weights. One host sync per batch, as
        transformers' Trainer makes for its NaN filter."""
        finite = torch.isfinite(loss.detach()).float().reshape(1)  # float: gloo gathers no bool tensors
        if self.accelerator.num_processes > 1:
            finite = self.accelerator.gather(finite)
        if not bool(finite.min() > 0):
            raise TrainingDiverged(
                f"the loss is {loss.item()} at optimizer step {self.completed_steps + 1}; nothing from this step on "
                "is saved (checkpoints and the best model saved before it stay). Lower --learning_rate, keep "
                "--max_grad_norm > 0, or check the data and --mixed_precision"
            )

    def after_update(self, epoch: int, batches_done: int) -> None:
        """Count the optimizer step; log, evaluate and checkpoint when due."""
        self.completed_steps += 1
        self.progress.update(1)
        steps = self.completed_steps
        if steps % self.training.logging_steps == 0 or steps == self.plan.max_train_steps:
            self.log_loss()
        if self.tracker.due(steps):
            self.tracker.evaluate(steps)
        every = self.training.checkpointing_steps
        if isinstance(every, int) and steps % every == 0:
            self.checkpoint(f"step_{steps}", epoch=epoch, batches_done=batches_done)

    def log_loss(self) -> None:
        """The mean loss since the last log line (over every process), with the learning rate."""
        steps, max_steps = self.completed_steps, self.plan.max_train_steps
        loss = self.accelerator.gather(self.running_loss).mean().item() / self.running_count
        self.running_loss.zero_()
        self.running_count = 0
        lr = self.lr_scheduler.get_last_lr()[0]
        self.progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        if not self.bars:
            speed = speed_line(steps, max_steps, time.perf_counter() - self.started, "steps", new=steps - self.first_step)
            self.logger.info(f"step {steps}/{max_steps}: loss {loss:.4f}, lr {lr:.3e}, {speed}")
        if self.training.with_tracking:
            self.accelerator.log({"train_loss": loss, "lr": lr}, step=steps)

    def run_state(self, **position: int) -> dict[str, Any]:
        """A checkpoint's training state: the loop position plus the statistics of the run so far."""
        return {**position, "loss_sum": self.accelerator.gather(self.total_loss).mean().item(),
                "loss_count": self.loss_count,
                "train_runtime_s": self.runtime_before + time.perf_counter() - self.started}

    def checkpoint(self, name: str, *, epoch: int, batches_done: int) -> None:
        require_finite(self.model, f"checkpoint {name}")
        state = self.run_state(completed_steps=self.completed_steps, epoch=epoch, batches_done=batches_done)
        save_checkpoint(self.accelerator, self.training.output_dir, name,
                        {**state, **self.tracker.state(), "run_args": self.run_args})

    def finish(self, metrics: dict[str, Any], updates_per_epoch: int) -> dict[str, Any]:
        """Close the loop: final evaluation if none ran, the best weights back (``--save_best``),
        and the run's results."""
        tracker, accelerator = self.tracker, self.accelerator
        self.progress.close()
        final = self.run_state()
        if not metrics:  # resumed from a checkpoint at the very end: still report evaluation
            tracker.evaluate(self.completed_steps, again=True)
            metrics = {f"eval_{k}": v for k, v in tracker.last_metrics.items()}
        if tracker.load_best():
            metrics = {**{f"last_{k}": v for k, v in metrics.items()},
                       **{f"eval_{k}": v for k, v in tracker.best_metrics.items()}}
        if self.training.with_tracking:
            accelerator.end_training()
        return {
            **metrics,
            # mean loss over every batch of the whole run (resumed segments included); None if unknown
            "train_loss": final["loss_sum"] / self.loss_count if self.loss_count else None,
            "train_steps": self.completed_steps,
            # epochs trained, as a fraction (HF Trainer's convention): the same for a resumed run, which
            # an epoch index was not (resuming the final epoch checkpoint reported one more)
            "epoch": round(self.completed_steps / updates_per_epoch, 2),
            "train_runtime_s": round(final["train_runtime_s"], 1),
            "eval_runtime_s": round(tracker.eval_runtime_s, 1),
            **tracker.summary(),
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "compiled": compile_setting(accelerator),
        }
