"""Shape-only tensors: a step run with shapes and dtypes, no values.

An :class:`AbstractTensor` is a MindSpore Tensor subclass whose storage is one element of its
dtype, seen through a view with all strides 0 (shared by the AbstractTensors of one shape and
dtype): its shape is the shape it stands for (for MindSpore too, so views of it, DTensors made
from it and shape checks behave as usual) and it occupies nothing. Every op it takes part in reaches its tensor hook, which computes no value:
the op's output shapes come from the project's own sharding rules (:mod:`hyper_parallel_ms.ops`,
read with every tensor replicated on a one-rank mesh: the rule's global shapes are the op's
shapes) and the output dtypes from :func:`out_dtypes`, and the outputs are new AbstractTensors.
An op without a rule raises ``NotImplementedError`` naming it (register one with
:func:`hyper_parallel_ms.ops.register_sharding`). Reading values (``asnumpy``, ``item``) gives
zeros; a Python branch on a value (``bool(t)``) raises, since a shape-only run has none.

Each AbstractTensor carries two flags, shared by every view of it (:func:`viewed`):
``needs_grad`` (it depends on a trainable parameter or a differentiated input) and
``from_data`` (it depends on the batch, not only on parameters: an activation). Observers
entered with :func:`observing_ops` see every op (the autodiff tape, :mod:`._autodiff`).

Example::

    x = AbstractTensor((4, 4096, 8192), ms.bfloat16)
    y = ops.matmul(x, w)              # AbstractTensor of shape (4, 4096, w.shape[-1]), no FLOP
"""
from __future__ import annotations

import contextlib
import functools
from math import prod
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

from .._mindspore import as_subclass, keeps_hook_errors, numpy_dtype, stride_free_view, tensor_hook
from ..layout import Layout
from ..ops._dispatch import _call_form
from ..ops._registry import propagator
from ..ops._rules.indexing import GetItem, index_key
from ..ops._schema import OpSchema, TensorArg
from ..placement import Replicate

__all__ = ["AbstractTensor", "abstract_like", "observing_ops", "out_dtypes", "is_abstract", "tensor_bytes",
           "abstract_scope", "infer", "flags_of", "abstract_view", "reads_abstract", "viewed", "storage_key"]

_ONE_RANK = Layout((1,), (Replicate(),))
OpObserver = Callable[[str, Sequence[Tensor], Sequence["AbstractTensor"]], None]
_OBSERVERS: List[OpObserver] = []

_BOOL_OUT = frozenset({"Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual", "LogicalAnd", "LogicalOr",
                       "LogicalXor", "LogicalNot", "IsNan", "IsInf", "IsFinite", "EqScalar", "LessScalar", "LessEqualScalar",
                       "GreaterScalar", "GreaterEqualScalar", "ReduceAll", "ReduceAny",
                       "AnyExt", "Any", "All"})
_INDEX_OUT = frozenset({"Argmax", "Argmin", "ArgMaxExt", "ArgMinExt", "DeprecatedArgmax", "DeprecatedArgmin"})
_CASTS = frozenset({"Cast", "ToDtype"})
# ops whose second output holds indices (values, indices)
_VALUES_AND_INDICES = frozenset({"Sort", "SortExt", "TopK", "TopkExt", "MaxDim", "MinDim", "Cummax", "Cummin"})
_INDICES_AND_VALUES = frozenset({"ArgMaxWithValue", "ArgMinWithValue"})
_FLOAT_RANK = {ms.float16: 1, ms.bfloat16: 1, ms.float32: 2, ms.float64: 3}


class _Storage:
    """The AbstractTensors made inside :func:`abstract_scope` and the views of them made by any code
    (:func:`viewed`): by object id, each with its flags and the key of the tensor it views, the
    objects kept alive so that no id is reused."""

    def __init__(self) -> None:
        self.entries: Dict[int, list] = {}        # id -> [needs_grad, from_data, key]
        self.params: Dict[int, Tuple[bool, bool]] = {}   # id of a Parameter -> its flags
        self.alive: List[Tensor] = []


_SCOPES: List[_Storage] = []


@contextlib.contextmanager
def abstract_scope() -> Iterator[None]:
    """Inside, the AbstractTensors made are known, and so are the views of them made by any code
    (through :func:`viewed`); leaving the scope forgets them.

    Example::

        with abstract_scope():
            x = AbstractTensor((2, 3), ms.float32)
            is_abstract(plain_view(x))          # True (in a shape-only run)
    """
    _SCOPES.append(_Storage())
    try:
        yield
    finally:
        _SCOPES.pop()


