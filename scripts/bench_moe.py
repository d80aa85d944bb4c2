"""Benchmark: expert parallelism on CPU ranks, ep = 1, 2, 4, in one run.

One MoE layer (``--dim``, ``--hidden`` per expert, ``--experts`` routed experts, top-``--top-k``, no shared
expert, fp32), ``--tokens`` tokens per rank (each ep rank its own tokens: ep borrowed from data
parallelism, so the work per rank stays the same as ep grows). ep = 1 is the layer on one rank (no
token moves); ep > 1 puts ExpertParallel on its experts. PyNative.

The routing is stated, not learned (``--routing``):

- ``uniform`` (default): token ``t``'s slot ``j`` goes to expert ``(t + j * E / k) mod E``: every expert gets
  exactly ``tokens * k / E`` slots of every rank, so each rank sends ``(ep - 1) / ep`` of its ``tokens * k``
  routed rows to the other ranks, each way (the textbook figure below, exact here);
- ``random``: each token's ``k`` experts drawn uniformly without replacement (seeded per rank): the
  textbook figure is the expectation, the exact one comes from the drawn counts;
- ``router``: the layer's own router (random weights) on random tokens; the exact figure from its counts.

Printed per ep: median step time (forward + backward) over ``--rounds`` interleaved rounds of ``--steps``
steps, its ratio to ep = 1 and to the whole layer run on each of the same ep ranks with nothing moved (the
same load on the machine's cores: on a few shared cores, ep ranks slow each other down whatever they run),
and the forward alone against the same; the token exchange alone (the forward's two all_to_all_single, dispatch
and combine, with the step's split matrices on zeros, timed like a step); the all-to-all bytes rank 0 sends
in the forward as ``CommDebugMode`` records them (``bytes``: what a bandwidth-optimal all-to-all sends;
``wire``: what the issued primitives send, on CPU the composed all-reduce of the gathered buffer) against
``2 * tokens * k * (ep - 1) / ep * dim * 4`` (the uniform textbook: dispatch sends the off-rank routed rows,
combine returns as many) and against the exact rows of the routing used (rank 0's off-rank rows, plus the
rows the other ranks sent it); the counts' all-gather bytes. The backward runs the same two exchanges
transposed (the same bytes again; CommDebugMode records the calls, not their backward).

Usage: .venv/bin/python scripts/bench_moe.py [--eps 1,2,4] [--routing uniform|random|router] [--tokens 512]
       [--dim 256] [--hidden 512] [--experts 8] [--top-k 2] [--rounds 3] [--steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import numpy as np

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools


def _table(routing: str, tokens: int, experts: int, top_k: int, rank: int) -> np.ndarray:
    if routing == "uniform":
        t = np.arange(tokens)[:, None]
        return ((t + np.arange(top_k)[None, :] * (experts // top_k)) % experts).astype(np.int32)
    rng = np.random.default_rng(100 + rank)
    return np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)


def _stated_router(dim: int, experts: int, top_k: int, table: np.ndarray):
    """A router whose choice is ``table`` ``(T, k)``; its scores are the gate's softmax probabilities there."""
    import mindspore as ms
    from mindspore import ops

    from hyper_parallel_ms.moe import TokenChoiceTopKRouter

    class StatedRouter(TokenChoiceTopKRouter):
        def __init__(self) -> None:
            super().__init__(dim, experts, top_k)
            self.table = ms.Tensor(table)

        def construct(self, x, expert_bias=None):
            probs = self.probabilities(x)
            picked = (self.table.expand_dims(-1) == ops.arange(experts).astype(ms.int32)).astype(ms.float32)
            return (probs.expand_dims(1) * picked).sum(-1), self.table, picked.sum((0, 1)).astype(ms.int32)
    return StatedRouter()


