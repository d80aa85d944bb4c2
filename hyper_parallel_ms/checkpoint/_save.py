"""``save``: every rank writes the chunks it was given by the write plan through the storage
writer (by default one safetensors file per rank); the coordinator commits the metadata.

Example::

    save({"model": get_model_state_dict(model), "step": 10}, checkpoint_id="ckpt/step_10")
"""
from __future__ import annotations

import copy

import os
import threading
import uuid
from math import prod
from typing import Any, Dict, List, Optional, Tuple

from ._default_planner import DefaultSavePlanner
from ._dist import Coordinator
from ._filesystem import FileSystemWriter
from ._metadata import CheckpointError, Chunk, Metadata, TensorEntry
from ._boxes import Piece, chunk_key
from ._stateful import resolve_stateful
from ._storage import StorageWriter, StoredChunk

__all__ = ["save", "async_save", "AsyncSave"]


def save(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
         storage_writer: Optional[StorageWriter] = None, planner: Optional[DefaultSavePlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, remove_redundancy: bool = True,
         save_to_minimum_rank: bool = False) -> Metadata:
    """Save a state dict of pieces (PyTorch DCP's ``save``, HyperParallel's arguments).

    Every rank writes only pieces it holds; a piece held by several ranks (replicas) is
    written once when ``remove_redundancy`` (by the lowest rank holding it with
    ``save_to_minimum_rank``, else spread over its holders). The metadata records each
    tensor's global shape, dtype and chunks (offsets, sizes, CRC-32) and the non-tensor
    values. Call it on every rank.

    Saving to an existing ``checkpoint_id`` replaces that checkpoint (as PyTorch's DCP
    overwrites), atomically: the new one is written to ``<checkpoint_id>.partial`` and renamed
    into place only once every rank has written; a reader sees the old checkpoint or the new
    one whole, never a mix (a read that spans the replacement fails and says to load again),
    and a save that fails or dies midway leaves the old checkpoint whole and loadable.

    Args:
        state_dict: a (nested) dict of tensors (DTensors, sharded Parameters,
            :class:`ShardedTensor`, plain tensors) and JSON-serialisable values; a top-level value
            with ``state_dict()`` / ``load_state_dict()`` (PyTorch's ``Stateful``) is saved as its
            ``state_dict()``.
        checkpoint_id: the checkpoint directory (its meaning is the storage writer's).
        storage_writer: where the data goes (default :class:`FileSystemWriter`); see
            :class:`StorageWriter`.
        planner: what is saved (default :class:`DefaultSavePlanner`; subclass it to filter or
            rename keys).
        no_dist: this process alone saves everything it holds, as a world of one (no
            collectives; give each process its own ``checkpoint_id``).
        use_collectives: coordinate the ranks (plan, dedup, one metadata, atomic commit). With
            ``False`` each rank writes its pieces and a rank-local ``metadata_rank_K.json``
            (each rank's part is atomic; replicas are written by every holder).
        remove_redundancy: write each replicated piece once.
        save_to_minimum_rank: the lowest holder writes a replicated piece; ``False`` (the
            default, HyperParallel's and PyTorch's) the holder with the fewest elements to write.

    Returns:
        The :class:`Metadata` of this checkpoint (on ranks not coordinating: this rank's part).

    Example::

        save({"model": get_model_state_dict(model), "step": 10}, checkpoint_id="ckpt/step_10")
    """
    world = Coordinator(distributed=not no_dist)
    writer, planner = _set_up(state_dict, checkpoint_id, storage_writer, planner, world)
    if not use_collectives and world.world_size > 1:
        return _save_rank_local(planner, writer, world.rank, world.world_size)
    job = _SaveJob(planner, writer, world, remove_redundancy, save_to_minimum_rank)
    job.write()
    return job.finish()


def _set_up(state_dict: Dict[str, Any], checkpoint_id: Optional[str], writer: Optional[StorageWriter],
            planner: Optional[DefaultSavePlanner], coord: Coordinator) -> Tuple[StorageWriter, DefaultSavePlanner]:
    """The writer reset to ``checkpoint_id`` and the planner set up (defaults where ``None``);
    Stateful values are saved as their ``state_dict()`` (:mod:`._stateful`)."""
    state_dict = resolve_stateful(state_dict)
    writer = writer if writer is not None else FileSystemWriter()
    writer.reset(None if checkpoint_id is None else os.fspath(checkpoint_id))
    planner = planner if planner is not None else DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=coord.rank == 0)
    return writer, planner


