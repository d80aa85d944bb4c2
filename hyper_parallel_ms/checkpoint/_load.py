"""``load``: fill a state dict in place from a checkpoint saved on any layout. Every rank
reads the parts of the saved chunks that overlap its own pieces (no collectives needed on
a shared file system); everything is read and checked before anything is assigned.

Example::

    sd = get_model_state_dict(model)
    load(sd, checkpoint_id="ckpt/step_10")           # model's parameters now hold the saved values
"""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import numpy as np

from ._dist import Coordinator
from ._metadata import CheckpointError
from ._pieces import TensorRef, ValueRef, flatten
from ._reader import CheckpointReader, open_checkpoint

__all__ = ["load"]

_LISTED = 8


def load(state_dict: Dict[str, Any], *, checkpoint_id: str, no_dist: bool = False,
         use_collectives: bool = True) -> None:
    """Load a checkpoint into ``state_dict`` in place (PyTorch DCP's ``load``).

    Tensors are resharded from the saved layout to the layout of each value (DTensor,
    sharded Parameter, :class:`ShardedTensor`, plain tensor); Parameters are updated in
    place, non-tensor values are replaced in their dict. ``checkpoint_id`` may also be a
    full MindSpore checkpoint (``.safetensors`` or ``.ckpt``), imported into any layout.

    Every key of ``state_dict`` must be in the checkpoint, with the same global shape and
    dtype; the data is checked (sizes, CRC-32) before any value changes. With
    ``use_collectives`` (and not ``no_dist``) the ranks also agree that all of them
    succeeded before any of them assigns, so that a failure leaves every rank unchanged.

    Args:
        state_dict: a (nested) dict of values to fill, laid out as this run needs them.
        checkpoint_id: the checkpoint directory, or a full ``.safetensors`` / ``.ckpt`` file.
        no_dist: this process alone loads (no collectives), as a world of one.
        use_collectives: agree with the other ranks before assigning (a failure changes no rank).

    Raises:
        CheckpointError: naming the tensor and the file (missing, truncated, corrupted,
            mismatched or a checkpoint of another model).

    Example::

        state = {"model": get_model_state_dict(model), "step": 0}
        load(state, checkpoint_id="ckpt/step_10")      # parameters filled in place, state["step"] == 10
    """
    checkpoint_id = os.fspath(checkpoint_id)
    tensors, values = flatten(state_dict, for_save=False)
    coord = Coordinator(distributed=use_collectives and not no_dist)
    staged, error = None, None
    try:
        staged = _read_all(open_checkpoint(checkpoint_id), tensors, values)
    except Exception as exc:  # every rank must reach the agreement below
        if not coord.distributed:
            raise
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"

    coord.agree(error)
    data, new_values = staged
    for key, array in data.items():
        tensors[key].assign(array)
    for key, value in new_values.items():
        ref = values[key]
        ref.container[ref.index] = value


def _read_all(reader: CheckpointReader, tensors: Dict[str, TensorRef],
              values: Dict[str, ValueRef]) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    meta = reader.metadata
    missing = [k for k in tensors if k not in meta.tensors] + [k for k in values if k not in meta.values]
    if missing:
        shown = ", ".join(repr(k) for k in missing[:_LISTED]) + (" ..." if len(missing) > _LISTED else "")
        raise CheckpointError(f"{len(missing)} entries of the state dict are not in checkpoint {reader.source}: "
                              f"{shown} (a checkpoint of another model, or other state dict keys?)")
    for key, ref in tensors.items():
        entry = meta.tensors[key]
        if tuple(entry.shape) != ref.piece.shape or entry.dtype != ref.piece.dtype:
            raise CheckpointError(f"tensor {key!r}: checkpoint {reader.source} holds shape {tuple(entry.shape)} "
                                  f"{entry.dtype}, the state dict expects {ref.piece.shape} {ref.piece.dtype}")
    with reader.overlapped_checks():
        data = {key: reader.read_box(key, ref.piece.offsets, ref.piece.sizes) for key, ref in tensors.items()}
    return data, {k: meta.values[k] for k in values}

