"""``save``: every rank writes the chunks it was given by the write plan into its own
safetensors file; the coordinator writes the metadata and commits the directory.

Example::

    save({"model": get_model_state_dict(model), "step": 10}, checkpoint_id="ckpt/step_10")
"""
from __future__ import annotations

import os
import threading
from dataclasses import replace
from math import prod
from typing import Any, Dict, List, Optional, Tuple

from ._commit import commit, prepare_staging, staging_dir, write_durable
from ._dist import Coordinator
from ._metadata import METADATA_FILE, CheckpointError, Chunk, Metadata, TensorEntry
from ._pieces import TensorRef, flatten
from ._planner import Piece, chunk_key, plan_writes
from ._safetensors import crc32, write_file

__all__ = ["save", "async_save", "AsyncSave", "data_file_name", "rank_metadata_name"]


def data_file_name(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def rank_metadata_name(rank: int) -> str:
    return f"metadata_rank_{rank}.json"


def save(state_dict: Dict[str, Any], *, checkpoint_id: str, no_dist: bool = False, use_collectives: bool = True,
         remove_redundancy: bool = True, save_to_minimum_rank: bool = True) -> Metadata:
    """Save a state dict of pieces (PyTorch DCP's ``save``, HyperParallel's arguments).

    Every rank writes only pieces it holds; a piece held by several ranks (replicas) is
    written once when ``remove_redundancy`` (by the lowest rank holding it with
    ``save_to_minimum_rank``, else spread over its holders). The metadata records each
    tensor's global shape, dtype and chunks (offsets, sizes, CRC-32) and the non-tensor
    values. The save is atomic: written to ``<checkpoint_id>.partial`` and renamed once all
    ranks finished. Call it on every rank.

    Args:
        state_dict: a (nested) dict of tensors (DTensors, sharded Parameters,
            :class:`ShardedTensor`, plain tensors) and JSON-serialisable values.
        checkpoint_id: the checkpoint directory.
        no_dist: this process alone saves everything it holds, as a world of one (no
            collectives; give each process its own ``checkpoint_id``).
        use_collectives: coordinate the ranks (plan, dedup, one metadata, atomic commit). With
            ``False`` each rank writes its pieces and a rank-local ``metadata_rank_K.json``
            (each rank's part is atomic; replicas are written by every holder).
        remove_redundancy: write each replicated piece once.
        save_to_minimum_rank: the lowest holder writes a replicated piece (else the least
            loaded holder).

    Returns:
        The :class:`Metadata` of this checkpoint (on ranks not coordinating: this rank's part).

    Example::

        save({"model": get_model_state_dict(model), "step": 10}, checkpoint_id="ckpt/step_10")
    """
    checkpoint_id = os.fspath(checkpoint_id)
    tensors, values = flatten(state_dict, for_save=True)
    plain_values = {k: v.value for k, v in values.items()}
    world = Coordinator(distributed=not no_dist)
    if not use_collectives and world.world_size > 1:
        return _save_rank_local(tensors, plain_values, checkpoint_id, world.rank, world.world_size)
    return _save_coordinated(tensors, plain_values, checkpoint_id, world, remove_redundancy, save_to_minimum_rank)


def _save_coordinated(tensors: Dict[str, TensorRef], values: Dict[str, Any], checkpoint_id: str,
                      coord: Coordinator, remove_redundancy: bool, save_to_minimum_rank: bool) -> Metadata:
    """Stage, plan, write, then commit once every rank has written (see :mod:`._commit`)."""
    job = _SaveJob(tensors, values, checkpoint_id, coord, remove_redundancy, save_to_minimum_rank)
    job.write()
    return job.finish()


class _SaveJob:
    """The phases of a coordinated save: :meth:`__init__` stages the directory and plans
    (collectives), :meth:`write` writes this rank's file (no collectives: may run in a
    thread), :meth:`finish` agrees that every rank wrote and commits (collectives)."""

    def __init__(self, tensors: Dict[str, TensorRef], values: Dict[str, Any], checkpoint_id: str,
                 coord: Coordinator, remove_redundancy: bool, save_to_minimum_rank: bool,
                 snapshot: bool = False) -> None:
        self.values, self.checkpoint_id, self.coord = values, checkpoint_id, coord
        error = None
        if coord.rank == 0:
            try:
                prepare_staging(checkpoint_id)
            except OSError as exc:
                error = f"cannot create {staging_dir(checkpoint_id)}: {exc}"
        coord.agree(error)
        plans = coord.all_gather([_plan_piece(ref) for ref in tensors.values()] if coord.world_size > 1
                                 else [ref.piece for ref in tensors.values()])
        self.pieces = plan_writes(plans, remove_redundancy=remove_redundancy,
                                  save_to_minimum_rank=save_to_minimum_rank)[coord.rank]
        # host copies when the caller goes on training while the file is written
        self.arrays = _arrays(self.pieces, tensors, copy=snapshot)
        self.path = os.path.join(staging_dir(checkpoint_id), data_file_name(coord.rank))
        self.error: Optional[str] = None
        self.written: Optional[List[Tuple[Piece, int, int]]] = None

    def write(self) -> None:
        try:
            self.written = _write_pieces(self.pieces, self.arrays, self.path)
        except Exception as exc:  # every rank must reach the collectives of finish()
            self.error = f"writing {self.path} failed: {type(exc).__name__}: {exc}"
        self.arrays = {}

    def finish(self) -> Metadata:
        coord, checkpoint_id = self.coord, self.checkpoint_id
        results = coord.all_gather((self.error, self.written))
        failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(results) if e]
        if failures:
            raise CheckpointError(f"save to {checkpoint_id} failed, nothing was committed: " + "; ".join(failures))
        metadata = _metadata([(r, w) for r, (_, w) in enumerate(results)], self.values, coord.world_size)
        error = None
        if coord.rank == 0:
            try:
                write_durable(os.path.join(staging_dir(checkpoint_id), METADATA_FILE), metadata.to_json())
                commit(staging_dir(checkpoint_id), checkpoint_id)
            except OSError as exc:
                error = f"committing {checkpoint_id} failed: {exc}"
        coord.agree(error)
        return metadata


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