class _SaveJob:
    """The phases of a coordinated save: :meth:`__init__` sets up the store and plans
    (collectives), :meth:`write` writes this rank's data (no collectives: may run in a
    thread), :meth:`finish` agrees that every rank wrote and commits (collectives)."""

    def __init__(self, planner: DefaultSavePlanner, writer: StorageWriter, coord: Coordinator,
                 remove_redundancy: bool, save_to_minimum_rank: bool, snapshot: bool = False) -> None:
        self.planner, self.writer, self.coord = planner, writer, coord
        error = None
        try:
            writer.set_up_storage_writer(coord.rank == 0, rank=coord.rank, use_collectives=True)
        except Exception as exc:  # every rank must reach the agreement below
            error = _described(exc)
        coord.agree(error)
        plans = coord.all_gather(planner.create_local_plan(with_checksums=coord.world_size > 1))
        self.pieces = planner.create_global_plan(plans, remove_redundancy=remove_redundancy,
                                                 save_to_minimum_rank=save_to_minimum_rank)[coord.rank]
        # host copies when the caller goes on training while the data is written (and of the
        # non-tensor values, which the caller may change before finish() writes the metadata)
        self.arrays = _arrays(self.pieces, planner, copy=snapshot)
        self.values = copy.deepcopy(planner.values) if snapshot else planner.values
        self.error: Optional[str] = None
        self.written: Optional[List[Tuple[Piece, StoredChunk]]] = None

    def write(self) -> None:
        try:
            self.written = _write_pieces(self.pieces, self.arrays, self.writer, self.coord.rank)
        except Exception as exc:  # every rank must reach the collectives of finish()
            self.error = f"writing to {_target(self.writer)} failed: {_described(exc)}"
        self.arrays = {}

    def finish(self) -> Metadata:
        coord = self.coord
        results = coord.all_gather((self.error, self.written))
        failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(results) if e]
        if failures:
            raise CheckpointError(f"save to {_target(self.writer)} failed, nothing was committed: " +
                                  "; ".join(failures))
        metadata = _metadata([w for _, w in results], self.values, coord.world_size,
                             coord.all_gather(uuid.uuid4().hex if coord.rank == 0 else None)[0])
        error = None
        if coord.rank == 0:
            try:
                self.writer.finish(metadata)
            except Exception as exc:
                error = f"committing {_target(self.writer)} failed: {_described(exc)}"
        coord.agree(error)
        return metadata


def _described(exc: Exception) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _target(writer: StorageWriter) -> str:
    return str(getattr(writer, "path", None) or type(writer).__name__)


class AsyncSave:
    """A save whose files are being written in the background; :meth:`result` commits it.

    ``result()`` is collective: call it on every rank, in the same order as other
    collectives (e.g. before the next save, or at the end of training).

    Args:
        job: the save in progress (made by :func:`async_save`, not by users).

    Example::

        pending = async_save(state, checkpoint_id="ckpt/step_20")
        ...                                   # train on
        pending.result()                      # every rank: committed
    """

    def __init__(self, job: _SaveJob) -> None:
        self._job = job
        self._thread = threading.Thread(target=job.write, name="hpms-checkpoint-write", daemon=False)
        self._thread.start()
        self._metadata: Optional[Metadata] = None

    def done(self) -> bool:
        """Whether this rank's file is written (the commit still needs :meth:`result`)."""
        return not self._thread.is_alive()

    def result(self) -> Metadata:
        """Wait for this rank's file, agree with the other ranks and commit; the metadata."""
        if self._metadata is None:
            self._thread.join()
            self._metadata = self._job.finish()
        return self._metadata


