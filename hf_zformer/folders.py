"""The output-folder guard: which folders the library may write, replace and clean (library side,
never shipped). Every script that writes (the training scripts, the converter, ``evaluate_model.py``,
the benchmark and report scripts) and every place that deletes or replaces a folder goes through
this module.

A folder the library wrote carries a marker file, :data:`MARKER`, listing every file the library
put there (relative paths). Only that list is ever deleted, and only folders carrying the marker are
ever replaced; ``config.json`` or a weight file proves nothing (anybody's folder may hold one).

* :func:`check_output_dir` -- before any work: an output folder is new, empty, or one this library
  wrote; never an empty path, a file, a symbolic link, the current directory or one above it, the
  home or root directory, nor one of the run's inputs (the source model, the teacher) or a folder
  holding one. With ``overwrite`` every file it would delete must be on the marker's list.
* :func:`staging_dir` / :func:`replace_atomically` -- a folder is written into a uniquely named,
  marked staging sibling and renamed into place; the folder it replaces is renamed to a uniquely
  named, marked backup first and deleted file by file once the new one is in place.
* :func:`recover` -- what an interrupted write left: a staging folder is deleted, a backup whose
  folder is missing (killed between the two renames) is renamed back. Nothing without the marker
  is touched (a user's ``.tmp-cache`` or ``.old-notes`` stays).
* :func:`check_output_files` / :func:`record_files` -- a report's files (``<output>.json``, ...):
  no existing file is overwritten that the folder's marker does not list;
* :func:`record` / :func:`recording` -- add files the library wrote to the marker's list;
  :func:`remove_recorded` -- ``--overwrite_output_dir``: delete what the list names, file by file.
* :func:`check_writes` / :func:`writing` -- the library writes only names it owns (:data:`OWNED`),
  never through a link: before any work, a file of such a name that the marker does not list, or a
  link, stops the run, and the folder must take a write; files are written into a marked staging
  folder and moved into place (``config.json`` last), so a failed write (:class:`WriteFailed`: the
  path and the errno) leaves the earlier files and no temporary ones.
* :func:`check_adoptable` / :func:`adopt` -- a run folder of a version without markers is adopted
  only where every file in it has a name the library writes.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import fnmatch
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = [
    "MARKER",
    "OWNED",
    "RUN_FILES",
    "WriteFailed",
    "adopt",
    "check_adoptable",
    "check_output_dir",
    "check_output_files",
    "check_writes",
    "lock_holder",
    "files_under",
    "foreign_files",
    "read_marker",
    "record",
    "record_files",
    "recording",
    "recover",
    "remove_recorded",
    "replace_atomically",
    "staging_dir",
    "writing",
]

#: The marker file of a folder the library wrote: ``{"written_by": "hf_zformer", "files": [...]}``.
MARKER = ".hf_zformer-output.json"
STAGING_PREFIX = ".hf_zformer-staging-"
BACKUP_PREFIX = ".hf_zformer-backup-"

_CODE = sorted(p.name for p in (Path(__file__).parent / "modeling").glob("*.py") if p.name != "__init__.py")
#: The names (``fnmatch`` patterns of one path component) of every file and folder the library
#: writes into an output folder or a checkpoint: a saved model (its code files among them), its
#: tokenizer, a run's records, checkpoints and lock file, an evaluation's predictions and results.
OWNED = (
    "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json", *_CODE,
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "chat_template.jinja",
    "README.md", "training_args.json", "all_results.json", "eval_history.jsonl", ".lock", "best", "step_*",
    "epoch_*", "training_state.json", "best_state.json", "optimizer*.bin", "scheduler*.bin", "sampler*.bin",
    "random_states_*.pkl", "scaler.pt", "custom_checkpoint_*.pkl", "dl_state_dict*.bin",
    "*_predictions.jsonl", "*_results.json", "run_args.json", "results.json", "transfer_state.*",
    "finetune_state.*", "transferred", "finetuned", "trials.jsonl", "summary.json",
)


#: What a training run writes into its output folder (:data:`OWNED` but an evaluation's files): a
#: file of the user's under one of these names stops the run before any work.
RUN_FILES = tuple(name for name in OWNED if name not in ("*_predictions.jsonl", "*_results.json")) + (
    "all_results.json",)


def owned(name: str) -> bool:
    """Whether every component of the relative path ``name`` is a name of :data:`OWNED`."""
    return all(any(fnmatch.fnmatchcase(part, pattern) for pattern in OWNED) for part in Path(name).parts)


# ---- the marker ------------------------------------------------------------------------------

def read_marker(folder: str | os.PathLike) -> dict | None:
    """The marker of ``folder``, or None when it has none (or one that is not ours)."""
    path = Path(folder) / MARKER
    if path.is_symlink() or not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("written_by") != "hf_zformer" or not isinstance(marker.get("files"), list):
        return None
    return marker


def _write_marker(folder: Path, files, **extra) -> None:
    """Write the marker through a new temporary file of a unique name (created exclusively, so
    neither a file of the user's nor a link is ever written), then rename it into place."""
    marker = {"written_by": "hf_zformer", **extra, "files": sorted(set(files))}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{MARKER}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(marker, indent=1) + "\n")
        os.replace(tmp, folder / MARKER)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _ours(name: str, path: Path) -> bool:
    """Whether ``path`` (named ``name``) is a staging or backup folder of this library."""
    return name.startswith((STAGING_PREFIX, BACKUP_PREFIX)) and not path.is_symlink() and read_marker(path) is not None


