"""HyperParallel's ``core.distributed_checkpoint.get_current_layout`` / ``get_global_layout``: every
parameter's sharding as MindSpore's strategy metadata describes it (device matrix, alias names,
rank list, tensor map), which MindFormers' ``LayoutAdapter`` turns into ``mindspore.parallel.Layout``
objects for its checkpoints.

Each entry is ``{"device_matrix", "alias_name", "rank_list", "tensor_map", "type", "full_shape"}``
for a parameter this library shards (a parallel style, ``shard_module``, ``fully_shard``: the joint
layout of its pieces; an optimizer state cloned from one keeps it), and ``{"type", "full_shape"}`` for a
whole one. A state that lost its parameter's record (MindFormers' float32 master copies,
``Parameter(piece.float())``) is laid out like the sharded parameter it is named after
(``main_param.<name>``, ``adam_m.<name>``: MindFormers' naming) when it has that piece's shape. ``type`` is the dtype's name
(``"Float32"``), ``full_shape`` the global shape.

Example::

    get_current_layout(model)       # {rank: {"layers.0.w": {"device_matrix": [2, 2], ...}}}
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

from mindspore import nn

from .. import _cluster
from ..comm._exchange import exchange_of
from ..nn._parameter import parameter_spec

__all__ = ["get_current_layout", "get_global_layout"]


def _state_of(name: str, shape: Tuple[int, ...], sharded: Dict[str, Any]) -> Optional[Any]:
    """The sharded parameter whose optimizer state (or master copy) ``name`` is, by MindFormers' naming
    (``<prefix>.<parameter name>``: ``adam_m.``, ``main_param.``, ...) and the piece's shape; else ``None``."""
    dot = name.find(".")
    while dot != -1:
        base = sharded.get(name[dot + 1:])
        if base is not None and tuple(base.shape) == shape:
            return base
        dot = name.find(".", dot + 1)
    return None


def _entry(param: Any, sharded: Dict[str, Any]) -> Dict[str, Any]:
    spec = parameter_spec(param)
    if spec is None:       # a state made from a piece without its record (Parameter(piece.float()), a master copy)
        base = _state_of(param.name, tuple(param.shape), sharded)
        spec = None if base is None else parameter_spec(base)
    entry: Dict[str, Any] = {"type": str(param.dtype)}
    if spec is None:
        entry["full_shape"] = [int(d) for d in param.shape]
        return entry
    layout, mesh = spec.layout, spec.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    entry.update(device_matrix=[int(d) for d in mesh.shape], alias_name=list(names),
                 rank_list=[int(r) for r in mesh.mesh.ravel()],
                 tensor_map=[list(m) if isinstance(m, tuple) else int(m) for m in layout.tensor_map(len(spec.shape))],
                 full_shape=[int(d) for d in spec.shape])
    return entry


def get_current_layout(network: Union[nn.Cell, List[nn.Cell]]) -> Dict[int, Dict[str, Dict[str, Any]]]:
    """This rank's parameters' layouts: ``{rank: {parameter name: entry}}`` (no communication).

    Args:
        network: a Cell, or a list of Cells (pipeline stages of this rank).

    Example::

        layouts = get_current_layout(model)[get_rank()]
    """
    cells = network if isinstance(network, (list, tuple)) else [network]
    rank = _cluster.world_rank() if _cluster.is_initialized() else 0
    params = [p for cell in cells for p in cell.get_parameters()]
    sharded = {p.name: p for p in params if parameter_spec(p) is not None}
    return {rank: {p.name: _entry(p, sharded) for p in params}}


def get_global_layout(network: Union[nn.Cell, List[nn.Cell]]) -> Dict[int, Dict[str, Dict[str, Any]]]:
    """Every rank's parameters' layouts, ``{rank: {parameter name: entry}}``: each rank's
    :func:`get_current_layout`, gathered over the world (a collective: every rank calls it).

    Args:
        network: a Cell, or a list of Cells (pipeline stages of this rank).

    Example::

        layouts = get_global_layout(model)     # the same dictionary on every rank
    """
    mine = get_current_layout(network)
    if not _cluster.is_initialized() or _cluster.world_size() == 1:
        return mine
    world = _cluster.current_world()
    out: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for part in exchange_of(world).all_gather_object(mine, world):
        out.update(part)
    return out
