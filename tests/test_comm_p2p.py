"""Point-to-point send / recv: exchanges both ways on 2 CPU ranks (the order a pipeline plan
gives them), CommDebugMode counts, the watchdog's counts on the rank's board, refusals; and their
rows in the capability table."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.comm import CAPABILITIES, POINT_TO_POINT, table
from hyper_parallel_ms.testing import multi_rank


def test_point_to_point_rows_in_the_capability_table():
    assert POINT_TO_POINT == ("send", "recv")
    for device in ("CPU", "Ascend"):
        for kind in POINT_TO_POINT:
            cap = CAPABILITIES[(device, kind)]
            assert cap.path == "native" and "PyNative only" in cap.how
            assert f"| {device} | {kind} | native | {cap.how} |" in table()


def _board_counts(mesh) -> tuple:
    """(sends to, receives from) the other rank of ``mesh``'s "pp" dim counted on this rank's board."""
    from hyper_parallel_ms.comm import _watchdog
    from hyper_parallel_ms.comm._board import BoardView, key_hash

    group = mesh.comm_group("pp")
    me, peer = group.ranks[group.rank], group.ranks[1 - group.rank]
    view = BoardView.read(_watchdog._dogs[0].board.path)          # pylint: disable=protected-access
    return view.count(key_hash(f"s:{group.name}:{me}>{peer}")), view.count(key_hash(f"r:{group.name}:{peer}>{me}"))


def _values(rank: int, step: int, dtype) -> ms.Tensor:
    return ms.Tensor(np.arange(6).reshape(2, 3) * 7 + 100 * rank + 10 * step - 20).astype(dtype)


@multi_rank(2)
def test_send_recv_both_ways_on_two_ranks():
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_local_rank()
    peer = 1 - me
    like = ms.ops.zeros((2, 3), ms.float32)
    with CommDebugMode() as mode:
        # the 1F1B order of a 2-stage plan: activation forward, gradient back, twice
        for step in range(2):
            if me == 0:
                comm.send(_values(0, step, ms.float32), mesh, "pp", dst=1)
                got = comm.recv(like, mesh, "pp", src=1)
            else:
                got = comm.recv(like, mesh, "pp", src=0)
                comm.send(_values(1, step, ms.float32), mesh, "pp", dst=0)
            np.testing.assert_array_equal(got.asnumpy(), _values(peer, step, ms.float32).asnumpy())
            assert got.dtype == ms.float32 and like.asnumpy().sum() == 0      # the shape template is untouched
    assert mode.get_comm_counts() == {"send": 2, "recv": 2}
    assert mode.total_bytes("send") == 2 * 6 * 4 and mode.total_bytes("recv") == 0
    assert {(r.mesh_dim, r.group_size, r.path) for r in mode.records} == {("pp", 2, "native")}

    # each call is counted once on this rank's board, for the watchdog (a recv by the receiver, a send by the sender)
    sends, receives = _board_counts(mesh)
    for dtype in (ms.bool_, ms.int64, ms.bfloat16, ms.float64):      # bool travels as uint8
        if me == 0:
            comm.send(_values(0, 3, dtype), mesh, "pp", dst=1)
        else:
            got = comm.recv(ms.ops.zeros((2, 3), dtype), mesh, "pp", src=0)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.astype(ms.float64).asnumpy(),
                                          _values(0, 3, dtype).astype(ms.float64).asnumpy())
    assert _board_counts(mesh) == ((sends + 4, receives) if me == 0 else (sends, receives + 4))

    # a runtime can execute a plan's lists as they are: each RECV gets what its SEND sent
    from hyper_parallel_ms.pipelining import SEND_F, build_plan
    for plan in (build_plan("ZBVZeroBubble", 2, 3), build_plan("Interleaved1F1B", 2, 3)):
        for a in plan.actions[me]:
            if a.kind.is_send:
                comm.send(ms.Tensor([a.stage, a.microbatch, a.kind is SEND_F], ms.float32), mesh, "pp", dst=peer)
            elif a.kind.is_recv:
                got = comm.recv(ms.ops.zeros(3, ms.float32), mesh, "pp", src=peer)
                sent = a.matching()
                assert got.asnumpy().tolist() == [sent.stage, sent.microbatch, sent.kind is SEND_F], (a, got)

    with pytest.raises(ValueError, match=f"send dst must be the index of another rank along mesh dim 'pp' "
                                         f"\\(0..1, this rank is {me}\\), got {me}"):
        comm.send(like, mesh, "pp", dst=me)
    with pytest.raises(ValueError, match="recv src must be the index of another rank"):
        comm.recv(like, mesh, "pp", src=2)
    with pytest.raises(TypeError, match="send needs a MindSpore Tensor, got ndarray"):
        comm.send(np.zeros(3), mesh, "pp", dst=peer)

    @ms.jit
    def compiled(x):
        comm.send(x, mesh, "pp", dst=peer)
        return x

    with pytest.raises(NotImplementedError, match="send runs in PyNative only"):
        compiled(like)
