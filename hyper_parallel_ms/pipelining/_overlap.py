"""Two-thread communication / computation overlap (HyperParallel's dual-pipe protocol).

One thread runs a micro-batch's forward while another runs a different micro-batch's backward, so
that a collective launched by one (an expert-parallel all-to-all) overlaps the other's compute. The
threads meet at **sync hooks**: identity ops placed around each communication (``A`` before the
dispatch, ``B`` after it, ``C`` before the combine, ``D`` after it; ``D_LAST`` after the last
combine of a chunk; ``CHUNK_START`` / ``CHUNK_END`` around the chunk). At each meeting one side
declares :attr:`HookRole.COMM` (it launches a collective next) and the other :attr:`HookRole.COMPUTE`;
:class:`HookCoordinator` lets the COMM side launch first and holds the COMPUTE side until the COMM
side reaches its next hook and says it launched (``notify_dispatched``). The two threads therefore
take turns between hooks: MindSpore's PyNative executor never records a forward and replays a
backward at the same moment (it supports neither concurrently; the turns make it unnecessary).

Which role a hook plays (forward / backward), as HyperParallel's tables:

====================  ===================  ======================
hook                  forward: prev, next  backward: prev, next
====================  ===================  ======================
``A``                 COMPUTE, COMM        COMM, COMPUTE
``B``                 COMM, COMPUTE        COMPUTE, COMM
``C``                 COMPUTE, COMM        COMM, COMPUTE
``D``                 COMM, COMPUTE        COMPUTE, COMM
``D_LAST``            skipped              as ``D``
``CHUNK_START``       COMPUTE, COMPUTE     skipped
``CHUNK_END``         COMM, COMPUTE        skipped
====================  ===================  ======================

A hook first signals that its thread's previous op, if a collective, was launched
(``notify_dispatched(prev)``), then meets the other thread (``rendezvous(next)``). While the
coordinator is disabled (outside :meth:`CommComputeOverlap.run`) every hook is the identity.

Example::

    overlap = CommComputeOverlap()
    dispatch = overlap.wrap_dispatch(ep_dispatch)             # A ... B around it
    combine = overlap.wrap_combine(ep_combine, is_last_layer=True)
    overlap.run(fwd_fn=lambda: forward(micro_batch_1), bwd_fn=lambda: loss_0.backward())
"""
from __future__ import annotations

import enum
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from mindspore import Tensor

from .._mindspore.autodiff import identity_with_gradient

__all__ = ["HookRole", "HookCoordinator", "CommComputeOverlap", "sync_hook", "SYNC_HOOK_NAMES"]


class HookRole(enum.Enum):
    """What a thread does right after a rendezvous: launch a collective (``COMM``, goes first) or
    compute (``COMPUTE``, waits until the paired COMM side has launched).

    Args:
        value: a member's value, as any ``Enum`` takes it (use the members by name).

    >>> HookRole.COMM.value
    'comm'
    """

    COMM = "comm"
    COMPUTE = "compute"


