"""DTensorSpec: the mesh, the layout and the global shape of a distributed tensor.

Placements may be given per mesh dim (``[Shard(0), Replicate()]``) or, as in MindSpore's
``Layout``, per tensor dim with mesh dim names (``("dp", "None")``, ``(("dp", "tp"), "None")``).

Example::

    spec = DTensorSpec.build(mesh, [Shard(0), Replicate()], (8, 4))
    spec.local_shape()            # this rank's piece, e.g. (4, 4)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..layout import Layout
from ..placement import Placement
from ..redistribute import execute, lower, plan_redistribute

__all__ = ["DTensorSpec", "to_layout", "spec_of"]


def to_layout(mesh, placements: Sequence, ndim: int) -> Layout:
    """The normalised layout of ``placements`` (per mesh dim, alias entries per tensor dim, or a Layout)."""
    if placements is None:
        raise ValueError("placements are required: one Shard/Replicate/Partial per mesh dim, or one alias "
                         "entry per tensor dim")
    if isinstance(placements, Layout):
        if placements.mesh_shape != tuple(mesh.shape):
            raise ValueError(f"layout {placements!r} is for a mesh of shape {placements.mesh_shape}, not {mesh.shape}")
        return Layout(mesh.shape, placements.placements, mesh_dim_names=mesh.mesh_dim_names,
                      shard_order=dict(placements.shard_order)).normalized(ndim)
    entries = tuple(placements) if not isinstance(placements, (str, Placement)) else (placements,)
    if entries and all(isinstance(p, Placement) for p in entries):
        if len(entries) != mesh.ndim:
            raise ValueError(f"expected {mesh.ndim} placements for the {mesh.ndim}-D mesh {mesh.shape}, got "
                             f"{len(entries)}: ({', '.join(str(p) for p in entries)})")
        layout = Layout(mesh.shape, entries, mesh_dim_names=mesh.mesh_dim_names)
    elif any(isinstance(p, Placement) for p in entries):
        raise TypeError(f"placements mix Placement objects and alias names: {entries}; use one form")
    else:
        if not mesh.mesh_dim_names:
            raise ValueError(f"alias placements {entries} need a mesh with mesh_dim_names")
        if len(entries) != ndim:
            raise ValueError(f"alias placements {entries} need one entry per tensor dim ({ndim}), got {len(entries)}")
        layout = Layout.from_alias(mesh.shape, mesh.mesh_dim_names, entries)
    return layout.normalized(ndim)


@dataclass(frozen=True, eq=False)
class DTensorSpec:
    """Where a distributed tensor lives. Hashable (the hash is kept: specs key the ops
    dispatcher's cache on every call).

    Args:
        mesh: the :class:`DeviceMesh`.
        layout: the :class:`Layout` (placements, sharding order).
        shape: the global shape.

    Example::

        spec = DTensorSpec.build(mesh, [Shard(0)], (8, 4))    # DTensorSpec(mesh, Layout(...), (8, 4))
    """

    mesh: object
    layout: Layout
    shape: Tuple[int, ...]

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DTensorSpec):
            return NotImplemented
        return self.layout == other.layout and self.shape == other.shape and self.mesh == other.mesh

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.mesh, self.layout, self.shape))
            object.__setattr__(self, "_hash", cached)
        return cached

    @classmethod
    def build(cls, mesh, placements: Sequence, shape: Sequence[int]) -> "DTensorSpec":
        shape = tuple(int(s) for s in shape)
        return cls(mesh, to_layout(mesh, placements, len(shape)), shape)

    @property
    def placements(self) -> Tuple[Placement, ...]:
        return self.layout.placements

    def local_shape(self, coordinate: Optional[Tuple[int, ...]] = None) -> Tuple[int, ...]:
        """Shape of the piece held at ``coordinate`` (this rank's by default)."""
        return self.layout.local_shape(self.shape, coordinate or self.mesh.coordinate)

    def with_layout(self, layout: Layout) -> "DTensorSpec":
        return DTensorSpec(self.mesh, layout, self.shape)

    def piece_of(self, full):
        """This rank's piece (own storage) of ``full``, the whole tensor replicated on every rank
        (Partial dims: PyTorch's partition)."""
        replicated = Layout.replicated(self.mesh.shape, self.mesh.mesh_dim_names)
        steps = lower(plan_redistribute(replicated, self.layout, self.shape), self.mesh.coordinate, self.shape)
        return execute(full, self.mesh, steps).copy()  # own storage: a view would alias ``full``


def spec_of(obj) -> Optional[DTensorSpec]:
    """The :class:`DTensorSpec` of a DTensor (a ``Parameter(DTensor)`` too); ``None`` for
    anything else (a plain Tensor, a local view of a DTensor, a non-tensor). Lets code below
    the DTensor class (the ops dispatcher) tell DTensors apart without importing it.

    >>> spec_of(3) is None
    True
    """
    spec = getattr(obj, "_dt_spec", None)
    return spec if isinstance(spec, DTensorSpec) else None
