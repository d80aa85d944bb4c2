"""Placements: how one mesh dimension holds a tensor.

Three small, hashable value objects, as in ``torch.distributed.tensor``:

* ``Shard(dim)``: the tensor is split along ``dim`` over the mesh dimension
  (``torch.chunk`` semantics for uneven sizes).
* ``Replicate()``: every rank of the mesh dimension holds the whole tensor.
* ``Partial(reduce_op)``: every rank holds a partial value; the global tensor is
  the reduction (``sum``, ``avg``, ``max`` or ``min``) over the mesh dimension.

Pure Python: no MindSpore import.

Example:
    >>> from hyper_parallel_ms.placement import Shard, Replicate, Partial
    >>> [str(p) for p in (Shard(0), Replicate(), Partial())]
    ['S(0)', 'R', 'P(sum)']
    >>> Shard(1) == Shard(1), Shard(1).is_shard(1), Partial("max").is_partial()
    (True, True, True)
"""
from __future__ import annotations

from typing import Optional

__all__ = ["Placement", "Shard", "Replicate", "Partial", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of the three placements; never instantiated directly.

    Example:
        >>> Shard(0).is_shard(), Replicate().is_shard()
        (True, False)
    """

    __slots__ = ()

    def is_shard(self, dim: Optional[int] = None) -> bool:
        """True for ``Shard`` (of ``dim`` when given)."""
        return False

    def is_replicate(self) -> bool:
        """True for ``Replicate``."""
        return False

    def is_partial(self, reduce_op: Optional[str] = None) -> bool:
        """True for ``Partial`` (with ``reduce_op`` when given)."""
        return False


class Shard(Placement):
    """The tensor is split along tensor dimension ``dim`` (negative dims allowed).

    Args:
        dim: the tensor dimension split over the mesh dimension (``torch.chunk`` sizes).

    Example:
        >>> Shard(-1), str(Shard(0))
        (Shard(dim=-1), 'S(0)')
    """

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Shard(dim) needs an int tensor dimension, got {dim!r} "
                            f"of type {type(dim).__name__}")
        object.__setattr__(self, "dim", dim)

    def __setattr__(self, name, value):
        raise AttributeError("Shard is immutable")

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return dim is None or dim == self.dim

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("Shard", self.dim))

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __reduce__(self):
        return (Shard, (self.dim,))


class Replicate(Placement):
    """Every rank of the mesh dimension holds the full tensor.

    Example:
        >>> Replicate() == Replicate(), str(Replicate())
        (True, 'R')
    """

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is Replicate

    def __hash__(self) -> int:
        return hash("Replicate")

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"

    def __reduce__(self):
        return (Replicate, ())


class Partial(Placement):
    """Every rank holds a partial value, reduced by ``reduce_op`` over the mesh dimension.

    Args:
        reduce_op: ``"sum"`` (default), ``"avg"``, ``"max"`` or ``"min"``: how the pieces combine.

    Example:
        >>> Partial(), str(Partial("avg"))
        (Partial(reduce_op='sum'), 'P(avg)')
    """

    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum") -> None:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op) must be one of {REDUCE_OPS}, got {reduce_op!r}")
        object.__setattr__(self, "reduce_op", reduce_op)

    def __setattr__(self, name, value):
        raise AttributeError("Partial is immutable")

    def is_partial(self, reduce_op: Optional[str] = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __eq__(self, other: object) -> bool:
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self) -> int:
        return hash(("Partial", self.reduce_op))

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op!r})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __reduce__(self):
        return (Partial, (self.reduce_op,))
