"""Tensor hooks: a Tensor subclass whose ``__fallback__`` sees the ops it takes part in, views of
tensors as the subclass, and what MindSpore needs so that hooked objects never compute silently on
local data (list arguments routed to the hook, compiled calls refused, hook errors kept).

Contracts: a subclass with ``__fallback__(self, func, args, kwargs)`` is called for the ops it takes
part in (:func:`tensor_hook`); ``NoFallbackGuard`` runs ops on subclass objects as on plain tensors
(:func:`no_hook`); ``Tensor._make_subclass`` views share storage and autodiff node
(:func:`as_subclass`); a ``MsDispatchMode`` subclass sees every PyNative primitive
(:class:`OpInterception`). Release differences: see :mod:`._release`.

Example::

    class MyTensor(Tensor):
        __fallback__ = tensor_hook(lambda func, args, kwargs: ...)
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import mindspore
from mindspore import Tensor
from mindspore._c_expression import NoFallbackGuard
from mindspore.ops import functional_overload as _functional_overload

from ._active import ACTIVE_RUNS, unhooked_op
from ._release import (ADOPTED_REACH_HOOK, HOOK_ERRORS_REACH_CALLER, LIST_ARGS_REACH_HOOK, OVERLOAD_OPS_CALLABLE,
                       F)
from .compiling import reject_in_compiled_args
from .swaps import swap_entry_points

__all__ = ["tensor_hook", "original_hook_errors", "keep_hook_errors", "keeps_hook_errors", "no_hook", "hooks_off",
           "as_subclass", "plain_view", "adopt", "route_list_arguments", "guard_mindspore_for", "OP_INTERCEPTION",
           "OpInterception", "one_autodiff_node", "in_one_autodiff_node", "ONE_NODE"]

_FALLBACK_FAILED = "Python fallback failed"
_OVERLOADS = {f.__code__: f for f in map(inspect.unwrap, vars(_functional_overload).values())
              if inspect.isfunction(f) and f.__module__ == _functional_overload.__name__}


class _HookErrors(threading.local):
    last: Optional[BaseException] = None


_HOOK_ERRORS = _HookErrors()


def tensor_hook(fn: Callable[[Any, tuple, dict], Any]) -> Callable:
    """The ``__fallback__`` method for a Tensor subclass calling ``fn(func, args, kwargs)``.
    On 2.8 / 2.9, which replace an exception raised there by a bare ``RuntimeError``, the
    exception is kept for :func:`keep_hook_errors` / :func:`original_hook_errors`.

    Example::

        class MyTensor(Tensor):
            __fallback__ = tensor_hook(lambda func, args, kwargs: ...)
    """
    if HOOK_ERRORS_REACH_CALLER:
        def __fallback__(self, func, args=(), kwargs=None):
            if ACTIVE_RUNS and ACTIVE_RUNS[-1].unhooked:
                return unhooked_op(func, args, kwargs or {})
            return fn(func, args, kwargs or {})
        return __fallback__

    def __fallback__(self, func, args=(), kwargs=None):  # noqa: F811  (2.8 / 2.9)
        overload = None if OVERLOAD_OPS_CALLABLE else _OVERLOADS.get(sys._getframe(1).f_code)
        if overload is not None:
            func = _OverloadOp(getattr(func, "name", overload.__name__), overload)
        try:
            if ACTIVE_RUNS and ACTIVE_RUNS[-1].unhooked:
                return unhooked_op(func, args, kwargs or {})
            return fn(func, args, kwargs or {})
        except BaseException as error:
            _HOOK_ERRORS.last = error
            raise
    return __fallback__


class _OverloadOp:
    """The op an overloaded functional op handed the hook (2.8 / 2.9), run by calling the
    overloaded function again: on the hook's arguments it picks the same op, and (inside
    :func:`no_hook`) runs it without the hook, returning a result the caller owns."""

    __slots__ = ("name", "_overload")

    def __init__(self, name: str, overload: Callable) -> None:
        self.name = name
        self._overload = overload

    def __call__(self, *args, **kwargs):
        return self._overload(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<op {self.name} through {self._overload.__name__}>"


@contextmanager
def original_hook_errors() -> Iterator[None]:
    """Inside, a ``RuntimeError: Python fallback failed.`` that MindSpore raises in place of
    an exception from a :func:`tensor_hook` is replaced by that exception (chained to it).

    Example::

        with original_hook_errors():
            ops.add(dt, other)      # raises the dispatcher's own error on every release
    """
    _HOOK_ERRORS.last = None
    try:
        yield
    except RuntimeError as error:
        _raise_original(error)
        raise


def _raise_original(error: RuntimeError) -> None:
    """Raise the hook's own exception if ``error`` is MindSpore's replacement for it."""
    original, _HOOK_ERRORS.last = _HOOK_ERRORS.last, None
    if original is not None and original is not error and _FALLBACK_FAILED in str(error):
        raise original.with_traceback(original.__traceback__) from error


def keep_hook_errors(fn: F) -> F:
    """``fn`` raising the original error of a :func:`tensor_hook` where MindSpore replaces
    it (2.8 / 2.9); ``fn`` itself on 2.10."""
    if HOOK_ERRORS_REACH_CALLER or getattr(fn, "__keeps_hook_errors__", False):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:
            _raise_original(error)
            raise
    call.__keeps_hook_errors__ = True
    return call


def _keep_hook_errors_in_mindspore() -> None:
    """On 2.8 / 2.9, MindSpore's op entry points (``Primitive.__call__``, the generated
    primitives' ``__call__`` and the overloaded functional ops of ``mint`` / ``ops``) raise
    the original error of a hook instead of ``RuntimeError: Python fallback failed.``."""
    if HOOK_ERRORS_REACH_CALLER:
        return
    from mindspore.ops import functional_overload
    from mindspore.ops.auto_generate import gen_ops_prim, pyboost_inner_prim
    classes = [mindspore.ops.Primitive] + [c for module in (gen_ops_prim, pyboost_inner_prim)
                                            for c in vars(module).values() if isinstance(c, type)]
    swaps = [(cls, "__call__", keep_hook_errors) for cls in classes if "__call__" in vars(cls)]
    overloads = {id(f): (name, f) for name, f in vars(functional_overload).items()
                 if inspect.isfunction(f) and not name.startswith("_")}
    for namespace in (functional_overload, mindspore.ops, mindspore.mint):
        swaps += [(namespace, name, keep_hook_errors) for name, value in list(vars(namespace).items())
                  if id(value) in overloads and overloads[id(value)][1] is value]
    swap_entry_points(swaps)


_OPERATORS = ("add sub mul truediv floordiv mod pow matmul and or xor lshift rshift neg pos abs invert "
              "eq ne lt le gt ge").split()


def keeps_hook_errors(cls: type) -> type:
    """Class decorator for a hooked Tensor subclass: where MindSpore replaces hook errors
    (2.8 / 2.9), the operators and public methods it inherits raise the original error.

    Example::

        @keeps_hook_errors
        class MyTensor(Tensor):
            __fallback__ = tensor_hook(...)
    """
    if HOOK_ERRORS_REACH_CALLER:
        return cls
    names = {f"__{op}__" for op in _OPERATORS} | {n for n in dir(cls) if not n.startswith("_")}
    own = set().union(*(vars(k) for k in cls.__mro__ if k not in (Tensor,) + Tensor.__mro__))
    own |= set(vars(mindspore.Parameter))  # Parameter(obj) makes a class with cls before Parameter
    for name in sorted(names - own):
        attr = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(attr) or type(attr).__name__ in ("method_descriptor", "wrapper_descriptor"):
            setattr(cls, name, keep_hook_errors(attr))   # instance methods only (not static / class methods)
    return cls


class _Unhooked(threading.local):
    depth = 0


_UNHOOKED = _Unhooked()


@contextmanager
def _unhooked() -> Iterator[None]:
    _UNHOOKED.depth += 1
    try:
        with NoFallbackGuard():
            yield
    finally:
        _UNHOOKED.depth -= 1


def no_hook() -> Any:
    """A context in which ops on subclass objects run as on plain tensors (no hook; :func:`hooks_off`
    says so inside); in a shape-only run (:func:`abstract_run`), ops on shape-only data stay
    shape-only there."""
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].unhooking()
    return _unhooked()


def hooks_off() -> bool:
    """Whether Python runs inside :func:`no_hook` (an op computing on subclass objects as on their
    local data: a subclass answering metadata queries, such as a DTensor's global ``shape``, should
    answer for its local data there).

    >>> hooks_off()
    False
    >>> with no_hook():
    ...     hooks_off()
    True
    """
    return _UNHOOKED.depth > 0


# ------------------------------------------------------------- subclass views
def as_subclass(cls: type, t: Tensor) -> Tensor:
    """An object of ``cls`` sharing storage and the autodiff node with ``t`` (no copy).

    >>> type(as_subclass(Tensor, Tensor([1.0]))).__name__
    'Tensor'

    In a shape-only run (:func:`abstract_run`) a plain view of shape-only data is shape-only too
    (the run's ``plain_view``), so that ops on it still compute nothing.
    """
    if ACTIVE_RUNS:
        run = ACTIVE_RUNS[-1]
        view = run.plain_view(t) if cls is Tensor else None
        if view is None:
            view = Tensor._make_subclass(cls, t)
            run.viewed(t, view)
        return view
    return Tensor._make_subclass(cls, t)


def plain_view(t: Tensor) -> Tensor:
    """A plain ``Tensor`` sharing storage and the autodiff node with ``t`` (a DTensor's local
    piece, no copy).

    >>> type(plain_view(Tensor([1.0]))).__name__
    'Tensor'
    """
    return as_subclass(Tensor, t)


def adopt(result: Tensor, cls: type) -> Tensor:
    """A fresh op result as an object of the subclass ``cls``, no copy: the result itself
    (``__class__`` swapped: unlike :func:`as_subclass`, no wait for the op to finish), or
    on 2.8, where swapped objects miss the hook in places, a new object sharing it."""
    if not ADOPTED_REACH_HOOK:
        return as_subclass(cls, result)
    result.__class__ = cls
    return result


# ------------------------------------------------------------ list arguments
# Functional ops taking a sequence of tensors, per namespace. On 2.8 / 2.9 a list there does
# not reach the hook (a tuple does); ``ops.stack`` (the legacy Stack primitive) reaches it on
# no release, so a hooked tensor in its sequence goes to ``cat`` of ``expand_dims`` instead.
_SEQUENCE_OPS = {"ops": ("cat", "concat", "hstack", "vstack", "dstack", "column_stack", "row_stack"),
                 "mint": ("cat", "concat", "stack")}
_ROUTED: list = []


def _has(seq, hooked: tuple) -> bool:
    return isinstance(seq, (list, tuple)) and any(isinstance(t, hooked) for t in seq)


def _hook_visible(seq, hooked: tuple):
    """A sequence argument as one that reaches the hook: a tuple (of objects that
    :func:`adopt` made, which reach it on 2.8 too)."""
    return tuple(seq) if _has(seq, hooked) else seq


def _tuples_for_lists(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        hooked = tuple(_ROUTED)
        args = tuple(_hook_visible(a, hooked) for a in args)
        kwargs = {k: _hook_visible(v, hooked) for k, v in kwargs.items()}
        return fn(*args, **kwargs)
    call.__wrapped_by_hyper_parallel_ms__ = fn
    return call


def _stack_through_mint(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def stack(tensors, axis=0):
        if _has(tensors, tuple(_ROUTED)):  # as cat of unsqueezed pieces (mint.stack has no CPU kernel)
            return mindspore.ops.cat([mindspore.ops.expand_dims(t, axis) for t in tensors], axis)
        return fn(tensors, axis)
    stack.__wrapped_by_hyper_parallel_ms__ = fn
    return stack


def route_list_arguments(hooked: type) -> None:
    """From now on, ``mindspore.ops`` / ``mindspore.mint`` sequence ops (``cat``, ``concat``,
    ``stack``, ...) given objects of ``hooked`` call its tensor hook on every release
    (2.8 / 2.9 skip it for lists, every release for ``ops.stack``, which becomes ``cat`` of
    ``expand_dims``). Idempotent."""
    if hooked in _ROUTED:
        return
    _ROUTED.append(hooked)
    if len(_ROUTED) > 1:
        return
    namespaces = {"ops": mindspore.ops, "mint": mindspore.mint}
    swaps = [(mindspore.ops, "stack", lambda fn: keep_hook_errors(_stack_through_mint(fn)))]
    if not LIST_ARGS_REACH_HOOK:
        swaps += [(namespaces[space], name, lambda fn: keep_hook_errors(_tuples_for_lists(fn)))
                  for space, names in _SEQUENCE_OPS.items() for name in names
                  if getattr(namespaces[space], name, None) is not None]
    swap_entry_points(swaps)


def guard_mindspore_for(hooked: type, allow_compiled: Optional[Callable[[Callable, tuple], bool]] = None) -> None:
    """Everything MindSpore needs so that objects of ``hooked`` never compute silently on
    their local data (:func:`reject_in_compiled_args`, :func:`route_list_arguments`; a compiled
    call that ``allow_compiled(fn, args)`` accepts computes on the local data by design) and
    that errors of their hook reach the caller on every release. Idempotent."""
    if hooked not in _ROUTED:
        if not _ROUTED:
            _keep_hook_errors_in_mindspore()
        reject_in_compiled_args(hooked, allow_compiled)
        route_list_arguments(hooked)


# ------------------------------------------------------------ op interception
OP_INTERCEPTION: bool = hasattr(mindspore, "MsDispatchMode")     # absent before MindSpore 2.10 (not measured)


class OpInterception(getattr(mindspore, "MsDispatchMode", object)):
    """Inside ``with``, every PyNative primitive runs as ``self.on_op(name, run)``: ``run()``
    computes it, what ``on_op`` returns is its result.

    Example::

        class Names(OpInterception):
            def on_op(self, name, run):
                print(name)
                return run()
    """

    def on_op(self, name: str, run: Callable[[], Any]) -> Any:
        return run()

    def __ms_dispatch__(self, func, args, kwargs=None):
        return self.on_op(func.name, lambda: func(*args, **(kwargs or {})))


class _OneNode(threading.local):
    depth = 0                          # > 0 while a custom-bprop Cell's forward runs its ops eagerly


_ONE_NODE = _OneNode()
ONE_NODE = "<one autodiff node>"     # an op record's mark where such a forward ran (its ops not recorded)


@contextmanager
def one_autodiff_node() -> Iterator[None]:
    """Inside (PyNative), the ops compute the forward of one custom-``bprop`` Cell: autodiff keeps
    none of their outputs, only the Cell's inputs and outputs, so an op-level recompute policy
    (:class:`OpInterception`) treats them as one op rather than keeping what they make.

    Example::

        with one_autodiff_node():
            out = ring_attention_cell(q, k, v, bias)     # its score blocks are nobody's to keep
    """
    _ONE_NODE.depth += 1
    try:
        yield
    finally:
        _ONE_NODE.depth -= 1


def in_one_autodiff_node() -> bool:
    """Whether ops now run inside :func:`one_autodiff_node`.

    >>> in_one_autodiff_node()
    False
    """
    return _ONE_NODE.depth > 0
