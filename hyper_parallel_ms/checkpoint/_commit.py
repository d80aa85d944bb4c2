"""Atomic checkpoint directories: data is written into ``<checkpoint_id>.partial``, and the
checkpoint becomes visible only when the coordinator, after every rank has finished and
fsync'd its file, writes ``metadata.json`` and renames the directory into place. A save
that dies half-way leaves at most a ``.partial`` directory that no load reads, and the
previous checkpoint untouched.

Example::

    staging = prepare_staging("ckpt/step_10")        # coordinator, before the ranks write
    ...                                               # ranks write into staging
    commit(staging, "ckpt/step_10")                  # coordinator, after all ranks finished
"""
from __future__ import annotations

import os
import shutil

__all__ = ["staging_dir", "previous_dir", "prepare_staging", "write_durable", "commit", "fsync_path"]


def staging_dir(checkpoint_id: str) -> str:
    """The directory a save writes into before it is committed."""
    return os.path.normpath(checkpoint_id) + ".partial"


def prepare_staging(checkpoint_id: str) -> str:
    """An empty staging directory (the leftovers of an earlier failed save are removed)."""
    staging = staging_dir(checkpoint_id)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    parent = os.path.dirname(staging)
    if parent:
        os.makedirs(parent, exist_ok=True)
    os.makedirs(staging)
    return staging


def previous_dir(checkpoint_id: str) -> str:
    """Where the replaced checkpoint of the same name waits while a new one is moved in."""
    return os.path.normpath(checkpoint_id) + ".old"


def write_durable(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync'd, then renamed."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(staging: str, checkpoint_id: str) -> None:
    """Move the finished ``staging`` directory to ``checkpoint_id`` (replacing an older
    checkpoint of that name only once the new one is complete)."""
    target = os.path.normpath(checkpoint_id)
    fsync_path(staging)
    old = previous_dir(target)
    if os.path.exists(target):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(target, old)
    # between the two renames the checkpoint is <target>.old (readers fall back to it); an old
    # copy left by a save that died there stays until the new one is in place
    os.replace(staging, target)
    fsync_path(os.path.dirname(os.path.abspath(target)))
    if os.path.exists(old):
        shutil.rmtree(old)


def fsync_path(path: str) -> None:
    """Flush a file or directory (its entries: renames, new files) at ``path`` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
