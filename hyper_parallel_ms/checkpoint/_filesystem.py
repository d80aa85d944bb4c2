"""The default storage: a directory of safetensors files (one per writing rank) and
``metadata.json`` (PyTorch DCP's ``FileSystemWriter`` / ``FileSystemReader`` roles).

Writes go to ``<checkpoint_id>.partial`` and are committed by renaming (see :mod:`._commit`):
a save over an existing checkpoint replaces it atomically. A reader reads ``metadata.json``
and then the data files of that same commit: each data file is memory-mapped once, and a file
opened after the checkpoint was replaced is refused (the reader never mixes two saves). The
reader also opens rank-local parts (``metadata_rank_K.json``) and full MindSpore checkpoints
(``.safetensors`` or ``.ckpt``, each tensor one chunk, under MindSpore's names).

Example::

    save(state, checkpoint_id="ckpt/step_10", storage_writer=FileSystemWriter())   # the default
    load(state, checkpoint_id="ckpt/step_10", storage_reader=FileSystemReader())
"""
from __future__ import annotations

import glob
import os
import re
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from ._commit import commit, fsync_path, prepare_staging, previous_dir, staging_dir, write_durable
from ._metadata import METADATA_FILE, CheckpointError, Chunk, Metadata, TensorEntry
from ._safetensors import SafetensorsFile, write_file
from ._storage import NO_CHECKSUM, StorageReader, StorageWriter, StoredChunk

__all__ = ["FileSystemWriter", "FileSystemReader", "data_file_name", "rank_metadata_name"]


