"""Meshes of fully_shard: the data-parallel mesh (1-D: shard; 2-D: replicate x shard, HSDP),
and the root mesh joining it with a tensor-parallel mesh for parameters placed by the
parallel styles (FSDP x TP), so that a piece's sharding names both.

Example::

    dp, tp = mesh["dp"], mesh["tp"]
    root = join_meshes(dp, tp)          # the (dp, tp) mesh again, dims ("dp", "tp")
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .. import _cluster
from ..mesh import DeviceMesh, init_device_mesh

__all__ = ["dp_mesh_dims", "default_mesh", "join_meshes"]


def default_mesh() -> DeviceMesh:
    """A 1-D mesh of every rank (fully_shard's default)."""
    device = "npu" if _cluster.device_target() == "Ascend" else "cpu"
    return init_device_mesh(device, (_cluster.world_size(),), mesh_dim_names=("dp_shard",))


def dp_mesh_dims(mesh: DeviceMesh) -> Tuple[int, Optional[int]]:
    """(shard dim, replicate dim or None) of a 1-D (FSDP) or 2-D (HSDP) data-parallel mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return 0, None
    if mesh.ndim == 2:
        return 1, 0
    raise ValueError(f"fully_shard takes a 1-D mesh (FSDP) or a 2-D mesh (replicate, shard) for HSDP, "
                     f"got a {mesh.ndim}-D mesh {mesh!r}")


def join_meshes(dp: DeviceMesh, tp: DeviceMesh) -> DeviceMesh:
    """The mesh of dims ``dp`` + ``tp`` whose slices through this rank are ``dp`` and ``tp``."""
    me = _cluster.world_rank()
    dp_ranks, tp_ranks = dp.mesh, tp.mesh
    ranks = dp_ranks.reshape(dp_ranks.shape + (1,) * tp_ranks.ndim) + tp_ranks - me
    names = None
    if dp.mesh_dim_names and tp.mesh_dim_names:
        names = tuple(dp.mesh_dim_names) + tuple(tp.mesh_dim_names)
    flat = ranks.ravel().tolist()
    world = _cluster.world_size()
    if len(set(flat)) != len(flat) or min(flat) < 0 or max(flat) >= world:
        raise ValueError(f"the data-parallel mesh {dp!r} and the tensor-parallel mesh {tp!r} of the parameters do "
                         "not form one regular mesh; slice both from one init_device_mesh (mesh['dp'], mesh['tp'])")
    root = DeviceMesh(dp.device_type, ranks, mesh_dim_names=names)
    coord = root.get_coordinate()
    if not (np.array_equal(root.mesh[coord[:dp.ndim]], tp_ranks)
            and np.array_equal(root.mesh[(slice(None),) * dp.ndim + coord[dp.ndim:]], dp_ranks)):
        raise ValueError(f"meshes {dp!r} and {tp!r} do not slice one regular mesh")
    return root
