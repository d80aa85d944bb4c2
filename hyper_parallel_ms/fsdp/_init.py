"""``init_parameters``: materialise a model built under ``hyper_parallel_ms.no_init_parameters()``.

Each deferred parameter gets the value it has eagerly for the same seed: its initialiser is
replayed from the point of numpy's random stream recorded when the Parameter was made
(:mod:`hyper_parallel_ms._deferred`), so the order in which this runs does not matter.
Where the current world's exchange holds no values (a rank of a dry run, see
:mod:`hyper_parallel_ms.dryrun`) nothing is initialised: the parameters stay without data. Random streams cannot be cut, so for each sharded parameter this rank runs its initialiser
once, keeps its piece and drops the rest before the next parameter: the peak is the pieces
plus the largest single parameter, never the whole model. Random initialisers made under
MindSpore's own ``no_init_parameters()`` (no record) run from numpy's current state in
attribute order, as ``Cell.init_parameters_data()`` runs them on the one-device model, with
one warning; a model mixing both kinds is refused, naming them, before anything changes.

Example::

    ms.set_seed(0)
    with no_init_parameters():
        model = Net()
    fully_shard(model, mesh=mesh)
    init_parameters(model)         # pieces equal to the slices of Net() built eagerly from seed 0
"""
from __future__ import annotations

from typing import List

from mindspore import Parameter, Tensor, nn

from .._deferred import check_initial_values, initial_value, initialise, unrecorded_notice
from ..comm._exchange import current_exchange
from ._param import fsdp_param
from ._pieces import cut_piece

__all__ = ["init_parameters"]


def _distinct(module: nn.Cell) -> List[Parameter]:
    seen, params = set(), []
    for _, param in module.parameters_and_names():
        if id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params


def init_parameters(module: nn.Cell, stage_index: int = 0) -> nn.Cell:
    """Give every deferred parameter of ``module`` its eager value (built under
    ``hyper_parallel_ms.no_init_parameters()``), or, built under MindSpore's own context, the
    value ``module.init_parameters_data()`` gives it on one device (attribute order, one
    warning); returns ``module``. Raises ``ValueError`` (``module`` unchanged) for a mix of both
    or a recorded initialiser that does not replay.

    Args:
        module: the Cell built under ``mindspore.nn.utils.no_init_parameters`` and sharded.
        stage_index: HyperParallel's pipeline stage of ``module`` (a non-negative int). A recorded
            parameter replays its own place in the random stream, so a stage's parameters get the
            values of the whole model built eagerly whatever the stage; the index is checked only.

    Example::

        init_parameters(model)
    """
    if not isinstance(module, nn.Cell):
        raise TypeError(f"init_parameters needs an nn.Cell, got {type(module).__name__}")
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or stage_index < 0:
        raise ValueError(f"init_parameters: stage_index must be a non-negative int, got {stage_index!r}")
    params = _distinct(module)
    records = [fsdp_param(p) for p in params]
    records = [r if r is not None and r.deferred is not None else None for r in records]
    if not current_exchange().holds_values:     # a rank that plans on shapes: its parameters never get values
        for record in records:
            if record is not None:
                record.deferred = None
        return module
    check_initial_values([r.deferred if r is not None else p for p, r in zip(params, records)])
    with unrecorded_notice("at this init_parameters call, in attribute order (as Cell.init_parameters_data())"):
        for param, record in zip(params, records):     # attribute order: parameters_and_names()
            if record is not None:
                source, record.deferred = record.deferred, None
                full = initial_value(source)
                piece = cut_piece(full, record.mesh, record.sharded, record.chunks.dim)
                param.set_data(Tensor(piece, dtype=param.dtype))
                del full, source
            else:
                initialise(param)
    return module