def _entry(t: Any) -> Optional[list]:
    return _SCOPES[-1].entries.get(id(t)) if _SCOPES else None


def _register(t: Tensor, entry: list) -> None:
    if _SCOPES:
        _SCOPES[-1].entries[id(t)] = entry
        _SCOPES[-1].alive.append(t)


def viewed(t: Any, view: Tensor) -> None:
    """``view`` shares ``t``'s data: if ``t`` is shape-only, so is ``view`` (same flags, same key).

    Args:
        t: the viewed tensor.
        view: the new object.

    Example::

        viewed(x, as_subclass(DTensor, x))
    """
    entry = _entry(t)
    if entry is None and isinstance(t, AbstractTensor):
        entry = [t._needs_grad, t._from_data, id(t)]
        _register(t, entry)
    if entry is not None:
        _register(view, entry)


def storage_key(t: Tensor) -> int:
    """What identifies ``t``'s data: the shape-only tensor it views, else the object itself.

    Args:
        t: a Tensor.

    >>> x = Tensor([1.0]); storage_key(x) == id(x)
    True
    """
    entry = _entry(t)
    return entry[2] if entry is not None else id(t)


def is_abstract(t: Any) -> bool:
    """Whether ``t`` is an :class:`AbstractTensor` or (inside :func:`abstract_scope`) a view of one.

    Args:
        t: any object.

    >>> is_abstract(Tensor([1.0]))
    False
    """
    return isinstance(t, AbstractTensor) or (isinstance(t, Tensor) and _entry(t) is not None)


def tensor_bytes(t: Any) -> int:
    """Bytes of the values ``t`` stands for (its local shape times its itemsize).

    Args:
        t: a Tensor (abstract or not).

    >>> tensor_bytes(AbstractTensor((1024, 1024), ms.float16))
    2097152
    """
    return prod(_shape(t)) * t.itemsize


def _shape(t: Tensor) -> Tuple[int, ...]:
    """The shape of ``t``'s own data (a DTensor's local piece; MindSpore's shape)."""
    return tuple(Tensor.shape.fget(t))


def flags_of(t: Any) -> Tuple[bool, bool]:
    """(needs_grad, from_data) of a tensor: a Parameter's (its ``requires_grad``, not data), an
    AbstractTensor's or its view's, and for any other tensor (not differentiated, batch data).

    Args:
        t: a Tensor.

    >>> flags_of(Tensor([1.0]))
    (False, True)
    """
    if isinstance(t, Parameter):
        cached = _SCOPES[-1].params.get(id(t)) if _SCOPES else None
        if cached is None:
            cached = (bool(t.requires_grad), False)
            if _SCOPES:
                _SCOPES[-1].params[id(t)] = cached
                _SCOPES[-1].alive.append(t)
        return cached
    known = _entry(t)
    if known is not None:
        return known[0], known[1]
    if isinstance(t, AbstractTensor):
        return t._needs_grad, t._from_data
    return False, True


@contextlib.contextmanager
def observing_ops(observer: OpObserver) -> Iterator[None]:
    """Inside, ``observer(name, inputs, outputs)`` sees every op run on AbstractTensors
    (``inputs``: its tensor arguments, ``outputs``: the AbstractTensors it made).

    Args:
        observer: the callback.

    Example::

        names = []
        with observing_ops(lambda name, inputs, outputs: names.append(name)):
            model(x)
    """
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def _promoted(dtypes: Sequence[Any]) -> Any:
    floats = [d for d in dtypes if d in _FLOAT_RANK]
    if floats:
        return max(floats, key=lambda d: _FLOAT_RANK[d])
    return dtypes[0]


def out_dtypes(op: str, dtypes: Sequence[Any], inputs: Sequence[Any], kwargs: dict, count: int) -> List[Any]:
    """The dtypes of the ``count`` outputs of ``op`` whose tensor arguments have ``dtypes``:
    comparisons and logical ops give bool, argmax-like ops int64 indices, casts their target, and
    everything else the promoted dtype of the tensor arguments (the widest float, else the
    first argument's).

    Args:
        op: the primitive's name.
        dtypes: the dtypes of its tensor arguments.
        inputs: all its positional arguments.
        kwargs: its keyword arguments.
        count: the number of outputs.

    >>> out_dtypes("Less", [ms.float32], [None, 0.5], {}, 1) == [ms.bool_]
    True
    """
    if op in _CASTS:
        target = kwargs.get("dtype", inputs[1] if len(inputs) > 1 else None)
        return [target] * count
    if op in _BOOL_OUT:
        return [ms.bool_] * count
    if op in _INDEX_OUT:
        return [ms.int64] * count
    values = _promoted(dtypes)
    if op in _VALUES_AND_INDICES and count == 2:
        return [values, ms.int64]
    if op in _INDICES_AND_VALUES and count == 2:
        return [ms.int32, values]
    return [values] * count


