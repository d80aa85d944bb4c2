"""Which implementation each collective takes on each device.

``native``: the device's own collective primitive (HCCL on Ascend). ``composed``: built
from the one primitive MindSpore's CPU backend (MCCL) offers on every group, inside
``ms.jit`` and with a backward: ``ops.AllReduce`` with SUM. Composed collectives move
more bytes than native ones (an all-gather becomes an all-reduce of the gathered
buffer); ``CommDebugMode`` reports both the textbook and the actual bytes.

Example:
    >>> from hyper_parallel_ms.comm.capability import CAPABILITIES
    >>> CAPABILITIES[("Ascend", "all_gather")].path, CAPABILITIES[("CPU", "all_gather")].path
    ('native', 'composed')
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

__all__ = ["Capability", "CAPABILITIES", "COLLECTIVES", "POINT_TO_POINT", "DTYPES", "select_path", "force_path", "table"]

NATIVE = "native"
COMPOSED = "composed"
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_single", "broadcast")
POINT_TO_POINT = ("send", "recv")


@dataclass(frozen=True)
class Capability:
    """How ``collective`` runs on ``device``; ``how`` says with which primitives."""

    device: str
    collective: str
    path: str
    how: str


_ROWS = [
    Capability("Ascend", "all_gather", NATIVE, "ops.AllGather (pad to the largest piece when uneven)"),
    Capability("Ascend", "all_reduce", NATIVE, "ops.AllReduce sum/max/min; avg = sum / n"),
    Capability("Ascend", "reduce_scatter", NATIVE,
               "ops.ReduceScatter for sum/avg; max/min: ops.AllReduce + local chunk "
               "(ReduceScatter has no max/min backward)"),
    Capability("Ascend", "all_to_all", NATIVE, "ops.AlltoAll (padded when uneven)"),
    Capability("Ascend", "all_to_all_single", NATIVE,
               "ops.AlltoAllV on the flattened rows; backward: the same with the splits swapped"),
    Capability("Ascend", "broadcast", NATIVE, "ops.Broadcast; backward: ops.AllReduce kept on the source"),
    Capability("CPU", "all_gather", COMPOSED,
               "each rank writes its piece into a zero buffer, ops.AllReduce sum; on the world group (float32, "
               "float16; compiled: equal pieces on dim 0 only) MCCL's AllGather (native: half the all-reduce's "
               "bytes) with this composed backward (MCCL has no ReduceScatter)"),
    Capability("CPU", "all_reduce", COMPOSED,
               "sum: ops.AllReduce sum itself; avg = sum / n; max/min: pieces stacked in slots, "
               "AllReduce sum, max/min over the slot axis (MCCL AllReduce: sum only)"),
    Capability("CPU", "reduce_scatter", COMPOSED, "all_reduce, then the local chunk"),
    Capability("CPU", "all_to_all", COMPOSED, "all_gather along concat_dim, then the local chunk of split_dim"),
    Capability("CPU", "all_to_all_single", COMPOSED,
               "PyNative: the ranks exchange their splits (one all-reduce), each writes its rows into its slot of the "
               "buffer of every rank's rows, ops.AllReduce sum, keeps the blocks sent to it; ms.jit (splits as Python "
               "ints, equal row counts): the inputs all-gathered whole, the blocks picked at offsets computed in the "
               "graph"),
    Capability("CPU", "broadcast", COMPOSED, "non-source ranks contribute zeros to ops.AllReduce sum"),
    Capability("Ascend", "send", NATIVE, "HCCL isend kernel (mint.distributed.send's), waited on; PyNative only"),
    Capability("Ascend", "recv", NATIVE, "HCCL irecv kernel (mint.distributed.recv's), waited on; PyNative only"),
    Capability("CPU", "send", NATIVE,
               "MCCL isend kernel, any group (mint.distributed.send fails on CPU: its own-rank check reads "
               "hccl_world_group); returns before the matching recv (buffered); bool as uint8; PyNative only"),
    Capability("CPU", "recv", NATIVE, "MCCL irecv kernel, any group; blocks until the data arrive; bool as uint8; "
                                      "PyNative only"),
]

CAPABILITIES: Dict[Tuple[str, str], Capability] = {(c.device, c.collective): c for c in _ROWS}

DTYPES: Tuple[Tuple[str, str, str], ...] = (
    # (device, dtypes, how they travel)
    ("CPU", "float32, float16", "as themselves (MCCL AllReduce sum)"),
    ("CPU", "bfloat16", "widened to float32"),
    ("CPU", "int8, int16, int32, int64, uint8",
     "16-bit limbs as float32 (8-bit beyond 256 ranks), exact sums with carries; int32 moves 8 B per value, "
     "int64 16 B; avg refused"),
    ("CPU", "bool", "as float32 0/1; sum and max = or, min = and; avg refused"),
    ("CPU", "float64", "int64 bit pattern (bit-exact); inside ms.jit five float32 parts (exact but for "
     "subnormals); sums gather every piece and add in rank order"),
    ("Ascend", "float16/32, bfloat16, int8/16/32/64", "as themselves (HCCL)"),
    ("Ascend", "bool, uint8", "reductions as int32 (bool sum = or); bool moves as uint8"),
    ("Ascend", "float64", "moved natively; reductions gather every piece and reduce in rank order"),
)

# (device, collective) -> the dtypes with which a composed collective runs natively on the world group
WORLD_NATIVE: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("CPU", "all_gather"): ("Float32", "Float16"),        # MCCL truncates int64 (measured)
}

_FORCED: List[str] = []


def select_path(device: str, collective: str, *, world_group: bool = False, dtype: object = None) -> str:
    """``native`` or ``composed`` for ``collective`` on ``device`` (``CPU``/``Ascend``); a composed
    collective listed in ``WORLD_NATIVE`` is native on the world group for the dtypes listed there.

    Args:
        device: MindSpore's device target, ``"CPU"`` or ``"Ascend"``.
        collective: ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``, ``"all_to_all"`` or ``"broadcast"``.
        world_group: whether the group is every rank.
        dtype: the tensor's dtype (its ``str`` is compared, e.g. ``Float32``).

    >>> select_path("CPU", "all_reduce") in ("native", "composed")
    True
    >>> select_path("CPU", "all_gather", world_group=True, dtype="Float32")
    'native'
    """
    if _FORCED:
        return _FORCED[-1]
    cap = CAPABILITIES.get((device, collective))
    if cap is None:
        raise RuntimeError(f"no {collective} implementation for device target {device!r}; "
                           f"hyper_parallel_ms runs on {sorted({c.device for c in _ROWS})}")
    if cap.path == COMPOSED and world_group and str(dtype) in WORLD_NATIVE.get((device, collective), ()):
        return NATIVE
    return cap.path


@contextlib.contextmanager
def force_path(path: Optional[str]) -> Iterator[None]:
    """Run collectives on ``path`` (``native``/``composed``) whatever the device.

    Used to test the native implementations on CPU where MCCL has the primitive (the
    world group's AllGather and Broadcast).

    Args:
        path: ``"native"`` or ``"composed"``.

    Example:
        >>> with force_path("composed"):
        ...     select_path("Ascend", "all_gather")
        'composed'
    """
    if path not in (NATIVE, COMPOSED):
        raise ValueError(f"path must be {NATIVE!r} or {COMPOSED!r}, got {path!r}")
    _FORCED.append(path)
    try:
        yield
    finally:
        _FORCED.pop()


def table() -> str:
    """The capability table as Markdown: collectives per device, then how each dtype travels.

    >>> print(table().splitlines()[0])
    | device | collective | path | how |
    """
    lines = ["| device | collective | path | how |", "| --- | --- | --- | --- |"]
    lines += [f"| {c.device} | {c.collective} | {c.path} | {c.how} |" for c in _ROWS]
    lines += ["", "| device | dtypes | how they travel |", "| --- | --- | --- |"]
    lines += [f"| {device} | {dtypes} | {how} |" for device, dtypes, how in DTYPES]
    return "\n".join(lines)
