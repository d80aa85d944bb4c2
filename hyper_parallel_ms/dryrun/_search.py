"""Search the parallel dims of a job: enumerate (pp, dp, cp, tp, fully_shard, micro-batches, activation
checkpointing) for a number of devices, dry-run each, keep those that fit in a device's memory
and rank them by the tokens per second of the alpha-beta model (:mod:`._cost`). Context parallelism
(cp > 1) is tried only for sequences long enough (:func:`context_parallel_sizes`).

Each :class:`ParallelDims` is simulated with one and two blocks per pipeline stage (the training
code is built for that many layers: ``build(dims, layers)``) on the first rank of every stage, and
every per-rank number (bytes held, activations, FLOPs, calls and bytes of each collective)
is extrapolated linearly to the model's blocks per stage: the blocks are identical, so each
one adds the same. Ranks along dp, cp and tp are taken to be equivalent to the stage's first one
(even shards); simulate the chosen dims with :func:`~hyper_parallel_ms.dryrun.simulate` to
check every rank. The pipeline runs 1F1B; a step trains ``dp * microbatches * micro_batch``
sequences, so candidates are compared by tokens per second, not by step time.

Example::

    ranked = search(lambda dims, layers: llama_training(replace(config, layers=layers), dims),
                    devices=64, layers=32, cluster=Cluster(device_memory=64 * 2**30))
    ranked[0].dims, ranked[0].tokens_per_second
"""
from __future__ import annotations

import multiprocessing
import pickle
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from .._deprecated import renamed
from ._cost import Cluster, rank_seconds
from ._report import CommStats, RankReport
from ._session import simulate
from ._stages import sample_pipelines, stage_reports

