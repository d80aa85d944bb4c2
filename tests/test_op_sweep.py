"""The op sweep: every entry of tests/_op_table/ on DTensors against the single-device op
(values and gradients), on meshes (2,) and (2, 2), each mesh in one rank-function call; the
propagator's rule replacement; Partial(max) through monotonic ops; empty local pieces; a wrong
rule failing on some ranks only raises on every rank."""
from __future__ import annotations

import collections

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.ops import OpSchema, OutputSharding, propagator, register_sharding
from hyper_parallel_ms.placement import Partial
from hyper_parallel_ms.testing import multi_rank, run_on_ranks
from tests import _op_table
from tests._ops_check import S0, S1, R, _rand, check_op


def coverage() -> dict:
    """{family: Counter of entry statuses}: "ok" (run against the single-device op),
    "cpu_kernel" (rule present, no CPU kernel), "unsupported" (no rule), "bypass"."""
    table: dict = collections.defaultdict(collections.Counter)
    for c in _op_table.CASES:
        table[c.family][c.status] += 1
    return dict(table)


def test_table_size_and_coverage():
    families = coverage()
    total = sum(sum(counts.values()) for counts in families.values())
    assert total >= 200, total
    assert len({c.name for c in _op_table.CASES}) == total          # one entry per entry point
    print(f"{'family':22s} with a rule / entries (of which no CPU kernel)")
    for family, counts in sorted(families.items()):
        ruled = counts["ok"] + counts["cpu_kernel"]
        print(f"{family:22s} {ruled:4d} / {sum(counts.values()):4d} ({counts['cpu_kernel']})")
    ruled = sum(c["ok"] + c["cpu_kernel"] for c in families.values())
    print(f"{'all':22s} {ruled:4d} / {total:4d}")


def _assert_clean(results):
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank}:\n" + "\n".join(result["failures"])
    assert results[0]["checked"] > 0


def test_sweep_on_1d_mesh():
    _assert_clean(run_on_ranks(_op_table.sweep, 2, (2,)))


def test_sweep_on_2d_mesh():
    _assert_clean(run_on_ranks(_op_table.sweep, 4, (2, 2)))


def _second_split_piece_weighted(mesh, x, weights):
    def loss(piece):
        a = DTensor.from_local(piece, mesh, x.layout, shape=x.shape)
        return (mint.split(a, 2, 1)[1].full_tensor() * weights).sum()
    return ms.grad(loss)(x.to_local())


@multi_rank(4)
def test_gradient_through_a_split_view_of_a_gathered_piece():
    """The gradient each rank gets back from a gather is a view at its offset into the whole
    one; MindSpore's SplitTensorView backward read it from the start (every rank got rows 0..)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(ms.Tensor(_rand(5, 6)), mesh, [S0, S0])
    weights = _rand(5, 2)
    grad = _second_split_piece_weighted(mesh, x, ms.Tensor(weights)).asnumpy()
    want = np.zeros((5, 6), np.float32)
    want[:, 2:4] = weights
    np.testing.assert_allclose(grad, want[x.layout.local_slices(x.shape, mesh.get_coordinate())], rtol=1e-6)


def _exp_of_max(a):
    return ops.exp(ops.amax(a, 1)) + 1.0


def _relu_of_max(a):
    return ops.relu(ops.amax(a, 1) * 2.0)


@multi_rank(2)
def test_propagator_replaces_rules_and_keeps_partial_max():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = check_op(mesh, _exp_of_max, [_rand(4, 6)], [[S1]], [Partial("max")])      # monotone: stays P(max)
    assert out.placements == (Partial("max"),)
    check_op(mesh, _relu_of_max, [_rand(4, 6)], [[S1]], [Partial("max")])
    x = distribute_tensor(ms.Tensor(_rand(4, 6)), mesh, [S0])
    assert ops.neg(x).placements == (S0,)                 # a decision is cached for Neg on S(0)
    old = propagator.rule_for("Neg")

    def replicating(schema: OpSchema) -> OutputSharding:
        layout = schema.args[0].layout.with_placements((R,))
        return OutputSharding((layout,), ((layout, schema.args[0].shape),))
    try:
        register_sharding("Neg")(replicating)
        assert propagator.rule_for("Neg") is replicating
        y = ops.neg(x)                                    # the new rule is used, not the cached decision
        assert y.placements == (R,)
        np.testing.assert_allclose(y.full_tensor().asnumpy(), -x.full_tensor().asnumpy())
    finally:
        register_sharding("Neg")(old)
    assert ops.neg(x).placements == (S0,)


def _layer_norm_cell():
    norm = nn.LayerNorm((6,), begin_norm_axis=-1, begin_params_axis=-1)

    def run(a):
        return norm(a)
    return run


def _max_over_rows(a):
    return ops.amax(a, 0)


def _tile_rows(a):
    return ops.tile(a, (1, 2))


def _argmax_rows(a):
    return ops.argmax(a, 1).astype(ms.float32)


def _mean_of_all(a):
    return a.mean()


def _whole_on_every_rank(dt, want):
    """``dt``'s global value equals ``want`` (dtype included) on every rank."""
    got = dt.full_tensor().asnumpy()
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


