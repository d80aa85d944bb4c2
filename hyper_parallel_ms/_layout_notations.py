"""The notations a :class:`~hyper_parallel_ms.layout.Layout` is also written in: alias names per
tensor dim (MindSpore's and HyperParallel's ``Layout``: a mesh dim name, ``"None"``, or a tuple of
names, major first), MindSpore's tensor map (mesh dims counted from the right), HyperParallel's
``layout(...)`` call and its ``repeat_num`` / ``get_global_shape``. A mixin of ``Layout``: each
method reads the layout's placements through ``sharding_axes`` and builds layouts with its class.

Pure Python: no MindSpore import.

Example:
    >>> from hyper_parallel_ms.layout import Layout
    >>> Layout.from_alias((2, 2), ("dp", "tp"), ("tp", "None")).placements
    (Replicate(), Shard(dim=0))
"""
from __future__ import annotations

import numbers
from math import prod
from typing import Dict, Optional, Sequence, Tuple, Union

from .placement import Placement, Replicate, Shard

__all__ = ["LayoutNotations", "AliasEntry", "check_mesh_shape"]

AliasEntry = Union[str, None, Tuple[str, ...]]
Shape = Tuple[int, ...]


def check_mesh_shape(mesh_shape: Sequence[int]) -> Shape:
    """``mesh_shape`` as a tuple of positive ints, or ``ValueError``.

    >>> check_mesh_shape([2, 4])
    (2, 4)
    """
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh shape must be a non-empty tuple of positive ints, got {mesh_shape!r}")
    return shape


