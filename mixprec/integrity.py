"""Checkpoints that are whole or refused: atomic files and directories, checksums checked on load.

* A file is written under a temporary name beside it (``.NAME.XXXXXXXX.partial``) and renamed
  into place (:func:`atomic_save`). A checkpoint file carries the SHA-256 of its payload (every
  tensor's bytes and every other value, :func:`digest`) under ``"sha256"`` (:func:`seal`).
* A directory (an FSDP Trainer checkpoint, ``MixprecAccelerator.save_state``, a
  ``MixprecTrainer`` checkpoint) is written by every rank under a temporary name
  (``.NAME.saving`` beside it); when every rank is done, the writing rank records each file's
  size and SHA-256 in :data:`MANIFEST`, written last, and renames the directory into place
  (:func:`save_directory`). A save that fails on any rank fails on every rank, and what was at
  the path stays as it was.

On load, :func:`check_seal` and :func:`verify_directory` refuse content that no longer matches
its checksum, naming the file; the loaders' ``verify=False`` skips the check (for a file edited
on purpose). A directory without a manifest (written by another tool, or by an earlier mixprec)
loads unchecked.

A save that was interrupted (the process killed) leaves its temporary behind: the next save
beside it, and a resume from there, remove those of mixprec's own naming that nothing has
written to for :data:`STALE_AFTER_S` seconds (on the rank that saves; nothing else is touched).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from . import distenv as env

__all__ = ["STALE_AFTER_S", "MANIFEST", "atomic_save", "remove_stale_temporaries", "digest",
           "seal", "check_seal", "save_directory", "write_manifest", "verify_directory",
           "verify_on_ranks"]

#: Seconds without a write after which a temporary checkpoint file is an orphan.
STALE_AFTER_S = 60.0
#: The file in a checkpoint directory that lists the others with their sizes and SHA-256.
MANIFEST = "mixprec-checksums.json"
_MANIFEST_FORMAT = "mixprec.checksums/1"
_SEAL = "sha256"
_TEMP_SUFFIX = ".partial"
# a temporary of atomic_save: "." + name + "." + mkstemp's 8 characters + ".partial" (earlier
# versions wrote no ".partial": only those of checkpoint-like names are taken for theirs)
_TEMP_FILE = re.compile(r"^\..+\.[a-z0-9_]{8}\.partial$|^\..+\.(pt|pth|ckpt)\.[a-z0-9_]{8}$")
_TEMP_DIR = re.compile(r"^\..+\.saving$")   # a checkpoint directory being written


# ----------------------------------------------------------------- temporaries
def remove_stale_temporaries(directory, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the temporaries interrupted saves left in ``directory`` (see the module
    docstring): files and ``.saving`` directories of mixprec's naming not written to for
    ``stale_after_s`` seconds. Returns what was removed; one that cannot be removed is left.
    """
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    now = time.time()
    for entry in directory.iterdir():
        ours = (_TEMP_FILE.match(entry.name) and entry.is_file()
                or _TEMP_DIR.match(entry.name) and entry.is_dir())
        try:
            if not ours or now - _last_write(entry) < stale_after_s:
                continue
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry)
        except OSError:  # gone already, or not ours to remove: leave it
            continue
    return removed


def _last_write(entry: Path) -> float:
    if entry.is_file():
        return entry.stat().st_mtime
    return max([entry.stat().st_mtime, *(p.stat().st_mtime for p in entry.rglob("*"))])


def atomic_save(obj, path) -> None:
    """``torch.save`` to a temporary file next to ``path``, then rename it over ``path``
    (removing stale temporaries of interrupted saves there first)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ----------------------------------------------------------------- a file's payload
def digest(obj) -> str:
    """The SHA-256 of a checkpoint's content: dicts (in their order), lists, tuples, every
    tensor's dtype, shape and bytes, and the ``repr`` of other values. Equal before
    ``torch.save`` and after ``torch.load``: it checks what was loaded, not how it was stored."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{list(t.shape)}".encode())
        # the bytes of a plain tensor (a subclass, DTensor or a low-bit one, counts by dtype and
        # shape only: none reaches a Trainer file, whose model state is plain fp32)
        if type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta":
            t = t.int_repr() if t.is_quantized else t.resolve_conj().resolve_neg()
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}".encode())
        for item in obj:
            _feed(h, item)
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def seal(state: dict) -> dict:
    """``state`` with the :func:`digest` of the rest under ``"sha256"``."""
    rest = {k: v for k, v in state.items() if k != _SEAL}
    return {**rest, _SEAL: digest(rest)}


def check_seal(state: dict, path, *, verify: bool = True, required: bool = True) -> None:
    """Refuse a loaded checkpoint whose content does not match the digest sealed into it.

    Args:
        state: what ``torch.load`` returned.
        path: the file (named in the error).
        verify: False skips the check.
        required: a file without a digest is refused too (else it loads unchecked).

    Raises:
        ValueError: a digest that differs, or none where ``required``.
    """
    if not verify:
        return
    if _SEAL not in state:
        if required:
            raise ValueError(f"checkpoint file {str(path)!r} carries no checksum of its content "
                             f"(damaged, or edited); load it with verify=False only if it was "
                             f"edited on purpose")
        return
    got = digest({k: v for k, v in state.items() if k != _SEAL})
    if got != state[_SEAL]:
        raise ValueError(_damaged(path, got, state[_SEAL], "sealed into it"))


