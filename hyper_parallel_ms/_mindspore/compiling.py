"""Compilation: what runs in Python while MindSpore compiles (``ms.jit``, GRAPH_MODE), how to tell,
and the Cell classes and Cells that compiled graphs need.

Contracts: ``ms.jit`` runs a ``functools.lru_cache`` object as opaque Python on its constant
arguments (:func:`cached_in_python`, :func:`run_in_python`); graph compilation runs in
``_JitExecutor.compile`` / ``_CellGraphExecutor.compile`` (``mindspore.graph.api`` from 2.9,
``mindspore.common.api`` on 2.8), which receive the call's arguments (:func:`is_compiling`,
:func:`reject_in_compiled_args`); differentiating a compiled forward from PyNative reads the last
call's output for every call of one custom-bprop Cell instance (:func:`cell_per_call_site`), and a
plain ``ms.jit`` compiles two property reads of Parameters through one shared identity
custom-bprop Cell as the first read (so a shared one computes, or each read has its own); a Cell property is compiled only when
declared in the Cell's own class (:func:`cell_subclass`).

>>> @run_in_python
... def double(n):
...     return 2 * n
>>> double(4), is_compiling()
(8, False)
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ._release import F, _graph_api
from .swaps import Swap, swap_entry_points

__all__ = ["graph_of_its_own", "cell_subclass", "reading_class", "run_first_call_checks", "cached_in_python", "run_in_python", "cell_per_call_site",
           "constant_id", "constant_of", "refuse_while_compiling",
           "is_compiling", "running_eagerly", "compiling_graph_code", "compile_argument_checks",
           "reject_in_compiled_args"]


def graph_of_its_own(fn: Callable) -> Callable:
    """A copy of the Python function ``fn`` (same code, globals, defaults, closure) that MindSpore
    parses into a graph of its own. MindSpore 2.10 failed to compile ("The func graph is empty ...
    all_gather") a graph in which one function is called by a custom-bprop Cell's ``construct`` and
    by another custom-bprop Cell's ``bprop`` (measured with ``comm.all_gather`` on a (2, 2) mesh);
    calling a copy in one of the two places compiles.

    Args:
        fn: a plain Python function.

    Example::

        gather = graph_of_its_own(comm.all_gather)
    """
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__module__ = fn.__module__
    return copy


def _defined_by_mindspore(prop: property) -> bool:
    return getattr(prop.fget, "__module__", "").startswith("mindspore")


def cell_subclass(name: str, bases: Tuple[type, ...], namespace: Dict[str, Any]) -> type:
    """A Cell class for a class swap that MindSpore compiles like the classes it extends.

    MindSpore's compiler runs a Cell's property as graph code only when the property is in the
    Cell's own class; an inherited one is evaluated in Python while compiling, giving a constant
    without gradient (silently zero gradients for the parameters it reads). Every property of
    ``bases`` is therefore declared again in the new class. A ``construct`` in ``namespace`` that
    wraps a base one must call it as a method of ``self`` (a class attribute holding the base
    function): called as ``Base.construct(self, ...)``, the properties it reads are constants too.

    >>> class A:
    ...     @property
    ...     def w(self): return 1
    >>> "w" in cell_subclass("B", (A,), {}).__dict__
    True
    """
    cls = type(name, bases, dict(namespace))
    for attr in dir(cls):
        owner = next((k for k in cls.__mro__ if attr in k.__dict__), cls)
        value = owner.__dict__.get(attr)
        # MindSpore's own Cell properties are its Python-side bookkeeping, never compiled
        if owner is not cls and isinstance(value, property) and not _defined_by_mindspore(value):
            setattr(cls, attr, value)
    return cls


def reading_class(cache: Dict[tuple, type], base: type, attrs: Tuple[str, ...],
                  read: Callable[[str], property], **extra: Any) -> type:
    """The :func:`cell_subclass` of the Cell class ``base`` that reads each of ``attrs`` (sorted)
    through ``read(attr)``, a property, with the class attributes ``extra``; made once per
    ``(base, attrs)`` in ``cache`` (a class swap of many Cells of one kind shares one class).

    >>> class A:
    ...     w = 1
    >>> cache = {}
    >>> B = reading_class(cache, A, ("w",), lambda a: property(lambda self: 2))
    >>> B().w, reading_class(cache, A, ("w",), None) is B
    (2, True)
    """
    key = (base, attrs)
    cls = cache.get(key)
    if cls is None:
        namespace = {a: read(a) for a in attrs}
        namespace.update(__module__=base.__module__, __qualname__=base.__qualname__, **extra)
        cls = cache[key] = cell_subclass(base.__name__, (base,), namespace)
    return cls


# ------------------------------------------------------------ compile-time Python
def run_first_call_checks(cell: Any) -> None:
    """Run now the checks MindSpore's ``Cell.__call__`` runs on a Cell's first call (they walk the
    parameter tables and expect Parameters there), for ``cell`` and every Cell under it. Contract:
    ``_is_check_and_refresh`` / ``_self_check`` and ``_init_flag`` / ``_init_check``, and after
    this a call no longer runs them.

    Args:
        cell: an ``nn.Cell``.

    >>> from mindspore import nn
    >>> run_first_call_checks(nn.Dense(2, 2))
    """
    for _, sub in cell.cells_and_names():
        if not getattr(sub, "_is_check_and_refresh", True):
            sub._self_check()
        if not getattr(sub, "_init_flag", True):
            sub._init_check()


def cached_in_python(fn: F) -> F:
    """Memoise ``fn`` (hashable arguments); under ms.jit it runs in Python at compile time."""
    return functools.lru_cache(maxsize=4096)(fn)


def run_in_python(fn: F) -> F:
    """Under ms.jit, run ``fn`` in Python at compile time instead of compiling it (no memo)."""
    return functools.lru_cache(maxsize=0)(fn)


def cell_per_call_site(fn: F) -> F:
    """``fn`` returning a Cell with a custom ``bprop`` (or holding one): memoised (hashable
    arguments), except while MindSpore compiles a graph that PyNative will differentiate
    (``ms.value_and_grad(ms.jit(f))``, a compiled pipeline stage): then each call builds a new
    Cell, so no two places of that graph call the same instance. Contract: in such a graph the
    ops reading the output of the first of two calls of one custom-bprop Cell instance get
    wrong gradients (MindSpore 2.10 measured; two instances, or the whole step compiled, are
    right), and PyNative's ``requires_grad()`` is on while it compiles (MindSpore keys that
    compile ".grad"); checked by the seam's contract test. Whole-step graphs keep the shared
    Cells (measured: building them per call site made the example's first jit step 1.6x slower).

    >>> from mindspore import nn
    >>> dense = cell_per_call_site(lambda n: nn.Dense(n, n))
    >>> dense(2) is dense(2)
    True
    """
    memo = functools.lru_cache(maxsize=4096)(fn)

    def build(*args: Any, **kwargs: Any) -> Any:
        if _graph_api._pynative_executor.requires_grad() and is_compiling():
            return fn(*args, **kwargs)
        return memo(*args, **kwargs)
    functools.update_wrapper(build, fn)
    return functools.lru_cache(maxsize=0)(build)


class _Constants:
    """Small ints naming hashable values, in the order first asked."""

    def __init__(self) -> None:
        self.ids: Dict[Any, int] = {}
        self.values: List[Any] = []

    def id_of(self, value: Any) -> int:
        if value not in self.ids:
            self.ids[value] = len(self.values)
            self.values.append(value)
        return self.ids[value]


_CONSTANTS = _Constants()


def constant_id(value: Any) -> int:
    """A small int naming the hashable ``value`` (equal values, one number): what a Cell keeps as an
    attribute for graph code to hand to a :func:`cell_per_call_site` / :func:`run_in_python`
    function, where the value itself (a DeviceMesh, a tuple holding one) is no graph constant.
    :func:`constant_of` gives the value back.

    >>> constant_of(constant_id(("mesh", 2))) == ("mesh", 2)
    True
    """
    return _CONSTANTS.id_of(value)


def constant_of(number: int) -> Any:
    """The value :func:`constant_id` named ``number``."""
    return _CONSTANTS.values[number]


# ------------------------------------------------------------ compile detection
_JIT_COMPILE = _graph_api._JitExecutor.compile
_CELL_COMPILE = _graph_api._CellGraphExecutor.compile
_COMPILE_CODES = frozenset({_JIT_COMPILE.__code__, _CELL_COMPILE.__code__})


class _Compiles(threading.local):
    """Per thread: the compiles running now through this package's swapped entry points."""

    def __init__(self) -> None:
        self.depth = 0


_COMPILES = _Compiles()
_OURS: List[Callable] = []       # the swapped entry points, once swapped (every compile runs through them)


def _entry_points_ours() -> bool:
    return bool(_OURS) and _graph_api._JitExecutor.compile is _OURS[0] and \
        _graph_api._CellGraphExecutor.compile is _OURS[1]


@run_in_python
def refuse_while_compiling(message: str) -> bool:
    """Raise ``NotImplementedError(message)`` (when ``message`` is not empty) if ms.jit / GRAPH_MODE is
    compiling the code that calls this; return True otherwise (graph code can branch on the constant,
    so MindSpore never parses what a refused Cell would run).

    >>> refuse_while_compiling("cannot compile this Cell")       # PyNative: nothing raised
    True
    """
    if message and is_compiling():
        raise NotImplementedError(message)
    return True


def is_compiling() -> bool:
    """Whether Python runs on behalf of MindSpore's graph compiler (ms.jit or GRAPH_MODE): a count
    kept by the swapped compile entry points while they are the ones in place (a read per call,
    where walking the caller's frames cost about 25 us per call in a PyNative step, measured), else
    MindSpore's compile frames looked up on the stack."""
    if _COMPILES.depth:
        return True
    if _entry_points_ours():
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _COMPILE_CODES:
            return True
        frame = frame.f_back
    return False


@run_in_python
def running_eagerly() -> bool:
    """``False`` while ms.jit / GRAPH_MODE compiles the caller, ``True`` when Python runs it.

    Inside compiled code the call is a constant, so ``if running_eagerly(): ...`` keeps
    PyNative-only work out of graphs (the branch is never compiled).

    >>> running_eagerly()
    True
    """
    return not is_compiling()


@run_in_python
def compiling_graph_code() -> bool:
    """``True`` where MindSpore's compiler compiles the caller as graph code, ``False`` where
    Python runs it: in PyNative, and in Python code a compile runs (a Cell's ``repr``, which
    GRAPH_MODE's compile calls and which reads properties). Contract: the compiler evaluates a
    ``run_in_python`` call of graph code from a frame of code compiled from a string, not
    from the caller's own code (checked by the seam's contract test).

    >>> compiling_graph_code()
    False
    """
    return sys._getframe(1).f_code.co_filename == "<string>" and is_compiling()


def _compiled_arguments(fn: Callable, args: tuple, kwargs: dict) -> Iterator[Tuple[str, Any]]:
    """(name, value) of each argument of a compiled call, nested sequences and dicts included."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    pending = [(names[i] if i < len(names) else f"#{i}", a) for i, a in enumerate(args)]
    pending += [(str(k), v) for k, v in kwargs.items()]
    while pending:
        name, value = pending.pop(0)
        yield name, value
        if isinstance(value, (tuple, list)):
            pending += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, dict):
            pending += [(f"{name}[{k!r}]", v) for k, v in value.items()]


def _check_compiled_call(kind: str, fn: Callable, args: tuple, kwargs: dict, rejected: type,
                         allowed: Sequence[Callable[[Callable, tuple], bool]] = ()) -> None:
    if any(allow(fn, args) for allow in allowed):
        return
    for name, value in _compiled_arguments(fn, args, kwargs):
        if isinstance(value, rejected):
            raise TypeError(
                f"argument '{name}' of {kind} '{getattr(fn, '__qualname__', fn)}' is a {type(value).__name__} "
                f"{value!r}: compiled code would compute on its local piece only. Pass .to_local() pieces "
                "(and rebuild with DTensor.from_local after the call), or call it in PyNative without ms.jit")


_GUARDED: list = []
_ALLOWED: list = []
_CHECKS: list = []


def compile_argument_checks(rejected: Sequence[type],
                            allowed: Sequence[Callable[[Callable, tuple], bool]] = (),
                            checks: Sequence[Callable[[Callable, tuple], None]] = ()) -> List[Swap]:
    """Swaps of MindSpore's compile entry points (``ms.jit`` and GRAPH_MODE Cells) that run
    each of ``checks`` (``check(fn, args)``, raising to refuse the call), then raise a
    ``TypeError`` naming the argument when a compiled call gets an object of a type in
    ``rejected`` (all read at each compile, so they may grow), unless a predicate of ``allowed``
    (``allow(fn, args)``, ``args`` starting with the bound object) accepts the call, for
    :func:`swap_entry_points`."""

    def run_checks(kind: str, fn: Callable, args: tuple, kwargs: dict) -> None:
        for check in checks:
            check(fn, args)
        _check_compiled_call(kind, fn, args, kwargs, tuple(rejected), allowed)

    def jit_compile(original: Callable) -> Callable:
        @functools.wraps(original)
        def compile(self, method_name, *args, **kwargs):
            given = args if self.obj is None else (self.obj,) + args
            run_checks("the ms.jit function", self.fn, given, {k: v for k, v in kwargs.items() if k != "phase"})
            return _counted(original, self, method_name, *args, **kwargs)
        return compile

    def cell_compile(original: Callable) -> Callable:
        @functools.wraps(original)
        def compile(self, obj, *args, **kwargs):
            run_checks("the GRAPH_MODE Cell", type(obj).construct, (obj,) + args,
                       {k: v for k, v in kwargs.items() if k not in ("phase", "do_convert", "jit_config_dict")})
            return _counted(original, self, obj, *args, **kwargs)
        return compile

    return [(_graph_api._JitExecutor, "compile", jit_compile), (_graph_api._CellGraphExecutor, "compile", cell_compile)]


def _counted(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` (a MindSpore compile entry point) counted in :func:`is_compiling`."""
    _COMPILES.depth += 1
    try:
        return original(*args, **kwargs)
    finally:
        _COMPILES.depth -= 1


def _swap_compile_entry_points() -> None:
    if not _OURS:
        swap_entry_points(compile_argument_checks(_GUARDED, _ALLOWED, _CHECKS))
        _OURS[:] = [_graph_api._JitExecutor.compile, _graph_api._CellGraphExecutor.compile]


def reject_in_compiled_args(rejected: type, allow: Optional[Callable[[Callable, tuple], bool]] = None) -> None:
    """From now on, ``ms.jit`` functions and GRAPH_MODE Cells raise a ``TypeError`` naming
    the argument when called with an object of type ``rejected``, except calls that
    ``allow(fn, args)`` accepts. Idempotent."""
    if rejected in _GUARDED:
        return
    _GUARDED.append(rejected)
    if allow is not None:
        _ALLOWED.append(allow)
    _swap_compile_entry_points()


def check_compiled_calls(check: Callable[[Callable, tuple], None]) -> None:
    """From now on, every compile of an ``ms.jit`` function or a GRAPH_MODE Cell first runs
    ``check(fn, args)`` (``args`` starting with the bound object: a Cell, an optimizer), which
    raises to refuse the call. Idempotent.

    Example::

        check_compiled_calls(refuse_whole_parameter_updates)    # optimizers reading whole parameters
    """
    if check not in _CHECKS:
        _CHECKS.append(check)
    _swap_compile_entry_points()
