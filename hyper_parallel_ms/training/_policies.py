"""Selective activation-checkpoint policies: which op outputs a checkpointed forward keeps for its
recompute (PyTorch's ``create_selective_checkpoint_contexts``), on MindSpore's op interception.

A policy names MindSpore primitives (``"selective"``: :data:`SAVE_MATMUL_AND_COLLECTIVES`, a collection
of names, a predicate) or is :data:`ATTENTION_CORE` (Korthikanti et al.'s selective recomputation of an
attention Cell, decided over the whole forward's record). Random ops' outputs are always kept. The
wrapper that runs them is :mod:`._recompute`.

Example::

    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts("selective")()
"""
from __future__ import annotations

import collections.abc
import threading
from collections import Counter
from typing import Any, Callable, Collection, List, Optional, Tuple, Union

import mindspore as ms

from .._mindspore import ONE_NODE, OP_INTERCEPTION, OpInterception, in_one_autodiff_node

__all__ = ["SAVE_MATMUL_AND_COLLECTIVES", "ATTENTION_CORE", "CheckpointStats", "Policy", "is_random_op",
           "create_selective_checkpoint_contexts"]

# MindSpore primitive names whose outputs a selective policy keeps by default: the matmuls (CPU and
# Ascend kernels) and the collectives (on CPU every sub-group collective is composed over AllReduce)
SAVE_MATMUL_AND_COLLECTIVES = frozenset({
    "MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Dense", "Mm", "Bmm", "BmmExt", "Baddbmm",
    "AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AlltoAllV", "Broadcast",
    "DistCommAllReduce", "DistCommAllGather", "DistCommReduceScatter", "DistCommAllToAll"})
# random ops: their outputs are kept by every policy and handed to the recompute, which would draw
# other numbers (MindSpore's dropout primitives keep their generator state in the kernel, which no
# saved RNG state restores; PyTorch restores its RNG state instead, preserve_rng_state=True)
# (in-place random ops are not replayed, which would leave their target unwritten: they draw again from
# the restored random state)
_RANDOM_PREFIXES = ("Rand", "Random", "Uniform", "StandardNormal", "Normal", "Bernoulli", "Multinomial", "Gamma",
                    "Poisson", "Gumbel", "LogNormal", "TruncatedNormal", "StandardLaplace")


def is_random_op(name: str) -> bool:
    """Whether the MindSpore primitive ``name`` draws random numbers (its output is never recomputed).

    >>> is_random_op("Dropout"), is_random_op("DropoutExt"), is_random_op("UniformReal"), is_random_op("MatMul")
    (True, True, True, False)
    """
    return "Dropout" in name or name.startswith(_RANDOM_PREFIXES)


_NEVER_SAVED = frozenset({"StopGradient"})     # run by MindSpore's recompute itself, in the recompute only

class _Excluding(threading.local):
    depth = 0                          # > 0 inside a region excluded from recomputation (training._exclude)


_EXCLUDING = _Excluding()              # per thread, 0 in every thread until it enters a region

Policy = Union[None, str, Collection[str], Callable[[str], bool]]


class CheckpointStats:
    """What a wrapped Cell's checkpointing did since the last :meth:`reset`: ``forwards`` (runs of
    its forward, recomputations included), ``recomputes``, and for a selective policy the op names
    whose outputs were ``saved`` in the forward, ``replayed`` to the recompute, ``recomputed`` there."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.forwards = self.recomputes = 0
        self.saved: Counter = Counter()
        self.replayed: Counter = Counter()
        self.recomputed: Counter = Counter()


def _keep_fn(policy: Policy) -> Optional[Callable[[str], bool]]:
    """The op-name predicate of ``policy`` (``None``: full recompute; :data:`ATTENTION_CORE`: its own
    predicate, told apart by identity)."""
    if policy is None or policy == "full":
        return None
    if policy == "selective":
        return SAVE_MATMUL_AND_COLLECTIVES.__contains__
    if policy == ATTENTION_CORE:
        return _attention_core_keeps
    if isinstance(policy, str):
        raise ValueError(f"policy must be None, 'full', 'selective', {ATTENTION_CORE!r}, a collection of op names or a "
                         f"callable op_name -> bool, got {policy!r}")
    if callable(policy):
        return policy
    if not isinstance(policy, collections.abc.Collection):
        raise TypeError(f"policy must be None, 'full', 'selective', a collection of MindSpore primitive names "
                        f"({{'MatMul', 'AllReduce'}}) or a callable op_name -> bool, got {policy!r} "
                        f"({type(policy).__name__})")
    names = frozenset(policy)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"policy names MindSpore primitives by name (str), got {bad!r}")
    return names.__contains__


class _SaveOutputs(OpInterception):
    """Forward of a selective checkpoint: keeps the outputs of the ops ``keep`` names."""

    def __init__(self, keep: Callable[[str], bool], saved: List[list], stats: CheckpointStats) -> None:
        super().__init__()
        self.keep, self.saved, self.stats = keep, saved, stats

    def on_op(self, name: str, run: Callable[[], Any]) -> Any:
        if _EXCLUDING.depth:          # a region excluded from recomputation: not recorded
            return run()
        out = run()
        if name not in _NEVER_SAVED and self.keep(name):
            self.saved.append([name, out])
            self.stats.saved[name] += 1
        return out

    def keeps(self, names: List[str], shapes: List[Optional[tuple]]) -> List[bool]:
        """Which of a forward's ops (names, output shapes) keep their outputs (the planner asks)."""
        return [name not in _NEVER_SAVED and bool(self.keep(name)) for name in names]


