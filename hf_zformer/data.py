"""Dataset loaders for translation and text classification.

Both loaders accept either a local directory (the layout of ``/work/shared/data``, which works
offline) or a Hugging Face Hub dataset name, and always return a :class:`datasets.DatasetDict`
with the same schema whatever the source:

* :func:`load_translation_dataset` -> one column ``translation`` holding dicts
  ``{source_lang: str, target_lang: str}`` (feature :class:`datasets.Translation`), the
  convention of the ``transformers`` translation examples and of the WMT datasets on the Hub.
* :func:`load_classification_dataset` -> columns ``text`` (str) and ``label`` (int64), plus any
  ``extra_columns`` asked for.
* :func:`load_text_dataset` -> one column ``text`` (str): documents for language modelling.

Split names are normalised to ``train``, ``validation`` and ``test`` (``val``, ``valid`` and
``dev`` mean ``validation``; Multi30K's ``test_2016_flickr`` means ``test``). When a dataset has
a ``train`` split but no ``validation`` split, a validation split is carved from ``train``
deterministically (seeded; stratified by label for classification).

:func:`dataset_source` is the rule that decides between the local loaders and
:func:`datasets.load_dataset`.
"""

from __future__ import annotations

import collections
import csv
import gzip
import hashlib
import io
import json
import numbers
import os
import random
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

__all__ = [
    "dataset_source",
    "load_classification_dataset",
    "load_text_dataset",
    "load_translation_dataset",
]

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

_CANONICAL_SPLITS = ("train", "validation", "test")
_CLASSIFICATION_SUFFIXES = (".jsonl", ".jsonl.gz", ".csv", ".csv.gz")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_LOCAL_SUFFIX = re.compile(r"\.(gz|jsonl|json|csv|tsv|txt|parquet|arrow)$", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# local or Hub
# --------------------------------------------------------------------------------------------


def dataset_source(path: str | os.PathLike) -> str:
    """Decide whether ``path`` names local data or a Hub dataset.

    Returns ``"local"`` when ``path`` exists on disk (a directory, or a file for the
    classification loader), ``"hub"`` when it looks like a Hub id (``name`` or ``org/name``).

    Raises:
        FileNotFoundError: ``path`` does not exist but is clearly meant as a local path (absolute,
            starting with ``.`` or ``~``, more than one ``/``, or a data-file suffix such as
            ``.gz``), so that a typo in a directory name is not sent to the Hub.
    """
    text = os.fspath(path)
    expanded = Path(text).expanduser()
    if expanded.exists():
        return "local"
    looks_local = (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or "\\" in text
        or not _HUB_ID.fullmatch(text)
        or bool(_LOCAL_SUFFIX.search(text))
    )
    if looks_local:
        raise FileNotFoundError(f"Data directory or file not found: {expanded}")
    return "hub"


_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (a one-line reason), or None when it can, or when
    that cannot be known cheaply: in offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``,
    where ``datasets`` reads its cache) or behind a proxy (a direct connection proves nothing).

    One TCP connection to the endpoint's host: without network this fails at once, where
    ``datasets.load_dataset`` would retry for half a minute before its ``ConnectionError``."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in _OFFLINE_VARIABLES):
        return None
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    return None


def _load_hub(path: str, config_name: str | None, hub_kwargs: dict[str, Any]) -> datasets.DatasetDict:
    not_here = f"{path!r} is not an existing local path, so it was taken for a Hugging Face Hub dataset id"
    reason = hub_unreachable()
    if reason is not None:
        raise ConnectionError(
            f"{not_here}, but the Hub cannot be reached ({reason}). Without network, pass a local copy "
            "of the data with --data_dir DIR (the layout is in docs/data.md); to use a copy already in "
            "the datasets cache, set HF_DATASETS_OFFLINE=1."
        )
    try:
        loaded = datasets.load_dataset(path, config_name, **hub_kwargs)
    except Exception as err:  # add context, keep the original error type and traceback
        if hasattr(err, "add_note"):  # Python >= 3.11
            err.add_note(f"hf_zformer.data: {not_here}; pass a local directory (--data_dir DIR) to read files instead.")
        raise
    if not isinstance(loaded, datasets.DatasetDict):
        raise ValueError(
            f"datasets.load_dataset({path!r}) returned a {type(loaded).__name__}, expected a "
            "DatasetDict (do not pass `split=` to the hf_zformer loaders)."
        )
    splits: dict[str, datasets.Dataset] = {}
    for name, ds in loaded.items():
        canonical = SPLIT_ALIASES.get(name)
        if canonical is None:  # e.g. IMDB's unlabeled "unsupervised" split
            continue
        if canonical in splits:
            raise ValueError(f"Hub dataset {path!r} has several splits that mean {canonical!r}: {list(loaded)}")
        splits[canonical] = ds
    if not splits:
        raise ValueError(
            f"Hub dataset {path!r} has none of the splits {list(_CANONICAL_SPLITS)} "
            f"(or their aliases); it has {list(loaded)}."
        )
    return datasets.DatasetDict(splits)