def files_under(folder: str | os.PathLike) -> set[str]:
    """Relative paths of the files (and links) under ``folder``, without its own marker and the
    library's staging and backup folders; links to folders are not followed."""
    root = Path(folder)
    found = set()
    for current, dirs, files in os.walk(root):
        here = Path(current)
        for name in list(dirs):
            if (here / name).is_symlink():
                dirs.remove(name)
                files.append(name)
            elif here == root and _ours(name, here / name):
                dirs.remove(name)
        found.update((here / name).relative_to(root).as_posix() for name in files)
    found.discard(MARKER)
    return found


def record(folder: str | os.PathLike, *names: str) -> None:
    """Add ``names`` (paths relative to ``folder``; a folder stands for every file under it) to the
    marker's list of ``folder`` (created when missing)."""
    folder = Path(folder)
    marker = read_marker(folder) or {}
    files = set(marker.get("files", []))
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            inside = files_under(path) | ({MARKER} if (path / MARKER).is_file() else set())
            files.update(f"{Path(name).as_posix()}/{f}" for f in inside)
        elif path.exists() or path.is_symlink():
            files.add(Path(name).as_posix())
    files = {f for f in files if (folder / f).exists() or (folder / f).is_symlink()}  # gone with a replacement
    _write_marker(folder, files, **{k: v for k, v in marker.items() if k not in ("written_by", "files")})


def check_adoptable(folder: str | os.PathLike, names) -> None:
    """``ValueError`` unless :func:`adopt` may claim ``names`` of ``folder``: each is (or holds
    only) files with names the library writes (:data:`OWNED`), and none is a link."""
    folder = Path(folder)
    for name in names:
        path = folder / name
        inside = files_under(path) if path.is_dir() and not path.is_symlink() else {""}
        for file in sorted(inside):
            relative = f"{name}/{file}" if file else name
            if (folder / relative).is_symlink() or not owned(relative):
                what = "a link" if (folder / relative).is_symlink() else "not a file this library writes"
                raise ValueError(f"{str(folder)!r} has no {MARKER} (written by an earlier version), and "
                                 f"{relative} in it is {what}: the library would take it for its own and delete "
                                 "it later; move it out of the folder, then resume")


def adopt(folder: str | os.PathLike, names) -> None:
    """Mark the subfolders ``names`` of ``folder`` (and the files among ``names``) as the library's:
    a run folder written by a version whose folders carried no marker, which the user resumes.
    ``ValueError`` (nothing marked) unless they hold only what the library writes (:func:`check_adoptable`)."""
    folder = Path(folder)
    check_adoptable(folder, names)
    for name in names:
        sub = folder / name
        if sub.is_dir() and not sub.is_symlink() and read_marker(sub) is None:
            _write_marker(sub, files_under(sub))
    record(folder, *names)


def _stamps(folder: Path) -> dict[str, tuple]:
    result = {}
    for name in files_under(folder):
        with contextlib.suppress(OSError):
            stat = (folder / name).lstat()
            result[name] = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    return result


