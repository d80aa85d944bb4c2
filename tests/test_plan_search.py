"""The alpha-beta cost model, the search over parallel dims (its linear extrapolation over blocks checked
against full simulations) and the scripts/plan_cluster.py command line."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup():
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.llama import LlamaConfig
    return LlamaConfig(vocab=64, dim=64, layers=6, heads=4, hidden=128, max_seq=32)


def test_alpha_beta_cost_of_collectives_and_ranks():
    from hyper_parallel_ms.dryrun import Cluster, CommStats, RankReport, rank_seconds
    from hyper_parallel_ms.dryrun._cost import collective_seconds
    cluster = Cluster(devices_per_node=4, intra_bandwidth=100.0, inter_bandwidth=10.0, intra_latency=1.0,
                      inter_latency=2.0, device_flops=1000.0, efficiency=0.5)
    inside = CommStats(calls=2, bytes=300, group_size=4, group=(4, 5, 6, 7))
    across = CommStats(calls=1, bytes=50, group_size=2, group=(3, 7))
    assert collective_seconds("all_gather", inside, cluster) == 2 * 3 * 1.0 + 300 / 100.0
    assert collective_seconds("all_reduce", across, cluster) == 1 * 2 * 2.0 + 50 / 10.0
    assert collective_seconds("send", across, cluster) == 2.0 + 5.0
    rank = RankReport(5, (1, 1), 0, 0, 0, flops=2000, comm={("all_gather", "tp"): inside})
    assert rank_seconds(rank, cluster, bubble=0.5) == 2000 / 500 / 0.5 + 9.0
    with pytest.raises(ValueError, match="rank 5 has no step"):
        rank_seconds(replace(rank, flops=None), cluster)


def test_parallel_dims_cover_the_devices():
    from hyper_parallel_ms.dryrun import parallel_dims_of
    found = parallel_dims_of(64, layers=32, devices_per_node=8)
    assert found and all(c.ranks == 64 and c.tp <= 8 and 32 % c.pp == 0 for c in found)
    assert {(c.pp, c.dp, c.tp) for c in found} >= {(2, 4, 8), (1, 64, 1), (32, 2, 1)}
    assert all(c.microbatches in ((1,) if c.pp == 1 else (c.pp, 2 * c.pp)) for c in found)
    assert all(not c.fsdp for c in found if c.dp == 1)


def test_extrapolation_over_blocks_equals_a_full_simulation():
    config = _setup()
    from examples.plan_llama import builder
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.pipelining import build_plan
    from hyper_parallel_ms.dryrun import Cluster, ParallelDims, estimate, rank_seconds
    from hyper_parallel_ms.dryrun._search import _extrapolated, _stage_reports
    build = builder(config)
    dims = ParallelDims(pp=2, dp=2, tp=2, fsdp=True, microbatches=2, seq=32)
    one = _stage_reports(build, dims, 1, "npu")
    two = _stage_reports(build, dims, 2, "npu")
    shape, names = dims.mesh
    full = simulate(build(dims, 6), mesh_shape=shape, mesh_dim_names=names, ranks=[0, 4])
    for r in (0, 4):
        guess, real = _extrapolated(one[r], two[r], 3), full[r]
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes", "flops"):
            assert getattr(guess, field) == getattr(real, field), (r, field)
        assert {k: (v.calls, v.bytes) for k, v in guess.comm.items()} == {k: (v.calls, v.bytes)
                                                                          for k, v in real.comm.items()}
    cluster = Cluster()
    priced = estimate(build, dims, layers=6, cluster=cluster)
    bubble = build_plan("1F1B", 2, 2).bubble_fraction()
    assert priced.step_seconds == pytest.approx(max(rank_seconds(full[r], cluster, bubble) for r in (0, 4)))
    assert priced.fits and priced.tokens_per_second == pytest.approx(dims.tokens / priced.step_seconds)


@pytest.mark.parametrize("pp, microbatches, dp, tp, fsdp, checkpointing", [
    (6, 6, 2, 1, True, False),         # the first and the middle roles extrapolated in flight (k = 6, 5, 4)
    (5, 10, 1, 2, False, True),        # more micro-batches than stages, checkpointed blocks
    (2, 4, 2, 2, True, False),         # two stages from 2 stages with 2 and 3 micro-batches
])
def test_every_stage_of_a_deep_pipeline_from_two_short_ones(pp, microbatches, dp, tp, fsdp, checkpointing):
    """The search's fast path (dryrun/_stages.py) gives the numbers a full simulation of every stage
    gives, exactly: held bytes, activations, FLOPs, each collective's calls, bytes and group."""
    config = _setup()
    from examples.plan_llama import builder
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.dryrun import ParallelDims
    from hyper_parallel_ms.dryrun._search import _sampled
    build = builder(config)
    layers = 3 * pp
    dims = ParallelDims(pp, dp, tp, fsdp, microbatches, checkpointing, 1, 32)
    cache = {}
    sampled = _sampled(build, dims, layers, "npu", cache)
    assert len(cache) == 4                  # 2 short pipelines x (1, 2) blocks per stage
    firsts = [s * dp * tp for s in range(pp)]
    shape, names = dims.mesh
    full = simulate(build(dims, layers), mesh_shape=shape, mesh_dim_names=names, ranks=firsts)
    assert full.problems == [] and [r.rank for r in sampled] == firsts
    for guess in sampled:
        real = full[guess.rank]
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes", "flops",
                      "coordinate"):
            assert getattr(guess, field) == getattr(real, field), (guess.rank, field)
        assert guess.comm == real.comm, guess.rank
    again = _sampled(build, replace(dims, microbatches=2 * microbatches), layers, "npu", cache)
    assert len(cache) == 4 and len(again) == pp                  # another micro-batch count: no new simulation


