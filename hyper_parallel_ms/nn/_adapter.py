"""The one place that touches Cell internals: sub-cells by dotted path, a Cell's own
parameters, parameter replacement, forward hooks and class swaps. Every change goes
through a :class:`CellChanges`, which undoes all of them if applying a plan fails, so a
failed call leaves the Cell as it was.

Example::

    with CellChanges() as changes:
        changes.set_parameter(dense, "weight", new_weight)
        changes.add_forward_pre_hook(dense, hook.pre)
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from mindspore import Parameter, nn

__all__ = ["named_cells", "own_parameters", "CellChanges", "snapshot_parameters", "restore_parameters"]

_MISSING = object()


def named_cells(root: nn.Cell) -> Dict[str, nn.Cell]:
    """Every Cell under ``root`` by dotted path (``""`` is ``root``), in definition order."""
    return {name: cell for name, cell in root.cells_and_names()}


def own_parameters(cell: nn.Cell) -> Dict[str, Parameter]:
    """The parameters held by ``cell`` itself (not by its children), by attribute name."""
    return {name: p for name, p in cell._params.items() if p is not None}


def snapshot_parameters(root: nn.Cell) -> List[tuple]:
    """(cell, attribute, parameter) for every parameter under ``root``: what :func:`restore_parameters` puts back."""
    return [(cell, name, p) for cell in named_cells(root).values() for name, p in own_parameters(cell).items()]


def restore_parameters(root: nn.Cell, snapshot: List[tuple]) -> None:
    """Put back the parameters recorded by :func:`snapshot_parameters`."""
    for cell, name, p in snapshot:
        if cell._params.get(name) is not p:
            cell._params[name] = p


class CellChanges:
    """Records changes to Cells; leaving the ``with`` block by an exception undoes them, newest first."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def __enter__(self) -> "CellChanges":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is not None:
            self.undo()
        return False

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def set_parameter(self, cell: nn.Cell, name: str, param: Parameter) -> None:
        old = cell._params[name]
        cell._params[name] = param
        self._undo.append(lambda: cell._params.__setitem__(name, old))

    def set_attribute(self, obj: Any, name: str, value: Any) -> None:
        old = obj.__dict__.get(name, _MISSING)
        object.__setattr__(obj, name, value)

        def undo():
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                object.__setattr__(obj, name, old)
        self._undo.append(undo)

    def add_forward_pre_hook(self, cell: nn.Cell, fn: Callable, *, with_kwargs: bool = False) -> None:
        handle = cell.register_forward_pre_hook(fn, with_kwargs=with_kwargs)
        self._undo.append(handle.remove)

    def add_forward_hook(self, cell: nn.Cell, fn: Callable, *, with_kwargs: bool = False) -> None:
        handle = cell.register_forward_hook(fn, with_kwargs=with_kwargs)
        self._undo.append(handle.remove)

    def swap_class(self, cell: nn.Cell, cls: type) -> None:
        old = cell.__class__
        cell.__class__ = cls
        self._undo.append(lambda: setattr(cell, "__class__", old))
