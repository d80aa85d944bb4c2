"""DTensor parameters (``shard_module`` / ``distribute_module``) under fully_shard and hsdp.

A ``Parameter(DTensor)`` is global-shaped, but a unit shards and gathers what this rank
holds: its local piece. :func:`local_parameter` gives a plain Parameter with that piece and
a ``ParameterSharding`` record on the sub-mesh of the mesh dims that shard it (the tp part),
so the piece record of :mod:`._pieces` is the joint (dp, tp) layout, as for a parameter
placed by a parallel style. During the forward the gathered local piece is put back into
the Cell as a DTensor with the parameter's own spec (:func:`as_placed`), so the Cell's code
computes through the ops dispatcher as before. :func:`replicated_dp_mesh` is hsdp's
data-parallel mesh of such a parameter: the ranks of its Replicate mesh dims through this
rank (HyperParallel: hsdp shards a DTensor parameter over the ranks holding the same piece).

Example::

    local, spec = local_parameter(model.weight)     # weight: (R, S0) on ("dp", "tp")
    parameter_sharding(local).spec.placements       # (Shard(dim=0),) on the "tp" sub-mesh
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from mindspore import Parameter, Tensor

from .._mindspore import is_meta, meta_empty
from ..dtensor import DTensor
from ..dtensor._dtensor import LOCAL_GRAD_PLACEMENTS, _local_view
from ..dtensor._spec import DTensorSpec
from ..layout import Layout
from ..mesh import DeviceMesh
from ..placement import Partial
from ..nn._parameter import ParameterSharding, record_sharding

__all__ = ["local_parameter", "replicated_dp_mesh", "as_placed"]


def _check_placements(param: DTensor, engine: str) -> None:
    if any(p.is_partial() for p in param.placements):
        raise ValueError(f"{engine}: the DTensor parameter {param.name!r} is Partial {param.placements}; a unit "
                         "shards a parameter whose pieces are its values: reduce it first (Replicate)")


def _sub_mesh(mesh: DeviceMesh, dims) -> np.ndarray:
    """The ranks of ``mesh`` along ``dims`` through this rank."""
    coord = mesh.coordinate
    return mesh.mesh[tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))]


def local_parameter(param: Parameter, engine: str,
                    dp_mesh: Optional[DeviceMesh] = None) -> Tuple[Parameter, Optional[DTensorSpec]]:
    """``(param, None)`` for a plain Parameter; for a ``Parameter(DTensor)``, a plain Parameter with
    its name and local piece recorded on the sub-mesh of its sharding mesh dims and of its Replicate
    dims outside ``dp_mesh`` (the mesh data parallelism shards it over: a tensor-parallel Replicate
    stays in the record, as FSDP2's ``(Shard(0), Replicate())`` on ``(dp, tp)``: every rank holding a
    copy is in the layout), and its spec."""
    if not isinstance(param, DTensor):
        return param, None
    _check_placements(param, engine)
    spec = param._dt_spec
    view = _local_view(param)
    value = meta_empty(view.shape, param.dtype) if is_meta(view) else Tensor(view.asnumpy(), dtype=param.dtype)
    local = Parameter(value, name=param.name, requires_grad=param.requires_grad)
    dims = [d for d, p in enumerate(spec.placements)
            if p.is_shard() or (dp_mesh is not None and spec.mesh.size(d) > 1
                                and _disjoint(_sub_mesh(spec.mesh, (d,)), dp_mesh))]
    if dims:
        names = spec.mesh.mesh_dim_names
        mesh = DeviceMesh(spec.mesh.device_type, _sub_mesh(spec.mesh, dims),
                          mesh_dim_names=tuple(names[d] for d in dims) if names else None)
        order = {t: tuple(dims.index(a) for a in axes) for t, axes in spec.layout.shard_order}
        layout = Layout(mesh.shape, [spec.placements[d] for d in dims], mesh_dim_names=mesh.mesh_dim_names,
                        shard_order=order)
        record_sharding(local, ParameterSharding(DTensorSpec(mesh, layout, tuple(spec.shape))))
    return local, spec


def _disjoint(ranks: np.ndarray, dp_mesh: DeviceMesh) -> bool:
    """Whether the group ``ranks`` (through this rank) shares no rank but this one with ``dp_mesh``."""
    return len(set(ranks.ravel().tolist()) & set(dp_mesh.mesh.ravel().tolist())) == 1


def replicated_dp_mesh(param: DTensor, shard_size: int, engine: str) -> DeviceMesh:
    """hsdp's mesh for a ``Parameter(DTensor)``: the ranks of its Replicate mesh dims through this rank
    (row-major), 1-D ``("dp_shard",)`` or, for ``shard_size`` below their number, 2-D
    ``("dp_replicate", "dp_shard")``; a ``shard_size`` above it is the number (as HyperParallel)."""
    _check_placements(param, engine)
    spec = param._dt_spec
    dims = [d for d, p in enumerate(spec.placements) if p.is_replicate()]
    ranks = _sub_mesh(spec.mesh, dims).ravel() if dims else np.array([spec.mesh.get_rank()])
    n = ranks.size
    size = n if shard_size == -1 else min(shard_size, n)
    if n % size:
        raise ValueError(f"{engine}: shard_size {shard_size} does not divide the {n} ranks holding the same piece of "
                         f"the DTensor parameter {param.name!r} (its Replicate mesh dims of {spec.placements} on "
                         f"{spec.mesh!r}): give a shard_size dividing {n}")
    if size == n:
        return DeviceMesh(spec.mesh.device_type, ranks, mesh_dim_names=("dp_shard",))
    return DeviceMesh(spec.mesh.device_type, ranks.reshape(n // size, size),
                      mesh_dim_names=("dp_replicate", "dp_shard"))


def as_placed(value: Tensor, spec: Optional[DTensorSpec], replicated_grads_partial: bool = False):
    """A gathered local piece as what the Cell reads: a DTensor with the parameter's ``spec``
    (differentiable: it shares the autodiff node), or ``value`` itself for a plain parameter.
    ``replicated_grads_partial`` (HyperParallel's convention, see
    :func:`hyper_parallel_ms.compat.alias_hyper_parallel`): the Cell computes with ``to_local()`` on
    its own pieces of activations, so on the mesh dims where the parameter is Replicate the gradient
    of its local value is this rank's share: ``to_local()`` reads it as Partial (summed over those
    dims in the backward)."""
    if spec is None:
        return value
    placed = DTensor(value, spec)
    if replicated_grads_partial and any(p.is_replicate() for p in spec.placements):
        placed.__dict__[LOCAL_GRAD_PLACEMENTS] = tuple(Partial() if p.is_replicate() else p for p in spec.placements)
    return placed