def async_save(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
               storage_writer: Optional[StorageWriter] = None, planner: Optional[DefaultSavePlanner] = None,
               no_dist: bool = False, remove_redundancy: bool = True, save_to_minimum_rank: bool = False) -> AsyncSave:
    """:func:`save` whose file writing overlaps the caller's next steps. The pieces are
    copied to host memory before it returns (the state may change afterwards); call
    ``.result()`` on every rank to commit (the checkpoint is not visible before).

    Args:
        state_dict, checkpoint_id, no_dist, remove_redundancy, save_to_minimum_rank: as in :func:`save`.
        storage_writer: where the data goes (default :class:`FileSystemWriter`), as in :func:`save`;
            its ``write_data`` runs in a background thread.
        planner: what is saved (default :class:`DefaultSavePlanner`), as in :func:`save`.

    Returns:
        An :class:`AsyncSave`; its ``result()`` commits and returns the :class:`Metadata`.

    Example::

        pending = async_save(state, checkpoint_id="ckpt/step_10")
        ...                                 # train on
        pending.result()                    # every rank: committed
    """
    coord = Coordinator(distributed=not no_dist)
    writer, planner = _set_up(state_dict, checkpoint_id, storage_writer, planner, coord)
    return AsyncSave(_SaveJob(planner, writer, coord, remove_redundancy, save_to_minimum_rank, snapshot=True))


def _arrays(pieces: List[Piece], planner: DefaultSavePlanner, copy: bool = False) -> Dict[str, Any]:
    """Chunk key -> this rank's data of each piece (host copies with ``copy``)."""
    return {chunk_key(p.key, p.offsets): (planner.resolve_data(p).copy() if copy else planner.resolve_data(p))
            for p in pieces}


def _write_pieces(pieces: List[Piece], arrays: Dict[str, Any], writer: StorageWriter,
                  rank: int) -> List[Tuple[Piece, StoredChunk]]:
    """Write the pieces' data; ``(piece, stored chunk)`` of each. A plain tensor's CRC-32 from
    the plan (of the same data, agreed by its holders) is not computed again."""
    if not pieces:
        return []
    known = {chunk_key(p.key, p.offsets): p.crc32 for p in pieces if p.crc32 is not None}
    stored = writer.write_data(rank, arrays, known)
    missing = [k for k in arrays if k not in stored]
    if missing:
        raise CheckpointError(f"{type(writer).__name__}.write_data did not store {missing}")
    return [(p, stored[chunk_key(p.key, p.offsets)]) for p in pieces]


def _metadata(results, values: Dict[str, Any], world_size: int, save_id: str = "") -> Metadata:
    """Metadata of the chunks the ranks wrote: ``results`` lists each rank's ``written``."""
    chunks: Dict[str, list] = {}
    shapes: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for written in results:
        for piece, stored in written or ():
            chunks.setdefault(piece.key, []).append(Chunk(piece.offsets, piece.sizes, stored.file,
                                                          chunk_key(piece.key, piece.offsets), stored.crc32,
                                                          stored.nbytes))
            shapes[piece.key] = (piece.shape, piece.dtype)
    return Metadata({k: TensorEntry(shapes[k][0], shapes[k][1], tuple(sorted(c, key=lambda c: c.offsets)))
                     for k, c in chunks.items()}, values, world_size, save_id)


def _save_rank_local(planner: DefaultSavePlanner, writer: StorageWriter, rank: int, world_size: int) -> Metadata:
    writer.set_up_storage_writer(False, rank=rank, use_collectives=False)
    pieces = [p for p in planner.create_local_plan(with_checksums=False) if prod(p.sizes)]
    written = _write_pieces(pieces, _arrays(pieces, planner), writer, rank)
    metadata = _metadata([written], planner.values, world_size, uuid.uuid4().hex)
    writer.finish_rank(rank, metadata)
    return metadata
