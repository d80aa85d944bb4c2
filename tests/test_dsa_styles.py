"""DeepSeek sparse attention's boundary styles in one process (a 1-rank cp mesh): which argument each
style shards on the sequence and which it all-gathers, by position and by keyword, what it leaves alone,
the outputs it returns as pieces, the asynchronous forms' handoffs, the argument checks and the refusal of
a compiled boundary. Against one device on 2 ranks: tests/_dsa_boundaries.py (in
tests/test_context_parallel.py's rank call)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms import nn as hnn
from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.mesh import DeviceMesh
from hyper_parallel_ms.placement import Replicate, Shard

from tests._dsa_boundaries import Handoff, Indexer

S1, R = (Shard(1),), (Replicate(),)


class Echo(nn.Cell):
    """Returns what the boundary hooks handed it."""

    def construct(self, *args, **kwargs):
        return (args, kwargs) if kwargs else args


def _mesh():
    return DeviceMesh("cpu", [0], mesh_dim_names=("cp",))


def _tensors(n, seed=0):
    rng = np.random.default_rng(seed)
    return [ms.Tensor(rng.standard_normal((2, 4, 2, 8)).astype(np.float32)) for _ in range(n)]


def _placements(out):
    return [tuple(o.placements) if isinstance(o, DTensor) else o for o in out]


@pytest.mark.parametrize("style, sides", [
    (hnn.DSAIndexerContextParallel, [S1, R, S1]),
    (hnn.DSASparseAttentionContextParallel, [S1, R, R, S1, S1, R]),
    (hnn.DSAIndexerLossContextParallel, [S1, R, S1, R, S1, S1, None, None, S1, R]),
])
def test_each_position_is_sharded_or_gathered(style, sides):
    echo = Echo()
    style().apply(echo, _mesh())
    args = _tensors(len(sides))
    out = echo(*args)
    for i, (got, want) in enumerate(zip(_placements(out), sides)):
        if want is None:                        # the softmax statistics: left alone unless placed
            assert out[i] is args[i]
        else:
            assert got == want, (style.__name__, i)


def test_keywords_and_roles_left_alone():
    echo = Echo()
    hnn.DSASparseAttentionContextParallel(query_index=None, key_index=None, value_index=None, topk_index=None,
                                          query_kwarg_name="query", key_kwarg_name="key", value_kwarg_name="value",
                                          topk_kwarg_name="topk").apply(echo, _mesh())
    q, k, v, t, qr, kr = _tensors(6)
    args, kwargs = echo(query=q, key=k, value=v, topk=t, query_rope=qr, key_rope=kr, keep="unchanged")
    assert args == () and kwargs["keep"] == "unchanged"
    assert {name: tuple(kwargs[name].placements) for name in ("query", "key", "value", "topk", "query_rope",
                                                            "key_rope")} == {
        "query": S1, "key": R, "value": R, "topk": S1, "query_rope": S1, "key_rope": R}
    echo = Echo()
    hnn.DSAIndexerLossContextParallel(topk_index=None, softmax_max_index=6, softmax_sum_index=7).apply(echo, _mesh())
    args = _tensors(10)
    out = echo(*args)
    assert out[5] is args[5] and _placements(out)[6:8] == [S1, S1]       # the dense stage: no top-k


def test_use_local_output_returns_pieces():
    echo = Echo()
    hnn.DSASparseAttentionContextParallel(use_local_output=True).apply(echo, _mesh())
    out = echo(*_tensors(4))
    assert all(not isinstance(o, DTensor) for o in out)
    assert hnn.DSAIndexerContextParallel().use_local_output is False


def test_async_forms_take_their_handoffs_and_refuse_another_tensor():
    echo, handoffs = Echo(), [Handoff(), Handoff(), Handoff()]
    style = hnn.AsyncDSAIndexerLossContextParallel()
    assert isinstance(style, hnn.DSAIndexerLossContextParallel)
    style.apply(echo, _mesh(), key_handoff=handoffs[0], key_indexer_handoff=handoffs[1], key_rope_handoff=handoffs[2])
    args = _tensors(10)
    args[1], args[3], args[9] = handoffs[0](args[1]), handoffs[1](args[3]), handoffs[2](args[9])
    out = echo(*args)
    assert _placements(out)[1] == _placements(out)[3] == _placements(out)[9] == R
    handoffs[0](args[1])
    with pytest.raises(ValueError, match="not what its handoff Cell returned"):
        echo(*(args[:1] + [args[1] * 1.0] + args[2:]))
    assert "AsyncDSAIndexerLossContextParallel" in repr(style) and "layout='BSND'" in repr(style)


def test_arguments_are_checked_and_a_compiled_boundary_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        hnn.DSAIndexerContextParallel(layout="BNSD")
    with pytest.raises(ValueError, match="only mode='colossal' is provided"):
        hnn.DSASparseAttentionContextParallel(mode="ulysses")
    with pytest.raises(ValueError, match="share_key_value=True needs a shared_replicate_cache"):
        hnn.DSASparseAttentionContextParallel(share_key_value=True)
    with pytest.raises(TypeError, match="must be a DSASequenceReplicateCache"):
        hnn.DSAIndexerLossContextParallel(shared_replicate_cache={})
    with pytest.raises(ValueError, match="topk_index must be None or an argument position"):
        hnn.DSAIndexerLossContextParallel(topk_index=-1)
    with pytest.raises(TypeError, match="needs the 1-D cp DeviceMesh"):
        hnn.DSAIndexerContextParallel().apply(nn.Identity(), DeviceMesh("cpu", [[0]], mesh_dim_names=("a", "b")))
    indexer = Indexer()
    style = hnn.DSAIndexerContextParallel(layout="TND", use_local_output=True)
    assert style.seq_dim == 0 and style._apply(indexer, _mesh()) is indexer and style.weights_index == 2
    assert "layout='TND'" in repr(style) and "use_local_output=True" in repr(style)
    q = ms.Tensor(np.ones((1, 3, 2, 4), np.float32))
    w = ms.Tensor(np.ones((1, 3, 2), np.float32))
    np.testing.assert_allclose(indexer(q, q, w).asnumpy(), Indexer()(q, q, w).asnumpy(), rtol=1e-6)

    def model(q, k, w):                             # a compiled model holding the boundary is refused
        return indexer(q, k, w)
    with pytest.raises(NotImplementedError, match="DSA context-parallel styles convert"):
        ms.jit(model)(q, q, w)


def test_a_tensor_parallel_dtensor_enters_on_the_mesh_of_both_and_its_outputs_go_back():
    root = DeviceMesh("cpu", [[0]], mesh_dim_names=("cp", "tp"))
    echo = Echo()
    hnn.DSAIndexerContextParallel().apply(echo, root["cp"])
    q, k, w = (DTensor.from_local(x, root["tp"], (Shard(2),)) for x in _tensors(3))
    out = echo(q, k, w)                         # outputs: the arguments as the boundary saw them, sent back
    assert [o.device_mesh for o in out] == [root["tp"]] * 3
    assert [tuple(o.placements) for o in out] == [(Shard(2),)] * 3
    cell = Echo()
    hnn.DSAIndexerContextParallel(use_local_output=True).apply(cell, root["cp"])
    seen = []
    cell.register_forward_pre_hook(lambda c, args: seen.extend(args))      # after the style's hooks
    cell(q, k, w)
    assert [tuple(a.placements) for a in seen] == [(Shard(1), Shard(2)), (Replicate(), Shard(2)), (Shard(1), Shard(2))]
    assert seen[0].device_mesh.mesh_dim_names == ("cp", "tp")
    with pytest.raises(ValueError, match="cuts its sequence dim 1, which it must hold whole"):
        echo(DTensor.from_local(_tensors(1)[0], root["tp"], (Shard(1),)), k, w)
    other = DeviceMesh("cpu", [0], mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="not a slice of the mesh the cp mesh"):
        echo(DTensor.from_local(_tensors(1)[0], other, (Shard(2),)), k, w)