@contextlib.contextmanager
def recording(folder: str | os.PathLike) -> Iterator[None]:
    """Record every file of ``folder`` that the block creates or rewrites (e.g. ``save_pretrained``
    into a run folder), also when the block fails part-way."""
    folder = Path(folder)
    before = _stamps(folder) if folder.is_dir() else {}
    try:
        yield
    finally:
        if folder.is_dir():
            after = _stamps(folder)
            record(folder, *(name for name, stamp in after.items() if before.get(name) != stamp))


# ---- the guard -------------------------------------------------------------------------------

def _protected(path: Path) -> str | None:
    """Why ``path`` (resolved) must never be an output folder, or None."""
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


def _names(paths, limit: int = 4) -> str:
    paths = sorted(paths)
    return ", ".join(paths[:limit]) + (f", ... ({len(paths)} in all)" if len(paths) > limit else "")


def foreign_files(folder: str | os.PathLike) -> set[str]:
    """Files under ``folder`` that are not on its marker's list (all of them without a marker), and
    the links under it: the library never writes a link, so a link is somebody else's whatever
    its name (a listed file replaced by a link to a file outside)."""
    marker = read_marker(folder)
    found = files_under(folder)
    return (found - set(marker["files"] if marker else [])) | {f for f in found if (Path(folder) / f).is_symlink()}


def check_output_dir(
    output_dir: str | os.PathLike | None,
    *,
    overwrite: bool = False,
    name: str = "output_dir",
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
    whole: bool = True,
    resume: bool = False,
) -> Path:
    """Check, before any work, that the library may write to ``output_dir``; returns the path
    (``~`` expanded). Raises ``ValueError`` naming ``name``, the value and the reason.

    Refused: an empty path; a file or a path under a file; a symbolic link; the root, home or
    current directory or a folder above one of them; one of ``inputs`` (``{"--flag": path}``: the
    source model, the teacher, ...) or a folder holding one; a non-empty folder without the
    library's marker (somebody's files, whatever they are). ``whole`` (the converter): the folder is
    replaced as a whole, so a non-empty one needs ``overwrite`` and must hold only files the library
    wrote. Otherwise (a training run, an evaluation) files are written into it; with ``overwrite``
    (which deletes) or ``resume`` (which replaces checkpoints and ``best/``) every subfolder holding
    recorded files must hold nothing else, no link either; ``resume`` (a run resumed in its own
    folder) also accepts a run folder of a version whose
    folders carried no marker."""
    if output_dir is None or str(output_dir).strip() == "":
        raise ValueError(f"{name} is empty ({output_dir!r}): pass the folder to write to")
    shown = str(output_dir)
    path = Path(output_dir).expanduser()
    for part in (path, *path.parents):
        if part.is_symlink() and part == path:
            raise ValueError(f"{name}={shown!r} is a symbolic link (to {os.readlink(path)!r}); pass the folder itself")
        if part.exists() and not part.is_dir():
            what = "is a file" if part == path else f"is under {str(part)!r}, which is a file"
            raise ValueError(f"{name}={shown!r} {what}; pass a folder")
    resolved = path.resolve()
    why = _protected(resolved)
    if why is not None:
        raise ValueError(f"{name}={shown!r} cannot be written to: {why}; pass a new folder")
    for flag, value in (inputs or {}).items():
        if not value or not Path(value).expanduser().exists():
            continue  # a Hub id, or nothing given
        source = Path(value).expanduser().resolve()
        if source == resolved or resolved in source.parents:
            what = "is" if source == resolved else "contains"
            raise ValueError(f"{name}={shown!r} {what} {flag} {str(value)!r}: the run would write over what it reads; "
                             "pass another folder")
    if not path.is_dir() or not files_under(path):
        return path
    marker = read_marker(path)
    if marker is None and resume and not whole and not overwrite:
        return path
    if marker is None:
        raise ValueError(f"{name}={shown!r} holds files this library did not write ({_names(files_under(path))}; "
                         f"no {MARKER}); refusing to write into it: pass a new or empty folder")
    foreign = foreign_files(path)
    if whole:
        if not overwrite:
            raise ValueError(f"{name}={shown!r} exists and is not empty; pass overwrite=True (--overwrite) to "
                             "replace it, or another folder")
        if foreign:
            raise ValueError(f"{name}={shown!r} holds files this library did not write ({_names(foreign)}); "
                             "replacing the folder would delete them: move them out, or pass another folder")
    elif overwrite or resume:
        cleared = {str(Path(f).parent) for f in marker["files"] if "/" in f}
        blocking = {f for f in foreign if any(f.startswith(d + "/") for d in cleared)}
        if blocking:
            what = "an overwrite clears" if overwrite else "a resumed run replaces"
            raise ValueError(f"{name}={shown!r} holds files this library did not write (or links) in folders "
                             f"{what} ({_names(blocking)}); move them out, or pass another folder")
    return path