@multi_rank(4)
def test_empty_pieces_skip_the_kernel():
    """Rows nested over mesh (2, 2) (5 rows: 2, 1, 1, 1; 3 rows: 1, 1, 1, 0). LayerNorm / Tile /
    Argmax kernels raise on an empty piece and ReduceMax / ReduceSum return uninitialised memory
    there; every rank must get on, with the one-device values."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    check_op(mesh, _layer_norm_cell(), [_rand(2, 5, 6)], [[S1, S1]], [S1, S1])
    check_op(mesh, _tile_rows, [_rand(5, 3)], [[S0, S0]], [S0, S0])
    check_op(mesh, _argmax_rows, [_rand(5, 3)], [[S0, S0]], [S0, S0])
    negative = -np.abs(_rand(5, 3)) - 1.0           # the maximum is negative: a 0 from the empty piece would win
    out = check_op(mesh, _max_over_rows, [negative], [[S0, S0]], [Partial("max"), Partial("max")])
    assert out.placements == (Partial("max"), Partial("max"))
    table = _rand(5, 4)                             # an embedding table of 5 rows, row-sharded on 4 ranks
    table_dt = distribute_tensor(ms.Tensor(table), mesh, [S0, S0])
    ids = ms.Tensor(np.array([[4, 0, 3]], np.int32))
    np.testing.assert_allclose(ops.gather(table_dt, ids, 0).full_tensor().asnumpy(), table[[[4, 0, 3]]],
                               rtol=1e-6)
    # 3 rows on [S0, S0]: pieces 1, 1, 1, 0. A mean over all dims summed the empty piece with
    # MindSpore's CPU sum, which returns uninitialised memory there (-1e11 for 0.19); an integer
    # sum filled the empty piece's Partial with a float 0, so that rank's all-reduce moved float32
    # while the others moved integer limbs (a collective failure); new_ones was 0 on that rank.
    check_op(mesh, _mean_of_all, [_rand(3, 4)], [[S0, S0]], [Partial(), Partial()])
    ints = np.arange(12, dtype=np.int32).reshape(3, 4) - 20
    ints_dt = distribute_tensor(ms.Tensor(ints), mesh, [S0, S0])
    _whole_on_every_rank(ints_dt.sum(0), ints.sum(0))
    _whole_on_every_rank(ops.amax(ints_dt, 0), ints.max(0))        # negative: the identity is int32's minimum
    _whole_on_every_rank(ints_dt.new_ones((2,)), np.ones(2, np.int32))


def _raised_everywhere(fn) -> str:
    """``fn()`` must raise; return the exception's type and first line."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001  (the type is what the test compares)
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "returned"


def _wrong_rules_raise_on_every_rank():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = distribute_tensor(ms.Tensor(_rand(5, 6)), mesh, [S0])          # pieces of 3 and 2 rows
    y = ms.Tensor(_rand(3, 6))                                          # broadcasts with rank 0's piece only
    old_neg, old_mul = propagator.rule_for("Neg"), propagator.rule_for("Mul")

    def four_rows(schema: OpSchema) -> OutputSharding:      # promises (2, 6) pieces: wrong on rank 0 only
        return OutputSharding((schema.args[0].layout,), ((schema.args[0].layout, (4, 6)),))

    def like_first(schema: OpSchema) -> OutputSharding:     # rank 1 multiplies (2, 6) by (3, 6): its kernel fails
        a = schema.args[0]
        return OutputSharding((a.layout, schema.args[1].layout), ((a.layout, a.shape),))
    try:
        register_sharding("Neg")(four_rows)
        register_sharding("Mul")(like_first)
        errors = [_raised_everywhere(lambda: ops.neg(x)), _raised_everywhere(lambda: ops.neg(x)),
                  _raised_everywhere(lambda: ops.mul(x, y))]
    finally:
        register_sharding("Neg")(old_neg)
        register_sharding("Mul")(old_mul)
    whole = x.full_tensor().asnumpy()                  # a collective after the failures: nobody was left behind
    np.testing.assert_allclose(whole, _rand(5, 6))
    np.testing.assert_allclose(ops.neg(x).full_tensor().asnumpy(), -whole)
    return errors


def test_a_rule_failing_on_some_ranks_raises_on_every_rank():
    """A wrong rule registered with register_sharding fails the shape check (or the kernel) on
    one rank only; every rank must raise, and the next collective must still pair up."""
    results = run_on_ranks(_wrong_rules_raise_on_every_rank, 2)
    for rank, errors in enumerate(results):
        assert all(e != "returned" for e in errors), (rank, errors)
    assert "sharding rule of Neg is wrong" in results[0][0], results[0]
    assert "failed on the ranks at mesh coordinates [(0,)]" in results[1][0], results[1]
    assert results[1][0] == results[1][1]              # a second call is checked again, not waved through
    assert "failed on the ranks at mesh coordinates [(1,)]" in results[0][2], results[0]
