"""The planner with context parallelism (the example Llama's step inside ``context_parallel``, the ring
engine run on shapes) and expert parallelism (the MoE example's step, the token exchange shaped by a
stated routing): per-rank bytes and the collectives of a step against their textbook formulas, in this
process; and against real ranks, in one 2-rank call: the simulated records of a cp=2 step equal what
CommDebugMode records on the ranks call by call (ring all-gathers and reduce-scatters, fully_shard over
dp x cp), its held bytes equal and its activation estimate within 10% of what the ranks keep; an ep=2
MoE step simulated with the routing the real router chose records what the ranks record call by call:
the count gather, the token exchanges of the forward and their transposes in the backward, the dense
gradients' sums over ep and the expert-bias counts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hyper_parallel_ms.testing import run_on_ranks

ROOT = str(Path(__file__).resolve().parents[1])


def _setup():
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from examples.llama import LlamaConfig
    # no activation shape equals a parameter's (the real ranks' measure leaves those out)
    return LlamaConfig(vocab=96, dim=48, layers=2, heads=4, kv_heads=2, hidden=128, max_seq=64, attention="flash")


def _moe_config():
    from examples.moe import MoEConfig
    return MoEConfig(vocab=64, dim=32, layers=1, heads=4, moe_hidden=32, experts=4, max_seq=16)


def _record(rec) -> tuple:
    return rec.kind, rec.mesh_dim, tuple(rec.group), tuple(rec.shape), rec.dtype, rec.bytes


def _simulated(dims, rotate="allgather", device_type="npu", config=None, method="ring", ulysses_degree=None):
    from examples.plan_llama import llama_training
    from hyper_parallel_ms import simulate
    shape, names = dims.mesh
    report = simulate(llama_training(config or _setup(), dims, rotate=rotate, method=method,
                                     ulysses_degree=ulysses_degree), mesh_shape=shape,
                      mesh_dim_names=names, device_type=device_type)
    assert report.ok, report.table()
    return report


def test_context_parallel_bytes_per_rank_equal_the_ring_textbook():
    """Per block, the ring moves this rank's key / value shard (k and v side by side, [b, kv_heads / tp,
    seq / cp, 2 head_dim]): "allgather" sends (cp - 1) shards in the forward's all-gather and again in the
    backward's, and reduce-scatters the float32 gradients of the whole gathered keys and values ((cp - 1) /
    cp of them); "alltoall" sends one shard per ring step forward and backward, and the float32 gradients
    one step each and once more home. Parameters are replicated over cp, or fully_shard-ed over dp x cp."""
    config = _setup()
    from hyper_parallel_ms.dryrun import ParallelDims
    head_dim, layers, b = config.dim // config.heads, config.layers, 1
    for cp, tp, seq in ((2, 2, 64), (4, 1, 64)):
        shard = b * (config.key_heads // tp) * (seq // cp) * 2 * head_dim       # elements of a k|v shard
        dims = ParallelDims(dp=1, cp=cp, tp=tp, seq=seq, fsdp=False)
        rank = _simulated(dims)[0]
        gather, scatter = rank.comm["all_gather", "cp"], rank.comm["reduce_scatter", "cp"]
        assert (gather.calls, gather.bytes) == (2 * layers, 2 * layers * (cp - 1) * shard * 4), (cp, tp)
        assert (scatter.calls, scatter.bytes) == (layers, layers * (cp - 1) * shard * 4), (cp, tp)
        alone = _simulated(ParallelDims(dp=1, tp=tp, seq=seq, fsdp=False), config=config)[0]
        assert rank.param_bytes == alone.param_bytes and rank.optimizer_bytes == alone.optimizer_bytes
        ring = _simulated(dims, rotate="alltoall")[0]
        sends = ring.comm["send", "cp"]
        assert sends.bytes == layers * (2 * (cp - 1) * shard * 4 + cp * shard * 4), (cp, tp)
        assert ("all_gather", "cp") not in ring.comm
    # fully_shard over dp x cp: each of the 4 data ranks holds a quarter of every parameter (the sizes divide)
    sharded = _simulated(ParallelDims(dp=2, cp=2, tp=1, seq=64, fsdp=True))[0]
    whole = _simulated(ParallelDims(dp=1, tp=1, seq=64, fsdp=False))[0]
    assert 4 * sharded.param_bytes == whole.param_bytes and 4 * sharded.optimizer_bytes == whole.optimizer_bytes
    assert sharded.comm["reduce_scatter", "dp_cp"].group_size == 4


def test_ulysses_and_hybrid_bytes_per_rank_equal_the_textbook():
    """Ulysses (``--cp-method ulysses``) sends (cp - 1) / cp of this rank's q, k, v and attention output
    shards ([b, heads / tp, seq / cp, head_dim] each; k and v with their kv_heads / tp heads, repeated to
    one per query head when they do not divide by cp) in the forward's all-to-alls, and as much again in
    the backward's inverse ones; a tp rank's query heads that cp does not divide are refused naming
    --cp-method."""
    config = _setup()
    from hyper_parallel_ms.dryrun import ParallelDims
    head_dim, layers, b = config.dim // config.heads, config.layers, 1
    for cp, tp, seq in ((2, 1, 64), (2, 2, 64), (4, 1, 64)):     # kv heads per tp rank: 2 (moved), 1 and 2 (repeated)
        rank = _simulated(ParallelDims(dp=1, cp=cp, tp=tp, seq=seq, fsdp=False), method="ulysses")[0]
        q = b * (config.heads // tp) * (seq // cp) * head_dim                  # elements of a q (or output) shard
        kv_heads = config.key_heads // tp if (config.key_heads // tp) % cp == 0 else config.heads // tp
        kv = b * kv_heads * (seq // cp) * head_dim
        moved = rank.comm["all_to_all", "cp"]
        assert moved.calls == 8 * layers, (cp, tp)
        assert moved.bytes == 2 * layers * (2 * q + 2 * kv) * (cp - 1) // cp * 4, (cp, tp)
    # hybrid over cp=4, Ulysses over 2: the all-to-alls as Ulysses over 2 ranks, the ring over 2 members
    # carrying each Ulysses group's twice-longer key / value shard of half the heads
    rank = _simulated(ParallelDims(dp=1, cp=4, tp=1, seq=64, fsdp=False), method="hybrid", ulysses_degree=2)[0]
    q = b * config.heads * (64 // 4) * head_dim
    kv = b * config.key_heads * (64 // 4) * head_dim
    assert rank.comm["all_to_all", "ulysses"].bytes == 2 * layers * (2 * q + 2 * kv) // 2 * 4
    shard = b * (config.key_heads // 2) * (64 // 2) * 2 * head_dim
    assert rank.comm["all_gather", "ring"].bytes == 2 * layers * shard * 4
    assert rank.comm["reduce_scatter", "ring"].bytes == layers * shard * 4
    sys.path.insert(0, str(Path(ROOT) / "scripts"))
    try:
        import plan_cluster
    finally:
        sys.path.remove(str(Path(ROOT) / "scripts"))
    from types import SimpleNamespace
    assert "--ulysses-degree" in plan_cluster.dims_problem(SimpleNamespace(heads=64, key_heads=8, layers=2), pp=1,
                                                           tp=8, seq=4096, cp=4, cp_method="hybrid", ulysses_degree=3)
    with pytest.raises(SystemExit):
        plan_cluster.parse_args(["--cp", "4", "--ulysses-degree", "2"])
    problem = plan_cluster.dims_problem(SimpleNamespace(heads=64, key_heads=8, layers=2), pp=1, tp=8, seq=4096, cp=16,
                                        cp_method="ulysses")
    assert problem.startswith("argument --cp: Ulysses") and "--cp-method ring" in problem, problem
    assert plan_cluster.dims_problem(SimpleNamespace(heads=64, key_heads=8, layers=2), pp=1, tp=8, seq=4096, cp=4,
                                     cp_method="ulysses") == ""


def test_context_parallel_activations_depend_on_the_local_shard_only():
    """What a rank keeps depends on its seq / cp tokens: cp=2 at seq 64 keeps exactly what cp=4 keeps at
    seq 128 (the ring keeps the local query / key / value shards, the output and the log-sum-exp, never
    the gathered keys), and well under half of what one rank keeps for the whole sequence."""
    from hyper_parallel_ms.dryrun import ParallelDims
    two = _simulated(ParallelDims(dp=1, cp=2, tp=1, seq=64, fsdp=False))[0].activation_bytes
    four = _simulated(ParallelDims(dp=1, cp=4, tp=1, seq=128, fsdp=False))[0].activation_bytes
    one = _simulated(ParallelDims(dp=1, tp=1, seq=64, fsdp=False), device_type="cpu")[0].activation_bytes
    assert two == four and 0 < two < one / 2, (two, four, one)


def test_search_tries_context_parallelism_for_long_sequences_only():
    from hyper_parallel_ms.dryrun import context_parallel_sizes, parallel_dims_of
    assert context_parallel_sizes(4096, 64) == [1]
    assert context_parallel_sizes(32768, 64) == [1, 2, 4, 8]
    assert context_parallel_sizes(32768, 64, min_cp_tokens=2048) == [1, 2, 4, 8, 16]
    assert context_parallel_sizes(12006, 12, min_cp_tokens=1000) == [1, 3]     # 2 cp must divide the sequence
    short = parallel_dims_of(16, layers=4, seq=4096)
    long = parallel_dims_of(16, layers=4, seq=16384)
    assert {d.cp for d in short} == {1} and {d.cp for d in long} == {1, 2, 4}
    assert all(d.ranks == 16 and d.seq % (2 * d.cp) == 0 for d in long)
    assert len([d for d in long if d.cp == 1]) == len(short)
    assert all(d.fsdp is False for d in long if d.dp * d.cp == 1)


def test_the_search_prices_a_cp_candidate_as_its_full_simulation():
    """The search's fast path (short pipelines, one and two blocks per stage) on a (pp, dp, cp, tp) mesh
    gives the numbers of simulating the candidate's own stages."""
    from dataclasses import replace
    from examples.plan_llama import builder
    from hyper_parallel_ms.dryrun import Cluster, ParallelDims, estimate
    config = replace(_setup(), layers=4)
    dims = ParallelDims(pp=2, dp=1, cp=2, tp=2, fsdp=True, microbatches=2, seq=64)
    fast = estimate(builder(config), dims, layers=4, cluster=Cluster())
    full = estimate(builder(config), dims, layers=4, cluster=Cluster(), every_stage=True)
    assert not fast.problem and fast.max_bytes == full.max_bytes, (fast, full)
    assert fast.step_seconds == pytest.approx(full.step_seconds, rel=1e-12)      # summed in another order


