"""What each action needs and makes: the data flow every check and timeline shares.

A datum is a small tuple ``(what, stage, microbatch)``:

* ``("y", s, m)``: the output of ``F(s, m)`` (the input of stage ``s + 1``);
* ``("g", s, m)``: the input gradient of stage ``s`` (made by ``B`` or ``I`` of ``(s, m)``),
  the output gradient that stage ``s - 1`` needs;
* ``("f", s, m)``: the saved forward state of ``(s, m)`` that its backward needs;
* ``("i", s, m)``: the saved state of ``I(s, m)`` that its ``W`` needs.

A compute action makes its data on its own rank; a RECV makes the datum its SEND carries. The
parameter actions (UNSHARD, RESHARD, REDUCE_GRAD) need and make none. :func:`costs` gives each
kind its time in the timelines (compute 1, transfers and parameter actions 0, by default).

Example:
    >>> from hyper_parallel_ms.pipelining._action import Action
    >>> needs(Action.parse("1B0"), num_stages=3), makes(Action.parse("1B0"))
    ((('f', 1, 0), ('g', 2, 0)), (('g', 1, 0),))
    >>> describe(("g", 2, 0))
    'the input gradient of stage 2, micro-batch 0'
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from ._action import B, F, I, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD, W, Action, ActionKind

__all__ = ["Datum", "needs", "makes", "describe", "costs"]

Datum = Tuple[str, int, int]


def needs(action: Action, num_stages: int) -> Tuple[Datum, ...]:
    """The data ``action`` reads; all must be on its rank before it runs."""
    s, kind, m = action
    if kind is F:
        return (("y", s - 1, m),) if s > 0 else ()
    if kind in (B, I):
        return (("f", s, m),) + ((("g", s + 1, m),) if s < num_stages - 1 else ())
    if kind is W:
        return (("i", s, m),)
    if kind is SEND_F:
        return (("y", s, m),)
    if kind is SEND_B:
        return (("g", s, m),)
    return ()


def makes(action: Action) -> Tuple[Datum, ...]:
    """The data ``action`` leaves on its rank."""
    s, kind, m = action
    if kind is F:
        return (("y", s, m), ("f", s, m))
    if kind is B:
        return (("g", s, m),)
    if kind is I:
        return (("g", s, m), ("i", s, m))
    if kind is RECV_F:
        return (("y", s - 1, m),)
    if kind is RECV_B:
        return (("g", s + 1, m),)
    return ()


def describe(datum: Datum) -> str:
    """Words for a datum, for error messages."""
    what, s, m = datum
    return {"y": f"the output of {s}F{m}",
            "g": f"the input gradient of stage {s}, micro-batch {m}",
            "f": f"the forward state of {s}F{m}",
            "i": f"the saved state of {s}I{m}"}[what]


def costs(durations: Optional[Mapping[ActionKind, float]] = None) -> Dict[ActionKind, float]:
    """Time units of each kind a timeline advances a rank's clock by: F, B, I, W 1 and UNSHARD,
    RESHARD, REDUCE_GRAD 0 unless ``durations`` says otherwise (SEND / RECV take none).

    >>> costs({F: 2.0})[F], costs()[UNSHARD]
    (2.0, 0.0)
    """
    cost = {k: 1.0 for k in (F, B, I, W)}
    cost.update({k: 0.0 for k in (UNSHARD, RESHARD, REDUCE_GRAD)})
    cost.update(durations or {})
    return cost
