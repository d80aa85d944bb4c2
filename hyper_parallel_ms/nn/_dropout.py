"""Dropout Cells on sharded activations: the single device's mask, cut like the activation.

A dropout Cell under :class:`SequenceParallel` receives this rank's piece of an activation
split along one dim. Run as it is, it would draw a mask of the piece's shape from the same
stream on every rank (every rank the same mask, none of them the single device's). The Cell's
class is therefore swapped for one that places the piece in zeros of the whole shape, runs
the Cell's own dropout on that, and keeps its piece: the mask, the kernel's arithmetic and the
random state's advance are the single device's (MindSpore's kernels draw by position, with no
offset into the stream to start from; see :mod:`hyper_parallel_ms.ops._rules.random`). Plain
tensor ops only, so PyNative and compiled graphs alike.

Example::

    parallelize_module(block, mesh["tp"], {"dropout": SequenceParallel()})
"""
from __future__ import annotations

from typing import Dict, Tuple

from mindspore import mint, nn

from .._mindspore import cell_subclass, run_in_python
from ..ops._rules.random import piece, placed, refuse_ignored_seeds

__all__ = ["DROPOUT_CELLS", "is_dropout", "sharded_dropout_class", "check_dropout_seeded", "check_dropouts_seeded",
           "dropouts_inside"]

DROPOUT_CELLS: Tuple[type, ...] = (nn.Dropout, mint.nn.Dropout)
_PRIMITIVE_DROPOUT = (nn.Dropout,)          # the Dropout primitive with seeds fixed at construction


def is_dropout(cell: nn.Cell) -> bool:
    """Whether ``cell`` is a dropout Cell whose masks this module knows how to cut."""
    return isinstance(cell, DROPOUT_CELLS)


def _drops(cell: nn.Cell) -> bool:
    p = getattr(cell, "p", None)
    return p is None or p > 0


def check_dropout_seeded(cell: nn.Cell, where: str) -> None:
    """Refuse a dropout Cell whose masks cannot be the same on every rank: ``nn.Dropout``
    built before any ``ms.set_seed`` (its kernel picks a seed per process) or on Ascend
    (where its primitive ignores seeds)."""
    if not isinstance(cell, _PRIMITIVE_DROPOUT) or not _drops(cell):
        return
    refuse_ignored_seeds(where)
    seeds = (cell.dropout.attrs.get("Seed0", 0), cell.dropout.attrs.get("Seed1", 0))
    if seeds == (0, 0):
        raise ValueError(f"{where}: the nn.Dropout was built before any ms.set_seed, so each rank's kernel picks its "
                         "own seed and ranks holding one activation (whole or in pieces) would draw unrelated masks; "
                         "call ms.set_seed(s) (the same on every rank) before building the model")


def dropouts_inside(cell: nn.Cell) -> Tuple[str, ...]:
    """Names (relative to ``cell``) of the dropout Cells below ``cell`` that drop something."""
    return tuple(name for name, sub in cell.cells_and_names() if name and is_dropout(sub) and _drops(sub))


def check_dropouts_seeded(module: nn.Cell, engine: str) -> None:
    """:func:`check_dropout_seeded` for every dropout Cell in ``module`` (itself included): under
    tensor parallelism each sees an activation that several ranks hold (whole or in pieces)."""
    for name, sub in module.cells_and_names():
        if is_dropout(sub):
            check_dropout_seeded(sub, f"{engine}: the dropout Cell '{name or '<root>'}'")


@run_in_python
def _box(shape: Tuple[int, ...], dim: int, parts: int, index: int):
    """``(starts, whole shape)`` of the piece ``index`` of ``parts`` even pieces along ``dim``."""
    dim = dim % len(shape)
    starts = tuple(index * shape[d] if d == dim else 0 for d in range(len(shape)))
    whole = tuple(shape[d] * parts if d == dim else shape[d] for d in range(len(shape)))
    return starts, whole


def sharded_dropout_class(base: type) -> type:
    """A subclass of the dropout Cell ``base`` that takes the piece ``hpms_dropout_index`` of
    ``hpms_dropout_parts`` even pieces along ``hpms_dropout_dim`` and returns its piece of the
    whole tensor's dropout."""
    cached = _SHARDED.get(base)
    if cached is not None:
        return cached

    def construct(self, x):
        if not self.training:
            return self._hpms_whole_construct(x)
        starts, whole = _box(x.shape, self.hpms_dropout_dim, self.hpms_dropout_parts, self.hpms_dropout_index)
        return piece(self._hpms_whole_construct(placed(x, starts, whole)), starts, x.shape)
    cls = cell_subclass(f"Sharded{base.__name__}", (base,),
                        {"construct": construct, "_hpms_whole_construct": base.construct, "__module__": __name__})
    _SHARDED[base] = cls
    return cls


_SHARDED: Dict[type, type] = {}