class LayoutNotations:
    """The alias, tensor-map and HyperParallel forms of a layout (mixed into ``Layout``).

    Example:
        >>> from hyper_parallel_ms.layout import Layout
        >>> Layout((2, 4), (Shard(1), Shard(0))).tensor_map(2)
        (0, 1)
    """

    __slots__ = ()

    @classmethod
    def from_alias(cls, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str],
                   alias: Sequence[AliasEntry]) -> "Layout":
        """Build a layout from one alias entry per tensor dimension.

        Each entry is a mesh dimension name, ``"None"``/``None`` for "not sharded", or a
        tuple of names (sharded over several mesh dimensions, major first).

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout.from_alias((2, 2), ("dp", "tp"), (("tp", "dp"), "None")).shard_order
            ((0, (1, 0)),)
        """
        shape = check_mesh_shape(mesh_shape)
        names = tuple(mesh_dim_names)
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(f"mesh_dim_names {names} must be {len(shape)} distinct names")
        if isinstance(alias, str):
            raise TypeError(f"alias layout must be a sequence with one entry per tensor dim, got {alias!r}")
        used: Dict[str, int] = {}
        sharding = []
        for dim, entry in enumerate(alias):
            axes = []
            for name in _alias_names(entry):
                if name not in names:
                    raise ValueError(f"unknown mesh dim name {name!r} in alias layout {tuple(alias)!r}; "
                                     f"the mesh has {names}")
                if name in used:
                    raise ValueError(f"mesh dim {name!r} shards tensor dims {used[name]} and {dim} in "
                                     f"alias layout {tuple(alias)!r}; a mesh dim can shard one tensor dim")
                used[name] = dim
                axes.append(names.index(name))
            sharding.append(axes)
        return cls._from_sharding_axes(shape, sharding, names)

    @classmethod
    def _from_sharding_axes(cls, shape: Shape, sharding: Sequence[Sequence[int]],
                            mesh_dim_names: Optional[Sequence[str]]) -> "Layout":
        """The layout in which tensor dim ``d`` is sharded by the mesh dims ``sharding[d]``, major first
        (each mesh dim in one list at most: the callers check it, naming it in their notation)."""
        placements: list = [Replicate()] * len(shape)
        order: Dict[int, Tuple[int, ...]] = {}
        for dim, axes in enumerate(sharding):
            for axis in axes:
                placements[axis] = Shard(dim)
            if len(axes) > 1 and list(axes) != sorted(axes):
                order[dim] = tuple(axes)
        return cls(shape, placements, mesh_dim_names=mesh_dim_names, shard_order=order)

    @classmethod
    def from_device_mesh(cls, device_mesh) -> "Layout":
        """HyperParallel's: the layout of ``device_mesh``'s shape and dim names (every dim Replicate),
        to be called per tensor.

        Example::

            layout = Layout.from_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
            layout("dp", "None")
        """
        names = device_mesh.mesh_dim_names
        if not names:
            raise ValueError(f"Layout.from_device_mesh needs a mesh with mesh_dim_names, got {device_mesh!r}")
        return cls(tuple(device_mesh.shape), tuple(names))

    @classmethod
    def from_tensor_map(cls, mesh_shape: Sequence[int], tensor_map: Sequence[Union[int, Sequence[int]]],
                        mesh_dim_names: Optional[Sequence[str]] = None) -> "Layout":
        """The inverse of :meth:`tensor_map`: a layout from MindSpore's / HyperParallel's tensor map,
        one entry per tensor dim: ``-1`` (not sharded), ``k`` (sharded by mesh dim
        ``len(mesh_shape) - 1 - k``), or a tuple of such entries (sharded by several, major first;
        ``-1`` inside a tuple is skipped).

        Args:
            mesh_shape: the device mesh shape.
            tensor_map: one entry per tensor dim, as above.
            mesh_dim_names: optional names of the mesh dims.

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout.from_tensor_map((2, 4), (0, -1)).placements
            (Replicate(), Shard(dim=0))
            >>> Layout.from_tensor_map((2, 2), ((0, 1), -1)).sharding_axes(2)
            ((1, 0), ())
        """
        shape = check_mesh_shape(mesh_shape)
        last = len(shape) - 1
        used: Dict[int, int] = {}
        sharding = []
        for dim, entry in enumerate(tensor_map):
            axes = []
            for item in tuple(entry) if isinstance(entry, (tuple, list)) else (entry,):
                if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not -1 <= item <= last:
                    raise ValueError(f"tensor map {tuple(tensor_map)!r}: entry {item!r} of tensor dim {dim} is not -1 "
                                     f"or a mesh dim counted from the right in [0, {last}] (mesh {shape})")
                if item == -1:
                    continue
                axis = last - int(item)
                if axis in used:
                    raise ValueError(f"tensor map {tuple(tensor_map)!r}: mesh dim {axis} shards tensor dims "
                                     f"{used[axis]} and {dim}; a mesh dim shards one tensor dim")
                used[axis] = dim
                axes.append(axis)
            sharding.append(axes)
        return cls._from_sharding_axes(shape, sharding, mesh_dim_names)

    @property
    def alias_name(self) -> Optional[Tuple[str, ...]]:
        """HyperParallel's name for :attr:`mesh_dim_names`."""
        return self.mesh_dim_names

    def __call__(self, *entries: Union[AliasEntry, Placement]) -> "Layout":
        """HyperParallel's: this mesh's layout of a tensor, given one alias entry per tensor dim
        (a mesh dim name, ``"None"``, or a tuple of names, major first), or one placement per mesh
        dim (also as one tuple).

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout((2, 2), ("dp", "tp"))(("dp", "tp"), "None").placements
            (Shard(dim=0), Shard(dim=0))
        """
        if len(entries) == 1 and isinstance(entries[0], (tuple, list)) and entries[0] and \
                all(isinstance(p, Placement) for p in entries[0]):
            entries = tuple(entries[0])
        if entries and all(isinstance(p, Placement) for p in entries):
            return type(self)(self.mesh_shape, entries, mesh_dim_names=self.mesh_dim_names)
        if any(isinstance(p, Placement) for p in entries):
            raise TypeError(f"a layout call mixes Placement objects and alias names: {entries}; use one form")
        if self.mesh_dim_names is None:
            raise ValueError(f"alias entries {entries} need a layout with mesh dim names: "
                             f"Layout({self.mesh_shape}, alias_name)")
        return type(self).from_alias(self.mesh_shape, self.mesh_dim_names, entries)

    def to_alias(self, ndim: int) -> Tuple[AliasEntry, ...]:
        """Alias form (needs ``mesh_dim_names``); Partial placements are not representable.

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout((2, 2), (Shard(1), Replicate()), mesh_dim_names=("dp", "tp")).to_alias(2)
            ('None', 'dp')
        """
        if self.mesh_dim_names is None:
            raise ValueError("to_alias needs a layout with mesh_dim_names")
        if any(p.is_partial() for p in self.placements):
            raise ValueError(f"alias layouts cannot express Partial placements: {self}")
        out: list = []
        for axes in self.sharding_axes(ndim):
            named = tuple(self.mesh_dim_names[a] for a in axes)
            out.append("None" if not named else named[0] if len(named) == 1 else named)
        return tuple(out)

    def tensor_map(self, ndim: int) -> Tuple[Union[int, Tuple[int, ...]], ...]:
        """MindSpore tensor map: per tensor dim the sharding mesh dims counted from the
        right of the mesh shape (``-1``: not sharded; a tuple when several, major first).

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout((2, 4), (Shard(1), Shard(0))).tensor_map(2)
            (0, 1)
        """
        last = len(self.mesh_shape) - 1
        out: list = []
        for axes in self.sharding_axes(ndim):
            mapped = tuple(last - a for a in axes)
            out.append(-1 if not mapped else mapped[0] if len(mapped) == 1 else mapped)
        return tuple(out)

    def repeat_num(self) -> int:
        """HyperParallel's: how many ranks hold each piece, the mesh size over the sizes of the
        mesh dims that shard a tensor dim (a Partial or Replicate mesh dim repeats pieces).

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout((2, 4), (Shard(0), Replicate())).repeat_num()
            4
        """
        return prod(self.mesh_shape) // prod(n for n, p in zip(self.mesh_shape, self.placements) if p.is_shard())

    def get_global_shape(self, slice_shape: Sequence[int]) -> Shape:
        """HyperParallel's name for :meth:`even_global_shape`: ``slice_shape`` times the shard
        counts (a DTensor's ``layout`` answers its true global shape, uneven pieces included).

        Example:
            >>> from hyper_parallel_ms.layout import Layout
            >>> Layout((2, 2), (Shard(0), Replicate())).get_global_shape((3, 4))
            (6, 4)
        """
        return self.even_global_shape(slice_shape)


def _alias_names(entry: AliasEntry) -> Tuple[str, ...]:
    if entry is None or entry == "None":
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(e, str) and e != "None" for e in entry):
        if len(set(entry)) != len(entry):
            raise ValueError(f"alias entry {tuple(entry)!r} repeats a mesh dim name")
        return tuple(entry)
    raise TypeError(f"alias entry must be a mesh dim name, 'None' or a tuple of names, got {entry!r}")
