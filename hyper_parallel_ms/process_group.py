"""Process groups by PyTorch's and HyperParallel's names (``init_process_group``, ``split_group``, ...),
over MindSpore's communication: a group is a MindSpore group name (``str``), the same object
:meth:`DeviceMesh.get_group` returns, and ``None`` means the world group.

Differences, by design of MindSpore's launch: msrun's environment is the rendezvous, so
``init_method`` / ``store`` are refused and ``world_size`` / ``rank`` must match it;
``init_process_group`` after the world is up checks and returns (PyTorch raises); a group is
created on its member ranks only (``split_group`` returns ``None`` on the others, as PyTorch's
``new_group`` gives non-members a non-member object).

Example::

    init_process_group()                       # under msrun
    group = split_group(split_ranks=[[0, 1], [2, 3]])
    get_process_group_ranks(group), get_group_local_rank(group), get_backend(group)
"""
from __future__ import annotations

import datetime
import warnings
from functools import lru_cache
from typing import Any, List, Optional, Sequence, Union

import numpy as np

from . import _cluster
from .comm._agreement import digest, extremes
from .comm._watchdog import set_comm_timeout
from .mesh import DeviceMesh

__all__ = ["init_process_group", "destroy_process_group", "get_process_group_ranks", "get_backend", "split_group",
           "get_group_local_rank", "mark_created_groups"]


def _ranks(group: Optional[str]) -> tuple:
    if not _cluster.is_initialized():
        raise RuntimeError("communication is not initialized: call init_process_group() (under msrun) first")
    if group is None:
        return tuple(range(_cluster.world_size()))
    return _cluster.group_ranks(group)


def init_process_group(backend: Optional[str] = None, *, init_method: Optional[str] = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, store: Any = None, pg_options: Any = None,
                       device_id: Any = None) -> None:
    """Start this process's communication (``mindspore.communication.init``) and check it against the
    arguments; a no-op check once it has started.

    Args:
        backend: ``None`` (the device's: HCCL on Ascend, MCCL on CPU) or MindSpore's backend name.
        init_method: must be ``None``: msrun's environment is the rendezvous.
        timeout: how long a rank waits for a silent peer before it ends, naming it (a
            ``datetime.timedelta`` or seconds): the communication watchdog's ``HPMS_COMM_TIMEOUT``
            for this process. MindSpore's own collective timeouts stay its environment's
            (``HCCL_EXEC_TIMEOUT``, ``MS_NODE_TIMEOUT``).
        world_size: ``-1``, or the number of ranks msrun's environment gives (else ``ValueError``).
        rank: ``-1``, or this process's rank in msrun's environment (else ``ValueError``).
        store: must be ``None``, as ``init_method``.
        pg_options: accepted, not applied (warns).
        device_id: accepted, not applied (warns; ``ms.set_device`` picks the device).

    Example::

        init_process_group()          # in a script started by msrun
    """
    if init_method is not None or store is not None:
        raise ValueError("init_process_group: init_method / store are not used with MindSpore: msrun's "
                         "environment (MS_SCHED_HOST, MS_WORKER_NUM, ...) is the rendezvous; drop them")
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"init_process_group {name} must be an int, got {value!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"init_process_group backend must be a str or None, got {backend!r}")
    seconds = None
    if timeout is not None:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ValueError(f"init_process_group timeout must be a positive datetime.timedelta or number of "
                             f"seconds, got {timeout!r}")
    ignored = [n for n, v in (("pg_options", pg_options), ("device_id", device_id)) if v is not None]
    if ignored:
        warnings.warn(f"init_process_group: {', '.join(ignored)} not applied: MindSpore reads them from its "
                      "environment (ms.set_device)", stacklevel=2)
    _cluster.init_world(backend)
    size, me = _cluster.world_size(), _cluster.world_rank()
    if world_size not in (-1, size) or rank not in (-1, me):
        raise ValueError(f"init_process_group(world_size={world_size}, rank={rank}): this process is rank {me} "
                         f"of {size} (msrun's environment); launch with that many workers, or drop the arguments")
    if seconds is not None:
        set_comm_timeout(seconds)


def destroy_process_group(group: Optional[str] = None) -> None:
    """End this process's communication, or destroy one group.

    Args:
        group: ``None``: end communication (``mindspore.communication.release``); a group name: destroy
            that group (created by this process; not the world group).

    Example::

        destroy_process_group()       # at the end of a script
    """
    if group is None:
        _cluster.release_world()
        return
    if not isinstance(group, str):
        raise TypeError(f"a group is a MindSpore group name (str), got {group!r}")
    _cluster.destroy_group(group)


_OP_NAMES = {"sum": "sum", "avg": "avg", "mean": "avg", "max": "max", "min": "min"}


def reduce_op_name(op: Any, caller: str) -> str:
    """This library's reduce op (``"sum"``, ``"avg"``, ``"max"``, ``"min"``) for a reduction named by a
    string or a ``mindspore.ops.ReduceOp`` value (``"mean"`` is ``"avg"``), for collectives called
    by a group's name; anything else is refused naming ``caller``.

    >>> reduce_op_name("mean", "all_reduce")
    'avg'
    """
    key = str(getattr(op, "name", op)).lower()
    if key not in _OP_NAMES:
        raise ValueError(f"{caller}: op {op!r} is not one of {sorted(_OP_NAMES)}")
    return _OP_NAMES[key]


