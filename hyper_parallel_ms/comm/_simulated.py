"""What collectives over a simulated mesh give back, and where point-to-point messages go.

A simulated mesh sends nothing: a collective returns a placeholder of its output's shape and
dtype, ``send`` delivers nowhere and ``recv`` returns a placeholder. By default a placeholder
is zeros made by the input's ``new_zeros`` (a shape-only tensor makes a shape-only one). A
simulation that runs several ranks of one cluster in turn enters an :class:`Exchange` of its
own (:func:`exchanging`): it makes the placeholders (shape-only tensors) and keeps what ranks
send, so that a later rank's ``recv`` of small host values (a pipeline's shape header) gets
what its peer sent.

Example::

    class Keep(Exchange):
        def sent(self, x, group, dst): self.last = x
    with exchanging(Keep()):
        send(x, simulated_mesh, dst=1)
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

__all__ = ["Exchange", "RunFirst", "exchanging", "placeholder", "sent", "received"]


class RunFirst(RuntimeError):
    """A simulated rank needs what a rank not run yet sends: the simulation runs that rank first and
    this one again (layers that turn failures into errors of their own let it pass).

    Example::

        raise RunFirst("rank 4 needs rank 0's header")
    """


class Exchange:
    """The default behaviour: zeros placeholders, sends dropped.

    Example::

        Exchange().placeholder(x, (2, 3))        # x.new_zeros((2, 3))
    """

    def placeholder(self, x: Any, shape: Tuple[int, ...]) -> Any:
        """The output of shape ``shape`` (``x``'s dtype) of a simulated collective on ``x``."""
        return x.new_zeros(tuple(shape))

    def sent(self, x: Any, group: Any, dst: int) -> None:
        """``x`` was sent to rank ``dst`` of ``group`` (a :class:`~hyper_parallel_ms._cluster.CommGroup`)."""

    def received(self, x: Any, group: Any, src: int) -> Any:
        """What rank ``src`` of ``group`` sent, of ``x``'s shape and dtype."""
        return self.placeholder(x, tuple(x.shape))


_DEFAULT = Exchange()
_ACTIVE: List[Exchange] = []


@contextlib.contextmanager
def exchanging(exchange: Exchange) -> Iterator[Exchange]:
    """Inside, collectives over simulated meshes use ``exchange``.

    Args:
        exchange: the :class:`Exchange` to use.

    Example::

        with exchanging(my_exchange):
            step()
    """
    _ACTIVE.append(exchange)
    try:
        yield exchange
    finally:
        _ACTIVE.remove(exchange)


def _current() -> Exchange:
    return _ACTIVE[-1] if _ACTIVE else _DEFAULT


def placeholder(x: Any, shape: Tuple[int, ...]) -> Any:
    """The placeholder output of shape ``shape`` of a simulated collective on ``x``.

    Args:
        x: the collective's input.
        shape: the output's shape.

    Example::

        y = placeholder(x, (8, 3))
    """
    return _current().placeholder(x, shape)


def sent(x: Any, group: Any, dst: int) -> None:
    """Hand a simulated send to the current exchange.

    Args:
        x: the tensor sent.
        group: the simulated group.
        dst: the receiver's index in the group.

    Example::

        sent(x, group, 1)
    """
    _current().sent(x, group, dst)


def received(x: Any, group: Any, src: int) -> Any:
    """The tensor a simulated ``recv`` returns.

    Args:
        x: a tensor of the shape and dtype expected.
        group: the simulated group.
        src: the sender's index in the group.

    Example::

        y = received(like, group, 0)
    """
    return _current().received(x, group, src)
