"""Replace the checkpoint in a model folder so that the folder always holds the old checkpoint or the new one.

`replace_checkpoint(out)` hands out a staging folder *beside* `out` (same filesystem, hidden name); the caller writes
the new checkpoint there. Then what `out` holds that is not a checkpoint file (training `checkpoint-*` folders, logs, a
README the user wrote) is hard-linked into the staging folder, and the two folders trade places in one atomic
`renameat2(RENAME_EXCHANGE)`. A save killed at any point therefore leaves `out` as it was or as it became, never a mix;
files of the earlier checkpoint that the new one does not write (adapters, other shards, `pytorch_model*.bin`) are
gone with the old folder.

Where the filesystem cannot exchange two folders (NFS, non-Linux), `out` is renamed aside and the new folder renamed
in; a save killed between those two renames leaves the old folder aside, and the next save (or
`remove_leftovers(out)`) puts it back. Where `out` cannot be renamed at all (a mount point), files are replaced one by
one, `config.json` first out and last in, so a partial folder never looks like a model; a warning says so.

Each save holds an advisory lock (`fcntl.flock`) beside `out` while it runs; folders of saves whose lock is free (the
process died) are removed, or restored, before the next save starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import functools
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: leftovers of other processes are kept
    fcntl = None

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_FILE_PATTERNS",
    "drop_checkpoint_entries",
    "holds_a_model",
    "is_checkpoint_entry",
    "output_overwrites_model",
    "remove_leftovers",
    "replace_checkpoint",
    "unwritable",
]

# Files that belong to a saved model (weights, configs, tokenizer, adapters): a new save replaces all of them.
CHECKPOINT_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "adapter_config.json",
    "adapter_model.*",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)
CHECKPOINT_FOLDERS = ("bf16_master",)  # written by FP8GRPOTrainer(save_bf16_master_weights=True)
LEGACY_TEMP_PATTERN = ".tmp-fp8-save-*"  # trl-fp8 0.1 wrote its temporary files inside the output folder
_TAG = "trl-fp8"

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _stem_prefix(out: Path) -> str:
    return f".{out.name}.{_TAG}-"


def is_checkpoint_entry(name: str, code_files: set[str] = frozenset()) -> bool:
    """Whether a top-level entry of a model folder belongs to its checkpoint (and so is replaced by a new save)."""
    return (
        name in CHECKPOINT_FOLDERS
        or name in code_files
        or any(fnmatch.fnmatch(name, pattern) for pattern in CHECKPOINT_FILE_PATTERNS)
    )


def _code_files(folder: Path) -> set[str]:
    """The `.py` files the folder's `config.json` names in its `auto_map` (a custom-code model's own code)."""
    try:
        auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError):
        return set()
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, list | tuple) else [v]) if isinstance(r, str)]
    return {ref.split("--")[-1].rsplit(".", 1)[0] + ".py" for ref in refs}


def holds_a_model(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a saved model or adapter (anything a new checkpoint there would replace)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    codes = _code_files(folder)
    return any(is_checkpoint_entry(p.name, codes) and p.name not in ("training_args.bin",) for p in folder.iterdir())


def output_overwrites_model(model_dir: str | os.PathLike | None, output_dir: str | os.PathLike) -> str | None:
    """Why saving to `output_dir` would write into the model folder `model_dir` it was loaded from, or None.

    Paths are compared resolved (symbolic links, `..`), so another spelling of the same folder is caught, and so is
    a folder inside the model's: a checkpoint or a run's files written there change the model folder the user has.
    """
    if model_dir is None or not Path(model_dir).expanduser().is_dir():
        return None  # a Hub id or a model built in memory: no folder of the user's to protect
    source = Path(os.path.realpath(Path(model_dir).expanduser()))
    out = Path(os.path.realpath(Path(output_dir).expanduser()))
    if out == source:
        return f"{output_dir} is the input model's own folder ({source}): saving there would replace its weights."
    if source in out.parents:
        return f"{output_dir} is inside the input model's folder ({source}): saving there would change that folder."
    return None


def unwritable(out: str | os.PathLike, *, beside: bool) -> str | None:
    """Why a save to the folder `out` would fail, or None: it is a file, or a folder the save writes in does not
    take new files (a read-only filesystem, permissions). Those folders: `out` if it exists, else the nearest folder
    above it that does (the save creates the rest); with `beside`, also the folder `out` is in, where
    `replace_checkpoint` writes the new checkpoint first.

    Each is probed by creating and removing an empty file, as the save would: a read-only mount answers EROFS to
    root too, where permission bits (and `os.access`) do not."""
    out = Path(os.path.realpath(Path(out).expanduser()))
    if out.exists() and not out.is_dir():
        return f"{out} is a file"
    nearest = out
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        return f"{nearest} is a file, so no folder can be created in it"
    probes = [(nearest, "")]
    if beside and nearest == out:
        probes.append((out.parent, f"the checkpoint is written beside it first, in {out.parent}, and "))
    for folder, where in probes:
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{_TAG}-write-probe-")
        except OSError as exc:
            return f"{where}{folder} does not take new files ({exc.strerror or exc})"
        os.close(fd)
        os.unlink(probe)
    return None


@contextlib.contextmanager
def replace_checkpoint(out: str | os.PathLike, *, before_swap: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield an empty staging folder beside `out`; when the block ends without an exception, the staging folder
    (plus every non-checkpoint entry `out` held) becomes `out` in one atomic step, and the old folder is deleted.

    Args:
        out: the model folder; created if missing. A symbolic link is followed (the folder it points to is
            replaced).
        before_swap: called right before the swap, e.g. to wait for an upload of `out` that is in flight.

    On an exception the staging folder is removed and `out` is left exactly as it was.
    """
    out = Path(os.path.realpath(out))
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file; a checkpoint is written to a folder. Pass a folder path.")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    stem = out.parent / f"{_stem_prefix(out)}{os.getpid()}-{secrets.token_hex(4)}"
    lock = _Lock(stem.with_name(stem.name + ".lock"))
    staging = stem.with_name(stem.name + ".new")
    try:
        staging.mkdir()
        yield staging
        carried = _carry_over(out, staging)
        if before_swap is not None:
            before_swap()
        _swap_in(staging, out, stem.with_name(stem.name + ".old"), carried)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()


