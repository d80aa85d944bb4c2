"""What :func:`~hyper_parallel_ms.dryrun.simulate` reports: per rank, the bytes it holds and moves;
for the cluster, the problems found across ranks.

Example::

    report = simulate(build, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    report[5].param_bytes, report[5].comm["all_gather", "dp"].bytes
    print(report.table())
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["CommStats", "Problem", "RankReport", "SimulationReport", "format_bytes"]


def format_bytes(n: Optional[float]) -> str:
    """``n`` bytes in binary units, for tables.

    Args:
        n: a byte count (``None``: not measured).

    >>> format_bytes(3 * 2 ** 30), format_bytes(512), format_bytes(None)
    ('3.00 GiB', '512 B', '-')
    """
    if n is None:
        return "-"
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class CommStats:
    """The collectives of one kind over one mesh dim in a step: how many, textbook bytes sent.

    Args:
        calls: the number of calls.
        bytes: textbook bytes this rank sends over all of them.
        group_size: the ranks of the group.
        group: the global ranks of the (first) group the calls ran over.

    >>> CommStats(3, 1024, 8).bytes
    1024
    """

    calls: int
    bytes: int
    group_size: int
    group: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Problem:
    """Something that would fail on the cluster, found across the simulated ranks.

    Args:
        kind: ``"plan"`` (ranks apply different plans), ``"collectives"`` (the ranks of a group issue
            different collective sequences: a hang), ``"p2p"`` (unmatched sends / receives) or
            ``"error"`` (a rank's code raised).
        ranks: the ranks concerned.
        where: the Cell (or call) concerned.
        message: what differs, and how to fix it.
        traceback: for an ``"error"``, the traceback of what the rank's code raised.

    >>> Problem("plan", (37,), "layers.3.attention", "...").ranks
    (37,)
    """

    kind: str
    ranks: Tuple[int, ...]
    where: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"[{self.kind}] ranks {_ranges(self.ranks)} at {self.where}: {self.message}"


@dataclass(frozen=True)
class RankReport:
    """One rank's numbers (ints are bytes of this rank).

    Args:
        rank: the global rank.
        coordinate: its mesh coordinate.
        param_bytes: its parameter pieces.
        grad_bytes: the gradients of its trainable pieces.
        optimizer_bytes: its optimizer state (per-parameter slots, e.g. AdamWeightDecay's two moments).
        optimizer_slots: optimizer bytes per slot name (``adam_m``, ``adam_v``, ...).
        activation_bytes: estimated peak of the activations a step keeps for its backward (``None``: no
            step given; temporary buffers come on top, see :mod:`hyper_parallel_ms.dryrun._autodiff`).
        comm_bytes: textbook bytes it sends in one step (``None``: no step given).
        comm: per (kind, mesh dim name) the :class:`CommStats` of one step.
        represented_by: the rank whose run these numbers are (itself, or its class's representative).
        flops: matmul FLOPs of one step (forward, backward and recomputation; ``None``: no step given).
        largest_temporary_bytes: the largest single batch-dependent tensor an op of the step makes (kept
            or not: a temporary such as the attention's scores or a ring block's, which comes on top of
            ``activation_bytes`` while it lives; ``None``: no step given).

    Example::

        report[3].total_bytes
    """

    rank: int
    coordinate: Tuple[int, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    optimizer_slots: Dict[str, int] = field(default_factory=dict)
    activation_bytes: Optional[int] = None
    comm_bytes: Optional[int] = None
    comm: Dict[Tuple[str, str], CommStats] = field(default_factory=dict)
    represented_by: int = -1
    flops: Optional[int] = None
    largest_temporary_bytes: Optional[int] = None

    @property
    def total_bytes(self) -> int:
        """Parameters, gradients, optimizer state and (when estimated) activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + (self.activation_bytes or 0)

    def to_dict(self) -> dict:
        """A JSON-ready dict (``comm`` keyed ``"kind/mesh_dim"``)."""
        out = asdict(self)
        out["comm"] = {f"{k}/{d}": asdict(v) for (k, d), v in self.comm.items()}
        out["total_bytes"] = self.total_bytes
        return out


class SimulationReport:
    """Every rank's :class:`RankReport`, indexable by rank, and the :class:`Problem` list.

    Args:
        ranks: the reports, by rank.
        mesh_shape: the simulated mesh's shape.
        mesh_dim_names: its dim names.
        problems: what would fail on the cluster.
        computed: the ranks actually run (the others are represented by one of them).
        seconds: how long the simulation took.

    Example::

        report = simulate(build, mesh_shape=(4,), mesh_dim_names=("tp",))
        report[0].param_bytes, report.ok, report.to_json()
    """

    def __init__(self, ranks: Dict[int, RankReport], mesh_shape: Tuple[int, ...],
                 mesh_dim_names: Optional[Tuple[str, ...]], problems: Sequence[Problem], computed: Sequence[int],
                 seconds: float) -> None:
        self._ranks = dict(sorted(ranks.items()))
        self.mesh_shape, self.mesh_dim_names = tuple(mesh_shape), mesh_dim_names
        self.problems: List[Problem] = list(problems)
        self.computed = tuple(sorted(computed))
        self.seconds = seconds

    def __getitem__(self, rank: int) -> RankReport:
        if rank not in self._ranks:
            raise KeyError(f"rank {rank} was not simulated; the report has ranks {_ranges(tuple(self._ranks))}")
        return self._ranks[rank]

    def __iter__(self) -> Iterator[RankReport]:
        return iter(self._ranks.values())

    def __len__(self) -> int:
        return len(self._ranks)

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def max_total_bytes(self) -> int:
        """The largest per-rank total (what must fit in one device's memory)."""
        return max(r.total_bytes for r in self)

    def classes(self) -> Dict[int, Tuple[int, ...]]:
        """Representative rank -> the ranks it stands for."""
        out: Dict[int, List[int]] = {}
        for r in self:
            out.setdefault(r.represented_by, []).append(r.rank)
        return {k: tuple(v) for k, v in out.items()}

    def table(self) -> str:
        """One line per group of ranks with equal numbers, totals, then the problems."""
        dims = sorted({d for r in self for _, d in r.comm})
        width = {d: max(14, len(d) + 7) for d in dims}          # a long dim name keeps a space before it
        head = (f"{'ranks':<22}{'params':>12}{'grads':>12}{'optimizer':>12}{'activations':>13}{'total':>12}"
                f"{'comm/step':>12}" + "".join(f"{'comm ' + d:>{width[d]}}" for d in dims))
        lines = [f"simulated mesh {self.mesh_shape} {self.mesh_dim_names or ''}: {len(self)} ranks, "
                 f"{len(self.computed)} run, {self.seconds:.1f} s", head]
        for ranks, r in self._grouped():
            per_dim = {d: sum(s.bytes for (_, dd), s in r.comm.items() if dd == d) for d in dims}
            lines.append(f"{_ranges(ranks):<22}{format_bytes(r.param_bytes):>12}{format_bytes(r.grad_bytes):>12}"
                         f"{format_bytes(r.optimizer_bytes):>12}{format_bytes(r.activation_bytes):>13}"
                         f"{format_bytes(r.total_bytes):>12}{format_bytes(r.comm_bytes):>12}"
                         + "".join(f"{format_bytes(per_dim[d]):>{width[d]}}" for d in dims))
        total_comm = sum(r.comm_bytes or 0 for r in self)
        lines.append(f"{'all ranks':<22}{format_bytes(sum(r.param_bytes for r in self)):>12}"
                     f"{format_bytes(sum(r.grad_bytes for r in self)):>12}"
                     f"{format_bytes(sum(r.optimizer_bytes for r in self)):>12}{'':>13}"
                     f"{format_bytes(sum(r.total_bytes for r in self)):>12}{format_bytes(total_comm):>12}")
        lines.append(f"largest per-rank total: {format_bytes(self.max_total_bytes())}")
        for p in self.problems:
            lines.append(str(p))
            if p.traceback:
                lines.extend("    " + line for line in user_frames(p.traceback).splitlines())
        if not self.problems:
            lines.append("no cross-rank problem found")
        return "\n".join(lines)

    def _grouped(self) -> List[Tuple[Tuple[int, ...], RankReport]]:
        groups: Dict[tuple, List[int]] = {}
        first: Dict[tuple, RankReport] = {}
        for r in self:
            key = (r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_bytes, r.comm_bytes,
                   tuple(sorted((k, v.bytes) for k, v in r.comm.items())))
            groups.setdefault(key, []).append(r.rank)
            first.setdefault(key, r)
        return [(tuple(v), first[k]) for k, v in groups.items()]

    def to_dict(self) -> dict:
        """A JSON-ready dict: the mesh, every rank, the problems."""
        return {"mesh_shape": list(self.mesh_shape), "mesh_dim_names": list(self.mesh_dim_names or ()),
                "seconds": self.seconds, "computed_ranks": list(self.computed),
                "max_total_bytes": self.max_total_bytes(),
                "ranks": [r.to_dict() for r in self], "problems": [asdict(p) for p in self.problems]}

    def to_json(self, indent: Optional[int] = None) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


_INTERNAL = (f"{os.sep}hyper_parallel_ms{os.sep}", f"{os.sep}site-packages{os.sep}", f"{os.sep}lib{os.sep}python")


def user_frames(traceback_text: str) -> str:
    r"""``traceback_text`` (Python's format) with only the frames of the code that was simulated: the
    frames of this package, of MindSpore and of the standard library left out (the full text is in
    :attr:`Problem.traceback` and in the JSON report).

    >>> text = ('Traceback (most recent call last):\n  File "/x/hyper_parallel_ms/a.py", line 1, in f\n    g()\n'
    ...         '  File "/home/me/train.py", line 9, in construct\n    raise KeyError(1)\nKeyError: 1\n')
    >>> print(user_frames(text))
    Traceback (most recent call last; the frames of hyper_parallel_ms, MindSpore and Python left out):
      File "/home/me/train.py", line 9, in construct
        raise KeyError(1)
    KeyError: 1
    """
    out: List[str] = []
    keep = True
    for line in traceback_text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            out.append("Traceback (most recent call last; the frames of hyper_parallel_ms, MindSpore and Python "
                       "left out):")
            keep = False
        elif line.startswith("  File "):
            keep = not any(part in line for part in _INTERNAL)
            if keep:
                out.append(line)
        elif line.startswith("    "):
            if keep:
                out.append(line)
        else:                     # the exception line, and the lines between chained exceptions
            keep = False
            out.append(line)
    return "\n".join(out)


def _ranges(ranks: Sequence[int]) -> str:
    """``0-7,16`` for sorted ranks.

    >>> _ranges((0, 1, 2, 5, 7, 8))
    '0-2,5,7-8'
    """
    out, start, prev = [], None, None
    for r in sorted(ranks):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)
