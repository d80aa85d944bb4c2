"""What a stage's parameter actions do to its fully_shard / hsdp units (PyNative stages).

* ``UNSHARD``: every sharded unit of the stage gathers its parameters once (one all-gather per
  parameter group) and keeps them across the step's forwards and backwards: with
  ``reshard_after_forward=False`` no forward or backward of the step gathers again. A unit with
  ``reshard_after_forward=True`` (or an int) frees them after its first forward, as FSDP2's
  post-forward reshard does; its later forwards gather and free as usual.
* ``RESHARD``: the units put their pieces back and drop what they gathered.
* ``REDUCE_GRAD``: the gradients the step's backwards accumulated unreduced (gradient sync is
  off for them) are reduced now, one reduce-scatter (or all-reduce) per group, and returned per
  piece Parameter.

A compiled stage (``jit=True``) gathers and reduces inside its graphs: the actions do nothing
there, as they do for a stage without sharded units.

Example::

    unshard(stage)                    # 0UNSHARD
    ...                               # the step's F / B actions
    grads = reduce_gradients(stage)   # 0REDUCE_GRAD: {id(piece): reduced gradient}
    reshard(stage)                    # 0RESHARD
"""
from __future__ import annotations

from typing import Dict, List

from mindspore import Tensor

from ..fsdp._module import fsdp_state
from ..fsdp._state import FSDPState
from ._stage import PipelineStage

__all__ = ["unshard", "reshard", "reduce_gradients"]


def _units(stage: PipelineStage) -> List[FSDPState]:
    return [] if stage.jit else [fsdp_state(cell) for cell in stage.sharded_units()]


def unshard(stage: PipelineStage) -> None:
    """Gather the parameters of every sharded unit of ``stage``, kept until :func:`reshard`."""
    for unit in _units(stage):
        unit.unshard(through_backward=True)


def reshard(stage: PipelineStage) -> None:
    """Put the pieces of every sharded unit of ``stage`` back (frees the gathered parameters)."""
    for unit in _units(stage):
        unit.reshard()


def reduce_gradients(stage: PipelineStage) -> Dict[int, Tensor]:
    """The gradients ``stage``'s units accumulated without sync, reduced now: ``id(piece)`` -> gradient."""
    return {id(piece): grad for unit in _units(stage) for piece, grad in unit.reduce_pending()}