def test_plan_cluster_cp_flags():
    """``--cp`` takes the mesh (pp, dp, cp, tp); a sequence the cp ranks cannot cut, or a share tp cannot
    split, is refused naming --seq; the written-out attention with --cp is refused naming --attention."""
    from types import SimpleNamespace
    _setup()
    sys.path.insert(0, str(Path(ROOT) / "scripts"))
    try:
        import plan_cluster
    finally:
        sys.path.remove(str(Path(ROOT) / "scripts"))
    from examples.plan_llama import DTYPES, PRESETS
    args = plan_cluster.parse_args(["--cp", "4", "--tp", "2", "--ranks", "0,7"])
    assert (args.cp, args.ranks, args.rotate) == (4, [0, 7], "allgather")
    with pytest.raises(SystemExit):
        plan_cluster.parse_args(["--cp", "2", "--tp", "2", "--ranks", "4"])
    with pytest.raises(SystemExit):
        plan_cluster.parse_args(["--search", "--devices", "8", "--cp", "2"])
    with pytest.raises(SystemExit):
        plan_cluster.parse_args(["--min-cp-tokens", "1024"])
    config = SimpleNamespace(heads=32, key_heads=32, layers=2)
    assert "2 x --cp = 8 equal chunks" in plan_cluster.dims_problem(config, pp=1, tp=1, seq=4100, cp=4)
    problem = plan_cluster.dims_problem(config, pp=1, tp=8, seq=4112, cp=4)
    assert problem.startswith("argument --seq: each of the --cp 4 ranks holds 1028 tokens") and "multiple of 32" in problem
    assert plan_cluster.dims_problem(config, pp=1, tp=8, seq=4096, cp=4) == ""
    shape, problem = plan_cluster.model_config(plan_cluster.parse_args(["--cp", "2", "--attention", "math"]),
                                               PRESETS, DTYPES)
    assert shape is None and problem.startswith("argument --attention: with --cp")