class _Tensor(tuple):
    """A tensor argument in a cache key: (shape, dtype)."""


def _keyed(a: Any) -> Any:
    if isinstance(a, Tensor):
        return _Tensor((_shape(a), a.dtype))
    if isinstance(a, list):
        return tuple(_keyed(x) for x in a)
    return a


def _fused_dtypes(name: str, keyed: tuple) -> Optional[List[Any]]:
    """The output dtypes of the fused kernels whose outputs do not all take the inputs' dtype:
    ``FlashAttentionScore``'s softmax max and sum are float32, its reserved output and attention
    output the query's dtype (their shapes come from its sharding rule)."""
    if name == "FlashAttentionScore":
        return [ms.float32, ms.float32, keyed[0][1], keyed[0][1]]
    return None


def _outputs(name: str, keyed: tuple, kwargs: tuple, attrs: tuple) -> Tuple[bool, Tuple[Tuple[tuple, Any], ...]]:
    """(inplace, ((shape, dtype) of each output)) of op ``name`` on arguments described by ``keyed``."""
    rule = propagator.rule_for(name)
    if rule is None:
        raise NotImplementedError(
            f"a shape-only run has no shape rule for MindSpore op '{name}' (called with "
            f"{[a[0] if isinstance(a, _Tensor) else a for a in keyed]}): shapes are propagated by the sharding rules; "
            f"register one with @hyper_parallel_ms.ops.register_sharding('{name}')")
    described = tuple(TensorArg(_ONE_RANK, a[0], is_dtensor=False) if isinstance(a, _Tensor) else a for a in keyed)
    sharding = rule(OpSchema(name, described, kwargs, attrs))
    dtypes = _fused_dtypes(name, keyed) or out_dtypes(name, [a[1] for a in keyed if isinstance(a, _Tensor)], keyed,
                                                      dict(kwargs), len(sharding.outputs))
    return sharding.inplace, tuple((tuple(shape), dtype) for (_, shape), dtype in zip(sharding.outputs, dtypes))


_cached_outputs = functools.lru_cache(maxsize=65536)(_outputs)


def _flags(tensors: Sequence[Tensor]) -> Tuple[bool, bool]:
    """(needs_grad, from_data) of an op's outputs: any input's."""
    flags = [flags_of(t) for t in tensors]
    return any(g for g, _ in flags), any(d for _, d in flags)


def infer(func: Any, args: tuple, kwargs: dict) -> Any:
    """The AbstractTensor result(s) of ``func(*args, **kwargs)`` (see the module docstring).

    Args:
        func: the MindSpore op the tensor hook received.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Example::

        y = infer(ops.matmul, (x, w), {})
    """
    name = getattr(func, "name", None) or getattr(func, "__name__", repr(func))
    inputs, _, attrs = _call_form(args if type(args) is tuple else tuple(args))
    keyed = tuple(_keyed(a) for a in inputs)
    options = tuple(sorted(kwargs.items())) if kwargs else ()
    try:
        inplace, outputs = _cached_outputs(name, keyed, options, attrs)
    except TypeError:                    # an unhashable argument: no cache
        inplace, outputs = _outputs(name, keyed, options, attrs)
    tensors = [a for a in inputs if isinstance(a, Tensor)]
    if inplace:
        out = inputs[0] if is_abstract(inputs[0]) else abstract_like(inputs[0])
        _notify(name, tensors, (out,))
        return out
    grad, data = _flags(tensors)
    outs = tuple(AbstractTensor(shape, dtype, needs_grad=grad, from_data=data) for shape, dtype in outputs)
    _notify(name, tensors, outs)
    return outs[0] if len(outs) == 1 and _single_output(name) else outs


def _single_output(name: str) -> bool:
    return name not in _VALUES_AND_INDICES and name not in _INDICES_AND_VALUES and not name.startswith(
        ("Split", "Unstack"))


def _notify(name: str, inputs: Sequence[Tensor], outputs: Sequence["AbstractTensor"]) -> None:
    for observer in list(_OBSERVERS):
        observer(name, inputs, outputs)