def measure(routing: str, tokens: int, dim: int, hidden: int, experts: int, top_k: int, steps: int,
            expert_parallel: bool = True) -> Dict:
    """On each of ep ranks: step seconds, exchange-alone seconds, CommDebugMode bytes of one step, the counts
    (``expert_parallel=False``: every rank the whole layer on its tokens, nothing moved)."""
    import mindspore as ms
    from mindspore import communication

    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.moe import ExpertParallel, MoE
    from hyper_parallel_ms.nn import parallelize_module

    ep = communication.get_group_size()
    rank = communication.get_rank()
    np.random.seed(0)
    ms.set_seed(0)
    moe = MoE(dim, hidden, experts, top_k)
    if routing != "router":
        moe.router = _stated_router(dim, experts, top_k, _table(routing, tokens, experts, top_k, rank))
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    if ep > 1 and expert_parallel:
        parallelize_module(moe, mesh, {"experts": ExpertParallel()})
    x = ms.Tensor(np.random.default_rng(rank).standard_normal((tokens, dim)).astype(np.float32))
    params = moe.trainable_params()
    grad = ms.value_and_grad(lambda v: (moe(v) ** 2).mean(), None, params)
    grad(x)                                                                # warm up
    with comm.CommDebugMode() as debug:
        grad(x)
    counts = np.rint(moe.tokens_per_expert.asnumpy() / 2).astype(np.int64)  # two calls since the layer was built
    out: Dict = {"records": [(r.kind, r.bytes, r.wire_bytes) for r in debug.records], "counts": counts.tolist()}
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        loss, _ = grad(x)
        loss.asnumpy()
        seconds.append(time.perf_counter() - began)
    out["step"] = seconds
    forward = []
    for _ in range(steps):
        began = time.perf_counter()
        moe(x).asnumpy()
        forward.append(time.perf_counter() - began)
    out["forward"] = forward
    if ep > 1 and expert_parallel:
        local = experts // ep
        every = comm.all_gather(ms.Tensor(counts.astype(np.float32)).reshape(1, -1), mesh, "ep", dim=0).asnumpy()
        matrix = tuple(tuple(int(every[i, j * local:(j + 1) * local].sum()) for j in range(ep)) for i in range(ep))
        back = tuple(zip(*matrix))
        rows = ms.Tensor(np.zeros((tokens * top_k, dim), np.float32))
        alone = []
        for _ in range(steps):
            began = time.perf_counter()
            y = comm.all_to_all_by_matrix(rows, matrix, mesh, "ep")
            comm.all_to_all_by_matrix(y, back, mesh, "ep").asnumpy()
            alone.append(time.perf_counter() - began)
        out["exchange"] = alone
    return out


def _report(ep: int, rounds: List[List[Dict]], local_rounds: List[List[Dict]], base: float, args) -> None:
    k, dim = args.top_k, args.dim
    results = [ranks[0] for ranks in rounds]
    step = statistics.median(s for r in results for s in r["step"])
    line = f"ep={ep}: step {step * 1e3:7.1f} ms ({step / base:4.2f}x ep=1"
    if ep == 1:
        print(line + ")")
        return
    alike = statistics.median(s for ranks in local_rounds for s in ranks[0]["step"])
    line += f"; {step / alike:4.2f}x the whole layer on each of the {ep} ranks, {alike * 1e3:.1f} ms)"
    forward = statistics.median(s for r in results for s in r["forward"])
    forward_alike = statistics.median(s for ranks in local_rounds for s in ranks[0]["forward"])
    line += f"; forward {forward * 1e3:.1f} ms ({forward / forward_alike:4.2f}x)"
    exchange = statistics.median(s for r in results for s in r["exchange"])
    rec = results[0]["records"]
    a2a = [r for r in rec if r[0] == "all_to_all_single"]
    sent = sum(r[1] for r in a2a)
    wire = sum(r[2] for r in a2a)
    gather = sum(r[1] for r in rec if r[0] == "all_gather")
    textbook = 2 * args.tokens * k * (ep - 1) / ep * dim * 4
    local = args.experts // ep
    counts = np.array([r["counts"] for r in rounds[0]])                        # (ep ranks, E)
    off_rank = counts[0].sum() - counts[0, :local].sum()
    received = counts[1:, :local].sum()
    exact = (off_rank + received) * dim * 4
    print(f"{line}; exchange alone (dispatch + combine, fwd) {exchange * 1e3:6.1f} ms "
          f"(x2 with the backward's: {exchange * 2 / step:4.2f} of the step)")
    print(f"      rank 0 forward all-to-all: {len(a2a)} calls, {sent / 1e6:7.3f} MB sent "
          f"(uniform textbook {textbook / 1e6:.3f} MB: {sent / textbook:5.3f}x; exact for this routing "
          f"{exact / 1e6:.3f} MB: {sent / exact:5.3f}x), wire {wire / 1e6:7.3f} MB ({wire / textbook:5.2f}x "
          f"textbook); counts all-gather {gather} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", default="1,2,4")
    parser.add_argument("--routing", choices=["uniform", "random", "router"], default="uniform")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    eps = [int(e) for e in args.eps.split(",")]
    if 1 not in eps:
        eps = [1] + eps
    if args.experts % args.top_k or any(args.experts % e for e in eps):
        raise SystemExit(f"--experts {args.experts} must divide by --top-k and by every ep in {eps}")
    print(f"MoE layer: dim {args.dim}, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, "
          f"{args.tokens} tokens per rank, fp32, routing {args.routing}; forward + backward, PyNative, "
          f"{args.rounds} rounds x {args.steps} steps, median (rank 0)")
    gathered: Dict[int, List[Dict]] = {e: [] for e in eps}
    local: Dict[int, List[Dict]] = {e: [] for e in eps}
    try:
        for _ in range(args.rounds):
            for e in eps:
                sizes = (args.routing, args.tokens, args.dim, args.hidden, args.experts, args.top_k, args.steps)
                gathered[e].append(run_on_ranks(measure, e, *sizes, timeout=1800))
                if e > 1:
                    local[e].append(run_on_ranks(measure, e, *sizes, False, timeout=1800))
    finally:
        shutdown_pools()
    base = statistics.median(s for ranks in gathered[1] for s in ranks[0]["step"])
    for e in eps:
        _report(e, gathered[e], local[e], base, args)


if __name__ == "__main__":
    main()
