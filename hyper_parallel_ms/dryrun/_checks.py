"""Cross-rank checks over the simulated ranks, as the cluster would make them (or fail on them).

- **plans**: every agreement a layer asks of the ranks of a mesh (the plan digests of
  ``parallelize_module`` / ``fully_shard`` / ``distribute_module``, :mod:`hyper_parallel_ms.nn._consistency`)
  is compared between the ranks of that mesh that ran: the n-th agreement over a group must
  have the same entries on every member. A rank whose entries differ from its group's majority
  is reported with the first entry that differs (it names the Cell or parameter).
- **collectives**: the ranks of a group must issue the same sequence of collectives (kind and
  dtype; shapes too where every member sends the same shape: all-reduce, reduce-scatter,
  broadcast). On the cluster a difference hangs or pairs up wrong collectives; here the ranks
  whose sequence departs from the group's majority are reported with the Cell that issued the
  first differing call.
- **point-to-point**: what a rank sends to a peer must be what that peer receives from it, in
  order (shape and dtype).

Only ranks that ran are compared (a rank represented by another one issues what its
representative issues, by the rule that grouped them).

Example::

    problems = cross_rank_problems(runs)        # runs: rank -> RankRun
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ._report import Problem

__all__ = ["RankRun", "cross_rank_problems", "grouped"]

_SAME_SHAPE = ("all_reduce", "reduce_scatter", "broadcast")
_P2P = ("send", "recv")


@dataclass
class RankRun:
    """What one simulated rank did.

    Args:
        rank: the global rank.
        notes: ``(what, group ranks, entries)`` of each agreement, in order.
        records: every collective it issued (construction and step), in order.
        where: the Cell that issued each record.
        error: what its code raised (``""``: it ran through).
        error_cell: the model's innermost Cell running when it raised (``""``: none, or outside the model).
        traceback: the traceback of what it raised.

    >>> RankRun(3).rank
    3
    """

    rank: int
    notes: List[Tuple[str, Tuple[int, ...], Tuple[Tuple[str, str], ...]]] = field(default_factory=list)
    records: list = field(default_factory=list)
    where: List[str] = field(default_factory=list)
    error: str = ""
    error_cell: str = ""
    traceback: str = ""


def _majority(values: Dict[int, object]) -> object:
    return Counter(values.values()).most_common(1)[0][0]


def _plan_problems(runs: Dict[int, RankRun]) -> List[Problem]:
    by_key: Dict[Tuple[Tuple[int, ...], int], Dict[int, tuple]] = {}
    whats: Dict[Tuple[Tuple[int, ...], int], str] = {}
    for rank, run in runs.items():
        seen: Counter = Counter()
        for what, group, entries in run.notes:
            key = (group, seen[group])
            seen[group] += 1
            by_key.setdefault(key, {})[rank] = entries
            whats.setdefault(key, what)
    problems = []
    for (group, index), entries in sorted(by_key.items()):
        members = {r: entries.get(r) for r in group if r in runs and not runs[r].error}
        if len(members) < 2 or len(set(members.values())) == 1:
            continue
        common = _majority(members)
        for rank, mine in sorted(members.items()):
            if mine == common:
                continue
            first, name, detail = _first_difference(mine, common)
            problems.append(Problem("plan", (rank,), name,
                                    f"{whats[group, index]}: rank {rank} applies a different plan than the other ranks "
                                    f"of group {list(group)}; first difference at entry {first}: {detail}. Every rank "
                                    "must apply the same plan to the same model"))
    return problems


def _first_difference(mine, common) -> Tuple[int, str, str]:
    mine, common = mine or (), common or ()
    for i in range(max(len(mine), len(common))):
        a = mine[i] if i < len(mine) else None
        b = common[i] if i < len(common) else None
        if a != b:
            name = (a or b)[0]
            return i, name, (f"this rank has {a[0]!r} ({a[1]})" if a else "this rank has nothing (its plan is shorter)") \
                + (f", the others {b[0]!r} ({b[1]})" if b else ", the others nothing")
    return 0, "?", "equal"


def _signature(rec) -> tuple:
    return (rec.kind, rec.dtype) + ((tuple(rec.shape),) if rec.kind in _SAME_SHAPE else ())


def _collective_problems(runs: Dict[int, RankRun]) -> List[Problem]:
    sequences: Dict[Tuple[int, ...], Dict[int, List[Tuple[tuple, str]]]] = {}
    for rank, run in runs.items():
        if run.error:
            continue
        for rec, where in zip(run.records, run.where):
            if rec.kind not in _P2P and rec.group:
                sequences.setdefault(tuple(rec.group), {}).setdefault(rank, []).append((_signature(rec), where))
    problems = []
    for group, members in sorted(sequences.items()):
        present = {r: members.get(r, []) for r in group if r in runs and not runs[r].error}
        if len(present) < 2:
            continue
        plain = {r: tuple(s for s, _ in seq) for r, seq in present.items()}
        if len(set(plain.values())) == 1:
            continue
        common = _majority(plain)
        for rank, seq in sorted(plain.items()):
            if seq == common:
                continue
            i = next((k for k in range(max(len(seq), len(common)))
                      if k >= len(seq) or k >= len(common) or seq[k] != common[k]), 0)
            where = present[rank][i][1] if i < len(seq) else (present[rank][-1][1] if seq else "?")
            mine = seq[i] if i < len(seq) else "nothing"
            theirs = common[i] if i < len(common) else "nothing"
            problems.append(Problem("collectives", (rank,), where,
                                    f"collective {i} over group {list(group)}: rank {rank} issues {mine}, the other "
                                    f"ranks {theirs}; on the cluster the group would hang or pair up wrong collectives"))
    return problems


def _p2p_problems(runs: Dict[int, RankRun]) -> List[Problem]:
    sent: Dict[Tuple[int, int], List[Tuple[tuple, str, str]]] = {}
    received: Dict[Tuple[int, int], List[Tuple[tuple, str, str]]] = {}
    for rank, run in runs.items():
        for rec, where in zip(run.records, run.where):
            if rec.kind == "send":
                sent.setdefault((rank, rec.peer), []).append((tuple(rec.shape), rec.dtype, where))
            elif rec.kind == "recv":
                received.setdefault((rec.peer, rank), []).append((tuple(rec.shape), rec.dtype, where))
    problems = []
    for pair in sorted(set(sent) | set(received)):
        src, dst = pair
        if src not in runs or dst not in runs or runs[src].error or runs[dst].error:
            continue
        out, into = sent.get(pair, []), received.get(pair, [])
        for i in range(max(len(out), len(into))):
            a = out[i][:2] if i < len(out) else None
            b = into[i][:2] if i < len(into) else None
            if a != b:
                where = (out[i] if i < len(out) else into[i])[2]
                problems.append(Problem("p2p", (src, dst), where,
                                        f"message {i} from rank {src} to rank {dst}: sent {a or 'nothing'}, received "
                                        f"{b or 'nothing'} (shape, dtype); the ranks would wait forever or read "
                                        "wrong data"))
                break
    return problems


def cross_rank_problems(runs: Dict[int, RankRun]) -> List[Problem]:
    """Every problem found between the ranks that ran (see the module docstring), ranks that
    raised first.

    Args:
        runs: rank -> :class:`RankRun`.

    >>> cross_rank_problems({0: RankRun(0), 1: RankRun(1, error="ValueError: x")})[0].kind
    'error'
    """
    errors = [Problem("error", (r,), run.error_cell or "its code", run.error, run.traceback)
              for r, run in sorted(runs.items()) if run.error]
    return errors + _plan_problems(runs) + _collective_problems(runs) + _p2p_problems(runs)


def grouped(problems: Sequence[Problem]) -> List[Problem]:
    """``problems`` with those equal but for their ranks merged into one naming every rank.

    Args:
        problems: the problems.

    >>> len(grouped([Problem("error", (1,), "x", "m"), Problem("error", (2,), "x", "m")]))
    1
    """
    merged: Dict[Tuple[str, str, str], List[int]] = {}
    tracebacks: Dict[Tuple[str, str, str], str] = {}
    for p in problems:
        merged.setdefault((p.kind, p.where, p.message), []).extend(p.ranks)
        tracebacks.setdefault((p.kind, p.where, p.message), p.traceback)
    return [Problem(kind, tuple(sorted(set(ranks))), where, message, tracebacks[kind, where, message])
            for (kind, where, message), ranks in merged.items()]
