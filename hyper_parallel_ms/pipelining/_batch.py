"""Checks of a step's batch before any rank runs it: whether stage 0's inputs and the last
stage's target split into micro-batches (as codes the pp ranks agree on, then one message on
every rank), the chunk specs' types, and each micro-batch's weight in the gradients.

Example::

    code = batch_problem((x,), 4)                     # (0, 0, 0, rows, rows, uneven): fine
    weights = microbatch_weights(code[3:6], (0, 0, 0), 4, True, "ScheduleGPipe")
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from mindspore import Tensor

from ._microbatch import TensorChunkSpec, chunk_sizes, tree_leaves

__all__ = ["batch_problem", "batch_message", "check_chunk_specs", "microbatch_weights", "MISSING", "ZERO_DIM",
           "NO_TENSOR", "TOO_SMALL", "TARGET_WITHOUT_LOSS", "BAD_SPEC"]

MISSING, ZERO_DIM, NO_TENSOR, TOO_SMALL, TARGET_WITHOUT_LOSS, BAD_SPEC = 1, 2, 3, 4, 5, 6


def batch_problem(values: Optional[Sequence[object]], n: int, dims: Optional[Sequence[Optional[int]]] = None
                   ) -> Tuple[int, int, int, int, int, int]:
    """(code, index, rows, fewest rows, most rows, uneven) of ``values`` (a stage's inputs, or the target
    alone) split into ``n`` micro-batches; code 0: fine, then the fewest and most rows of its Tensors
    and whether one does not split evenly. Nested tuples, lists and dicts are flattened (the index
    counts their leaves); ``dims``: each leaf's split dim (default 0 for Tensors; ``None``: given
    whole); values that are not Tensors go to every micro-batch (PyTorch's); a Tensor needs a split
    dim of at least ``n`` rows."""
    if not values:
        return MISSING, 0, 0, 0, 0, 0
    leaves = tree_leaves(tuple(values))
    dims = [0] * len(leaves) if dims is None else dims
    rows = []
    for i, (t, d) in enumerate(zip(leaves, dims)):
        if not isinstance(t, Tensor) or d is None:
            continue
        if t.ndim == 0:
            return ZERO_DIM, i, 0, 0, 0, 0
        if t.shape[d] < n:
            return TOO_SMALL, i, t.shape[d], 0, 0, 0
        rows.append(t.shape[d])
    if not rows:
        return NO_TENSOR, 0, 0, 0, 0, 0
    return 0, 0, 0, min(rows), max(rows), int(any(r % n for r in rows))


def check_chunk_specs(args_spec: Any, kwargs_spec: Any, merge_spec: Any, name: str) -> None:
    """PyTorch's chunk specs: a tuple per positional input, a dict per keyword, a spec (or a tuple
    / dict of them) for the outputs; each entry a :class:`TensorChunkSpec`, ``None`` or a structure of them."""
    def entries_ok(value: Any) -> bool:
        return all(v is None or isinstance(v, TensorChunkSpec) for v in tree_leaves(value))
    if args_spec is not None and not (isinstance(args_spec, (tuple, list)) and entries_ok(args_spec)):
        raise TypeError(f"{name}: args_chunk_spec must be a tuple with a TensorChunkSpec (or None, or a structure of "
                        f"them) per positional input, got {args_spec!r}")
    if kwargs_spec is not None and not (isinstance(kwargs_spec, dict) and entries_ok(kwargs_spec)):
        raise TypeError(f"{name}: kwargs_chunk_spec must be a dict of TensorChunkSpec (or None) per keyword input, "
                        f"got {kwargs_spec!r}")
    if merge_spec is not None and not (isinstance(merge_spec, (TensorChunkSpec, tuple, list, dict)) and
                                       entries_ok(merge_spec)):
        raise TypeError(f"{name}: output_merge_spec must be a TensorChunkSpec, or a tuple / dict of them like the "
                        f"outputs (None: a list over the micro-batches), got {merge_spec!r}")


def batch_message(what: str, code: int, index: int, size: int, n: int) -> str:
    if code == TARGET_WITHOUT_LOSS:
        return ("the last stage got a target, but the schedule has no loss_fn there and runs forward only; pass "
                "loss_fn=... (loss_fn(output, target)) when building the schedule to train")
    if code == BAD_SPEC:
        return ("the first stage's inputs do not fit args_chunk_spec / kwargs_chunk_spec or do not split (the rank "
                "holding it raises the details)")
    if code == MISSING:
        return (f"the rank holding the {what} stage got no {what == 'first' and 'batch' or 'target'}: pass "
                f"{what == 'first' and 'the inputs to step(*args, **kwargs)' or 'step(..., target=...)'} there")
    name = (f"input {index} (positional arguments, then keyword arguments, nested tuples, lists and dicts "
            f"flattened)" if what == "first" else "target" if index == 0 else f"target's Tensor {index}")
    if code == ZERO_DIM:
        return f"{what} stage's {name} is a 0-d Tensor, which has no batch dim to split"
    if code == NO_TENSOR:
        return (f"{what} stage's {'inputs hold' if what == 'first' else 'target is'} no Tensor with a batch dim to "
                f"split into micro-batches")
    return (f"{what} stage's {name} has batch size {size}, fewer rows than {n} micro-batches; use a batch of at "
            f"least {n} rows or fewer micro-batches")


def microbatch_weights(first: Sequence[float], last: Sequence[float], n: int, scale_grads: bool,
                        name: str) -> List[float]:
    """Each micro-batch's weight in the gradients, from the agreed (fewest rows, most rows, uneven) of
    the first stage's inputs and of the last stage's target (zeros where absent): ``1 / n`` for an
    even split (Tensors may then differ in rows, e.g. a target of one row per token), ``rows_m /
    rows`` for an uneven one, which needs one row count in every Tensor (chunks of different rows
    would not pair up)."""
    sizes = {int(v) for v in (first[0], first[1], last[0], last[1]) if v}
    if first[2] or last[2]:
        if len(sizes) > 1:
            raise ValueError(f"{name}.step: a batch that does not split evenly into {n} micro-batches needs the same "
                             f"rows in every Tensor of the first stage's inputs and the last stage's target, got "
                             f"{sorted(sizes)}; use a batch size that is a multiple of {n} or give every Tensor the "
                             f"batch's rows")
        rows = sizes.pop()
        return [r / rows if scale_grads else 1.0 for r in chunk_sizes(rows, n)]
    return [1.0 / n if scale_grads else 1.0] * n
