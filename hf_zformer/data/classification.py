"""Text classification: :func:`load_classification_dataset`.

Local ``.jsonl[.gz]`` / ``.csv[.gz]`` files or a Hub dataset become a ``DatasetDict`` with columns
``text`` (str) and ``label`` (int64; a Hub ``ClassLabel`` keeps its class names), plus any
``extra_columns`` asked for; the carved validation split is stratified by label and can keep
groups (e.g. all reviews of one movie) on one side.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from .files import file_identity, cheap_fingerprint, in_memory_dataset
from .records import LabelRange, as_int_label, discover_classification_files, has_column, read_records
from .sources import load_hub, dataset_source
from .splits import DEFAULT_GROUP_COLUMN, finish_splits


def _classification_features(extra: Mapping[str, datasets.features.features.FeatureType]) -> datasets.Features:
    return datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("int64"), **extra})


def _load_local_classification(
    path: Path,
    text_column: str,
    label_column: str,
    split_files: Mapping[str, str | os.PathLike] | None,
    extra_columns: Sequence[str],
    label_range: LabelRange,
    group_column: str | None = None,
) -> dict[str, datasets.Dataset]:
    if path.is_file():
        if split_files is not None:
            raise ValueError(f"split_files needs a directory, but {path} is a file")
        files = {"train": path}
    elif split_files is not None:
        if not split_files:
            raise ValueError("split_files is empty")
        files = {}
        for split, name in split_files.items():
            file = path / Path(name).expanduser()  # an absolute name replaces the directory
            if not file.is_file():
                raise FileNotFoundError(f"Split {split!r}: file not found: {file}")
            files[split] = file
    else:
        files = discover_classification_files(path)
    if group_column and group_column not in extra_columns and has_column(files.get("train"), group_column):
        extra_columns = (*extra_columns, group_column)
    splits: dict[str, datasets.Dataset] = {}
    for split, file in files.items():
        columns = read_records(file, text_column, label_column, extra_columns, label_range)
        arrays = {
            "text": pa.array(columns[text_column], pa.string()),
            "label": pa.array(columns[label_column], pa.int64()),
        }
        for name in extra_columns:
            try:
                arrays[name] = pa.array(columns[name])
            except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
                raise ValueError(f"{file}: extra column {name!r} has values of mixed types ({err})") from None
        table = pa.table(arrays)
        features = datasets.Features.from_arrow_schema(table.schema)
        fingerprint = cheap_fingerprint(
            "classification", text_column, label_column, tuple(extra_columns), file_identity(file)
        )
        splits[split] = in_memory_dataset(table, features, fingerprint)
    return splits


def _hub_classification(
    loaded: datasets.DatasetDict,
    name: str,
    text_column: str,
    label_column: str,
    extra_columns: Sequence[str],
    label_range: LabelRange,
    group_column: str | None = None,
) -> dict[str, datasets.Dataset]:
    if group_column and group_column not in extra_columns and "train" in loaded:
        if group_column in loaded["train"].column_names:  # kept for the carve, dropped after it
            extra_columns = (*extra_columns, group_column)
    splits: dict[str, datasets.Dataset] = {}
    for split, ds in loaded.items():
        missing = [c for c in (text_column, label_column, *extra_columns) if c not in ds.column_names]
        if missing:
            raise ValueError(
                f"Hub dataset {name!r} split {split!r} has no column(s) {missing}; its columns are {ds.column_names}"
            )
        where = f"Hub dataset {name!r} split {split!r}"
        for value in ds.unique(label_column) if len(ds) else []:
            as_int_label(value, where, label_column, label_range)  # raises on the first bad value
        features = _classification_features({n: ds.features[n] for n in extra_columns})
        if isinstance(ds.features[label_column], datasets.ClassLabel):  # keep the class names (IMDB: neg, pos)
            features["label"] = datasets.ClassLabel(names=ds.features[label_column].names)

        def convert(batch: dict[str, list], where: str = where) -> dict[str, list]:
            for text in batch[text_column]:
                if not isinstance(text, str):
                    raise ValueError(f"{where}: text column {text_column!r} has the non-string value {text!r}")
            out = {
                "text": batch[text_column],
                "label": [as_int_label(v, where, label_column, label_range) for v in batch[label_column]],
            }
            out.update({n: batch[n] for n in extra_columns})
            return out

        splits[split] = ds.map(convert, batched=True, remove_columns=ds.column_names, features=features)
    return splits


def load_classification_dataset(
    path: str | os.PathLike,
    *,
    text_column: str = "text",
    label_column: str = "label",
    split_files: Mapping[str, str | os.PathLike] | None = None,
    validation_size: float | int | None = 0.1,
    stratify: bool = True,
    seed: int = 42,
    max_samples: int | Mapping[str, int | None] | None = None,
    extra_columns: Sequence[str] = (),
    group_column: str | None = DEFAULT_GROUP_COLUMN,
    config_name: str | None = None,
    num_labels: int | None = None,
    allow_negative_labels: bool = True,
    **hub_kwargs: Any,
) -> datasets.DatasetDict:
    """Load a text-classification dataset as a ``DatasetDict`` with columns ``text`` and ``label``.

    ``text`` is a string and ``label`` an ``int64`` class id (the number of classes is
    ``max(label) + 1`` when ids are 0-based, as in IMDB: 0 = negative, 1 = positive); a Hub
    dataset's ``ClassLabel`` label column stays a ``ClassLabel`` (int64 ids) with its class names.

    Args:
        path: a directory with ``<split>.jsonl[.gz]`` or ``<split>.csv[.gz]`` files (``train``,
            ``validation``/``val``/``valid``/``dev``, ``test``; e.g. ``/work/shared/data/imdb`` with
            ``train.jsonl.gz``), a single such file (loaded as ``train``), or a Hub dataset name
            (``"stanfordnlp/imdb"``; splits other than train/validation/test, like IMDB's
            ``unsupervised``, are dropped). See :func:`dataset_source`.
        text_column, label_column: input column names, renamed to ``text`` and ``label``.
            Labels must be integers (ints, or strings/floats that are exact integers such as
            ``"1"`` in a CSV file).
        split_files: local only: ``{split: file name}`` relative to the directory (or absolute).
        validation_size: when there is a ``train`` split but no ``validation`` split, hold out this
            fraction (float in (0, 1)) or number of rows (int) of ``train`` as ``validation``,
            chosen with ``seed``; both keep the file order. ``None`` or ``0``: don't.
        stratify: make the held-out validation split's label distribution match ``train``'s.
        seed: seed for the validation split and for ``max_samples``.
        max_samples: keep at most this many rows per split (an int, or ``{split: n or None}``), a
            seeded random subset kept in its original order, taken after the validation split.
        extra_columns: further input columns to keep unchanged (e.g. ``("id",)``).
        group_column: when the train split has this column (default ``"movie"``, as in the IMDB
            files of ``../shared/data`` and as the scripts' ``--group_column``), the carved
            validation split takes whole groups: every row with the same value lands on the same
            side (still stratified by label, within a few rows of ``validation_size``), so no movie
            is scored that training saw. Data without the column, or ``group_column=None``, is
            carved by rows. The column is only kept in the output when it is also in
            ``extra_columns``.
        config_name, **hub_kwargs: passed to :func:`datasets.load_dataset` for Hub datasets.
        num_labels: when given, every label of every split must be a class id ``0..num_labels-1``.
        allow_negative_labels: ``False``: a negative label is an error (``True`` keeps e.g. the
            ``-1`` that Hub test splits use for "no label").

    Raises ``FileNotFoundError`` for a missing path or split file, ``ValueError`` for an empty file,
    invalid JSON, bytes that are not UTF-8, a truncated or corrupt ``.gz`` file, a missing column,
    a non-integer label or one outside the allowed range (naming the file, line and value).
    """
    label_range = (0 if num_labels is not None or not allow_negative_labels else None, num_labels)
    clash = {"text", "label"} & set(extra_columns)
    if clash:
        raise ValueError(f"extra_columns must not contain the output columns {sorted(clash)}")
    if dataset_source(path) == "local":
        if hub_kwargs or config_name is not None:
            raise ValueError(
                f"config_name/hub arguments {sorted(hub_kwargs)} only apply to Hub datasets, not to {path}"
            )
        splits = _load_local_classification(
            Path(path).expanduser(), text_column, label_column, split_files, tuple(extra_columns), label_range,
            group_column,
        )
    else:
        if split_files is not None:
            raise ValueError("split_files only applies to local directories")
        name = os.fspath(path)
        splits = _hub_classification(
            load_hub(name, config_name, hub_kwargs), name, text_column, label_column, tuple(extra_columns),
            label_range, group_column,
        )
    result = finish_splits(
        splits, validation_size, seed, max_samples, stratify_column="label" if stratify else None, group_column=group_column
    )
    if group_column and group_column not in extra_columns:
        result = datasets.DatasetDict(
            {split: ds.remove_columns([c for c in ds.column_names if c == group_column]) for split, ds in result.items()}
        )
    return result
