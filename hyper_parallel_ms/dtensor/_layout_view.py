"""The layout a DTensor answers with ``dt.layout``: its :class:`Layout` (equal to it, hashing the
same) that also knows the tensor's mesh and global shape, so HyperParallel's rank-bound queries
(``rank_list``, ``get_split_id``, ``get_global_shape``, ``alias_placements``, ``tensor_map`` as a value)
answer, and HyperParallel's in-place setters (``set_placements``, ``placement_to_tensor_map``,
``reset_partial``) change a view (MindFormers' Muon calls them on a deep copy), never the DTensor.

Example::

    dt = distribute_tensor(x, mesh, [Shard(0)])
    dt.layout.get_split_id(0)       # this rank's piece index along tensor dim 0
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

from ..layout import Layout, Shape
from ..placement import Placement, Replicate

__all__ = ["TensorLayout", "TensorMap", "tensor_layout"]


class TensorMap(tuple):
    """A DTensor layout's tensor map (HyperParallel reads ``layout.tensor_map`` as a value), also
    callable as :meth:`Layout.tensor_map` (``tensor_map(ndim)``) for this library's callers.

    Example::

        dt.layout.tensor_map            # (1, -1): dim 0 sharded by mesh dim 0 of a 2-D mesh
        dt.layout.tensor_map(2)         # the same, asked as Layout.tensor_map(ndim)
    """

    def __new__(cls, entries, layout: Layout):
        out = super().__new__(cls, entries)
        out._layout = layout
        return out

    def __call__(self, ndim: int):
        return Layout.tensor_map(self._layout, ndim)

    def __reduce__(self):
        return tuple, (tuple(self),)           # copied or pickled: the plain tuple


class TensorLayout(Layout):
    """A :class:`Layout` bound to a tensor's mesh and global shape (HyperParallel's layout queries).

    Example::

        lay = tensor_layout(Layout((1,), (Shard(0),)), DeviceMesh("cpu", [0]), (4, 2))
        lay.get_split_id(0), lay.get_global_shape((4, 2)), lay.rank_list   # (0, (4, 2), (0,))
    """

    __slots__ = ("_mesh", "_shape")

    @property
    def mesh(self):
        """The tensor's :class:`DeviceMesh`."""
        return self._mesh

    @property
    def rank_list(self) -> Tuple[int, ...]:
        """The mesh's global ranks, row-major (HyperParallel)."""
        return self._mesh.rank_list

    @property
    def alias_placements(self) -> Tuple[Placement, ...]:
        """HyperParallel's: the placements, as ``DTensor.from_local`` takes them."""
        return self.placements

    def get_global_shape(self, slice_shape: Sequence[int] = None) -> Shape:
        """The tensor's global shape (uneven pieces included); ``slice_shape`` is HyperParallel's
        argument for a layout without a tensor and is not needed here."""
        return self._shape

    @property
    def tensor_map(self) -> "TensorMap":
        """HyperParallel's ``layout.tensor_map``: the tensor's map (per tensor dim ``-1``, or the
        sharding mesh dim counted from the right, a tuple when several, major first). It is a tuple
        that can also be called as :meth:`Layout.tensor_map` (``tensor_map(ndim)``)."""
        return TensorMap(Layout.tensor_map(self, len(self._shape)), self)

    def set_placements(self, placements: Sequence[Placement]) -> None:
        """HyperParallel's in-place setter: this view now describes ``placements`` (one per mesh
        dim). Only this view changes, never the DTensor (``dt.layout`` builds a new view each time).

        Args:
            placements: one ``Shard`` / ``Replicate`` / ``Partial`` per mesh dim.

        Example::

            lay = copy.deepcopy(dt.layout)
            lay.set_placements([Replicate()] * len(lay.mesh_shape))
        """
        new = Layout(self.mesh_shape, tuple(placements), mesh_dim_names=self.mesh_dim_names).normalized(
            len(self._shape))
        self._become(new)

    def placement_to_tensor_map(self, dim: int) -> List[Union[int, Tuple[int, ...]]]:
        """HyperParallel's: the tensor map of the placements for a ``dim``-D tensor, as a list
        (this view's :attr:`tensor_map` always follows its placements).

        Args:
            dim: the tensor's number of dims (this view's tensor: ``len(get_global_shape())``).

        Example::

            lay.placement_to_tensor_map(2)          # [1, -1] for (Shard(0), Replicate())
        """
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"placement_to_tensor_map: dim must be a non-negative int, got {dim!r}")
        return list(Layout.tensor_map(self, dim))

    def reset_partial(self) -> None:
        """HyperParallel's: every ``Partial`` placement of this view becomes ``Replicate``.

        Example::

            lay.reset_partial()
        """
        self._become(self.with_placements(tuple(Replicate() if p.is_partial() else p for p in self.placements)))

    def _become(self, layout: Layout) -> None:
        for name in ("mesh_shape", "mesh_dim_names", "placements", "shard_order"):
            object.__setattr__(self, name, getattr(layout, name))
        object.__setattr__(self, "_hash", None)

    def __copy__(self) -> "TensorLayout":
        """A view of the same mesh (a mesh is not copied: it names process groups) and shape."""
        return tensor_layout(self, self._mesh, self._shape)

    def __deepcopy__(self, memo) -> "TensorLayout":
        return self.__copy__()

    def get_split_id(self, tensor_dim: int) -> int:
        """This rank's index among the pieces ``tensor_dim`` is split into (HyperParallel): its mesh
        coordinates along the sharding mesh dims, major first, as one mixed-radix number; 0 when
        the dim is not sharded or this rank is not in the mesh. A ``tensor_dim`` outside the tensor's
        dims raises ``IndexError``."""
        ndim = len(self._shape)
        if isinstance(tensor_dim, bool) or not isinstance(tensor_dim, int) or not -ndim <= tensor_dim < ndim:
            raise IndexError(f"get_split_id: tensor_dim must be an int in [{-ndim}, {ndim}) for a tensor of shape "
                             f"{self._shape}, got {tensor_dim!r}")
        coordinate = self._mesh.coordinate
        if coordinate is None:
            return 0
        index = 0
        for axis in self.sharding_axes(ndim)[tensor_dim % ndim]:
            index = index * self.mesh_shape[axis] + coordinate[axis]
        return index


def tensor_layout(layout: Layout, mesh, shape: Sequence[int]) -> TensorLayout:
    """``layout`` bound to ``mesh`` and the global ``shape`` (no checks: a DTensor's own parts)."""
    view = object.__new__(TensorLayout)
    for name in ("mesh_shape", "mesh_dim_names", "placements", "shard_order", "_hash"):
        object.__setattr__(view, name, getattr(layout, name))
    object.__setattr__(view, "_mesh", mesh)
    object.__setattr__(view, "_shape", tuple(shape))
    return view
