"""How the ranks of a mesh exchange data: the one interface collectives and ``send`` / ``recv`` go through.

A mesh's :attr:`~hyper_parallel_ms.mesh.DeviceMesh.exchange` is chosen by the cluster place it is
seen from (its :class:`~hyper_parallel_ms._cluster.World`):

- :class:`ClusterExchange` (this process's place): collectives run MindSpore's primitives, each
  call counted for the communication watchdog; ``send`` / ``recv`` move tensors between ranks;
  ranks agree through all-reduces; Python objects travel pickled.
- :class:`SimulatedExchange` (one rank of a cluster simulated in this process, ``init_device_mesh(...,
  simulate=...)``): nothing is sent. A collective returns a placeholder of its output's shape and
  dtype (zeros by default), ``send`` delivers nowhere, ``recv`` returns a placeholder, each rank
  agrees with itself and what the ranks must agree on is noted for the observers of
  :func:`~._agreement.observing_agreements`. A simulation that runs several ranks in turn enters a
  subclass of its own (:func:`exchanging`) that makes shape-only placeholders and keeps what ranks
  send, so that a later rank's ``recv`` of small host values gets what its peer sent.

The layers above ``comm`` ask the exchange's properties (:attr:`Exchange.holds_values`), never
which kind it is. A ``recv`` whose sender has not run yet raises :class:`NotReady`: the receiver's
step is not failed, it is run again once the sender has run.

Example::

    mesh.exchange.moves              # True on a cluster: collectives send data
    with exchanging(my_simulated_exchange):
        step()                       # simulated meshes use my_simulated_exchange
"""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Iterator, List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from .._cluster import current_world
from .._mindspore import off_meta_device, p2p_recv, p2p_send
from ._watchdog import arrive

__all__ = ["Exchange", "ClusterExchange", "SimulatedExchange", "NotReady", "exchanging", "exchange_of",
           "current_exchange"]


class NotReady(RuntimeError):
    """What a rank receives is not there yet and will not come while it waits (its sender runs
    later): the receiving step is not a failure, it is run again once the sender has run (layers
    that turn failures into errors of their own let it pass).

    Example::

        raise NotReady("rank 4 needs rank 0's header")
    """


class Exchange:
    """The operations ``comm`` needs from the ranks' transport (the interface; see the module docstring).

    Attributes:
        moves: whether collectives over a group of several ranks send data (else they return a
            :meth:`placeholder` of their output).
        holds_values: whether tensors hold values (else parameters are pieces without data).

    Example::

        exchange = mesh.exchange
        y = exchange.recv(like, mesh.comm_group(0), src=0)
    """

    moves: bool = True
    holds_values: bool = True

    def count(self, kind: str, group: Any, dim: str, peer: Any = None) -> None:
        """Note a call before it is issued (``kind`` over ``group``, mesh dim ``dim``; ``peer``: the
        group index of a ``send`` / ``recv``'s other rank)."""
        raise NotImplementedError

    def placeholder(self, x: Any, shape: Tuple[int, ...]) -> Any:
        """The output of shape ``shape`` (``x``'s dtype) of a collective on ``x`` that moves nothing:
        zeros (a simulation may make shape-only ones)."""
        return x.new_zeros(tuple(shape))

    def send(self, x: Any, group: Any, dst: int) -> None:
        """Send ``x`` to rank ``dst`` of ``group`` (a :class:`~hyper_parallel_ms._cluster.CommGroup`)."""
        raise NotImplementedError

    def recv(self, x: Any, group: Any, src: int) -> Any:
        """What rank ``src`` of ``group`` sends, of ``x``'s shape and dtype."""
        raise NotImplementedError

    def extremes(self, values: np.ndarray, mesh: Any) -> Tuple[np.ndarray, np.ndarray]:
        """(max, min) over the ranks of ``mesh`` of each entry of the float32 vector ``values``."""
        raise NotImplementedError

    def defer_agreement(self, what: str, mesh: Any, entries: Sequence[Tuple[str, str]]) -> bool:
        """Whether the check that the ranks of ``mesh`` hold the same ``entries`` is left to whoever
        sees every rank (``True``: the entries were handed over, nothing is compared here)."""
        return False

    def all_gather_object(self, obj: Any, world: Any) -> List[Any]:
        """Every rank's ``obj`` in rank order, over the ``world``'s ranks (also a barrier)."""
        raise NotImplementedError


