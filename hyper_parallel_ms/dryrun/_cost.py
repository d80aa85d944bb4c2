"""An alpha-beta model of a training step's time on an Ascend cluster, from a simulated rank's report.

Per rank: compute time is the step's matmul FLOPs (:attr:`RankReport.flops`, counted by the
simulation: forward, backward, recomputation) over ``device_flops * efficiency``, stretched by
the pipeline's bubble (``1 / (1 - bubble)``, the idle share of the schedule's unit-time
timeline, :meth:`~hyper_parallel_ms.pipelining.PipelinePlan.bubble_fraction`). Communication
time is, for each collective kind and mesh dim, ``calls * steps * alpha + bytes / bandwidth``:
``bytes`` the textbook bytes the rank sends (what ``CommDebugMode`` records), ``steps`` those of
a ring (``n - 1``; all-reduce ``2 (n - 1)``; a send 1), and ``alpha`` / ``bandwidth`` the
intra-node link's when every rank of the group is on one node (``devices_per_node``
consecutive ranks), else the inter-node link's. The project's collectives are synchronous, so
the step time is compute plus communication (no overlap); a job's step time is its
slowest rank's.

Default figures are public ones for Atlas 800T A2 servers (eight Ascend 910B per node): HCCS
392 GB/s per NPU both directions (196e9 B/s one way), one 200 Gb/s RoCE port per NPU between
nodes (25e9 B/s), 313 TFLOPS fp16 dense per NPU, 64 GB HBM; latencies of a few microseconds.
They are parameters: measure your own cluster and pass them.

Example::

    cluster = Cluster(device_memory=64 * 2**30)
    seconds = step_seconds(report, cluster, bubble=0.2)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ._report import CommStats, RankReport, SimulationReport

__all__ = ["Cluster", "collective_seconds", "rank_seconds", "step_seconds"]


@dataclass(frozen=True)
class Cluster:
    """The devices and links the cost model prices.

    Args:
        devices_per_node: devices sharing the intra-node links (consecutive global ranks).
        intra_bandwidth: bytes per second one device sends inside a node.
        inter_bandwidth: bytes per second one device sends to other nodes.
        intra_latency: seconds per ring step inside a node (alpha).
        inter_latency: seconds per ring step across nodes.
        device_flops: peak FLOPS of one device.
        efficiency: the share of ``device_flops`` a step achieves (model FLOPs utilisation).
        device_memory: bytes of one device's memory.

    >>> Cluster().inter_bandwidth
    25000000000.0
    """

    devices_per_node: int = 8
    intra_bandwidth: float = 196e9
    inter_bandwidth: float = 25e9
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    device_flops: float = 313e12
    efficiency: float = 0.4
    device_memory: int = 64 * 2 ** 30

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` live on more than one node."""
        return len({r // self.devices_per_node for r in ranks}) > 1


def _ring_steps(kind: str, n: int) -> int:
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "send":
        return 1
    if kind == "recv":
        return 0
    return n - 1


def collective_seconds(kind: str, stats: CommStats, cluster: Cluster) -> float:
    """Seconds the calls of ``stats`` (one kind over one mesh dim) take on ``cluster``.

    Args:
        kind: the collective kind.
        stats: the calls, their bytes, their group.
        cluster: the :class:`Cluster`.

    >>> round(collective_seconds("all_gather", CommStats(1, 7 * 2**20, 8, tuple(range(8))), Cluster()), 6)
    7.2e-05
    """
    inter = cluster.spans_nodes(stats.group) if stats.group else False
    alpha = cluster.inter_latency if inter else cluster.intra_latency
    bandwidth = cluster.inter_bandwidth if inter else cluster.intra_bandwidth
    return stats.calls * _ring_steps(kind, stats.group_size) * alpha + stats.bytes / bandwidth


def rank_seconds(rank: RankReport, cluster: Cluster, bubble: float = 0.0) -> float:
    """One rank's step time: compute stretched by the pipeline bubble, plus communication.

    Args:
        rank: the rank's report (with a step: ``flops`` and ``comm``).
        cluster: the :class:`Cluster`.
        bubble: the idle share of the pipeline schedule (0 without pipeline).

    >>> rank_seconds(RankReport(0, (0,), 0, 0, 0, flops=int(313e12)), Cluster(efficiency=1.0))
    1.0
    """
    if rank.flops is None:
        raise ValueError(f"rank {rank.rank} has no step: simulate a (model, optimizer, step) to price it")
    compute = rank.flops / (cluster.device_flops * cluster.efficiency) / (1.0 - bubble)
    return compute + sum(collective_seconds(kind, stats, cluster) for (kind, _), stats in rank.comm.items())


def step_seconds(report: SimulationReport, cluster: Cluster, bubble: float = 0.0) -> float:
    """The step time of a simulated job: its slowest rank's (:func:`rank_seconds`).

    Args:
        report: the :class:`SimulationReport`.
        cluster: the :class:`Cluster`.
        bubble: the idle share of the pipeline schedule.

    Example::

        step_seconds(report, Cluster(), bubble=build_plan("1F1B", pp, n).bubble_fraction())
    """
    return max(rank_seconds(r, cluster, bubble) for r in report)
