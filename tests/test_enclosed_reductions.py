"""A gradient reduction that an enclosing conversion already performs is dropped, and only
that one: collectives counted with CommDebugMode, input gradients against a single device."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests.test_parallel_styles import Attention

SEQ, REP = Shard(1), Replicate()


class TwoInputs(nn.Cell):
    """``q`` reads the input its PrepareModuleInput gathers; ``k`` gathers its own input."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Dense(8, 8)
        self.k = nn.Dense(8, 8)

    def construct(self, x, y):
        return self.q(x) * self.k(y)


def _inputs(count: int):
    rng = np.random.default_rng(5)
    return [rng.standard_normal((2, 4, 8)).astype(np.float32) for _ in range(count)]


def _input_grads_and_counts(make, plan, full_inputs, mesh):
    """Gradients of the summed output w.r.t. this rank's sequence pieces, the single-device
    ones cut the same way, and the collectives of one forward + backward."""
    ms.set_seed(0)
    reference = make()
    ms.set_seed(0)
    model = make()
    parallelize_module(model, mesh, plan)
    rank, n = mesh.get_coordinate()[0], mesh.size()
    part = slice(rank * 4 // n, (rank + 1) * 4 // n)
    pieces = [ms.Tensor(x[:, part]) for x in full_inputs]
    positions = tuple(range(len(pieces))) if len(pieces) > 1 else 0
    with CommDebugMode() as mode:
        grads = ms.grad(lambda *a: model(*a).sum(), grad_position=positions)(*pieces)
    want = ms.grad(lambda *a: reference(*a).sum(), grad_position=positions)(*[ms.Tensor(x) for x in full_inputs])
    if len(pieces) == 1:
        grads, want = (grads,), (want,)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy()[:, part], rtol=1e-5, atol=1e-5)
    return mode.get_comm_counts()


@multi_rank(2)
def test_attention_input_gradient_reduced_once_not_three_times():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    counts = {}
    for defer in (False, True):
        plan = {"": PrepareModuleInput(input_layouts=SEQ, desired_input_layouts=REP, defer_colwise_grads=defer),
                "[qkv]": ColwiseParallel(), "o": RowwiseParallel(output_layouts=SEQ)}
        counts[defer] = _input_grads_and_counts(Attention, plan, _inputs(1), mesh)
    # forward: the sequence gather and o's reduce-scatter; backward: o's gather, then the input gradient
    # reduced by q, k and v (all-reduce each), or once by the enclosing gather's reduce-scatter
    assert counts[False] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 3}, counts
    assert counts[True] == {"all_gather": 2, "reduce_scatter": 2}, counts


@multi_rank(2)
def test_a_reduction_the_enclosing_conversion_does_not_perform_is_kept():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {"": PrepareModuleInput(input_layouts=(SEQ, None), desired_input_layouts=(REP, None),
                                   defer_colwise_grads=True),
            "q": ColwiseParallel(), "k": ColwiseParallel(input_layouts=SEQ)}
    counts = _input_grads_and_counts(TwoInputs, plan, _inputs(2), mesh)
    # q's all-reduce is taken over by the enclosing reduce-scatter; k reads y as it arrives
    # (sequence pieces), gathers it itself and keeps its own reduce-scatter
    assert counts == {"all_gather": 2, "reduce_scatter": 2}, counts


def test_the_rule_on_placements():
    """Which reductions an enclosing conversion takes over, and the gradient layouts the
    styles derive (pure, no ranks)."""
    from hyper_parallel_ms.placement import Partial
    from hyper_parallel_ms.redistribute._gradient import gradient_placements, reduction_taken_over, shared_dims
    both, second = (Partial(), Partial()), (REP, Partial())
    assert reduction_taken_over((REP, REP), both, (REP, REP), second)          # a subset of the outer's dims
    assert not reduction_taken_over((REP, REP), second, (REP, REP), both)      # mesh dim 0 is not reduced outside
    assert not reduction_taken_over((REP, REP), both, (SEQ, REP), second)      # reads another layout
    assert not reduction_taken_over((REP, REP), both, (REP, REP), None)        # nothing to drop
    assert not reduction_taken_over((REP, REP), None, (REP, REP), second)      # the outer reduces nothing
    # Colwise input, SequenceParallel parameter, Rowwise bias on replicated / sequence-sharded outputs
    assert gradient_placements((REP,), shared_dims((REP,), (Shard(0),))) == (Partial(),)
    assert shared_dims((REP,), (SEQ,)) == (0,) and shared_dims((REP,), (REP,)) == ()
    assert gradient_placements((Partial(), SEQ)) == (REP, SEQ)
