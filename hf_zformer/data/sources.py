"""Where a dataset comes from: a local path or the Hugging Face Hub.

:func:`dataset_source` decides between the two; :func:`hub_unreachable` tells at once when the Hub
cannot be reached (instead of ``datasets.load_dataset`` retrying for half a minute); ``load_hub``
loads a Hub dataset and keeps its splits under the canonical names (:data:`.splits.SPLIT_ALIASES`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import datasets

from .splits import CANONICAL_SPLITS, SPLIT_ALIASES


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_LOCAL_SUFFIX = re.compile(r"\.(gz|jsonl|json|csv|tsv|txt|parquet|arrow)$", re.IGNORECASE)


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
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")


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
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    return None


def load_hub(path: str, config_name: str | None, hub_kwargs: dict[str, Any]) -> datasets.DatasetDict:
    not_here = f"{path!r} is not an existing local path, so it was taken for a Hugging Face Hub dataset id"
    local_copy = ("Without network, pass a local copy of the data with --data_dir DIR (the layout is in "
                  "docs/data.md)")
    reason = hub_unreachable()
    if reason is not None:
        raise ConnectionError(
            f"{not_here}, but the Hub cannot be reached ({reason}). {local_copy}; to use a copy already in "
            "the datasets cache, set HF_DATASETS_OFFLINE=1."
        )
    try:
        loaded = datasets.load_dataset(path, config_name, **hub_kwargs)
    except ConnectionError as err:  # offline mode without a cached copy, or the Hub failing mid-way
        raise ConnectionError(f"{not_here}, but it could not be loaded ({err}). {local_copy}.") from err
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
            f"Hub dataset {path!r} has none of the splits {list(CANONICAL_SPLITS)} "
            f"(or their aliases); it has {list(loaded)}."
        )
    return datasets.DatasetDict(splits)