def group_mesh(group: Optional[str] = None) -> DeviceMesh:
    """A 1-D mesh over a group's ranks (cached per world and ranks), for this library's
    collectives on a group known by its name only.

    Example::

        comm.all_reduce(x, group_mesh(mesh.get_group("tp")))
    """
    return _mesh_of(_cluster.current_world(), _ranks(group))


@lru_cache(maxsize=64)
def _mesh_of(world: _cluster.World, ranks: tuple) -> DeviceMesh:
    return DeviceMesh(world.device_type, list(ranks), _world=world)


def get_process_group_ranks(group: Optional[str] = None) -> List[int]:
    """The global ranks of a group, in group order.

    Args:
        group: a MindSpore group name; ``None``: the world.

    Example::

        get_process_group_ranks(mesh.get_group("tp"))      # [0, 1] on ranks 0 and 1 of a (2, 2) mesh
    """
    return list(_ranks(group))


def get_group_local_rank(group: Optional[str] = None) -> int:
    """This rank's index in a group.

    Args:
        group: a MindSpore group name holding this rank; ``None``: the world (the global rank).

    Example::

        get_group_local_rank(mesh.get_group("tp"))          # mesh.get_local_rank("tp")
    """
    ranks = _ranks(group)
    me = _cluster.world_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not in group {group!r} (ranks {list(ranks)})")
    return ranks.index(me)


def get_backend(group: Optional[str] = None) -> str:
    """``"hccl"`` on Ascend, ``"mccl"`` on CPU ranks (MindSpore's own ``get_backend`` says ``"hccl"`` on
    both).

    Args:
        group: a MindSpore group name (checked to be one this rank can see); ``None``: the world.

    Example::

        get_backend()                 # 'mccl' on CPU ranks
    """
    _ranks(group)
    return "hccl" if _cluster.device_type() == "npu" else "mccl"


def split_group(parent_pg: Optional[str] = None, split_ranks: Optional[Sequence[Sequence[int]]] = None,
                timeout: Any = None, pg_options: Any = None, group_desc: Optional[str] = None) -> Optional[str]:
    """Groups of ranks, each created on its members only; returns the group holding this rank.

    Args:
        parent_pg: the group the lists split (``None``: the world).
        split_ranks: disjoint lists of global ranks within ``parent_pg``, the same on every rank.
        timeout: accepted, not used (MindSpore's environment sets it).
        pg_options: accepted, not used.
        group_desc: accepted, not used (the group's name is derived from its ranks).

    Returns:
        The name of the group holding this rank; ``None`` where no list holds it, or where its list is
        this rank alone (no communicator).

    Example::

        split_group(split_ranks=[[0, 1], [2, 3]])           # ranks 0, 1: their group's name
    """
    del timeout, pg_options, group_desc
    if not split_ranks:
        raise ValueError("split_group: split_ranks cannot be None or empty")
    parent = set(_ranks(parent_pg))
    seen: set = set()
    lists = []
    for ranks in split_ranks:
        ranks = [int(r) for r in ranks]
        if not ranks or sorted(set(ranks)) != sorted(ranks):
            raise ValueError(f"split_group: each list must be non-empty without repeats, got {ranks}")
        if not set(ranks) <= parent:
            raise ValueError(f"split_group: ranks {sorted(set(ranks) - parent)} are not in the parent group "
                             f"{sorted(parent)}")
        if seen & set(ranks):
            raise ValueError(f"split_group: rank(s) {sorted(seen & set(ranks))} appear in two lists")
        seen |= set(ranks)
        lists.append(sorted(ranks))
    _check_agreed(sorted(parent), lists)
    me = _cluster.world_rank()
    mine = [ranks for ranks in lists if me in ranks]
    return _cluster.comm_group(mine[0]).name if mine else None


def _check_agreed(parent: Sequence[int], lists: Sequence[Sequence[int]]) -> None:
    """Raise on every rank of ``parent`` if they were given different ``split_ranks`` (a rank creating a
    group its peers do not would hang there)."""
    mesh = DeviceMesh(_cluster.device_type(), list(parent))
    high, low = extremes(np.array(digest(repr(sorted(lists))), np.float32), mesh)
    if (high != low).any():
        raise ValueError(f"split_group: the ranks {list(parent)} were given different split_ranks (this rank: "
                         f"{sorted(lists)}); give the same lists on every rank")


def mark_created_groups(process_group: Union[str, Sequence[str]]) -> None:
    """Record groups created outside this package (``mindspore.communication.create_group``) as their
    ranks' groups, so that meshes and :func:`split_group` over the same ranks use them.

    Args:
        process_group: a group name, or a list of them.

    Example::

        create_group("tp_0", [0, 1]); mark_created_groups("tp_0")
    """
    for name in ([process_group] if isinstance(process_group, str) else list(process_group)):
        if not isinstance(name, str):
            raise TypeError(f"a group is a MindSpore group name (str), got {name!r}")
        _cluster.adopt_group(name)
