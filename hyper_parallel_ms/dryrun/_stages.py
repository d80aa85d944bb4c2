"""Every stage of a deep 1F1B pipeline from two short ones: the search's fast path.

A stage of a 1F1B pipeline is its first, a middle or its last one (its *role*); the stages of one
role run the same code on the same shapes, so they differ only in how many micro-batches are in
flight at once (``k = pp - s`` for stage ``s`` when there are at least ``pp`` micro-batches) and
in the ranks of their groups. Per stage, for ``m`` micro-batches of ``b`` identical blocks:

- what a rank holds (parameters, gradients, optimizer state) depends on its role and ``b`` only;
- what a step computes and sends (FLOPs, each collective's calls and bytes) adds the same for each
  micro-batch: affine in ``m``;
- the activation peak is ``k`` micro-batches' kept tensors plus what a recomputed block holds
  while its backward runs: affine in ``k``, the same for every ``m >= pp``;

and each of them is affine in ``b`` (``_search`` simulates 1 and 2 blocks per stage). So two short
pipelines give every stage of any depth exactly: 3 stages with 3 micro-batches and 4 stages with
4 (the first role at ``k`` = 3 and 4, the middle one at ``k`` = 2 and 3, every role at ``m`` = 3
and 4); a 2-stage job takes 2 stages with 2 and 3 micro-batches. Each number of a stage comes from
the samples of its role: the one at its own ``k`` (or ``m``), else the line through two adjacent
ones. ``tests/test_plan_search.py`` checks the result against full simulations.

Example::

    samples = {(p, m): reports_of(p, m) for p, m in sample_pipelines(8)}   # first rank of each stage
    stages = stage_reports(samples, ParallelDims(pp=8, dp=16, tp=8, microbatches=16))
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ._report import CommStats, RankReport

__all__ = ["sample_pipelines", "stage_reports"]

Samples = Dict[Tuple[int, int], Dict[int, RankReport]]      # (stages, micro-batches) -> stage -> first rank's report


def sample_pipelines(pp: int) -> Tuple[Tuple[int, int], ...]:
    """The (stages, micro-batches) of the short pipelines that give every stage of a ``pp``-stage one.

    >>> sample_pipelines(1), sample_pipelines(2), sample_pipelines(16)
    (((1, 1),), ((2, 2), (2, 3)), ((3, 3), (4, 4)))
    """
    if pp == 1:
        return ((1, 1),)
    if pp == 2:
        return ((2, 2), (2, 3))
    return ((3, 3), (4, 4))


def _role(stage: int, pp: int) -> int:
    return 0 if stage == 0 else 2 if stage == pp - 1 else 1


def _at(points: Sequence[Tuple[int, int]], x: int) -> int:
    """The value at ``x`` of the line through ``points`` ((x, value), two with adjacent x, or one at x)."""
    for px, value in points:
        if px == x:
            return value
    for (xa, a), (xb, b) in ((p, q) for p in points for q in points if q[0] == p[0] + 1):
        return a + (b - a) * (x - xa)
    raise ValueError(f"no two samples with adjacent x among {[p[0] for p in points]} to reach {x}")


def _group(group: Tuple[int, ...], small: Tuple[int, ...], big: Tuple[int, ...], stage: int) -> Tuple[int, ...]:
    """A group of a rank of the short pipeline's mesh ``small`` as the group of stage ``stage``'s rank in
    ``big``: a group along the pipeline dim spans all its stages, any other lies in the stage."""
    coords = [np.unravel_index(r, small) for r in group]
    if len({int(c[0]) for c in coords}) > 1:
        rest = sorted({tuple(int(v) for v in c[1:]) for c in coords})
        return tuple(int(np.ravel_multi_index((s,) + r, big)) for r in rest for s in range(big[0]))
    return tuple(int(np.ravel_multi_index((stage,) + tuple(int(v) for v in c[1:]), big)) for c in coords)


def stage_reports(samples: Samples, pp: int, microbatches: int, mesh_shape: Tuple[int, ...]) -> List[RankReport]:
    """The first rank of every stage of a ``pp``-stage 1F1B pipeline of ``microbatches`` micro-batches on
    ``mesh_shape`` (pipeline dim first), from ``samples`` (see the module docstring), each already at
    the job's blocks per stage.

    Args:
        samples: ``(stages, micro-batches) -> {stage: report of its first rank}`` for
            :func:`sample_pipelines` ``(pp)``.
        pp: the job's stages.
        microbatches: its micro-batches (at least ``pp`` when ``pp > 1``).
        mesh_shape: its mesh, ``(pp, ...)``.

    Example::

        stage_reports(samples, 8, 16, (8, 16, 8))[7].activation_bytes
    """
    by_role: Dict[int, List[Tuple[int, int, Tuple[int, ...], RankReport]]] = {0: [], 1: [], 2: []}
    for (p, m), reports in sorted(samples.items()):
        small = (p,) + tuple(mesh_shape[1:])
        for s, report in sorted(reports.items()):
            by_role[_role(s, p) if pp > 1 else 0].append((p - s, m, small, report))
    zeros = (0,) * (len(mesh_shape) - 1)
    out = []
    for stage in range(pp):
        role = by_role[_role(stage, pp) if pp > 1 else 0]
        per_m: Dict[int, Tuple[Tuple[int, ...], RankReport]] = {}
        for _, m, small, r in role:
            per_m.setdefault(m, (small, r))
        ms = sorted(per_m)

        def along_m(value) -> int:
            return _at([(m, value(per_m[m][1])) for m in ms], microbatches)
        comm = {}
        for key in sorted({key for _, r in per_m.values() for key in r.comm}):
            small, some = next((sm, r.comm[key]) for sm, r in per_m.values() if key in r.comm)
            group = _group(some.group, small, tuple(mesh_shape), stage) if some.group else ()
            empty = CommStats(0, 0, some.group_size)
            comm[key] = CommStats(along_m(lambda r: r.comm.get(key, empty).calls),
                                  along_m(lambda r: r.comm.get(key, empty).bytes),
                                  len(group) if group else some.group_size, group)
        rank = int(np.ravel_multi_index((stage,) + zeros, tuple(mesh_shape)))
        activation = _at(sorted({(k, r.activation_bytes or 0) for k, _, _, r in role}), pp - stage)
        out.append(replace(role[0][3], rank=rank, coordinate=(stage,) + zeros, represented_by=rank,
                           activation_bytes=activation, flops=along_m(lambda r: r.flops or 0),
                           comm_bytes=along_m(lambda r: r.comm_bytes or 0), comm=comm))
    return out
