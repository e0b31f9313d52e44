"""Folders the library writes and replaces (library side, never shipped).

Every place that deletes or replaces a folder goes through this module:

* :func:`check_output_dir` -- before any work, whether ``output_dir`` may receive a model: never the
  current directory, one of its parents, the home or root directory, an empty path, a file or a path
  under a file; a non-empty folder only with ``overwrite=True`` and only when it holds what we write
  (a model folder), never somebody's other files.
* :func:`replace_atomically` -- move a finished temporary folder into place; at no moment is there
  a half-written folder, and the folder replaced must pass the same guard.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["MODEL_FILES", "check_output_dir", "check_replaceable", "replace_atomically"]

# a folder holding one of these was written by save_pretrained (ours or another library's model folder)
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# what a folder we replace inside a run directory holds (checkpoints and best models)
RUN_FILES = MODEL_FILES + ("training_state.json", "best_state.json", "optimizer.bin")


def _protected(path: Path) -> str | None:
    """Why ``path`` (resolved) must never be deleted, or None."""
    if path == Path(path.anchor):
        return "it is the root directory"
    home = Path.home().resolve()
    if path == home or path in home.parents:
        return "it is the home directory" if path == home else "it contains the home directory"
    cwd = Path.cwd().resolve()
    if path == cwd:
        return "it is the current directory"
    if path in cwd.parents:
        return "it contains the current directory"
    return None


def check_replaceable(folder: str | os.PathLike, *, name: str = "output_dir", expect: tuple[str, ...] = MODEL_FILES) -> None:
    """Raise ``ValueError`` (naming ``name`` and the value) unless ``folder`` may be deleted and
    written anew: not a protected directory (:func:`_protected`), and, when it exists and is not
    empty, a folder holding one of the files in ``expect`` (something we or ``save_pretrained`` wrote)."""
    path = Path(folder).resolve()
    why = _protected(path)
    if why is not None:
        raise ValueError(f"{name}={str(folder)!r} cannot be replaced: {why}; pass a new folder")
    if path.is_dir() and any(path.iterdir()) and not any((path / f).exists() for f in expect):
        raise ValueError(
            f"{name}={str(folder)!r} holds files that are not a saved model (none of {', '.join(expect)}); "
            "refusing to delete them: pass a new or empty folder"
        )


def check_output_dir(output_dir: str | os.PathLike | None, *, overwrite: bool = False, name: str = "output_dir") -> Path:
    """Check, before any work, that a model can later be written to ``output_dir`` (what the
    converter and the scripts call first). Returns the path. ``ValueError`` names the problem:
    an empty path, a file, a path under a file, a protected directory, or a non-empty folder without
    ``overwrite`` (or with it, a folder that does not hold a saved model)."""
    if output_dir is None or str(output_dir).strip() == "":
        raise ValueError(f"{name} is empty ({output_dir!r}): pass the folder to write to")
    path = Path(output_dir)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            what = "is a file" if part == path else f"is under {str(part)!r}, which is a file"
            raise ValueError(f"{name}={str(output_dir)!r} {what}; pass a folder")
    why = _protected(path.resolve())
    if why is not None:
        raise ValueError(f"{name}={str(output_dir)!r} cannot be replaced: {why}; pass a new folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"{name}={str(output_dir)!r} exists and is not empty; pass overwrite=True "
                         "(--overwrite) to replace it, or another folder")
    check_replaceable(path, name=name)  # a non-empty folder must hold a saved model
    return path


def replace_atomically(tmp: Path, final: Path, *, expect: tuple[str, ...] = RUN_FILES) -> None:
    """Move the finished folder ``tmp`` to ``final``, replacing an older ``final``; at no moment is
    there a half-written ``final`` (the old one is renamed away first, then deleted). An existing
    ``final`` must pass :func:`check_replaceable` with ``expect``."""
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        check_replaceable(final, name="folder", expect=expect)
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)
