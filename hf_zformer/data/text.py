"""Documents for language modelling: :func:`load_text_dataset`.

Local ``.txt[.gz]`` files (one document per line), ``.jsonl[.gz]`` / ``.csv[.gz]`` files (one per
row) or a Hub dataset become a ``DatasetDict`` with one column ``text``; empty documents are
dropped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from .files import file_identity, cheap_fingerprint, in_memory_dataset, read_lines
from .records import CLASSIFICATION_SUFFIXES, discover_classification_files, has_column, read_records
from .sources import load_hub, dataset_source
from .splits import DEFAULT_GROUP_COLUMN, finish_splits


_TEXT_SUFFIXES = (*CLASSIFICATION_SUFFIXES, ".txt", ".txt.gz")


def _read_text_file(path: Path, text_column: str, group_column: str | None) -> dict[str, list]:
    """The documents of one file: a ``.txt[.gz]`` file holds one per line, a ``.jsonl[.gz]`` /
    ``.csv[.gz]`` file one per row (its ``text_column``, and ``group_column`` when the file has it)."""
    if path.name.lower().endswith(_TEXT_SUFFIXES[-2:]):
        return {"text": read_lines(path)}
    extra = (group_column,) if group_column and has_column(path, group_column) else ()
    columns = read_records(path, text_column, None, extra, (None, None))
    return {"text": columns.pop(text_column), **columns}


def _text_split(columns: dict[str, list], fingerprint: str) -> datasets.Dataset:
    """A ``Dataset`` of the non-empty documents in ``columns``."""
    keep = [i for i, text in enumerate(columns["text"]) if text.strip()]
    table = pa.table({name: pa.array([values[i] for i in keep]) for name, values in columns.items()})
    return in_memory_dataset(table, datasets.Features.from_arrow_schema(table.schema), fingerprint)


def load_text_dataset(
    path: str | os.PathLike,
    *,
    text_column: str = "text",
    validation_file: str | os.PathLike | None = None,
    validation_size: float | int | None = 0.05,
    seed: int = 42,
    group_column: str | None = DEFAULT_GROUP_COLUMN,
    config_name: str | None = None,
    **hub_kwargs: Any,
) -> datasets.DatasetDict:
    """Load documents for language modelling as a ``DatasetDict`` with one column ``text``.

    Args:
        path: a ``.jsonl[.gz]`` / ``.csv[.gz]`` file (one document per row, in ``text_column``; e.g.
            ``../shared/data/imdb/unsup.jsonl.gz``) or ``.txt[.gz]`` file (one document per line),
            loaded as ``train``; a directory of such ``<split>.*`` files (``train``, ``validation``
            and its aliases, ``test``); or a Hub dataset name (``"wikitext"`` with
            ``config_name="wikitext-103-raw-v1"``). See :func:`dataset_source`.
        validation_file: local only: a file of validation documents (instead of carving them).
        validation_size: without a validation split, hold out this fraction (float in (0, 1)) or
            number (int) of training documents, chosen with ``seed``.
        group_column: when the training data has this column (default ``"movie"``, as in the IMDB
            files and as the scripts' ``--group_column``), the held-out validation documents are
            whole groups, so no group is on both sides; ``None`` carves by documents.
        config_name, **hub_kwargs: passed to :func:`datasets.load_dataset` for Hub datasets.

    Empty and whitespace-only documents are dropped (Hub text datasets such as wikitext have many).
    Raises like :func:`load_classification_dataset` for missing files, bad bytes, bad JSON or a
    missing text column, naming the file and line.
    """
    if dataset_source(path) == "local":
        if hub_kwargs or config_name is not None:
            raise ValueError(f"config_name/hub arguments {sorted(hub_kwargs)} only apply to Hub datasets, not to {path}")
        base = Path(path).expanduser()
        files = {"train": base} if base.is_file() else discover_classification_files(base, _TEXT_SUFFIXES)
        if validation_file is not None:
            if "validation" in files:
                raise ValueError(f"validation_file {validation_file} given, but {base} has a validation file too")
            files["validation"] = Path(validation_file).expanduser()
            if not files["validation"].is_file():
                raise FileNotFoundError(f"Validation file not found: {files['validation']}")
        splits = {
            split: _text_split(_read_text_file(file, text_column, group_column if split == "train" else None),
                               cheap_fingerprint("text", text_column, group_column, file_identity(file)))
            for split, file in files.items()
        }
    else:
        if validation_file is not None:
            raise ValueError("validation_file only applies to local data")
        name = os.fspath(path)
        splits = {}
        for split, ds in load_hub(name, config_name, hub_kwargs).items():
            if text_column not in ds.column_names:
                raise ValueError(f"Hub dataset {name!r} split {split!r} has no text column {text_column!r}; its "
                                 f"columns are {ds.column_names} (choose one with --text_column)")
            keep = [text_column, *([group_column] if group_column in ds.column_names and split == "train" else [])]
            ds = ds.select_columns(keep).rename_columns({text_column: "text"} if text_column != "text" else {})
            splits[split] = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    result = finish_splits(splits, validation_size, seed, None, stratify_column=None, group_column=group_column)
    return datasets.DatasetDict(
        {split: ds.select_columns(["text"]) for split, ds in result.items()}
    )
