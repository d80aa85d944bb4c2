"""HyperParallel's tensor-map helpers that MindFormers' Muon optimizer imports:
``core.dtensor.layout._infer_slice_area_by_rank`` and ``core.dtensor.redistribute_infer.DevMat`` /
``RedistributionOperatorInfer``, on this library's :class:`~hyper_parallel_ms.layout.Layout` and
redistribution planner.

Conventions (HyperParallel's, MindSpore's): a mesh is ``mesh_shape`` with its ranks listed
row-major (``rank_list``, the last mesh dim varying fastest); a tensor map has one entry per tensor
dim, ``-1`` (not sharded), ``k`` (sharded by mesh dim ``len(mesh_shape) - 1 - k``) or a tuple of
such entries (major first). Mesh dims passed to :class:`DevMat` are counted from the left.

Example:
    >>> infer_slice_area_by_rank((2, 2), (1, 0), 3, (4, 6))
    [(2, 4), (3, 6)]
    >>> DevMat([2, 2]).get_devices_along_dim(3, [0, 1, 2, 3], 0)
    [1, 3]
    >>> RedistributionOperatorInfer([2, 2], [1, 0], [-1, -1]).infer_ops_list(0, [0, 1, 2, 3])
    [('all_concat', (0, 2, [0, 2])), ('all_concat', (1, 2, [0, 1]))]
"""
from __future__ import annotations

import numbers
from math import prod
from typing import List, Sequence, Tuple, Union

import numpy as np

from ..layout import Layout
from ..redistribute._planner import plan_redistribute

__all__ = ["infer_slice_area_by_rank", "DevMat", "RedistributionOperatorInfer"]

MapEntry = Union[int, Tuple[int, ...]]


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an int, got {value!r}")
    return int(value)


def infer_slice_area_by_rank(mesh_shape: Sequence[int], tensor_map: Sequence[MapEntry], rank_id: int,
                             full_shape: Sequence[int]) -> List[Tuple[int, int]]:
    """The ``(begin, end)`` range of each tensor dim that the ``rank_id``-th rank of the mesh holds
    (HyperParallel's ``_infer_slice_area_by_rank``): ``rank_id`` is the position in the row-major
    ``rank_list``, not a global rank.

    Pieces are this library's (:meth:`Layout.local_slices`, as ``distribute_tensor`` cuts them):
    equal for sizes that divide; for sizes that do not, ``torch.chunk``'s (HyperParallel floors the
    piece size there and leaves the tail out).

    Args:
        mesh_shape: the mesh shape.
        tensor_map: one entry per tensor dim (``-1``, a mesh dim counted from the right, or a tuple).
        rank_id: the rank's position in the mesh, in ``[0, prod(mesh_shape))``.
        full_shape: the tensor's global shape (as many dims as ``tensor_map`` has entries).

    Example:
        >>> infer_slice_area_by_rank((2, 4), ((1, 0), -1), 5, (16, 3))
        [(10, 12), (0, 3)]
    """
    layout = Layout.from_tensor_map(mesh_shape, tensor_map)
    shape = tuple(_int(s, "a full_shape entry") for s in full_shape)
    if len(shape) != len(tuple(tensor_map)):
        raise ValueError(f"full_shape {shape} has {len(shape)} dims but the tensor map {tuple(tensor_map)!r} "
                         f"has {len(tuple(tensor_map))} entries")
    index = _int(rank_id, "rank_id")
    size = prod(layout.mesh_shape)
    if not 0 <= index < size:
        raise ValueError(f"rank_id {index} is not a position in a mesh of {size} ranks {layout.mesh_shape}")
    coordinate = tuple(int(c) for c in np.unravel_index(index, layout.mesh_shape))
    return [(s.start, s.stop) for s in layout.local_slices(shape, coordinate)]


