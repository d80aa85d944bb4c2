"""This process's place in the cluster, and the communication groups it created.

The only module that talks to ``mindspore.communication``. Groups are created once
per rank set, on member ranks only, with deterministic names; a group of one rank
needs no communicator, and a group of all ranks is the world group.

Example:
    >>> from hyper_parallel_ms import _cluster
    >>> _cluster.world_size() >= 1
    True
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import communication as comm_api
from mindspore.communication import GlobalComm

__all__ = ["CommGroup", "is_initialized", "world_size", "world_rank", "device_target",
           "comm_group", "DEVICE_TYPES"]

# user-facing device type -> MindSpore device target
DEVICE_TYPES = {"cpu": "CPU", "npu": "Ascend", "ascend": "Ascend"}


@dataclass(frozen=True)
class CommGroup:
    """A communication group seen from one member rank.

    ``name`` is the MindSpore group name (``None`` for a one-rank group, which never
    communicates), ``ranks`` the global ranks in group order, ``rank`` this process's
    index in ``ranks``.

    Example:
        >>> CommGroup(None, (3,), 0).size
        1
    """

    name: Optional[str]
    ranks: Tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_world(self) -> bool:
        return self.name is not None and self.name == GlobalComm.WORLD_COMM_GROUP


def is_initialized() -> bool:
    """Whether ``mindspore.communication.init()`` has run in this process."""
    return bool(GlobalComm.INITED)


def _env_world_size() -> int:
    for var in ("MS_WORKER_NUM", "RANK_SIZE"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1


def world_size() -> int:
    """Number of ranks; 1 when communication is not initialized in a lone process.

    Raises ``RuntimeError`` when the environment describes a cluster (msrun sets
    ``MS_WORKER_NUM``) but ``mindspore.communication.init()`` has not been called.
    """
    if is_initialized():
        return comm_api.get_group_size()
    if os.environ.get("MS_ROLE") == "MS_WORKER" and _env_world_size() > 1:
        raise RuntimeError(f"this process is one of {_env_world_size()} ranks (MS_WORKER_NUM) but "
                           "communication is not initialized: call mindspore.communication.init() "
                           "before building a device mesh")
    return 1


def world_rank() -> int:
    """Global rank of this process (0 for a lone process)."""
    return comm_api.get_rank() if is_initialized() else 0


def device_target() -> str:
    """MindSpore's device target: ``"CPU"`` or ``"Ascend"`` (``"GPU"`` is not supported)."""
    return ms.get_context("device_target")


def _group_name(ranks: Tuple[int, ...]) -> str:
    if len(ranks) <= 8:
        return "hpms_" + "_".join(map(str, ranks))
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    return f"hpms_{ranks[0]}_n{len(ranks)}_{digest}"


class _GroupRegistry:
    """Groups created by this process, keyed by their rank tuple."""

    def __init__(self) -> None:
        self._names: Dict[Tuple[int, ...], Optional[str]] = {}

    def name_for(self, ranks: Tuple[int, ...]) -> Optional[str]:
        name = self._names.get(ranks)
        if name is not None or ranks in self._names:
            return name
        if len(ranks) == 1:
            name = None
        elif sorted(ranks) == list(range(world_size())):
            if list(ranks) != sorted(ranks):
                raise ValueError(f"group ranks {ranks} must be in increasing order")
            name = GlobalComm.WORLD_COMM_GROUP
        else:
            if list(ranks) != sorted(ranks):
                raise ValueError(f"group ranks {ranks} must be in increasing order: a communication "
                                 "group orders its members by rank")
            name = _group_name(ranks)
            comm_api.create_group(name, list(ranks))
        self._names[ranks] = name
        return name


_REGISTRY: Optional[_GroupRegistry] = None


def comm_group(ranks: Sequence[int]) -> CommGroup:
    """The group of ``ranks`` (which must include this rank), created on first use.

    Every member must ask for its groups in the same order (SPMD); non-members must not
    ask at all.
    """
    global _REGISTRY
    ranks = tuple(int(r) for r in ranks)
    me = world_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of group {ranks}")
    if _REGISTRY is None:
        _REGISTRY = _GroupRegistry()
    return CommGroup(_REGISTRY.name_for(ranks), ranks, ranks.index(me))
