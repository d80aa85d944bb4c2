"""HyperParallel's DeviceMesh queries, mixed into :class:`~hyper_parallel_ms.mesh.DeviceMesh`.

Example::

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "tp"))
    mesh.get_rank_list_along_axis("pp")     # rank 5: [1, 5]
    world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))["tp"]     # rank 5: ranks [4, 5]
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import numpy as np

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

    def _unflatten(self, dim: Union[str, int], mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override: Optional[Dict[Union[str, int], object]] = None):
        """This mesh with dim ``dim`` split into dims of ``mesh_sizes`` named ``mesh_dim_names``
        (row-major: the last new dim varies fastest), the other dims kept (PyTorch's and
        HyperParallel's ``DeviceMesh._unflatten``).

        ``backend_override`` maps new dims (names or indices among ``mesh_dim_names``) to a backend;
        ``"fake"`` marks a dim whose collectives the caller never runs. Every dim here gets a real
        MindSpore group (one group creation each), so a collective on a ``"fake"`` dim still gives
        the right answer rather than a fake one; other values are refused.

        Raises:
            ValueError: sizes whose product differs from the dim's size, names that do not match
                the sizes or clash with the other dims, an unknown ``backend_override`` entry.
        """
        index = self.dim_index(dim)
        sizes = tuple(int(s) for s in mesh_sizes)
        names = tuple(mesh_dim_names)
        if len(names) != len(sizes) or any(s < 1 for s in sizes):
            raise ValueError(f"_unflatten: mesh_sizes {sizes} and mesh_dim_names {names} must pair up, "
                             f"each size >= 1")
        if int(np.prod(sizes)) != self.shape[index]:
            raise ValueError(f"_unflatten: mesh_sizes {sizes} multiply to {int(np.prod(sizes))}, but dim "
                             f"{dim!r} of {self!r} has {self.shape[index]} ranks")
        kept = list(self.mesh_dim_names or [f"dim{d}" for d in range(self.ndim)])
        all_names = tuple(kept[:index]) + names + tuple(kept[index + 1:])
        if len(set(all_names)) != len(all_names):
            raise ValueError(f"_unflatten: the new names {names} clash with the mesh's other dims {kept}")
        for key, backend in (backend_override or {}).items():
            if key not in names and not (isinstance(key, int) and 0 <= key < len(names)):
                raise ValueError(f"_unflatten: backend_override names {key!r}, not one of the new dims {names}")
            if backend not in (None, "fake"):
                raise ValueError(f"_unflatten: backend_override {backend!r} for {key!r}: MindSpore's backend "
                                 f"follows the device; only 'fake' (or None) is taken")
        ranks = self.mesh.reshape(self.shape[:index] + sizes + self.shape[index + 1:])
        return type(self)(self.device_type, ranks, mesh_dim_names=all_names, _world=self._world)
