"""This process's place in the cluster, and the communication groups it created.

The only module that talks to ``mindspore.communication``. Groups are created once
per rank set, on member ranks only, with deterministic names; a group of one rank
needs no communicator, and a group of all ranks is the world group.

A :class:`World` is a place in a cluster: this process's (:func:`process_world`) or one rank
of a simulated cluster (``simulated=True``), where groups are descriptions only (no
communicator is created; collectives over them are recorded, not run). Inside
``with simulating(world):`` code that has no mesh to ask (a default mesh of every rank) sees
that world (:func:`current_world`).

Example:
    >>> from hyper_parallel_ms import _cluster
    >>> _cluster.world_size() >= 1
    True
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import communication as comm_api
from mindspore.communication import GlobalComm
from ._mindspore import process_device_target

__all__ = ["CommGroup", "World", "is_initialized", "world_size", "world_rank", "device_target", "rank_device_target",
           "comm_group", "group_ranks", "device_key", "check_device_type", "process_world", "current_world",
           "simulating", "DEVICE_TYPES", "device_type", "init_world", "release_world", "destroy_group", "adopt_group"]

# user-facing device type -> MindSpore device target
DEVICE_TYPES = {"cpu": "CPU", "npu": "Ascend", "ascend": "Ascend"}


@dataclass(frozen=True)
class CommGroup:
    """A communication group seen from one member rank.

    ``name`` is the MindSpore group name (``None`` for a one-rank group, which never
    communicates), ``ranks`` the global ranks in group order, ``rank`` this process's
    index in ``ranks``; ``simulated``: a group of a simulated world (no communicator:
    collectives over it are recorded, not run).

    Example:
        >>> CommGroup(None, (3,), 0).size
        1
    """

    name: Optional[str]
    ranks: Tuple[int, ...]
    rank: int
    simulated: bool = False

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


@dataclass(frozen=True)
class World:
    """A place in a cluster: ``size`` ranks, this one ``rank``; ``simulated``: one rank of a
    cluster simulated in this process (its ``device_type``, ``"cpu"`` or ``"npu"``, picks the
    collectives' implementation as on that device). The process's own world has
    ``simulated=False`` and the device of MindSpore's device target.

    Example:
        >>> World(1024, 17, simulated=True, device_type="npu").rank
        17
    """

    size: int
    rank: int
    simulated: bool = False
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a world has a positive number of ranks, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}) for a world of {self.size} ranks, got {self.rank!r}")
        if self.device_type not in ("cpu", "npu"):
            raise ValueError(f"device_type must be 'cpu' or 'npu', got {self.device_type!r}")

    @property
    def device_target(self) -> str:
        """MindSpore's name of the world's device: ``"CPU"`` or ``"Ascend"``."""
        return DEVICE_TYPES[self.device_type]


def process_world() -> World:
    """This process's place: :func:`world_size` ranks, this one :func:`world_rank`."""
    return World(world_size(), world_rank(), False, device_type())


_SIMULATING: List[World] = []     # worlds entered with ``simulating``, innermost last


def current_world() -> World:
    """The innermost world entered with :func:`simulating`, else this process's.

    Example:
        >>> with simulating(World(8, 3, simulated=True)):
        ...     current_world().rank
        3
    """
    return _SIMULATING[-1] if _SIMULATING else process_world()


@contextlib.contextmanager
def simulating(world: World) -> Iterator[World]:
    """Inside, :func:`current_world` is ``world`` (a simulated one).

    Example:
        >>> with simulating(World(4, 1, simulated=True)) as w:
        ...     w.size
        4
    """
    if not world.simulated:
        raise ValueError(f"simulating() takes a simulated world, got {world}")
    _SIMULATING.append(world)
    try:
        yield world
    finally:
        _SIMULATING.remove(world)


def device_target() -> str:
    """MindSpore's device target: ``"CPU"`` or ``"Ascend"`` (``"GPU"`` is not supported), the
    process's also inside a ``mindspore.DeviceCtx("meta")`` block."""
    return process_device_target()


def rank_device_target() -> str:
    """MindSpore's device target of the rank this code runs as: a simulated world's inside
    :func:`simulating` (a dry run of Ascend ranks picks Ascend's kernels), else :func:`device_target`.

    Example:
        >>> with simulating(World(8, 3, simulated=True, device_type="npu")):
        ...     rank_device_target()
        'Ascend'
    """
    return _SIMULATING[-1].device_target if _SIMULATING else device_target()


def device_type() -> str:
    """This process's device type, ``"npu"`` or ``"cpu"`` (from :func:`device_target`; no
    communication needed)."""
    return "npu" if device_target() == "Ascend" else "cpu"


def _solo_group_name(rank: int) -> str:
    return f"hpms_solo_{rank}"


def _group_name(ranks: Tuple[int, ...]) -> str:
    if len(ranks) <= 8:
        return "hpms_" + "_".join(map(str, ranks))
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    return f"hpms_{ranks[0]}_n{len(ranks)}_{digest}"


class _GroupRegistry:
    """Groups created by this process, keyed by their rank tuple."""

    def __init__(self) -> None:
        self._names: Dict[Tuple[int, ...], Optional[str]] = {}
        self._solo: Dict[int, str] = {}

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

    def solo_name(self, rank: int) -> str:
        """A MindSpore group of this rank alone, created on first use (what a one-rank mesh dim's
        ``get_group`` names: MindSpore reads ``group=None`` as the world)."""
        name = self._solo.get(rank)
        if name is None:
            name = _solo_group_name(rank)
            comm_api.create_group(name, [rank])
            self._solo[rank] = name
        return name

    def adopt(self, ranks: Tuple[int, ...], name: str) -> None:
        known = self._names.get(ranks)
        if known is not None and known != name:
            raise ValueError(f"ranks {ranks} have the group {known!r} already; {name!r} would be a second one")
        self._names[ranks] = name

    def forget(self, name: str) -> None:
        for ranks in [r for r, n in self._names.items() if n == name]:
            del self._names[ranks]


_REGISTRY: Optional[_GroupRegistry] = None


def _registry() -> _GroupRegistry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _GroupRegistry()
    return _REGISTRY


def init_world(backend: Optional[str] = None) -> None:
    """``mindspore.communication.init`` (``backend``: MindSpore's name, e.g. ``"hccl"``; ``None``: the
    device's), unless it has run already."""
    if is_initialized():
        return
    if backend is None:
        comm_api.init()
    else:
        comm_api.init(backend)


def release_world() -> None:
    """``mindspore.communication.release``: every group of this process is gone (created again on use
    after the next :func:`init_world`)."""
    global _REGISTRY
    comm_api.release()
    _REGISTRY = None


def destroy_group(name: str) -> None:
    """Destroy the group ``name`` created by this process (not the world group)."""
    if name == GlobalComm.WORLD_COMM_GROUP:
        raise ValueError(f"{name!r} is the world group: release the whole world instead (destroy_process_group())")
    comm_api.destroy_group(name)
    _registry().forget(name)


def adopt_group(name: str) -> Tuple[int, ...]:
    """Record the existing MindSpore group ``name`` as its ranks' group (no second group is created
    for them); returns its ranks."""
    ranks = group_ranks(name)
    _registry().adopt(ranks, name)
    return ranks


def comm_group(ranks: Sequence[int], world: Optional[World] = None) -> CommGroup:
    """The group of ``ranks`` (which must include this rank), created on first use; in a
    simulated ``world`` a description only (nothing is created).

    Every member must ask for its groups in the same order (SPMD); non-members must not
    ask at all.
    """
    ranks = tuple(int(r) for r in ranks)
    me = world_rank() if world is None else world.rank
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of group {ranks}")
    if world is not None and world.simulated:
        if list(ranks) != sorted(ranks):
            raise ValueError(f"group ranks {ranks} must be in increasing order: a communication "
                             "group orders its members by rank")
        name = None if len(ranks) == 1 else (GlobalComm.WORLD_COMM_GROUP if len(ranks) == world.size
                                             else _group_name(ranks))      # as a real world group is named
        return CommGroup(name, ranks, ranks.index(me), simulated=True)
    return CommGroup(_registry().name_for(ranks), ranks, ranks.index(me))


def named_group(group: CommGroup) -> Optional[str]:
    """The MindSpore group name to hand to MindSpore's own collectives for ``group``: its name, or for a
    one-rank group (which this library never communicates over, ``name`` ``None``) a group of this rank
    alone, created on first use (a simulated one: its description ``"hpms_solo_<rank>"``); ``None`` only
    where communication is not initialized (a world of one: no MindSpore collective runs there).

    Example::

        all_reduce(x, group=named_group(mesh.comm_group("dp")))     # dp of size 1: this rank alone
    """
    if group.name is not None:
        return group.name
    rank = group.ranks[0]
    if group.simulated:
        return _solo_group_name(rank)
    return _registry().solo_name(rank) if is_initialized() else None


def group_ranks(group) -> Tuple[int, ...]:
    """Global ranks of a MindSpore group name (or a :class:`CommGroup`), in group order."""
    if isinstance(group, CommGroup):
        return group.ranks
    if not isinstance(group, str):
        raise TypeError(f"a group is a MindSpore group name (str), got {group!r}")
    if not is_initialized():
        raise RuntimeError(f"cannot read the ranks of group {group!r}: communication is not initialized")
    return tuple(int(r) for r in comm_api.get_process_group_ranks(group))


def device_key(device_type: str) -> str:
    """``"cpu"`` or ``"npu"`` for a user's device type (``"Ascend"`` too), else ``ValueError``.

    Example:
        >>> device_key("Ascend"), device_key("cpu")
        ('npu', 'cpu')
    """
    key = device_type.lower() if isinstance(device_type, str) else device_type
    if key not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {sorted(DEVICE_TYPES)}, got {device_type!r}")
    return "npu" if key == "ascend" else key


def check_device_type(device_type: str, world: World) -> str:
    """The device key of ``device_type`` (see :func:`device_key`), checked against ``world``: a
    simulated world's device, else MindSpore's device target."""
    device = device_key(device_type)
    if world.simulated:       # a simulated cluster's device, not this machine's
        if device != world.device_type:
            raise ValueError(f"device_type {device_type!r} differs from the simulated world's {world.device_type!r}: "
                             "every mesh of one simulated cluster has the same device")
        return device
    target = device_target()
    if DEVICE_TYPES[device] != target:
        raise ValueError(f"device_type {device_type!r} needs MindSpore device target "
                         f"{DEVICE_TYPES[device]!r}, but it is {target!r}: call "
                         f"mindspore.set_device({DEVICE_TYPES[device]!r}) first or pick the "
                         f"matching device_type")
    return device
