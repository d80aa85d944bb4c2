"""HyperParallel's ``get_platform()``: the object through which MindFormers calls differentiable
collectives on a process group given by its name.

Served: ``differentiable_all_reduce(tensor, op, group)`` (this library's ``comm.all_reduce`` on
the group's ranks, whose backward is the all-reduce of the gradient, summed),
``create_group(rank_list)`` (the group name of those ranks, made once),
``differentiable_all_to_all_single(_async)(tensor, input_splits, output_splits, group)`` (this
library's ``comm.all_to_all_single``; the async form returns the exchanged tensor itself, complete:
the same values, no overlap window) and ``differentiable_sync_hook(x, name, coordinator)``
(:func:`hyper_parallel_ms.pipelining.sync_hook`, the meeting points of a
:class:`~hyper_parallel_ms.pipelining.CommComputeOverlap`). Any other name raises
:class:`~hyper_parallel_ms.compat.NotProvidedError`.

Example::

    from hyper_parallel.platform import get_platform      # after alias_hyper_parallel()
    total = get_platform().differentiable_all_reduce(count, "sum", mesh.get_group("tp"))
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional, Sequence

from ..comm import all_reduce, all_to_all_single
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

    def differentiable_all_to_all_single(self, input_tensor, input_splits: Sequence[int], output_splits: Sequence[int],
                                         group: Optional[str]):
        """Rows of ``input_tensor`` (dim 0) to the group's ranks, ``input_splits[j]`` to rank ``j``; the rows
        received, ``output_splits[i]`` from rank ``i``, in rank order. Differentiable (the backward is the
        exchange with the splits swapped). HyperParallel's expert-parallel token dispatch / combine.

        Args:
            input_tensor: this rank's rows (MindFormers passes a 1-D tensor and element counts).
            input_splits: rows sent to each rank of the group (Python ints).
            output_splits: rows received from each rank (Python ints).
            group: a MindSpore group name (``DeviceMesh.get_group()``), or ``None``: the world.

        Example::

            out = get_platform().differentiable_all_to_all_single(x, [2, 1], [2, 3], mesh.get_group("ep"))
        """
        return all_to_all_single(input_tensor, output_split_sizes=list(output_splits),
                                 input_split_sizes=list(input_splits), mesh=group_mesh(group), mesh_dim=0)

    def differentiable_all_to_all_single_async(self, input_tensor, input_splits: Sequence[int],
                                               output_splits: Sequence[int], group: Optional[str]):
        """HyperParallel's asynchronous form of :meth:`differentiable_all_to_all_single`: here the exchange
        completes before it returns (the received tensor itself, where HyperParallel hands back one
        that waits on first use): the same values and gradients, without the overlap window.

        Example::

            out = get_platform().differentiable_all_to_all_single_async(flat, sends, receives, ep_group)
        """
        return self.differentiable_all_to_all_single(input_tensor, input_splits, output_splits, group)

    def differentiable_sync_hook(self, x, hook_name: str, coordinator):
        """A meeting point of the two threads of a ``CommComputeOverlap``: the identity on ``x`` (values
        and gradient); see :func:`hyper_parallel_ms.pipelining.sync_hook`.

        Example::

            h = get_platform().differentiable_sync_hook(h, "A", overlap.coordinator)
        """
        from ..pipelining import sync_hook
        return sync_hook(x, hook_name, coordinator)

    def _not_provided(self, what: str) -> Any:
        raise NotProvidedError(f"hyper_parallel.platform.get_platform().{what} is not provided by hyper_parallel_ms; "
                               f"see docs/mindformers.md")

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
