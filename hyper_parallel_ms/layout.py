"""Layout: from (mesh shape, placements) to each rank's local shape and global offset.

A ``Layout`` says how a global tensor lies on a device mesh: one placement per mesh
dimension and, when several mesh dimensions shard the same tensor dimension, the
order in which they split it (major first, the default being ascending mesh
dimension, as in PyTorch). Sizes that do not divide evenly follow ``torch.chunk``:
the chunk size is ``ceil(size / n)`` and trailing ranks get smaller or empty chunks
(5 rows on 4 ranks give 2, 2, 1, 0). Nested sharding splits the major piece again.

Layouts can also be written with alias names, one entry per tensor dimension, as in
MindSpore's ``Layout``: a mesh dimension name, ``"None"`` (not sharded) or a tuple of
names (sharded over several mesh dimensions, major first).

Pure Python: no MindSpore import.

Example:
    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Shard, Replicate
    >>> lay = Layout((2, 2), (Shard(0), Shard(0)))
    >>> [lay.local_shape((5, 3), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    [(2, 3), (1, 3), (1, 3), (1, 3)]
    >>> Layout.from_alias((2, 2), ("dp", "tp"), ("tp", "None")).placements
    (Replicate(), Shard(dim=0))
"""
from __future__ import annotations

import itertools
from math import prod
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

from ._layout_notations import AliasEntry, LayoutNotations
from ._layout_notations import check_mesh_shape as _check_mesh_shape
from .placement import Partial, Placement, Replicate, Shard

__all__ = ["Layout", "chunk_sizes", "chunk_offsets", "AliasEntry"]

Shape = Tuple[int, ...]