class _ReplayOutputs(OpInterception):
    """Recompute of a selective checkpoint: hands back the kept outputs, in order, runs the rest."""

    def __init__(self, keep: Callable[[str], bool], saved: List[list], stats: CheckpointStats) -> None:
        super().__init__()
        self.keep, self.saved, self.stats, self.next = keep, saved, stats, 0

    def on_op(self, name: str, run: Callable[[], Any]) -> Any:
        if _EXCLUDING.depth:          # a region excluded from recomputation: not recorded
            return run()
        if name in _NEVER_SAVED or not self.keep(name):
            self.stats.recomputed[name] += 1
            return run()
        if self.next >= len(self.saved) or self.saved[self.next][0] != name:
            want = self.saved[self.next][0] if self.next < len(self.saved) else "nothing more"
            raise RuntimeError(
                f"selective activation checkpointing: the recomputed forward ran {name} where the forward had "
                f"{want} (op {self.next} of those kept). The wrapped Cell's forward must run the same ops each "
                "time (no data-dependent branches, no state changed between forward and backward); use policy=None")
        out = self.saved[self.next][1]
        self.saved[self.next] = None         # handed over: the kept output is freed with the recompute
        self.next += 1
        self.stats.replayed[name] += 1
        return out


# --------------------------------------------- Korthikanti et al.'s selective recomputation
ATTENTION_CORE = "attention_core"
# the ops whose outputs define the attention scores' shape
_SOFTMAX = frozenset({"Softmax", "SoftmaxExt", "SoftmaxV2"})
_MATMULS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Dense", "Mm", "Bmm", "BmmExt",
                      "Baddbmm"})


def _attention_core_keeps(name: str) -> bool:
    """The op-name part of :data:`ATTENTION_CORE` (the shape part is decided after the forward)."""
    return name in SAVE_MATMUL_AND_COLLECTIVES


def _shape(out: Any) -> Optional[tuple]:
    return tuple(out.shape) if isinstance(out, ms.Tensor) else None


class _RecordOutputs(OpInterception):
    """Forward of the :data:`ATTENTION_CORE` policy: records every op and its output; on leaving,
    keeps what Korthikanti et al.'s selective recomputation keeps: the outputs of the matmuls up
    to the attention core's last (q, k, v and the probabilities times v) except those shaped like a
    softmax output of this forward (the scores), and those of random ops; it releases the rest,
    which the recompute runs again (collectives and the output projection included). The ops of a
    custom-bprop Cell's forward (:func:`one_autodiff_node`: the context-parallel attention, whose
    blockwise softmax has no softmax op) are neither recorded nor kept: the recompute runs it again."""

    def __init__(self, record: List[list], stats: CheckpointStats) -> None:
        super().__init__()
        self.record, self.stats = record, stats

    def on_op(self, name: str, run: Callable[[], Any]) -> Any:
        if _EXCLUDING.depth:          # a region excluded from recomputation: not recorded
            return run()
        if in_one_autodiff_node():    # a custom-bprop Cell's forward (the context-parallel attention): one mark
            if not self.record or self.record[-1][0] != ONE_NODE:
                self.record.append([ONE_NODE, None])
            return run()
        out = run()
        if name not in _NEVER_SAVED:
            self.record.append([name, out])
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        flags = self.keeps([name for name, _ in self.record], [_shape(out) for _, out in self.record])
        for entry, keep in zip(self.record, flags):
            if keep:
                self.stats.saved[entry[0]] += 1
            else:
                entry[1] = _RECOMPUTED
        return result

    @staticmethod
    def keeps(names: List[str], shapes: List[Optional[tuple]]) -> List[bool]:
        """Which of a forward's ops (names and output shapes, in order) keep their outputs (the
        planner asks too)."""
        scores = {shape for name, shape in zip(names, shapes) if name in _SOFTMAX} - {None}
        first = next((i for i, shape in enumerate(shapes) if shape in scores), None)
        # the core ends with the first matmul after its scores that is no score itself (probabilities x V)
        last = None if first is None else next(
            (i for i in range(first, len(shapes)) if names[i] in _MATMULS and shapes[i] not in scores), None)
        if first is None and ONE_NODE in names:      # the core is a custom-bprop Cell: what follows is recomputed
            last = names.index(ONE_NODE)
        return [is_random_op(name) or (name in _MATMULS and shape not in scores and (last is None or i <= last))
                for i, (name, shape) in enumerate(zip(names, shapes))]


