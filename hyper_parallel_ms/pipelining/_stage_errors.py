"""What a pipeline step says when a stage's forward or its ``loss_fn`` goes wrong: the stage, the
micro-batch, the shapes the stage received and where they came from (PyTorch's stages raise
"failed to run forward" with the inputs too), and a loss that is not one number.

Example::

    check_loss(loss, stage=3)                  # TypeError / ValueError naming loss_fn
    raise RuntimeError(forward_failure(1, 0, (h,), {}, "received from stage 0 on pp rank 0", None, error))
"""
from __future__ import annotations

from typing import Any, Optional

from mindspore import Tensor

from ._microbatch import tree_leaves

__all__ = ["check_loss", "forward_failure", "input_origin"]


def _shapes(value: Any) -> list:
    """The shape of each Tensor of ``value`` (nested containers flattened), the type name of anything else."""
    return [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in tree_leaves(value)]


def check_loss(loss: object, stage: int) -> None:
    """Raise unless ``loss`` (what ``loss_fn`` returned on ``stage``) is a Tensor of one element
    (PyTorch's backward of a loss needs one element too).

    >>> check_loss(None, 3)
    Traceback (most recent call last):
    ...
    TypeError: loss_fn returned None on stage 3; loss_fn(output, target) must return the micro-batch's loss as a scalar Tensor, e.g. ((output - target) ** 2).mean()
    """
    if not isinstance(loss, Tensor):
        got = "None" if loss is None else f"a {type(loss).__name__} ({loss!r})"
        raise TypeError(f"loss_fn returned {got} on stage {stage}; loss_fn(output, target) must return the "
                        f"micro-batch's loss as a scalar Tensor, e.g. ((output - target) ** 2).mean()")
    if loss.size != 1:
        raise ValueError(f"loss_fn returned a Tensor of shape {tuple(loss.shape)} on stage {stage}; it must return "
                         f"the micro-batch's loss as a scalar (one element): reduce it, e.g. with .mean() or .sum() "
                         f"(MindSpore's nn losses: reduction='mean' or 'sum')")


def input_origin(stage: int, microbatch: int, placement: tuple) -> str:
    """Where ``stage``'s inputs of ``microbatch`` came from, under ``placement`` (the rank of each stage).

    >>> input_origin(2, 0, (0, 1, 0, 1))
    'received from stage 1 on pp rank 1'
    """
    if stage == 0:
        return f"micro-batch {microbatch} of the batch given to step()"
    if placement[stage - 1] == placement[stage]:
        return f"the outputs of stage {stage - 1} on this rank"
    return f"received from stage {stage - 1} on pp rank {placement[stage - 1]}"


def forward_failure(stage: int, microbatch: int, args: Any, kwargs: dict, origin: str, target: Optional[Any],
                    error: BaseException) -> str:
    """The message of a stage forward that raised ``error``: the stage and micro-batch, the error's
    first paragraph (MindSpore's C++ stack left out), the input shapes, their origin and the fix.

    >>> print(forward_failure(1, 0, (Tensor([[1.0, 2.0]]),), {}, "received from stage 0 on pp rank 0", None,
    ...                       ValueError("For 'MatMul' the input dimensions must be equal")))
    stage 1 failed to run its forward on micro-batch 0: ValueError: For 'MatMul' the input dimensions must be equal; its inputs have shapes [(1, 2)], received from stage 0 on pp rank 0; the outputs of stage 0 must be what stage 1's Cell takes (check where the model was split), or pass input_args= / output_args= to PipelineStage to have every micro-batch's shapes checked
    """
    text = str(error).strip().split("\n\n")[0].strip()
    inputs = f"its inputs have shapes {_shapes(args)}"
    if kwargs:
        inputs += f" and keyword inputs {dict(zip(kwargs, (_shapes(v) for v in kwargs.values())))}"
    fix = (f"the outputs of stage {stage - 1} must be what stage {stage}'s Cell takes (check where the model was "
           f"split)" if stage else "the batch's Tensors must be what stage 0's Cell takes")
    if target is not None:
        fix += ", and loss_fn(output, target) must take its output and the target"
    what = "its forward" if target is None else "its forward and loss_fn"
    origin += "" if target is None else f" (and a target of {_shapes(target)})"
    return (f"stage {stage} failed to run {what} on micro-batch {microbatch}: {type(error).__name__}: {text}; "
            f"{inputs}, {origin}; {fix}, or pass input_args= / output_args= to PipelineStage to have every "
            f"micro-batch's shapes checked")
