"""Messages between pipeline ranks: every transfer is a small header, then its tensors.

The header (int64) says what follows: a status, the sending action (stage, kind, micro-batch)
and the signature of the tensors (their shapes and dtypes, :mod:`._microbatch`). The receiver
checks that the header names the SEND its RECV pairs with, and allocates the tensors from it,
so a stage's output shapes may change between any two micro-batches. A header whose status is
not ``DATA`` is an abort: a rank that fails sends one, in place of its next message, to every
peer that still expects a message from it, and a rank receiving one raises :class:`PipelineAbort`
and passes the abort on in the same way, so no rank waits in ``recv`` for a failed one. A rank
that hangs or dies sends nothing: the communication watchdog (:mod:`hyper_parallel_ms.comm._watchdog`)
ends the ranks waiting for it, naming it and the pipeline action they waited in.

Example::

    channel = Channel(pp_mesh)
    channel.send(Action(0, SEND_F, 3), (activation,), dst=1)       # on rank 0
    (activation,) = channel.recv(Action(1, RECV_F, 3), src=0)     # on rank 1
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence, Set, Tuple

import numpy as np
from mindspore import Tensor

from .. import comm
from ..comm._exchange import NotReady
from ..comm._watchdog import note
from ._action import Action, ActionKind, ScheduleError, TransferFailed
from ._microbatch import HEADER, fitting_signature, like_tensors

__all__ = ["Channel", "PipelineAbort", "DATA", "ABORT", "ABORT_LOST"]

DATA, ABORT, ABORT_LOST = 0, 1, 2      # ABORT_LOST: the failure lost a peer (no agreement can follow)
_KINDS = tuple(ActionKind)
_FIELDS = 5                             # status, origin rank, stage, kind, micro-batch


class PipelineAbort(RuntimeError):
    """Another pipeline rank failed during this step; raised where this rank waited for it.

    Args:
        origin: the pp rank whose failure started the abort.
        status: ``ABORT`` (the ranks then agree on the cause) or ``ABORT_LOST`` (a rank lost a
            peer: no agreement, since a rank may be gone).
        action: the action of the origin that failed.

    Example::

        try:
            channel.recv(Action(1, RECV_F, 0), src=0)
        except PipelineAbort as abort:
            abort.origin, abort.action            # (0, 0F0)
    """

    def __init__(self, origin: int, status: int, action: Action) -> None:
        lost = " (it lost a peer: a rank may be gone)" if status == ABORT_LOST else ""
        super().__init__(f"pipeline rank {origin} failed at {action}{lost}")
        self.origin, self.status, self.action = origin, status, action


def _header(status: int, origin: int, action: Action, sig: Sequence[int]) -> Tensor:
    fields = (status, origin, action.stage, _KINDS.index(action.kind), action.microbatch)
    return Tensor(np.array(fields + tuple(sig), np.int64))


class Channel:
    """Sends and receives the runtime's messages over the 1-D pp ``mesh``, counting per peer the
    whole messages sent and read in the current step (what a failed step still owes or must read).

    Args:
        mesh: the pipeline :class:`DeviceMesh` (ranks are indices along it).

    Example::

        Channel(mesh).send(Action(0, SEND_F, 0), (y,), dst=1)
    """

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self.rank = mesh.get_local_rank()
        self.new_step()

    def new_step(self) -> None:
        """Start counting a step's messages: ``sent[peer]``, ``read[peer]`` and the peers whose abort was read."""
        self.sent: Counter = Counter()
        self.read: Counter = Counter()
        self.aborted_by: Set[int] = set()

    def send(self, action: Action, tensors: Tuple[Tensor, ...], dst: int) -> None:
        """Send ``tensors`` as the message of ``action`` (a SEND) to pp rank ``dst``; a tuple the
        header cannot describe is refused before anything is sent."""
        header = _header(DATA, self.rank, action, fitting_signature(tensors))
        with note(f"pipeline {action} of pp rank {self.rank}, to pp rank {dst}"):
            for t in (header,) + tuple(tensors):
                self._send(t, dst)
        self.sent[dst] += 1

    def recv(self, action: Action, src: int, expected: Sequence[Tensor] = ()) -> Tuple[Tensor, ...]:
        """The tensors of the message ``action`` (a RECV) reads from pp rank ``src``; raises
        :class:`PipelineAbort` if ``src`` sent an abort instead. ``expected``: tensors like the
        message's (a stage's outputs, for their gradients), used where messages carry no header."""
        with note(f"pipeline {action} of pp rank {self.rank}, from pp rank {src}"):
            return self._read(action, src, expected)

    def _read(self, action: Action, src: int, expected: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        if action.kind is ActionKind.RECV_B and not self._holds_values():
            # over an exchange without values a gradient's header is received as a placeholder (its
            # sender, a later stage, need not have made it yet) and the shapes are the expected ones
            header = Tensor(np.zeros(_FIELDS + HEADER, np.int64))
            self._recv(self.mesh.exchange.placeholder(header, (_FIELDS + HEADER,)), src)
            self.read[src] += 1
            return tuple(self._recv(like, src) for like in expected)
        sent, tensors = self._message(src)
        if sent != action.matching():
            raise ScheduleError(f"pp rank {self.rank} at {action} received the message of {sent} from pp rank {src} "
                                f"(expected {action.matching()}): the ranks run different action lists")
        return tensors

    def drain(self, src: int, count: int) -> None:
        """After a failure: read and drop up to ``count`` messages from ``src``, stopping at its
        abort, so that no message is left to be mistaken for a later collective's data."""
        with note(f"pp rank {self.rank} reading what pp rank {src} sent before a failed step ended"):
            for _ in range(count):
                try:
                    self._message(src)
                except PipelineAbort:
                    return

    def abort(self, dst: int, status: int, origin: int, action: Action) -> None:
        """Send an abort (``status``: ``ABORT`` or ``ABORT_LOST``) naming ``origin`` and its failed
        ``action`` to pp rank ``dst``, in place of the next message ``dst`` expects from here."""
        self._send(_header(status, origin, action, (0,) * HEADER), dst)

    def _holds_values(self) -> bool:
        """Whether the pp mesh's tensors hold values (the transport a test puts under the protocol has no mesh)."""
        return self.mesh is None or self.mesh.holds_values

    def _send(self, tensor: Tensor, dst: int) -> None:
        """The transport (``comm``'s send; a test may put another under the protocol)."""
        try:
            comm.send(tensor, self.mesh, 0, dst=dst)
        except NotReady:
            raise                  # the exchange's "run the peer first": not a failed transfer, the step runs again
        except Exception as exc:  # noqa: BLE001  (MindSpore's failures, re-raised naming the peer)
            raise TransferFailed(dst, exc) from exc

    def _recv(self, like: Tensor, src: int) -> Tensor:
        try:
            return comm.recv(like, self.mesh, 0, src=src)
        except NotReady:
            raise
        except Exception as exc:  # noqa: BLE001
            raise TransferFailed(src, exc) from exc

    def _message(self, src: int) -> Tuple[Action, Tuple[Tensor, ...]]:
        """The next whole message from ``src``: its SEND action and tensors (:class:`PipelineAbort` for an abort)."""
        header = self._recv(Tensor(np.zeros(_FIELDS + HEADER, np.int64)), src).asnumpy()
        status, origin, stage, kind, microbatch = (int(v) for v in header[:_FIELDS])
        sent = Action(stage, _KINDS[kind], microbatch)
        if status != DATA:
            self.read[src] += 1
            self.aborted_by.add(src)
            raise PipelineAbort(origin, status, sent)
        tensors = tuple(self._recv(like, src) for like in like_tensors(header[_FIELDS:]))
        self.read[src] += 1
        return sent, tensors