def chunk_sizes(size: int, parts: int) -> Tuple[int, ...]:
    """Sizes of ``parts`` chunks of ``size`` elements with ``torch.chunk`` semantics.

    Example:
        >>> chunk_sizes(5, 4), chunk_sizes(6, 4), chunk_sizes(8, 4)
        ((2, 2, 1, 0), (2, 2, 2, 0), (2, 2, 2, 2))
    """
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    if size < 0:
        raise ValueError(f"cannot split a negative size {size}")
    step = -(-size // parts)
    return tuple(max(0, min(step, size - i * step)) for i in range(parts))


def chunk_offsets(size: int, parts: int) -> Tuple[int, ...]:
    """Start offsets of the chunks of :func:`chunk_sizes`.

    Example:
        >>> chunk_offsets(5, 4)
        (0, 2, 4, 5)
    """
    step = -(-size // parts)
    return tuple(min(i * step, size) for i in range(parts))


class Layout(LayoutNotations):
    """Placements of a tensor over a mesh, with the local-shape and offset arithmetic.

    HyperParallel's (and MindSpore's) form is accepted too: ``Layout(mesh_shape, alias_name)``
    names the mesh dims (every one Replicate), and calling a layout that has names with one
    alias entry per tensor dim, or with placements, gives that tensor's layout
    (``layout("dp", "None")``); such a layout serves wherever placements are taken.

    Args:
        mesh_shape: the device mesh shape, e.g. ``(2, 4)``.
        placements: one ``Shard``/``Replicate``/``Partial`` per mesh dimension, or (HyperParallel's
            ``alias_name``) one name per mesh dimension.
        rank_list: HyperParallel's: the ranks of the mesh in order; only ``range(prod(mesh_shape))``
            (a layout holds no ranks: a sub-mesh is the :class:`DeviceMesh` a DTensor is given).
        mesh_dim_names: optional names of the mesh dimensions.
        shard_order: for a tensor dimension sharded by several mesh dimensions, the
            mesh dimensions from major to minor (default: ascending).

    Example:
        >>> from hyper_parallel_ms.placement import Shard, Replicate
        >>> lay = Layout((4,), (Shard(0),))
        >>> [lay.local_shape((5,), (r,)) for r in range(4)]
        [(2,), (2,), (1,), (0,)]
        >>> lay.global_offset((5,), (2,))
        (4,)
        >>> Layout((2, 2), ("dp", "tp"))("tp", "None").placements
        (Replicate(), Shard(dim=0))
    """

    __slots__ = ("mesh_shape", "mesh_dim_names", "placements", "shard_order", "_hash")

    def __init__(self, mesh_shape: Sequence[int], placements: Sequence[Placement],
                 rank_list: Optional[Sequence[int]] = None, *,
                 mesh_dim_names: Optional[Sequence[str]] = None,
                 shard_order: Optional[Mapping[int, Sequence[int]]] = None) -> None:
        shape = _check_mesh_shape(mesh_shape)
        if rank_list is not None and tuple(rank_list) != tuple(range(prod(shape))):
            raise NotImplementedError(
                f"Layout rank_list {tuple(rank_list)}: a layout holds no ranks here; build the DeviceMesh of those "
                f"ranks (DeviceMesh(device_type, mesh=np.array(rank_list).reshape({shape}), mesh_dim_names=...)) "
                f"and give it with the placements")
        placements = tuple(placements)
        if placements and all(isinstance(p, str) for p in placements):       # HyperParallel's alias_name
            if mesh_dim_names is not None:
                raise ValueError(f"Layout got mesh dim names twice: {placements} and mesh_dim_names={mesh_dim_names}")
            if len(placements) != len(shape):
                raise ValueError(f"Layout alias_name {placements} names {len(placements)} mesh dims of the "
                                 f"{len(shape)}-D mesh {shape}")
            if "None" in placements:
                raise ValueError(f"Layout alias_name {placements}: 'None' means an unsharded tensor dim, it cannot "
                                 f"name a mesh dim")
            mesh_dim_names, placements = placements, (Replicate(),) * len(placements)
        if len(placements) != len(shape):
            raise ValueError(f"expected {len(shape)} placements for a {len(shape)}-D mesh {shape}, "
                             f"got {len(placements)}: {_fmt(placements)}")
        for p in placements:
            if not isinstance(p, Placement) or type(p) is Placement:
                raise TypeError(f"placements must be Shard, Replicate or Partial, got {p!r}")
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        if names is not None and len(names) != len(shape):
            raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {len(shape)}-D mesh")
        order = {}
        for dim, axes in (shard_order or {}).items():
            axes = tuple(axes)
            if len(set(axes)) != len(axes) or any(not 0 <= a < len(shape) for a in axes):
                raise ValueError(f"shard_order[{dim}] = {axes} must list distinct mesh dims in [0, {len(shape)})")
            for a in axes:
                if not placements[a].is_shard():
                    raise ValueError(f"shard_order[{dim}] names mesh dim {a}, whose placement is "
                                     f"{placements[a]}, not a Shard")
            order[dim] = axes
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "mesh_dim_names", names)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "shard_order", tuple(sorted(order.items())))
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, name, value):
        raise AttributeError("Layout is immutable")

    @classmethod
    def replicated(cls, mesh_shape: Sequence[int], mesh_dim_names: Optional[Sequence[str]] = None) -> "Layout":
        """Every mesh dim Replicate.

        Example:
            >>> Layout.replicated((2, 2)).placements
            (Replicate(), Replicate())
        """
        return cls(mesh_shape, (Replicate(),) * len(tuple(mesh_shape)), mesh_dim_names=mesh_dim_names)

    def with_placements(self, placements: Sequence[Placement]) -> "Layout":
        """The same mesh, names and shard order with other placements (the mesh dims named in
        the shard order must stay Shard).

        Example:
            >>> Layout((2, 2), (Shard(0), Partial())).with_placements((Shard(0), Replicate())).placements
            (Shard(dim=0), Replicate())
        """
        return Layout(self.mesh_shape, placements, mesh_dim_names=self.mesh_dim_names,
                      shard_order=dict(self.shard_order))

    # ------------------------------------------------------------- normalising
    def normalized(self, ndim: int) -> "Layout":
        """The same layout with non-negative Shard dims, checked against ``ndim``.

        Example:
            >>> Layout((2,), (Shard(-1),)).normalized(3).placements
            (Shard(dim=2),)
        """
        placements = tuple(Shard(_norm_dim(p.dim, ndim, self)) if p.is_shard() else p
                           for p in self.placements)
        order = {}
        for dim, axes in self.shard_order:
            d = _norm_dim(dim, ndim, self)
            for a in axes:
                if placements[a] != Shard(d):
                    raise ValueError(f"shard_order gives tensor dim {dim} the mesh dims {axes}, but mesh dim "
                                     f"{a} has placement {self.placements[a]}")
            sharding = [a for a, p in enumerate(placements) if p == Shard(d)]
            if sorted(axes) != sharding:
                raise ValueError(f"shard_order[{dim}] = {axes} must list exactly the mesh dims sharding "
                                 f"tensor dim {dim}: {tuple(sharding)}")
            if list(axes) != sharding:
                order[d] = axes
        if placements == self.placements and tuple(sorted(order.items())) == self.shard_order:
            return self
        return Layout(self.mesh_shape, placements, mesh_dim_names=self.mesh_dim_names, shard_order=order)

    def sharding_axes(self, ndim: int) -> Tuple[Tuple[int, ...], ...]:
        """For each tensor dim, the mesh dims sharding it, major first.

        Example:
            >>> Layout((2, 2), (Shard(0), Shard(0)), shard_order={0: (1, 0)}).sharding_axes(2)
            ((1, 0), ())
        """
        norm = self.normalized(ndim)
        explicit = dict(norm.shard_order)
        return tuple(explicit.get(d, tuple(a for a, p in enumerate(norm.placements) if p == Shard(d)))
                     for d in range(ndim))

    # ------------------------------------------------------------- arithmetic
    def even_global_shape(self, local_shape: Sequence[int]) -> Shape:
        """The global shape whose even pieces have ``local_shape`` (as ``DTensor.from_local``
        assumes without ``shape=``).

        Example:
            >>> Layout((2, 2), (Shard(0), Shard(1))).even_global_shape((3, 4))
            (6, 8)
        """
        return tuple(s * prod(self.mesh_shape[a] for a in axes)
                     for s, axes in zip(local_shape, self.sharding_axes(len(local_shape))))

    def local_shape(self, global_shape: Sequence[int], coordinate: Sequence[int]) -> Shape:
        """Shape of the piece held by the rank at mesh ``coordinate``."""
        return self._local_box(global_shape, coordinate)[1]

    def global_offset(self, global_shape: Sequence[int], coordinate: Sequence[int]) -> Shape:
        """Global index of the first element of the piece held at ``coordinate``."""
        return self._local_box(global_shape, coordinate)[0]

    def local_slices(self, global_shape: Sequence[int], coordinate: Sequence[int]) -> Tuple[slice, ...]:
        """Slices of the global tensor that make the piece held at ``coordinate``.

        Example:
            >>> Layout((2,), (Shard(1),)).local_slices((2, 3), (1,))
            (slice(0, 2, None), slice(2, 3, None))
        """
        offset, shape = self._local_box(global_shape, coordinate)
        return tuple(slice(o, o + s) for o, s in zip(offset, shape))

    def local_shapes(self, global_shape: Sequence[int]) -> Dict[Tuple[int, ...], Shape]:
        """Local shape of every mesh coordinate.

        Example:
            >>> Layout((2,), (Shard(0),)).local_shapes((3,))
            {(0,): (2,), (1,): (1,)}
        """
        return {c: self.local_shape(global_shape, c) for c in self.coordinates()}

    def empty_piece(self, global_shape: Sequence[int]) -> Optional[Shape]:
        """The shape of an empty piece some rank holds while ``global_shape`` is not empty, else
        ``None`` (every coordinate of the mesh dims that shard: nested ``torch.chunk`` pieces do
        not shrink in one direction).

        Example:
            >>> Layout((4,), (Shard(0),)).empty_piece((5, 3)), Layout((4,), (Shard(0),)).empty_piece((8, 3))
            ((0, 3), None)
        """
        if 0 in tuple(global_shape):
            return None
        cutting = [d for d, p in enumerate(self.placements) if p.is_shard()]
        for coords in itertools.product(*(range(self.mesh_shape[d]) for d in cutting)):
            coordinate = [0] * len(self.mesh_shape)
            for d, c in zip(cutting, coords):
                coordinate[d] = c
            shape = self.local_shape(global_shape, tuple(coordinate))
            if 0 in shape:
                return shape
        return None

    def coordinates(self) -> Iterator[Tuple[int, ...]]:
        """All mesh coordinates in row-major (rank) order."""
        return itertools.product(*(range(n) for n in self.mesh_shape))

    def shard_sizes(self, global_shape: Sequence[int], coordinate: Sequence[int], mesh_dim: int) -> Tuple[int, ...]:
        """Sizes along the tensor dim sharded by ``mesh_dim`` of the pieces held by the ranks
        that differ from ``coordinate`` only in ``mesh_dim`` (in mesh-dim order).

        Example:
            >>> Layout((4,), (Shard(0),)).shard_sizes((5, 2), (0,), 0)
            (2, 2, 1, 0)
        """
        p = self.placements[mesh_dim]
        if not p.is_shard():
            raise ValueError(f"mesh dim {mesh_dim} does not shard the tensor: placement {p}")
        dim = _norm_dim(p.dim, len(global_shape), self)
        coord = list(coordinate)
        sizes = []
        for k in range(self.mesh_shape[mesh_dim]):
            coord[mesh_dim] = k
            sizes.append(self.local_shape(global_shape, coord)[dim])
        return tuple(sizes)

    def _local_box(self, global_shape: Sequence[int], coordinate: Sequence[int]) -> Tuple[Shape, Shape]:
        shape = tuple(global_shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise ValueError(f"global shape must be non-negative ints, got {global_shape!r}")
        coord = tuple(coordinate)
        if len(coord) != len(self.mesh_shape) or any(not 0 <= c < n for c, n in zip(coord, self.mesh_shape)):
            raise ValueError(f"coordinate {coord} is not in mesh of shape {self.mesh_shape}")
        offsets, sizes = [0] * len(shape), list(shape)
        for dim, axes in enumerate(self.sharding_axes(len(shape))):
            for axis in axes:
                n, k = self.mesh_shape[axis], coord[axis]
                offsets[dim] += chunk_offsets(sizes[dim], n)[k]
                sizes[dim] = chunk_sizes(sizes[dim], n)[k]
        return tuple(offsets), tuple(sizes)

    # ---------------------------------------------------------------- queries
    def partial_dims(self) -> Tuple[Tuple[int, str], ...]:
        """``(mesh_dim, reduce_op)`` for every Partial placement."""
        return tuple((a, p.reduce_op) for a, p in enumerate(self.placements) if isinstance(p, Partial))

    def is_replicated(self) -> bool:
        """True when every rank holds the full, final tensor."""
        return all(p.is_replicate() for p in self.placements)

    # ------------------------------------------------------------ value object
    def _key(self):
        return (self.mesh_shape, self.mesh_dim_names, self.placements, self.shard_order)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(self._key()))
        return self._hash

    def __reduce__(self):
        return (_rebuild_layout, self._key())

    def __repr__(self) -> str:
        extra = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        extra += f", shard_order={dict(self.shard_order)}" if self.shard_order else ""
        return f"Layout({self.mesh_shape}, {_fmt(self.placements)}{extra})"

    def __str__(self) -> str:
        return _fmt(self.placements)


def _rebuild_layout(mesh_shape, names, placements, order) -> Layout:
    return Layout(mesh_shape, placements, mesh_dim_names=names, shard_order=dict(order))


def _fmt(placements: Sequence[object]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _norm_dim(dim: int, ndim: int, layout: Layout) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"Shard dim {dim} is out of range for a {ndim}-D tensor "
                         f"(layout {layout}); valid dims are [{-ndim}, {ndim - 1}]")
    return dim % ndim
