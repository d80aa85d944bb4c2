"""Verified reads of a checkpoint through a :class:`StorageReader`: a chunk's size and CRC-32
are checked before its data is used, and a box of a global tensor is assembled from the saved
chunks that overlap it.

Example::

    reader = open_checkpoint("ckpt/step_10")
    entry = reader.metadata.tensors["model.up.weight"]
    data = reader.read_box("model.up.weight", (0, 0), entry.shape)       # the whole tensor
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ._filesystem import FileSystemReader
from ._metadata import CheckpointError, Chunk, Metadata
from ._boxes import overlap_reads
from ._safetensors import crc32, numpy_dtype
from ._storage import NO_CHECKSUM, StorageReader

__all__ = ["CheckpointReader", "open_checkpoint", "NO_CHECKSUM"]


class CheckpointReader:
    """Metadata of a checkpoint and verified reads of its chunks from ``storage``."""

    def __init__(self, storage: StorageReader, metadata: Metadata) -> None:
        self.storage, self.metadata = storage, metadata
        self.source, self.full_file = storage.source, storage.full_file
        self._pool: Optional[ThreadPoolExecutor] = None
        self._checks: Optional[List[Tuple[str, Chunk, str, Future]]] = None

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        """The chunk's data (read-only); raises :class:`CheckpointError` naming the tensor and
        where it is stored when it is missing, truncated or corrupted."""
        data = self.storage.read_chunk(key, chunk)
        where = self.storage.location(chunk)
        if tuple(data.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"tensor {key!r}: chunk {chunk.key!r} in {where} has shape {data.shape}, the "
                                  f"metadata says {chunk.sizes}: the file does not belong to this checkpoint")
        if chunk.crc32 != NO_CHECKSUM:
            if self._checks is None:
                _verify(key, chunk, where, crc32(data))
            else:
                self._checks.append((key, chunk, where, self._pool.submit(crc32, data)))
        return data

    @contextmanager
    def overlapped_checks(self) -> Iterator[None]:
        """Within this block, CRCs are computed in threads beside the next reads, and all are
        checked when the block ends (raising for the first chunk that fails)."""
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            self._pool, self._checks = pool, []
            try:
                yield
                for key, chunk, where, future in self._checks:
                    _verify(key, chunk, where, future.result())
            finally:
                self._pool, self._checks = None, None

    def read_box(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """The box (``offsets``, ``sizes``) of tensor ``key`` (read-only), assembled from the
        saved chunks that overlap it (each checked whole)."""
        entry = self.metadata.tensors[key]
        reads = overlap_reads(key, entry, offsets, sizes, self.source)
        if len(reads) == 1 and tuple(reads[0].chunk.sizes) == tuple(sizes):
            return self.read_chunk(key, reads[0].chunk)
        out = np.empty(tuple(sizes), dtype=numpy_dtype(entry.dtype))
        for read in reads:
            out[read.dst] = self.read_chunk(key, read.chunk)[read.src]
        return out


def _verify(key: str, chunk: Chunk, where: str, got: int) -> None:
    if got != chunk.crc32:
        raise CheckpointError(f"tensor {key!r}: chunk {chunk.key!r} in {where} fails its checksum (CRC-32 "
                              f"{got:#010x}, expected {chunk.crc32:#010x}): the file is corrupted")


def open_checkpoint(checkpoint_id: Optional[str], storage_reader: Optional[StorageReader] = None) -> CheckpointReader:
    """A reader for ``checkpoint_id`` through ``storage_reader`` (default: a
    :class:`FileSystemReader`: a checkpoint directory or a full ``.safetensors`` / ``.ckpt`` file).

    Args:
        checkpoint_id: a checkpoint directory or a full ``.safetensors`` / ``.ckpt`` file (``None``: the
            reader's own location).
        storage_reader: where to read from (default: :class:`FileSystemReader`).

    Example::

        reader = open_checkpoint("ckpt/step_10")
        reader.metadata.tensors["model.fc.weight"].shape
    """
    storage = storage_reader if storage_reader is not None else FileSystemReader()
    storage.reset(None if checkpoint_id is None else os.fspath(checkpoint_id))
    return CheckpointReader(storage, storage.read_metadata())
