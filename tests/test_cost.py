"""The one cost model (pure Python): the planner, the op rules and CommDebugMode's textbook
figures agree on it, and its tie-breaks are the documented ones."""
from __future__ import annotations

import itertools
from math import prod

import pytest

from hyper_parallel_ms._cost import Cost, change_cost, change_steps, step_elements, textbook_sent
from hyper_parallel_ms.comm import _traffic
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.redistribute import plan_redistribute

PLACEMENTS = [Replicate(), Partial(), Partial("max"), Shard(0), Shard(1)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_planner_and_rules_price_a_mesh_dim_change_alike(n):
    """On one mesh dim, the planner's plan takes the steps the rules price, at their cost."""
    shape = (4 * n, 2 * n)
    for src, dst in itertools.product(PLACEMENTS, PLACEMENTS):
        plan = plan_redistribute(Layout((n,), (src,)), Layout((n,), (dst,)), shape)
        local = prod(shape) // (n if src.is_shard() else 1)
        sent = 0.0
        for step in plan:
            sent += step_elements(step.kind, n, local)
            local = local * n if step.kind == "all_gather" else local // n if step.kind in (
                "chunk", "reduce_scatter") else local
        assert tuple(s.kind for s in plan) == change_steps(src, dst), (src, dst)
        assert sent == pytest.approx(change_cost(src, dst, n).elements * prod(shape)), (src, dst)


def test_tie_breaks_fewer_elements_then_fewer_steps_then_keep():
    assert Cost(1.0, 5) < Cost(2.0, 0)                       # fewer elements first
    assert Cost(0.0, 0) < Cost(0.0, 1)                       # then fewer steps
    for p, n in itertools.product(PLACEMENTS, (1, 2, 4)):  # keeping a placement wins every tie it is part of
        assert all(change_cost(p, p, n) < change_cost(p, q, n) for q in PLACEMENTS if q != p)
    big, small = Cost(0.0, 1).scaled(64), Cost(0.0, 1).scaled(4)
    assert small + Cost() < big                              # a local step on the smaller tensor wins


def test_commdebugmode_textbook_figures_are_the_model():
    n, shape, itemsize = 4, (8, 3), 4
    local = prod(shape) * itemsize
    assert _traffic.all_gather_bytes("native", n, shape, itemsize, 0, (8,) * 4)[0] == step_elements(
        "all_gather", n, local)
    for kind, figure in [("all_reduce", _traffic.all_reduce_bytes("native", n, shape, itemsize, "sum")),
                         ("reduce_scatter", _traffic.reduce_scatter_bytes("native", n, shape, itemsize, 0, 1, "sum")),
                         ("all_to_all", _traffic.all_to_all_bytes("native", n, shape, itemsize, 0, 1, (3,) * 4, 1)),
                         ("broadcast", _traffic.broadcast_bytes("native", n, shape, itemsize))]:
        assert figure[0] == step_elements(kind, n, local) == textbook_sent(kind, n, local), kind
    # uneven pieces: what this rank does not hold / keep
    assert _traffic.all_gather_bytes("native", 3, (2, 1), 4, 0, (3, 3, 2))[0] == textbook_sent(
        "all_gather", 3, 8 * 4, 2 * 4) == 24
