"""Reads of a styled Cell's pieces by code outside it.

A parallel style moves activations around a Cell's own ``construct`` (its input and output
conversions); the Cell's parameters hold this rank's piece. Code of another Cell that reads those
parameters itself (MindSpore's ``nn.MultiheadAttention`` reads ``out_proj.weight`` and never calls
``out_proj``; a tied head reading ``embed.embedding_table``) would compute on the piece as if it
were the whole parameter, with no conversion around it.

So each sharded parameter of a styled Cell is read through a property (:func:`guarded_class`).
In PyNative, a read from the ``construct`` of another Cell (or code it calls) that is not one of
the Cell's declared readers hands that code a :class:`ForeignPiece`: the same piece, whose
metadata (``shape``, ``dtype``) reads as usual but whose first op raises naming the Cell, the style
and the fix. Reads outside any forward (inspection, initialisation, optimizers, checkpoints) get the
parameter. Compiled code (``ms.jit``, GRAPH_MODE) reads the parameter with no check: a graph runs
no Python per read. :func:`check_known_readers` refuses, before anything changes and in both modes,
styles on the children that MindSpore's own Cells read this way.

Example::

    parallelize_module(model, mesh, {"self_attn.out_proj": RowwiseParallel()})   # refused: use
    parallelize_module(model, mesh, {"self_attn": MultiheadAttentionParallel()})  # instead
"""
from __future__ import annotations

import sys
from typing import Dict, Iterable, List, Tuple

from mindspore import Tensor, nn

from .._mindspore import as_subclass, compiling_graph_code, reading_class, tensor_hook

__all__ = ["ForeignPiece", "guarded_class", "check_known_readers", "READERS_ATTR", "GUARD_ATTR"]

READERS_ATTR = "_hpms_readers"          # on a guarded Cell: ids of the other Cells allowed to read its pieces
GUARD_ATTR = "_hpms_guarded_by"         # on a guarded Cell: "<Style> on '<path>'", for the messages
_FRAMES = 64                            # how far up the stack a read looks for the forward it belongs to

# MindSpore Cells whose own code reads the parameters of these children instead of calling them
_KNOWN_READERS: Dict[type, Tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


def _refuse(piece: "ForeignPiece", func) -> None:
    raise ValueError(piece.hpms_refusal.format(op=getattr(func, "name", func)))


def _refused_reflected(name: str):
    """``plain OP piece``: Python asks the subclass first, which refuses with the cause."""
    def reflected(self, other):
        _refuse(self, name)
    return reflected


class ForeignPiece(Tensor):
    """A styled Cell's piece as handed to another Cell's forward code: every op on it raises
    ``ValueError`` with ``hpms_refusal`` (its ``{op}`` filled in); ``shape`` and ``dtype`` read as usual.

    Example::

        ForeignPiece  # made by the guarded property, never by hand
    """

    hpms_refusal = ""
    __radd__, __rsub__, __rmul__ = _refused_reflected("add"), _refused_reflected("sub"), _refused_reflected("mul")
    __rtruediv__, __rmatmul__, __rpow__ = (_refused_reflected("truediv"), _refused_reflected("matmul"),
                                           _refused_reflected("pow"))

    def __fallback__(self, func, args=(), kwargs=None):
        return tensor_hook(lambda f, a, k: _refuse(self, f))(self, func, args, kwargs)


def _forward_reader(start) -> object:
    """The Cell whose ``construct`` the frame ``start`` runs in (itself or a caller), or ``None``
    when no Cell's forward is running there."""
    frame, depth = start, 0
    while frame is not None and depth < _FRAMES:
        if frame.f_code.co_name == "construct":
            reader = frame.f_locals.get("self")
            if isinstance(reader, nn.Cell):
                return reader
        frame, depth = frame.f_back, depth + 1
    return None


def _refusal(owner: nn.Cell, attr: str, reader: nn.Cell) -> str:
    guarded_by = owner.__dict__.get(GUARD_ATTR, "a parallel style")
    known = next((" For nn.MultiheadAttention apply MultiheadAttentionParallel() to the attention Cell instead."
                  for cls in _KNOWN_READERS if isinstance(reader, cls)), "")
    return (f"{guarded_by}: its parameter '{attr}' holds this rank's piece, but the forward of another Cell "
            f"({type(reader).__name__}) read it and used it in the op '{{op}}' outside the styled Cell's own "
            "construct, so the style's input and output conversions never ran around that use and it would compute "
            f"on the piece as if it were the whole parameter.{known} Otherwise call the styled Cell rather than "
            "reading its parameters, or leave it unstyled")


def _checked(owner: nn.Cell, attr: str, value, caller) -> object:
    """PyNative: ``value`` (the piece) for reads by ``owner``'s own forward, its declared readers' or
    code outside every forward; a :class:`ForeignPiece` for any other Cell's forward."""
    reader = _forward_reader(caller)
    if reader is None or reader is owner or id(reader) in owner.__dict__.get(READERS_ATTR, ()):
        return value
    piece = as_subclass(ForeignPiece, value)
    piece.hpms_refusal = _refusal(owner, attr, reader)
    return piece


def _guarded(attr: str) -> property:
    def read(self):
        value = self._params[attr]
        if compiling_graph_code():
            return value
        return _checked(self, attr, value, sys._getframe(1))
    read.__name__ = attr
    return property(read, doc=f"``{attr}``: this rank's piece (refused to other Cells' forwards)")


def guarded_class(base: type, attrs: Iterable[str]) -> type:
    """A subclass of the Cell class ``base`` whose parameters ``attrs`` are read through a property
    handing other Cells' forwards a :class:`ForeignPiece` (PyNative). The instance names its style in
    ``GUARD_ATTR`` and the other Cells allowed to read its pieces (by id) in ``READERS_ATTR``.

    Example::

        dense.__class__ = guarded_class(type(dense), ["weight", "bias"])
    """
    return reading_class(_GUARDED, base, tuple(sorted(attrs)), _guarded)


_GUARDED: Dict[tuple, type] = {}


def check_known_readers(cells: Dict[str, nn.Cell], guarded: List[Tuple[str, str, Tuple[nn.Cell, ...]]]) -> None:
    """Refuse a style sharding the parameters of a child that its MindSpore parent reads itself
    (``nn.MultiheadAttention``'s ``out_proj``) unless that parent is one of its readers.

    Args:
        cells: every Cell of the model by path.
        guarded: ``(path, "<Style> on '<path>'", readers)`` of each Cell whose parameters a style cuts.

    Example::

        check_known_readers(named_cells(model), [("attn.out_proj", "RowwiseParallel on 'attn.out_proj'", ())])
    """
    def parent_of(path: str):
        return cells.get(path.rpartition(".")[0]) if path else None
    # a child its parent's style places (its out_proj): another style on it is a conflict, named later
    placed_by_parent = {path for path, _, readers in guarded if any(r is parent_of(path) for r in readers)}
    for path, guarded_by, readers in guarded:
        parent_path, _, name = path.rpartition(".")
        parent = parent_of(path)
        for cls, children in _KNOWN_READERS.items():
            if isinstance(parent, cls) and name in children and path not in placed_by_parent:
                raise ValueError(
                    f"{guarded_by}: {cls.__name__} '{parent_path or '<root>'}' reads its {name}'s parameters in its "
                    f"own construct and never calls {name}, so the style's input and output conversions would never "
                    f"run and the attention would compute on this rank's pieces. Apply MultiheadAttentionParallel() to "
                    f"'{parent_path or '<root>'}' instead (it splits the heads, {name} included)")