class HookCoordinator:
    """The meeting point of the two threads of an overlap.

    ``rendezvous(role)`` returns once both threads arrived (a two-party barrier); a ``COMPUTE``
    caller then also waits until the paired ``COMM`` caller calls ``notify_dispatched(COMM)``
    (each COMM rendezvous makes a fresh event, remembered by its thread, so a late notify never
    releases a later meeting). Disabled (the default, and after :meth:`disable`) every call returns
    at once; :meth:`disable` also releases a thread waiting at a barrier or for an event.

    Example::

        coordinator = HookCoordinator()
        coordinator.enable()
        # thread 1                                  # thread 2
        coordinator.rendezvous(HookRole.COMM)       coordinator.rendezvous(HookRole.COMPUTE)  # waits
        launch_all_to_all()
        coordinator.notify_dispatched(HookRole.COMM)                                         # released
        coordinator.disable()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._enabled = False
        self._barrier: Optional[threading.Barrier] = None
        self._launched = threading.Event()          # the current meeting's: set once its COMM side launched
        self._mine = threading.local()              # per thread: the event of its last COMM meeting

    def enable(self) -> None:
        """Start a session: a fresh barrier and fresh events."""
        with self._lock:
            self._barrier = threading.Barrier(2)
            self._launched = threading.Event()
            self._mine = threading.local()
            self._enabled = True

    def disable(self) -> None:
        """End the session and release any waiting thread (callable from either thread, repeatedly)."""
        with self._lock:
            self._enabled = False
            barrier, launched = self._barrier, self._launched
        if barrier is not None:
            barrier.abort()
        launched.set()

    def is_enabled(self) -> bool:
        """Whether a session is on."""
        return self._enabled

    @staticmethod
    def _check(role: Any) -> None:
        if not isinstance(role, HookRole):
            raise TypeError(f"role must be a HookRole (HookRole.COMM or HookRole.COMPUTE), got {type(role).__name__}")

    def rendezvous(self, role: HookRole) -> None:
        """Meet the other thread; see the class text."""
        self._check(role)
        if not self._enabled:
            return
        if role is HookRole.COMM:
            event = threading.Event()
            self._launched = event            # read by the COMPUTE side once both passed the barrier
            self._mine.event = event
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:  # disabled while waiting: the session ended
            return
        if role is HookRole.COMPUTE:
            self._launched.wait()

    def notify_dispatched(self, role: HookRole) -> None:
        """Say this thread launched the collective of its last COMM meeting (a no-op for ``COMPUTE``,
        for a thread with no such meeting pending, and while disabled)."""
        self._check(role)
        if not self._enabled or role is not HookRole.COMM:
            return
        event = getattr(self._mine, "event", None)
        if event is not None:
            self._mine.event = None
            event.set()


_C, _M = HookRole.COMPUTE, HookRole.COMM
# hook -> (role of the previous op, role of the next op); None: the hook does nothing in that direction
_FORWARD: Dict[str, Optional[Tuple[HookRole, HookRole]]] = {
    "A": (_C, _M), "B": (_M, _C), "C": (_C, _M), "D": (_M, _C), "D_LAST": None,
    "CHUNK_START": (_C, _C), "CHUNK_END": (_M, _C)}
_BACKWARD: Dict[str, Optional[Tuple[HookRole, HookRole]]] = {
    "A": (_M, _C), "B": (_C, _M), "C": (_M, _C), "D": (_C, _M), "D_LAST": (_C, _M),
    "CHUNK_START": None, "CHUNK_END": None}
SYNC_HOOK_NAMES = tuple(_FORWARD)


def _meet(coordinator: HookCoordinator, roles: Optional[Tuple[HookRole, HookRole]]) -> None:
    if roles is not None and coordinator.is_enabled():
        coordinator.notify_dispatched(roles[0])
        coordinator.rendezvous(roles[1])


def sync_hook(x: Tensor, hook_name: str, coordinator: HookCoordinator) -> Tensor:
    """A sync hook on ``x``: the identity (values and gradient), meeting the other thread of an
    overlap in the forward and again when its gradient passes in the backward (roles: the module's
    table). HyperParallel's ``get_platform().differentiable_sync_hook``. PyNative only.

    Args:
        x: a floating-point tensor (the hidden states at that point).
        hook_name: ``"A"``, ``"B"``, ``"C"``, ``"D"``, ``"D_LAST"``, ``"CHUNK_START"`` or ``"CHUNK_END"``.
        coordinator: the :class:`HookCoordinator` of the overlap.

    Example::

        h = sync_hook(h, "A", overlap.coordinator)      # before the dispatch all-to-all
    """
    if hook_name not in _FORWARD:
        raise ValueError(f"sync hook {hook_name!r}: the hooks are {', '.join(SYNC_HOOK_NAMES)}")
    if not isinstance(coordinator, HookCoordinator):
        raise TypeError(f"sync hook {hook_name!r}: coordinator must be a HookCoordinator, got "
                        f"{type(coordinator).__name__}")
    _meet(coordinator, _FORWARD[hook_name])
    backward_roles = _BACKWARD[hook_name]
    if backward_roles is None:
        return x

    def backward(dout: Tensor) -> Tensor:
        _meet(coordinator, backward_roles)
        return dout

    return identity_with_gradient(x, backward)


def _hooked(fn: Callable, coordinator: HookCoordinator, before: str, after: str) -> Callable:
    """``fn`` with ``before`` on its first positional argument and ``after`` on its result (a tuple's first)."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not args:
            raise TypeError(f"{getattr(fn, '__name__', fn)!r} wrapped by CommComputeOverlap takes its tensor as the "
                            f"first positional argument")
        result = fn(sync_hook(args[0], before, coordinator), *args[1:], **kwargs)
        if isinstance(result, tuple):
            return (sync_hook(result[0], after, coordinator),) + result[1:]
        return sync_hook(result, after, coordinator)

    return wrapped


class CommComputeOverlap:
    """Runs a forward and a backward on two threads taking turns at the sync hooks (the module's
    text): HyperParallel's orchestrator, which MindFormers' ``OverlapExpertParallel`` and its
    ``OVERLAP_B_F`` schedule step drive.

    Example::

        overlap = CommComputeOverlap()
        dispatch = overlap.wrap_dispatch(dispatch)                  # A, then B on its result
        combine = overlap.wrap_combine(combine, is_last_layer=True) # C, then D_LAST
        overlap.run(fwd_fn, bwd_fn)                                # fwd here, bwd on a second thread
    """

    def __init__(self) -> None:
        self._coordinator = HookCoordinator()

    @property
    def coordinator(self) -> HookCoordinator:
        """The coordinator the hooks of this overlap meet at."""
        return self._coordinator

    def wrap_dispatch(self, dispatch_fn: Callable) -> Callable:
        """``dispatch_fn`` between hook ``A`` (on its first argument) and ``B`` (on its result)."""
        return _hooked(dispatch_fn, self._coordinator, "A", "B")

    def wrap_combine(self, combine_fn: Callable, is_last_layer: bool = False) -> Callable:
        """``combine_fn`` between hook ``C`` and ``D`` (``D_LAST`` for the chunk's last MoE layer)."""
        return _hooked(combine_fn, self._coordinator, "C", "D_LAST" if is_last_layer else "D")

    def run(self, fwd_fn: Callable[[], Any], bwd_fn: Callable[[], Any]) -> None:
        """Run ``fwd_fn`` on this thread and ``bwd_fn`` on a second one, the coordinator enabled
        meanwhile; the second thread starts with this thread's PyNative grad flags (MindSpore keeps
        them per thread). Either raising releases the other (the coordinator disabled); an error of
        ``bwd_fn`` is raised here as a RuntimeError from it, else one of ``fwd_fn`` as it was."""
        from mindspore.common.api import _pynative_executor
        flags = (_pynative_executor.grad_flag(), _pynative_executor.enable_grad())
        coordinator = self._coordinator
        errors: Dict[str, BaseException] = {}

        def backward_thread() -> None:
            _pynative_executor.set_grad_flag(flags[0])
            _pynative_executor.set_enable_grad(flags[1])
            try:
                bwd_fn()
            except BaseException as exc:      # noqa: BLE001 - handed to the calling thread below
                errors["bwd"] = exc
                coordinator.disable()

        coordinator.enable()
        thread = threading.Thread(target=backward_thread, name="hpms-overlap-backward", daemon=True)
        thread.start()
        try:
            fwd_fn()
        except BaseException as exc:          # noqa: BLE001 - re-raised after the join
            errors["fwd"] = exc
        finally:
            coordinator.disable()
            thread.join()
        if "bwd" in errors:
            raise RuntimeError(f"the backward thread of CommComputeOverlap.run failed: {errors['bwd']!r}") \
                from errors["bwd"]
        if "fwd" in errors:
            raise errors["fwd"]
