"""The simulated cluster's exchange: shape-only placeholders for collectives, and a mailbox for
point-to-point messages between the ranks a simulation runs in turn.

A rank run later receives what an earlier one sent: host values (a pipeline's header of
shapes) come back as they were sent, tensors as shape-only placeholders. A rank the simulation
stands for by another one (its class representative, :mod:`._session`) sends through that
representative: ``stand_in(rank) -> (representative, translate)`` maps a sender to the rank
that ran and a function translating the representative's peers to the sender's.

Example::

    exchange = Mailbox()
    with exchanging(exchange):
        send(header, simulated_mesh, dst=1)         # rank 0
    ...
    with exchanging(exchange):
        recv(like, simulated_mesh, src=0)           # rank 1: the header rank 0 sent

The mailbox also states what a simulated rank cannot know: how a mixture-of-experts router spreads
the tokens over the experts (:meth:`Mailbox.expert_counts`, from the routing :func:`simulate` was
given; :mod:`._routing`), which expert parallelism's token exchange takes its shapes from.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..comm._exchange import NotReady, SimulatedExchange
from ._abstract import abstract_like, is_abstract
from ._routing import check_routing, routed_counts

__all__ = ["Mailbox", "MissingMessage"]

_FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)

StandIn = Callable[[int], Tuple[int, Callable[[int], int]]]


class MissingMessage(NotReady):
    """A rank receives host values from a rank that has not run yet (the simulation runs it first)."""

    def __init__(self, sender: int, receiver: int, dtype: Any) -> None:
        super().__init__(f"simulated rank {receiver} receives host values ({dtype}) from rank {sender}, which has not "
                         "run yet: its messages are made when it runs")
        self.sender, self.receiver = sender, receiver


class Mailbox(SimulatedExchange):
    """Placeholders are shape-only tensors; messages wait in a mailbox keyed by (sender, receiver).

    Args:
        stand_in: ``rank -> (the rank that ran for it, translation of that rank's peers to its own)``
            (default: every rank ran itself).
        routing: the routing assumption of :meth:`expert_counts` (``"uniform"`` or shares, see
            :func:`~._routing.routed_counts`).

    Example::

        exchange = Mailbox()
        exchange.placeholder(x, (4, 8))          # AbstractTensor((4, 8), x.dtype)
    """

    def __init__(self, stand_in: Optional[StandIn] = None, routing: Any = "uniform") -> None:
        self._mail: Dict[Tuple[int, int], List[Any]] = {}
        self._read: Dict[Tuple[int, int], int] = {}
        self._stand_in = stand_in or (lambda rank: (rank, lambda peer: peer))
        self.routing = check_routing(routing)

    def expert_counts(self, rows: int, num_experts: int, ranks: int) -> np.ndarray:
        """The ``(ranks, num_experts)`` routed slots each rank of an expert-parallel group sends to each
        expert (every rank routing ``rows``), by the stated routing: what the ranks' all-gathered router
        counts would be on the cluster."""
        return routed_counts(self.routing, rows=rows, num_experts=num_experts, ranks=ranks)

    def placeholder(self, x: Any, shape: Tuple[int, ...]) -> Any:
        return abstract_like(x, shape)

    def sent_by_others(self, rank: int) -> int:
        """How many messages ranks other than ``rank`` have sent (a measure of progress)."""
        return sum(len(box) for (sender, _), box in self._mail.items() if sender != rank)

    def forget(self, rank: int) -> None:
        """Drop what ``rank`` sent and received (it runs again)."""
        self._mail = {k: v for k, v in self._mail.items() if k[0] != rank}
        self._read = {k: v for k, v in self._read.items() if k[0] != rank}

    def send(self, x: Any, group: Any, dst: int) -> None:
        value = None if is_abstract(x) else np.array(x.asnumpy(), copy=True)
        self._mail.setdefault((group.ranks[group.rank], group.ranks[dst]), []).append(value)

    def recv(self, x: Any, group: Any, src: int) -> Any:
        sender, receiver = group.ranks[src], group.ranks[group.rank]
        count = self._read.get((receiver, sender), 0)
        self._read[receiver, sender] = count + 1
        ran, translate = self._stand_in(sender)
        box = next((v for (s, d), v in self._mail.items() if s == ran and translate(d) == receiver), [])
        if count >= len(box):
            if x.dtype in _FLOATS or is_abstract(x):     # from a rank run later, values not needed: shapes suffice
                return abstract_like(x)
            raise MissingMessage(sender, receiver, x.dtype)
        value = box[count]
        if value is None or is_abstract(x):
            return abstract_like(x)
        return Tensor(value)
