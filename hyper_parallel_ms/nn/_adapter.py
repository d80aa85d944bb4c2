"""The one place that touches Cell internals: sub-cells by dotted path, a Cell's own
parameters, parameter replacement, forward hooks, conversions run inside ``construct``
and class swaps. Every change goes
through a :class:`CellChanges`, which undoes all of them if applying a plan fails, so a
failed call leaves the Cell as it was.

Example::

    with CellChanges() as changes:
        changes.set_parameter(dense, "weight", new_weight)
        changes.add_construct_hooks(dense, pre=[input_hook])

Conversions of the parallel styles run inside the Cell's own ``construct`` (a subclass
made by :func:`converting_class`), not as MindSpore forward hooks: under ``ms.jit`` and
GRAPH_MODE, MindSpore skips the forward hooks of a Cell reached by iterating a
``CellList`` / ``SequentialCell``, and a compiled pre-hook returning a slice of its input
fails with "Graph cycle exists". ``construct`` is compiled in every position.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Sequence, Tuple

from mindspore import Parameter, nn

from .._mindspore import cached_in_python, cell_subclass, refuse_while_compiling

__all__ = ["named_cells", "stands_in", "STANDS_IN", "own_parameters", "put_parameter", "CellChanges", "snapshot_parameters", "restore_parameters",
           "ConstructHooks", "converting_class"]

_MISSING = object()
_HOOKS = "_hpms_construct_hooks"
STANDS_IN = "_hpms_stands_in"     # True on a Cell holding the place of a layer another pipeline stage runs


def named_cells(root: nn.Cell) -> Dict[str, nn.Cell]:
    """Every Cell under ``root`` by dotted path (``""`` is ``root``), in definition order."""
    return {name: cell for name, cell in root.cells_and_names()}


def stands_in(cell: nn.Cell) -> bool:
    """Whether ``cell`` holds the place of a layer another pipeline stage runs (``split_blocks``'
    pass-through Cell): a plan naming that layer has nothing to do on this stage."""
    return getattr(cell, STANDS_IN, False) is True


def own_parameters(cell: nn.Cell) -> Dict[str, Parameter]:
    """The parameters held by ``cell`` itself (not by its children), by attribute name."""
    return {name: p for name, p in cell._params.items() if p is not None}


def held_parameter(cell: nn.Cell, name: str) -> Any:
    """What ``cell`` reads now as its own parameter ``name`` (see :func:`put_parameter`)."""
    return cell._params.get(name)


def put_parameter(cell: nn.Cell, name: str, value: Any) -> None:
    """Make ``value`` (a Parameter, or a tensor standing in for one during a forward) what
    ``cell`` reads as its own parameter ``name``, recording nothing (see :class:`CellChanges`)."""
    cell._params[name] = value


def snapshot_parameters(root: nn.Cell) -> List[tuple]:
    """(cell, attribute, parameter) for every parameter under ``root``: what :func:`restore_parameters` puts back."""
    return [(cell, name, p) for cell in named_cells(root).values() for name, p in own_parameters(cell).items()]


def restore_parameters(root: nn.Cell, snapshot: List[tuple]) -> None:
    """Put back the parameters recorded by :func:`snapshot_parameters`."""
    for cell, name, p in snapshot:
        if cell._params.get(name) is not p:
            put_parameter(cell, name, p)


class ConstructHooks(nn.Cell):
    """The hooks run inside one Cell's ``construct``: ``pre`` Cells have a method
    ``pre(cell, args) -> args`` and an int ``inputs_read`` (the leading inputs they read), ``post``
    Cells a method ``post(cell, args, output, bias) -> output``.

    A post hook that needs the Cell's ``bias`` says so with ``reads_bias``; the Cell's own
    ``construct`` reads it as ``self.bias`` and passes it. Read from the ``cell`` argument (or with
    ``getattr``), a property such as fully_shard's gathered parameters would be evaluated by
    MindSpore's compiler as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_hooks = nn.CellList()
        self.post_hooks = nn.CellList()
        self.graph_error = ""          # why this Cell cannot run compiled (raised while compiling)
        self.reads_bias = False        # a post hook needs the Cell's bias
        self.inputs_read = 0           # the leading inputs the pre hooks read (given by keyword: moved to args)

    def before(self, cell, args):
        for hook in self.pre_hooks:
            args = hook.pre(cell, args)
        return args

    def after(self, cell, args, output, bias):
        for hook in self.post_hooks:
            output = hook.post(cell, args, output, bias)
        return output


