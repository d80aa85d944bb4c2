"""DeviceMesh: an n-D arrangement of ranks with one communication group per dimension.

Follows ``torch.distributed.device_mesh``: ``init_device_mesh(device_type, shape,
mesh_dim_names=...)`` lays the world's ranks out row-major; ``mesh["tp"]`` and
``mesh["dp", "tp"]`` give the sub-mesh that contains this rank. Building a mesh
creates, on this rank, the group of each mesh-dimension slice it belongs to (once:
groups are cached by rank set, names are deterministic). Communication must be
initialized first (``mindspore.communication.init()``, as under msrun); a lone process
has a world of one rank and needs no communication at all.

Both anchors' surfaces are here: PyTorch's ``with mesh:`` (the current mesh, which
``parallelize_module`` takes when given none; see :func:`current_mesh`), ``_flatten``, and
HyperParallel's ``mesh_shape``, ``rank_list``, :meth:`DeviceMesh.from_group` and
``init_device_mesh(..., rank_list=..., init_backend=...)``.

The rank a mesh describes is a property of the mesh: ``init_device_mesh(..., simulate=(world_size,
rank))`` builds the mesh as rank ``rank`` of a simulated cluster of ``world_size`` ranks sees it,
in this process and without communication (:attr:`DeviceMesh.is_simulated`). Every layer above
reads the rank from the mesh, so styles, ``fully_shard``, pipeline stages and checkpoint plans
built on it are rank ``rank``'s; collectives over it are recorded (``CommDebugMode``), not run,
and return tensors of the right shape and dtype (zeros). Sub-meshes and meshes built while
:func:`hyper_parallel_ms._cluster.simulating` a world belong to the same simulated world.
Communication goes through the mesh's :attr:`DeviceMesh.exchange` (the cluster's, or the
simulated world's): the layers above ``comm`` ask its properties (:attr:`DeviceMesh.holds_values`),
never whether the mesh is simulated.

Example:
    >>> from hyper_parallel_ms.mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    >>> mesh.shape, mesh.get_coordinate(), mesh["tp"].size()
    ((1,), [0], 1)
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _cluster, _mesh_context
from ._cluster import CommGroup, World, named_group
from ._mesh_context import current_mesh, get_current_mesh
from ._mesh_hyper import HyperParallelMeshMixin
from .comm._exchange import Exchange, exchange_of

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh", "get_current_mesh", "mesh_world"]

MeshDim = Union[int, str]


class DeviceMesh(HyperParallelMeshMixin):
    """Ranks laid out as an n-D array, with names and per-dimension groups.

    Args:
        device_type: ``"cpu"`` or ``"npu"`` (Ascend); must match MindSpore's device target.
        mesh: nested sequence / array of global ranks, e.g. ``[[0, 1], [2, 3]]``.
        mesh_dim_names: optional distinct names, one per dimension.
        _init_backend: create this rank's communication groups (default). ``False`` builds a
            mesh for planning only: its collectives and :meth:`get_group` raise.
        _world: the cluster place it is seen from (default: :func:`~hyper_parallel_ms._cluster.current_world`);
            a simulated world makes a simulated mesh.

    Example:
        >>> m = DeviceMesh("cpu", [0])
        >>> m.ndim, m.size(), m.get_local_rank(0)
        (1, 1, 0)
    """

    def __init__(self, device_type: str, mesh: Union[Sequence, np.ndarray], *,
                 mesh_dim_names: Optional[Sequence[str]] = None, _init_backend: bool = True,
                 _world: Optional[World] = None) -> None:
        self._world = _cluster.current_world() if _world is None else _world
        self.device_type = _cluster.check_device_type(device_type, self._world)
        ranks = np.array(mesh, dtype=np.int64)
        if ranks.ndim == 0 or ranks.size == 0:
            raise ValueError(f"mesh must be a non-empty n-D array of ranks, got {mesh!r}")
        world = self._world.size
        flat = ranks.ravel().tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"mesh {ranks.tolist()} lists a rank more than once")
        bad = [r for r in flat if not 0 <= r < world]
        if bad:
            raise ValueError(f"mesh {ranks.tolist()} has ranks {bad} outside the world of {world} ranks")
        names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        if names is not None:
            if len(names) != ranks.ndim:
                raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {ranks.ndim}-D mesh")
            if any(not isinstance(n, str) or not n for n in names):
                raise ValueError(f"mesh_dim_names must be non-empty strings, got {names}")
            if len(set(names)) != len(names):
                raise ValueError(f"mesh_dim_names must be distinct, got {names}")
        ranks.setflags(write=False)
        self._hash: Optional[int] = None
        self._ranks = ranks
        self._names = names
        where = np.argwhere(ranks == self._world.rank)
        self._coordinate = tuple(int(c) for c in where[0]) if len(where) else None
        self._flattened: Dict[str, "DeviceMesh"] = {}
        self._flat_dims: Dict[str, Tuple[int, ...]] = {}    # flattened name -> the dims of this mesh it spans
        self._root: Optional["DeviceMesh"] = None           # the mesh this one was sliced from (PyTorch's root)
        self._root_dims: Tuple[int, ...] = tuple(range(ranks.ndim))   # ... and its dims there
        self._init_backend = bool(_init_backend)
        self._groups: Tuple[Optional[CommGroup], ...] = tuple(
            _cluster.comm_group(self._slice_ranks(d), self._world) if self._coordinate is not None
            and self._init_backend else None for d in range(ranks.ndim))

    # ------------------------------------------------------------- geometry
    @property
    def mesh(self) -> np.ndarray:
        """The (read-only) array of global ranks."""
        return self._ranks

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._ranks.shape)

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        """HyperParallel's name for :attr:`shape`."""
        return self.shape

    @property
    def rank_list(self) -> Tuple[int, ...]:
        """The mesh's global ranks, flattened row-major (HyperParallel).

        Example:
            >>> DeviceMesh("cpu", [[0]]).rank_list
            (0,)
        """
        return tuple(int(r) for r in self._ranks.ravel())

    @property
    def ndim(self) -> int:
        return self._ranks.ndim

    @property
    def mesh_dim_names(self) -> Optional[Tuple[str, ...]]:
        return self._names

    def size(self, mesh_dim: Optional[MeshDim] = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``."""
        return int(self._ranks.size) if mesh_dim is None else self.shape[self.dim_index(mesh_dim)]

    def get_rank(self) -> int:
        """The global rank this mesh is seen from (this process's, or the simulated one)."""
        return self._world.rank

    @property
    def rank(self) -> int:
        """HyperParallel's name for :meth:`get_rank`."""
        return self.get_rank()

    @property
    def root_mesh(self) -> Optional["DeviceMesh"]:
        """The mesh this one was sliced from (HyperParallel's; ``None`` for a root mesh).

        Example:
            >>> m = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "tp"))
            >>> m["tp"].root_mesh is m, m.root_mesh is None
            (True, True)
        """
        return self._root

    @property
    def is_simulated(self) -> bool:
        """Whether the mesh is rank :meth:`get_rank` of a simulated cluster (no communication).

        Example:
            >>> init_device_mesh("npu", (4, 2), simulate=(8, 5)).is_simulated
            True
        """
        return self._world.simulated

    @property
    def exchange(self) -> Exchange:
        """How this mesh's ranks exchange data (:mod:`hyper_parallel_ms.comm._exchange`): the
        cluster's collectives and point-to-point calls, or, on a simulated mesh, the simulated
        world's (nothing sent). ``comm`` goes through it.

        Example:
            >>> init_device_mesh("cpu", (1,)).exchange.moves
            True
        """
        return exchange_of(self._world)

    @property
    def holds_values(self) -> bool:
        """Whether tensors and parameters on this mesh hold values (``False`` on a simulated mesh:
        its ranks plan on shapes only, parameters are pieces without data).

        Example:
            >>> init_device_mesh("npu", (4,), simulate=(4, 1)).holds_values
            False
        """
        return self.exchange.holds_values

    @property
    def device_target(self) -> str:
        """MindSpore's name of the mesh's device, ``"CPU"`` or ``"Ascend"`` (the collectives'
        implementation follows it; a simulated ``"npu"`` mesh plans Ascend's on any machine)."""
        return _cluster.DEVICE_TYPES[self.device_type]

    def get_coordinate(self) -> Optional[List[int]]:
        """This rank's index along every mesh dim, a new list (PyTorch's), ``None`` if it is not in
        the mesh; :attr:`coordinate` is the same as a tuple."""
        return None if self._coordinate is None else list(self._coordinate)

    @property
    def coordinate(self) -> Optional[Tuple[int, ...]]:
        """This rank's index along every mesh dim as a tuple (hashable: a key, an argument of cached
        planning), ``None`` if it is not in the mesh.

        Example:
            >>> from hyper_parallel_ms.mesh import init_device_mesh
            >>> init_device_mesh("cpu", (1,)).coordinate
            (0,)
        """
        return self._coordinate

    def get_local_rank(self, mesh_dim: Optional[MeshDim] = None) -> int:
        """This rank's index along ``mesh_dim`` (may be omitted for a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank needs mesh_dim for a {self.ndim}-D mesh")
            mesh_dim = 0
        return self._member_coordinate()[self.dim_index(mesh_dim)]

    def dim_index(self, mesh_dim: MeshDim) -> int:
        """Index of a mesh dim given by index (negative allowed) or name."""
        if isinstance(mesh_dim, str):
            if not self._names or mesh_dim not in self._names:
                raise KeyError(f"mesh dim name {mesh_dim!r} not found; the mesh has dims "
                               f"{self._names if self._names else 'without names'}")
            return self._names.index(mesh_dim)
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, (int, np.integer)):
            raise TypeError(f"mesh_dim must be an int or a name, got {mesh_dim!r}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} out of range for a {self.ndim}-D mesh")
        return int(mesh_dim) % self.ndim

    # --------------------------------------------------------------- groups
    def comm_group(self, mesh_dim: MeshDim = 0) -> CommGroup:
        """The group of ranks that differ from this rank only along ``mesh_dim`` (a name made by
        ``_flatten`` on this mesh or a sub-mesh of it: the flattened dims' group, as HyperParallel's)."""
        if isinstance(mesh_dim, str) and mesh_dim in self._flattened and mesh_dim not in (self._names or ()):
            return self._flattened[mesh_dim].comm_group(0)
        group = self._groups[self.dim_index(mesh_dim)]
        if group is None:
            if not self._init_backend and self._coordinate is not None:
                raise RuntimeError(f"{self!r} was built with init_backend=False: it has no communication "
                                   "groups; build it with init_backend=True to run collectives on it")
            raise RuntimeError(f"rank {self.get_rank()} is not in {self!r}: it has no group here")
        return group

    def get_group(self, mesh_dim: Optional[MeshDim] = None) -> Optional[str]:
        """MindSpore group name of ``mesh_dim`` (size 1: a group of this rank alone, as MindSpore reads
        ``None`` as the world; ``None`` only without communication); ``mesh_dim`` may be omitted for a
        1-D mesh, as in PyTorch."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(f"get_group needs mesh_dim for a {self.ndim}-D mesh")
            mesh_dim = 0
        return named_group(self.comm_group(mesh_dim))

    def get_all_groups(self) -> List[Optional[str]]:
        """Group names of every mesh dimension."""
        return [self.get_group(d) for d in range(self.ndim)]

    def _slice_ranks(self, dim: int) -> Tuple[int, ...]:
        index = list(self._coordinate)
        index[dim] = slice(None)
        return tuple(int(r) for r in self._ranks[tuple(index)])

    def _member_coordinate(self) -> Tuple[int, ...]:
        if self._coordinate is None:
            raise RuntimeError(f"rank {self.get_rank()} is not in {self!r}")
        return self._coordinate

    # ------------------------------------------------------------ sub-meshes
    def __getitem__(self, names: Union[str, Sequence[str]]) -> "DeviceMesh":
        """Sub-mesh over the named dims (in mesh order) that contains this rank. A name made by
        ``_flatten`` on this mesh or on a sub-mesh of it stands for the dims it joined (PyTorch's
        ``mesh["dp_cp"]`` after ``mesh["dp", "cp"]._flatten("dp_cp")``), also beside other names when
        its dims are adjacent: ``mesh["pp", "dp_cp"]``.

        Example:
            >>> m = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "tp"))
            >>> m["tp"].mesh_dim_names, m["dp", "tp"].shape
            (('tp',), (1, 1))
        """
        if isinstance(names, str) and names in self._flattened:
            return self._flattened[names]
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if not self._names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names: build it with "
                               "init_device_mesh(..., mesh_dim_names=(...)) to slice it by name")
        if not wanted:
            raise KeyError("give at least one mesh dim name")
        groups = []
        for n in wanted:
            if n in self._flat_dims:
                groups.append(self._flat_dims[n])
            elif n in self._names:
                groups.append((self._names.index(n),))
            else:
                raise KeyError(f"mesh dim name {n!r} not found; the mesh has dims {self._names}"
                               + (f" and the flattened dims {tuple(self._flat_dims)}" if self._flat_dims else ""))
        dims = [d for g in groups for d in g]
        if len(set(dims)) != len(dims):
            raise KeyError(f"mesh dim names repeat in {wanted} (a flattened name covers {self._flat_dims})")
        if dims != sorted(dims):
            raise KeyError(f"mesh dim names {wanted} must follow the mesh's order {self._names}")
        joined = [g for g in groups if len(g) > 1]
        if any(g != tuple(range(g[0], g[0] + len(g))) for g in joined) and len(wanted) > 1:
            raise KeyError(f"a flattened dim in {wanted} joins dims that are not adjacent in {self._names}: "
                           "it can only be taken alone")
        coord = self._member_coordinate()
        index = tuple(slice(None) if d in dims else coord[d] for d in range(self.ndim))
        ranks = self._ranks[index].reshape(tuple(int(np.prod([self.shape[d] for d in g])) for g in groups))
        sub = DeviceMesh(self.device_type, ranks, mesh_dim_names=wanted, _init_backend=self._init_backend,
                         _world=self._world)
        root = self._root if self._root is not None else self
        if all(len(g) == 1 for g in groups):
            sub._root, sub._root_dims = root, tuple(self._root_dims[d] for d in dims)
        return sub

    def _flatten(self, mesh_dim_name: Optional[str] = None) -> "DeviceMesh":
        """This mesh's ranks as a 1-D mesh named ``mesh_dim_name`` (default: the dim names
        joined by ``_``), also reachable afterwards as ``self[mesh_dim_name]`` and, for a sub-mesh,
        as ``root[mesh_dim_name]`` on the mesh it was sliced from (PyTorch).

        Example:
            >>> m = DeviceMesh("cpu", [[0]], mesh_dim_names=("dp", "tp"))
            >>> flat = m._flatten()
            >>> flat.mesh_dim_names, m["dp_tp"] is flat
            (('dp_tp',), True)
        """
        if mesh_dim_name is None:
            mesh_dim_name = "_".join(self._names) if self._names else "flat"
        if self._names and mesh_dim_name in self._names:
            raise ValueError(f"{mesh_dim_name!r} already names a dim of {self!r}; pick another name")
        root = self._root if self._root is not None else self
        spans = self._root_dims
        if root._flat_dims.get(mesh_dim_name, spans) != spans or (root._names and mesh_dim_name in root._names):
            raise ValueError(f"{mesh_dim_name!r} already names other dims of the mesh {root!r}; pick another name")
        flat = self._flattened.get(mesh_dim_name)
        if flat is None:
            flat = root._flattened.get(mesh_dim_name) if root._flat_dims.get(mesh_dim_name) == spans else None
        if flat is None:
            flat = DeviceMesh(self.device_type, self._ranks.ravel(), mesh_dim_names=(mesh_dim_name,),
                              _init_backend=self._init_backend, _world=self._world)
        self._flattened[mesh_dim_name] = flat
        if root is not self or len(spans) > 1:
            root._flattened[mesh_dim_name], root._flat_dims[mesh_dim_name] = flat, spans
        return flat

    @staticmethod
    def from_group(group, device_type: str, mesh: Optional[Union[Sequence, np.ndarray]] = None,
                   mesh_dim_names: Optional[Sequence[str]] = None) -> "DeviceMesh":
        """A mesh over existing communication groups (HyperParallel / PyTorch).

        ``group``: one MindSpore group name (a 1-D mesh of its ranks; ``mesh``, if given,
        must list the same ranks), or a list with one group name per mesh dim, where
        ``mesh`` (the n-D array of ranks) is required and each group must hold the ranks of
        this rank's slice along its dim. The mesh's collectives run over groups of the same
        ranks.

        Example::

            tp = DeviceMesh.from_group("tp_group", "npu", mesh_dim_names=("tp",))
            mesh2d = DeviceMesh.from_group(["dp_group", "tp_group"], "npu", mesh=[[0, 1], [2, 3]],
                                           mesh_dim_names=("dp", "tp"))
        """
        if not isinstance(group, (list, tuple)):
            ranks = _cluster.group_ranks(group)
            if mesh is not None and np.array(mesh).ravel().tolist() != list(ranks):
                raise ValueError(f"mesh {np.array(mesh).tolist()} must list the ranks of group {group!r}: "
                                 f"{list(ranks)}")
            return DeviceMesh(device_type, list(ranks), mesh_dim_names=mesh_dim_names)
        if not group:
            raise ValueError("from_group needs at least one group")
        if mesh is None:
            raise ValueError("from_group with a list of groups needs mesh, the n-D array of their ranks")
        out = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)
        if out.ndim != len(group):
            raise ValueError(f"{len(group)} groups for a {out.ndim}-D mesh: give one group per mesh dim")
        for d, g in enumerate(group):
            want = out._slice_ranks(d)
            if tuple(_cluster.group_ranks(g)) != want:
                raise ValueError(f"group {g!r} has ranks {list(_cluster.group_ranks(g))}, but mesh dim {d} of "
                                 f"{out!r} groups this rank with {list(want)}")
        return out

    # ---------------------------------------------------------- current mesh
    def __enter__(self) -> "DeviceMesh":
        """``with mesh:`` makes this the current mesh (see :func:`current_mesh`)."""
        _mesh_context.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        _mesh_context.leave()

    # ------------------------------------------------------------ value-ish
    def _key(self):
        return (self.device_type, self.shape, tuple(self._ranks.ravel().tolist()), self._names, self._world)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names}" if self._names else ""
        seen = f", simulated rank {self._world.rank} of {self._world.size}" if self._world.simulated else ""
        return f"DeviceMesh({self.device_type!r}, {self._ranks.tolist()}{names}{seen})"


