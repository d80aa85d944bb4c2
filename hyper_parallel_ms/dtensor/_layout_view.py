"""The layout a DTensor answers with ``dt.layout``: its :class:`Layout` (equal to it, hashing the
same) that also knows the tensor's mesh and global shape, so HyperParallel's rank-bound queries
(``rank_list``, ``get_split_id``, ``get_global_shape``, ``alias_placements``) answer.

Example::

    dt = distribute_tensor(x, mesh, [Shard(0)])
    dt.layout.get_split_id(0)       # this rank's piece index along tensor dim 0
"""
from __future__ import annotations

from typing import Sequence, Tuple

from ..layout import Layout, Shape
from ..placement import Placement

__all__ = ["TensorLayout", "tensor_layout"]


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
