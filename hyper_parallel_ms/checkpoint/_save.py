"""``save``: every rank writes the chunks it was given by the write plan into its own
safetensors file; the coordinator writes the metadata and commits the directory.

Example::

    save({"model": get_model_state_dict(model), "step": 10}, checkpoint_id="ckpt/step_10")
"""
from __future__ import annotations

import os
from math import prod
from typing import Any, Dict, List, Optional, Tuple

from ._commit import commit, prepare_staging, staging_dir, write_durable
from ._dist import Coordinator
from ._metadata import METADATA_FILE, CheckpointError, Chunk, Metadata, TensorEntry
from ._pieces import TensorRef, flatten
from ._planner import Piece, chunk_key, plan_writes
from ._safetensors import write_file

__all__ = ["save", "data_file_name", "rank_metadata_name"]


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
    error = None
    if coord.rank == 0:
        try:
            prepare_staging(checkpoint_id)
        except OSError as exc:
            error = f"cannot create {staging_dir(checkpoint_id)}: {exc}"
    coord.agree(error)
    plans = coord.all_gather([ref.piece for ref in tensors.values()])
    mine = plan_writes(plans, remove_redundancy=remove_redundancy,
                       save_to_minimum_rank=save_to_minimum_rank)[coord.rank]
    path = os.path.join(staging_dir(checkpoint_id), data_file_name(coord.rank))
    written: Optional[List[Tuple[Piece, int, int]]] = None
    try:
        written = _write_pieces(mine, tensors, path)
    except Exception as exc:  # every rank must reach the next collective
        error = f"writing {path} failed: {type(exc).__name__}: {exc}"
    results = coord.all_gather((error, written))
    failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(results) if e]
    if failures:
        raise CheckpointError(f"save to {checkpoint_id} failed, nothing was committed: " + "; ".join(failures))
    metadata = _metadata([(r, w) for r, (_, w) in enumerate(results)], values, coord.world_size)
    if coord.rank == 0:
        try:
            write_durable(os.path.join(staging_dir(checkpoint_id), METADATA_FILE), metadata.to_json())
            commit(staging_dir(checkpoint_id), checkpoint_id)
        except OSError as exc:
            error = f"committing {checkpoint_id} failed: {exc}"
    coord.agree(error)
    return metadata


def _write_pieces(pieces: List[Piece], tensors: Dict[str, TensorRef], path: str) -> List[Tuple[Piece, int, int]]:
    if not pieces:
        return []
    arrays = {chunk_key(p.key, p.offsets): tensors[p.key].local_numpy() for p in pieces}
    sums = write_file(path, arrays)
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
    written = _write_pieces(pieces, tensors, final + ".tmp")
    if written:
        os.replace(final + ".tmp", final)
    metadata = _metadata([(rank, written)], values, world_size)
    write_durable(os.path.join(checkpoint_id, rank_metadata_name(rank)), metadata.to_json())
    return metadata