def remove_leftovers(out: str | os.PathLike) -> None:
    """Remove what killed saves left beside `out` (or inside it, from trl-fp8 0.1); if one was killed between
    moving the old folder aside and moving the new one in, put the old folder back first."""
    out = Path(os.path.realpath(out))
    if not out.parent.is_dir():
        return
    prefix = _stem_prefix(out)
    stems = {p.name.rsplit(".", 1)[0] for p in out.parent.iterdir() if p.name.startswith(prefix)}
    for name in sorted(stems):
        stem = out.parent / name
        lock_path = stem.with_name(name + ".lock")
        lock = _Lock.take_if_free(lock_path)
        if lock is None:
            continue  # a save in progress in another process
        try:
            old = stem.with_name(name + ".old")
            if old.is_dir() and not out.exists():
                os.rename(old, out)
                logger.warning("Restored %s: a save there was interrupted after moving the old checkpoint aside.", out)
            for suffix in (".old", ".new"):
                shutil.rmtree(stem.with_name(name + suffix), ignore_errors=True)
        finally:
            lock.release()
    if out.is_dir():
        for legacy in out.glob(LEGACY_TEMP_PATTERN):
            shutil.rmtree(legacy, ignore_errors=True)


def _carry_over(out: Path, staging: Path) -> set[str]:
    """Hard-link into `staging` every entry of `out` that is not part of its checkpoint and that the new save did
    not write (copying where hard links are not possible); return their names."""
    if not out.is_dir():
        return set()
    codes, carried = _code_files(out), set()
    for entry in out.iterdir():
        target = staging / entry.name
        if is_checkpoint_entry(entry.name, codes) or target.exists() or target.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target)
        carried.add(entry.name)
    return carried


def _link_or_copy(src, dst) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _swap_in(staging: Path, out: Path, old: Path, carried: set[str]) -> None:
    if out.exists():
        mode = out.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o777 & ~umask
    os.chmod(staging, mode)  # mkdir's default, not the temporary 0700
    if not out.exists():
        os.rename(staging, out)
        return
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # the old folder, now at the staging path
        return
    try:
        os.rename(out, old)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES):
            raise
        logger.warning(
            "%s cannot be renamed (%s), so its checkpoint is replaced file by file: a save killed now could leave "
            "it without config.json (it would not load, and no loader would take it for a model).",
            out, exc.strerror,
        )  # fmt: skip
        _replace_files_in_place(staging, out, carried)
        return
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (Linux `renameat2(RENAME_EXCHANGE)`); False where the system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EBUSY, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        return None


def _replace_files_in_place(staging: Path, out: Path, carried: set[str]) -> None:
    """The last resort: move the new files in one by one, `config.json` removed first and written last."""
    codes = _code_files(out)
    (out / "config.json").unlink(missing_ok=True)
    new = sorted((p for p in staging.iterdir() if p.name not in carried), key=lambda p: p.name == "config.json")
    new_names = {p.name for p in new}
    for entry in list(out.iterdir()):
        if entry.name in new_names or is_checkpoint_entry(entry.name, codes):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for entry in new:
        shutil.move(str(entry), str(out / entry.name))


class _Lock:
    """An exclusive `flock` on a file beside the output folder, held for the whole save."""

    def __init__(self, path: Path, fd: int | None = None):
        self.path = path
        if fd is None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd

    @classmethod
    def take_if_free(cls, path: Path) -> _Lock | None:
        """The lock of a save whose process is gone (or that never created its lock file), else None."""
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)  # folders without a lock file: orphans
        if fcntl is None:
            os.close(fd)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return cls(path, fd)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # while still locked: nobody can take a lock on a file about to vanish
        os.close(self.fd)
        self.fd = None


def drop_checkpoint_entries(out: str | os.PathLike, keep: set[str]) -> list[str]:
    """Remove the checkpoint entries of `out` whose names are not in `keep`; return the names removed.

    For writers that replace a checkpoint file by file (transformers' Hub push from a training checkpoint): whatever
    they do not overwrite would otherwise stay behind and mix two models in one folder.
    """
    out = Path(out)
    if not out.is_dir():
        return []
    codes, removed = _code_files(out), []
    for entry in sorted(out.iterdir()):
        if is_checkpoint_entry(entry.name, codes) and entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
    return removed
