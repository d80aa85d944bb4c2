"""``reshard_after_forward=True`` (or an int) in PyNative: a unit's gathered parameters are not
kept from its forward to its backward, but gathered again when the backward needs them (FSDP2's
behaviour: one all-gather per unit and group in the forward, one in the backward). With an int
``k`` (a divisor of the shard dim's size ``n``) each rank keeps ``1/k`` of the gathered buffer
(the rows of ``n / k`` ranks' pieces) and the backward all-gathers over its group of ``k``
consecutive ranks of the shard dim (the group's ``post_forward_mesh``, dim 1): less memory than
``False``, a cheaper (e.g. intra-node) backward gather than ``True``.

MindSpore's autodiff keeps the tensors an op needs for its backward (a Dense keeps its
weight; the gathering Cell keeps its inputs and outputs). From just before a unit's gather to
the end of its forward, MindSpore's saved-tensor hooks (``mindspore.saved_tensors_hooks``) see
each tensor kept: a gathered value of the unit is kept as a small record instead, so the
gathered values are freed when the forward ends; the first backward use of a record gathers
that group again, without autodiff (the pieces' gradient comes from the forward's gathering
Cell), and the values are dropped once the group's last record is used. The gathering Cell's
own records of its outputs hold only a shape (its backward reads none of them) and are used
last, by that Cell's backward, which ends the unit's backward; a backward that stops short of
it (a zero-bubble input pass) leaves the values for the one that follows (the weight pass). A
unit whose backward reads none of its values (an embedding table) gathers nothing in the backward.

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
    group and index to gather it again from (index -1: only its shape and dtype, ``like``, are read)."""

    __slots__ = ("tensor", "call", "group", "index", "like")

    def __init__(self, tensor: Any) -> None:
        self.tensor, self.call, self.group, self.index, self.like = tensor, 0, 0, 0, None


class _Live:
    """The records of one forward call's gathered group not yet used by the backward: how many,
    the values gathered again for them (``None`` until the first is used) and, with an int
    ``reshard_after_forward``, this rank's rows of the buffer to gather them from."""

    __slots__ = ("values", "records", "rows")

    def __init__(self, rows: Any) -> None:
        self.values, self.records, self.rows = None, 0, rows


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
        self._live: Dict[Tuple[int, int], _Live] = {}        # (call, group) -> its values' records
        self._hooks = None
        self._zeros: Dict[Any, Any] = {}                  # dtype -> a zero scalar (see _stand_in)
        self.name = "the unit"            # for messages: the unit's Cell class
        self.unshard_in_backward = True   # FSDP2's flag: False promises the backward reads no gathered value
        self._warned = False              # that promise broken: warned once (the user's flag is kept)

    def begin(self) -> None:
        """Start hooking the tensors the unit's forward keeps (call before its gather)."""
        self.end()
        self.call += 1
        self._live = {k: v for k, v in self._live.items() if v.values is None and k[0] > self.call - 64}
        self._early = []
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def gathered(self, gathered: Sequence[Optional[Tuple[Any, Sequence]]]) -> None:
        """Name the tensors to free: per group ``(flat, values)``, ``None`` for a group kept whole."""
        for g, item in enumerate(gathered):
            if item is not None:
                flat, values = item
                for i, v in enumerate(values):
                    shape = tuple(v.shape)
                    self._where[(tensor_address(v), shape)] = (g, i)
                    self._shapes.add(shape)
                if self.reshard_after_forward is not True and self.groups[g].post_forward_mesh is not None:
                    self._chunks[g] = self._kept_rows(g, flat)
        early, self._early = self._early or [], None
        for kept in early:                  # kept by the gathering Cells, whose backward reads only shapes
            self._free(kept, shape_only=True)

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
            for (_, g), live in self._live.items():
                if live.values is None:
                    live.values, live.rows = self._regather(g, live.rows), None

    def records_held(self) -> int:
        """The records of freed values the backward has not used yet."""
        return sum(live.records for live in self._live.values())

    def bytes_held(self) -> int:
        """Bytes kept for the backward's gathers (``1/k`` of each group's buffer with an int ``k``)."""
        return sum(live.rows.nbytes for live in self._live.values() if live.rows is not None)

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

    def _free(self, kept: _Kept, shape_only: bool = False) -> None:
        shape = tuple(kept.tensor.shape)
        if shape not in self._shapes:        # most kept tensors (activations): no address read (it waits)
            return
        where = self._where.get((tensor_address(kept.tensor), shape))
        if where is None:
            return
        kept.like = (shape, kept.tensor.dtype)
        kept.tensor, kept.call, (kept.group, kept.index) = None, self.call, where
        if shape_only:
            kept.index = -1
        live = self._live.get((self.call, kept.group))
        if live is None:
            live = self._live[(self.call, kept.group)] = _Live(self._chunks.get(kept.group))
        live.records += 1

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
        live = self._live.get(key)
        if live is None:           # a backward run again (keep_graph): its records were all used once
            live = self._live[key] = _Live(None)
            live.records = 1
        if kept.index < 0:
            value = self._stand_in(*kept.like)
        else:
            value = self._value(live, kept)
        live.records -= 1
        if live.records <= 0:
            del self._live[key]
        return value

    def _stand_in(self, shape: Tuple[int, ...], dtype: Any):
        """A tensor of ``shape`` and ``dtype`` for a record only its shape is read from: a broadcast
        view of one zero (no memory of its own; allocating zeros cost more per step than the view)."""
        zero = self._zeros.get(dtype)
        if zero is None:
            zero = self._zeros[dtype] = mint.zeros((), dtype=dtype)
        return zero.broadcast_to(shape)

    def _value(self, live: _Live, kept: _Kept):
        """The value a record stands for, gathered again with its group's other values on first use."""
        if live.values is None:
            if not self.unshard_in_backward and not self._warned:
                warnings.warn(f"set_unshard_in_backward(False), but the backward reads the gathered values of "
                              f"{self.name}: they are gathered again (the gradients stay exact); leave it True for "
                              f"this unit", UserWarning, stacklevel=2)
                self._warned = True
            with no_grad():
                live.values = self._regather(kept.group, live.rows)
            live.rows = None
            for other in self.ahead:            # backward prefetch: their gathers issued now
                other.gather_ahead()
        return live.values[1][kept.index]
