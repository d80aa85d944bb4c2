"""HyperParallel's DeviceMesh queries, mixed into :class:`~hyper_parallel_ms.mesh.DeviceMesh`.

Example::

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "tp"))
    mesh.get_rank_list_along_axis("pp")     # rank 5: [1, 5]
"""
from __future__ import annotations

from typing import List, Union

__all__ = ["HyperParallelMeshMixin"]


class HyperParallelMeshMixin:
    """HyperParallel's names of :class:`DeviceMesh` queries (``mesh_shape`` and ``rank_list``
    are properties of the mesh itself).

    Example::

        DeviceMesh("cpu", [0]).get_rank_list_along_axis(0)    # [0]
    """

    def get_rank_list_along_axis(self, axis: Union[str, int]) -> List[int]:
        """The global ranks along mesh dim ``axis`` (a name or an index) through this rank's
        coordinate, in mesh order: this rank's group on that dim (HyperParallel).

        Raises:
            RuntimeError: this rank is not in the mesh.
        """
        dim = self.dim_index(axis)
        self._member_coordinate()                 # raises when this rank is not in the mesh
        return list(self._slice_ranks(dim))