def check_output_files(paths, *, name: str = "--output") -> list[Path]:
    """Check, before any work, that the library may write the report files ``paths`` (a benchmark's
    ``<output>.json``, ``.md``, ...; one folder, which the user named with them): each file that
    exists is one the folder's marker lists, so a file of somebody else's is never overwritten,
    while a report written before is replaced. Returns the paths (``~`` expanded);
    :func:`record_files` lists them in the marker once written."""
    paths = [Path(p).expanduser() for p in paths]
    folder = paths[0].parent
    shown = f"{name} {str(paths[0].with_suffix(''))!r}"
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{shown}: {str(folder)!r} is a file, not a folder")
    listed = set((read_marker(folder) or {}).get("files", [])) if folder.is_dir() else set()
    theirs = [p.name for p in paths if (p.exists() or p.is_symlink()) and p.name not in listed]
    if theirs:
        raise ValueError(f"{shown} would overwrite {_names(theirs)} in {str(folder) or '.'!r}, which this library "
                         f"did not write (not on the list of its {MARKER}); pass another {name}")
    return paths


def record_files(paths) -> None:
    """Mark report files just written (:func:`check_output_files`) as the library's."""
    paths = [Path(p) for p in paths if Path(p).exists()]
    if paths:
        record(paths[0].parent, *(p.name for p in paths))


# ---- writing, replacing, recovering ------------------------------------------------------------

class WriteFailed(OSError):
    """A write the system refused (the disk full, a read-only folder, a file-size limit): the
    message names the path and the errno; what was there before is unchanged."""

    def __init__(self, error: OSError, path: str | os.PathLike):
        code = errnos.errorcode.get(error.errno, "?") if error.errno is not None else "?"
        super().__init__(error.errno, f"cannot write {path}: {error.strerror or error} ({code}, errno {error.errno})")
        self.filename = str(path)

    def __str__(self) -> str:
        return self.strerror


def _writable(folder: Path) -> None:
    """Raise :class:`WriteFailed` unless a file can be written in ``folder`` (or, while it does not
    exist yet, in the nearest folder above it): a one-byte probe, removed at once."""
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == Path(p.anchor))
    probe = existing / f"{STAGING_PREFIX}probe{_suffix()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        raise WriteFailed(error, existing) from None


def check_writes(folder: str | os.PathLike, names, *, name: str = "--output_dir", listed=()) -> None:
    """Before any work: ``ValueError`` when ``folder`` holds, under one of ``names`` (``fnmatch``
    patterns of the files and folders the run will write there), a link, or an entry the folder's
    marker does not list (nor ``listed``: what a resumed run is about to adopt), i.e. somebody
    else's file the write would replace; :class:`WriteFailed` when ``folder`` takes no write."""
    folder = Path(folder)
    _writable(folder)
    if not folder.is_dir():
        return
    ours = set((read_marker(folder) or {}).get("files", [])) | set(listed)
    tops = {f.split("/", 1)[0] for f in ours}
    links, theirs = [], []
    for entry in sorted(os.listdir(folder)):
        if entry == MARKER or not any(fnmatch.fnmatchcase(entry, pattern) for pattern in names):
            continue
        if (folder / entry).is_symlink():
            links.append(entry)
        elif entry not in tops:
            theirs.append(entry)
    if links:
        raise ValueError(f"{name}={str(folder)!r}: {_names(links)} is a symbolic link; the library never writes "
                         "through a link (nor replaces one): remove it, or pass another folder")
    if theirs:
        raise ValueError(f"{name}={str(folder)!r} holds {_names(theirs)}, which this run would write but this "
                         f"library did not write (not on the list of its {MARKER}); move it out, or pass another "
                         "folder")


