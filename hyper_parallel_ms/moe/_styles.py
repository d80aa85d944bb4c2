"""Parallel styles for Cells of stacked expert weights (``w1 (E, hidden, dim)``, ``w2 (E, dim, hidden)``,
``w3 (E, hidden, dim)``, ``construct(x, num_tokens_per_expert)`` on tokens sorted by expert, as
:class:`~hyper_parallel_ms.moe.GroupedExperts`), applied with ``parallelize_module`` like the other styles.

=======================  =================  ==============================  ==================================
style                    mesh               weights                         tokens
=======================  =================  ==============================  ==================================
ExpertParallel           1-D ``ep``         ``Shard(0)``: ``E / ep`` each   sent to their experts' ranks and
                                                                            back (all_to_all_single)
ExpertTensorParallel     2-D (ep, tp)       ``Shard(0)`` on ep; hidden      as ExpertParallel over ep; over
                                            ``Shard`` on tp                 tp replicated in, summed out
TensorParallel           1-D ``tp``         hidden ``Shard`` on tp          replicated in, summed out
=======================  =================  ==============================  ==================================

The token moves depend on the router's counts, so a Cell under ExpertParallel / ExpertTensorParallel runs
in PyNative only (``ms.jit`` / GRAPH_MODE refuse it when compiling, naming the cause); TensorParallel
compiles. Over tp the Cell's input is Megatron's ``f`` (identity, gradient summed) and its output ``g``
(summed, identity gradient), as ColwiseParallel / RowwiseParallel place them.

Example::

    parallelize_module(model, mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from mindspore import nn

from .._mindspore import recompute_record, refuse_while_compiling
from ..nn import ParallelStyle
from ..nn._adapter import own_parameters
from ..nn._edit import ConversionSpec, InputSpec, ModuleEdit, OutputSpec
from ..nn._parameter import ParameterPlacement
from ..nn._targets import check_mesh
from ..placement import Partial, Replicate, Shard
from ..redistribute._gradient import gradient_placements, shared_dims
from ._dispatch import TokenDispatcher

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel", "stacked_experts"]

_HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}          # the hidden dim of each stacked weight
_DISPATCH = "_hpms_expert_dispatch"                # on a Cell: its TokenDispatcher and the pending dispatches
_GRAPH_ERROR = "_hpms_expert_graph_error"


def _where(path: str) -> str:
    return f"'{path}'" if path else "the root Cell"


def stacked_experts(style: str, path: str, cell: nn.Cell) -> Tuple[int, int, int]:
    """``(E, hidden, dim)`` of a Cell holding stacked expert weights, or raise naming what is missing.

    Args:
        style: the style's name (for the message).
        path: the Cell's path.
        cell: the Cell.

    Example::

        stacked_experts("ExpertParallel", "moe.experts", model.moe.experts)     # (4, 32, 16)
    """
    params = own_parameters(cell)
    missing = [n for n in ("w1", "w2", "w3") if n not in params]
    if missing:
        raise TypeError(f"{style} on {_where(path)}: a {type(cell).__name__} without the stacked expert weights "
                        f"{missing} (it needs w1 (E, hidden, dim), w2 (E, dim, hidden), w3 (E, hidden, dim) of its "
                        f"own, as GroupedExperts; it has {sorted(params)})")
    shapes = {n: tuple(params[n].shape) for n in ("w1", "w2", "w3")}
    if any(len(s) != 3 for s in shapes.values()):
        raise ValueError(f"{style} on {_where(path)}: stacked expert weights are 3-D, got {shapes}")
    experts, hidden, dim = shapes["w1"]
    if shapes["w3"] != shapes["w1"] or shapes["w2"] != (experts, dim, hidden):
        raise ValueError(f"{style} on {_where(path)}: w1 (E, hidden, dim), w2 (E, dim, hidden) and w3 (E, hidden, dim) "
                         f"disagree: {shapes}")
    return experts, hidden, dim


def _check_divides(style: str, path: str, experts: int, ranks: int) -> None:
    if experts % ranks:
        raise ValueError(f"{style} on {_where(path)}: {experts} experts do not divide over the {ranks} expert-parallel "
                         f"ranks (each rank holds E / ep whole experts); use an ep size dividing {experts}")


def _graph_error(style: str, path: str) -> str:
    return (f"{style} on {_where(path)} moves tokens by the counts the router computes at run time (the shapes depend "
            "on the data), which ms.jit / GRAPH_MODE cannot compile. Run the MoE layer in PyNative, or compile "
            "the model without expert parallelism (a whole GroupedExperts compiles)")


def _same_routing_when_recomputed(cell, state) -> None:
    """Under activation checkpointing (PyNative) the backward runs the dispatch again: its counts, gathered
    from every rank, must be the forward's (then the recomputed exchanges are the forward's); otherwise every
    rank raises (they all compare the same gathered counts), naming the cause."""
    record = recompute_record()
    if record is None:
        return
    if not record.replaying:
        record.keep(state.counts)
        return
    forward = record.take()
    if forward != state.counts:
        raise RuntimeError(
            f"expert parallelism under activation checkpointing ({type(cell).__name__}): the recompute in the "
            f"backward routed the tokens differently from the forward (tokens per expert on each rank: forward "
            f"{forward}, recompute {state.counts}), so its token exchanges would not be the forward's. The router's "
            "weights or expert_bias changed between the forward and its backward (update the expert bias and step "
            "the optimizer after the backward), or its inputs differ; checkpoint the block without changing them")


def _dispatch_hook(cell, args):
    if refuse_while_compiling(getattr(cell, _GRAPH_ERROR)):
        dispatcher, pending = getattr(cell, _DISPATCH)
        if len(args) < 2:
            raise TypeError(f"expert parallelism: {type(cell).__name__} is called with (x, num_tokens_per_expert), "
                            f"got {len(args)} positional argument(s)")
        tokens, local_counts, state = dispatcher.dispatch(args[0], args[1])
        _same_routing_when_recomputed(cell, state)
        pending.append(state)
        return (tokens, local_counts) + tuple(args[2:])
    return args


def _combine_hook(cell, args, output):
    if refuse_while_compiling(getattr(cell, _GRAPH_ERROR)):
        dispatcher, pending = getattr(cell, _DISPATCH)
        return dispatcher.combine(output, pending.pop())
    return output


def _placements(mesh, placements, src_data_rank) -> Dict[str, ParameterPlacement]:
    return {name: ParameterPlacement(mesh, placements[name], src_data_rank=src_data_rank) for name in placements}


def _tensor_parallel_io(edit: ModuleEdit, tp_mesh, where: str) -> None:
    """Over tp: the tokens replicated in (their gradient summed over the ranks' shares), the partial sums of
    ``w2`` summed out."""
    replicated = (Replicate(),)
    grad = gradient_placements(replicated, shared_dims(replicated, (Shard(1),)))
    edit.inputs = InputSpec({0: ConversionSpec(tp_mesh, replicated, replicated, grad, where=where)})
    edit.outputs = OutputSpec({0: ConversionSpec(tp_mesh, (Partial(),), replicated, where=where)})


def _dispatching(edit: ModuleEdit, style: str, path: str, mesh, mesh_dim, experts: int) -> None:
    edit.attributes[_DISPATCH] = (TokenDispatcher(mesh, mesh_dim, experts), [])
    edit.attributes[_GRAPH_ERROR] = _graph_error(style, path)
    edit.forward_pre_hooks.append(_dispatch_hook)
    edit.forward_hooks.append(_combine_hook)


class ExpertParallel(ParallelStyle):
    """Place ``E / ep`` whole experts on each rank of a 1-D ep mesh (``w1`` / ``w2`` / ``w3`` ``Shard(0)``) and
    move tokens: before the Cell, each rank's tokens (sorted by global expert, with their counts) go to the
    ranks holding their experts, which see them sorted by local expert with local counts; after it, the
    outputs go back to the tokens' ranks in their original order (all_to_all_single of uneven splits, the
    backward the transposed exchange). PyNative only (the counts make the shapes).

    Refused: a Cell without stacked weights ``w1``, ``w2``, ``w3`` of its own, a number of experts that ``ep``
    does not divide.

    Example::

        parallelize_module(moe.experts, mesh["ep"], ExpertParallel())
    """

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        name = type(self).__name__
        check_mesh(mesh, f"{name} on {_where(path)}", ndim=1)
        experts, _, _ = stacked_experts(name, path, cell)
        _check_divides(name, path, experts, mesh.size(0))
        edit = ModuleEdit(path, cell, parameters=_placements(mesh, {n: (Shard(0),) for n in _HIDDEN_DIM},
                                                             src_data_rank))
        _dispatching(edit, name, path, mesh, 0, experts)
        return edit


class ExpertTensorParallel(ParallelStyle):
    """Expert parallelism over mesh dim 0 (ep) with each expert's hidden features split over mesh dim 1 (tp)
    of a 2-D mesh: ``w1`` / ``w3`` ``(Shard(0), Shard(1))``, ``w2`` ``(Shard(0), Shard(2))``. Tokens move over ep
    as in :class:`ExpertParallel`; the ranks of a tp group hold the same tokens, compute partial outputs from
    their hidden slices, and sum them. PyNative only.

    Example::

        parallelize_module(moe.experts, mesh["ep", "tp"], ExpertTensorParallel())
    """

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        name = type(self).__name__
        check_mesh(mesh, f"{name} on {_where(path)}", ndim=2)
        if not mesh.mesh_dim_names:
            raise ValueError(f"{name} on {_where(path)} needs a 2-D mesh with named dims (ep, tp), e.g. "
                             "init_device_mesh('cpu', (2, 2), mesh_dim_names=('ep', 'tp'))")
        experts, _, _ = stacked_experts(name, path, cell)
        _check_divides(name, path, experts, mesh.size(0))
        placements = {n: (Shard(0), Shard(d)) for n, d in _HIDDEN_DIM.items()}
        edit = ModuleEdit(path, cell, parameters=_placements(mesh, placements, src_data_rank))
        _tensor_parallel_io(edit, mesh[mesh.mesh_dim_names[1]], _where(path))
        _dispatching(edit, name, path, mesh, 0, experts)
        return edit


class TensorParallel(ParallelStyle):
    """Tensor parallelism of stacked experts over a 1-D tp mesh: every rank holds every expert's slice of the
    hidden features (``w1`` / ``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``), the tokens (the same on every tp rank) in,
    the partial outputs summed out. Compiles (no token moves). Exported as ``hyper_parallel_ms.moe.TensorParallel``.

    Example::

        parallelize_module(moe.experts, mesh["tp"], TensorParallel())
    """

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        name = type(self).__name__
        check_mesh(mesh, f"{name} on {_where(path)}", ndim=1)
        stacked_experts(name, path, cell)
        edit = ModuleEdit(path, cell, parameters=_placements(mesh, {n: (Shard(d),) for n, d in _HIDDEN_DIM.items()},
                                                             src_data_rank))
        _tensor_parallel_io(edit, mesh, _where(path))
        return edit
