"""One step of a pipeline schedule: compute (F / B / I / W), point-to-point (SEND / RECV) or
an action on a fully_shard stage's parameters (UNSHARD / RESHARD / REDUCE_GRAD).

An :class:`Action` names a stage, a kind and a micro-batch, and prints compactly as PyTorch's
``_Action`` does: ``"0F1"`` is the forward of stage 0 on micro-batch 1, ``"3SEND_B2"`` the
send of stage 3's input gradient for micro-batch 2 (to stage 2), ``"1UNSHARD"`` the gather of
stage 1's parameters (the parameter actions have no micro-batch: see :mod:`._lowering`).

Conventions for the point-to-point kinds (the stage is always the one on this side):

* ``SEND_F`` of stage ``s``: the output of ``F(s, m)``, sent to stage ``s + 1``;
  it meets ``RECV_F`` of stage ``s + 1``.
* ``SEND_B`` of stage ``s``: the input gradient of ``B``/``I(s, m)``, sent to stage ``s - 1``;
  it meets ``RECV_B`` of stage ``s - 1``.

Pure Python: no MindSpore import.

Example:
    >>> a = Action(0, ActionKind.FORWARD, 1)
    >>> str(a), Action.parse("2W3"), Action.parse("3SEND_B2").peer_stage()
    ('0F1', 2W3, 2)
"""
from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple, Optional

__all__ = ["ActionKind", "Action", "ScheduleError", "PipelineError", "TransferFailed", "F", "B", "I", "W",
           "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"]


class ScheduleError(ValueError):
    """A schedule or an action list that cannot run; the message names the action and rank.

    Example::

        try:
            build_plan("1F1B", pp=4, n_microbatches=2)
        except ScheduleError as error:
            print(error)           # 1F1B needs at least as many micro-batches as stages: ...
    """


class PipelineError(RuntimeError):
    """A pipeline step failed on another rank: raised on every pp rank but the failed one (which
    raises its own exception), naming the failed rank, its action and its error.

    Example::

        try:
            schedule.step(x, target=y)
        except PipelineError as error:    # e.g. "pipeline step failed: pp rank 1 at 1F1: RuntimeError: ..."
            ...                           # restart the job: messages may be left between the ranks
    """


class TransferFailed(PipelineError):
    """A send or receive with pp rank ``peer`` failed in MindSpore (a peer gone: "Send failed"
    after the node timeout); the message names the peer and MindSpore's error.

    Args:
        peer: the pp rank at the other end.
        error: MindSpore's exception.

    Example::

        raise TransferFailed(1, RuntimeError("Send failed."))
    """

    def __init__(self, peer: int, error: BaseException) -> None:
        text = str(error).strip()
        super().__init__(f"a transfer with pp rank {peer} failed (the rank may be gone): {type(error).__name__}: "
                         f"{text.splitlines()[0] if text else ''}")
        self.peer = peer


class ActionKind(Enum):
    """What an action does; its value is the code printed in an action string.

    Args:
        value: the code (``"F"``, ``"B"``, ``"I"``, ``"W"``, ``"SEND_F"``, ``"RECV_F"``,
            ``"SEND_B"``, ``"RECV_B"``, ``"UNSHARD"``, ``"RESHARD"``, ``"REDUCE_GRAD"``).

    Example:
        >>> ActionKind("W") is ActionKind.BACKWARD_WEIGHT, ActionKind("SEND_B").is_send
        (True, True)
    """

    FORWARD = "F"
    BACKWARD = "B"           # full backward: input and weight gradients
    BACKWARD_INPUT = "I"     # input gradient only (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"    # weight gradient of an earlier BACKWARD_INPUT
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"            # gather a fully_shard stage's parameters, kept until its RESHARD
    RESHARD = "RESHARD"            # free them (the pieces back in place)
    REDUCE_GRAD = "REDUCE_GRAD"    # reduce the gradients its backwards accumulated, once per step

    __hash__ = object.__hash__     # members are singletons; Enum's name hash is slow in hot loops

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        """SEND_F or SEND_B."""
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        """RECV_F or RECV_B."""
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    @property
    def is_fsdp(self) -> bool:
        """UNSHARD, RESHARD or REDUCE_GRAD: acts on a stage's parameters, on no micro-batch."""
        return self in _FSDP


_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                      ActionKind.BACKWARD_WEIGHT})
F = ActionKind.FORWARD
B = ActionKind.BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 (PyTorch's letter for the input gradient)
W = ActionKind.BACKWARD_WEIGHT
_FSDP = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B
UNSHARD = ActionKind.UNSHARD
RESHARD = ActionKind.RESHARD
REDUCE_GRAD = ActionKind.REDUCE_GRAD

_FSDP_ORDER = (UNSHARD, RESHARD, REDUCE_GRAD)
_PAIRS = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}
_PATTERN = re.compile(r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d*)$")


class Action(NamedTuple):
    """``kind`` of stage ``stage`` on micro-batch ``microbatch``; prints as ``"0F1"`` (a parameter
    action, which has no micro-batch, as ``"0UNSHARD"``).

    Args:
        stage: the stage (on this side of a SEND / RECV).
        kind: the :class:`ActionKind`.
        microbatch: the micro-batch (``None`` for UNSHARD, RESHARD and REDUCE_GRAD).

    Example:
        >>> Action(2, ActionKind.BACKWARD_INPUT, 3), Action.parse("2I3") == Action(2, I, 3)
        (2I3, True)
        >>> Action(1, ActionKind.REDUCE_GRAD), Action.parse("1UNSHARD").microbatch is None
        (1REDUCE_GRAD, True)
    """

    stage: int
    kind: ActionKind
    microbatch: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Action":
        """The action an action string names (the inverse of ``str``).

        >>> Action.parse(" 1RECV_F0 ").kind
        <ActionKind.RECV_F: 'RECV_F'>
        """
        match = _PATTERN.match(text.strip())
        kind = None if match is None else ActionKind(match.group(2))
        if match is None or (match.group(3) == "") != kind.is_fsdp:
            raise ValueError(f"invalid action string {text!r}: expected <stage><kind><microbatch> "
                             f"with kind one of {[k.value for k in ActionKind if not k.is_fsdp]}, e.g. '2F0' or "
                             f"'1SEND_B3', or <stage><kind> with kind one of {[k.value for k in _FSDP_ORDER]}, "
                             f"e.g. '1UNSHARD'")
        stage, _, mb = match.groups()
        return Action(int(stage), kind, int(mb) if mb else None)

    def peer_stage(self) -> Optional[int]:
        """The stage at the other end of a SEND / RECV (None for compute actions).

        >>> Action.parse("1SEND_F0").peer_stage(), Action.parse("1RECV_F0").peer_stage()
        (2, 0)
        """
        if self.kind in (SEND_F, RECV_B):
            return self.stage + 1
        if self.kind in (SEND_B, RECV_F):
            return self.stage - 1
        return None

    def matching(self) -> "Action":
        """The action on the peer that pairs with this SEND / RECV.

        >>> Action.parse("0SEND_F3").matching(), Action.parse("1RECV_B2").matching()
        (1RECV_F3, 2SEND_B2)
        """
        pairs = _PAIRS
        if self.kind not in pairs:
            what = "parameter" if self.kind.is_fsdp else "compute"
            raise ValueError(f"{self} is a {what} action; only SEND / RECV actions have a matching action")
        return Action(self.peer_stage(), pairs[self.kind], self.microbatch)