class ClusterExchange(Exchange):
    """The ranks of this process's cluster: MindSpore's collectives and point-to-point calls.

    Example::

        ClusterExchange().send(x, group, dst=1)
    """

    def count(self, kind: str, group: Any, dim: str, peer: Any = None) -> None:
        arrive(kind, group, dim, peer)

    def send(self, x: Any, group: Any, dst: int) -> None:
        p2p_send(x.astype(ms.uint8) if x.dtype == ms.bool_ else x, dst, group.name)

    def recv(self, x: Any, group: Any, src: int) -> Any:
        if x.dtype == ms.bool_:
            return p2p_recv(ms.ops.zeros(x.shape, ms.uint8), src, group.name).astype(ms.bool_)
        return p2p_recv(ms.ops.zeros(x.shape, x.dtype), src, group.name)

    def extremes(self, values: np.ndarray, mesh: Any) -> Tuple[np.ndarray, np.ndarray]:
        from . import all_reduce
        from .debug import unrecorded
        with off_meta_device(), unrecorded():
            both = Tensor(np.concatenate([values, -values]))
            for dim in range(mesh.ndim):
                both = all_reduce(both, mesh, dim, op="max")
            both = both.asnumpy()
        return both[:len(values)], -both[len(values):]

    def all_gather_object(self, obj: Any, world: Any) -> List[Any]:
        # objects travel as pickled bytes: MindSpore 2.8's all_gather_object unpickles builtins only
        from mindspore.mint import distributed as dist
        out: List[Any] = [None] * world.size
        dist.all_gather_object(out, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return [pickle.loads(data) for data in out]


class SimulatedExchange(Exchange):
    """One rank of a cluster simulated in this process: nothing is sent; zeros placeholders, sends
    dropped, every rank agrees with itself (subclasses make other placeholders and keep messages).

    Example::

        SimulatedExchange().placeholder(x, (2, 3))        # x.new_zeros((2, 3))
    """

    moves = False
    holds_values = False

    def count(self, kind: str, group: Any, dim: str, peer: Any = None) -> None:
        """Nothing is issued: the watchdog has nothing to wait for."""

    def send(self, x: Any, group: Any, dst: int) -> None:
        """Delivered nowhere (a subclass may keep it for a rank run later)."""

    def recv(self, x: Any, group: Any, src: int) -> Any:
        return self.placeholder(x, tuple(x.shape))

    def extremes(self, values: np.ndarray, mesh: Any) -> Tuple[np.ndarray, np.ndarray]:
        return values, values             # the other ranks are not here: this rank agrees with itself

    def defer_agreement(self, what: str, mesh: Any, entries: Sequence[Tuple[str, str]]) -> bool:
        from ._agreement import note_agreement
        note_agreement(what, mesh, entries)     # compared once every rank has run, as the cluster would have
        return True

    def expert_counts(self, rows: int, num_experts: int, ranks: int) -> np.ndarray:
        """The ``(ranks, num_experts)`` routed rows each rank of an expert-parallel group sends to each expert,
        each rank routing ``rows`` (what the cluster's ranks all-gather from their routers; a simulated rank
        has no router values): stated by the exchange of a simulation that knows a routing assumption."""
        raise NotImplementedError(
            "expert parallelism on a simulated rank: the other ranks' token counts, which decide the shapes of "
            "the token exchange, are unknown here; simulate it with hyper_parallel_ms.simulate, which states "
            "them (routing='uniform' or shares per expert)")

    def all_gather_object(self, obj: Any, world: Any) -> List[Any]:
        raise NotImplementedError(f"rank {world.rank} of a simulated cluster of {world.size} ranks cannot exchange "
                                  "Python objects with the others (they are not in this process): run it on the "
                                  "cluster, or plan each rank's part on its simulated rank (a checkpoint's pieces: "
                                  "the planner's create_local_plan)")


_CLUSTER = ClusterExchange()
_SIMULATED = SimulatedExchange()
_ACTIVE: List[SimulatedExchange] = []       # entered with ``exchanging``, innermost last


@contextlib.contextmanager
def exchanging(exchange: SimulatedExchange) -> Iterator[SimulatedExchange]:
    """Inside, meshes of simulated worlds use ``exchange``.

    Args:
        exchange: the :class:`SimulatedExchange` to use.

    Example::

        with exchanging(my_exchange):
            step()
    """
    _ACTIVE.append(exchange)
    try:
        yield exchange
    finally:
        _ACTIVE.remove(exchange)


def exchange_of(world: Any) -> Exchange:
    """The exchange of the cluster place ``world`` (a :class:`~hyper_parallel_ms._cluster.World`):
    the innermost :func:`exchanging` one (default: zeros placeholders) for a simulated world, else
    the cluster's.

    Example::

        exchange_of(World(8, 3, simulated=True)).moves      # False
    """
    if world.simulated:
        return _ACTIVE[-1] if _ACTIVE else _SIMULATED
    return _CLUSTER


def current_exchange() -> Exchange:
    """The exchange of :func:`~hyper_parallel_ms._cluster.current_world` (code without a mesh to ask).

    Example::

        current_exchange().holds_values      # True outside a simulation
    """
    return exchange_of(current_world())

