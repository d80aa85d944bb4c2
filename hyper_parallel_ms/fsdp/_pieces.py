"""The piece Parameters of fully_shard and their sharding record.

A parameter sharded by fully_shard becomes a plain ``Parameter`` (same name) holding this
rank's ``torch.chunk`` piece of its cut dim (0, or what ``shard_placement_fn`` gave) over the
shard mesh dim; its ``ParameterSharding`` record names the whole layout. For a parameter
already placed by a parallel style, the record is on the root mesh (dp dims then tp dims) and,
when dp and tp split the same dim, the Layout's ``shard_order`` says "tp first, then dp within
the tp piece". A parameter
kept whole (too small, or a piece would be empty) is recorded as replicated over dp.

``GRAD_REDUCED`` marks, on every piece, the mesh dims (of the record's mesh) over which
the gradient fully_shard returns is already averaged: a gradient reducer applied after
fully_shard must leave those dims alone (composition rule: fully_shard owns the dp
reduction; ``GradientReducer`` keeps only the tp ``grad_partial_dims`` sums).

Example::

    piece = new_piece(param, dp_mesh, sharded=True)
    parameter_sharding(piece).spec.placements     # (Shard(dim=0),)
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
from mindspore import Parameter, Tensor
from mindspore.common.initializer import initializer

from .._mindspore import deferred_parameter, is_meta, meta_empty
from ..dtensor._spec import DTensorSpec
from ..layout import Layout
from ..nn._parameter import ParameterSharding, parameter_sharding, record_sharding
from ..placement import Replicate, Shard
from ._chunks import Chunks
from ._mesh import dp_mesh_dims, join_meshes

__all__ = ["chunks_of", "new_piece", "piece_record", "cut_piece", "GRAD_REDUCED", "TAKEN_BY"]

GRAD_REDUCED = "_hpms_grad_reduced_dims"
TAKEN_BY = "_hpms_fsdp_taken_by"      # on a parameter a unit replaced by its piece: (unit class, use)


def chunks_of(shape, mesh, dim: int = 0) -> Chunks:
    """The :class:`Chunks` of a parameter of ``shape`` cut on ``dim`` over the shard dim of the dp ``mesh``.

    Args:
        shape: the parameter's (local, for a DTensor) full shape.
        mesh: the data-parallel mesh (1-D, or 2-D ``(replicate, shard)``).
        dim: the parameter's dim that is cut.

    Example::

        chunks_of((7, 8), mesh).piece_shape      # (4, 8) on rank 0 of 2
    """
    shard_dim, _ = dp_mesh_dims(mesh)
    return Chunks(tuple(shape), mesh.size(shard_dim), mesh.get_local_rank(shard_dim), dim)


def piece_record(param: Parameter, mesh, sharded: bool, dim: int = 0) -> Tuple[ParameterSharding, Tuple[int, ...]]:
    """The sharding record of ``param``'s piece (cut on ``dim``, normalised), and the dp dims its
    gradient is averaged over."""
    shard_dim, rep_dim = dp_mesh_dims(mesh)
    dp_dims = (shard_dim,) if rep_dim is None else (rep_dim, shard_dim)
    dp_places = [Replicate()] * mesh.ndim
    if sharded:
        dp_places[shard_dim] = Shard(dim)
    ndim = len(param.shape)
    previous = parameter_sharding(param)
    if previous is None:
        spec = DTensorSpec(mesh, Layout(mesh.shape, dp_places, mesh_dim_names=mesh.mesh_dim_names).normalized(ndim),
                           tuple(param.shape))
        return ParameterSharding(spec), dp_dims
    tp = previous.spec
    root = join_meshes(mesh, tp.mesh)
    k = mesh.ndim
    order = {}
    for d, axes in enumerate(tp.layout.sharding_axes(ndim)):
        if len(axes) > 1 or (axes and d == dim and sharded):
            order[d] = tuple(a + k for a in axes) + ((shard_dim,) if d == dim and sharded else ())
    layout = Layout(root.shape, tuple(dp_places) + tuple(tp.layout.placements),
                    mesh_dim_names=root.mesh_dim_names, shard_order=order).normalized(ndim)
    spec = DTensorSpec(root, layout, tuple(tp.shape))
    expected = chunks_of(param.shape, mesh, dim).piece_shape if sharded else tuple(param.shape)
    if spec.local_shape() != expected:
        raise ValueError(f"parameter {param.name!r}: the joint dp x tp layout {layout} gives this rank a piece of "
                         f"{spec.local_shape()}, but fully_shard holds {expected}")
    record = ParameterSharding(spec, tuple(d + k for d in previous.grad_partial_dims))
    return record, dp_dims


def cut_piece(full: np.ndarray, mesh, sharded: bool, dim: int = 0) -> np.ndarray:
    """This rank's ``torch.chunk`` piece of ``dim`` over the shard dim of ``mesh`` (or all of it)."""
    if sharded:
        chunks = chunks_of(full.shape, mesh, dim)
        full = full[(slice(None),) * chunks.dim + (slice(chunks.start, chunks.start + chunks.local),)]
    return np.array(full, order="C")        # (np.ascontiguousarray makes a 0-d array 1-d)


def new_piece(param: Parameter, mesh, sharded: bool, dim: int = 0) -> Parameter:
    """A Parameter with ``param``'s name holding this rank's piece of ``dim`` (normalised; zeros for
    a parameter built under ``no_init_parameters()``, which :func:`init_parameters` fills later; on
    a mesh without values a piece without data, never filled; for a meta parameter a meta piece), with its
    records."""
    record, dp_dims = piece_record(param, mesh, sharded, dim)
    shape = chunks_of(param.shape, mesh, dim).piece_shape if sharded else tuple(param.shape)
    if is_meta(param):                      # built shape-only (DeviceCtx("meta")): a meta piece (to_empty fills it)
        piece = Parameter(meta_empty(shape, param.dtype), name=param.name, requires_grad=param.requires_grad)
    elif param.has_init:
        if not mesh.holds_values:
            piece = deferred_parameter(shape, param.dtype, param.name, param.requires_grad)
        else:
            piece = Parameter(initializer("zeros", shape, param.dtype), name=param.name,
                              requires_grad=param.requires_grad)
    else:
        piece = Parameter(Tensor(cut_piece(param.asnumpy(), mesh, sharded, dim), dtype=param.dtype), name=param.name,
                          requires_grad=param.requires_grad)
    record_sharding(piece, record)
    object.__setattr__(piece, GRAD_REDUCED, dp_dims)
    return piece
