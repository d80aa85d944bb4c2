"""Where a checkpoint's bytes live: the roles of PyTorch DCP's ``StorageWriter`` /
``StorageReader``. :func:`~hyper_parallel_ms.checkpoint.save` and ``load`` plan which rank
writes or reads which box of which tensor; a storage only stores and returns arrays by name,
and commits. The default, :class:`~hyper_parallel_ms.checkpoint.FileSystemWriter` /
``FileSystemReader``, writes one safetensors file per rank and ``metadata.json``; another
store (memory, an object store) implements these few methods.

Calls a writer receives during a save, in order:

1. every rank: ``reset(checkpoint_id)``, then ``set_up_storage_writer(is_coordinator, rank=,
   use_collectives=)`` (the coordinator prepares the store: it runs before any rank writes);
2. every rank that writes: ``write_data(rank, arrays, checksums)``, no collectives (it may run
   in a background thread: ``async_save``); returns where each array went;
3. the coordinator, once every rank has written: ``finish(metadata)``, which makes the
   checkpoint visible atomically (a reader sees the previous checkpoint or this one whole).

With ``use_collectives=False`` each rank calls ``reset``, ``set_up_storage_writer``,
``write_data`` and ``finish_rank(rank, metadata)`` (its own part; optional for a writer).

Calls a reader receives during a load: ``reset(checkpoint_id)``, ``read_metadata()``, then
``read_chunk(key, chunk)`` for each saved chunk overlapping this rank's pieces (sizes and
CRC-32s are checked by the caller).

Example (an in-memory store)::

    class MemoryWriter(StorageWriter):
        def __init__(self): self.store, self.metadata = {}, None
        def reset(self, checkpoint_id): pass
        def set_up_storage_writer(self, is_coordinator, *, rank=0, use_collectives=True): pass
        def write_data(self, rank, arrays, checksums):
            out = {}
            for key, a in arrays.items():
                self.store[key] = np.array(a)
                out[key] = StoredChunk("memory", checksums.get(key, NO_CHECKSUM), a.nbytes)
            return out
        def finish(self, metadata): self.metadata = metadata
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import numpy as np

from ._metadata import CheckpointError, Chunk, Metadata

__all__ = ["StorageWriter", "StorageReader", "StoredChunk", "NO_CHECKSUM"]

NO_CHECKSUM = -1          # a chunk stored without a CRC-32: read unchecked


@dataclass(frozen=True)
class StoredChunk:
    """Where a writer put one array: ``file`` (any name the reader understands, recorded in
    the metadata as :attr:`Chunk.file`), its CRC-32 (or :data:`NO_CHECKSUM`) and size.

    Args:
        file: where the array is stored, as the matching reader understands it.
        crc32: the CRC-32 of the array's bytes, or :data:`NO_CHECKSUM` (then read unchecked).
        nbytes: the array's size in bytes.

    Example:
        >>> StoredChunk("rank_0.safetensors", NO_CHECKSUM, 24)
        StoredChunk(file='rank_0.safetensors', crc32=-1, nbytes=24)
    """

    file: str
    crc32: int
    nbytes: int


class StorageWriter(abc.ABC):
    """Writes the arrays of a save and commits them (see the module docstring for the calls).

    Example::

        class MemoryWriter(StorageWriter):                   # an in-memory store
            def __init__(self): self.store, self.metadata = {}, None
            def reset(self, checkpoint_id): pass
            def set_up_storage_writer(self, is_coordinator, *, rank=0, use_collectives=True): pass
            def write_data(self, rank, arrays, checksums):
                out = {}
                for key, a in arrays.items():
                    self.store[key] = np.array(a)
                    out[key] = StoredChunk("memory", checksums.get(key, NO_CHECKSUM), a.nbytes)
                return out
            def finish(self, metadata): self.metadata = metadata

        writer = MemoryWriter()
        save(state, storage_writer=writer, no_dist=True)
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: Optional[str]) -> None:
        """A new save to ``checkpoint_id`` (its meaning is the storage's: a path, a key)."""

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool, *, rank: int = 0, use_collectives: bool = True) -> None:
        """Prepare the store (the coordinator: before any rank writes). ``use_collectives=False``:
        every rank saves its own part, published by :meth:`finish_rank`."""

    @abc.abstractmethod
    def write_data(self, rank: int, arrays: Mapping[str, np.ndarray],
                   checksums: Mapping[str, int]) -> Dict[str, StoredChunk]:
        """Store this rank's ``arrays`` (chunk key -> data, all of them at once); ``checksums``:
        CRC-32s already known of some of them. Returns chunk key -> :class:`StoredChunk`."""

    @abc.abstractmethod
    def finish(self, metadata: Metadata) -> None:
        """Coordinator, after every rank has written: store ``metadata`` and make the
        checkpoint visible atomically, replacing an earlier one of the same id."""

    def finish_rank(self, rank: int, metadata: Metadata) -> None:
        """``use_collectives=False``: make this rank's part (``metadata``) visible."""
        raise CheckpointError(f"{type(self).__name__} cannot save without collectives (use_collectives=False)")


class StorageReader(abc.ABC):
    """Reads a checkpoint's metadata and chunks (see the module docstring for the calls).

    Example::

        class MemoryReader(StorageReader):    # reads what StorageWriter's example MemoryWriter stored
            def __init__(self, writer): self.writer = writer
            def reset(self, checkpoint_id): pass
            def read_metadata(self): return self.writer.metadata
            def read_chunk(self, key, chunk): return self.writer.store[chunk.key]

        load(state, storage_reader=MemoryReader(writer), no_dist=True)
    """

    #: a full MindSpore checkpoint (tensors under MindSpore's names, no values)
    full_file: bool = False

    @abc.abstractmethod
    def reset(self, checkpoint_id: Optional[str]) -> None:
        """A new load from ``checkpoint_id``."""

    @abc.abstractmethod
    def read_metadata(self) -> Metadata:
        """The checkpoint's :class:`Metadata` (raises :class:`CheckpointError` if there is none)."""

    @abc.abstractmethod
    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        """The data of ``chunk`` of tensor ``key``, as stored (read-only is fine); raises
        :class:`CheckpointError` naming the tensor and where it is stored when it cannot."""

    @property
    def source(self) -> str:
        """The checkpoint, as error messages name it."""
        return type(self).__name__

    def location(self, chunk: Chunk) -> str:
        """Where ``chunk`` is stored, as error messages name it."""
        return chunk.file