def _move_in(staging: Path, folder: Path) -> list[str]:
    """Move the files of ``staging`` into ``folder`` (``config.json`` last: a folder is never a
    model before its weights are in place); each target is new, or a plain file of the library's."""
    names = sorted(os.listdir(staging), key=lambda n: (n == "config.json", n))
    names = [n for n in names if n != MARKER]
    check_writes(folder, names, name=str(folder))
    for entry in names:
        os.replace(staging / entry, folder / entry)
    return names


@contextlib.contextmanager
def writing(folder: str | os.PathLike, *, staging: str | os.PathLike | None = None) -> Iterator[Path]:
    """Write files into ``folder`` as a whole: the block writes them into the path it is given, a
    marked staging folder in ``folder`` (or ``staging``, one of :func:`staging_dir` there); when it
    ends they are moved into place (:func:`_move_in`) and recorded in the marker. When the block or
    the move fails, the staging folder is removed, the files already in ``folder`` are those of
    before, and an ``OSError`` is raised as :class:`WriteFailed`."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        stage = Path(staging) if staging is not None else staging_dir(folder, "files")
    except OSError as error:
        raise WriteFailed(error, folder) from None
    try:
        yield stage
        record(folder, *_move_in(stage, folder))
    except OSError as error:
        if isinstance(error, WriteFailed):
            raise
        written = [str(f) for f in (error.filename2, error.filename) if f and stage.as_posix() in str(f)]  # (a copy's
        target = folder / Path(written[0]).relative_to(stage) if written else folder  # source is error.filename)
        raise WriteFailed(error, target) from None
    finally:
        discard(stage)


def _suffix() -> str:
    """What makes a staging or backup folder's name unique: ``-`` and 12 random hex digits."""
    return f"-{uuid.uuid4().hex[:12]}"


_HELD: dict[str, int] = {}  # staging folder -> an open descriptor of it, locked while this process writes it


