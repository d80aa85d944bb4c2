"""Dry runs of a cluster job in one process: simulate the ranks of a cluster without values.

:func:`simulate` runs a training script's own ``fn(mesh)`` as ranks of a simulated cluster
(meshes built with ``init_device_mesh(..., simulate=(world_size, rank))``): parameters get no
values, a step propagates shapes only, collectives are recorded, not run. The report says,
per rank, the bytes of its parameter pieces, gradients and optimizer state, an estimate of its
peak activations, the bytes one step sends per collective kind and mesh dim, and the
problems a cluster launch would hit (ranks applying different plans, groups issuing different
collective sequences, unmatched point-to-point messages). :func:`search` enumerates the
:class:`ParallelDims` of a number of devices (pp, dp, cp, tp) and ranks those that fit by the step
time of an alpha-beta cost model (:class:`Cluster`). Context parallelism and expert parallelism run
their own code on shapes: the ring's key / value transfers are recorded as the engine issues them,
and expert parallelism's token exchange takes its shapes from a stated routing (``simulate(...,
routing=)``, uniform unless given).

This package was ``hyper_parallel_ms.plan``; that name still imports, with a
``DeprecationWarning``, for one release.

Example::

    from hyper_parallel_ms import simulate
    report = simulate(build, mesh_shape=(8, 16, 8), mesh_dim_names=("pp", "dp", "tp"))
    print(report.table())
    report[17].param_bytes, report[17].comm_bytes, report.problems
"""
from __future__ import annotations

from ._cost import Cluster, rank_seconds, step_seconds
from ._report import CommStats, Problem, RankReport, SimulationReport, format_bytes
from ._search import Candidate, ParallelDims, context_parallel_sizes, estimate, parallel_dims_of, search
from ._session import simulate

__all__ = ["simulate", "SimulationReport", "RankReport", "CommStats", "Problem", "format_bytes", "Cluster",
           "rank_seconds", "step_seconds", "ParallelDims", "Candidate", "parallel_dims_of", "context_parallel_sizes",
           "estimate", "search"]
