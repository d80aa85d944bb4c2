"""Sharded parameters of the parallel styles: a plain ``Parameter`` holding this rank's
piece (so that it works in graph mode and with every MindSpore optimizer), with its
sharding recorded beside it.

:func:`parameter_sharding` reads the record; :func:`as_dtensor` views the piece as a
DTensor (PyNative); :func:`sharded_parameter` cuts a full parameter into its piece. A
:class:`ParameterPlacement` describes the cut before it is made (the styles' piece, or a
``Parameter(DTensor)`` for ``shard_module`` / ``distribute_module``).

On a mesh without values (``mesh.holds_values`` is ``False``: a rank of a dry run,
:mod:`hyper_parallel_ms.dryrun`) a parameter becomes a piece of the right shape without
data (a deferred Parameter): no value of the whole parameter or of the piece is computed or sent
(such a rank plans, it does not train). DTensor parameters (``as_dtensor``) hold their values in
the DTensor and are refused there.

Example::

    parallelize_module(model, mesh, {"fc1": ColwiseParallel()})
    parameter_sharding(model.fc1.weight).spec.placements      # (Shard(dim=0),)
    as_dtensor(model.fc1.weight).full_tensor()                  # the whole weight
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from mindspore import Parameter, Tensor

from ..dtensor import DTensor, distribute_tensor
from ..dtensor._dtensor import _local_view
from ..dtensor._optimizer import centralized_gradients, reads_whole_parameters
from ..dtensor._sharding_record import ParameterSharding, attach_record, parameter_sharding
from ..dtensor._spec import DTensorSpec, to_layout
from .._deferred import initial_value
from .._mindspore import check_compiled_calls, deferred_parameter, is_meta, meta_empty

__all__ = ["ParameterSharding", "ParameterPlacement", "parameter_sharding", "parameter_spec", "as_dtensor",
           "sharded_parameter", "record_sharding", "check_optimizer_step", "REPLACED_BY"]

REPLACED_BY = "_hpms_replaced_by"     # on a Parameter an engine replaced by a new one in the model: which engine


def parameter_spec(param: Any) -> Optional[DTensorSpec]:
    """The global layout of what ``param`` holds: a DTensor parameter's spec, else the spec recorded by
    the engine that sharded it, else ``None`` (a whole parameter).

    Args:
        param: a Parameter (plain, a piece, or a ``Parameter(DTensor)``).

    Example::

        parameter_spec(model.fc1.weight).placements       # (Shard(dim=0),)
    """
    if isinstance(param, DTensor):
        return param._dt_spec
    record = parameter_sharding(param)
    return None if record is None else record.spec


def as_dtensor(param: Parameter) -> DTensor:
    """A DTensor view of a sharded parameter's piece (PyNative).

    Args:
        param: a Parameter sharded by a parallel style or ``fully_shard`` (else ``ValueError``).

    Example::

        whole = as_dtensor(model.fc1.weight).full_tensor()
    """
    sharding = parameter_sharding(param)
    if sharding is None:
        raise ValueError(f"parameter {param.name!r} has no sharding: it was not placed by a parallel style")
    spec = sharding.spec
    return DTensor.from_local(_local_view(param), spec.mesh, spec.layout, shape=spec.shape)


def sharded_parameter(param: Parameter, mesh, placements: Sequence, *, src_data_rank: Optional[int] = 0,
                      grad_partial_dims: Tuple[int, ...] = (), view: Optional[Tuple[int, ...]] = None) -> Parameter:
    """A new Parameter with ``param``'s name holding this rank's piece under ``placements``.
    ``src_data_rank``: whose full value is cut (``None``: every rank cuts its own); ``view``: the
    shape the whole parameter is cut in (a reshape of its values, e.g. a fused q/k/v weight
    ``(3E, E)`` seen as ``(3, E, E)``), which becomes its global shape. On a mesh without values
    the piece has no data (a deferred Parameter)."""
    if not mesh.holds_values:
        spec = DTensorSpec.build(mesh, placements, tuple(view or param.shape))
        local = deferred_parameter(spec.local_shape(), param.dtype, param.name, param.requires_grad)
    elif is_meta(param):                      # built shape-only (DeviceCtx("meta")): a meta piece
        spec = DTensorSpec.build(mesh, placements, tuple(view or param.shape))
        local = Parameter(meta_empty(spec.local_shape(), param.dtype), name=param.name,
                          requires_grad=param.requires_grad)
    else:
        piece = _distributed(param, mesh, placements, src_data_rank, view)
        spec = piece._dt_spec
        local = Parameter(Tensor(piece.to_local().asnumpy(), dtype=param.dtype), name=param.name,
                          requires_grad=param.requires_grad)
    record_sharding(local, ParameterSharding(spec, tuple(grad_partial_dims)))
    return local


def record_sharding(param: Parameter, record: ParameterSharding) -> None:
    """Record on ``param`` (a plain Parameter holding this rank's piece) its sharding; from then
    on, compiling a MindSpore optimizer step that cannot step such pieces is refused
    (:func:`check_optimizer_step`).

    Args:
        param: the Parameter holding the piece.
        record: its sharding.

    Example::

        record_sharding(piece, ParameterSharding(spec))
    """
    check_compiled_calls(check_optimizer_step)
    attach_record(param, record)            # its clones (an optimizer's states) keep the record


def _cut_dims(param: Any) -> Tuple[int, ...]:
    """The tensor dims along which ``param`` holds a piece (not a replica of the whole)."""
    record = parameter_sharding(param)
    if record is None:
        return ()
    spec = record.spec
    sizes = spec.mesh.shape
    return tuple(d for d, axes in enumerate(spec.layout.sharding_axes(len(spec.shape)))
                 if any(sizes[a] > 1 for a in axes))


def check_optimizer_step(fn: Callable, args: tuple) -> None:
    """A compile check (:func:`check_compiled_calls`) of MindSpore optimizer steps, each a silent
    wrong result otherwise, refused with a ``TypeError`` naming the parameters: an optimizer holding
    Parameters an engine has replaced in the model (built before ``fully_shard`` or a parallel
    style: their gradients are zero, they never change), and an update reading whole parameters
    (``AdaFactor``'s factored moments, ``Lamb`` / ``LARS`` norms) over Parameters holding pieces, or
    a group's ``grad_centralization`` over pieces cut along a dim other than 0 (it would treat each
    piece as the whole parameter; pieces of rows, fully_shard's, centralize exactly). Optimizers of
    other classes (a user's own) are taken as element-wise.

    Args:
        fn: the compiled function.
        args: its arguments, the bound object (the optimizer) first.

    Example::

        check_compiled_calls(check_optimizer_step)
    """
    from mindspore import nn as ms_nn
    if not args or not isinstance(args[0], ms_nn.Optimizer):
        return
    optimizer = args[0]
    params = tuple(optimizer.parameters)
    name = type(optimizer).__name__
    replaced = [(p.name, getattr(p, REPLACED_BY)) for p in params if getattr(p, REPLACED_BY, None)]
    if replaced:
        raise TypeError(f"{name} holds {len(replaced)} Parameters that {replaced[0][1]} replaced in the model with "
                        f"its own, e.g. {[n for n, _ in replaced[:3]]}: the optimizer was built before the model was "
                        f"sharded, so their gradients are zero and the model would never change. Build the optimizer "
                        f"after sharding, from model.trainable_params()")
    if reads_whole_parameters(optimizer):
        cut = [p.name for p in params if _cut_dims(p)]
        why = "reads each parameter whole (norms or factored moments)"
    else:       # centralization: a mean over dims 1.. of each dim-0 row (exact on pieces of rows)
        cut = [params[i].name for i in centralized_gradients(optimizer) if any(d >= 1 for d in _cut_dims(params[i]))]
        why = "centralizes gradients (grad_centralization: a mean over dims 1.. of each row)"
    if cut:
        raise TypeError(f"{name} {why}, but {len(cut)} of its parameters hold this rank's pieces (parallel styles, "
                        f"fully_shard or hsdp), e.g. {cut[:3]}: it would update each piece as if it were the whole "
                        f"parameter. Use an element-wise optimizer (SGD, Momentum, Adam, AdamWeightDecay, Adagrad, "
                        f"RMSProp, ...) or leave grad_centralization off for those parameters")



@dataclass(frozen=True)
class ParameterPlacement:
    """How one parameter is to be cut, before it is: ``placements`` on ``mesh`` (or an alias
    layout); ``as_dtensor``: a ``Parameter(DTensor)`` (the DTensor path) rather than a plain
    Parameter holding the piece (the styles); ``grad_partial_dims`` as in :class:`ParameterSharding`;
    ``src_data_rank``: whose values are cut (``None``: every rank its own); ``view``: for the styles'
    pieces, the shape the parameter is cut in, a reshape that becomes its global shape (``None``: its own).

    Example::

        ParameterPlacement(mesh, (Shard(0),)).make(dense.weight)       # the piece of rows
    """

    mesh: Any
    placements: Any
    as_dtensor: bool = False
    grad_partial_dims: Tuple[int, ...] = ()
    src_data_rank: Optional[int] = 0
    view: Optional[Tuple[int, ...]] = None

    def piece(self, global_shape: Sequence[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(offset, shape) of this rank's piece of a parameter of ``global_shape`` (cut in ``view``)."""
        global_shape = self.view or global_shape
        layout, coordinate = to_layout(self.mesh, self.placements, len(global_shape)), self.mesh.coordinate
        return tuple(layout.global_offset(global_shape, coordinate)), tuple(layout.local_shape(global_shape, coordinate))

    def empty_piece(self, global_shape: Sequence[int]) -> Optional[Tuple[int, ...]]:
        """The shape of an empty piece some rank would hold while ``global_shape`` is not empty, else
        ``None`` (:meth:`Layout.empty_piece`)."""
        global_shape = self.view or global_shape
        return to_layout(self.mesh, self.placements, len(global_shape)).empty_piece(global_shape)

    def make(self, param: Parameter) -> Parameter:
        """The new Parameter, with ``param``'s name, cut from ``param``'s values."""
        if self.as_dtensor:
            if not self.mesh.holds_values:
                raise NotImplementedError(
                    f"parameter {param.name!r}: a DTensor parameter (shard_module / distribute_module) holds values, "
                    f"which the ranks of {self.mesh!r} do not have (shapes only); place it with parallelize_module's "
                    "styles or fully_shard to plan it there")
            return Parameter(_distributed(param, self.mesh, self.placements, self.src_data_rank), name=param.name,
                             requires_grad=param.requires_grad)
        return sharded_parameter(param, self.mesh, self.placements, src_data_rank=self.src_data_rank,
                                 grad_partial_dims=self.grad_partial_dims, view=self.view)


def _distributed(param: Parameter, mesh, placements: Sequence, src_data_rank: Optional[int],
                 view: Optional[Tuple[int, ...]] = None) -> DTensor:
    # a deferred parameter is cut from initial_value (eager, or first-use), itself left as it was;
    # a meta one (DeviceCtx("meta")) has no values: its piece is a meta tensor of the local shape
    if is_meta(param):
        spec = DTensorSpec.build(mesh, placements, tuple(view or param.shape))
        return DTensor(meta_empty(spec.local_shape(), param.dtype), spec)
    value = initial_value(param)
    return distribute_tensor(Tensor(value.reshape(view) if view else value), mesh, placements,
                             src_data_rank=src_data_rank)
