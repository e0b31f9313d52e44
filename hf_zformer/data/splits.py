"""Split names and what every loader does to the splits it read.

:data:`SPLIT_ALIASES` maps file stems and Hub split names to ``train``, ``validation`` and
``test``. ``finish_splits`` carves a validation split from ``train`` when there is none (seeded;
stratified by label and/or made of whole groups on request), takes the ``max_samples`` subsets and
puts the splits in canonical order.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Mapping, Sequence
from typing import Any

import datasets

from .files import cheap_fingerprint


#: File stems / Hub split names understood without an explicit mapping, and the split they mean.
SPLIT_ALIASES: dict[str, str] = {
    "train": "train",
    "validation": "validation",
    "val": "validation",
    "valid": "validation",
    "dev": "validation",
    "test": "test",
    "test_2016_flickr": "test",
}

CANONICAL_SPLITS = ("train", "validation", "test")

#: The column whose groups a carved validation split keeps whole unless the caller names another
#: (or ``None``: carve by rows): ``movie`` in the IMDB files of ``../shared/data``, as the scripts'
#: ``--group_column`` default. Data without the column is carved by rows.
DEFAULT_GROUP_COLUMN = "movie"


def _validation_count(n_rows: int, validation_size: float | int) -> int:
    if isinstance(validation_size, bool) or not isinstance(validation_size, (int, float)):
        raise ValueError(f"validation_size must be a float in (0, 1) or an int >= 1, got {validation_size!r}")
    if isinstance(validation_size, float):
        if not 0.0 < validation_size < 1.0:
            raise ValueError(f"validation_size as a fraction must be in (0, 1), got {validation_size!r}")
        count = int(round(n_rows * validation_size))
        count = max(count, 1)
    else:
        if validation_size < 1:
            raise ValueError(f"validation_size as a count must be >= 1, got {validation_size!r}")
        count = validation_size
    if count >= n_rows:
        raise ValueError(
            f"validation_size={validation_size!r} leaves no training rows: the train split has {n_rows} rows."
        )
    return count


def _label_quotas(sizes: Mapping[Any, int], count: int) -> dict[Any, int]:
    """Split ``count`` over the labels in proportion to ``sizes`` (label -> rows), by largest remainder."""
    n_rows = sum(sizes.values())
    quotas = {label: count * size / n_rows for label, size in sizes.items()}
    taken = {label: int(quota) for label, quota in quotas.items()}
    # largest remainder, ties broken by label value so the result is deterministic
    leftover = count - sum(taken.values())
    for label in sorted(quotas, key=lambda lab: (-(quotas[lab] - taken[lab]), lab))[:leftover]:
        taken[label] += 1
    return taken


def _stratified_pick(labels: Sequence[int], count: int, rng: random.Random) -> list[int]:
    """Pick ``count`` row indices with each label's share as close as possible to its share in ``labels``."""
    by_label: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_label.setdefault(label, []).append(index)
    taken = _label_quotas({label: len(rows) for label, rows in by_label.items()}, count)
    picked: list[int] = []
    for label in sorted(by_label):
        picked.extend(rng.sample(by_label[label], taken[label]))
    return picked


def grouped_pick(groups: Sequence[Any], labels: Sequence[int] | None, count: int, rng: random.Random) -> list[int]:
    """Pick about ``count`` row indices made of whole groups (rows with equal ``groups`` value, e.g.
    all reviews of one movie; a missing value is a group of its own), label-stratified when
    ``labels`` is given: groups are visited in a seeded random order and taken while they fit in
    what is left of each label's quota, so the result never exceeds the quotas and, with many
    small groups, ends at or a few rows below them."""
    by_group: dict[Any, list[int]] = {}
    for index, group in enumerate(groups):
        by_group.setdefault(("row", index) if group is None else ("group", group), []).append(index)
    row_label = (lambda i: labels[i]) if labels is not None else (lambda i: None)
    sizes = collections.Counter(row_label(i) for i in range(len(groups)))
    remaining = _label_quotas(sizes, count) if labels is not None else {None: count}
    order = list(by_group)  # first-appearance order: deterministic for a given file
    rng.shuffle(order)
    picked: list[int] = []
    for key in order:
        need = collections.Counter(row_label(i) for i in by_group[key])
        if all(n <= remaining[label] for label, n in need.items()):
            picked.extend(by_group[key])
            for label, n in need.items():
                remaining[label] -= n
            if not any(remaining.values()):
                break
    return picked


def _carve_validation(
    splits: dict[str, datasets.Dataset],
    validation_size: float | int | None,
    seed: int,
    stratify_column: str | None,
    group_column: str | None = None,
) -> dict[str, datasets.Dataset]:
    if "validation" in splits or "train" not in splits or not validation_size:
        return splits
    train = splits["train"]
    count = _validation_count(len(train), validation_size)
    rng = random.Random(seed)
    if group_column is not None and group_column in train.column_names:
        columns = train.select_columns([group_column, *([stratify_column] if stratify_column else [])])[:]
        picked = grouped_pick(columns[group_column], columns.get(stratify_column), count, rng)
    elif stratify_column is not None:
        labels = train.select_columns([stratify_column])[:][stratify_column]  # fast: no per-row Column access
        picked = _stratified_pick(labels, count, rng)
    else:
        picked = rng.sample(range(len(train)), count)
    picked_set = set(picked)
    validation_rows = sorted(picked_set)
    train_rows = [i for i in range(len(train)) if i not in picked_set]
    result = dict(splits)
    parts = (train._fingerprint, validation_size, seed, stratify_column, group_column)
    result["train"] = train.select(train_rows, new_fingerprint=cheap_fingerprint("carve-train", *parts))
    result["validation"] = train.select(validation_rows, new_fingerprint=cheap_fingerprint("carve-validation", *parts))
    return result


def _subset(
    splits: dict[str, datasets.Dataset],
    max_samples: int | Mapping[str, int | None] | None,
    seed: int,
) -> dict[str, datasets.Dataset]:
    if max_samples is None:
        return splits
    if isinstance(max_samples, Mapping):
        unknown = set(max_samples) - set(splits)
        if unknown:
            raise ValueError(f"max_samples names splits {sorted(unknown)} that are not in the dataset {sorted(splits)}")
        limits = dict(max_samples)
    else:
        limits = {name: max_samples for name in splits}
    result = dict(splits)
    for name, limit in limits.items():
        if limit is None:
            continue
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_samples for split {name!r} must be a positive int or None, got {limit!r}")
        ds = splits[name]
        if limit < len(ds):
            rows = sorted(random.Random(f"{seed}-{name}").sample(range(len(ds)), limit))
            result[name] = ds.select(rows, new_fingerprint=cheap_fingerprint("subset", ds._fingerprint, seed, limit))
    return result


def finish_splits(
    splits: dict[str, datasets.Dataset],
    validation_size: float | int | None,
    seed: int,
    max_samples: int | Mapping[str, int | None] | None,
    stratify_column: str | None,
    group_column: str | None = None,
) -> datasets.DatasetDict:
    splits = _carve_validation(splits, validation_size, seed, stratify_column, group_column)
    splits = _subset(splits, max_samples, seed)
    order = [name for name in CANONICAL_SPLITS if name in splits] + sorted(set(splits) - set(CANONICAL_SPLITS))
    return datasets.DatasetDict({name: splits[name] for name in order})
