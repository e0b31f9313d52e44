"""JSON lines and CSV records: the files of the classification and text loaders.

``read_records`` reads a ``.jsonl[.gz]`` / ``.csv[.gz]`` file into columns and checks every row
(the text a string, the label an integer class id in the allowed :data:`LabelRange`), naming the
file and line of the first bad row; ``discover_classification_files`` finds a folder's
``<split>.<suffix>`` files.
"""

from __future__ import annotations

import csv
import json
import numbers
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .files import ambiguous_split, reading, require_train
from .splits import SPLIT_ALIASES


#: The record files the classification loader reads (the text loader adds ``.txt[.gz]``).
CLASSIFICATION_SUFFIXES = (".jsonl", ".jsonl.gz", ".csv", ".csv.gz")


#: ``(low, high)``: labels must be ``>= low`` (``None``: any) and ``< high`` (``None``: any int64).
LabelRange = tuple[int | None, int | None]


def as_int_label(value: Any, where: str, column: str, label_range: LabelRange = (None, None)) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        label = int(value)  # Python and numpy integers
    elif isinstance(value, float) and value.is_integer():
        label = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        label = int(value)
    else:
        raise ValueError(
            f"{where}: label column {column!r} has the non-integer value {value!r}; labels must be "
            "integers (map string labels to ids first)"
        )
    low, high = label_range
    if not -(2**63) <= label < 2**63:
        raise ValueError(f"{where}: label column {column!r} has the value {value!r}, too large for a class id")
    if (low is not None and label < low) or (high is not None and label >= high):
        classes = f"0..{high - 1} ({high} classes)" if high is not None else f"at least {low}"
        raise ValueError(f"{where}: label column {column!r} has the value {value!r}; class ids must be {classes}")
    return label


def _classification_suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in CLASSIFICATION_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ValueError(f"Unsupported file type {path}: expected one of {list(CLASSIFICATION_SUFFIXES)}")


def read_records(
    path: Path, text_column: str, label_column: str | None, extra_columns: Sequence[str], label_range: LabelRange
) -> dict[str, list]:
    """Read a ``.jsonl[.gz]`` / ``.csv[.gz]`` file into columns, checking every row (no label
    column when ``label_column`` is None)."""
    suffix = _classification_suffix(path)
    wanted = [text_column, *([label_column] if label_column is not None else []), *extra_columns]
    columns: dict[str, list] = {name: [] for name in wanted}

    def add(row: Mapping[str, Any], where: str) -> None:
        missing = [name for name in wanted if name not in row]
        if missing:
            raise ValueError(f"{where}: missing column(s) {missing}; the row has {sorted(row)}")
        text = row[text_column]
        if not isinstance(text, str):
            raise ValueError(f"{where}: text column {text_column!r} has the non-string value {text!r}")
        columns[text_column].append(text)
        if label_column is not None:  # None: text only (language modelling)
            columns[label_column].append(as_int_label(row[label_column], where, label_column, label_range))
        for name in extra_columns:
            columns[name].append(row[name])

    with reading(path) as handle:
        if suffix.startswith(".csv"):
            reader = csv.DictReader(handle)
            if reader.fieldnames is None:
                raise ValueError(f"Empty file: {path}")
            missing = [name for name in wanted if name not in reader.fieldnames]
            if missing:
                raise ValueError(f"{path}: missing column(s) {missing}; the header has {reader.fieldnames}")
            for row in reader:
                add(row, f"{path} line {reader.line_num}")
        else:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path} line {line_number}: invalid JSON ({err.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path} line {line_number}: expected a JSON object, got {type(row).__name__}")
                add(row, f"{path} line {line_number}")
    if not columns[text_column]:
        raise ValueError(f"Empty file: {path}")
    return columns


def discover_classification_files(directory: Path, suffixes: Sequence[str] = CLASSIFICATION_SUFFIXES) -> dict[str, Path]:
    by_split: dict[str, Path] = {}
    for entry in sorted(directory.iterdir()):
        if not entry.is_file():
            continue
        name = entry.name.lower()
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None:
            continue
        split = SPLIT_ALIASES.get(entry.name[: -len(suffix)])
        if split is None:
            continue
        if split in by_split:
            raise ambiguous_split(split, directory, f"{by_split[split].name} and {entry.name}")
        by_split[split] = entry
    require_train(by_split, directory, f"file train{{{','.join(suffixes)}}}")
    return by_split


def has_column(path: Path | None, column: str) -> bool:
    """Whether the first record (JSON lines) or the header (CSV) of ``path`` has ``column``."""
    if path is None:
        return False
    with reading(path) as handle:
        if _classification_suffix(path).startswith(".csv"):
            return column in (csv.DictReader(handle).fieldnames or [])
        for line in handle:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False  # read_records reports the error with its line number
                return isinstance(row, dict) and column in row
    return False