def test_expert_parallel_step_bytes_follow_the_stated_routing():
    """The MoE example's step on shapes: each rank holds E / ep experts (over ep x tp with ETP); per MoE
    layer it all-gathers the E counts once and sends four token exchanges (dispatch and combine, forward
    and backward); under uniform routing each carries (ep - 1) / ep of the T k routed rows. With every
    token routed to rank 0's experts, rank 0 sends nothing in the dispatch and T k rows in the combine."""
    _setup()
    from examples.plan_moe import expert_bytes, moe_training, uniform_all_to_all_bytes
    from hyper_parallel_ms import simulate
    from examples.moe import MoEConfig
    config = MoEConfig(vocab=64, dim=32, layers=2, heads=4, moe_hidden=32, experts=8, max_seq=16)
    build = moe_training(config, micro_batch=2, seq=16)
    tokens, row = 32, config.dim * 4
    alone = simulate(build, mesh_shape=(1, 1), mesh_dim_names=("ep", "tp"))[0]
    for ep, tp in ((2, 1), (4, 1), (2, 2)):
        report = simulate(build, mesh_shape=(ep, tp), mesh_dim_names=("ep", "tp"))
        assert report.ok, report.table()
        rank = report[0]
        a2a, counts = rank.comm["all_to_all_single", "ep"], rank.comm["all_gather", "ep"]
        assert (a2a.calls, a2a.bytes) == (4 * config.layers, uniform_all_to_all_bytes(
            layers=config.layers, tokens=tokens, top_k=config.top_k, dim=config.dim, ep=ep)), (ep, tp)
        assert (counts.calls, counts.bytes) == (config.layers, config.layers * (ep - 1) * config.experts * 4)
        if tp == 1:                                        # only the routed experts are cut over ep
            assert alone.param_bytes - rank.param_bytes == expert_bytes(config, ep=1, tp=1) - expert_bytes(
                config, ep=ep, tp=1), (ep, tp)
    skewed = [1.0] * 4 + [0.0] * 4                          # every token to experts 0-3: rank 0's of ep=2
    report = simulate(build, mesh_shape=(2, 1), mesh_dim_names=("ep", "tp"), ranks=[0, 1], routing=skewed)
    sent = {r: report[r].comm["all_to_all_single", "ep"].bytes for r in (0, 1)}
    routed = tokens * config.top_k * row
    assert sent == {0: 2 * config.layers * routed, 1: 2 * config.layers * routed}, sent
    assert report[0].activation_bytes > report[1].activation_bytes        # rank 0 computes every routed row
    wrong = simulate(build, mesh_shape=(2, 1), mesh_dim_names=("ep", "tp"), routing=[1.0, 1.0])
    assert not wrong.ok and "do not fit 8 experts over 2 expert-parallel ranks" in wrong.problems[0].message
    with pytest.raises(ValueError, match="non-negative"):
        simulate(build, mesh_shape=(2, 1), mesh_dim_names=("ep", "tp"), routing=[-1.0] + [1.0] * 7)