def _positional_names(construct: Callable) -> Tuple[str, ...]:
    """The names of ``construct``'s inputs that may be given by position (``self`` excluded)."""
    try:
        params = list(inspect.signature(construct).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = []
    for p in params:
        if p.kind not in kinds:
            break
        names.append(p.name)
    return tuple(names)


@cached_in_python
def keywords_to_move(cls_name: str, names: Tuple[str, ...], given: int, keywords: Tuple[str, ...],
                     read: int) -> Tuple[str, ...]:
    """The keyword inputs that a Cell's pre hooks must see as positional ones: the inputs after the
    ``given`` positional ones, up to the ``read`` leading inputs the hooks convert, given by keyword
    (``cell(x=h)`` is ``cell(h)`` to the styles). Raises where a keyword input the hooks would read
    follows a missing one (it cannot be moved, and would pass unconverted).

    >>> keywords_to_move("Dense", ("x",), 0, ("x",), 1)
    ('x',)
    >>> keywords_to_move("Dense", ("x", "mask"), 1, ("mask",), 1)
    ()
    """
    moved = []
    for name in names[given:read]:
        if name not in keywords:
            break
        moved.append(name)
    late = [n for n in names[given + len(moved):read] if n in keywords]
    if late:
        raise ValueError(
            f"{cls_name} got the input(s) {late} by keyword after the input {names[given + len(moved)]!r} was left out, "
            f"but its parallel style converts its first {read} inputs by position: pass them positionally")
    return tuple(moved)


def converting_class(base: type) -> type:
    """A subclass of the Cell class ``base`` whose ``construct`` runs the instance's
    :class:`ConstructHooks` around ``base.construct``. The hooks see the positional inputs; an
    input they read that is given by keyword (``dense(x=h)``) is handed to them as positional
    (PyNative and compiled); other keywords pass through."""
    cached = _CONVERTING.get(base)
    if cached is not None:
        return cached

    def construct(self, *args, **kwargs):
        hooks = getattr(self, _HOOKS)
        refuse_while_compiling(hooks.graph_error)
        moved = keywords_to_move(self._hpms_base_name, self._hpms_positional, len(args), tuple(kwargs.keys()),
                                 hooks.inputs_read)
        for name in moved:
            args = args + (kwargs[name],)
        kwargs = {k: v for k, v in kwargs.items() if k not in moved}
        args = hooks.before(self, args)
        output = self._hpms_converted_construct(*args, **kwargs)
        if hooks.reads_bias:
            return hooks.after(self, args, output, self.bias)
        return hooks.after(self, args, output, None)
    cls = cell_subclass(base.__name__, (base,), {"construct": construct, "_hpms_converted_construct": base.construct,
                                                 "__module__": base.__module__, "__qualname__": base.__qualname__,
                                                 "_hpms_converting": True,
                                                 "_hpms_positional": _positional_names(base.construct),
                                                 "_hpms_base_name": base.__name__})
    _CONVERTING[base] = cls
    return cls


_CONVERTING: Dict[type, type] = {}


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
        put_parameter(cell, name, param)
        self._undo.append(lambda: put_parameter(cell, name, old))

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

    def add_forward_hook(self, cell: nn.Cell, fn: Callable, *, with_kwargs: bool = False,
                         always_call: bool = False) -> None:
        """``always_call``: run ``fn`` also when the forward raises (a hook putting the Cell back)."""
        handle = cell.register_forward_hook(fn, with_kwargs=with_kwargs, always_call=always_call)
        self._undo.append(handle.remove)

    def add_construct_hooks(self, cell: nn.Cell, pre: Sequence[nn.Cell] = (), post: Sequence[nn.Cell] = (),
                            graph_error: str = "") -> None:
        """Run ``pre`` / ``post`` hook Cells inside ``cell``'s ``construct`` (after any earlier ones);
        ``graph_error``: raised if ms.jit / GRAPH_MODE compiles ``cell`` (what it cannot do there)."""
        if not pre and not post and not graph_error:
            return
        hooks = cell.__dict__.get(_HOOKS)
        if hooks is None:
            hooks = ConstructHooks()
            self.set_attribute(cell, _HOOKS, hooks)
        if not getattr(type(cell), "_hpms_converting", False):
            self.swap_class(cell, converting_class(type(cell)))
        old_pre, old_post, old_error = len(hooks.pre_hooks), len(hooks.post_hooks), hooks.graph_error
        old_reads, old_inputs = hooks.reads_bias, hooks.inputs_read
        hooks.graph_error = graph_error or old_error
        for h in pre:
            hooks.inputs_read = max(hooks.inputs_read, h.inputs_read)
            hooks.pre_hooks.append(h)
        for h in post:
            hooks.reads_bias = hooks.reads_bias or getattr(h, "reads_bias", False)
            hooks.post_hooks.append(h)

        def undo():
            del hooks.pre_hooks[old_pre:]
            del hooks.post_hooks[old_post:]
            hooks.graph_error, hooks.reads_bias, hooks.inputs_read = old_error, old_reads, old_inputs
        self._undo.append(undo)

    def swap_class(self, cell: nn.Cell, cls: type) -> None:
        old = cell.__class__
        cell.__class__ = cls
        self._undo.append(lambda: setattr(cell, "__class__", old))
