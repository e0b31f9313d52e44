"""Batching of the training scripts (library side, never shipped): :class:`LengthGroupedBatchSampler`
(length-bucketed, seeded per epoch, resumable), :func:`pad_collate` (dynamic padding per batch) and
:func:`make_dataloader`, which puts the two together; for language modelling, :func:`group_into_blocks`
(documents concatenated and cut into fixed-length blocks), :func:`block_collate` (causal LM) and
:class:`MaskedLMCollator` (masked LM)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "LengthGroupedBatchSampler", "MaskedLMCollator", "block_collate", "group_into_blocks", "make_dataloader", "make_eval_dataloaders",
    "pad_collate",
]


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


def make_eval_dataloaders(datasets: dict, splits, batch_size: int, collate_fn, *, seed: int) -> dict:
    """``{split: DataLoader}`` for evaluation: batches of similar ``input_ids`` length, in a fixed order."""
    return {
        split: make_dataloader(datasets[split], [len(ids) for ids in datasets[split]["input_ids"]], batch_size,
                               collate_fn, shuffle=False, seed=seed)[0]
        for split in splits
    }


def group_into_blocks(documents: Iterable[Sequence[int]], block_size: int, eos_token_id: int) -> np.ndarray:
    """Language-modelling examples, as in transformers' ``run_clm``: the token ids of all
    ``documents`` concatenated, each followed by ``eos_token_id`` (so a block that spans two
    documents sees where one ends), cut into blocks of ``block_size`` tokens, shape
    ``(blocks, block_size)``; the remainder that does not fill a last block is dropped."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    eos = np.array([eos_token_id], dtype=np.int64)
    parts = [part for ids in documents for part in (np.asarray(ids, dtype=np.int64), eos)]
    stream = np.concatenate(parts) if parts else eos[:0]
    blocks = len(stream) // block_size
    return stream[: blocks * block_size].reshape(blocks, block_size)


def block_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Stack equal-length ``input_ids`` blocks; ``labels`` are the same ids (the causal LM shifts
    them inside). No attention mask: a block has no padding."""
    input_ids = torch.tensor(np.array([f["input_ids"] for f in features]), dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


class MaskedLMCollator:
    """Masked-language-model batches of equal-length blocks (:func:`group_into_blocks`), BERT's
    recipe with a fixed count: in every block exactly ``round(probability * block_size)`` positions
    (at least one) are scored; of those, each becomes ``mask_token_id`` with probability 0.8, a
    random ordinary token (ids ``first_ordinary_id`` .. ``vocab_size - 1``) with 0.1, and stays
    itself with 0.1. ``labels`` holds the original ids at the scored positions, -100 elsewhere.
    Every block scoring the same number of tokens makes the mean token loss the mean of the blocks'
    mean losses (so :func:`hf_zformer.training.results.perplexity_ci` applies as for causal blocks).

    The masks are a pure function of ``(seed, epoch, block)`` (each feature carries its ``block``
    index): a resumed run, a second process and a re-evaluation mask every block as before, and
    the global RNG is never drawn. ``sampler`` (whose ``epoch`` the training loop sets) gives new
    masks each epoch; without it (evaluation) the masks never change."""

    def __init__(self, mask_token_id: int, vocab_size: int, *, probability: float = 0.15, seed: int = 0,
                 sampler: LengthGroupedBatchSampler | None = None, first_ordinary_id: int = 0):
        if not 0.0 < probability < 1.0:
            raise ValueError(f"the masking probability must be in (0, 1), got {probability}")
        if mask_token_id is None:
            raise ValueError("the tokenizer has no mask token: masked-language modelling needs one")
        if not 0 <= first_ordinary_id < vocab_size:
            raise ValueError(f"first_ordinary_id {first_ordinary_id} must be in 0..{vocab_size - 1}")
        self.mask_token_id, self.vocab_size, self.first_ordinary_id = mask_token_id, vocab_size, first_ordinary_id
        self.probability, self.seed, self.sampler = probability, seed, sampler

    def scored_per_block(self, block_size: int) -> int:
        return max(1, round(self.probability * block_size))

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        epoch = self.sampler.epoch if self.sampler is not None else 0
        input_ids = np.array([f["input_ids"] for f in features], dtype=np.int64)
        labels = np.full_like(input_ids, -100)
        count = self.scored_per_block(input_ids.shape[1])
        for row, feature in enumerate(features):
            rng = np.random.default_rng([self.seed, epoch, int(feature["block"])])
            positions = rng.choice(input_ids.shape[1], size=count, replace=False)
            labels[row, positions] = input_ids[row, positions]
            action = rng.random(count)
            replace = rng.integers(self.first_ordinary_id, self.vocab_size, size=count)
            input_ids[row, positions] = np.where(
                action < 0.8, self.mask_token_id, np.where(action < 0.9, replace, input_ids[row, positions])
            )
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
                "labelled_logits_only": True}