# ---------------------------------------------------------------------------------------------- real ranks
def real_rank(_):
    """One real rank of 2: a cp=2 step of the example Llama (records, held bytes, kept activations) and an
    ep=2 step of the one-layer MoE example (records, every rank's routed counts)."""
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from hyper_parallel_ms._mindspore import tensor_address
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.dryrun import ParallelDims
    from hyper_parallel_ms.dryrun._memory import memory_of
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.moe import _dispatch
    from examples.plan_llama import llama_training
    from examples.plan_moe import moe_training
    config = _setup()
    dims = ParallelDims(dp=1, cp=2, tp=1, seq=64, fsdp=True, micro_batch=2)
    shape, names = dims.mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ms.set_seed(0)
    model, optimizer, step = llama_training(config, dims)(mesh)
    excluded = set()
    for p in model.get_parameters():       # what parameters become (pieces, gathered values, transposes)
        s = tuple(p.shape)
        excluded.update({s, s[::-1], (s[0] * 2,) + s[1:], ((s[0] * 2,) + s[1:])[::-1]})
    kept, hooks = {}, ms.saved_tensors_hooks

    def composed(pack, unpack):            # fully_shard's own hooks count too (each storage once)
        def packed(t):
            handle = pack(t)
            if handle is not None and isinstance(t, Tensor) and not isinstance(t, Parameter) \
                    and tuple(t.shape) not in excluded:
                kept.setdefault((tensor_address(t), tuple(t.shape), t.dtype), t.nbytes)
            return handle
        return hooks(packed, unpack)
    ms.saved_tensors_hooks = composed
    try:
        with CommDebugMode() as mode, composed(lambda t: t, lambda t: t):
            step()
    finally:
        ms.saved_tensors_hooks = hooks
    state = {"peak": sum(kept.values())}      # one forward: everything kept is held until its backward
    held = memory_of(model, optimizer)
    out = {"cp_records": [_record(r) for r in mode.records], "cp_activations": state["peak"],
           "cp_held": (held.param_bytes, held.grad_bytes, held.optimizer_bytes)}
    ms.set_seed(0)
    _, _, ulysses_step = llama_training(config, dims, method="ulysses")(mesh)
    with CommDebugMode() as mode:
        ulysses_step()
    out["ulysses_records"] = [_record(r) for r in mode.records]
    ep_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "tp"))
    ms.set_seed(0)
    _, _, moe_step = moe_training(_moe_config(), micro_batch=2, seq=16)(ep_mesh)
    seen, gathered = [], _dispatch.TokenDispatcher.gathered_counts

    def spied(self, counts):
        every = gathered(self, counts)
        seen.append(every.tolist())
        return every
    _dispatch.TokenDispatcher.gathered_counts = spied
    try:
        with CommDebugMode() as mode:
            moe_step()
    finally:
        _dispatch.TokenDispatcher.gathered_counts = gathered
    out["ep_records"] = [_record(r) for r in mode.records]
    out["ep_counts"] = seen[0]
    return out