def init_device_mesh(device_type: Optional[str] = None, mesh_shape: Optional[Sequence[int]] = None, *,
                     mesh_dim_names: Optional[Sequence[str]] = None, rank_list: Optional[Sequence[int]] = None,
                     init_backend: bool = True, simulate: Optional[Tuple[int, int]] = None,
                     alias_name: Optional[Sequence[str]] = None) -> DeviceMesh:
    """A mesh of all ranks (or of ``rank_list``) laid out row-major in ``mesh_shape``.

    ``init_backend=False`` (HyperParallel) builds the mesh without communication groups,
    for planning; collectives on it raise. ``simulate=(world_size, rank)`` builds the mesh
    that rank ``rank`` of a cluster of ``world_size`` ranks builds, in this process, with no
    communication at all: its collectives are recorded and return placeholders of the right
    shape and dtype (see the module docstring); ``device_type`` is then the simulated
    cluster's (``"npu"`` plans Ascend's collectives on a CPU machine).

    Args:
        device_type: ``"cpu"`` or ``"npu"`` / ``"Ascend"``: the device of the ranks (``None``: MindSpore's
            device target; a simulated cluster needs it named).
        mesh_shape: ranks per mesh dimension, e.g. ``(2, 4)``; its product is the world size (or
            ``len(rank_list)``).
        mesh_dim_names: one name per mesh dimension (``("dp", "tp")``), for ``mesh["tp"]`` and alias layouts.
        rank_list: the ranks of the mesh, row-major (default: every rank of the job).
        init_backend: ``False`` builds the mesh without communication groups (planning only).
        simulate: ``(world_size, rank)``: the mesh as seen by ``rank`` of a simulated cluster of
            ``world_size`` ranks (default: this process's place in the cluster).
        alias_name: HyperParallel's earlier name of ``mesh_dim_names`` (give one of the two).

    Example:
        >>> init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")).mesh.tolist()
        [[0]]
        >>> init_device_mesh("cpu", (1,), rank_list=[0], init_backend=False).rank_list
        (0,)
        >>> mesh = init_device_mesh("npu", (2, 4), mesh_dim_names=("dp", "tp"), simulate=(8, 6))
        >>> mesh.get_coordinate(), mesh["tp"].rank_list
        ([1, 2], (4, 5, 6, 7))
        >>> init_device_mesh(mesh_shape=(1,), alias_name=("dp",))      # HyperParallel's earlier form
        DeviceMesh('cpu', [0], mesh_dim_names=('dp',))
    """
    if mesh_shape is None:
        raise TypeError("init_device_mesh needs mesh_shape, e.g. init_device_mesh(\"cpu\", (2, 2))")
    if alias_name is not None:
        if mesh_dim_names is not None:
            raise ValueError("give mesh_dim_names or alias_name (its earlier name), not both")
        mesh_dim_names = alias_name
    if device_type is None:
        if simulate is not None:
            raise ValueError("a simulated cluster needs its device_type named (\"npu\" or \"cpu\")")
        device_type = {v: k for k, v in _cluster.DEVICE_TYPES.items() if k != "ascend"}[_cluster.device_target()]
    shape = tuple(mesh_shape) if not isinstance(mesh_shape, int) else (mesh_shape,)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}")
    world = _cluster.current_world() if simulate is None else _simulated_world(simulate, device_type)
    if rank_list is None:
        if int(np.prod(shape)) != world.size:
            raise ValueError(f"mesh_shape {shape} holds {int(np.prod(shape))} ranks but the world has "
                             f"{world.size}; the product of the mesh shape must equal the world size")
        ranks = np.arange(world.size)
    else:
        ranks = np.array(list(rank_list), dtype=np.int64)
        if ranks.size != int(np.prod(shape)):
            raise ValueError(f"rank_list has {ranks.size} ranks but mesh_shape {shape} holds {int(np.prod(shape))}")
    return DeviceMesh(device_type, ranks.reshape(shape), mesh_dim_names=mesh_dim_names, _init_backend=init_backend,
                      _world=world)


def _simulated_world(simulate, device_type: str) -> World:
    if not isinstance(simulate, (tuple, list)) or len(simulate) != 2:
        raise ValueError(f"simulate must be (world_size, rank), got {simulate!r}")
    size, rank = simulate
    return World(size, rank, simulated=True, device_type=_cluster.device_key(device_type))


def mesh_world(mesh: DeviceMesh) -> World:
    """The cluster place ``mesh`` is seen from (for layers that build meshes from meshes).

    Args:
        mesh: a :class:`DeviceMesh`.

    Example:
        >>> mesh_world(init_device_mesh("cpu", (4,), simulate=(4, 2))).rank
        2
    """
    return mesh._world