def data_file_name(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def rank_metadata_name(rank: int) -> str:
    return f"metadata_rank_{rank}.json"


def _path(checkpoint_id: Optional[str], current: Optional[str], role: str) -> str:
    if checkpoint_id is not None:
        return os.fspath(checkpoint_id)
    if current is None:
        raise CheckpointError(f"{role} has no checkpoint_id: pass checkpoint_id= or a path to the {role}")
    return current


class FileSystemWriter(StorageWriter):
    """Safetensors files in a directory, committed atomically (the default writer).

    Args:
        path: the checkpoint directory, used when ``save`` is given no ``checkpoint_id`` (a
            ``checkpoint_id`` replaces it).

    Example::

        save(state, storage_writer=FileSystemWriter("ckpt/step_10"))   # = checkpoint_id="ckpt/step_10"
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._rank, self._rank_local, self._file = 0, False, None

    def reset(self, checkpoint_id: Optional[str]) -> None:
        self.path = _path(checkpoint_id, self.path, "FileSystemWriter")

    def set_up_storage_writer(self, is_coordinator: bool, *, rank: int = 0, use_collectives: bool = True) -> None:
        self._rank, self._rank_local = rank, not use_collectives
        if self._rank_local:
            os.makedirs(self.path, exist_ok=True)
        elif is_coordinator:
            try:
                prepare_staging(self.path)
            except OSError as exc:
                raise CheckpointError(f"cannot create {staging_dir(self.path)}: {exc}") from exc

    def write_data(self, rank: int, arrays: Mapping[str, np.ndarray],
                   checksums: Mapping[str, int]) -> Dict[str, StoredChunk]:
        if not arrays:
            return {}
        name = data_file_name(rank)
        directory = self.path if self._rank_local else staging_dir(self.path)
        self._file = os.path.join(directory, name + (".tmp" if self._rank_local else ""))
        sums = write_file(self._file, arrays, checksums=checksums)
        return {key: StoredChunk(name, crc, nbytes) for key, (crc, nbytes) in sums.items()}

    def finish(self, metadata: Metadata) -> None:
        staging = staging_dir(self.path)
        write_durable(os.path.join(staging, METADATA_FILE), metadata.to_json())
        commit(staging, self.path)

    def finish_rank(self, rank: int, metadata: Metadata) -> None:
        if self._file is not None:
            os.replace(self._file, os.path.join(self.path, data_file_name(rank)))
            self._file = None
        write_durable(os.path.join(self.path, rank_metadata_name(rank)), metadata.to_json())
        fsync_path(self.path)


class FileSystemReader(StorageReader):
    """Reads what :class:`FileSystemWriter` wrote, rank-local parts, or a full MindSpore
    checkpoint file (the default reader).

    Args:
        path: the checkpoint directory or full ``.safetensors`` / ``.ckpt`` file, used when
            ``load`` is given no ``checkpoint_id`` (a ``checkpoint_id`` replaces it).

    Example::

        load(state, storage_reader=FileSystemReader("ckpt/step_10"))   # = checkpoint_id="ckpt/step_10"
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._resolved: Optional[str] = None
        self._files: Dict[str, SafetensorsFile] = {}
        self._arrays: Optional[Dict[str, np.ndarray]] = None
        self._stamp: Optional[Tuple[int, int, int]] = None
        self.full_file = False

    @property
    def source(self) -> str:
        return self._resolved or self.path or "FileSystemReader"

    def reset(self, checkpoint_id: Optional[str]) -> None:
        self.path = _path(checkpoint_id, self.path, "FileSystemReader")
        self._resolved, self._files, self._arrays, self._stamp, self.full_file = None, {}, None, None, False

    def read_metadata(self) -> Metadata:
        path = self.path
        if os.path.isfile(path):
            self._resolved, self.full_file = path, True
            return self._full_file(path)
        path = _committed(path)
        self._resolved = path
        meta_path = os.path.join(path, METADATA_FILE)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                self._stamp = _stamp(os.fstat(f.fileno()))
                return Metadata.from_json(f.read(), meta_path)
        parts = sorted(glob.glob(os.path.join(path, "metadata_rank_*.json")))
        if not parts:
            raise CheckpointError(f"{path} has no {METADATA_FILE}: it is not a committed checkpoint")
        return _merge_rank_parts(path, parts)

    def location(self, chunk: Chunk) -> str:
        return os.path.join(os.path.dirname(self._resolved) if self.full_file else self._resolved, chunk.file)

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        if self._arrays is not None:
            return self._arrays[chunk.key]
        if chunk.file not in self._files:
            path = self.location(chunk)
            if not os.path.exists(path):
                self._check_not_replaced(key)
                raise CheckpointError(f"tensor {key!r}: its data file {path} is missing (the checkpoint "
                                      f"{self.source} is incomplete)")
            opened = SafetensorsFile(path)
            self._check_not_replaced(key)
            self._files[chunk.file] = opened
        return self._files[chunk.file].view(chunk.key)

    def _check_not_replaced(self, key: str) -> None:
        """The file just opened belongs to the commit whose metadata was read: refuse it when
        ``metadata.json`` is no longer that file (a save replaced the checkpoint meanwhile)."""
        if self._stamp is None:
            return
        try:
            now = _stamp(os.stat(os.path.join(self._resolved, METADATA_FILE)))
        except FileNotFoundError:
            now = None
        if now != self._stamp:
            raise CheckpointError(f"tensor {key!r}: checkpoint {self.source} was replaced by another save while it "
                                  "was being read; load it again")

    def _full_file(self, path: str) -> Metadata:
        if path.endswith(".safetensors"):
            f = SafetensorsFile(path)
            self._files[os.path.basename(path)] = f
            tensors = {}
            for key in f.keys():
                shape = f.shape(key)
                nbytes = int(np.prod(shape, dtype=np.int64)) * f.dtype(key).itemsize
                chunk = Chunk((0,) * len(shape), shape, os.path.basename(path), key, NO_CHECKSUM, nbytes)
                tensors[key] = TensorEntry(shape, f.dtype(key).name, (chunk,))
            return Metadata(tensors)
        if path.endswith(".ckpt"):
            import mindspore as ms
            try:
                params = ms.load_checkpoint(path)
            except Exception as exc:
                raise CheckpointError(f"{path} is not a readable MindSpore checkpoint: {exc}") from exc
            self._arrays = {k: p.asnumpy() for k, p in params.items()}
            return Metadata({k: TensorEntry(a.shape, a.dtype.name, (Chunk((0,) * a.ndim, a.shape,
                                                                          os.path.basename(path), k, NO_CHECKSUM,
                                                                          a.nbytes),))
                             for k, a in self._arrays.items()})
        raise CheckpointError(f"{path} is a file but neither a .safetensors nor a .ckpt checkpoint")


def _stamp(st: os.stat_result) -> Tuple[int, int, int]:
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _committed(path: str) -> str:
    """The committed directory of ``path``: itself, or ``<path>.old`` while a save is between
    the two renames of its commit."""
    for _ in range(2):                 # the second look: the commit may have finished meanwhile
        if os.path.isdir(path):
            return path
        if os.path.exists(os.path.join(previous_dir(path), METADATA_FILE)):
            return previous_dir(path)
    if os.path.isdir(staging_dir(path)):
        raise CheckpointError(f"checkpoint {path} was never committed: only {staging_dir(path)} exists (a save "
                              "died before every rank finished); load an earlier checkpoint")
    raise CheckpointError(f"checkpoint {path} does not exist")


def _merge_rank_parts(path: str, parts) -> Metadata:
    metas = {}
    for part in parts:
        with open(part) as f:
            metas[int(re.search(r"metadata_rank_(\d+)\.json$", part).group(1))] = Metadata.from_json(f.read(), part)
    world = {m.world_size for m in metas.values()}
    if len(world) != 1:
        raise CheckpointError(f"the rank-local parts of {path} come from saves with different world sizes {world}")
    missing = sorted(set(range(world.pop())) - set(metas))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the parts of ranks {missing} (metadata_rank_K.json missing)")
    tensors: Dict[str, TensorEntry] = {}
    for rank in sorted(metas):
        for key, entry in metas[rank].tensors.items():
            old = tensors.get(key)
            if old is not None and (old.shape, old.dtype) != (entry.shape, entry.dtype):
                raise CheckpointError(f"tensor {key!r}: rank parts of {path} disagree on shape or dtype")
            tensors[key] = TensorEntry(entry.shape, entry.dtype, (old.chunks if old else ()) + entry.chunks)
    return Metadata(tensors, metas[min(metas)].values, len(metas))