def test_simulated_cp_and_ep_steps_equal_real_two_rank_runs():
    from hyper_parallel_ms.dryrun import ParallelDims, _session
    from examples.plan_llama import llama_training
    from examples.plan_moe import moe_training
    config = _setup()
    real = run_on_ranks(real_rank, 2, None, timeout=600)
    dims = ParallelDims(dp=1, cp=2, tp=1, seq=64, fsdp=True, micro_batch=2)
    shape, names = dims.mesh
    sim = _session._Simulation(llama_training(config, dims), shape, names, "cpu")
    for r in range(2):
        outcome = sim.outcome(r)
        got = [_record(x) for x in outcome.step_records]
        assert got == real[r]["cp_records"], r
        assert sum(x[0] in ("all_gather", "reduce_scatter") and x[1] == "cp" for x in got) == 3 * config.layers
        held = outcome.held
        assert (held.param_bytes, held.grad_bytes, held.optimizer_bytes) == real[r]["cp_held"]
        want = real[r]["cp_activations"]
        assert want > 0 and abs(outcome.activation - want) <= 0.1 * want, (r, outcome.activation, want)
    sim = _session._Simulation(llama_training(config, dims, method="ulysses"), shape, names, "cpu")
    for r in range(2):                  # Ulysses: the forward's all-to-alls and their inverses in the backward
        got = [_record(x) for x in sim.outcome(r).step_records]
        assert got == real[r]["ulysses_records"], r
        assert sum(x[0] == "all_to_all" for x in got) == 8 * config.layers, got
    assert real[0]["ep_counts"] == real[1]["ep_counts"]
    counts = real[0]["ep_counts"]                         # (ep, E): what each rank's router sent each expert
    sim = _session._Simulation(moe_training(_moe_config(), micro_batch=2, seq=16), (2, 1), ("ep", "tp"), "cpu",
                               routing=counts)
    for r in range(2):
        got = [_record(x) for x in sim.outcome(r).step_records]
        assert got == real[r]["ep_records"], r
        a2a = [x for x in got if x[0] == "all_to_all_single"]
        assert len(a2a) == 4, got                          # dispatch, combine; then their transposes backward
        assert sorted(x[5] for x in a2a[2:]) == sorted(x[5] for x in a2a[:2]), a2a
