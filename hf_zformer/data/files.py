"""Reading local data files, and what the loaders build from them.

Text files (plain or ``.gz``, UTF-8) with errors that name the file and line, the split files of a
local folder (``find_file``, ``ambiguous_split``, ``require_train``), cheap deterministic dataset
fingerprints and in-memory :class:`datasets.Dataset` objects built from Arrow tables.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


#: What reading a file raises for bytes that are not UTF-8 or a truncated/corrupt ``.gz`` file.
_UNREADABLE = (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error)


@contextlib.contextmanager
def reading(path: Path) -> Iterator[io.TextIOBase]:
    """``path`` open for reading text (:func:`_open_text`); what its bytes cannot give (not UTF-8,
    not gzip, a truncated ``.gz``) raises the ``ValueError`` of :func:`_unreadable`, naming the
    file and the line, wherever in the ``with`` block the reading happens."""
    try:
        with _open_text(path) as handle:
            yield handle
    except _UNREADABLE as error:
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: Exception) -> ValueError:
    """A ``ValueError`` for an :data:`_UNREADABLE` ``error`` that names ``path`` and the line."""
    raw = path.read_bytes()
    if path.suffix == ".gz" and not raw.startswith(b"\x1f\x8b"):  # gzip's magic number
        return ValueError(
            f"{path}: not a gzip file (it starts with {raw[:8]!r}), though its name ends in .gz; compress it "
            f"with gzip, or name it without .gz if it is plain text"
        )
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


def read_lines(path: Path) -> list[str]:
    """One sentence per line; only ``\\n`` (and a ``\\r`` before it) ends a line."""
    with reading(path) as handle:
        content = handle.read()
    if content.startswith("\ufeff"):
        content = content[1:]
    lines = content.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline at the end of the last line
    if not lines:
        raise ValueError(f"Empty file: {path}")
    return [line.strip() for line in lines]


def find_file(base: Path) -> Path | None:
    """``base`` itself or ``base`` + ``.gz``; error when both exist."""
    plain, gz = base, base.with_name(base.name + ".gz")
    if plain.is_file() and gz.is_file():
        raise ValueError(f"Both {plain} and {gz} exist; remove one or pass `split_files`.")
    if plain.is_file():
        return plain
    if gz.is_file():
        return gz
    return None


def cheap_fingerprint(*parts: Any) -> str:
    """A cheap deterministic dataset fingerprint (``datasets`` would otherwise hash all the data)."""
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:16]


def file_identity(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def in_memory_dataset(table: pa.Table, features: datasets.Features, fingerprint: str) -> datasets.Dataset:
    return datasets.Dataset(
        table.cast(features.arrow_schema), info=datasets.DatasetInfo(features=features), fingerprint=fingerprint
    )


def ambiguous_split(split: str, directory: Path, candidates: str) -> ValueError:
    return ValueError(
        f"Files for split {split!r} are ambiguous in {directory}: {candidates}; "
        f"pass split_files={{{split!r}: ...}} to choose."
    )


def require_train(by_split: dict, directory: Path, wanted: str) -> None:
    """A local dataset folder must hold training data: else name what was looked for and what is there."""
    if "train" not in by_split:
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(
            f"No training {wanted} in {directory} (found: {found}); pass `split_files` to name the files."
        )
