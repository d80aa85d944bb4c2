"""Deprecated: the dry run is :mod:`hyper_parallel_ms.dryrun` (this name goes in the next release).

Importing this package warns (``DeprecationWarning``) and gives the same objects as
``hyper_parallel_ms.dryrun``; its two renamed names still resolve, each with its own warning:
``Layout`` (the job's pp / dp / tp shape) is :class:`~hyper_parallel_ms.dryrun.ParallelDims`,
``layouts`` is :func:`~hyper_parallel_ms.dryrun.parallel_dims_of`.

Example::

    from hyper_parallel_ms.dryrun import ParallelDims, simulate     # was: from hyper_parallel_ms.plan import ...
"""
from __future__ import annotations

from typing import Any

from .._deprecated import importer_stacklevel, renamed
from ..dryrun import (Candidate, Cluster, CommStats, ParallelDims, Problem, RankReport, SimulationReport,
                      context_parallel_sizes, estimate, format_bytes, parallel_dims_of, rank_seconds, search, simulate,
                      step_seconds)

__all__ = ["simulate", "SimulationReport", "RankReport", "CommStats", "Problem", "format_bytes", "Cluster",
           "rank_seconds", "step_seconds", "ParallelDims", "Candidate", "parallel_dims_of",
           "context_parallel_sizes", "estimate", "search"]

renamed("hyper_parallel_ms.plan", "hyper_parallel_ms.dryrun", stacklevel=importer_stacklevel())

_RENAMED = {"Layout": ("ParallelDims", ParallelDims), "layouts": ("parallel_dims_of", parallel_dims_of)}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new, value = _RENAMED[name]
        renamed(f"hyper_parallel_ms.plan.{name}", f"hyper_parallel_ms.dryrun.{new}")
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
