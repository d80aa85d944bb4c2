"""fully_shard inside ms.jit and GRAPH_MODE: parameters gathered where the Cell reads them.

The PyNative driver swaps gathered values into a Cell's parameter table in forward hooks;
a compiled graph cannot have its Parameters replaced by computed values that way. Here
each Cell holding a fully_shard parameter gets a subclass (:func:`gathering_class`) in
which the parameter's attribute is a property: run by Python it returns what the table
holds (the full value the hooks installed, or the piece; the piece read inside another unit's
forward, a tied head reading an embedding unit's table, is gathered there as its own unit's
forward gathers it: :meth:`._state.FSDPState.read_outside_forward`); compiled as graph code it
returns the parameter's full value from the :class:`._group.SharedGather` its
:class:`._group.ParamGather` names (the piece all-gathered in the graph, the gradient reduced to
the piece in its backward; one Cell for the reads of one shape and layout). The table keeps the piece,
so the optimizer, ``parameters_and_names`` and checkpoints see the same Parameters in every mode.

What the compiled graph communicates (counted in the compiled graph by the tests): one
all-gather and one reduce-scatter per parameter (see :mod:`._group` for why not one per group).
Whether a gathered value stays alive for the backward is the compiler's choice: it keeps it
(``reshard_after_forward`` is not applied; an activation checkpoint around the unit recomputes
the gather instead). What cannot be compiled is refused
while compiling, naming the fix: backward passes without gradient sync, and the input /
output casts of a mixed-precision policy.

Example::

    fully_shard(model.layers[0], mesh=mesh); fully_shard(model, mesh=mesh)
    step = ms.jit(ms.value_and_grad(loss_fn, None, model.trainable_params()))
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

from .._mindspore import compiling_graph_code, reading_class
from ..nn._hooks import SUMMED_PREFIX
from ._group import shared_gather

__all__ = ["gathering_class", "READER_PREFIX"]

READER_PREFIX = "_hpms_fsdp_read_"
_CLASSES: Dict[Tuple[type, Tuple[str, ...]], type] = {}


def _gathered(attr: str, summed: bool) -> property:
    reader = READER_PREFIX + attr
    summer = SUMMED_PREFIX + attr

    def read(self):
        value = self._params[attr]
        if compiling_graph_code():
            gather = getattr(self, reader)
            gather.check()
            value = shared_gather(gather.spec_id)(value)
        else:
            value = getattr(self, reader).read_eagerly(value)
        return getattr(self, summer)(value) if summed else value
    read.__name__ = attr
    return property(read, doc=f"``{attr}``: the full parameter (gathered from the pieces when compiled)")


def gathering_class(base: type, attrs: Sequence[str]) -> type:
    """A subclass of the Cell class ``base`` in which each of ``attrs`` is read through a
    property (the instance holds ``READER_PREFIX + attr``, the parameter's
    :class:`._group.ParamGather`, for each).

    Args:
        base: the holder Cell's class.
        attrs: the attribute names of its fully_shard parameters.

    Example::

        holder.__class__ = gathering_class(type(holder), ["weight", "bias"])
    """
    attrs = tuple(sorted(attrs))
    summed = getattr(base, "_hpms_summed", ())    # a SequenceParallel Cell's reads sum their gradients
    return reading_class(_CLASSES, base, attrs, lambda a: _gathered(a, a in summed), _hpms_gathered=attrs)