@functools.lru_cache(maxsize=4096)
def _backing(shape: Tuple[int, ...], dtype: Any) -> Tensor:
    """The one-element storage seen with ``shape``, shared by the AbstractTensors of one shape and
    dtype (making a view waits for MindSpore's op queue, about 1 ms; sharing one costs 1 us)."""
    return stride_free_view(Tensor(np.zeros((1,), dtype=numpy_dtype(dtype))), shape)


@keeps_hook_errors
class AbstractTensor(Tensor):
    """A tensor of ``shape`` and ``dtype`` without values (see the module docstring).

    Args:
        shape: the shape it stands for.
        dtype: its MindSpore dtype.
        needs_grad: it depends on what is differentiated.
        from_data: it depends on the batch (an activation), not only on parameters.

    Example::

        x = AbstractTensor((2, 3), ms.float32)
        (x @ AbstractTensor((3, 5), ms.float32)).shape        # (2, 5)
    """

    def __new__(cls, shape: Sequence[int], dtype: Any, *, needs_grad: bool = False, from_data: bool = True):
        shape = tuple(int(s) for s in shape)
        obj = as_subclass(cls, _backing(shape, dtype))
        obj._needs_grad = bool(needs_grad)
        obj._from_data = bool(from_data)
        _register(obj, [obj._needs_grad, obj._from_data, id(obj)])
        return obj

    __fallback__ = tensor_hook(infer)

    def __getitem__(self, index):
        """Indexing through the indexing rule (MindSpore's indexing does not always reach the hook)."""
        return infer(GetItem, (self, index_key(index, self.ndim)), {})

    def requires_grad_(self, requires_grad: bool = True) -> "AbstractTensor":
        self._needs_grad = bool(requires_grad)
        entry = _entry(self)
        if entry is not None:
            entry[0] = self._needs_grad
        return self

    # ------------------------------------------------------------ no values
    def asnumpy(self) -> np.ndarray:
        """Zeros of the shape (a shape-only run has no values)."""
        return np.zeros(tuple(self.shape), dtype=numpy_dtype(self.dtype))

    def item(self):
        return self.asnumpy().item()

    def __bool__(self) -> bool:
        raise RuntimeError(f"a shape-only run has no values: Python branches on a tensor's value ({self!r}) cannot "
                           "be followed; keep value-dependent control flow out of the simulated step")

    def __repr__(self) -> str:
        return f"AbstractTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    __str__ = __repr__

    def __radd__(self, other):
        return ms.ops.add(other, self)

    def __rsub__(self, other):
        return ms.ops.sub(other, self)

    def __rmul__(self, other):
        return ms.ops.mul(other, self)

    def __rtruediv__(self, other):
        return ms.ops.div(other, self)


def abstract_view(t: Tensor) -> Optional[AbstractTensor]:
    """An AbstractTensor sharing ``t``'s storage (and flags) if ``t`` is shape-only data, else ``None``.

    Args:
        t: a Tensor.

    Example::

        with abstract_scope():
            view = abstract_view(as_subclass(Tensor, AbstractTensor((2, 3), ms.float32)))    # shape-only
    """
    if isinstance(t, Parameter) or not is_abstract(t):
        return None
    grad, data = flags_of(t)
    view = as_subclass(AbstractTensor, t)
    view._needs_grad, view._from_data = grad, data
    return view


def reads_abstract(args: Any) -> bool:
    """Whether an op's arguments include shape-only data or a Parameter without data.

    Args:
        args: the op's positional arguments (nested tuples and lists are searched).

    >>> reads_abstract((Tensor([1.0]), 2))
    False
    """
    for a in args:
        if isinstance(a, (tuple, list)):
            if reads_abstract(a):
                return True
        elif isinstance(a, Parameter):
            if a.has_init:
                return True
        elif isinstance(a, Tensor) and is_abstract(a):
            return True
    return False


def abstract_like(t: Tensor, shape: Optional[Sequence[int]] = None, *, needs_grad: Optional[bool] = None,
                  from_data: Optional[bool] = None) -> AbstractTensor:
    """An AbstractTensor of ``t``'s dtype and shape (or ``shape``), with ``t``'s flags unless given.

    Args:
        t: a Tensor (abstract or not).
        shape: the shape (default: ``t``'s).
        needs_grad: the flag (default: ``t``'s; a Parameter's ``requires_grad``).
        from_data: the flag (default: ``t``'s; ``False`` for a Parameter).

    >>> abstract_like(Tensor(np.ones((2, 3), np.float32)), (4,)).shape
    (4,)
    """
    grad, data = flags_of(t)
    return AbstractTensor(_shape(t) if shape is None else shape, t.dtype,
                          needs_grad=grad if needs_grad is None else needs_grad,
                          from_data=data if from_data is None else from_data)
