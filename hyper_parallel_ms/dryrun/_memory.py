"""The bytes a rank holds between steps: its parameter pieces, their gradients, its optimizer state.

Read from the objects the rank built, without values: each distinct Parameter of the model
counts its (piece) shape times its itemsize; each trainable one a gradient of the same size
(what ``value_and_grad`` and fully_shard's reduce-scatter return); the optimizer state is the
optimizer's per-parameter slots: each of its tuples of Parameters aligned with the parameters it
trains (same length, same shapes), named by the prefix MindSpore gives their names
(AdamWeightDecay / Adam: ``adam_m``, ``adam_v``; Momentum: ``moments``); its scalars (step,
learning rate) are left out.

Example::

    held = memory_of(model, optimizer)
    held.param_bytes, held.optimizer_slots          # e.g. {'adam_m': ..., 'adam_v': ...}
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Dict, List, Sequence

from mindspore import Parameter, nn

__all__ = ["Held", "memory_of", "cells_of"]


@dataclass(frozen=True)
class Held:
    """Bytes held between steps.

    Args:
        param_bytes: parameter pieces.
        grad_bytes: gradients of the trainable ones.
        optimizer_bytes: optimizer slots.
        optimizer_slots: optimizer bytes per slot name.
        parameters: ``(name, shape, dtype)`` of each piece, sorted.

    >>> Held(8, 8, 16, {"adam_m": 8, "adam_v": 8}, ()).optimizer_bytes
    16
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    optimizer_slots: Dict[str, int]
    parameters: tuple


def _bytes(p: Parameter) -> int:
    return prod(tuple(p.shape)) * p.itemsize


def cells_of(model: Any) -> List[nn.Cell]:
    """The Cells of what a rank built: a Cell, a ``PipelineStage`` (its submodule), a schedule
    (its stages) or a sequence of those.

    Args:
        model: the model object(s).

    >>> [type(c).__name__ for c in cells_of([nn.Dense(2, 2), nn.ReLU()])]
    ['Dense', 'ReLU']
    """
    if isinstance(model, nn.Cell):
        return [model]
    if hasattr(model, "submodule"):
        return cells_of(model.submodule)
    if hasattr(model, "stages"):
        return cells_of(list(model.stages))
    if isinstance(model, (list, tuple)):
        return [c for m in model for c in cells_of(m)]
    raise TypeError(f"the model must be an nn.Cell, a PipelineStage, a pipeline schedule or a list of them, "
                    f"got {type(model).__name__}")


def _distinct(cells: Sequence[nn.Cell]) -> List[Parameter]:
    seen, out = set(), []
    for cell in cells:
        for p in cell.get_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _optimizer_slots(optimizer: Any) -> Dict[str, int]:
    """Bytes per slot of ``optimizer`` (see the module docstring)."""
    if not isinstance(optimizer, nn.Cell) or not hasattr(optimizer, "parameters"):
        raise TypeError(f"the optimizer must be a MindSpore optimizer, got {type(optimizer).__name__}")
    trained = tuple(optimizer.parameters)
    shapes = [tuple(p.shape) for p in trained]
    slots: Dict[str, int] = {}
    for attr, value in vars(optimizer).items():
        if attr == "_parameters" or not isinstance(value, (tuple, list)) or len(value) != len(trained) or not trained:
            continue
        if value is optimizer.parameters or not all(isinstance(p, Parameter) for p in value):
            continue
        if any(id(p) == id(q) for p, q in zip(value, trained)) or [tuple(p.shape) for p in value] != shapes:
            continue
        slot = value[0].name.split(".", 1)[0] if "." in value[0].name else attr
        slots[slot] = slots.get(slot, 0) + sum(_bytes(p) for p in value)
    return slots


def memory_of(model: Any, optimizer: Any = None) -> Held:
    """The bytes ``model``'s pieces and ``optimizer``'s state hold (see the module docstring).

    Args:
        model: what the rank built (see :func:`cells_of`).
        optimizer: a MindSpore optimizer (or ``None``).

    Example::

        memory_of(model, nn.AdamWeightDecay(model.trainable_params())).optimizer_bytes
    """
    params = _distinct(cells_of(model))
    slots = _optimizer_slots(optimizer) if optimizer is not None else {}
    return Held(sum(_bytes(p) for p in params), sum(_bytes(p) for p in params if p.requires_grad),
                sum(slots.values()), slots,
                tuple(sorted((p.name, tuple(p.shape), str(p.dtype)) for p in params)))