class DevMat:
    """HyperParallel's device matrix: a mesh shape and the groups of ranks along mesh dims.

    Args:
        dims: the mesh shape (sizes of the mesh dims, from the left).

    Example:
        >>> DevMat([2, 4]).get_dim_by_reverse_idx(0), DevMat([2, 4]).get_dim_by_reverse_idx((1, 0))
        (4, 8)
    """

    def __init__(self, dims: Sequence[int]) -> None:
        self.dims = [_int(d, "a DevMat dim") for d in dims]
        if not self.dims or any(d < 1 for d in self.dims):
            raise ValueError(f"DevMat dims must be positive ints, got {list(dims)!r}")

    def get_dim_by_reverse_idx(self, idx: MapEntry) -> int:
        """The size of the mesh dim ``idx`` counted from the right (a tensor-map entry); for a tuple,
        the product of the sizes.

        Args:
            idx: a mesh dim counted from the right, or a tuple of them.

        Example:
            >>> DevMat([2, 3]).get_dim_by_reverse_idx(1)
            2
        """
        entries = tuple(idx) if isinstance(idx, (tuple, list)) else (idx,)
        size = 1
        for entry in entries:
            entry = _int(entry, "a reverse mesh dim")
            if not 0 <= entry < len(self.dims):
                raise ValueError(f"reverse mesh dim {entry} is out of range for DevMat {self.dims}")
            size *= self.dims[len(self.dims) - 1 - entry]
        return size

    def get_devices_along_dim(self, rank: int, rank_list: Sequence[int], dim: Union[int, Sequence[int]]) -> List[int]:
        """The ranks that share ``rank``'s coordinates on every mesh dim except ``dim`` (mesh dims
        counted from the left); for a list of dims, those varying on all of them, ordered row-major
        over the dims in the order given (the first one major).

        Args:
            rank: a rank of ``rank_list``.
            rank_list: the mesh's ranks, row-major (``prod(dims)`` of them).
            dim: a mesh dim, or a list of distinct mesh dims.

        Raises:
            ValueError: a dim out of range or repeated, ``rank_list`` of the wrong length, or
                ``rank`` not in it.

        Example:
            >>> DevMat([2, 2, 2]).get_devices_along_dim(5, list(range(8)), [2, 0])
            [0, 4, 1, 5]
        """
        axes = [_int(a, "a mesh dim") for a in (dim if isinstance(dim, (list, tuple)) else [dim])]
        for axis in axes:
            if not 0 <= axis < len(self.dims):
                raise ValueError(f"Dimension {axis} out of range [0, {len(self.dims)}) of DevMat {self.dims}")
        if len(set(axes)) != len(axes) or not axes:
            raise ValueError(f"get_devices_along_dim: the mesh dims {axes} must be distinct and at least one")
        ranks = [int(r) for r in rank_list]
        if len(ranks) != prod(self.dims):
            raise ValueError(f"rank_list length ({len(ranks)}) doesn't match mesh shape product "
                             f"({prod(self.dims)}) of DevMat {self.dims}")
        if int(rank) not in ranks:
            raise ValueError(f"Rank {rank} not in rank_list {ranks}")
        grid = np.array(ranks).reshape(self.dims)
        here = np.unravel_index(ranks.index(int(rank)), self.dims)
        index = tuple(slice(None) if a in axes else int(c) for a, c in enumerate(here))
        kept = [a for a in range(len(self.dims)) if a in axes]          # the order indexing leaves them in
        lines = np.transpose(grid[index], [kept.index(a) for a in axes])
        return [int(r) for r in lines.ravel()]