__all__ = ["ParallelDims", "Candidate", "parallel_dims_of", "context_parallel_sizes", "estimate", "search"]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel dims of a job (torchtitan's name) and its batching: ``pp * dp * cp * tp`` ranks on
    a ("pp", "dp", "tp") mesh, or ("pp", "dp", "cp", "tp") with context parallelism (``cp > 1``: each
    sequence cut over the cp ranks), fully_shard over dp (over dp x cp with context parallelism, as
    torchtitan does) or gradients averaged over it, micro-batches per step, activation checkpointing
    of every block, and the sequences of each micro-batch on a dp rank. (Named ``plan.Layout``
    before: a :class:`~hyper_parallel_ms.Layout` is a tensor's layout.)

    Args:
        pp: pipeline stages.
        dp: data-parallel ranks.
        tp: tensor-parallel ranks.
        fsdp: parameters, gradients and optimizer state sharded over dp (and cp) (fully_shard).
        microbatches: micro-batches per step (pipelined when pp > 1).
        checkpointing: activation checkpointing of every block.
        micro_batch: sequences per micro-batch on each dp rank.
        seq: tokens per sequence.
        cp: context-parallel ranks (each holds ``seq / cp`` tokens of every sequence of its dp rank).

    >>> ParallelDims(pp=8, dp=16, tp=8).ranks, ParallelDims(dp=4, microbatches=2, seq=4096).tokens
    (1024, 32768)
    >>> ParallelDims(dp=2, cp=4, tp=2).mesh
    ((1, 2, 4, 2), ('pp', 'dp', 'cp', 'tp'))
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    fsdp: bool = True
    microbatches: int = 1
    checkpointing: bool = False
    micro_batch: int = 1
    seq: int = 4096
    cp: int = 1

    @property
    def ranks(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def tokens(self) -> int:
        """Tokens trained per step."""
        return self.dp * self.microbatches * self.micro_batch * self.seq

    @property
    def mesh(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """``(mesh_shape, mesh_dim_names)``: ``(pp, dp, tp)`` and ``("pp", "dp", "tp")``; with ``cp > 1``
        ``(pp, dp, cp, tp)`` and ``("pp", "dp", "cp", "tp")`` (tp innermost, then cp, as torchtitan)."""
        if self.cp > 1:
            return (self.pp, self.dp, self.cp, self.tp), ("pp", "dp", "cp", "tp")
        return (self.pp, self.dp, self.tp), ("pp", "dp", "tp")

    def describe(self) -> str:
        cp = f"cp={self.cp} " if self.cp > 1 else ""
        return (f"pp={self.pp} dp={self.dp} {cp}tp={self.tp} {'fsdp' if self.fsdp else 'ddp '} "
                f"mb={self.microbatches} {'ac' if self.checkpointing else '--'}")


@dataclass(frozen=True)
class Candidate:
    """A :class:`ParallelDims`, priced.

    Args:
        dims: the :class:`ParallelDims`.
        max_bytes: the largest per-rank total (parameters, gradients, optimizer, activations).
        fits: whether ``max_bytes`` fits in the cluster's device memory.
        step_seconds: the model's step time (the slowest rank's).
        tokens_per_second: ``dims.tokens / step_seconds``.
        problem: why the dims failed to simulate (empty if they did not).

    >>> Candidate(ParallelDims(), 1, True, 2.0, 2048.0).fits
    True
    """

    dims: ParallelDims
    max_bytes: int
    fits: bool
    step_seconds: float
    tokens_per_second: float
    problem: str = ""

    @property
    def layout(self) -> ParallelDims:
        """Deprecated name of :attr:`dims` (warns; it goes in the next release)."""
        renamed("Candidate.layout", "Candidate.dims")
        return self.dims


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_parallel_sizes(seq: int, devices: int, min_cp_tokens: int = 4096) -> List[int]:
    """The context-parallel sizes a search tries for sequences of ``seq`` tokens on ``devices``: 1, and every
    ``cp > 1`` dividing ``devices`` that cuts the sequence into ``2 cp`` equal load-balanced chunks and leaves
    each cp rank at least ``min_cp_tokens`` tokens (shorter shards gain little memory and pay the ring's
    transfers for every block).

    Args:
        seq: tokens per sequence.
        devices: the devices (cp divides them).
        min_cp_tokens: the fewest tokens of a sequence a cp rank may hold.

    >>> context_parallel_sizes(4096, 64), context_parallel_sizes(32768, 64), context_parallel_sizes(12288, 64)
    ([1], [1, 2, 4, 8], [1, 2])
    """
    return [1] + [c for c in _divisors(devices) if c > 1 and seq % (2 * c) == 0 and seq // c >= min_cp_tokens]


def parallel_dims_of(devices: int, *, layers: int, devices_per_node: int = 8, micro_batch: int = 1,
                     seq: int = 4096, min_cp_tokens: int = 4096) -> List[ParallelDims]:
    """Every :class:`ParallelDims` of ``devices``: tp dividing the node size, cp among
    :func:`context_parallel_sizes` (only 1 unless each cp rank keeps ``min_cp_tokens`` tokens or more),
    pp dividing the blocks, fully_shard or not (dp x cp > 1), ``pp`` or ``2 pp`` micro-batches (1
    without pipeline), checkpointing or not. (Named ``plan.layouts`` before.)

    Args:
        devices: the number of devices.
        layers: the model's blocks (pp must divide them).
        devices_per_node: tp stays inside a node.
        micro_batch: sequences per micro-batch.
        seq: tokens per sequence.
        min_cp_tokens: context parallelism is tried down to this many tokens per cp rank.

    >>> len(parallel_dims_of(8, layers=4)), parallel_dims_of(8, layers=4)[0].describe()
    (46, 'pp=1 dp=8 tp=1 ddp  mb=1 --')
    >>> sorted({d.cp for d in parallel_dims_of(8, layers=4, seq=16384)})
    [1, 2, 4]
    """
    out = []
    for tp in [t for t in _divisors(devices) if t <= devices_per_node and devices_per_node % t == 0]:
        for cp in context_parallel_sizes(seq, devices // tp, min_cp_tokens):
            for pp in [p for p in _divisors(devices // (tp * cp)) if layers % p == 0]:
                dp = devices // (tp * cp * pp)
                for fsdp in ((False, True) if dp * cp > 1 else (False,)):
                    for microbatches in ((1,) if pp == 1 else (pp, 2 * pp)):
                        for checkpointing in (False, True):
                            out.append(ParallelDims(pp, dp, tp, fsdp, microbatches, checkpointing, micro_batch,
                                                    seq, cp))
    return out


def _stage_reports(build: Callable, dims: ParallelDims, blocks: int, device_type: str) -> Dict[int, RankReport]:
    """The first rank of every stage, simulated with ``blocks`` blocks per stage."""
    shape, names = dims.mesh
    firsts = [s * (dims.ranks // dims.pp) for s in range(dims.pp)]
    report = simulate(build(dims, blocks * dims.pp), mesh_shape=shape, mesh_dim_names=names, ranks=firsts,
                      device_type=device_type)
    if report.problems:
        raise RuntimeError("; ".join(str(p) for p in report.problems))
    return {r: report[r] for r in firsts}


def _line(a: float, b: float, blocks: int) -> int:
    """The value at ``blocks`` blocks on the line through (1, a) and (2, b)."""
    return int(round(a + (b - a) * (blocks - 1)))


def _extrapolated(one: RankReport, two: Optional[RankReport], blocks: int) -> RankReport:
    if two is None:
        return one
    fields = {name: _line(getattr(one, name) or 0, getattr(two, name) or 0, blocks)
              for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes", "flops")}
    comm = {}
    for key, stats in two.comm.items():
        first = one.comm.get(key, CommStats(0, 0, stats.group_size, stats.group))
        comm[key] = CommStats(_line(first.calls, stats.calls, blocks), _line(first.bytes, stats.bytes, blocks),
                              stats.group_size, stats.group)
    return replace(two, comm=comm, **fields)


def _sample_keys(dims: ParallelDims, layers: int) -> List[Tuple[ParallelDims, int]]:
    """The runs :func:`_sampled` needs for ``dims``: ``(short pipeline's dims, blocks per stage)``."""
    blocks = layers // dims.pp
    return [(replace(dims, pp=p, microbatches=m), b) for p, m in sample_pipelines(dims.pp)
            for b in ((1, 2) if blocks > 1 else (1,))]


def _sample_run(build: Callable, key: Tuple[ParallelDims, int], device_type: str):
    """The run of ``key`` (see :func:`_sample_keys`), or what it raised (the dims sharing it fail alike)."""
    try:
        return _stage_reports(build, key[0], key[1], device_type)
    except Exception as exc:  # noqa: BLE001  (kept: reported as the candidate's problem)
        return exc


def _sampled(build: Callable, dims: ParallelDims, layers: int, device_type: str, cache: Dict) -> List[RankReport]:
    """The first rank of every stage of ``dims`` from the short pipelines of :mod:`._stages`, each
    simulated with one and two blocks per stage (``cache``: runs shared by the dims that need them)."""
    blocks = layers // dims.pp
    samples = {}
    for key in _sample_keys(dims, layers):
        if key not in cache:
            cache[key] = _sample_run(build, key, device_type)
        if isinstance(cache[key], Exception):
            raise cache[key]
    for p, m in sample_pipelines(dims.pp):
        short = replace(dims, pp=p, microbatches=m)
        one = cache[short, 1]
        two = cache[short, 2] if blocks > 1 else {}
        samples[p, m] = {s: _extrapolated(one[r], two.get(r), blocks) for s, r in enumerate(sorted(one))}
    return stage_reports(samples, dims.pp, dims.microbatches, dims.mesh[0])


_WORKER: Dict[str, object] = {}


def _worker_start(build: Callable, device_type: str, target: str) -> None:
    import mindspore as ms
    if ms.get_context("device_target") != target:
        ms.set_device(target)
    _WORKER.update(build=build, device_type=device_type)


def _worker_run(key: Tuple[ParallelDims, int]):
    out = _sample_run(_WORKER["build"], key, _WORKER["device_type"])
    if isinstance(out, Exception):
        try:
            pickle.dumps(out)
        except Exception:  # noqa: BLE001  (an exception that does not pickle comes back as its text)
            out = RuntimeError(f"{type(out).__name__}: {out}")
    return key, out


def _prefilled(build: Callable, candidates: List[ParallelDims], layers: int, device_type: str, cache: Dict,
               workers: int) -> Iterator[int]:
    """Run the short pipelines of ``candidates`` on ``workers`` processes (spawned: ``build`` must
    pickle), filling ``cache``; yields the number of leading candidates whose runs are all in."""
    import mindspore as ms
    keys = list(dict.fromkeys(k for dims in candidates for k in _sample_keys(dims, layers) if k not in cache))
    needed = [set(_sample_keys(dims, layers)) for dims in candidates]
    ready = 0
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, _worker_start, (build, device_type, ms.get_context("device_target"))) as pool:
        for key, out in pool.imap(_worker_run, keys):
            cache[key] = out
            while ready < len(candidates) and needed[ready] <= cache.keys():
                ready += 1
                yield ready
    while ready < len(candidates):
        ready += 1
        yield ready


def estimate(build: Callable, dims: ParallelDims, *, layers: int, cluster: Cluster, device_type: str = "npu",
             every_stage: bool = False, cache: Optional[Dict] = None) -> Candidate:
    """Simulate ``dims`` (see the module docstring) and price it on ``cluster``.

    Args:
        build: ``build(dims, layers) -> fn(mesh)``, the training code for that many blocks.
        dims: the :class:`ParallelDims`.
        layers: the model's blocks.
        cluster: the :class:`~hyper_parallel_ms.dryrun.Cluster`.
        device_type: the simulated device.
        every_stage: simulate the first rank of every stage of ``dims`` itself (slower, the same numbers)
            instead of the short pipelines of :mod:`._stages`.
        cache: the short pipelines' runs, shared between calls (:func:`search` passes one).

    Example::

        estimate(build, ParallelDims(pp=2, dp=4, tp=8, microbatches=4), layers=32, cluster=Cluster())
    """
    from ..pipelining import build_plan
    blocks = layers // dims.pp
    try:
        if every_stage:
            one = _stage_reports(build, dims, 1, device_type)
            two = _stage_reports(build, dims, 2, device_type) if blocks > 1 else {}
            ranks = [_extrapolated(one[r], two.get(r), blocks) for r in one]
        else:
            ranks = _sampled(build, dims, layers, device_type, {} if cache is None else cache)
    except Exception as exc:  # noqa: BLE001  (dims that cannot run are reported, not fatal)
        return Candidate(dims, 0, False, float("inf"), 0.0, f"{type(exc).__name__}: {exc}")
    bubble = build_plan("1F1B", dims.pp, dims.microbatches).bubble_fraction() if dims.pp > 1 else 0.0
    seconds = max(rank_seconds(r, cluster, bubble) for r in ranks)
    peak = max(r.total_bytes for r in ranks)
    return Candidate(dims, peak, peak <= cluster.device_memory, seconds, dims.tokens / seconds)


def search(build: Callable, *, devices: int, layers: int, cluster: Cluster, micro_batch: int = 1, seq: int = 4096,
           candidates: Optional[Iterable[ParallelDims]] = None, device_type: str = "npu",
           progress: Optional[Callable[[Candidate], None]] = None, workers: int = 1,
           min_cp_tokens: int = 4096) -> List[Candidate]:
    """Every :class:`ParallelDims` of ``devices`` (or ``candidates``), estimated; those that fit
    first, fastest first.

    Dims that differ only in their micro-batches share their simulations (the short pipelines of
    :mod:`._stages`); with ``workers > 1`` the simulations run on that many processes, and each
    candidate is priced, and passed to ``progress``, in order as soon as its runs are in.

    Args:
        build: ``build(dims, layers) -> fn(mesh)`` (picklable when ``workers > 1``: a module-level
            function or class instance, as ``examples/plan_llama.py``'s ``builder`` returns).
        devices: the number of devices.
        layers: the model's blocks.
        cluster: the :class:`~hyper_parallel_ms.dryrun.Cluster` (its device memory decides what fits).
        micro_batch: sequences per micro-batch.
        seq: tokens per sequence.
        candidates: the dims to try (default: :func:`parallel_dims_of`).
        device_type: the simulated device.
        progress: called with each :class:`Candidate` as it is priced.
        workers: processes that simulate (1: this one).
        min_cp_tokens: context parallelism is among the default candidates where each cp rank keeps
            at least this many tokens of a sequence (:func:`context_parallel_sizes`).

    Example::

        best = search(build, devices=64, layers=32, cluster=Cluster(), workers=2)[0]
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"search: workers must be an int of 1 or more, got {workers!r}")
    todo = list(candidates if candidates is not None else
                parallel_dims_of(devices, layers=layers, devices_per_node=cluster.devices_per_node,
                                 micro_batch=micro_batch, seq=seq, min_cp_tokens=min_cp_tokens))
    cache: Dict = {}
    if workers > 1:
        try:
            pickle.dumps(build)
        except Exception as exc:  # noqa: BLE001  (named, with the fix)
            raise TypeError(f"search: with workers={workers} build must pickle (a module-level function or class "
                            f"instance, not a lambda or closure): {type(exc).__name__}: {exc}; or pass workers=1") \
                from None
    ready = _prefilled(build, todo, layers, device_type, cache, workers) if workers > 1 else iter(range(1, len(todo) + 1))
    tried = []
    for count in ready:
        while len(tried) < count:
            dims = todo[len(tried)]
            candidate = estimate(build, dims, layers=layers, cluster=cluster, device_type=device_type, cache=cache)
            tried.append(candidate)
            if progress is not None:
                progress(candidate)
    return sorted(tried, key=lambda c: (not c.fits, bool(c.problem), -c.tokens_per_second))