_RECOMPUTED = object()


class _ReplayRecord(OpInterception):
    """Recompute of the :data:`ATTENTION_CORE` policy: walks the forward's record, handing back the
    kept outputs and running the ops whose outputs were released."""

    def __init__(self, record: List[list], stats: CheckpointStats) -> None:
        super().__init__()
        self.record, self.stats, self.next = record, stats, 0

    def on_op(self, name: str, run: Callable[[], Any]) -> Any:
        if _EXCLUDING.depth or in_one_autodiff_node():   # excluded, or a custom-bprop Cell's forward: run
            return run()
        if name in _NEVER_SAVED:
            return run()
        while self.next < len(self.record) and self.record[self.next][0] == ONE_NODE:
            self.next += 1
        if self.next >= len(self.record) or self.record[self.next][0] != name:
            want = self.record[self.next][0] if self.next < len(self.record) else "nothing more"
            raise RuntimeError(
                f"selective activation checkpointing ({ATTENTION_CORE!r}): the recomputed forward ran {name} where the "
                f"forward had {want} (op {self.next}). The wrapped Cell's forward must run the same ops each time (no "
                "data-dependent branches, no state changed between forward and backward); use policy=None")
        entry = self.record[self.next]
        self.next += 1
        if entry[1] is _RECOMPUTED:
            self.stats.recomputed[name] += 1
            return run()
        out, entry[1] = entry[1], None            # handed over: freed with the recompute
        self.stats.replayed[name] += 1
        return out


def _attention_core_contexts(stats: CheckpointStats) -> Callable[[], Tuple[Any, Any]]:
    if not OP_INTERCEPTION:
        raise NotImplementedError(f"selective activation checkpointing needs mindspore.MsDispatchMode (MindSpore "
                                  f"2.10); MindSpore {ms.__version__} lacks it: use policy=None (full recompute)")

    def context_fn():
        record: List[list] = []
        return _RecordOutputs(record, stats), _ReplayRecord(record, stats)
    return context_fn


def create_selective_checkpoint_contexts(policy: Policy) -> Callable[[], Tuple[Any, Any]]:
    """A ``context_fn`` for ``mindspore.recompute(..., use_reentrant=False, context_fn=...)``: the
    forward keeps the outputs of the ops ``policy`` names, the recompute reuses them and runs
    every other op again (PyTorch's name). PyNative only.

    Args:
        policy: ``"selective"`` (:data:`SAVE_MATMUL_AND_COLLECTIVES`), :data:`ATTENTION_CORE`
            (``"attention_core"``, see :func:`~hyper_parallel_ms.training.checkpoint_wrapper`), a collection of MindSpore primitive names (``{"MatMul", "AllReduce"}``) or a callable ``op_name -> bool`` (True: keep).

    Example::

        context_fn = create_selective_checkpoint_contexts({"MatMul"})
        y = mindspore.recompute(block, x, use_reentrant=False, context_fn=context_fn)
    """
    keep = _keep_fn(policy)
    if keep is None:
        raise ValueError("create_selective_checkpoint_contexts needs a selective policy, got None / 'full'")
    if keep is _attention_core_keeps:
        context_fn = _attention_core_contexts(CheckpointStats())
    else:
        context_fn = _selective_contexts(keep, CheckpointStats())
    context_fn._hpms_policy = policy          # the composable checkpoint(context_fn=) reads it back
    return context_fn


def _selective_contexts(keep: Callable[[str], bool], stats: CheckpointStats) -> Callable[[], Tuple[Any, Any]]:
    if not OP_INTERCEPTION:
        raise NotImplementedError(f"selective activation checkpointing needs mindspore.MsDispatchMode (MindSpore "
                                  f"2.10); MindSpore {ms.__version__} lacks it: use policy=None (full recompute)")

    def context_fn():
        saved: List[list] = []
        return _SaveOutputs(keep, saved, stats), _ReplayOutputs(keep, saved, stats)
    return context_fn
