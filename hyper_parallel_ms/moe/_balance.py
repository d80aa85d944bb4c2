"""Aux-loss-free load balancing (DeepSeek-V3): after each optimizer step, move every MoE layer's
``expert_bias`` toward the experts that got fewer tokens.

For each :class:`~hyper_parallel_ms.moe.MoE` with ``load_balance_coeff``: the tokens per expert counted since
the last update (``tokens_per_expert``, summed over the ranks that hold different tokens: the data-parallel
and expert-parallel ranks, not the tensor-parallel ones, which see the same tokens) give
``delta = coeff * sign(mean - counts)``, centred (``delta - mean(delta)``) and added to ``expert_bias``; the
counts restart from zero. The bias shifts only which experts a token picks, never its scores. As in
torchtitan, the sign makes the update independent of how often the counts were taken (gradient
accumulation, activation recomputation counting twice).

Example::

    optimizer(grads)
    update_expert_bias(model, mesh["dp", "ep"])
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import mindspore as ms
from mindspore import nn, ops

from .. import comm
from ._layer import MoE

__all__ = ["update_expert_bias"]


def _balanced_layers(model: nn.Cell) -> List[MoE]:
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, MoE) and cell.load_balance_coeff]


def update_expert_bias(model: nn.Cell, mesh=None, mesh_dims: Optional[Sequence] = None) -> int:
    """Update the ``expert_bias`` of every MoE layer of ``model`` that has ``load_balance_coeff`` from its
    ``tokens_per_expert`` summed over ``mesh_dims`` of ``mesh`` (one all-reduce per mesh dim for all layers
    together), and zero the counts. Call it after each optimizer step, on every rank. Returns the number
    of layers updated.

    Args:
        model: the model (its MoE layers are found by type).
        mesh: the :class:`~hyper_parallel_ms.DeviceMesh` whose ranks hold different tokens (``None``: one
            device, nothing summed).
        mesh_dims: the dims of ``mesh`` to sum over (default: all of them; leave tensor-parallel dims out).

    Example::

        update_expert_bias(model, mesh, mesh_dims=("dp", "ep"))
    """
    if not isinstance(model, nn.Cell):
        raise TypeError(f"update_expert_bias needs the model (an nn.Cell), got {type(model).__name__}")
    layers = _balanced_layers(model)
    if not layers:
        return 0
    counts = ops.stack([layer.tokens_per_expert.value() for layer in layers]).astype(ms.float32)
    if mesh is not None:
        for dim in (range(mesh.ndim) if mesh_dims is None else mesh_dims):
            counts = comm.all_reduce(counts, mesh, dim)
    for layer, count in zip(layers, counts):
        delta = layer.load_balance_coeff * ops.sign(count.mean() - count)
        ops.assign_add(layer.expert_bias, delta - delta.mean())
        ops.assign(layer.tokens_per_expert, ops.zeros_like(layer.tokens_per_expert))
    return len(layers)