def _hold(staging: Path) -> None:
    """Lock ``staging`` (``flock`` on the folder) while this process writes it: :func:`recover`
    run by another process (a second converter into the same folder) leaves it alone."""
    with contextlib.suppress(ImportError, OSError):
        import fcntl

        fd = os.open(staging, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _HELD[str(staging)] = fd


def _let_go(staging: Path) -> None:
    """Release the lock :func:`_hold` took (the folder was moved into place or abandoned)."""
    fd = _HELD.pop(str(staging), None)
    if fd is not None:
        os.close(fd)


def _in_use(folder: Path) -> bool:
    """Whether another writer holds ``folder`` (:func:`_hold`); a staging folder whose writer died is not."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def lock_holder(path: str | os.PathLike) -> str | None:
    """The pid written in the lock file ``path`` while another process holds it (``flock``), else None."""
    path = Path(path)
    if not path.is_file() or path.is_symlink() or not _in_use(path):
        return None
    with contextlib.suppress(OSError):
        return path.read_text().strip() or "unknown"
    return "unknown"


def discard(staging: str | os.PathLike) -> None:
    """Remove a staging folder of :func:`staging_dir` that will not be moved into place."""
    _let_go(Path(staging))
    shutil.rmtree(staging, ignore_errors=True)  # everything in it is ours by construction


def staging_dir(parent: str | os.PathLike, target: str) -> Path:
    """A new, uniquely named staging folder in ``parent`` for what becomes ``parent/target``,
    marked as the library's (so an interrupted write is recognised and removed, and nothing else)
    and locked while this process writes it (:func:`recover` elsewhere leaves it alone)."""
    parent = Path(parent)
    staging = parent / f"{STAGING_PREFIX}{target}{_suffix()}"
    staging.mkdir()
    try:
        _write_marker(staging, [])
    except BaseException:  # the disk full or a read-only folder: no unmarked staging folder is left
        with contextlib.suppress(OSError):
            staging.rmdir()
        raise
    _hold(staging)
    return staging


def replace_atomically(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the finished ``staging`` folder (from :func:`staging_dir`) to ``final``; at no moment is
    there a half-written ``final``. An existing ``final`` must be the library's, holding only files
    it recorded (``ValueError`` otherwise); it is renamed to a marked backup first and deleted after
    the new one is in place (a run killed in between leaves the backup, which :func:`recover`
    renames back)."""
    staging, final = Path(staging), Path(final)
    backup = None
    if final.is_symlink() or final.exists():
        if final.is_symlink() or not final.is_dir():
            raise ValueError(f"{str(final)!r} is not a folder the library wrote (a link or a file); not replacing it")
        marker = read_marker(final)
        foreign = foreign_files(final) if marker is not None else files_under(final)
        if marker is None or foreign:
            why = f"files it did not write ({_names(foreign)})" if foreign else f"no {MARKER}"
            raise ValueError(f"{str(final)!r} holds {why}; refusing to replace it")
        backup = final.with_name(f"{BACKUP_PREFIX}{final.name}{_suffix()}")
        os.replace(final, backup)
    try:
        _write_marker(staging, files_under(staging))
        os.replace(staging, final)
    finally:
        _let_go(staging)
    if backup is not None:
        remove_recorded(backup, remove_folder=True)


def _inside(folder: Path, name: str) -> bool:
    """Whether the recorded ``name`` lies in ``folder`` (no absolute path, no ``..``, no link
    leading out): a damaged or edited marker never makes a file elsewhere deletable."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        return False
    top, where = folder.resolve(), (folder / relative).parent.resolve()
    return where == top or top in where.parents


def remove_recorded(folder: str | os.PathLike, *, remove_folder: bool = False, keep=(), logger=None) -> list[str]:
    """Delete the files on ``folder``'s marker list, one by one (but those in ``keep``), then the
    folders this leaves empty (and, with ``remove_folder``, ``folder`` itself with its marker when
    nothing else is left). A file not on the list is never deleted. Returns the paths deleted."""
    folder = Path(folder)
    marker = read_marker(folder)
    if marker is None:
        return []
    removed = []
    for name in sorted(marker["files"], key=lambda n: (-n.count("/"), n)):
        path = folder / name
        if name not in keep and _inside(folder, name) and (path.is_symlink() or path.is_file()):
            path.unlink()
            removed.append(name)
    for sub in sorted({Path(n).parent for n in removed if "/" in n}, key=lambda p: -len(p.parts)):
        for level in (sub, *sub.parents):
            with contextlib.suppress(OSError):
                if level != Path("."):
                    (folder / level).rmdir()  # only an empty folder goes
    if logger is not None and removed:
        logger.warning(f"deleted {len(removed)} files an earlier run wrote in {folder} ({_names(removed)})")
    if remove_folder and not files_under(folder):
        with contextlib.suppress(OSError):
            (folder / MARKER).unlink()
            folder.rmdir()
    else:
        _write_marker(folder, [f for f in marker["files"] if f not in removed and (folder / f).exists()],
                      **{k: v for k, v in marker.items() if k not in ("written_by", "files")})
    return removed


def recover(parent: str | os.PathLike, target: str | None = None, logger=None) -> None:
    """Undo what an interrupted write left in ``parent`` (only for ``target`` when given): a marked
    staging folder is deleted; a marked backup is renamed back when its folder is missing (the
    write was killed between its two renames), and deleted when the library's new folder is in
    place. Folders without the marker are never touched."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        if not _ours(entry.name, entry):
            continue
        staging = entry.name.startswith(STAGING_PREFIX)
        of = entry.name[len(STAGING_PREFIX if staging else BACKUP_PREFIX):-len(_suffix())]  # the folder it was for
        if not of or (target is not None and of != target):
            continue
        if staging and _in_use(entry):
            action = "kept: a running process is writing it"
        elif staging:
            shutil.rmtree(entry)  # a staging folder: everything in it is ours by construction
            action = "removed"
        else:
            final = parent / of
            if not final.exists() and not final.is_symlink():
                os.replace(entry, final)
                action = f"restored as {final}"
            elif read_marker(final) is not None:
                remove_recorded(entry, remove_folder=True)
                action = "removed (its replacement is in place)"
            else:
                action = f"kept: {final} is not a folder this library wrote"
        if logger is not None:
            logger.warning(f"{entry} of an interrupted write: {action}")
