"""The two-thread comm / compute overlap (HyperParallel's HookCoordinator, sync hooks and
CommComputeOverlap): the coordinator's ordering and release rules with plain threads, then, in one
process, micro-batch 1's forward run while micro-batch 0's backward runs on a second thread: the two
take turns at the hooks in exactly the protocol's order, and the loss and every gradient are
bit-equal to ``ms.value_and_grad`` of each micro-batch alone."""
from __future__ import annotations

import threading
import time

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from hyper_parallel_ms.pipelining import CommComputeOverlap, HookCoordinator, HookRole, sync_hook
from hyper_parallel_ms.training import disable_mindspore_backward_compat, enable_mindspore_backward_compat

WAIT = 30.0       # seconds a thread of these tests may take; a hang fails instead of blocking the suite


def _in_thread(fn):
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _joined(*threads):
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive(), "a thread of the overlap hung"


def test_the_comm_side_launches_before_the_compute_side_goes_on():
    coordinator, log = HookCoordinator(), []
    coordinator.enable()
    coordinator.notify_dispatched(HookRole.COMM)      # no COMM meeting pending on this thread: nothing released

    def comm():
        coordinator.rendezvous(HookRole.COMM)
        time.sleep(0.05)                              # a compute side that did not wait would log first
        log.append("launch")
        coordinator.notify_dispatched(HookRole.COMM)

    def compute():
        coordinator.rendezvous(HookRole.COMPUTE)
        log.append("compute")

    _joined(_in_thread(compute), _in_thread(comm))
    assert log == ["launch", "compute"]
    coordinator.disable()


def test_a_disabled_coordinator_returns_at_once_and_disable_releases_waiters():
    coordinator = HookCoordinator()
    assert not coordinator.is_enabled()
    coordinator.rendezvous(HookRole.COMPUTE)                  # disabled: no partner needed
    coordinator.enable()
    released = []
    waiter = _in_thread(lambda: (coordinator.rendezvous(HookRole.COMM), released.append(True)))
    time.sleep(0.05)
    assert not released                                       # waits for its partner at the barrier
    coordinator.disable()
    _joined(waiter)
    assert released and not coordinator.is_enabled()
    with pytest.raises(TypeError, match="role must be a HookRole"):
        coordinator.rendezvous("comm")
    with pytest.raises(TypeError, match="role must be a HookRole"):
        coordinator.notify_dispatched(1)


@pytest.fixture
def backward_compat():
    enable_mindspore_backward_compat()
    yield
    disable_mindspore_backward_compat()


class _Chunk(nn.Cell):
    """attention, then a dispatch / experts / combine of an expert-parallel layer, then a head; ``log``
    records each region (between two hooks) when its forward starts and when its backward ends."""

    def __init__(self, overlap=None):
        super().__init__()
        self.attn, self.expert, self.head = nn.Dense(4, 4), nn.Dense(4, 4), nn.Dense(4, 1)
        self.overlap, self.log = overlap, []
        dispatch = lambda h: self._mark(h, "dispatch") * 1.0          # what stands for an all-to-all here
        combine = lambda h: self._mark(h, "combine") * 1.0
        self.dispatch = overlap.wrap_dispatch(dispatch) if overlap else dispatch
        self.combine = overlap.wrap_combine(combine, is_last_layer=True) if overlap else combine

    def _mark(self, h, name):
        from hyper_parallel_ms._mindspore.autodiff import identity_with_gradient
        self.log.append(name)
        return identity_with_gradient(h, lambda d: (self.log.append(name + ".bwd"), d)[1])

    def construct(self, x):
        coordinator = self.overlap.coordinator if self.overlap else None
        if coordinator:
            x = sync_hook(x, "CHUNK_START", coordinator)
        h = self.attn(self._mark(x, "attn"))
        h = self.dispatch(h)
        h = self.expert(ops.relu(self._mark(h, "expert")))
        h = self.combine(h)
        loss = self.head(self._mark(h, "head")).sum()
        return sync_hook(loss, "CHUNK_END", coordinator) if coordinator else loss


def test_forward_and_backward_take_turns_at_the_hooks_and_match_one_thread(backward_compat):
    ms.set_seed(1)
    x0, x1 = (Tensor(np.random.default_rng(i).standard_normal((3, 4)).astype(np.float32)) for i in (0, 1))
    overlap = CommComputeOverlap()
    chunk = _Chunk(overlap)
    reference = _Chunk()
    for mine, theirs in zip(chunk.trainable_params(), reference.trainable_params()):
        theirs.set_data(mine.value().copy())
    params = chunk.trainable_params()
    expected = [ms.value_and_grad(reference, None, reference.trainable_params())(x) for x in (x0, x1)]

    loss0 = chunk(x0)                       # micro-batch 0's forward, the coordinator still off: no meeting
    chunk.log.clear()
    result = {}

    def fwd_fn():
        result["loss1"] = chunk(x1)

    def bwd_fn():
        loss0.backward()
        overlap.coordinator.rendezvous(HookRole.COMPUTE)     # the exit meeting, as MindFormers' OVERLAP_B_F step

    from mindspore.common.api import _pynative_executor
    flags = _pynative_executor.grad_flag(), _pynative_executor.enable_grad()

    def run():                              # on a thread of its own (a hang fails the test), with this one's flags
        _pynative_executor.set_grad_flag(flags[0])
        _pynative_executor.set_enable_grad(flags[1])
        overlap.run(fwd_fn, bwd_fn)

    _joined(_in_thread(run))
    # the protocol's order: the backward's combine launched first, each compute after its partner's launch
    assert chunk.log == ["head.bwd", "combine.bwd", "attn", "dispatch", "expert.bwd", "dispatch.bwd", "expert",
                         "combine", "head", "attn.bwd"], chunk.log
    assert not overlap.coordinator.is_enabled()
    for param, grad in zip(params, expected[0][1]):
        np.testing.assert_array_equal(param.grad.asnumpy(), grad.asnumpy())
    assert result["loss1"].asnumpy() == expected[1][0].asnumpy()
    for param in params:
        param.grad = None
    result["loss1"].backward()              # recorded on the other thread while micro-batch 0's backward ran
    for param, grad in zip(params, expected[1][1]):
        np.testing.assert_array_equal(param.grad.asnumpy(), grad.asnumpy())


def test_a_failing_side_releases_the_other_and_its_error_is_raised(backward_compat):
    overlap = CommComputeOverlap()
    coordinator = overlap.coordinator

    def waits_for_a_partner():
        coordinator.rendezvous(HookRole.COMPUTE)

    def fails():
        raise ValueError("broken backward")

    with pytest.raises(RuntimeError, match="backward thread of CommComputeOverlap.run failed") as info:
        overlap.run(waits_for_a_partner, fails)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(KeyError, match="broken forward"):
        overlap.run(lambda: {}["broken forward"], waits_for_a_partner)
    with pytest.raises(ValueError, match="the hooks are A, B, C, D, D_LAST, CHUNK_START, CHUNK_END"):
        sync_hook(Tensor(np.ones(2, np.float32)), "E", coordinator)
    with pytest.raises(TypeError, match="coordinator must be a HookCoordinator"):
        sync_hook(Tensor(np.ones(2, np.float32)), "A", None)