# --------------------------------------------------------------------------------------------
# file reading
# --------------------------------------------------------------------------------------------


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


#: What reading a file raises for bytes that are not UTF-8 or a truncated/corrupt ``.gz`` file.
_UNREADABLE = (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error)


def _unreadable(path: Path, error: Exception) -> ValueError:
    """A ``ValueError`` for an :data:`_UNREADABLE` ``error`` that names ``path`` and the line."""
    raw = path.read_bytes()
    if isinstance(error, UnicodeDecodeError):  # the compression is fine, the text is not UTF-8
        text = gzip.decompress(raw) if path.suffix == ".gz" else raw
        for number, line in enumerate(text.split(b"\n"), start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return ValueError(
                    f"{path} line {number}: not valid UTF-8 (byte {line[bad.start:bad.start + 1]!r} at column "
                    f"{bad.start + 1}); convert the file to UTF-8"
                )
        return ValueError(f"{path}: not valid UTF-8 ({error.reason}); convert the file to UTF-8")
    decompressor, readable = zlib.decompressobj(wbits=31), []
    for start in range(0, len(raw), 1 << 16):  # keep what decompresses before the damage
        try:
            readable.append(decompressor.decompress(raw[start : start + (1 << 16)]))
        except zlib.error:
            break
    lines = b"".join(readable).count(b"\n")
    return ValueError(
        f"{path}: truncated or corrupt gzip file ({error}); it breaks off in line {lines + 1}. "
        "Download or compress it again."
    )


def _read_lines(path: Path) -> list[str]:
    """One sentence per line; only ``\\n`` (and a ``\\r`` before it) ends a line."""
    try:
        with _open_text(path) as handle:
            content = handle.read()
    except _UNREADABLE as error:
        raise _unreadable(path, error) from None
    if content.startswith("\ufeff"):
        content = content[1:]
    lines = content.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline at the end of the last line
    if not lines:
        raise ValueError(f"Empty file: {path}")
    return [line.strip() for line in lines]


def _find_file(base: Path) -> Path | None:
    """``base`` itself or ``base`` + ``.gz``; error when both exist."""
    plain, gz = base, base.with_name(base.name + ".gz")
    if plain.is_file() and gz.is_file():
        raise ValueError(f"Both {plain} and {gz} exist; remove one or pass `split_files`.")
    if plain.is_file():
        return plain
    if gz.is_file():
        return gz
    return None


def _fingerprint(*parts: Any) -> str:
    """A cheap deterministic dataset fingerprint (``datasets`` would otherwise hash all the data)."""
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:16]


