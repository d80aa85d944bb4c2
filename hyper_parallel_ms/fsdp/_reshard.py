"""``reshard_after_forward=True`` (or an int) in PyNative: a unit's gathered parameters are not
kept from its forward to its backward, but gathered again when the backward needs them (FSDP2's
behaviour: one all-gather per unit and group in the forward, one in the backward). With an int
``k`` (a divisor of the shard dim's size ``n``) each rank keeps ``1/k`` of the gathered buffer
(the rows of ``n / k`` ranks' pieces) and the backward all-gathers over its group of ``k``
consecutive ranks of the shard dim (the group's ``post_forward_mesh``, dim 1): less memory than
``False``, a cheaper (e.g. intra-node) backward gather than ``True``.

MindSpore's autodiff keeps the tensors an op needs for its backward (a Dense keeps its
weight; the gathering Cell keeps its output). From just before a unit's gather to the end
of its forward, MindSpore's saved-tensor hooks (``mindspore.saved_tensors_hooks``) see each
tensor kept: a gathered value of the unit (or the flat gathered buffer) is kept as a small
record instead, so the gathered values are freed when the forward ends; the first backward
use of a record gathers that group again, without autodiff (the pieces' gradient comes from
the forward's gathering Cell), and the values are dropped once the group's last record is used.
The flat buffer itself is never gathered again: the backward reads only its shape (a unit whose
backward reads none of its values, an embedding table, gathers nothing in the backward).

Example::

    saving = RegatherOnBackward(groups)
    saving.begin()                  # in the forward pre-hook, before the gather
    saving.gathered(gathered)       # after it: which tensors to free
    ...                             # the unit's forward
    saving.end()                    # in the forward post-hook
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from mindspore import mint

from .. import comm
from .._mindspore import no_grad, saved_tensors_hooks, tensor_address
from ._flat import unpack

__all__ = ["RegatherOnBackward"]


class _Kept:
    """A tensor kept for the backward: the tensor itself, or (once freed) the forward call,
    group and index (-1: the flat buffer) to gather it again from."""

    __slots__ = ("tensor", "call", "group", "index", "like")

    def __init__(self, tensor: Any) -> None:
        self.tensor, self.call, self.group, self.index, self.like = tensor, 0, 0, 0, None


class RegatherOnBackward:
    """The saved-tensor hooks of one unit: gathered values freed at the end of its forward,
    gathered again in its backward.

    Args:
        groups: the unit's groups (:class:`._group.FSDPParamGroup`); only sharded ones are freed.
        reshard_after_forward: ``True``, or the int ``k`` (groups with a ``post_forward_mesh``
            keep ``1/k`` of the buffer).

    Example::

        saving = RegatherOnBackward(state.groups, True)
    """

    def __init__(self, groups: Sequence, reshard_after_forward: Any = True) -> None:
        self.groups = list(groups)
        self.reshard_after_forward = reshard_after_forward
        self._chunks: Dict[int, Any] = {}                   # group -> this rank's 1/k of the buffer (int k)
        self.ahead: List["RegatherOnBackward"] = []          # units whose backward gathers run after this one's
        self.call = 0
        self._where: Dict[Tuple[int, Tuple[int, ...]], Tuple[int, int]] = {}
        self._shapes: Set[Tuple[int, ...]] = set()
        self._early: Optional[List[_Kept]] = None         # kept while gathering, before addresses are known
        # (call, group) -> [values or None, records unused, rows, zeros standing in for the flat buffer, flat records unused]
        self._live: Dict[Tuple[int, int], List[Any]] = {}
        self._hooks = None
        self.name = "the unit"            # for messages: the unit's Cell class
        self.unshard_in_backward = True   # FSDP2's flag: False promises the backward reads no gathered value
        self._warned = False              # that promise broken: warned once (the user's flag is kept)

    def begin(self) -> None:
        """Start hooking the tensors the unit's forward keeps (call before its gather)."""
        self.end()
        self.call += 1
        self._live = {k: v for k, v in self._live.items() if v[0] is None and k[0] > self.call - 64}
        self._early = []
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def gathered(self, gathered: Sequence[Optional[Tuple[Any, Sequence]]]) -> None:
        """Name the tensors to free: per group ``(flat, values)``, ``None`` for a group kept whole."""
        for g, item in enumerate(gathered):
            if item is not None:
                flat, values = item
                layout = self.groups[g].layout
                # the flat buffer, also as the (ranks, length) table the values are cut from, then the values
                for address, shape, index in ([(tensor_address(flat), tuple(flat.shape), -1),
                                               (tensor_address(flat), (layout.n, layout.length), -1)] +
                                              [(tensor_address(v), tuple(v.shape), i) for i, v in enumerate(values)]):
                    self._where[(address, shape)] = (g, index)
                    self._shapes.add(shape)
                if self.reshard_after_forward is not True and self.groups[g].post_forward_mesh is not None:
                    self._chunks[g] = self._kept_rows(g, flat)
        early, self._early = self._early or [], None
        for kept in early:
            self._free(kept)
        # the flat buffer is kept only while gathering (its Cell and the views cutting it): its memory is
        # free now, and a later tensor placed there with its shape is an activation, not a record
        self._where = {key: where for key, where in self._where.items() if where[1] >= 0}

    def pause(self) -> None:
        """Stop hooking until :meth:`resume`, keeping what to free (a gather made ahead of the
        unit's forward: another unit's forward runs in between)."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def resume(self) -> None:
        """Hook again the tensors of the forward that :meth:`pause` interrupted."""
        if self._hooks is None:
            self._hooks = saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def end(self) -> None:
        """Stop hooking (the unit's forward ended)."""
        self.pause()
        self._where, self._shapes, self._early, self._chunks = {}, set(), None, {}

    def gather_ahead(self) -> None:
        """Gather now every group whose records the backward has not used yet (backward prefetch)."""
        with no_grad():
            for (_, g), entry in self._live.items():
                if entry[0] is None:
                    entry[0], entry[2] = self._regather(g, entry[2]), None

    def records_held(self) -> int:
        """The records of freed values the backward has not used yet."""
        return sum(entry[1] for entry in self._live.values())

    def bytes_held(self) -> int:
        """Bytes kept for the backward's gathers (``1/k`` of each group's buffer with an int ``k``)."""
        return sum(entry[2].nbytes for entry in self._live.values() if entry[2] is not None)

    def _kept_rows(self, g: int, flat) -> Any:
        """This rank's ``1/k`` of group ``g``'s gathered buffer (a copy), for a group resharded to ``k`` ranks."""
        group = self.groups[g]
        post = group.post_forward_mesh
        k = post.size(1)
        rows = group.layout.n // k
        table = flat.reshape((group.layout.n, group.layout.length))
        return mint.narrow(table, 0, post.get_local_rank(1) * rows, rows).copy()

    def _regather(self, g: int, rows: Any) -> Tuple[Any, list]:
        group = self.groups[g]
        if rows is None:
            return group.gathered()      # handed to the backward, never to a Cell: views do
        flat = comm.all_gather(rows, group.post_forward_mesh, 1, dim=0).reshape((-1,))
        return flat, unpack(group.layout, flat)

    def _free(self, kept: _Kept) -> None:
        shape = tuple(kept.tensor.shape)
        if shape not in self._shapes:        # most kept tensors (activations): no address read (it waits)
            return
        where = self._where.get((tensor_address(kept.tensor), shape))
        if where is None:
            return
        kept.like = (shape, kept.tensor.dtype)
        kept.tensor, kept.call, (kept.group, kept.index) = None, self.call, where
        entry = self._live.setdefault((self.call, kept.group), [None, 0, self._chunks.get(kept.group), None, 0])
        entry[1] += 1
        entry[4] += kept.index < 0

    def _pack(self, tensor) -> _Kept:
        kept = _Kept(tensor)
        if self._early is not None:
            self._early.append(kept)
        elif self._where:
            self._free(kept)
        return kept

    def _unpack(self, kept: _Kept):
        if kept.tensor is not None:
            return kept.tensor
        key = (kept.call, kept.group)
        entry = self._live.setdefault(key, [None, 1, None, None, 0])
        if kept.index < 0:
            # the flat buffer is kept only by its gathering Cell (whose backward reads no value) and by
            # the views cutting it (which read its shape): zeros of its shape, no gather, one buffer for
            # all its records (dropped with the last). A unit whose backward reads none of its values (an
            # embedding table) is not gathered again at all.
            zeros = entry[3]
            if zeros is None:
                zeros = mint.zeros(kept.like[0], dtype=kept.like[1])
            elif tuple(zeros.shape) != kept.like[0]:
                zeros = zeros.reshape(kept.like[0])
            entry[1] -= 1
            entry[4] -= 1
            entry[3] = zeros if entry[4] > 0 else None
            if entry[1] <= 0:
                del self._live[key]
            return zeros
        if entry[0] is None:
            if not self.unshard_in_backward and not self._warned:
                warnings.warn(f"set_unshard_in_backward(False), but the backward reads the gathered values of "
                              f"{self.name}: they are gathered again (the gradients stay exact); leave it True for "
                              f"this unit", UserWarning, stacklevel=2)
                self._warned = True
            with no_grad():
                entry[0] = self._regather(kept.group, entry[2])
            entry[2] = None
            for other in self.ahead:            # backward prefetch: their gathers issued now
                other.gather_ahead()
        values = entry[0][1]
        entry[1] -= 1
        if entry[1] <= 0:
            del self._live[key]
        return values[kept.index]