def _damaged(path, got: str, want, where: str) -> str:
    return (f"checkpoint file {str(path)!r} is damaged: the SHA-256 of its content is "
            f"{got[:16]}..., the checksum {where} is {str(want)[:16]}...; load it with "
            f"verify=False only if it was edited on purpose")


# ----------------------------------------------------------------- directories
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory) -> Path:
    """Write :data:`MANIFEST` into ``directory``: every other file below it (relative path,
    size, SHA-256). Returns its path."""
    directory = Path(directory)
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size,
                                                   "sha256": _file_sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    out = directory / MANIFEST
    out.write_text(json.dumps({"format": _MANIFEST_FORMAT, "files": files}, indent=1))
    return out


def verify_directory(directory, *, verify: bool = True) -> bool:
    """Check every file :data:`MANIFEST` lists in ``directory`` (present, same size, same
    SHA-256). Returns whether a manifest was found (False: nothing to check; also with
    ``verify=False``).

    Raises:
        ValueError: a listed file is missing, or its size or SHA-256 differs (the error names
            it); an unreadable manifest.
    """
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not verify or not manifest.is_file():
        return False
    try:
        listed = json.loads(manifest.read_text())
        files = listed["files"] if listed.get("format") == _MANIFEST_FORMAT else None
    except (ValueError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checksum manifest {str(manifest)!r} is damaged ({exc}); load with "
                         f"verify=False only if the checkpoint was edited on purpose") from exc
    if not isinstance(files, dict):
        raise ValueError(f"{str(manifest)!r} is not a mixprec checksum manifest (expected "
                         f"format {_MANIFEST_FORMAT!r})")
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"checkpoint file {str(path)!r} is missing: {str(manifest)!r} "
                             f"lists it; the checkpoint is incomplete")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"checkpoint file {str(path)!r} is damaged: {size} bytes, "
                             f"{entry['bytes']} when it was written; load it with verify=False "
                             f"only if it was edited on purpose")
        got = _file_sha256(path)
        if got != entry["sha256"]:
            raise ValueError(_damaged(path, got, entry["sha256"], f"in {MANIFEST}"))
    return True


def verify_on_ranks(directory, *, verify: bool = True) -> None:
    """:func:`verify_directory` on each machine's first process (``LOCAL_RANK`` 0: the files are
    read once per machine), the outcome shared by every rank of the default process group (a
    collective; one process: no group needed).

    Raises:
        ValueError: on the checking rank, what :func:`verify_directory` raises.
        RuntimeError: on the other ranks, when the check failed on one.
    """
    error = None
    if env.local_rank() == 0:
        error = _attempt(lambda: verify_directory(directory, verify=verify))
    env.agree(error, f"checking checkpoint {str(directory)!r}")


def save_directory(path, write: Callable[[Path], Path | None], *, main: bool | None = None,
                   aside=None) -> Path:
    """Write a checkpoint directory all or nothing, with its :data:`MANIFEST`.

    Every rank of the default process group calls it (one process: no group needed).
    ``write(tmp)`` writes this rank's part into ``tmp`` (``aside``, default ``.NAME.saving``
    beside ``path``, on the same file system; not there yet: the writer creates it) and returns
    the checkpoint directory it wrote (None: ``tmp`` itself; else a directory inside it). When
    every rank is done, the ``main`` rank (default: global rank 0) writes the manifest into it
    and renames it to ``path``, replacing what was there.

    Returns:
        ``path``.

    Raises:
        RuntimeError: the save failed on another rank (every rank raises; what was at ``path``
            is left as it was, the temporary removed).
    """
    path = Path(path)
    tmp = Path(aside) if aside is not None else path.with_name(f".{path.name}.saving")
    main = env.is_main_process() if main is None else main
    env.agree(_attempt(lambda: _fresh(tmp)) if main else None, f"preparing {str(tmp)!r}")
    written: list = [None]
    try:
        env.agree(_attempt(lambda: written.__setitem__(0, write(tmp))),
                  f"saving checkpoint {str(path)!r}")
        error = _attempt(lambda: _move(Path(written[0] or tmp), tmp, path)) if main else None
        env.agree(error, f"moving checkpoint {str(tmp)!r} to {str(path)!r}")
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _attempt(action) -> BaseException | None:
    try:
        action()
    except Exception as exc:  # reported on every rank by agree()
        return exc
    return None


def _fresh(tmp: Path) -> None:
    """No ``tmp`` (the writer creates it, and reports a path it cannot create), and the stale
    temporaries beside it gone."""
    if tmp.exists():
        shutil.rmtree(tmp)
    remove_stale_temporaries(tmp.parent)


def _move(written: Path, tmp: Path, path: Path) -> None:
    """Manifest into ``written``, then ``written`` renamed to ``path`` (the old one set aside
    first and removed after), and what is left of ``tmp`` removed."""
    write_manifest(written)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.with_name(f".{path.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    written.rename(path)
    for leftover in (old, tmp):
        if leftover.exists():
            shutil.rmtree(leftover)
