"""The norm of the global gradient from this rank's pieces: :class:`TotalGradNorm`.

Each parameter's ``ParameterSharding`` record (or a ``Parameter(DTensor)``'s spec) says over which
mesh dims its gradient is split. Parameters split over the same communication groups share one
entry of a small vector of local partial norms (sums of ``|g|**p``, or maxima for ``inf``); the
vector is all-reduced once per group, in one order on every rank (by mesh dim name and the
ranks' strides, so the tp groups of all dp ranks come at the same place). Each reduction
changes only the entries its group splits: an entry is reduced over exactly its own groups
(whose pieces it sums once each), whatever else the ranks share (a mesh of all ranks beside a
(dp, tp) mesh: its group splits some entries and holds others whole or still in pieces of
another group). Replicated gradients must be equal on the ranks that hold them, i.e. already
reduced (after :class:`GradientReducer`, or as fully_shard / hsdp return them).

Pipeline stages hold different parameters: their sums (or maxima) are reduced once more over the
pp mesh (one all-reduce of a scalar), a parameter shared by several stages (``shared_parameters``)
counted on its lowest pp rank only. Build it from the schedule, or pass ``pp_mesh``.

Example::

    norm = TotalGradNorm(optimizer.parameters)           # built outside ms.jit
    total = norm(reducer(grads))                          # PyNative or inside ms.jit
    stages = TotalGradNorm(schedule)                      # every stage's gradients, on every rank
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from .. import comm
from .._mindspore import run_in_python, running_eagerly
from ..dtensor import DTensor
from ..nn._parameter import parameter_sharding
from ..pipelining._schedule_base import PipelineSchedule
from ..pipelining._stage import STAGE_MESH

__all__ = ["TotalGradNorm", "split_groups"]


def _spec_of(param):
    record = parameter_sharding(param)
    if record is not None:
        return record.spec
    return param._dt_spec if isinstance(param, DTensor) else None


def split_groups(spec) -> Tuple[Tuple[Tuple[int, ...], object, int], ...]:
    """``(ranks, mesh, mesh dim)`` of each communication group (of more than one rank) that splits a
    tensor of ``spec`` (its ``Shard`` mesh dims); ``()`` for ``None`` (a whole tensor)."""
    if spec is None:
        return ()
    out = []
    for d, placement in enumerate(spec.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient laid out as {tuple(spec.placements)} is Partial over mesh dim {d}: "
                             "reduce it first (GradientReducer, or DTensor.reduce_partial)")
        if placement.is_shard() and spec.mesh.size(d) > 1:
            out.append((spec.mesh.comm_group(d).ranks, spec.mesh, d))
    return tuple(out)


def check_norm_type(norm_type) -> float:
    """``norm_type`` as a float: a positive number or ``inf`` (``"inf"`` too, as ``float()`` reads it).

    >>> check_norm_type("inf"), check_norm_type(2)
    (inf, 2.0)
    """
    frobenius = isinstance(norm_type, str) and norm_type.lower() in ("fro", "f")
    fix = " (the Frobenius norm of the gradients is norm_type=2.0)" if frobenius else ""
    if isinstance(norm_type, bool):
        raise TypeError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise (ValueError if isinstance(norm_type, str) else TypeError)(
            f"norm_type must be a positive number or inf (float('inf') or 'inf'), got {norm_type!r}{fix}") from None
    if not (p > 0):
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def parameter_list(parameters, who: str) -> Union[List[Parameter], PipelineSchedule]:
    """``parameters`` as a list of Parameters (a single Parameter as a list of one), or the pipeline
    schedule it is; what to pass instead named in the error."""
    if isinstance(parameters, PipelineSchedule):
        return parameters
    if isinstance(parameters, Parameter):
        return [parameters]
    what = ("the Parameters the gradients belong to, in their order: optimizer.parameters, or the weights given "
            "to ms.value_and_grad (e.g. model.trainable_params()); or a pipeline schedule")
    if parameters is None:
        raise TypeError(f"{who}: parameters is required: pass {what}")
    if isinstance(parameters, nn.Cell):
        raise TypeError(f"{who}: parameters is the Cell {type(parameters).__name__}, not its Parameters: pass "
                        f"{type(parameters).__name__}.trainable_params() (the weights given to ms.value_and_grad, "
                        "in that order) or optimizer.parameters")
    try:
        found = list(parameters)
    except TypeError:
        raise TypeError(f"{who}: parameters must be {what}; got {type(parameters).__name__}") from None
    for p in found:
        if not isinstance(p, Parameter):
            raise TypeError(f"{who} needs the Parameters the gradients belong to, got {type(p).__name__}; inside "
                            "ms.jit pass a TotalGradNorm built outside")
    return found


def grad_shape(p) -> Tuple[int, ...]:
    """The shape of this rank's gradient of ``p``: its local piece's (a ``Parameter(DTensor)``: the
    local shape, not the global one)."""
    return tuple(p.local_shape) if isinstance(p, DTensor) else tuple(p.shape)


@run_in_python
def check_grad_shapes(shapes: Tuple[Tuple[int, ...], ...], expected: Tuple[Tuple[int, ...], ...],
                      names: Tuple[str, ...]) -> bool:
    """Raise ``ValueError`` naming the first gradient whose shape differs from its parameter's piece
    (a dim of -1, dynamic in a graph, matches any size). Inside ``ms.jit`` it runs while compiling."""
    for i, (shape, want) in enumerate(zip(shapes, expected)):
        if len(shape) != len(want) or any(s not in (w, -1) for s, w in zip(shape, want)):
            raise ValueError(
                f"gradient {i} has shape {tuple(shape)} but its parameter '{names[i]}' has {want} on this rank: the "
                "gradients must be aligned with the parameters (the order of optimizer.parameters, or of the weights "
                "given to ms.value_and_grad)")
    return True


def _role(ranks: Tuple[int, ...], mesh, dim: int) -> Tuple[str, Tuple[int, ...]]:
    """What a group is for, the same on every rank: its mesh dim's name and its ranks' strides
    (a dp group of rank 0 and of rank 1 have the same role; a tp group another)."""
    names = mesh.mesh_dim_names
    return (names[dim] if names else "", tuple(r - ranks[0] for r in ranks))


class _GroupReduce(nn.Cell):
    """All-reduce the entries of the vector that one group splits over that group; the others
    unchanged (selected, not multiplied by a mask: an inf entry stays inf, not NaN)."""

    def __init__(self, mesh, dim: int, split: np.ndarray, op: str) -> None:
        super().__init__()
        self.mesh, self.dim, self.op = mesh, dim, op
        self.split = Tensor(split.astype(np.bool_))

    def construct(self, v):
        reduced = comm.all_reduce(ops.where(self.split, v, ops.zeros_like(v)), self.mesh, self.dim, op=self.op)
        return ops.where(self.split, reduced, v)


def _pipeline(parameters, pp_mesh) -> Tuple[list, object, frozenset]:
    """``(parameters, pp mesh or None, ids of parameters a lower pp rank counts)`` of what
    :class:`TotalGradNorm` was given: Parameters, or a pipeline schedule."""
    parameters = parameter_list(parameters, "TotalGradNorm")
    if isinstance(parameters, PipelineSchedule):
        if pp_mesh is not None and pp_mesh is not parameters.mesh:
            raise ValueError("TotalGradNorm: pp_mesh differs from the schedule's pp mesh; leave it out")
        return (list(parameters.parameters()), parameters.mesh,
                frozenset(id(p) for p in parameters.replica_parameters))
    if pp_mesh is not None and pp_mesh.ndim != 1:
        raise ValueError(f"TotalGradNorm: pp_mesh must be a 1-D mesh (mesh['pp']), got {pp_mesh.ndim} dims")
    if pp_mesh is None:
        staged = [p for p in parameters if _stage_mesh(p) is not None and _stage_mesh(p).size() > 1]
        if staged:
            raise ValueError(
                f"TotalGradNorm: {[p.name for p in staged[:3]]} are parameters of one pipeline stage (a schedule "
                f"over {_stage_mesh(staged[0])!r}), whose norm alone is not the model's: pass the schedule itself "
                "(clip_grad_norm(grads, schedule) / TotalGradNorm(schedule)), or pp_mesh=mesh['pp']")
    return parameters, pp_mesh, frozenset()


def _local_shapes(grads) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(g.local_shape) if isinstance(g, DTensor) else tuple(g.shape) for g in grads)


def _stage_mesh(p):
    return getattr(p, STAGE_MESH, None)


class TotalGradNorm(nn.Cell):
    """The ``norm_type`` norm of the whole gradient of ``parameters`` (the one-device value), on every
    rank, from a tuple of this rank's gradients (aligned with ``parameters``) as the optimizer takes
    them: reduced (after :class:`GradientReducer`; fully_shard / hsdp pieces as returned). One
    all-reduce of a vector per communication group that splits some parameter; none for a model
    without pieces; one more of a scalar over the pp ranks for pipeline stages. Placements are read
    here, once; calling it runs only tensor ops and collectives, in PyNative and inside ``ms.jit``.

    Args:
        parameters: the Parameters, in the order of the gradient tuples (``optimizer.parameters``);
            or a pipeline schedule: its :meth:`parameters` (the order of ``schedule.gradients()``),
            summed over its pp mesh, each shared parameter counted once.
        norm_type: ``2.0`` (default), any positive order, or ``float("inf")`` (the largest element).
        pp_mesh: a 1-D mesh whose ranks hold the other pipeline stages' parameters (a schedule
            brings its own): their totals are combined over it.

    Example::

        norm = TotalGradNorm(optimizer.parameters)
        total = norm(grads)                     # a float32 scalar, equal on every rank
    """

    def __init__(self, parameters: Union[Sequence[Parameter], PipelineSchedule], *, norm_type: float = 2.0,
                 pp_mesh=None) -> None:
        super().__init__()
        parameters, pp_mesh, elsewhere = _pipeline(parameters, pp_mesh)
        self.norm_type = check_norm_type(norm_type)
        self.inf = math.isinf(self.norm_type)
        self.count = len(parameters)
        self.shapes = tuple(grad_shape(p) for p in parameters)
        self.names = tuple(str(p.name) for p in parameters)
        keys: Dict[Tuple, List[int]] = {}
        groups: Dict[Tuple[int, ...], Tuple[object, int]] = {}
        for i, p in enumerate(parameters):
            split = split_groups(_spec_of(p))
            if int(np.prod(p.shape)) == 0 or id(p) in elsewhere:
                continue                                    # an empty piece adds nothing; a replica counts there
            keys.setdefault(tuple(sorted(ranks for ranks, _, _ in split)), []).append(i)
            for ranks, mesh, dim in split:
                groups.setdefault(ranks, (mesh, dim))
        self.members = tuple(tuple(m) for m in keys.values())
        order = sorted(groups, key=lambda ranks: _role(ranks, *groups[ranks]))
        op = "max" if self.inf else "sum"
        steps = []
        for ranks in order:
            mesh, dim = groups[ranks]
            steps.append(_GroupReduce(mesh, dim, np.array([ranks in key for key in keys]), op))
        self.steps = nn.CellList(steps)
        self.across_stages = None if pp_mesh is None or pp_mesh.size() == 1 else \
            _GroupReduce(pp_mesh, 0, np.ones(1, np.bool_), op)
        self.reductions = len(steps) + (self.across_stages is not None)

    def _part(self, g):
        a = ops.abs(g.astype(ms.float32))
        if self.inf:
            return a.max()
        if self.norm_type == 2.0:
            return (a * a).sum()
        return (a ** self.norm_type).sum()

    def construct(self, grads):
        if len(grads) != self.count:
            raise ValueError("TotalGradNorm: the number of gradients differs from the number of parameters")
        if running_eagerly():
            check_grad_shapes(_local_shapes(grads), self.shapes, self.names)
        else:
            shapes = ()
            for g in grads:
                shapes = shapes + (g.shape,)
            check_grad_shapes(shapes, self.shapes, self.names)      # static shapes: refused while compiling
        parts = ()
        for members in self.members:
            s = self._part(grads[members[0]])
            for i in members[1:]:
                s = ops.maximum(s, self._part(grads[i])) if self.inf else s + self._part(grads[i])
            parts = parts + (s,)
        if parts:
            v = ops.stack(parts)
            for step in self.steps:
                v = step(v)
            total = v.max() if self.inf else v.sum()
        else:
            total = ops.zeros((), ms.float32)
        if self.across_stages is not None:
            total = self.across_stages(total.reshape((1,)))[0]
        if self.inf:
            return total
        if self.norm_type == 2.0:
            return ops.sqrt(total)
        return total ** (1.0 / self.norm_type)