def test_search_ranks_what_fits_by_tokens_per_second():
    config = _setup()
    from examples.plan_llama import builder
    from hyper_parallel_ms.dryrun import Cluster, ParallelDims, search
    tried = [ParallelDims(1, 4, 1, False, 1, False, 1, 32), ParallelDims(1, 2, 2, True, 1, False, 1, 32),
             ParallelDims(2, 1, 2, False, 2, True, 1, 32), ParallelDims(1, 1, 4, False, 1, False, 1, 32)]
    roomy = search(builder(config), devices=4, layers=6, cluster=Cluster(), candidates=tried)
    assert [c.fits for c in roomy] == [True] * 4
    assert [c.tokens_per_second for c in roomy] == sorted((c.tokens_per_second for c in roomy), reverse=True)
    need = sorted(c.max_bytes for c in roomy)
    tight = search(builder(config), devices=4, layers=6, cluster=Cluster(device_memory=need[1]), candidates=tried)
    assert [c.fits for c in tight] == [True, True, False, False]
    assert all(c.max_bytes <= need[1] for c in tight[:2])


def test_plan_cluster_command_line(capsys):
    _setup()
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_cluster
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    args = ["--model", "7B", "--layers", "2", "--seq", "64", "--pp", "2", "--dp", "2", "--tp", "2"]
    assert plan_cluster.main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh_shape"] == [2, 2, 2] and len(data["ranks"]) == 8 and data["problems"] == []
    assert plan_cluster.main(args) == 0
    out = capsys.readouterr().out
    assert "estimated step" in out and "tokens/s" in out and "no cross-rank problem found" in out
    assert plan_cluster.parse_bytes("64GiB") == 64 * 2 ** 30
    # three stages with the default ranks: the last one reports its activations too
    assert plan_cluster.main(["--layers", "3", "--pp", "3", "--tp", "2", "--seq", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["problems"] == [] and len(data["ranks"]) == 6
    assert all(rank["activation_bytes"] for rank in data["ranks"])


def test_a_search_on_worker_processes_gives_the_same_candidates_in_the_same_order():
    config = _setup()
    from examples.plan_llama import builder
    from hyper_parallel_ms.dryrun import Cluster, ParallelDims, search
    tried = [ParallelDims(3, 1, 2, False, 3, False, 1, 32), ParallelDims(1, 2, 2, True, 1, False, 1, 32),
             ParallelDims(3, 1, 2, False, 6, False, 1, 32)]
    seen = {1: [], 2: []}
    for workers in (1, 2):
        ranked = search(builder(config), devices=6, layers=6, cluster=Cluster(), candidates=tried, workers=workers,
                        progress=seen[workers].append)
        assert [c.dims for c in seen[workers]] == tried and all(not c.problem for c in ranked)
    assert seen[1] == seen[2]
    with pytest.raises(TypeError, match="build must pickle"):
        search(lambda dims, layers: None, devices=6, layers=6, cluster=Cluster(), candidates=tried, workers=2)
