"""``DTensor.from_local(..., run_check=True)``: every rank checks that the pieces make one
global tensor (local shapes, global shape and dtype agree with the placements on every rank;
the pieces along Replicate mesh dims are equal), so that all ranks raise the same error.

Example::

    check_local_shapes(spec, tuple(local.shape), local.dtype)      # on every rank of spec.mesh
    check_replicas_equal(spec, local)
"""
from __future__ import annotations

from typing import Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from .. import comm
from .._mindspore import plain_view
from ._spec import DTensorSpec

__all__ = ["check_local_shapes", "check_replicas_equal"]


_DTYPE_NAMES = ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16",
                "Float32", "Float64", "BFloat16", "Complex64", "Complex128")


def _dtype_code(dtype) -> int:
    name = str(dtype)
    return _DTYPE_NAMES.index(name) if name in _DTYPE_NAMES else len(_DTYPE_NAMES)


def check_local_shapes(spec: DTensorSpec, local_shape: Tuple[int, ...], dtype) -> None:
    """Gather every rank's (local shape, global shape, dtype) over the whole mesh; every rank then
    checks all of them, so that all ranks raise the same error."""
    mesh, ndim = spec.mesh, len(local_shape)
    info = np.array(local_shape + spec.shape + (_dtype_code(dtype),), np.float32)
    table = Tensor(info.reshape((1,) * mesh.ndim + (2 * ndim + 1,)))
    for a in range(mesh.ndim):
        table = comm.all_gather(table, mesh, a, dim=a)
    table = table.asnumpy().astype(np.int64)
    for coord in spec.layout.coordinates():
        code = int(table[coord][2 * ndim])
        if code != _dtype_code(dtype):
            other = _DTYPE_NAMES[code] if code < len(_DTYPE_NAMES) else "another dtype"
            raise ValueError(f"run_check: the rank at mesh coordinate {coord} holds a {other} local tensor, the "
                             f"rank at {mesh.coordinate} a {dtype} one: every piece needs one dtype")
        got_local, got_global = tuple(table[coord][:ndim]), tuple(table[coord][ndim:2 * ndim])
        if got_global != spec.shape:
            raise ValueError(f"run_check: the rank at mesh coordinate {coord} sees global shape {got_global}, "
                             f"the rank at {mesh.coordinate} sees {spec.shape}")
        want = spec.layout.local_shape(spec.shape, coord)
        if got_local != want:
            raise ValueError(f"run_check: the rank at mesh coordinate {coord} holds a local tensor of shape "
                             f"{got_local}, but global shape {spec.shape} with placements {spec.layout} "
                             f"gives it {want}")


def check_replicas_equal(spec: DTensorSpec, local: Tensor) -> None:
    """Raise on every rank if the pieces along some Replicate mesh dim differ anywhere:
    the element-wise spread (max - min over the group) of each such dim, reduced to its
    largest value over the whole mesh so that all ranks see the same numbers."""
    mesh = spec.mesh
    dims = [a for a, p in enumerate(spec.placements) if p.is_replicate() and mesh.shape[a] > 1]
    if not dims or local.size == 0:
        return
    values = plain_view(local).astype(ms.float32)
    spreads = []
    for a in dims:
        spread = comm.all_reduce(values, mesh, a, op="max") - comm.all_reduce(values, mesh, a, op="min")
        spreads.append(spread.abs().max().reshape((1,)))
    worst = ms.ops.cat(spreads)
    for a in range(mesh.ndim):
        worst = comm.all_reduce(worst, mesh, a, op="max")
    worst = worst.asnumpy()
    for a, value in zip(dims, worst):
        if value > 0:
            name = mesh.mesh_dim_names[a] if mesh.mesh_dim_names else str(a)
            raise ValueError(f"run_check: the pieces of the Replicate mesh dim {name!r} differ between ranks "
                             f"(largest element-wise difference {float(value):.6g} on some rank group); a "
                             "Replicate DTensor needs the same local tensor on every rank of that dim. Pass "
                             "equal pieces, or distribute_tensor(full, mesh, placements) to broadcast one")