class RedistributionOperatorInfer:
    """HyperParallel's redistribution op inference between two tensor maps of one mesh: the steps
    that take this rank's piece of the ``in_tensor_map`` layout to its piece of ``out_tensor_map``,
    planned by this library's redistribution planner.

    Args:
        dev_mat: the mesh shape.
        in_tensor_map: the tensor map the tensor is in.
        out_tensor_map: the tensor map it should be in (as many entries).
        use_permute: ``True``: an all-to-all moves a mesh dim from one tensor dim to another;
            ``False``: an ``all_concat`` then an ``all_split`` on the same group instead.

    Example:
        >>> RedistributionOperatorInfer([2], [0, -1], [-1, 0]).infer_ops_list(5, [4, 5])
        [('all_to_all', (1, 0, 2, [4, 5]))]
    """

    def __init__(self, dev_mat: Sequence[int], in_tensor_map: Sequence[MapEntry],
                 out_tensor_map: Sequence[MapEntry], use_permute: bool = True) -> None:
        self.dev_mat = DevMat(dev_mat)
        self.in_tensor_map = list(in_tensor_map)
        self.out_tensor_map = list(out_tensor_map)
        self.use_permute = bool(use_permute)
        if len(self.in_tensor_map) != len(self.out_tensor_map):
            raise ValueError(f"in_tensor_map {self.in_tensor_map} and out_tensor_map {self.out_tensor_map} "
                             f"describe tensors of different ranks")
        mesh = tuple(self.dev_mat.dims)
        self._src = Layout.from_tensor_map(mesh, self.in_tensor_map)
        self._dst = Layout.from_tensor_map(mesh, self.out_tensor_map)

    def _steps(self) -> List[Tuple[str, int, int, Tuple[int, ...]]]:
        """``(kind, dim, other dim, mesh dims major first)``: the planner's steps on a shape every
        sharding divides, size-1 mesh dims left out, steps on one tensor dim in a row merged.
        Gathers only (a layout to a less sharded one) commute across tensor dims: they go in tensor
        dim order, so each tensor dim is gathered by one ``all_concat``, as HyperParallel lists them."""
        ndim = len(self.in_tensor_map)
        shape = (prod(self.dev_mat.dims),) * ndim
        raw: List[Tuple[str, int, int, int]] = []
        for step in plan_redistribute(self._src, self._dst, shape):
            kind = {"all_gather": "all_concat", "chunk": "all_split", "all_to_all": "all_to_all"}.get(step.kind)
            if kind is None:                        # no Partial in a tensor map: the planner never needs it
                raise RuntimeError(f"RedistributionOperatorInfer: unexpected step {step} between tensor maps "
                                   f"{self.in_tensor_map} and {self.out_tensor_map}")
            if self.dev_mat.dims[step.mesh_dim] == 1:
                continue
            if kind == "all_to_all" and not self.use_permute:
                raw += [("all_concat", step.dim, -1, step.mesh_dim), ("all_split", step.to_dim, -1, step.mesh_dim)]
            elif kind == "all_to_all":
                raw.append((kind, step.to_dim, step.dim, step.mesh_dim))
            else:
                raw.append((kind, step.dim, -1, step.mesh_dim))
        if all(kind == "all_concat" for kind, *_ in raw):
            raw.sort(key=lambda item: item[1])     # stable: within a tensor dim, minor-most mesh dim first
        merged: List[Tuple[str, int, int, Tuple[int, ...]]] = []
        for kind, dim, other, axis in raw:
            last = merged[-1] if merged else None
            if kind != "all_to_all" and last is not None and last[0] == kind and last[1] == dim:
                # gathers undo the minor-most mesh dim first (the new one is major); splits add minor ones
                merged[-1] = (kind, dim, -1, (axis,) + last[3] if kind == "all_concat" else last[3] + (axis,))
            else:
                merged.append((kind, dim, other, (axis,)))
        return merged

    def infer_ops_list(self, rank: int, rank_list: Sequence[int]) -> List[Tuple[str, Tuple]]:
        """The ops this rank runs, in order, with their groups of global ranks:
        ``("all_concat", (dim, size, group))`` (gather the group's pieces along ``dim``, in group
        order), ``("all_split", (dim, size, group))`` (keep this rank's part of ``dim``, no
        communication) and ``("all_to_all", (split_dim, concat_dim, size, group))``. Empty when the
        maps agree.

        Args:
            rank: this rank (global), one of ``rank_list``.
            rank_list: the mesh's global ranks, row-major.

        Example:
            >>> RedistributionOperatorInfer([2, 2], [(1, 0), -1], [-1, -1]).infer_ops_list(2, [0, 1, 2, 3])
            [('all_concat', (0, 4, [0, 1, 2, 3]))]
        """
        ops: List[Tuple[str, Tuple]] = []
        for kind, dim, other, axes in self._steps():
            group = self.dev_mat.get_devices_along_dim(rank, rank_list, list(axes))
            size = prod(self.dev_mat.dims[a] for a in axes)
            ops.append((kind, (dim, other, size, group) if kind == "all_to_all" else (dim, size, group)))
        return ops
