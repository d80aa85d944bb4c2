"""What a sharding rule sees and returns.

A rule receives an :class:`OpSchema`: the op name, its positional arguments (each tensor as
a :class:`TensorArg` with layout and global shape, other values as they are) and its keyword
arguments. It returns an :class:`OutputSharding`: the layout each tensor argument must have
(the dispatcher redistributes it first) and the layout and global shape of each output.

Example::

    @register_sharding("Neg")
    def neg_rule(schema):
        x = schema.args[0]
        return OutputSharding((x.layout,), ((x.layout, x.shape),))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..layout import Layout

__all__ = ["TensorArg", "OpSchema", "OutputSharding"]


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: its layout and global shape (a plain Tensor is read as Replicate).

    Args:
        layout: the tensor's :class:`Layout`.
        shape: its global shape.
        is_dtensor: ``False`` for a plain Tensor read as Replicate.

    >>> from hyper_parallel_ms.placement import Shard
    >>> TensorArg(Layout((2,), (Shard(0),)), (4, 3)).ndim
    2
    """

    layout: Layout
    shape: Tuple[int, ...]
    is_dtensor: bool = True

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpSchema:
    """One op call as the rule sees it.

    Args:
        op: the primitive's name.
        args: the positional arguments (tensors as :class:`TensorArg`, other values as they are).
        kwargs: the keyword arguments, as sorted ``(name, value)`` pairs.
        attrs: a legacy primitive's attributes, as ``(name, value)`` pairs.

    >>> from hyper_parallel_ms.placement import Shard
    >>> x = TensorArg(Layout((2,), (Shard(0),)), (4, 3))
    >>> str(OpSchema("Exp", (x,)))
    'Exp((4, 3) (S(0)))'
    """

    op: str
    args: Tuple[Any, ...]
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    attrs: Tuple[Tuple[str, Any], ...] = ()   # a legacy primitive's attributes

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        return next(a.layout.mesh_shape for a in self.args if isinstance(a, TensorArg))

    def kwarg(self, name: str, default: Any = None) -> Any:
        return dict(self.kwargs).get(name, default)

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    def __str__(self) -> str:
        parts = [f"{a.shape} {a.layout}" + ("" if a.is_dtensor else " (plain Tensor)") if isinstance(a, TensorArg)
                 else repr(a) for a in self.args]
        parts += [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.op}({', '.join(parts)})"


@dataclass(frozen=True)
class OutputSharding:
    """What a rule decides: the layout each argument must have and each output's layout and shape.

    Args:
        inputs: the layout each positional argument must have (``None`` for non-tensors).
        outputs: ``(layout, global shape)`` of each output.
        local_args: given this rank's mesh coordinate, replacements for non-tensor arguments that
            name global sizes (``None`` keeps an argument), e.g. the target shape of a reshape.
        inplace: the op updates its first argument, which is returned as the result.
        local_fn: given this rank's mesh coordinate, a function run on the local inputs instead of the
            op (a masked lookup into a row-sharded table).
        calls_op: ``local_fn``'s function takes, before the local inputs, the op itself as a function
            of new inputs (a random op drawing the whole tensor's values).

    >>> from hyper_parallel_ms.placement import Shard
    >>> s0 = Layout((2,), (Shard(0),))
    >>> OutputSharding(inputs=(s0,), outputs=((s0, (4, 3)),)).inplace
    False
    """

    inputs: Tuple[Optional[Layout], ...]
    outputs: Tuple[Tuple[Layout, Tuple[int, ...]], ...]
    local_args: Optional[Callable[[Tuple[int, ...]], Tuple[Any, ...]]] = None
    inplace: bool = False
    local_fn: Optional[Callable[[Tuple[int, ...]], Callable]] = None
    calls_op: bool = False
