"""HyperParallel's ``get_platform()``: the object through which MindFormers calls differentiable
collectives on a process group given by its name.

Served: ``differentiable_all_reduce(tensor, op, group)`` (this library's ``comm.all_reduce`` on
the group's ranks, whose backward is the all-reduce of the gradient, summed) and
``create_group(rank_list)`` (the group name of those ranks, made once). Not served: the
expert-parallel overlap hooks (``differentiable_sync_hook``,
``differentiable_all_to_all_single_async``, ``AsyncCollectiveTensor``): calling them raises
:class:`~hyper_parallel_ms.compat.NotProvidedError`.

Example::

    from hyper_parallel.platform import get_platform      # after alias_hyper_parallel()
    total = get_platform().differentiable_all_reduce(count, "sum", mesh.get_group("tp"))
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

from ..comm import all_reduce
from ..process_group import group_mesh, reduce_op_name
from ._alias import NotProvidedError

__all__ = ["MindSporePlatform", "get_platform"]

class MindSporePlatform:
    """The MindSpore platform of HyperParallel's API, on this library's collectives.

    Example::

        get_platform().differentiable_all_reduce(x, "sum", None)     # over the world group
    """

    name = "mindspore"

    def differentiable_all_reduce(self, tensor, op: str = "sum", group: Optional[str] = None):
        """All-reduce ``tensor`` over ``group`` (a group name; ``None``: the world), differentiably.

        Args:
            tensor: this rank's tensor.
            op: ``"sum"``, ``"avg"`` (or ``"mean"``), ``"max"`` or ``"min"``.
            group: a MindSpore group name, as ``DeviceMesh.get_group()`` returns, or ``None``.
        """
        op = reduce_op_name(op, "differentiable_all_reduce")          # checked before the group is looked up
        return all_reduce(tensor, group_mesh(group), 0, op=op)

    def create_group(self, rank_list, group_name: Optional[str] = None) -> str:
        """HyperParallel's: the MindSpore group name of ``rank_list``, created on first use (this library's
        group of those ranks, shared with its meshes). Every member calls it, in the same order; a
        non-member may not (MindSpore's group creation).

        Args:
            rank_list: the group's global ranks, increasing (a group orders its members by rank), two or
                more, this rank among them.
            group_name: HyperParallel's choice of name: refused (this library names its groups by their
                ranks, so that a group is made once whoever asks for it).

        Example::

            group = get_platform().create_group([0, 1])      # then mint.distributed calls with group=group
        """
        from .. import _cluster
        if group_name is not None:
            raise NotImplementedError(f"create_group(..., group_name={group_name!r}): this library names its groups "
                                      f"by their ranks; call create_group(rank_list) and use the name it returns")
        ranks = tuple(int(r) for r in rank_list)
        if len(ranks) < 2 or len(set(ranks)) != len(ranks):
            raise ValueError(f"create_group: rank_list {list(rank_list)} must hold two or more distinct ranks "
                             f"(one rank communicates with nobody)")
        return _cluster.comm_group(ranks).name

    def _not_provided(self, what: str) -> Any:
        raise NotProvidedError(f"hyper_parallel.platform.get_platform().{what} (HyperParallel's expert-parallel "
                               f"overlap) is not provided by hyper_parallel_ms; see docs/mindformers.md")

    def differentiable_sync_hook(self, *args: Any, **kwargs: Any) -> Any:
        """Not provided: raises :class:`NotProvidedError` (expert-parallel overlap hooks)."""
        return self._not_provided("differentiable_sync_hook")

    def differentiable_all_to_all_single_async(self, *args: Any, **kwargs: Any) -> Any:
        """Not provided: raises :class:`NotProvidedError` (expert-parallel overlap)."""
        return self._not_provided("differentiable_all_to_all_single_async")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._not_provided(name)


@lru_cache(maxsize=None)
def get_platform() -> MindSporePlatform:
    """The platform object (one per process), as HyperParallel's ``get_platform()``.

    Example::

        platform = get_platform()
        platform.differentiable_all_reduce(x, "sum", group)
    """
    return MindSporePlatform()
