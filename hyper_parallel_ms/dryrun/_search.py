"""Search the parallel dims of a job: enumerate (pp, dp, tp, fully_shard, micro-batches, activation
checkpointing) for a number of devices, dry-run each, keep those that fit in a device's memory
and rank them by the tokens per second of the alpha-beta model (:mod:`._cost`).

Each :class:`ParallelDims` is simulated with one and two blocks per pipeline stage (the training
code is built for that many layers: ``build(dims, layers)``) on the first rank of every stage, and
every per-rank number (bytes held, activations, FLOPs, calls and bytes of each collective)
is extrapolated linearly to the model's blocks per stage: the blocks are identical, so each
one adds the same. Ranks along dp and tp are taken to be equivalent to the stage's first one
(even shards); simulate the chosen dims with :func:`~hyper_parallel_ms.dryrun.simulate` to
check every rank. The pipeline runs 1F1B; a step trains ``dp * microbatches * micro_batch``
sequences, so candidates are compared by tokens per second, not by step time.

Example::

    ranked = search(lambda dims, layers: llama_training(replace(config, layers=layers), dims),
                    devices=64, layers=32, cluster=Cluster(device_memory=64 * 2**30))
    ranked[0].dims, ranked[0].tokens_per_second
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .._deprecated import renamed
from ._cost import Cluster, rank_seconds
from ._report import CommStats, RankReport
from ._session import simulate

__all__ = ["ParallelDims", "Candidate", "parallel_dims_of", "estimate", "search"]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel dims of a job (torchtitan's name) and its batching: ``pp * dp * tp`` ranks on a
    ("pp", "dp", "tp") mesh, fully_shard over dp or gradients averaged over it, micro-batches per
    step, activation checkpointing of every block, and the sequences of each micro-batch on a dp
    rank. (Named ``plan.Layout`` before: a :class:`~hyper_parallel_ms.Layout` is a tensor's layout.)

    Args:
        pp: pipeline stages.
        dp: data-parallel ranks.
        tp: tensor-parallel ranks.
        fsdp: parameters, gradients and optimizer state sharded over dp (fully_shard).
        microbatches: micro-batches per step (pipelined when pp > 1).
        checkpointing: activation checkpointing of every block.
        micro_batch: sequences per micro-batch on each dp rank.
        seq: tokens per sequence.

    >>> ParallelDims(pp=8, dp=16, tp=8).ranks, ParallelDims(dp=4, microbatches=2, seq=4096).tokens
    (1024, 32768)
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    fsdp: bool = True
    microbatches: int = 1
    checkpointing: bool = False
    micro_batch: int = 1
    seq: int = 4096

    @property
    def ranks(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def tokens(self) -> int:
        """Tokens trained per step."""
        return self.dp * self.microbatches * self.micro_batch * self.seq

    @property
    def mesh(self) -> Tuple[Tuple[int, int, int], Tuple[str, str, str]]:
        """``(mesh_shape, mesh_dim_names)``: ``(pp, dp, tp)`` and ``("pp", "dp", "tp")``."""
        return (self.pp, self.dp, self.tp), ("pp", "dp", "tp")

    def describe(self) -> str:
        return (f"pp={self.pp} dp={self.dp} tp={self.tp} {'fsdp' if self.fsdp else 'ddp '} "
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


def parallel_dims_of(devices: int, *, layers: int, devices_per_node: int = 8, micro_batch: int = 1,
                     seq: int = 4096) -> List[ParallelDims]:
    """Every :class:`ParallelDims` of ``devices``: tp dividing the node size, pp dividing the blocks,
    fully_shard or not (dp > 1), ``pp`` or ``2 pp`` micro-batches (1 without pipeline), checkpointing
    or not. (Named ``plan.layouts`` before.)

    Args:
        devices: the number of devices.
        layers: the model's blocks (pp must divide them).
        devices_per_node: tp stays inside a node.
        micro_batch: sequences per micro-batch.
        seq: tokens per sequence.

    >>> len(parallel_dims_of(8, layers=4)), parallel_dims_of(8, layers=4)[0].describe()
    (46, 'pp=1 dp=8 tp=1 ddp  mb=1 --')
    """
    out = []
    for tp in [t for t in _divisors(devices) if t <= devices_per_node and devices_per_node % t == 0]:
        for pp in [p for p in _divisors(devices // tp) if layers % p == 0]:
            dp = devices // (tp * pp)
            for fsdp in ((False, True) if dp > 1 else (False,)):
                for microbatches in ((1,) if pp == 1 else (pp, 2 * pp)):
                    for checkpointing in (False, True):
                        out.append(ParallelDims(pp, dp, tp, fsdp, microbatches, checkpointing, micro_batch, seq))
    return out


def _stage_reports(build: Callable, dims: ParallelDims, blocks: int, device_type: str) -> Dict[int, RankReport]:
    """The first rank of every stage, simulated with ``blocks`` blocks per stage."""
    shape, names = dims.mesh
    firsts = [s * dims.dp * dims.tp for s in range(dims.pp)]
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


def estimate(build: Callable, dims: ParallelDims, *, layers: int, cluster: Cluster,
             device_type: str = "npu") -> Candidate:
    """Simulate ``dims`` (see the module docstring) and price it on ``cluster``.

    Args:
        build: ``build(dims, layers) -> fn(mesh)``, the training code for that many blocks.
        dims: the :class:`ParallelDims`.
        layers: the model's blocks.
        cluster: the :class:`~hyper_parallel_ms.dryrun.Cluster`.
        device_type: the simulated device.

    Example::

        estimate(build, ParallelDims(pp=2, dp=4, tp=8, microbatches=4), layers=32, cluster=Cluster())
    """
    from ..pipelining import build_plan
    blocks = layers // dims.pp
    try:
        one = _stage_reports(build, dims, 1, device_type)
        two = _stage_reports(build, dims, 2, device_type) if blocks > 1 else {}
    except Exception as exc:  # noqa: BLE001  (dims that cannot run are reported, not fatal)
        return Candidate(dims, 0, False, float("inf"), 0.0, f"{type(exc).__name__}: {exc}")
    ranks = [_extrapolated(one[r], two.get(r), blocks) for r in one]
    bubble = build_plan("1F1B", dims.pp, dims.microbatches).bubble_fraction() if dims.pp > 1 else 0.0
    seconds = max(rank_seconds(r, cluster, bubble) for r in ranks)
    peak = max(r.total_bytes for r in ranks)
    return Candidate(dims, peak, peak <= cluster.device_memory, seconds, dims.tokens / seconds)


def search(build: Callable, *, devices: int, layers: int, cluster: Cluster, micro_batch: int = 1, seq: int = 4096,
           candidates: Optional[Iterable[ParallelDims]] = None, device_type: str = "npu",
           progress: Optional[Callable[[Candidate], None]] = None) -> List[Candidate]:
    """Every :class:`ParallelDims` of ``devices`` (or ``candidates``), estimated; those that fit
    first, fastest first.

    Args:
        build: ``build(dims, layers) -> fn(mesh)``.
        devices: the number of devices.
        layers: the model's blocks.
        cluster: the :class:`~hyper_parallel_ms.dryrun.Cluster` (its device memory decides what fits).
        micro_batch: sequences per micro-batch.
        seq: tokens per sequence.
        candidates: the dims to try (default: :func:`parallel_dims_of`).
        device_type: the simulated device.
        progress: called with each :class:`Candidate` as it is priced.

    Example::

        best = search(build, devices=64, layers=32, cluster=Cluster())[0]
    """
    tried = []
    for dims in (candidates if candidates is not None else
                 parallel_dims_of(devices, layers=layers, devices_per_node=cluster.devices_per_node,
                                  micro_batch=micro_batch, seq=seq)):
        candidate = estimate(build, dims, layers=layers, cluster=cluster, device_type=device_type)
        tried.append(candidate)
        if progress is not None:
            progress(candidate)
    return sorted(tried, key=lambda c: (not c.fits, bool(c.problem), -c.tokens_per_second))
