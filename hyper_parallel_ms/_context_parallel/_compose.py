"""A DTensor of another parallelism (tensor parallelism's heads, say) entering a context-parallel boundary,
and its outputs leaving it: the tensor's mesh and the cp mesh, two slices of one mesh, make the mesh of
both, on which the tensor's own placements stay and the cp dim holds the sequence (this rank's piece
sharded, or all-gathered); an output goes back to the tensor's mesh with its cp piece as its local part.

Example::

    q = enter_cp(q_tp, mesh["cp"], seq_dim=1, cp_placement=Shard(1))        # on mesh["cp", "tp"]
    k = enter_cp(k_tp, mesh["cp"], seq_dim=1, cp_placement=Replicate())
    out_tp = leave_cp(out, mesh["cp"], seq_dim=1, outer=q_tp.device_mesh)   # back on mesh["tp"]
"""
from __future__ import annotations

from typing import List, Tuple

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard

__all__ = ["enter_cp", "leave_cp", "holds_cp", "place_cp"]


def _root_dims(mesh: DeviceMesh) -> Tuple[DeviceMesh, Tuple[int, ...]]:
    root = mesh.root_mesh if mesh.root_mesh is not None else mesh
    return root, tuple(mesh._root_dims)


def holds_cp(mesh: DeviceMesh, cp_mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` has the cp mesh's dim (a slice of the same mesh containing it, or the cp mesh)."""
    if mesh == cp_mesh:
        return True
    root, dims = _root_dims(mesh)
    cp_root, cp_dims = _root_dims(cp_mesh)
    return root is cp_root and set(cp_dims) <= set(dims)


def place_cp(x: DTensor, cp_mesh: DeviceMesh, cp_placement: Placement) -> DTensor:
    """``x``, a DTensor on a mesh holding the cp dim (:func:`holds_cp`), with ``cp_placement`` on that dim.

    Example::

        place_cp(k_cp_tp, mesh["cp"], Replicate())             # all-gathered over cp, tp placement kept
    """
    if x.device_mesh == cp_mesh:
        index = 0
    else:
        _, dims = _root_dims(x.device_mesh)
        index = dims.index(_root_dims(cp_mesh)[1][0])
    placements = list(x.placements)
    if placements[index] == cp_placement:
        return x
    placements[index] = cp_placement
    return x.redistribute(x.device_mesh, tuple(placements))


def _composed(x_mesh: DeviceMesh, cp_mesh: DeviceMesh) -> Tuple[DeviceMesh, int]:
    """(the mesh of both, the cp dim's index in it)."""
    root, dims = _root_dims(x_mesh)
    cp_root, cp_dims = _root_dims(cp_mesh)
    if root is not cp_root or root.mesh_dim_names is None or len(cp_dims) != 1 or set(dims) & set(cp_dims):
        raise ValueError(f"a boundary argument is a DTensor on {x_mesh!r}, which is not a slice of the mesh the cp "
                         f"mesh {cp_mesh!r} was sliced from (or overlaps it): slice both from one named mesh "
                         "(mesh['cp'], mesh['tp']), or pass this rank's sequence piece as a Tensor")
    order = sorted(dims + cp_dims)
    return root[tuple(root.mesh_dim_names[d] for d in order)], order.index(cp_dims[0])


def enter_cp(x: DTensor, cp_mesh: DeviceMesh, seq_dim: int, cp_placement: Placement) -> DTensor:
    """``x`` (this rank's sequence piece, a DTensor on a mesh without the cp dim) on the mesh of both:
    its own placements kept, the cp dim ``cp_placement`` (``Shard(seq_dim)`` for the query side,
    ``Replicate()`` for the key side: all-gathered).

    Example::

        enter_cp(q_tp, mesh["cp"], 1, Shard(1)).placements      # (Shard(1), Shard(2)) on mesh["cp", "tp"]
    """
    if any(p.is_partial() or (isinstance(p, Shard) and p.dim % x.ndim == seq_dim % x.ndim) for p in x.placements):
        raise ValueError(f"a boundary argument is a DTensor with placements {tuple(x.placements)} on "
                         f"{x.device_mesh!r}: context parallelism cuts its sequence dim {seq_dim}, which it must "
                         "hold whole and summed (redistribute it to Replicate on that dim first)")
    mesh, cp_index = _composed(x.device_mesh, cp_mesh)
    placements: List[Placement] = list(x.placements)
    placements.insert(cp_index, Shard(seq_dim))
    out = DTensor.from_local(x.to_local(), mesh, tuple(placements))
    if cp_placement != Shard(seq_dim):
        placements[cp_index] = cp_placement
        out = out.redistribute(mesh, tuple(placements))
    return out


def leave_cp(out: DTensor, cp_mesh: DeviceMesh, seq_dim: int, outer: DeviceMesh) -> DTensor:
    """An output on the mesh of ``outer`` and the cp mesh back on ``outer``: its cp dim made this rank's
    sequence piece (a Partial one reduce-scattered), the other placements kept.

    Example::

        leave_cp(out, mesh["cp"], 1, mesh["tp"]).device_mesh == mesh["tp"]
    """
    mesh, cp_index = _composed(outer, cp_mesh)
    if out.device_mesh != mesh:
        return out
    placements = list(out.placements)
    if placements[cp_index] != Shard(seq_dim):
        placements[cp_index] = Shard(seq_dim)
        out = out.redistribute(mesh, tuple(placements))
    # the gradient comes back through the tensor of ``outer`` as its gradient is laid out there: a Partial
    # placement's as Replicate (PyTorch's rule for gradients), not as another partial sum
    local = out.to_local(grad_placements=[Replicate() if p.is_partial() else p for p in placements])
    del placements[cp_index]
    return DTensor.from_local(local, outer, tuple(placements))
