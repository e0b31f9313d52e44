"""Scoring a model on a prepared evaluation dataloader (library side, never shipped).

What the scripts' evaluations run, on one process or many (results gathered with
``accelerator.gather_for_metrics``, so every process gets the full split):

* :func:`generate_and_score` -- translation: greedy/beam generation, detokenized sacreBLEU (cased
  and lowercased), predictions and references back in dataset order;
* :func:`predict_labels` / :func:`score_accuracy` -- classification: the argmax class of every
  example, and the accuracy with the per-example hits (for bootstrap intervals);
* :func:`score_perplexity` -- language modelling: mean token loss and perplexity over fixed-length
  blocks, with the loss of every block (for bootstrap intervals); :func:`score_masked_lm` the same
  for a masked LM at its masked positions, with their accuracy.

When to evaluate during training, and the best checkpoint, are :mod:`hf_zformer.training.evaluation`'s job.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .feedback import progress

__all__ = ["generate_and_score", "predict_labels", "score_accuracy", "score_masked_lm", "score_perplexity"]


def generate_and_score(accelerator, model, dataloader, tokenizer, *, num_beams, max_length, metric):
    """Greedy/beam generation over ``dataloader`` on every process, gathered with
    ``gather_for_metrics``; returns (metric scores, the dataset indices, predictions and
    references in dataset order). Batches carry ``input_ids``, ``attention_mask``, ``labels`` and
    ``index``; ``metric`` is a sacreBLEU metric (:func:`hf_zformer.metrics.load`)."""
    unwrapped = accelerator.unwrap_model(model)
    model.eval()
    indices, predictions, references = [], [], []
    for batch in progress(dataloader, desc="generate", main=accelerator.is_local_main_process):
        with torch.no_grad(), accelerator.autocast():
            generated = unwrapped.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                num_beams=num_beams,
                max_length=max_length,
            )
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
        generated, labels, index = accelerator.gather_for_metrics((generated, labels, batch["index"]))
        labels = labels.masked_fill(labels == -100, tokenizer.pad_token_id)
        predictions += tokenizer.batch_decode(generated, skip_special_tokens=True)
        references += tokenizer.batch_decode(labels, skip_special_tokens=True)
        indices += index.tolist()
    model.train()
    # Sorted-by-length batches: put rows back in dataset order (duplicates, if any, collapse).
    rows = dict(zip(indices, zip(predictions, references)))
    ordered = [rows[i] for i in sorted(rows)]
    predictions, references = [p.strip() for p, _ in ordered], [r.strip() for _, r in ordered]
    return {**corpus_bleu(metric, predictions, references), "samples": len(predictions)}, sorted(rows), predictions, references


def corpus_bleu(metric, predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus sacreBLEU of ``predictions`` against one reference each, cased (``bleu``) and
    lowercased (``bleu_lowercase``); ``metric`` from :func:`hf_zformer.metrics.load`."""
    return {
        name: metric.compute(predictions=predictions, references=[[r] for r in references], lowercase=lowercase)["score"]
        for name, lowercase in (("bleu", False), ("bleu_lowercase", True))
    }


def predict_labels(accelerator, model, dataloader, *, desc: str = "evaluate") -> tuple[list, list, list | None]:
    """``(predictions, labels, indices)`` of a sequence classifier over ``dataloader``, gathered
    from every process in batch order; ``indices`` (the batches' ``index`` column) is None when the
    batches have none. The model is left in training mode."""
    model.eval()
    predictions, labels, indices = [], [], []
    for batch in progress(dataloader, desc=desc, main=accelerator.is_local_main_process):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        wanted = (logits.argmax(-1), batch["labels"], *((batch["index"],) if "index" in batch else ()))
        gathered = accelerator.gather_for_metrics(wanted)
        predictions += gathered[0].tolist()
        labels += gathered[1].tolist()
        if len(gathered) > 2:
            indices += gathered[2].tolist()
    model.train()
    return predictions, labels, indices if indices else None


def score_accuracy(accelerator, model, dataloader, *, desc: str = "evaluate") -> tuple[dict[str, Any], list[bool]]:
    """``({"accuracy", "samples"}, hits)``: the accuracy over ``dataloader`` and whether each
    example was classified right (for :func:`hf_zformer.training.results.accuracy_ci`)."""
    predictions, labels, _ = predict_labels(accelerator, model, dataloader, desc=desc)
    hits = [p == y for p, y in zip(predictions, labels)]
    return {"accuracy": sum(hits) / max(len(hits), 1), "samples": len(hits)}, hits


def score_perplexity(accelerator, model, dataloader, *, desc: str = "evaluate") -> tuple[dict[str, Any], list[float]]:
    """``({"loss", "perplexity", "samples", "tokens"}, block_losses)`` of a causal LM over
    ``dataloader``'s equal-length blocks (:func:`hf_zformer.training.batching.block_collate`): every block
    scores the same number of tokens (its length - 1, the first has no context), so the mean token
    loss is the mean of the blocks' mean losses, and ``perplexity = exp(loss)``. The model is left
    in training mode."""
    model.eval()
    losses, scored = [], 0  # scored: tokens scored per block
    for batch in progress(dataloader, desc=desc, main=accelerator.is_local_main_process):
        with torch.no_grad(), accelerator.autocast():
            logits = model(input_ids=batch["input_ids"]).logits
        targets = batch["labels"][:, 1:]
        scored = targets.shape[1]
        token_losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), targets, reduction="none"
        )  # (B, N - 1)
        losses += accelerator.gather_for_metrics(token_losses.mean(dim=1)).tolist()
    model.train()
    loss = sum(losses) / max(len(losses), 1)
    return {"loss": loss, "perplexity": math.exp(loss), "samples": len(losses), "tokens": len(losses) * scored}, losses


def score_masked_lm(accelerator, model, dataloader, *, desc: str = "evaluate") -> tuple[dict[str, Any], list[float]]:
    """``({"loss", "perplexity", "accuracy", "samples", "tokens"}, block_losses)`` of a masked LM
    over ``dataloader``'s blocks (:class:`hf_zformer.training.batching.MaskedLMCollator`, which scores the same
    number of positions in every block): the mean loss at the scored positions, its exp, and the
    share of them whose most likely token is the original one. The model is left in training mode."""
    model.eval()
    losses, correct, scored = [], 0, 0  # scored: positions scored per block
    for batch in progress(dataloader, desc=desc, main=accelerator.is_local_main_process):
        with torch.no_grad(), accelerator.autocast():
            logits = model(**batch).logits  # (B * scored, V): labelled positions only, row-major
        targets = batch["labels"][batch["labels"] != -100]
        scored = targets.numel() // batch["labels"].shape[0]
        token_losses = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
        losses += accelerator.gather_for_metrics(token_losses.view(-1, scored).mean(dim=1)).tolist()
        correct += int(accelerator.gather_for_metrics((logits.argmax(dim=-1) == targets).view(-1, scored).sum(dim=1)).sum())
    model.train()
    loss = sum(losses) / max(len(losses), 1)
    tokens = len(losses) * scored
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": correct / max(tokens, 1), "samples": len(losses),
            "tokens": tokens}, losses
