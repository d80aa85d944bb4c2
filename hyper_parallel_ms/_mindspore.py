"""The seam: every use of MindSpore that is not public API, in one module.

Each contract below is something MindSpore does today without promising it; a smoke test
in ``tests/test_mindspore_seam.py`` names each one, so that a MindSpore upgrade that
breaks a contract fails one test here instead of many elsewhere.

Contracts (measured on MindSpore 2.8, 2.9 and 2.10):

- **tensor hook**: a Tensor subclass with ``__fallback__(self, func, args, kwargs)`` is
  called for the ops it takes part in; what it returns is the op's result. 2.8 / 2.9
  replace an exception raised in it by ``RuntimeError: Python fallback failed.``
  (:func:`tensor_hook` keeps the original, :func:`original_hook_errors` restores it), and
  do not call it for tensors inside list arguments (:data:`LIST_ARGS_REACH_HOOK`).
- **hook op objects**: the ``func`` handed to the hook can be called from Python and
  returns a result the caller owns. On 2.8 / 2.9 the ``func`` of an overloaded functional
  op (``mindspore.ops.functional_overload``: ``mint.add``, ``mint.max``, ``mint.where``,
  ...) returns its result already released (use after free: garbage shapes, crashes);
  :func:`tensor_hook` passes an op that calls the overloaded function itself instead
  (:data:`OVERLOAD_OPS_CALLABLE`).
- **no-hook guard**: ``mindspore._c_expression.NoFallbackGuard`` runs ops on subclass
  objects as on plain tensors (:func:`no_hook`).
- **subclass views**: ``Tensor._make_subclass(cls, t)`` makes an object of ``cls``
  sharing storage and autodiff node with ``t`` (:func:`as_subclass`); assigning
  ``__class__`` turns a fresh plain op result into a subclass (:func:`adopt`). On 2.8 such
  a swapped object does not reach the hook in legacy primitives (``ops.reduce_sum``,
  ``P.Softplus``) nor inside tuples (:data:`ADOPTED_REACH_HOOK`), so there :func:`adopt`
  makes a new object with ``_make_subclass`` instead.
- **seeded dropout**: ``mindspore.ops.auto_generate.func_dropout_ext_op(x, p, training,
  inplace, seed, offset)``, the primitive behind ``ops.dropout``, draws its mask from
  explicit seed and offset tensors (:data:`seeded_dropout`).
- **compile-time Python**: ``ms.jit`` runs a ``functools.lru_cache`` object as opaque
  Python on its constant arguments (:func:`cached_in_python`, :func:`run_in_python`).
- **one custom-bprop Cell per call site**: differentiating a compiled forward from PyNative
  reads the last call's output for every call of one custom-bprop Cell instance
  (:func:`cell_per_call_site` builds one per call while compiling).
- **compile detection**: graph compilation runs in ``_JitExecutor.compile`` (``ms.jit``)
  or ``_CellGraphExecutor.compile`` (GRAPH_MODE Cells), in ``mindspore.graph.api`` from
  2.9 and ``mindspore.common.api`` on 2.8; both receive the call's arguments
  (:func:`is_compiling`; :func:`reject_in_compiled_args` wraps them).
- **op entry points** (2.8 / 2.9 only): ops reach C++ through ``Primitive.__call__``, the
  generated primitives' ``__call__`` and ``mindspore.ops.functional_overload``; wrapping
  them restores hook errors. ``ops`` / ``mint`` sequence functions are wrapped to pass
  lists as tuples (:func:`route_list_arguments`).
- **point-to-point kernels**: ``mindspore.ops.auto_generate.gen_ops_prim.dist_comm_isend_op(x,
  dst, group, tag)`` and ``dist_comm_irecv_op(buffer, tag, src, group)`` (ranks in the group),
  the kernels behind ``mint.distributed.send`` / ``recv``, return ``(tensor, handle)`` and run
  on CPU (MCCL, any group) where ``mint.distributed.send`` itself fails: its own-rank check
  reads the group ``hccl_world_group`` (:func:`p2p_send`, :func:`p2p_recv`).
- **autograd tape**: in PyNative, with the executor's grad flag on
  (``_pynative_executor.set_grad_flag(True)``), every op result carries an autodiff node
  (``Tensor._grad_node``), and ``mindspore._c_expression.run_backward(outputs, sens,
  keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad=False)`` returns the
  gradients of ``inputs`` (``None`` for one the outputs do not reach) from the saved nodes,
  for tapes of several forwards kept at once and in any order, without running the forward
  again; ``keep_graph=True`` keeps the tape for a second call (:func:`taped`,
  :func:`tape_backward`). ``ms.vjp`` / ``GradOperation`` instead find a forward by its
  "top cell", only the most recent one (a backward of an older pending forward fails:
  "Can not find top cell for backward").
  A Cell with a custom ``bprop`` run under the bare grad flag fails ("The pointer[top_cell_]
  is null"): wrapping the forward in ``_pynative_executor.new_graph`` / ``end_graph`` gives it
  its top graph, and ``run_backward`` then differentiates it, several such tapes in any order,
  and an input-only call does not run the custom bprops of the weights (:func:`taped_call`).
  An exception raised inside the forward of a gradient call (``ms.grad``, ``value_and_grad``)
  leaves the executor recording: the grad flag stays on and the failed call's top cell stays
  pending, so a later in-place op on a leaf Parameter fails ("A leaf tensor that requires grad
  is being used in an inplace operator"), even after the next gradient call;
  ``_pynative_executor.clear_res()`` drops that state (:func:`discard_grad_recording`).
- **swappable entry points**: MindSpore's functions, Cell methods and compile entry points
  are looked up as module / class attributes at call time, so replacing the attribute
  reroutes every call made after it. :func:`swap_entry_points` (for the process) and
  :func:`entry_points_swapped` (for a scope) are the only places that replace them, and
  put back exactly what was there.

- **saved tensors** (2.10): inside ``mindspore.saved_tensors_hooks(pack, unpack)``, PyNative
  autodiff passes every tensor it keeps for the backward through ``pack`` (a custom-bprop
  Cell's input and output included), as a tensor with the storage address (``data_ptr``) of
  the one the op received, and the backward reads what ``unpack`` returns; ops run under
  ``mindspore._no_grad()`` are not recorded (:func:`saved_tensors_hooks`, :func:`no_grad`,
  :func:`tensor_address`; :data:`SAVED_TENSOR_HOOKS` says whether the release has them).
- **deferred initialisers**: eagerly, ``Parameter(initializer(...))`` (and ``set_data`` of an
  initialiser Tensor) runs the ``Initializer`` at once on a numpy array; the random ones draw
  only from numpy's global generator, a fixed number of times for MindSpore's own classes
  (:func:`initializer_draws`, :func:`draw_numpy_seed`), and fill from that draw alone. Under
  ``no_init_parameters()`` the Parameter keeps the initialiser Tensor as ``init_mode``
  (:func:`pending_init`); Parameters are made through ``Parameter._get_parameter_new_args``
  (:func:`deferred_creation_hooked`); :func:`initial_array` computes what ``init_data`` would, and
  :func:`fill_deferred` stores it as ``init_data`` does.

- **recompute**: ``mindspore.recompute(fn, *args, use_reentrant=False, early_stop=False,
  context_fn=...)`` in PyNative keeps none of the tensors ``fn`` saves for the backward and
  runs ``fn`` again (whole, Cell hooks included) when the backward needs them; it captures no
  parameter, so a Parameter replaced after wrapping gets exact gradients (``Cell.recompute()``
  and ``use_reentrant=True`` capture ``trainable_params()`` once: silently zero gradients for a
  later replacement). ``context_fn()`` returns (forward context, recompute context). Inside
  ``ms.jit`` the same call on a bound method compiles to ``ops.recompute_block``, and the
  compiler's ``add_recomputation`` pass duplicates the method's forward ops into the backward
  (:func:`recompute_eagerly`, :func:`recompute_in_graph`; :data:`RECOMPUTE_CONTEXT_FN`).
- **op interception**: a ``mindspore.MsDispatchMode`` subclass sees every PyNative primitive
  run inside its ``with`` block as ``__ms_dispatch__(func, args, kwargs)`` with ``func.name``;
  what it returns is the op's result, and the op is recorded for autodiff as usual
  (:class:`OpInterception`).

:func:`guard_mindspore_for` installs the wrappers the first time a DTensor is made (never at
import).

Example:
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
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import mindspore
import numpy as np
from mindspore import Tensor

from . import _check_mindspore, _release

_check_mindspore(mindspore.__version__)  # before touching the internals below

from mindspore._c_expression import NoFallbackGuard  # noqa: E402
from mindspore.common import dtype as _mstype, initializer as _initializers  # noqa: E402
from mindspore.ops import functional_overload as _functional_overload  # noqa: E402
from mindspore.ops.auto_generate import func_dropout_ext_op as seeded_dropout  # noqa: E402

try:  # MindSpore 2.9 and later
    from mindspore.graph import api as _graph_api
except ImportError:  # MindSpore 2.8
    from mindspore.common import api as _graph_api

__all__ = ["MINDSPORE_VERSION", "LIST_ARGS_REACH_HOOK", "HOOK_ERRORS_REACH_CALLER", "ADOPTED_REACH_HOOK",
           "OVERLOAD_OPS_CALLABLE",
           "tensor_hook", "original_hook_errors", "keep_hook_errors", "keeps_hook_errors", "no_hook", "as_subclass",
           "plain_view", "adopt", "cell_subclass", "run_first_call_checks", "cached_in_python", "run_in_python", "cell_per_call_site", "is_compiling", "running_eagerly",
           "compiling_graph_code",
           "guard_mindspore_for", "reject_in_compiled_args", "compile_argument_checks", "route_list_arguments",
           "seeded_dropout", "Swap", "swap_entry_points", "entry_points_swapped", "p2p_send", "p2p_recv",
           "deferred_parameter", "GRAD_ENTRY_POINTS", "has_custom_bprop", "abstract_run", "stride_free_view", "numpy_dtype",
           "taped", "taped_call", "tape_backward", "discard_grad_recording",
           "initializer_draws", "draw_numpy_seed", "pending_init", "initial_array", "fill_deferred",
           "deferred_creation_hooked", "SAVED_TENSOR_HOOKS", "saved_tensors_hooks", "no_grad", "tensor_address",
           "RECOMPUTE_CONTEXT_FN", "recompute_eagerly", "recomputing", "recompute_in_graph", "OP_INTERCEPTION", "OpInterception"]

F = TypeVar("F", bound=Callable)

MINDSPORE_VERSION: Tuple[int, int] = _release(mindspore.__version__)
# 2.10 calls the hook for tensors inside list arguments (ops.cat([dt, ...])); 2.8 / 2.9 only
# inside tuples. 2.10 passes an exception raised in the hook to the caller; 2.8 / 2.9 print it
# and raise ``RuntimeError: Python fallback failed.`` instead.
LIST_ARGS_REACH_HOOK: bool = MINDSPORE_VERSION >= (2, 10)
HOOK_ERRORS_REACH_CALLER: bool = MINDSPORE_VERSION >= (2, 10)
# On 2.8 an object whose ``__class__`` was swapped to the subclass reaches the hook in
# generated ops (``ops.add``, ``mint.*``) but not in legacy primitives (``ops.reduce_sum``:
# a silent local result) nor as the first tensor of a tuple argument; an object made by
# ``_make_subclass`` reaches it everywhere. 2.9 and later look at the class.
ADOPTED_REACH_HOOK: bool = MINDSPORE_VERSION >= (2, 9)
# 2.8 / 2.9: the op object that an overloaded functional op (a function of
# ``functional_overload``, ``return _<name>_instance(*args, **kwargs)``) hands the hook returns,
# when called from Python, a result whose last reference it has already released.
OVERLOAD_OPS_CALLABLE: bool = MINDSPORE_VERSION >= (2, 10)
_FALLBACK_FAILED = "Python fallback failed"
_OVERLOADS = {f.__code__: f for f in map(inspect.unwrap, vars(_functional_overload).values())
              if inspect.isfunction(f) and f.__module__ == _functional_overload.__name__}


# ------------------------------------------------------------ entry point swaps
Swap = Tuple[Any, str, Callable[[Callable], Callable]]   # (owner, attribute, wrap: original -> replacement)
_ABSENT = object()


def swap_entry_points(swaps: Sequence[Swap]) -> Callable[[], None]:
    """Replace each ``owner.name`` (a module function, a class's method) by ``wrap(current)``
    (``wrap(None)`` where there is none) and return the function that puts back exactly what
    was there (the same objects; an attribute that ``owner`` only inherited or lacked is
    removed again), last swap first. If a ``wrap``
    raises, the swaps made so far are undone before the error propagates.

    >>> import types
    >>> space = types.SimpleNamespace(double=lambda x: 2 * x)
    >>> original = space.double
    >>> undo = swap_entry_points([(space, "double", lambda f: lambda x: f(x) + 1)])
    >>> space.double(3)
    7
    >>> undo(); space.double is original
    True
    """
    saved: List[Tuple[Any, str, Any]] = []

    def undo() -> None:
        while saved:
            owner, name, before = saved.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

    try:
        for owner, name, wrap in swaps:
            before = vars(owner).get(name, _ABSENT)
            replacement = wrap(getattr(owner, name, None) if before is _ABSENT else before)
            setattr(owner, name, replacement)
            saved.append((owner, name, before))
    except BaseException:
        undo()
        raise
    return undo


@contextmanager
def entry_points_swapped(swaps: Sequence[Swap]) -> Iterator[None]:
    """Inside, each ``owner.name`` is ``wrap(current)`` (:func:`swap_entry_points`); on leaving,
    normally or by an exception, exactly what was there before is back. Scopes nest: an inner
    scope wraps (and then restores) what the outer one installed.

    Example::

        with entry_points_swapped([(mindspore.ops, "cross_entropy", my_wrapper)]):
            ops.cross_entropy(logits, target)      # my_wrapper(original)(logits, target)
    """
    undo = swap_entry_points(swaps)
    try:
        yield
    finally:
        undo()


# ------------------------------------------------------------------ tensor hook
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
            if _ABSTRACT and _ABSTRACT[-1].unhooked:
                return _unhooked_op(func, args, kwargs or {})
            return fn(func, args, kwargs or {})
        return __fallback__

    def __fallback__(self, func, args=(), kwargs=None):  # noqa: F811  (2.8 / 2.9)
        overload = None if OVERLOAD_OPS_CALLABLE else _OVERLOADS.get(sys._getframe(1).f_code)
        if overload is not None:
            func = _OverloadOp(getattr(func, "name", overload.__name__), overload)
        try:
            if _ABSTRACT and _ABSTRACT[-1].unhooked:
                return _unhooked_op(func, args, kwargs or {})
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


def no_hook() -> Any:
    """A context in which ops on subclass objects run as on plain tensors (no hook); in a
    shape-only run (:func:`abstract_run`), ops on shape-only data stay shape-only there."""
    if _ABSTRACT:
        return _ABSTRACT[-1].unhooking()
    return NoFallbackGuard()


# ------------------------------------------------------------- saved tensors
SAVED_TENSOR_HOOKS = hasattr(mindspore, "saved_tensors_hooks") and hasattr(mindspore, "_no_grad")


def saved_tensors_hooks(pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> Any:
    """A context in which autodiff keeps ``pack(t)`` for each tensor ``t`` it saves for the
    backward, and the backward reads ``unpack`` of it (PyNative).

    Args:
        pack: called with each saved tensor; returns what is kept.
        unpack: called with what ``pack`` returned, in the backward; returns the tensor.

    Example::

        with saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(x)
    """
    if _ABSTRACT:
        return _ABSTRACT[-1].saved_tensors_hooks(pack, unpack)
    return mindspore.saved_tensors_hooks(pack, unpack)


def no_grad() -> Any:
    """A context in which PyNative ops are not recorded for autodiff."""
    if _ABSTRACT:
        return _ABSTRACT[-1].no_grad()
    return mindspore._no_grad()          # pylint: disable=protected-access


def tensor_address(t: Tensor) -> int:
    """The address of ``t``'s storage (views of one buffer at its start share it).

    >>> tensor_address(Tensor([1.0])) > 0
    True
    """
    return t.data_ptr()


# ------------------------------------------------------------- subclass views
def as_subclass(cls: type, t: Tensor) -> Tensor:
    """An object of ``cls`` sharing storage and the autodiff node with ``t`` (no copy).

    >>> type(as_subclass(Tensor, Tensor([1.0]))).__name__
    'Tensor'

    In a shape-only run (:func:`abstract_run`) a plain view of shape-only data is shape-only too
    (the run's ``plain_view``), so that ops on it still compute nothing.
    """
    if _ABSTRACT:
        run = _ABSTRACT[-1]
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


# ------------------------------------------------------------ class swaps
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


# ------------------------------------------------------------ compile detection
_JIT_COMPILE = _graph_api._JitExecutor.compile
_CELL_COMPILE = _graph_api._CellGraphExecutor.compile
_COMPILE_CODES = frozenset({_JIT_COMPILE.__code__, _CELL_COMPILE.__code__})


def is_compiling() -> bool:
    """Whether Python runs on behalf of MindSpore's graph compiler (ms.jit or GRAPH_MODE)."""
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


def _check_compiled_call(kind: str, fn: Callable, args: tuple, kwargs: dict, rejected: type) -> None:
    for name, value in _compiled_arguments(fn, args, kwargs):
        if isinstance(value, rejected):
            raise TypeError(
                f"argument '{name}' of {kind} '{getattr(fn, '__qualname__', fn)}' is a {type(value).__name__} "
                f"{value!r}: compiled code would compute on its local piece only. Pass .to_local() pieces "
                "(and rebuild with DTensor.from_local after the call), or call it in PyNative without ms.jit")


_GUARDED: list = []


def compile_argument_checks(rejected: Sequence[type]) -> List[Swap]:
    """Swaps of MindSpore's compile entry points (``ms.jit`` and GRAPH_MODE Cells) that raise
    a ``TypeError`` naming the argument when a compiled call gets an object of a type in
    ``rejected`` (read at each compile, so it may grow), for :func:`swap_entry_points`."""

    def jit_compile(original: Callable) -> Callable:
        @functools.wraps(original)
        def compile(self, method_name, *args, **kwargs):
            given = args if self.obj is None else (self.obj,) + args
            _check_compiled_call("the ms.jit function", self.fn, given,
                                 {k: v for k, v in kwargs.items() if k != "phase"}, tuple(rejected))
            return original(self, method_name, *args, **kwargs)
        return compile

    def cell_compile(original: Callable) -> Callable:
        @functools.wraps(original)
        def compile(self, obj, *args, **kwargs):
            _check_compiled_call("the GRAPH_MODE Cell", type(obj).construct, (obj,) + args,
                                 {k: v for k, v in kwargs.items() if k not in ("phase", "do_convert", "jit_config_dict")},
                                 tuple(rejected))
            return original(self, obj, *args, **kwargs)
        return compile

    return [(_graph_api._JitExecutor, "compile", jit_compile), (_graph_api._CellGraphExecutor, "compile", cell_compile)]


def reject_in_compiled_args(rejected: type) -> None:
    """From now on, ``ms.jit`` functions and GRAPH_MODE Cells raise a ``TypeError`` naming
    the argument when called with an object of type ``rejected``. Idempotent."""
    if rejected in _GUARDED:
        return
    _GUARDED.append(rejected)
    if len(_GUARDED) == 1:
        swap_entry_points(compile_argument_checks(_GUARDED))


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


def guard_mindspore_for(hooked: type) -> None:
    """Everything MindSpore needs so that objects of ``hooked`` never compute silently on
    their local data (:func:`reject_in_compiled_args`, :func:`route_list_arguments`) and
    that errors of their hook reach the caller on every release. Idempotent."""
    if hooked not in _ROUTED:
        if not _ROUTED:
            _keep_hook_errors_in_mindspore()
        reject_in_compiled_args(hooked)
        route_list_arguments(hooked)


# ------------------------------------------------------------ point-to-point kernels
def _p2p_kernels() -> Tuple[Callable, Callable]:
    """(isend, irecv) kernels; imported on first use so that a release without them fails here only."""
    from mindspore.ops.auto_generate.gen_ops_prim import dist_comm_irecv_op, dist_comm_isend_op
    return dist_comm_isend_op, dist_comm_irecv_op


def p2p_send(x: Tensor, dst: int, group: str) -> None:
    """Send ``x`` to rank ``dst`` of ``group``; returns when the kernel reports the send done."""
    _p2p_kernels()[0](x, dst, group, 0)[1].wait()


def p2p_recv(buffer: Tensor, src: int, group: str) -> Tensor:
    """Receive from rank ``src`` of ``group`` a tensor of ``buffer``'s shape and dtype (blocks until it arrives)."""
    out, handle = _p2p_kernels()[1](buffer, 0, src, group)
    handle.wait()
    return out


# ------------------------------------------------------------ autograd tape
@contextmanager
def taped() -> Iterator[None]:
    """Record the autodiff nodes of the PyNative ops run inside (the executor's grad flag),
    restoring the flag after; :func:`tape_backward` differentiates what was recorded."""
    from mindspore.common.api import _pynative_executor
    before = _pynative_executor.grad_flag()
    _pynative_executor.set_grad_flag(True)
    try:
        yield
    finally:
        _pynative_executor.set_grad_flag(before)


def taped_call(top: Callable, *args: Any) -> Any:
    """``top(*args)`` with its autodiff tape recorded as one top graph of the PyNative executor
    (as ``ms.grad`` records it), for :func:`tape_backward` to differentiate later. Cells with a
    custom ``bprop`` (the collectives' Cells, so tensor-parallel styles and fully_shard) need
    that top graph: under a bare :func:`taped` they fail with "The pointer[top_cell_] is null".
    Several such tapes may be kept and differentiated in any order.

    Example::

        out = taped_call(stage_cell, x)
        grads = tape_backward((out,), (ones_like_out,), [x] + params)
    """
    if _ABSTRACT:
        return _ABSTRACT[-1].taped_call(top, *args)
    from mindspore.common.api import _pynative_executor
    before = _pynative_executor.grad_flag()
    _pynative_executor.set_grad_flag(True)
    try:
        _pynative_executor.new_graph(top, *args)
        out = top(*args)
        _pynative_executor.end_graph(top, out, *args)
    finally:
        _pynative_executor.set_grad_flag(before)
    return out


def tape_backward(outputs: Sequence[Tensor], sens: Sequence[Tensor], inputs: Sequence[Tensor],
                  keep_graph: bool = False) -> Tuple[Optional[Tensor], ...]:
    """Gradients of ``inputs`` (``None`` where unreached) of ``sum(outputs * sens)`` from a
    forward recorded under :func:`taped`; ``keep_graph=True`` allows another call on it."""
    if _ABSTRACT:
        return _ABSTRACT[-1].tape_backward(outputs, sens, inputs, keep_graph)
    from mindspore._c_expression import run_backward
    grads = run_backward(tuple(outputs), tuple(sens), keep_graph, False, tuple(inputs), True,
                         accumulate_grad=False)
    return tuple(grads)


def discard_grad_recording() -> None:
    """Drop what the PyNative executor recorded for a gradient call whose forward is failing (an
    error about to leave it): otherwise the executor stays recording and later in-place updates of
    Parameters fail. Nothing happens when no gradient call is recording.

    Example::

        try:
            check(cell)
        except Exception:
            discard_grad_recording()
            raise
    """
    from mindspore.common.api import _pynative_executor
    if _pynative_executor.grad_flag():
        _pynative_executor.clear_res()


# ------------------------------------------------------------ deferred initialisation
# MindSpore's own initialisers whose every run draws a fixed number of times from numpy's global
# generator: ``_numpy_seed()`` (one ``np.random.randint``) seeds the C++ fill; the constant ones
# draw nothing. Others (Orthogonal, Sparse, a user's class) draw an amount that depends on the shape.
_NUMPY_DRAWS: Dict[type, int] = {
    **{getattr(_initializers, n): 0 for n in ("Zero", "One", "Constant", "Identity", "Dirac")},
    **{getattr(_initializers, n): 1 for n in ("Normal", "Uniform", "TruncatedNormal", "XavierNormal",
                                              "XavierUniform", "HeNormal", "HeUniform", "VarianceScaling")}}


def initializer_draws(init: Any) -> Optional[int]:
    """How many numpy draws one run of ``init`` makes (``None``: not known without running it)."""
    return _NUMPY_DRAWS.get(type(init))


def draw_numpy_seed() -> int:
    """The draw MindSpore's random initialisers make from numpy's global generator."""
    return _initializers._numpy_seed()  # pylint: disable=protected-access


def pending_init(tensor: Any) -> Optional[Tensor]:
    """The initialiser Tensor a not yet initialised ``Parameter`` (or initialiser Tensor) will
    run (``Parameter.init_mode``, whose ``init`` is the ``Initializer``), or ``None``."""
    if not isinstance(tensor, Tensor) or not tensor.has_init:
        return None
    pending = getattr(tensor, "init_mode", None) if isinstance(tensor, mindspore.Parameter) else tensor
    return pending if pending is not None and pending.has_init else None


def initial_array(init: Any, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """What ``Tensor.init_data()`` computes for an ``Initializer``, as a numpy array, drawing
    from numpy's global generator exactly as it does (without a slice index)."""
    nptype = _mstype._dtype_to_nptype(dtype)  # pylint: disable=protected-access
    if isinstance(init, _initializers.Zero):
        return np.zeros(tuple(shape), dtype=nptype)
    data = np.ndarray(tuple(shape), dtype=nptype)
    init(data)
    return data


def fill_deferred(param: Any, values: np.ndarray) -> None:
    """Give a not yet initialised ``param`` ``values`` as ``init_data`` would (in place, its
    initialiser dropped), leaving the initialiser Tensor itself untouched (others may share it)."""
    param.set_data(Tensor(values, dtype=param.dtype))
    param.init_mode = None


def deferred_creation_hooked(record: Callable[[Tensor], None]) -> Iterator[None]:
    """Inside, ``record(init_tensor)`` runs at the moment MindSpore would have run an
    initialiser eagerly but defers it (``no_init_parameters()``): when a ``Parameter`` is made
    from it (``Parameter._get_parameter_new_args``) and when ``set_data`` hands one to a deferred
    Parameter (eagerly, ``set_data`` initialises it there)."""
    def new_args(original: Any) -> Any:
        def wrapped(data, *args, **kwargs):
            result = original.__func__(data, *args, **kwargs)
            if pending_init(data) is not None:
                record(data)
            return result
        return staticmethod(wrapped)

    def set_data(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapped(self, data, *args, **kwargs):
            result = original(self, data, *args, **kwargs)
            if pending_init(data) is not None and getattr(self, "init_mode", None) is data:
                record(data)
            return result
        return wrapped
    return entry_points_swapped([(mindspore.Parameter, "_get_parameter_new_args", new_args),
                                 (mindspore.Parameter, "set_data", set_data)])


def deferred_parameter(shape: Sequence[int], dtype: Any, name: str, requires_grad: bool = True) -> Any:
    """A ``Parameter`` of ``shape`` and ``dtype`` holding no data (deferred, as under
    ``no_init_parameters()``, with a zeros initialiser), whatever context it is made in: the
    class flag ``Parameter.init_param`` that MindSpore's ``no_init_parameters()`` sets is set
    for the call and put back.

    >>> p = deferred_parameter((1 << 20, 1 << 20), mindspore.float32, "huge")
    >>> p.has_init, p.shape
    (True, (1048576, 1048576))
    """
    before = vars(mindspore.Parameter).get("init_param", _ABSENT)
    mindspore.Parameter.init_param = False
    try:
        return mindspore.Parameter(_initializers.initializer("zeros", tuple(shape), dtype), name=name,
                                   requires_grad=requires_grad)
    finally:
        if before is _ABSENT:
            del mindspore.Parameter.init_param
        else:
            mindspore.Parameter.init_param = before


# ------------------------------------------------------------ shape-only runs (simulation)
_ABSTRACT: List[Any] = []      # the active shape-only run (``plan._autodiff``), innermost last
# MindSpore's public functions that differentiate, by module: a shape-only run replaces them
GRAD_ENTRY_POINTS: Tuple[Tuple[Any, str], ...] = tuple(
    (owner, name) for owner in (mindspore, mindspore.ops) for name in ("value_and_grad", "grad") if hasattr(owner, name))


def has_custom_bprop(cell: Any) -> bool:
    """Whether ``cell`` defines ``bprop`` (MindSpore's ``Cell.has_bprop``, set at construction)."""
    return bool(getattr(cell, "has_bprop", False))


def numpy_dtype(dtype: Any) -> Any:
    """The numpy dtype of a MindSpore dtype (MindSpore's own conversion; the public one warns).

    >>> numpy_dtype(mindspore.float16)
    <class 'numpy.float16'>
    """
    return _mstype._dtype_to_nptype(dtype)  # pylint: disable=protected-access


def stride_free_view(t: Tensor, shape: Sequence[int]) -> Tensor:
    """A view of the one-element ``t`` with ``shape`` and every stride 0 (``ops.broadcast_to`` in
    PyNative is a view): it has the shape and occupies one element.

    >>> stride_free_view(Tensor(np.zeros((1,), np.float32)), (1 << 20, 1 << 20)).shape
    (1048576, 1048576)
    """
    shape = tuple(shape)
    return t.reshape(()) if not shape else mindspore.ops.broadcast_to(t, shape)


def _unhooked_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op reaching a tensor hook under :func:`no_hook` in a shape-only run: shapes only when it
    reads shape-only data, else run as on plain tensors."""
    run = _ABSTRACT[-1]
    if run.reads_abstract(args):
        return run.infer(func, args, kwargs)
    with NoFallbackGuard():
        return func(*args, **kwargs)


@contextmanager
def abstract_run(run: Any) -> Iterator[None]:
    """Inside, a shape-only run ``run`` (:class:`hyper_parallel_ms.plan._autodiff.AbstractAutodiff`)
    stands in for MindSpore's execution and autodiff:

    - :func:`no_hook` is ``run.unhooking()`` (sets ``run.unhooked``): tensor hooks reached there
      compute shapes only (``run.infer``) for ops that read shape-only data
      (``run.reads_abstract(args)``) and run the others as on plain tensors; :func:`as_subclass`
      of a plain ``Tensor`` is ``run.plain_view(t)`` where that is not ``None``, and every other
      view made there is announced to ``run.viewed(t, view)``;
    - ``mindspore.value_and_grad`` / ``grad`` (and ``mindspore.ops``'s) are ``run.value_and_grad`` /
      ``run.grad``; :func:`taped_call`, :func:`tape_backward`, :func:`saved_tensors_hooks`,
      :func:`no_grad` and :func:`recompute_eagerly` call ``run``'s methods of the same names;
    - every ``Cell`` call is ``run.cell_call(cell, call, args, kwargs)`` (``call`` runs it), and
      MindSpore's first-call initialisation of a Cell's parameters (``Cell._init_check``) only
      marks the Cell checked;
    - an op with a ``Parameter`` argument reaches ``run.parameter_op(func, args, kwargs)`` (a
      ``__fallback__`` on ``mindspore.Parameter``: the hook of every Parameter class);
    - ``Parameter.init_data`` (the materialisation of a deferred Parameter) calls
      ``run.refuse_initialisation(param)`` first, which raises.

    Example::

        with abstract_run(run):
            step()
    """
    def cell_call(original: Callable) -> Callable:
        @functools.wraps(original)
        def call(self, *args, **kwargs):
            return run.cell_call(self, lambda *a, **k: original(self, *a, **k), args, kwargs)
        return call

    def init_check(original: Callable) -> Callable:
        @functools.wraps(original)
        def checked(self):
            self._init_flag = True
        return checked

    def init_data(original: Callable) -> Callable:
        @functools.wraps(original)
        def refusing(self, *args, **kwargs):
            run.refuse_initialisation(self)
            return original(self, *args, **kwargs)
        return refusing

    swaps: List[Swap] = [(owner, name, lambda _, n=name: getattr(run, n)) for owner, name in GRAD_ENTRY_POINTS]
    swaps += [(mindspore.nn.Cell, "__call__", cell_call), (mindspore.nn.Cell, "_init_check", init_check),
              (mindspore.Parameter, "init_data", init_data),
              (mindspore.Parameter, "__fallback__", lambda _: tensor_hook(run.parameter_op))]
    _ABSTRACT.append(run)
    try:
        with entry_points_swapped(swaps):
            yield
    finally:
        _ABSTRACT.remove(run)


# ------------------------------------------------------------ recompute (activation checkpointing)
_RECOMPUTE_ARGS = inspect.signature(mindspore.recompute).parameters
# non-reentrant recompute with a whole second forward and a context_fn: MindSpore 2.9 and later
RECOMPUTE_CONTEXT_FN: bool = all(k in _RECOMPUTE_ARGS for k in ("use_reentrant", "early_stop", "context_fn"))


def recompute_eagerly(fn: Callable, args: tuple, kwargs: dict, context_fn: Optional[Callable] = None) -> Any:
    """``fn(*args, **kwargs)`` (PyNative) keeping none of the tensors it saves for the backward:
    the backward runs ``fn`` again, whole (``early_stop=False``: Cell hooks after the last saved
    tensor, such as fully_shard's reshard, run too). ``context_fn() -> (forward ctx, recompute ctx)``."""
    if not RECOMPUTE_CONTEXT_FN and not _ABSTRACT:
        raise NotImplementedError(
            f"activation checkpointing needs mindspore.recompute(use_reentrant=False, early_stop=..., context_fn=...) "
            f"(MindSpore 2.9 and later); MindSpore {mindspore.__version__} lacks it: upgrade MindSpore")

    def flagged(*inner_args, **inner_kwargs):     # the forward and its recompute in the backward alike
        _RECOMPUTING.depth += 1
        try:
            return fn(*inner_args, **inner_kwargs)
        finally:
            _RECOMPUTING.depth -= 1
    if _ABSTRACT:
        return _ABSTRACT[-1].recompute(flagged, args, kwargs, context_fn)
    return mindspore.recompute(flagged, *args, use_reentrant=False, early_stop=False, context_fn=context_fn, **kwargs)


class _Recomputing(threading.local):
    depth = 0


_RECOMPUTING = _Recomputing()


def recomputing() -> bool:
    """Whether Python runs inside :func:`recompute_eagerly`'s function (its forward or its
    recompute in the backward): MindSpore keeps none of the tensors saved there, so code that
    would free them itself (fully_shard's reshard) has nothing to do.

    >>> recomputing()
    False
    """
    return _RECOMPUTING.depth > 0


def recompute_in_graph(method: Callable, *args: Any) -> Any:
    """Inside ms.jit / GRAPH_MODE: ``method(*args)`` (a Cell's bound method) marked for MindSpore's
    graph recompute pass (its forward ops are computed again in the backward)."""
    return mindspore.recompute(method, *args)


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
