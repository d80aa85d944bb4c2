"""CommDebugMode: count the collectives a block of code runs.

Like PyTorch's ``CommDebugMode``: inside ``with CommDebugMode() as mode:`` every
collective issued by ``hyper_parallel_ms.comm`` in PyNative is recorded with its kind,
mesh dim, group size, path (native / composed) and bytes sent per rank: ``bytes`` is the
textbook figure of a bandwidth-optimal implementation, ``wire_bytes`` what the issued
primitives send (see :mod:`._traffic`).

A collective inside an ``ms.jit`` function is recorded once, when the graph is
compiled, with ``compiled=True``: the compiled graph then runs without Python, so later
calls of it add nothing.

Example:
    >>> with CommDebugMode() as mode:
    ...     pass
    >>> mode.get_total_counts(), mode.get_comm_counts()
    (0, {})
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Tuple

from .._mindspore import is_compiling

__all__ = ["CommDebugMode", "CommRecord", "record", "unrecorded"]

_ACTIVE: List["CommDebugMode"] = []


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by this rank.

    Args:
        kind: the collective (``"all_gather"``, ``"all_reduce"``, ...).
        mesh_dim: the mesh dim's name (or its index as a string).
        group_size: the ranks along that dim.
        path: ``"native"`` or ``"composed"``.
        bytes: bytes this rank sends in a bandwidth-optimal implementation (the textbook figure).
        wire_bytes: bytes the issued primitives send.
        shape: the input's shape.
        dtype: the input's dtype, as a string.
        compiled: recorded while ``ms.jit`` compiled a graph (once per compile).
        group: the global ranks of the group, in group order.
        peer: for ``send`` / ``recv``, the global rank sent to / received from (else ``None``).

    Example::

        with CommDebugMode() as mode:
            all_reduce(x, mesh, "tp")
        record = mode.records[0]            # CommRecord(kind='all_reduce', mesh_dim='tp', ...)
    """

    kind: str
    mesh_dim: Optional[str]
    group_size: int
    path: str
    bytes: int
    wire_bytes: int
    shape: tuple
    dtype: str
    compiled: bool = False
    group: Tuple[int, ...] = ()
    peer: Optional[int] = None


class CommDebugMode:
    """Context manager recording collectives (re-entrant; nested modes all record).

    Example:
        >>> mode = CommDebugMode()
        >>> with mode:
        ...     record(CommRecord("all_reduce", "tp", 2, "native", 8, 8, (4,), "Float32"))
        >>> mode.get_comm_counts(), mode.total_bytes()
        ({'all_reduce': 1}, 8)
    """

    def __init__(self) -> None:
        self.records: List[CommRecord] = []

    def __enter__(self) -> "CommDebugMode":
        self.records = []
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def get_comm_counts(self) -> Dict[str, int]:
        """Number of calls per collective kind."""
        return dict(Counter(r.kind for r in self.records))

    def get_total_counts(self) -> int:
        """Number of collective calls."""
        return len(self.records)

    def total_bytes(self, kind: Optional[str] = None) -> int:
        """Textbook bytes sent per rank, over all calls (of ``kind`` if given)."""
        return sum(r.bytes for r in self.records if kind is None or r.kind == kind)

    def total_wire_bytes(self, kind: Optional[str] = None) -> int:
        """Bytes the issued primitives send per rank, over all calls (of ``kind`` if given)."""
        return sum(r.wire_bytes for r in self.records if kind is None or r.kind == kind)

    def summary(self) -> str:
        """A text table, one line per call."""
        lines = [f"{'kind':<18}{'mesh dim':<10}{'n':>3}  {'path':<9}{'bytes':>12}{'wire bytes':>12}  shape"]
        for r in self.records:
            lines.append(f"{r.kind:<18}{str(r.mesh_dim):<10}{r.group_size:>3}  {r.path:<9}"
                         f"{r.bytes:>12}{r.wire_bytes:>12}  {r.shape} {r.dtype}"
                         f"{'  (compiled)' if r.compiled else ''}")
        return "\n".join(lines)


def record(rec: CommRecord) -> None:
    """Add ``rec`` to every active mode (marked ``compiled`` while ms.jit compiles)."""
    if not _ACTIVE:
        return
    if is_compiling():
        rec = replace(rec, compiled=True)
    for mode in _ACTIVE:
        mode.records.append(rec)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Collectives issued inside are bookkeeping (the ranks agreeing on shapes), not the
    program's communication: active modes do not record them.

    Example:
        >>> with CommDebugMode() as mode, unrecorded():
        ...     pass
        >>> mode.get_total_counts()
        0
    """
    saved = list(_ACTIVE)
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE[:] = saved
