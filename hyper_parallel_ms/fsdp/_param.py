"""FSDPParam: the record of one parameter a fully_shard / hsdp unit shards (FSDP2's ``FSDPParam``).

It names where the parameter is held (every ``(cell, attribute)``: a tied parameter is one
record), its full shape (this rank's local piece's, for a DTensor parameter), the data-parallel
mesh, whether it is cut on dim 0 or kept whole, where the pieces lie (:class:`Chunks`), the
DTensor spec the gathered value is read with, and the piece Parameter that replaces it (made
by :meth:`FSDPParam.make` when the unit is applied). The piece carries this record
(:func:`fsdp_param`), its sharding record (``parameter_sharding``) and the data-parallel mesh
dims its gradient is averaged over (read by ``GradientReducer``).

Example::

    record = fsdp_param(model.layers[0].up.weight)
    record.sharded, record.shape, record.chunks.piece_shape     # True, (7, 8), (4, 8) on rank 0 of 2
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, List, Optional, Tuple

from mindspore import Parameter, nn

from ..dtensor._spec import DTensorSpec
from ._chunks import Chunks
from ._pieces import new_piece

__all__ = ["FSDPParam", "fsdp_param", "is_piece", "note_piece_written", "FSDP_PARAM"]

FSDP_PARAM = "_hpms_fsdp_param"


def fsdp_param(param: Any) -> Optional["FSDPParam"]:
    """The :class:`FSDPParam` of a piece made by fully_shard / hsdp, else ``None``.

    Args:
        param: any Parameter.

    Example::

        fsdp_param(model.head.weight).mesh
    """
    return getattr(param, FSDP_PARAM, None)


def note_piece_written(param: Any) -> None:
    """A load wrote ``param``'s values: if it is a fully_shard / hsdp piece, it counts as initialised
    (``init_parameters`` leaves it alone) and its unit drops what it gathered ahead (``unshard()``,
    values kept between micro-steps), so the next forward gathers the loaded values (FSDP2 loads
    into resharded units).

    Args:
        param: any Parameter (others are left alone).

    Example::

        note_piece_written(model.head.weight)
    """
    record = fsdp_param(param)
    if record is None:
        return
    record.deferred = None
    if record.unit is not None:
        record.unit.drop_gathered()


def is_piece(param: Any) -> bool:
    """Whether ``param`` already belongs to a fully_shard / hsdp unit."""
    return fsdp_param(param) is not None


@dataclass(eq=False)
class FSDPParam:
    """One sharded (or kept whole) parameter of a unit.

    Args:
        original: the Parameter the model held.
        local: the plain Parameter whose values are cut (``original``, or a DTensor's local piece).
        holders: every ``(cell, attribute)`` holding ``original`` inside the unit.
        mesh: the data-parallel mesh (1-D, or 2-D replicate x shard).
        sharded: cut over the shard dim, on ``chunks.dim`` (else kept whole, its gradient all-reduced).
        chunks: where the pieces lie (one piece when kept whole).
        placed: the DTensor spec the gathered value is read with (``None``: a plain parameter).
    """

    original: Parameter
    local: Parameter
    holders: List[Tuple[nn.Cell, str]]
    mesh: Any
    sharded: bool
    chunks: Chunks
    placed: Optional[DTensorSpec] = None
    piece: Optional[Parameter] = None
    deferred: Optional[Parameter] = field(default=None, repr=False)   # built under no_init_parameters()
    unit: Any = field(default=None, repr=False)                       # the FSDPState holding it

    @property
    def name(self) -> str:
        return self.original.name

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.chunks.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the full (gathered) parameter."""
        return prod(self.shape) * self.local.itemsize

    def make(self, param: Parameter) -> Parameter:
        """The piece Parameter replacing ``param`` (made once; the edit engine's placement protocol)."""
        if self.piece is None:
            self.piece = new_piece(self.local, self.mesh, self.sharded, self.chunks.dim)
            object.__setattr__(self.piece, FSDP_PARAM, self)
            if self.local.has_init:
                self.deferred = self.local
        return self.piece
