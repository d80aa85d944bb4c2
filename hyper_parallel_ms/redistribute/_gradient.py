"""Gradient layouts derived from forward placements: the one rule every conversion, style
and parameter record uses to say how a gradient arrives.

The gradient of a tensor is laid out like the tensor, with a Partial read as Replicate
(the gradient of a sum reaches every summand whole). On a mesh dim where a *replicated*
value is used with something split over that dim (a column-parallel weight, a
sequence-sharded activation), each rank computes with its part only, so the gradient it
gets is its share of the whole: Partial(sum) there (the ``shared_dims`` of the use).

Example:
    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> dims = shared_dims((Replicate(),), (Shard(0),))     # a Colwise layer's input and weight
    >>> dims, gradient_placements((Replicate(),), dims)
    ((0,), (Partial(reduce_op='sum'),))
    >>> reduction_taken_over((Replicate(),), (Partial(),), (Replicate(),), (Partial(),))
    True
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

from ..layout import Layout
from ..placement import Partial, Placement, Replicate

__all__ = ["replicate_partials", "shared_dims", "gradient_placements", "gradient_layout", "reduced_dims",
           "reduction_taken_over"]

Placements = Sequence[Placement]


def replicate_partials(layout: Layout) -> Layout:
    """``layout`` with every Partial placement replaced by Replicate.

    Args:
        layout: a :class:`Layout`.

    >>> from hyper_parallel_ms.placement import Partial
    >>> replicate_partials(Layout((2,), (Partial(),))).placements
    (Replicate(),)
    """
    placements = tuple(Replicate() if p.is_partial() else p for p in layout.placements)
    return layout if placements == layout.placements else layout.with_placements(placements)


def shared_dims(value: Placements, *uses: Placements) -> Tuple[int, ...]:
    """Mesh dims where ``value`` is replicated but one of the placements it is computed with
    (``uses``) is not: there each rank's gradient of ``value`` is only its share.

    Args:
        value: the placements of the value.
        uses: the placements of what it is computed with (one argument each).

    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> shared_dims((Replicate(),), (Shard(0),))
    (0,)
    """
    return tuple(a for a, p in enumerate(value)
                 if p.is_replicate() and any(not u[a].is_replicate() for u in uses))


def gradient_placements(placements: Placements, shared: Iterable[int] = ()) -> Tuple[Placement, ...]:
    """The placements of the gradient of a tensor laid out as ``placements``: Partial read as
    Replicate, and Partial(sum) on the ``shared`` mesh dims (see :func:`shared_dims`).

    Args:
        placements: the tensor's placements.
        shared: mesh dims where the gradient is a Partial(sum) share.

    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> gradient_placements((Replicate(),), shared=(0,))
    (Partial(reduce_op='sum'),)
    """
    shared = set(shared)
    return tuple(Partial() if a in shared else (Replicate() if p.is_partial() else p)
                 for a, p in enumerate(placements))


def gradient_layout(layout: Layout, shared: Iterable[int] = ()) -> Layout:
    """:func:`gradient_placements` for a :class:`~hyper_parallel_ms.layout.Layout`.

    Args:
        layout: the tensor's :class:`Layout`.
        shared: as in :func:`gradient_placements`.

    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> gradient_layout(Layout((2,), (Replicate(),)), (0,)).placements
    (Partial(reduce_op='sum'),)
    """
    shared = tuple(shared)
    if not shared:
        return replicate_partials(layout)
    return layout.with_placements(gradient_placements(layout.placements, shared))


def reduced_dims(grad: Optional[Placements]) -> Tuple[int, ...]:
    """Mesh dims whose reduction the backward of a conversion performs when its gradient
    arrives as ``grad`` (``None``: the default gradient, no reduction)."""
    return () if grad is None else tuple(a for a, p in enumerate(grad) if p.is_partial())


def reduction_taken_over(outer_dst: Placements, outer_grad: Optional[Placements], inner_src: Placements,
                         inner_grad: Optional[Placements]) -> bool:
    """Whether an enclosing conversion (to ``outer_dst``, gradient arriving as ``outer_grad``)
    already performs the reduction of an inner one (from ``inner_src``, gradient ``inner_grad``):
    the inner one reads what the outer one produced, and reduces only over mesh dims the outer
    one reduces too; the inner reduction is then dropped and the summed gradient reduced once."""
    inner = reduced_dims(inner_grad)
    return bool(inner) and tuple(inner_src) == tuple(outer_dst) and set(inner) <= set(reduced_dims(outer_grad))
