"""A compile check of optimizer steps over fully_shard / hsdp units: parameters no unit holds.

FSDP2 requires ``fully_shard`` on the root: a parameter outside every unit (a root's own
embedding or head when only the blocks are units) is never reduced over the data-parallel ranks,
so each replica steps it with its own gradient and the replicas drift apart, silently.
:func:`warn_parameters_outside_units` runs when a MindSpore optimizer step compiles (registered by
the first ``fully_shard`` / ``hsdp`` call) and warns once per optimizer, naming them.

Example::

    check_compiled_calls(warn_parameters_outside_units)
"""
from __future__ import annotations

import warnings
from typing import Callable

from ..dtensor import DTensor
from ..nn import parameter_sharding
from ._param import fsdp_param

__all__ = ["warn_parameters_outside_units"]

_CHECKED = "_hpms_checked_outside_units"       # an optimizer's parameters are fixed: one look suffices


def warn_parameters_outside_units(fn: Callable, args: tuple) -> None:
    """Warn once per optimizer whose parameters mix fully_shard / hsdp units over several ranks with
    trainable ones no unit holds and no other engine placed (no DTensor, no sharding record):
    nothing averages the latter's gradients over the data-parallel ranks unless the script reduces
    them itself.

    Args:
        fn: the compiled function.
        args: its arguments, the bound object (the optimizer) first.

    Example::

        check_compiled_calls(warn_parameters_outside_units)
    """
    from mindspore import nn
    if not args or not isinstance(args[0], nn.Optimizer) or getattr(args[0], _CHECKED, False):
        return
    optimizer = args[0]
    object.__setattr__(optimizer, _CHECKED, True)
    records = [(p, fsdp_param(p)) for p in optimizer.parameters]
    units = [r for _, r in records if r is not None]
    if not units or max(u.mesh.size() for u in units) < 2:
        return
    outside = [p.name for p, r in records if r is None and p.requires_grad and not isinstance(p, DTensor)
               and parameter_sharding(p) is None]
    if outside:
        warnings.warn(f"{type(optimizer).__name__} steps {len(units)} parameters of fully_shard / hsdp units and "
                      f"{len(outside)} that no unit holds, e.g. {outside[:3]}: nothing averages the gradients of those "
                      f"over the data-parallel ranks, so the replicas drift apart. Apply fully_shard / hsdp to the "
                      f"root Cell too (FSDP2 requires it), or reduce their gradients yourself (GradientReducer)",
                      UserWarning, stacklevel=2)
