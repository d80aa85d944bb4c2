"""Dropout on DTensors: ``Dropout`` (``ops.dropout``, ``nn.Dropout``) and ``FuncDropoutExt``
(``mint.nn.functional.dropout``, ``mint.nn.Dropout``), with the single device's masks.

The output keeps the input's placements (Partial values are reduced first: dropping parts
of a sum is not dropping the sum). As with PyTorch's DTensor random ops, replicas draw the
same mask; beyond PyTorch, a sharded input gets exactly its piece of the mask one device
draws for the whole tensor with the same seed. MindSpore's CPU kernel has no offset into its
random stream (a ``Dropout`` primitive's stream restarts from its seeds for each input shape
and continues call after call), so each rank runs the op itself on the whole shape, its piece
placed in zeros (:func:`placed`), and keeps its piece of the result (:func:`piece`): the op's
state advances as on one device and the values and gradients are the kernel's own, in every
dtype. It costs one op on the whole tensor per rank (``scripts/bench_dropout.py``).

``Dropout`` called without seeds (``ms.set_seed`` never called: MindSpore passes 0, 0 and the
kernel picks random ones per process) gets seeds from a counter that every rank advances in
step, so replicas still agree. On Ascend the ``Dropout`` primitive ignores its seeds
(MindSpore's documentation): ranks would draw different masks, so it is refused there, naming
``mint.nn.Dropout`` (``FuncDropoutExt`` draws from the default generator's seed and offset,
equal on ranks seeded alike).

Example::

    y = ops.dropout(x_dt, p=0.1)     # x S(0): y S(0), this rank's rows of the one-device mask
"""
from __future__ import annotations

import itertools
from typing import Sequence, Tuple

import mindspore as ms
from mindspore import Tensor, ops

from ..._mindspore import plain_view, run_in_python
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import whole_and_reduced

__all__ = ["dropout_rule", "placed", "piece", "seeds_ignored", "refuse_ignored_seeds"]

_UNSEEDED = itertools.count(1)             # seeds for unseeded calls, in step on every rank


@run_in_python
def _fills(local_shape: Tuple[int, ...], starts: Tuple[int, ...], whole: Tuple[int, ...]):
    """``(dim, shape before, shape after)`` of the zeros around a piece at ``starts`` of a
    ``whole``-shaped tensor, dim by dim (``None`` for a missing side)."""
    out, shape = [], list(local_shape)
    for d, (s, n, w) in enumerate(zip(starts, local_shape, whole)):
        if n != w:
            before = tuple(shape[:d] + [s] + shape[d + 1:]) if s else None
            after = tuple(shape[:d] + [w - s - n] + shape[d + 1:]) if w - s - n else None
            out.append((d, before, after))
            shape[d] = w
    return tuple(out)


def placed(local: Tensor, starts: Sequence[int], whole: Sequence[int]) -> Tensor:
    """A zero tensor of shape ``whole`` holding ``local`` at ``starts`` (PyNative and graphs;
    concatenated with zeros: MindSpore's CPU ``Pad`` is several times slower)."""
    for d, before, after in _fills(tuple(local.shape), tuple(starts), tuple(whole)):
        if before is not None:
            local = ops.concat((ops.zeros(before, local.dtype), local), d)
        if after is not None:
            local = ops.concat((local, ops.zeros(after, local.dtype)), d)
    return local


@run_in_python
def _ends(local_shape: Tuple[int, ...], starts: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(s + n for s, n in zip(starts, local_shape))


def piece(whole: Tensor, starts: Sequence[int], local_shape: Sequence[int]) -> Tensor:
    """The ``local_shape`` piece of ``whole`` at ``starts`` (PyNative and graphs)."""
    ends = _ends(tuple(local_shape), tuple(starts))
    return ops.strided_slice(whole, tuple(starts), ends, (1,) * len(ends))


def seeds_ignored() -> bool:
    """Whether the ``Dropout`` primitive ignores its seeds here (Ascend, by MindSpore's documentation)."""
    return ms.get_context("device_target") == "Ascend"


def refuse_ignored_seeds(where: str) -> None:
    """Raise on Ascend, where the ``Dropout`` primitive (``nn.Dropout``, ``ops.dropout``) draws
    unseeded masks: the ranks holding the same activation would drop different elements."""
    if seeds_ignored():
        raise NotImplementedError(
            f"{where}: MindSpore's Dropout primitive (nn.Dropout, ops.dropout) ignores its seeds on Ascend, so the "
            "ranks would draw different masks for one activation (replicas disagree, pieces are not one mask's); "
            "use mint.nn.Dropout / mint.nn.functional.dropout, whose masks follow the default generator "
            "(ms.manual_seed alike on every rank)")


def _layout(schema: OpSchema):
    x = schema.args[0]
    return whole_and_reduced(x.layout, (), x.ndim)


def _whole_draw(layout, shape, coord):
    """``None`` for a whole local tensor, else ``(starts, draw)``: ``draw(run, local)`` runs
    ``run`` on the whole shape and returns this rank's piece of each output."""
    if all(not p.is_shard() or layout.mesh_shape[a] == 1 for a, p in enumerate(layout.placements)):
        return None
    starts, local_shape = layout.global_offset(shape, coord), layout.local_shape(shape, coord)

    def draw(run, local):      # ``local`` may be the DTensor itself (its shape the global one)
        out = run(placed(plain_view(local), starts, shape))
        if isinstance(out, (tuple, list)):
            return tuple(piece(o, starts, local_shape) for o in out)
        return piece(out, starts, local_shape)
    return draw


@register_sharding("Dropout", ignored_args=(2, 3, "Seed0", "Seed1"))
def dropout_rule(schema: OpSchema) -> OutputSharding:
    """``Dropout(x, keep_prob, seed0, seed1)``: output and mask, placed like ``x``."""
    refuse_ignored_seeds("ops.dropout / nn.Dropout on a DTensor")
    layout, x = _layout(schema), schema.args[0]

    def local_fn(coord):
        draw = _whole_draw(layout, x.shape, coord)

        def dropout(op, local, keep_prob, seed0, seed1):
            if seed0 == 0 and seed1 == 0:       # the kernel would pick a seed per process
                seeded = ops.Dropout(keep_prob, 0, next(_UNSEEDED))

                def run(t):
                    return seeded(t)
            else:
                def run(t):
                    return op(t, keep_prob, seed0, seed1)
            return run(local) if draw is None else draw(run, local)
        return dropout
    return OutputSharding((layout, None, None, None), ((layout, x.shape), (layout, x.shape)), local_fn=local_fn,
                          calls_op=True)


@register_sharding("FuncDropoutExt")
def dropout_ext_rule(schema: OpSchema) -> OutputSharding:
    """``FuncDropoutExt(x, p, training, inplace, seed, offset)`` (seed and offset are tensors
    drawn from MindSpore's default generator): the output, placed like ``x``."""
    layout, x = _layout(schema), schema.args[0]

    def local_fn(coord):
        draw = _whole_draw(layout, x.shape, coord)

        def dropout(op, local, p, training, inplace, seed, offset):
            if draw is None:
                return op(local, p, training, inplace, seed, offset)
            out = draw(lambda t: op(t, p, training, False, seed, offset), local)
            if inplace:
                local.copy_(out)
                return local
            return out
        return dropout
    inputs = (layout,) + tuple(a.layout if isinstance(a, TensorArg) else None for a in schema.args[1:])
    return OutputSharding(inputs, ((layout, x.shape),), local_fn=local_fn, calls_op=True)
