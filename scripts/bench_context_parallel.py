"""Benchmark: context parallelism on CPU ranks, cp = 1, 2 (4 with ``--cp 1,2,4``), in one run.

One causal attention call, ``scaled_dot_product_attention(q, k, v, is_causal=True)``, q, k, v of shape
``[--batch, --heads, S, --head-dim]`` fp32 for each sequence length ``S`` of ``--seqs`` (1k, 2k, 4k by
default; 8k with ``--seqs 1024,2048,4096,8192``), forward + backward (``ms.grad`` over q, k and v of the
output's sum), PyNative. Every rank draws the whole q, k, v (one seed); ``context_parallel(mesh["cp"],
buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])`` cuts them (load-balanced) and the step runs inside it.

Variants: at cp = 1, ``plain`` (the call outside any context: one device's attention from its
definition, which keeps the S x S probabilities) and ``engine`` (inside ``context_parallel`` on a
one-rank mesh: the blockwise engine, which keeps only q, k, v, the output and its log-sum-exp); at
cp > 1, ``ring/allgather``, ``ring/alltoall`` (``set_rotate_method``) and ``ulysses``.

Printed per (S, cp, variant), rank 0:

- ``kept``: the bytes autodiff keeps for the backward of the attention call: every tensor MindSpore's
  saved-tensor hooks (``mindspore.saved_tensors_hooks``) receive while the call runs, each storage
  (``data_ptr``) once (the accounting of ``tests/_gpt_layer.py``); the engine is a custom-bprop Cell, whose
  inputs and outputs MindSpore keeps. Against ``plain`` at cp = 1.
- ``step``: the median forward + backward time over ``--rounds`` x ``--steps`` steps (after one warm-up),
  and its ratios to ``plain`` and to ``engine`` at cp = 1 (the same blockwise algorithm on one rank). The cp ranks are processes sharing the machine's cores: on 2
  cores, cp = 2 runs two halves at once on the same two cores (and cp = 4 four quarters), so the ratio
  says how much of the work is left per rank plus what the moves cost, not a cluster's speed-up.
- ``moved``: the bytes rank 0 sends in one step as ``hyper_parallel_ms.comm.CommDebugMode`` records them
  (``bytes``: what a bandwidth-optimal implementation of each issued collective sends), forward and
  backward together (the engine's backward calls its collectives in Python), against the textbook:
  ``kv = 2 * B * H * S / cp * D * 4`` (this rank's keys and values);
  ring, all-gather: ``(cp - 1) * kv`` in the forward ((cp - 1) / cp of K and V), again in the backward,
  and as much of their gradients reduce-scattered: ``3 (cp - 1) kv``;
  ring, point-to-point: ``(cp - 1) * kv`` each pass, and the gradients' ``cp`` shifts (the last one home):
  ``(3 cp - 2) kv``;
  Ulysses: ``(cp - 1) / cp`` of q, k, v and the output each way, forward and backward: ``2 * 2 kv (cp - 1) / cp``
  (q and out are as large as k and v here).
  ``wire`` is what the issued primitives send (on CPU every collective is composed from all-reduce).

Usage: .venv/bin/python scripts/bench_context_parallel.py [--seqs 1024,2048,4096] [--cp 1,2] [--batch 1]
       [--heads 4] [--head-dim 32] [--rounds 2] [--steps 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Tuple

import numpy as np

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools


def _variants(cp: int) -> List[Tuple[str, str, str]]:
    """(name, method, rotate method) of a world of ``cp`` ranks."""
    if cp == 1:
        return [("plain", "", ""), ("engine", "ring", "allgather")]
    return [("ring/allgather", "ring", "allgather"), ("ring/alltoall", "ring", "alltoall"),
            ("ulysses", "ulysses", "allgather")]


def measure(seqs: List[int], batch: int, heads: int, head_dim: int, steps: int, accounting: bool = True) -> Dict:
    """On each of cp ranks, every (sequence length, variant): step seconds and (``accounting``) the kept
    bytes, the listing of what is kept, CommDebugMode records of one step and of one forward."""
    import contextlib

    import mindspore as ms
    from mindspore import communication

    from hyper_parallel_ms import comm
    from hyper_parallel_ms import nn as hnn
    from hyper_parallel_ms.mesh import DeviceMesh
    from hyper_parallel_ms.nn.functional import scaled_dot_product_attention as sdpa

    cp = communication.get_group_size()
    mesh = DeviceMesh("cpu", list(range(cp)), mesh_dim_names=("cp",))
    out: Dict = {}
    for seq in seqs:
        rng = np.random.default_rng(seq)
        whole = [rng.standard_normal((batch, heads, seq, head_dim)).astype(np.float32) for _ in range(3)]
        for name, method, rotate in _variants(cp):
            kept: list = []
            recording = [False]

            def pack(t):
                if recording[0]:
                    kept.append(t)
                return t

            def attention(q, k, v):
                recording[0] = True
                try:
                    o = sdpa(q, k, v, is_causal=True)
                finally:
                    recording[0] = False
                return o.sum()

            grad = ms.grad(attention, grad_position=(0, 1, 2))
            q, k, v = (ms.Tensor(a) for a in whole)
            if method:
                hnn.set_rotate_method(rotate)
                context = hnn.context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], method=method)
            else:
                context = contextlib.nullcontext()
            with context:
                for g in grad(q, k, v):                                   # warm up
                    g.asnumpy()
                if accounting:
                    with ms.saved_tensors_hooks(pack, lambda t: t):
                        for g in grad(q, k, v):
                            g.asnumpy()
                # storages and shapes read inside the context: leaving it gives q, k, v their whole values back
                seen: Dict[int, int] = {}
                listing = []
                for t in kept:
                    if t.data_ptr() not in seen:
                        seen[t.data_ptr()] = t.nbytes
                        listing.append((tuple(t.shape), str(t.dtype), t.nbytes))
                local = tuple(q.shape)
                kept.clear()
                with comm.CommDebugMode() as debug:
                    if accounting:
                        for g in grad(q, k, v):
                            g.asnumpy()
                with comm.CommDebugMode() as forward:
                    if accounting:
                        sdpa(q, k, v, is_causal=True).asnumpy()
                seconds = []
                for _ in range(steps):
                    began = time.perf_counter()
                    for g in grad(q, k, v):
                        g.asnumpy()
                    seconds.append(time.perf_counter() - began)
            out[(seq, name)] = {"kept": sum(seen.values()), "listing": listing, "step": seconds, "local": local,
                                "records": [(r.kind, r.bytes, r.wire_bytes) for r in debug.records],
                                "forward": [(r.kind, r.bytes, r.wire_bytes) for r in forward.records]}
        hnn.set_rotate_method("allgather")
    return out


def _textbook(name: str, cp: int, kv: float) -> Tuple[float, float]:
    """(forward, backward) bytes a rank sends, ``kv`` its keys' and values' bytes (see the docstring)."""
    if name == "ring/allgather":
        return (cp - 1) * kv, 2 * (cp - 1) * kv
    if name == "ring/alltoall":
        return (cp - 1) * kv, (2 * cp - 1) * kv
    if name == "ulysses":
        return 2 * kv * (cp - 1) / cp, 2 * kv * (cp - 1) / cp
    return 0.0, 0.0


def _ratio(moved: float, book: float) -> str:
    return f"{moved / book:6.3f}" if book else f"{'-':>6}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--cp", default="1,2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--listing", action="store_true", help="print what each variant keeps (rank 0)")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    cps = sorted({1, *(int(c) for c in args.cp.split(","))})
    for c in cps:
        if args.heads % c or any(s % (2 * c) for s in seqs):
            raise SystemExit(f"--heads {args.heads} must divide by every cp in {cps} (Ulysses) and every sequence "
                             f"length by 2 * cp (load balancing)")
    print(f"causal attention, batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, fp32; "
          f"forward + backward, PyNative, {args.rounds} rounds x {args.steps} steps, median (rank 0)")
    results: Dict[int, List[Dict]] = {c: [] for c in cps}
    began = time.perf_counter()
    try:
        for i in range(args.rounds):                      # the accounting once: it is the same every round
            for c in cps:
                results[c].append(run_on_ranks(measure, c, seqs, args.batch, args.heads, args.head_dim, args.steps,
                                               i == 0, timeout=1800)[0])
    finally:
        shutdown_pools()
    print(f"{'S':>5} {'cp':>2} {'variant':<15}{'kept MB':>8}{'vs cp=1':>8}{'step ms':>9}{'vs cp=1':>8}{'engine':>7}"
          f"{'fwd MB':>8}{'book':>7}{'ratio':>6}{'bwd MB':>8}{'book':>7}{'ratio':>6}{'wire MB':>8}  collectives (step)")
    for seq in seqs:
        base = results[1][0][(seq, "plain")]
        base_step = statistics.median(s for r in results[1] for s in r[(seq, "plain")]["step"])
        engine_step = statistics.median(s for r in results[1] for s in r[(seq, "engine")]["step"])
        for c in cps:
            for name, _, _ in _variants(c):
                res = results[c][0][(seq, name)]
                step = statistics.median(s for r in results[c] for s in r[(seq, name)]["step"])
                b, h, s_local, d = res["local"]
                kv = 2 * b * h * s_local * d * 4
                total = sum(r[1] for r in res["records"])
                fwd = sum(r[1] for r in res["forward"])
                wire = sum(r[2] for r in res["records"])
                counts: Dict[str, int] = {}
                for r in res["records"]:
                    counts[r[0]] = counts.get(r[0], 0) + 1
                book_f, book_b = _textbook(name, c, kv)
                print(f"{seq:>5} {c:>2} {name:<15}{res['kept'] / 1e6:>8.2f}{res['kept'] / base['kept']:>8.3f}"
                      f"{step * 1e3:>9.1f}{step / base_step:>8.2f}{step / engine_step:>7.2f}"
                      f"{fwd / 1e6:>8.3f}{book_f / 1e6:>7.3f}{_ratio(fwd, book_f)}"
                      f"{(total - fwd) / 1e6:>8.3f}{book_b / 1e6:>7.3f}{_ratio(total - fwd, book_b)}"
                      f"{wire / 1e6:>8.3f}  {', '.join(f'{k} x{n}' for k, n in sorted(counts.items()))}")
                if args.listing:
                    for shape, dtype, nbytes in res["listing"]:
                        print(f"{'':>24}kept {shape} {dtype} {nbytes / 1e6:.3f} MB")
    print(f"wall {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
