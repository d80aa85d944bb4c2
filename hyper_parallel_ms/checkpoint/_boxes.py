"""Box arithmetic of checkpoints: which rank writes which chunk, and which saved chunks fill
which part of a piece.

Pure Python over boxes (global offsets and sizes): a rank describes each tensor piece it
holds as a :class:`Piece`; :func:`assign_writers` takes every rank's pieces and gives each
distinct box one writer (the lowest rank holding it, or the least loaded one), and
:func:`overlap_reads` intersects a piece to fill with the saved chunks. Layouts of any
kind (styles, DTensors, fully-sharded pieces, nested or uneven shards) reduce to boxes.

Example:
    >>> a = [Piece("w", (4, 2), "float32", (0, 0), (2, 2))]
    >>> b = [Piece("w", (4, 2), "float32", (2, 0), (2, 2))]
    >>> c = [Piece("w", (4, 2), "float32", (0, 0), (2, 2))]          # a replica of rank 0's piece
    >>> [[p.offsets for p in mine] for mine in assign_writers([a, b, c])]
    [[(0, 0)], [(2, 0)], []]
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple

from ._metadata import CheckpointError, Chunk, TensorEntry

__all__ = ["Piece", "assign_writers", "Read", "overlap_reads", "chunk_key"]

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


@dataclass(frozen=True)
class Piece:
    """A box of the global tensor ``key`` (of ``shape`` and ``dtype``) held by one rank;
    ``crc32`` of its data when the ranks' copies must agree (plain tensors, said replicated).

    Args:
        key: the flat state-dict key of the tensor (``"model.fc.weight"``).
        shape: the global shape of the tensor.
        dtype: the numpy dtype name (``"float32"``, ``"bfloat16"``, ...).
        offsets: the box's first index along each dim of the global tensor.
        sizes: the box's length along each dim.
        crc32: the CRC-32 of the box's data, or ``None`` (the default) when not compared.
        rank_state: module state each rank updates from its own batch (batch norm statistics):
            copies that differ are not an error; the lowest rank's is written.

    Example:
        >>> Piece("w", (4, 2), "float32", (2, 0), (2, 2)).elements        # rows 2..3 of a 4x2 tensor
        4
    """

    key: str
    shape: Tuple[int, ...]
    dtype: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    crc32: Optional[int] = None      # of the data, for values said to be replicated (plain tensors)
    rank_state: bool = False

    @property
    def elements(self) -> int:
        return prod(self.sizes)


def chunk_key(key: str, offsets: Sequence[int]) -> str:
    """Name of a chunk inside a data file: the tensor key and its global offsets.

    Example:
        >>> chunk_key("up.weight", (4, 0))
        'up.weight@4,0'
    """
    return f"{key}@{','.join(str(o) for o in offsets)}"


def assign_writers(held: Sequence[Sequence[Piece]], *, remove_redundancy: bool = True,
                   save_to_minimum_rank: bool = False) -> List[List[Piece]]:
    """For each rank, the pieces it writes, from the pieces each rank holds (``held[rank]``). With
    ``remove_redundancy`` each distinct box is written once: by the lowest rank holding it
    (``save_to_minimum_rank``) or by the holder with the fewest elements to write so far (spreads
    the writes). Empty boxes are skipped.
    Raises :class:`CheckpointError` when ranks disagree on a tensor's shape or dtype or on
    the data of a replicated piece, or when the pieces do not cover a tensor."""
    _check_consistent(held)
    differing = _check_replicas(held)
    writes: List[List[Piece]] = [[] for _ in held]
    if not remove_redundancy:
        written = set()
        for rank, pieces in enumerate(held):
            for p in pieces:
                box = (p.key, (p.offsets, p.sizes))
                if prod(p.sizes) and (box not in differing or box not in written):
                    writes[rank].append(p)
                    written.add(box)
        return writes
    holders: Dict[Tuple[str, Box], List[int]] = {}
    first: Dict[Tuple[str, Box], Piece] = {}
    for rank, pieces in enumerate(held):
        for p in pieces:
            if prod(p.sizes):
                box = (p.key, (p.offsets, p.sizes))
                holders.setdefault(box, []).append(rank)
                first.setdefault(box, p)
    load = [0] * len(held)
    for box in sorted(holders, key=lambda b: (-first[b].elements, b)):
        ranks = holders[box]
        # a copy that differs between ranks (module state) is the lowest rank's, whose CRC-32 the piece carries
        lowest = save_to_minimum_rank or box in differing
        writer = ranks[0] if lowest else min(ranks, key=lambda r: (load[r], r))
        load[writer] += first[box].elements
        writes[writer].append(first[box])
    for pieces in writes:
        pieces.sort(key=lambda p: (p.key, p.offsets))
    return writes


def _check_consistent(held: Sequence[Sequence[Piece]]) -> None:
    seen: Dict[str, Tuple[Tuple[int, ...], str, int]] = {}
    boxes: Dict[str, set] = {}
    for rank, pieces in enumerate(held):
        for p in pieces:
            if p.key in seen and seen[p.key][:2] != (p.shape, p.dtype):
                shape, dtype, other = seen[p.key]
                raise CheckpointError(f"tensor {p.key!r}: rank {other} has global shape {shape} {dtype}, rank "
                                      f"{rank} has {p.shape} {p.dtype}; every rank must describe the same tensor")
            seen.setdefault(p.key, (p.shape, p.dtype, rank))
            boxes.setdefault(p.key, set()).add((p.offsets, p.sizes))
    for key, distinct in boxes.items():
        covered = sum(prod(sizes) for _, sizes in distinct)
        if covered != prod(seen[key][0]):
            raise CheckpointError(f"tensor {key!r} of shape {seen[key][0]}: the ranks' pieces cover {covered} of "
                                  f"{prod(seen[key][0])} elements (overlapping or missing pieces); every element "
                                  "must be held by some rank")


def _check_replicas(held: Sequence[Sequence[Piece]]) -> set:
    """Raise where the ranks' copies of a plain tensor differ; the boxes of module state (``rank_state``)
    whose copies differ are returned instead (the lowest rank's copy is written), with a warning."""
    sums: Dict[Tuple[str, Box], Dict[int, List[int]]] = {}
    state: set = set()
    for rank, pieces in enumerate(held):
        for p in pieces:
            if p.crc32 is not None:
                box = (p.key, (p.offsets, p.sizes))
                sums.setdefault(box, {}).setdefault(p.crc32, []).append(rank)
                if p.rank_state:
                    state.add(box)
    differing = set()
    for box, by_sum in sums.items():
        if len(by_sum) > 1:
            if box in state:
                differing.add(box)
                continue
            groups = " vs ".join(f"ranks {ranks}" for ranks in by_sum.values())
            raise CheckpointError(f"tensor {box[0]!r} is a plain tensor (saved as replicated) but its data differs "
                                  f"between {groups}; if it is a piece of a sharded tensor, give its layout "
                                  "(a DTensor, a sharded Parameter or a ShardedTensor)")
    if differing:
        warnings.warn(f"module state {sorted({key for key, _ in differing})[:4]} differs between ranks (each rank "
                      "updates it from its own batch: batch norm statistics without SyncBatchNorm): the lowest "
                      "rank's copy is saved, as PyTorch's DCP saves one copy of a replicated tensor", UserWarning,
                      stacklevel=4)
    return differing


@dataclass(frozen=True)
class Read:
    """Copy ``chunk[src]`` into ``piece[dst]`` (slices relative to the chunk and the piece)."""

    chunk: Chunk
    src: Tuple[slice, ...]
    dst: Tuple[slice, ...]


def overlap_reads(key: str, entry: TensorEntry, offsets: Sequence[int], sizes: Sequence[int],
                  source: str) -> List[Read]:
    """The reads that fill the box (``offsets``, ``sizes``) of tensor ``key`` from the saved
    chunks; raises :class:`CheckpointError` naming ``source`` if they do not cover it."""
    reads, covered, seen = [], 0, set()
    for chunk in entry.chunks:
        box = (chunk.offsets, chunk.sizes)
        if box in seen:          # a replica written twice (remove_redundancy=False)
            continue
        seen.add(box)
        lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
        hi = [min(o + s, c + n) for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
        if all(h > l for l, h in zip(lo, hi)):
            reads.append(Read(chunk, tuple(slice(l - c, h - c) for l, h, c in zip(lo, hi, chunk.offsets)),
                              tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))))
            covered += prod(h - l for l, h in zip(lo, hi))
    if covered != prod(sizes):
        raise CheckpointError(f"tensor {key!r}: the saved chunks in {source} cover {covered} of the {prod(sizes)} "
                              f"elements of the box at {tuple(offsets)} of size {tuple(sizes)}; the checkpoint "
                              "is incomplete")
    return reads