def async_save(state_dict: Dict[str, Any], *, checkpoint_id: str, no_dist: bool = False,
               remove_redundancy: bool = True, save_to_minimum_rank: bool = True) -> AsyncSave:
    """:func:`save` whose file writing overlaps the caller's next steps. The pieces are
    copied to host memory before it returns (the state may change afterwards); call
    ``.result()`` on every rank to commit (the checkpoint is not visible before).

    Args:
        state_dict, checkpoint_id, no_dist, remove_redundancy, save_to_minimum_rank: as in :func:`save`.

    Example::

        pending = async_save(state, checkpoint_id="ckpt/step_10")
        ...                                 # train on
        pending.result()                    # every rank: committed
    """
    checkpoint_id = os.fspath(checkpoint_id)
    tensors, values = flatten(state_dict, for_save=True)
    job = _SaveJob(tensors, {k: v.value for k, v in values.items()}, checkpoint_id,
                   Coordinator(distributed=not no_dist), remove_redundancy, save_to_minimum_rank, snapshot=True)
    return AsyncSave(job)


def _plan_piece(ref: TensorRef) -> Piece:
    """The piece as the plan sees it: with a checksum when it is a plain tensor, whose
    copies on the ranks must agree since only one of them is written."""
    return ref.piece if ref.spec is not None else replace(ref.piece, crc32=crc32(ref.local_numpy()))


def _arrays(pieces: List[Piece], tensors: Dict[str, TensorRef], copy: bool = False) -> Dict[str, Any]:
    """Chunk key -> this rank's data of each piece (host copies with ``copy``)."""
    return {chunk_key(p.key, p.offsets): (tensors[p.key].local_numpy().copy() if copy else
                                          tensors[p.key].local_numpy()) for p in pieces}


def _write_pieces(pieces: List[Piece], arrays: Dict[str, Any], path: str) -> List[Tuple[Piece, int, int]]:
    """Write the pieces' data to ``path``; ``(piece, crc32, nbytes)`` of each. A plain tensor's
    CRC-32 from the plan (of the same data, agreed by its holders) is not computed again."""
    if not pieces:
        return []
    known = {chunk_key(p.key, p.offsets): p.crc32 for p in pieces if p.crc32 is not None}
    sums = write_file(path, arrays, checksums=known)
    return [(p, *sums[chunk_key(p.key, p.offsets)]) for p in pieces]


def _metadata(results, values: Dict[str, Any], world_size: int) -> Metadata:
    """Metadata of the chunks each rank wrote: ``results`` lists ``(rank, written)``."""
    chunks: Dict[str, list] = {}
    shapes: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for rank, written in results:
        for piece, crc, nbytes in written or ():
            chunks.setdefault(piece.key, []).append(Chunk(piece.offsets, piece.sizes, data_file_name(rank),
                                                          chunk_key(piece.key, piece.offsets), crc, nbytes))
            shapes[piece.key] = (piece.shape, piece.dtype)
    return Metadata({k: TensorEntry(shapes[k][0], shapes[k][1], tuple(sorted(c, key=lambda c: c.offsets)))
                     for k, c in chunks.items()}, values, world_size)


def _save_rank_local(tensors: Dict[str, TensorRef], values: Dict[str, Any], checkpoint_id: str, rank: int,
                     world_size: int) -> Metadata:
    os.makedirs(checkpoint_id, exist_ok=True)
    pieces = [ref.piece for ref in tensors.values() if prod(ref.piece.sizes)]
    final = os.path.join(checkpoint_id, data_file_name(rank))
    written = _write_pieces(pieces, _arrays(pieces, tensors), final + ".tmp")
    if written:
        os.replace(final + ".tmp", final)
    metadata = _metadata([(rank, written)], values, world_size)
    write_durable(os.path.join(checkpoint_id, rank_metadata_name(rank)), metadata.to_json())
    return metadata
