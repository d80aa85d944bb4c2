"""CPU twins of MindSpore's collective primitives (``ops.communication``'s inner collectives,
``mint.distributed``'s in-place ones and ``batch_isend_irecv``): this library's ``comm`` functions on the
group's ranks (:mod:`._twins` lists them and puts them in place).

Example::

    with cpu_twins():
        ops.communication.all_reduce(x, group=name)      # runs _all_reduce: comm.all_reduce
"""
from __future__ import annotations

from ._twin_values import _host, _partial_view

__all__ = ["_all_reduce", "_all_gather", "_reduce_scatter", "_all_to_all_v", "_dist_all_reduce",
           "_dist_all_gather_into_tensor", "_dist_batch_isend_irecv"]


def _all_reduce(self, input, op_type, group, async_op=True):  # noqa: A002
    from ..comm import all_reduce
    from ..process_group import group_mesh, reduce_op_name
    op = reduce_op_name(_host(op_type), "cpu_twins")
    return all_reduce(input, group_mesh(group), 0, op=op)


def _all_gather(self, input, rank_size, group, async_op=True):  # noqa: A002
    from ..comm import all_gather
    from ..process_group import group_mesh
    return all_gather(input, group_mesh(group), 0, dim=0)


def _reduce_scatter(self, input, rank_size, op_type, group, async_op=True):  # noqa: A002
    from ..comm import reduce_scatter
    from ..process_group import group_mesh, reduce_op_name
    op = reduce_op_name(_host(op_type), "cpu_twins")
    return reduce_scatter(input, group_mesh(group), 0, dim=0, op=op)


def _all_to_all_v(self, input, group, send_numel_list, recv_numel_list, rank_size, split_sizes_empty,  # noqa: A002
                  async_op=True):
    from ..comm import all_to_all_single
    from ..process_group import group_mesh
    sends = [int(_host(n)) for n in send_numel_list]
    receives = [int(_host(n)) for n in recv_numel_list]
    return all_to_all_single(input.reshape(-1), receives, sends, group_mesh(group), 0)


def _dist_all_reduce(self, input, op_type, group, async_op=True):  # noqa: A002
    """In place (``mint.distributed.all_reduce``): the result written into ``input``."""
    return input.copy_(_all_reduce(self, input, op_type, group))


def _dist_all_gather_into_tensor(self, other, input, rank_size, group, async_op=True):  # noqa: A002
    """In place (``mint.distributed.all_gather_into_tensor``): the gathered rows written into ``other``."""
    from ..comm import all_gather
    from ..process_group import group_mesh
    other.copy_(all_gather(input, group_mesh(group), 0, dim=0))
    return other


def _dist_batch_isend_irecv(self, input, group, op_types, remotes_ranks):  # noqa: A002
    """``mint.distributed.batch_isend_irecv``: each ``isend`` (type 0), then each ``irecv`` (type 1), peers
    given as ranks of ``group``."""
    from ..comm import recv, send
    from ..process_group import group_mesh
    mesh = group_mesh(group)
    ops_ = list(zip(input, (int(_host(t)) for t in op_types), (int(_host(r)) for r in remotes_ranks)))
    for tensor, kind, peer in ops_:
        if kind not in (0, 1):
            raise ValueError(f"cpu_twins: batch_isend_irecv op type {kind} is neither isend (0) nor irecv (1)")
        if kind == 0:
            send(tensor.contiguous() if _partial_view(tensor) else tensor, mesh, 0, dst=peer)
    for tensor, kind, peer in ops_:
        if kind == 1:
            tensor.copy_(recv(tensor, mesh, 0, src=peer))
    return list(input)
