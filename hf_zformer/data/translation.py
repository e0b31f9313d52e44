"""Parallel corpora: :func:`load_translation_dataset`.

A local folder of line-aligned ``<stem>.<lang>[.gz]`` files or a Hub dataset (language columns or
a ``translation`` column) becomes a ``DatasetDict`` with one column ``translation`` of
``{source_lang: str, target_lang: str}`` dicts (feature :class:`datasets.Translation`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from .files import (
    ambiguous_split,
    file_identity,
    find_file,
    cheap_fingerprint,
    in_memory_dataset,
    read_lines,
    require_train,
)
from .sources import load_hub, dataset_source
from .splits import SPLIT_ALIASES, finish_splits


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
            raise ambiguous_split(split, directory, f"stems {by_split[split]!r} and {stem!r}")
        by_split[split] = stem
    require_train(by_split, directory, f"files train.{source_lang}[.gz]")
    return by_split


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
            found = find_file(base)
            if found is None:
                raise FileNotFoundError(f"Split {split!r}: missing file {base} (or {base}.gz)")
            paths[lang] = found
            texts[lang] = read_lines(found)
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
        fingerprint = cheap_fingerprint(
            "translation", source_lang, target_lang, *(file_identity(paths[lang]) for lang in paths)
        )
        splits[split] = in_memory_dataset(pa.table({"translation": column}), features, fingerprint)
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
        splits = _hub_translation(load_hub(name, config_name, hub_kwargs), name, source_lang, target_lang)
    return finish_splits(splits, validation_size, seed, max_samples, stratify_column=None)
