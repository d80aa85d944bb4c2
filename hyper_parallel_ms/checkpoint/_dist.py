"""How the ranks of a save or load agree: this rank, the world, an all-gather of small
Python objects, and whether every rank succeeded (``comm``'s agreement service over a 1-D
mesh of the world; the messages travel only when a rank failed). ``distributed=False`` (``no_dist``, or no collectives) makes
this process a world of its own.

Example:
    >>> c = Coordinator(distributed=False)
    >>> c.rank, c.world_size, c.all_gather({"a": 1})
    (0, 1, [{'a': 1}])
"""
from __future__ import annotations

from typing import Any, List, Optional

from .. import _cluster
from ..comm._agreement import failed_coordinates
from ..comm._exchange import exchange_of
from ..mesh import DeviceMesh

__all__ = ["Coordinator"]


class Coordinator:
    """Rank, world size and object collectives over the world group (PyNative); the world is
    the current one (:func:`~hyper_parallel_ms._cluster.current_world`), whose exchange carries the
    objects (:meth:`~hyper_parallel_ms.comm._exchange.Exchange.all_gather_object`)."""

    def __init__(self, distributed: bool) -> None:
        self._place = _cluster.current_world()
        self.distributed = distributed and self._place.size > 1
        self.rank = self._place.rank if self.distributed else 0
        self.world_size = self._place.size if self.distributed else 1
        self._world: Optional[DeviceMesh] = None

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order (also a barrier).

        The objects travel as pickled ``bytes``: MindSpore 2.8's ``all_gather_object``
        unpickles only builtins (a checkpoint's dataclasses are refused), later releases
        anything, so exchanging bytes works the same on every release.
        """
        if not self.distributed:
            return [obj]
        return exchange_of(self._place).all_gather_object(obj, self._place)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (the others' are not sent)."""
        return self.all_gather(obj if self.rank == src else None)[src]

    def agree(self, error: str | None) -> None:
        """Barrier that fails on every rank when any rank reports an ``error`` (the failed
        ranks' messages are gathered only then)."""
        if not self.distributed:
            failed = [0] if error else []
        else:
            if self._world is None:
                self._world = DeviceMesh(self._place.device_type, list(range(self.world_size)), _world=self._place)
            failed = [c[0] for c in failed_coordinates(self._world, bool(error))]
        if failed:
            errors = self.all_gather(error)
            from ._metadata import CheckpointError
            raise CheckpointError("; ".join(f"rank {r}: {errors[r]}" for r in failed))