def _file_identity(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def _in_memory_dataset(table: pa.Table, features: datasets.Features, fingerprint: str) -> datasets.Dataset:
    return datasets.Dataset(
        table.cast(features.arrow_schema), info=datasets.DatasetInfo(features=features), fingerprint=fingerprint
    )


# --------------------------------------------------------------------------------------------
# shared post-processing: validation carving and subsetting
# --------------------------------------------------------------------------------------------


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


def _grouped_pick(groups: Sequence[Any], labels: Sequence[int] | None, count: int, rng: random.Random) -> list[int]:
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
        picked = _grouped_pick(columns[group_column], columns.get(stratify_column), count, rng)
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
    result["train"] = train.select(train_rows, new_fingerprint=_fingerprint("carve-train", *parts))
    result["validation"] = train.select(validation_rows, new_fingerprint=_fingerprint("carve-validation", *parts))
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
            result[name] = ds.select(rows, new_fingerprint=_fingerprint("subset", ds._fingerprint, seed, limit))
    return result


def _finish(
    splits: dict[str, datasets.Dataset],
    validation_size: float | int | None,
    seed: int,
    max_samples: int | Mapping[str, int | None] | None,
    stratify_column: str | None,
    group_column: str | None = None,
) -> datasets.DatasetDict:
    splits = _carve_validation(splits, validation_size, seed, stratify_column, group_column)
    splits = _subset(splits, max_samples, seed)
    order = [name for name in _CANONICAL_SPLITS if name in splits] + sorted(set(splits) - set(_CANONICAL_SPLITS))
    return datasets.DatasetDict({name: splits[name] for name in order})


# --------------------------------------------------------------------------------------------
# translation
# --------------------------------------------------------------------------------------------


def _discover_translation_stems(directory: Path, source_lang: str, target_lang: str) -> dict[str, str]:
    pattern = re.compile(rf"(?P<stem>.+)\.{re.escape(source_lang)}(\.gz)?")
    by_split: dict[str, str] = {}
    for entry in sorted(directory.iterdir()):
        match = pattern.fullmatch(entry.name)
        if not match or not entry.is_file():
            continue
        stem = match.group("stem")
        split = SPLIT_ALIASES.get(stem)
        if split is None:
            continue
        if split in by_split and by_split[split] != stem:
            raise _ambiguous_split(split, directory, f"stems {by_split[split]!r} and {stem!r}")
        by_split[split] = stem
    _require_train(by_split, directory, f"files train.{source_lang}[.gz]")
    return by_split


def _ambiguous_split(split: str, directory: Path, candidates: str) -> ValueError:
    return ValueError(
        f"Files for split {split!r} are ambiguous in {directory}: {candidates}; "
        f"pass split_files={{{split!r}: ...}} to choose."
    )


def _require_train(by_split: dict, directory: Path, wanted: str) -> None:
    """A local dataset folder must hold training data: else name what was looked for and what is there."""
    if "train" not in by_split:
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(
            f"No training {wanted} in {directory} (found: {found}); pass `split_files` to name the files."
        )


def _load_local_translation(
    directory: Path,
    source_lang: str,
    target_lang: str,
    split_files: Mapping[str, str] | None,
) -> dict[str, datasets.Dataset]:
    if not directory.is_dir():
        raise ValueError(
            f"A translation corpus must be a directory of <split>.<lang>[.gz] files, got the file {directory}"
        )
    stems = (
        dict(split_files)
        if split_files is not None
        else _discover_translation_stems(directory, source_lang, target_lang)
    )
    if not stems:
        raise ValueError("split_files is empty")
    features = datasets.Features({"translation": datasets.Translation(languages=[source_lang, target_lang])})
    splits: dict[str, datasets.Dataset] = {}
    for split, stem in stems.items():
        texts: dict[str, list[str]] = {}
        paths: dict[str, Path] = {}
        for lang in (source_lang, target_lang):
            base = directory / f"{stem}.{lang}"
            found = _find_file(base)
            if found is None:
                raise FileNotFoundError(f"Split {split!r}: missing file {base} (or {base}.gz)")
            paths[lang] = found
            texts[lang] = _read_lines(found)
        n_src, n_tgt = len(texts[source_lang]), len(texts[target_lang])
        if n_src != n_tgt:
            raise ValueError(
                f"Split {split!r}: {paths[source_lang]} has {n_src} lines but {paths[target_lang]} has {n_tgt}; "
                "parallel files must be line-aligned."
            )
        column = pa.StructArray.from_arrays(
            [pa.array(texts[source_lang], pa.string()), pa.array(texts[target_lang], pa.string())],
            names=[source_lang, target_lang],
        )
        fingerprint = _fingerprint(
            "translation", source_lang, target_lang, *(_file_identity(paths[lang]) for lang in paths)
        )
        splits[split] = _in_memory_dataset(pa.table({"translation": column}), features, fingerprint)
    return splits


def _hub_translation(
    loaded: datasets.DatasetDict, name: str, source_lang: str, target_lang: str
) -> dict[str, datasets.Dataset]:
    features = datasets.Features({"translation": datasets.Translation(languages=[source_lang, target_lang])})
    splits: dict[str, datasets.Dataset] = {}
    for split, ds in loaded.items():
        columns = ds.column_names
        if "translation" in columns:
            languages = (
                set(ds.features["translation"].languages)
                if isinstance(ds.features["translation"], datasets.Translation)
                else set(ds[0]["translation"])
                if len(ds)
                else set()
            )
            missing = [lang for lang in (source_lang, target_lang) if lang not in languages]
            if missing:
                raise ValueError(
                    f"Hub dataset {name!r} split {split!r}: the 'translation' column has languages "
                    f"{sorted(languages)}, missing {missing}"
                )

            def convert(batch: dict[str, list]) -> dict[str, list]:
                return {
                    "translation": [
                        {source_lang: p[source_lang], target_lang: p[target_lang]} for p in batch["translation"]
                    ]
                }

        else:
            missing = [lang for lang in (source_lang, target_lang) if lang not in columns]
            if missing:
                raise ValueError(
                    f"Hub dataset {name!r} split {split!r} has neither a 'translation' column nor the "
                    f"language columns {missing}; its columns are {columns}"
                )

            def convert(batch: dict[str, list]) -> dict[str, list]:
                return {
                    "translation": [
                        {source_lang: s, target_lang: t} for s, t in zip(batch[source_lang], batch[target_lang])
                    ]
                }

        splits[split] = ds.map(convert, batched=True, remove_columns=columns, features=features)
    return splits


def load_translation_dataset(
    path: str | os.PathLike,
    source_lang: str = "de",
    target_lang: str = "en",
    *,
    split_files: Mapping[str, str] | None = None,
    validation_size: float | int | None = 0.1,
    seed: int = 42,
    max_samples: int | Mapping[str, int | None] | None = None,
    config_name: str | None = None,
    **hub_kwargs: Any,
) -> datasets.DatasetDict:
    """Load a parallel corpus as a ``DatasetDict`` with one column ``translation``.

    Every row is ``{"translation": {source_lang: "...", target_lang: "..."}}``.

    Args:
        path: a directory of line-aligned ``<stem>.<lang>`` files, plain or ``.gz`` (e.g. Multi30K:
            ``train.de.gz``/``train.en.gz``, ``val.*`` -> ``validation``, ``test_2016_flickr.*`` ->
            ``test``), or a Hub dataset name (``"bentrevett/multi30k"``: columns ``de``/``en``; a
            Hub dataset with a ``translation`` column works too). See :func:`dataset_source`.
        source_lang, target_lang: language codes, i.e. file suffixes / Hub column names.
        split_files: local only: explicit ``{split: stem}`` mapping, e.g.
            ``{"train": "train", "validation": "val", "test": "test_2017_flickr"}``; only these
            splits are loaded. Default: discover ``train``, ``val``/``valid``/``dev``/``validation``,
            ``test``/``test_2016_flickr`` stems; other stems are ignored.
        validation_size: when there is a ``train`` split but no ``validation`` split, hold out this
            fraction (float in (0, 1)) or number of rows (int) of ``train`` as ``validation``,
            chosen with ``seed``; both splits keep the file order. ``None`` or ``0``: don't.
        seed: seed for the validation split and for ``max_samples``.
        max_samples: keep at most this many rows per split (an int for all splits, or
            ``{split: n or None}``), a seeded random subset kept in its original order. Applied after
            the validation split is carved, so it does not change which rows are validation.
        config_name, **hub_kwargs: passed to :func:`datasets.load_dataset` for Hub datasets.

    Lines are stripped of surrounding whitespace. Raises ``FileNotFoundError`` for a missing
    directory or split file, ``ValueError`` for an empty file, files with different line counts,
    bytes that are not UTF-8 or a truncated/corrupt ``.gz`` file (naming file and line), or
    missing Hub columns.
    """
    if source_lang == target_lang:
        raise ValueError(f"source_lang and target_lang are both {source_lang!r}")
    if dataset_source(path) == "local":
        if hub_kwargs or config_name is not None:
            raise ValueError(
                f"config_name/hub arguments {sorted(hub_kwargs)} only apply to Hub datasets, not to {path}"
            )
        splits = _load_local_translation(Path(path).expanduser(), source_lang, target_lang, split_files)
    else:
        if split_files is not None:
            raise ValueError("split_files only applies to local directories")
        name = os.fspath(path)
        splits = _hub_translation(_load_hub(name, config_name, hub_kwargs), name, source_lang, target_lang)
    return _finish(splits, validation_size, seed, max_samples, stratify_column=None)


# --------------------------------------------------------------------------------------------
# classification
# --------------------------------------------------------------------------------------------


#: ``(low, high)``: labels must be ``>= low`` (``None``: any) and ``< high`` (``None``: any int64).
LabelRange = tuple[int | None, int | None]


def _as_int_label(value: Any, where: str, column: str, label_range: LabelRange = (None, None)) -> int:
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
    for suffix in _CLASSIFICATION_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ValueError(f"Unsupported file type {path}: expected one of {list(_CLASSIFICATION_SUFFIXES)}")


def _read_records(
    path: Path, text_column: str, label_column: str | None, extra_columns: Sequence[str], label_range: LabelRange
) -> dict[str, list]:
    """Read a ``.jsonl[.gz]`` / ``.csv[.gz]`` file into columns, checking every row (no label
    column when ``label_column`` is None)."""
    try:
        return _read_record_rows(path, text_column, label_column, extra_columns, label_range)
    except _UNREADABLE as error:
        raise _unreadable(path, error) from None


def _read_record_rows(
    path: Path, text_column: str, label_column: str | None, extra_columns: Sequence[str], label_range: LabelRange
) -> dict[str, list]:
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
            columns[label_column].append(_as_int_label(row[label_column], where, label_column, label_range))
        for name in extra_columns:
            columns[name].append(row[name])

    with _open_text(path) as handle:
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


def _discover_classification_files(directory: Path, suffixes: Sequence[str] = _CLASSIFICATION_SUFFIXES) -> dict[str, Path]:
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
            raise _ambiguous_split(split, directory, f"{by_split[split].name} and {entry.name}")
        by_split[split] = entry
    _require_train(by_split, directory, f"file train{{{','.join(suffixes)}}}")
    return by_split


def _has_column(path: Path | None, column: str) -> bool:
    """Whether the first record (JSON lines) or the header (CSV) of ``path`` has ``column``."""
    if path is None:
        return False
    with _open_text(path) as handle:
        if _classification_suffix(path).startswith(".csv"):
            return column in (csv.DictReader(handle).fieldnames or [])
        for line in handle:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False  # _read_records reports the error with its line number
                return isinstance(row, dict) and column in row
    return False


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
        files = _discover_classification_files(path)
    if group_column and group_column not in extra_columns and _has_column(files.get("train"), group_column):
        extra_columns = (*extra_columns, group_column)
    splits: dict[str, datasets.Dataset] = {}
    for split, file in files.items():
        columns = _read_records(file, text_column, label_column, extra_columns, label_range)
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
        fingerprint = _fingerprint(
            "classification", text_column, label_column, tuple(extra_columns), _file_identity(file)
        )
        splits[split] = _in_memory_dataset(table, features, fingerprint)
    return splits


def _hub_classification(
    loaded: datasets.DatasetDict,
    name: str,
    text_column: str,
    label_column: str,
    extra_columns: Sequence[str],
    label_range: LabelRange,
) -> dict[str, datasets.Dataset]:
    splits: dict[str, datasets.Dataset] = {}
    for split, ds in loaded.items():
        missing = [c for c in (text_column, label_column, *extra_columns) if c not in ds.column_names]
        if missing:
            raise ValueError(
                f"Hub dataset {name!r} split {split!r} has no column(s) {missing}; its columns are {ds.column_names}"
            )
        where = f"Hub dataset {name!r} split {split!r}"
        for value in ds.unique(label_column) if len(ds) else []:
            _as_int_label(value, where, label_column, label_range)  # raises on the first bad value
        features = _classification_features({n: ds.features[n] for n in extra_columns})
        if isinstance(ds.features[label_column], datasets.ClassLabel):  # keep the class names (IMDB: neg, pos)
            features["label"] = datasets.ClassLabel(names=ds.features[label_column].names)

        def convert(batch: dict[str, list], where: str = where) -> dict[str, list]:
            for text in batch[text_column]:
                if not isinstance(text, str):
                    raise ValueError(f"{where}: text column {text_column!r} has the non-string value {text!r}")
            out = {
                "text": batch[text_column],
                "label": [_as_int_label(v, where, label_column, label_range) for v in batch[label_column]],
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
    group_column: str | None = None,
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
        group_column: when the train split has this column (e.g. ``"movie"`` in the IMDB files of
            ``../shared/data``), the carved validation split takes whole groups: every row with the
            same value lands on the same side (still stratified by label, within a few rows of
            ``validation_size``). Data without the column is carved by rows. The column is only
            kept in the output when it is also in ``extra_columns``.
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
        loaded = _load_hub(name, config_name, hub_kwargs)
        extra = tuple(extra_columns)
        if group_column and group_column not in extra and "train" in loaded and group_column in loaded["train"].column_names:
            extra += (group_column,)
        splits = _hub_classification(loaded, name, text_column, label_column, extra, label_range)
    result = _finish(
        splits, validation_size, seed, max_samples, stratify_column="label" if stratify else None, group_column=group_column
    )
    if group_column and group_column not in extra_columns:
        result = datasets.DatasetDict(
            {split: ds.remove_columns([c for c in ds.column_names if c == group_column]) for split, ds in result.items()}
        )
    return result


# --------------------------------------------------------------------------------------------
# plain text (language modelling)
# --------------------------------------------------------------------------------------------

_TEXT_SUFFIXES = (*_CLASSIFICATION_SUFFIXES, ".txt", ".txt.gz")


def _read_text_file(path: Path, text_column: str, group_column: str | None) -> dict[str, list]:
    """The documents of one file: a ``.txt[.gz]`` file holds one per line, a ``.jsonl[.gz]`` /
    ``.csv[.gz]`` file one per row (its ``text_column``, and ``group_column`` when the file has it)."""
    if path.name.lower().endswith(_TEXT_SUFFIXES[-2:]):
        return {"text": _read_lines(path)}
    extra = (group_column,) if group_column and _has_column(path, group_column) else ()
    columns = _read_records(path, text_column, None, extra, (None, None))
    return {"text": columns.pop(text_column), **columns}


def _text_split(columns: dict[str, list], fingerprint: str) -> datasets.Dataset:
    """A ``Dataset`` of the non-empty documents in ``columns``."""
    keep = [i for i, text in enumerate(columns["text"]) if text.strip()]
    table = pa.table({name: pa.array([values[i] for i in keep]) for name, values in columns.items()})
    return _in_memory_dataset(table, datasets.Features.from_arrow_schema(table.schema), fingerprint)


def load_text_dataset(
    path: str | os.PathLike,
    *,
    text_column: str = "text",
    validation_file: str | os.PathLike | None = None,
    validation_size: float | int | None = 0.05,
    seed: int = 42,
    group_column: str | None = None,
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
        group_column: when the training data has this column (``movie`` in the IMDB files), the
            held-out validation documents are whole groups, so no group is on both sides.
        config_name, **hub_kwargs: passed to :func:`datasets.load_dataset` for Hub datasets.

    Empty and whitespace-only documents are dropped (Hub text datasets such as wikitext have many).
    Raises like :func:`load_classification_dataset` for missing files, bad bytes, bad JSON or a
    missing text column, naming the file and line.
    """
    if dataset_source(path) == "local":
        if hub_kwargs or config_name is not None:
            raise ValueError(f"config_name/hub arguments {sorted(hub_kwargs)} only apply to Hub datasets, not to {path}")
        base = Path(path).expanduser()
        files = {"train": base} if base.is_file() else _discover_classification_files(base, _TEXT_SUFFIXES)
        if validation_file is not None:
            if "validation" in files:
                raise ValueError(f"validation_file {validation_file} given, but {base} has a validation file too")
            files["validation"] = Path(validation_file).expanduser()
            if not files["validation"].is_file():
                raise FileNotFoundError(f"Validation file not found: {files['validation']}")
        splits = {
            split: _text_split(_read_text_file(file, text_column, group_column if split == "train" else None),
                               _fingerprint("text", text_column, group_column, _file_identity(file)))
            for split, file in files.items()
        }
    else:
        if validation_file is not None:
            raise ValueError("validation_file only applies to local data")
        name = os.fspath(path)
        splits = {}
        for split, ds in _load_hub(name, config_name, hub_kwargs).items():
            if text_column not in ds.column_names:
                raise ValueError(f"Hub dataset {name!r} split {split!r} has no text column {text_column!r}; its "
                                 f"columns are {ds.column_names} (choose one with --text_column)")
            keep = [text_column, *([group_column] if group_column in ds.column_names and split == "train" else [])]
            ds = ds.select_columns(keep).rename_columns({text_column: "text"} if text_column != "text" else {})
            splits[split] = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    result = _finish(splits, validation_size, seed, None, stratify_column=None, group_column=group_column)
    return datasets.DatasetDict(
        {split: ds.select_columns(["text"]) for split, ds in result.items()}
    )
