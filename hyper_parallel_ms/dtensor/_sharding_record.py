"""The sharding record of a Parameter holding this rank's piece, and clones that keep it.

A parallel style or ``fully_shard`` leaves a plain ``Parameter`` holding the piece, with its
:class:`ParameterSharding` recorded beside it; ``shard_module`` leaves a ``Parameter(DTensor)``.
MindSpore's ``Parameter.clone`` (what optimizers use for their states: ``adam_m``, ``adam_v``) keeps
neither: the clone would pass for a whole tensor of the piece's shape, and a checkpoint of the
optimizer would store every rank's moments under one whole name. :func:`clone_keeping_record`
clones and records the source's sharding on the clone, so the states are laid out like their
parameters.

Example::

    state = weight.clone("zeros")            # a piece of the optimizer's: laid out like ``weight``
    parameter_sharding(state).spec.placements
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any, Optional, Tuple

from mindspore import Parameter

from ._spec import DTensorSpec

__all__ = ["ParameterSharding", "parameter_sharding", "attach_record", "clone_keeping_record"]

_ATTR = "_hpms_sharding"


@dataclass(frozen=True)
class ParameterSharding:
    """The sharding of a parameter holding this rank's piece.

    Args:
        spec: mesh, placements and global shape of the parameter (a ``DTensorSpec``).
        grad_partial_dims: mesh dims over which each rank's gradient is only its share of the
            whole (a replicated parameter used on sequence-sharded activations);
            :class:`GradientReducer` sums them.

    Example::

        record = parameter_sharding(model.fc1.weight)   # ParameterSharding(spec=..., grad_partial_dims=())
        record.spec.placements, record.spec.shape
    """

    spec: DTensorSpec
    grad_partial_dims: Tuple[int, ...] = ()


def parameter_sharding(param: Any) -> Optional[ParameterSharding]:
    """The sharding recorded on ``param`` by a parallel style, or ``None``.

    Args:
        param: a Parameter (any: those no engine sharded give ``None``).

    Example::

        parameter_sharding(model.fc1.weight).spec.placements      # (Shard(dim=0),)
    """
    return getattr(param, _ATTR, None)


def attach_record(param: Parameter, record: ParameterSharding) -> None:
    """Record ``record`` on ``param`` (a plain Parameter holding a piece), and make
    ``param.clone(...)`` keep it (:func:`clone_keeping_record`).

    Args:
        param: the Parameter holding the piece.
        record: its sharding.

    Example::

        attach_record(piece, ParameterSharding(spec))
    """
    object.__setattr__(param, _ATTR, record)
    object.__setattr__(param, "clone", MethodType(clone_keeping_record, param))


def clone_keeping_record(param: Parameter, init: Any = "same") -> Parameter:
    """``Parameter.clone(param, init)`` with ``param``'s sharding recorded on the clone, which holds a
    piece of the same shape.

    Args:
        param: the Parameter cloned.
        init: as ``Parameter.clone``'s (``"same"``, ``"zeros"``, a number, a Tensor).

    Example::

        state = clone_keeping_record(weight, "zeros")
    """
    clone = Parameter.clone(param, init)
    record = parameter_sharding(param)
    if record is not None:
        attach_record(clone, record)
    return clone
