"""``load``: fill a state dict in place from a checkpoint saved on any layout. Every rank
reads the parts of the saved chunks that overlap its own pieces (no collectives needed on
a shared file system); everything is read and checked before anything is assigned.

Example::

    sd = get_model_state_dict(model)
    load(sd, checkpoint_id="ckpt/step_10")           # model's parameters now hold the saved values
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from ._default_planner import DefaultLoadPlanner, LoadPlan
from ._dist import Coordinator
from ._metadata import CheckpointError
from ._pieces import cast_for_load, loads_into
from ._reader import CheckpointReader, open_checkpoint
from ._stateful import resolve_stateful, restore_stateful
from ._storage import StorageReader

__all__ = ["load"]

_LISTED = 8


def load(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
         storage_reader: Optional[StorageReader] = None, planner: Optional[DefaultLoadPlanner] = None,
         no_dist: bool = False, use_collectives: bool = True) -> None:
    """Load a checkpoint into ``state_dict`` in place (PyTorch DCP's ``load``).

    Tensors are resharded from the saved layout to the layout of each value (DTensor,
    sharded Parameter, :class:`ShardedTensor`, plain tensor); Parameters are updated in
    place, non-tensor values are replaced in their dict. ``checkpoint_id`` may also be a
    full MindSpore checkpoint (``.safetensors`` or ``.ckpt``), imported into any layout: its
    tensors are matched by MindSpore's names (``{"model": ..., "optim": ...}`` from
    ``get_state_dict`` takes the weights and the optimizer's moments and scalars), and a
    tensor of the file that matches no entry is refused.

    Every entry the planner asks for (by default: every key of ``state_dict``) must be in the
    checkpoint, with the same global shape and the same dtype or, for floating tensors, another
    floating dtype (cast on load, as PyTorch's ``copy_``: an fp32 checkpoint into a bf16 model); the data is checked (sizes, CRC-32)
    before any value changes. With ``use_collectives`` (and not ``no_dist``) the ranks also
    agree that all of them succeeded, and read the same save, before any of them assigns, so
    that a failure leaves every rank unchanged.

    Args:
        state_dict: a (nested) dict of values to fill, laid out as this run needs them; a
            top-level value with ``state_dict()`` / ``load_state_dict()`` (PyTorch's ``Stateful``)
            is filled through them.
        checkpoint_id: the checkpoint directory, or a full ``.safetensors`` / ``.ckpt`` file
            (``None``: the storage reader's own location).
        storage_reader: where the data comes from (default :class:`FileSystemReader`).
        planner: which entries are filled from which checkpoint keys (default
            :class:`DefaultLoadPlanner`; subclass it to filter or rename keys).
        no_dist: this process alone loads (no collectives), as a world of one.
        use_collectives: agree with the other ranks before assigning (a failure changes no rank).

    Raises:
        CheckpointError: naming the tensor and the file (missing, truncated, corrupted,
            mismatched or a checkpoint of another model).

    Example::

        state = {"model": get_model_state_dict(model), "step": 0}
        load(state, checkpoint_id="ckpt/step_10")      # parameters filled in place, state["step"] == 10
    """
    planner = planner if planner is not None else DefaultLoadPlanner()
    given, state_dict = state_dict, resolve_stateful(state_dict)
    coord = Coordinator(distributed=use_collectives and not no_dist)
    staged, error, save_id = None, None, None
    try:
        reader = open_checkpoint(checkpoint_id, storage_reader)
        save_id = reader.metadata.save_id
        planner.set_up_planner(state_dict, reader.metadata, full_file=reader.full_file)
        staged = _read_all(reader, planner, planner.create_local_plan())
    except Exception as exc:  # every rank must reach the agreement below
        if not coord.distributed:
            raise
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    ids = coord.all_gather(save_id)
    if error is None and len({i for i in ids if i is not None}) > 1:
        error = f"the ranks read different saves of {checkpoint_id} (it was replaced during the load); load again"
    coord.agree(error)
    data, new_values = staged
    for key, array in data.items():
        planner.tensors[key].assign(array)
    for key, value in new_values.items():
        ref = planner.values[key]
        ref.container[ref.index] = value
    restore_stateful(given, state_dict)


def _read_all(reader: CheckpointReader, planner: DefaultLoadPlanner,
              plan: LoadPlan) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    meta, names = reader.metadata, plan.tensors
    missing = [k for k, n in names.items() if n not in meta.tensors] + [
        k for k, n in plan.values.items() if n not in meta.values]
    if missing:
        shown = ", ".join(_shown(k, names) for k in missing[:_LISTED]) + (" ..." if len(missing) > _LISTED else "")
        raise CheckpointError(f"{len(missing)} entries of the state dict are not in checkpoint {reader.source}: "
                              f"{shown} (a checkpoint of another model, or other state dict keys? To keep the values of entries "
                              "the checkpoint lacks, pass planner=DefaultLoadPlanner(allow_partial_load=True))")
    for key, name in names.items():
        piece, entry = planner.tensors[key].piece, meta.tensors[name]
        if tuple(entry.shape) != piece.shape or not loads_into(entry.dtype, piece.dtype):
            raise CheckpointError(f"tensor {_shown(key, names)}: checkpoint {reader.source} holds shape "
                                  f"{tuple(entry.shape)} {entry.dtype}, the state dict expects {piece.shape} "
                                  f"{piece.dtype}")
    with reader.overlapped_checks():
        data = {key: reader.read_box(name, planner.tensors[key].piece.offsets, planner.tensors[key].piece.sizes)
                for key, name in names.items()}
    # floating tensors saved in another dtype: cast to the target's (checked above)
    data = {key: cast_for_load(key, array, planner.tensors[key].piece.dtype) for key, array in data.items()}
    return data, {k: meta.values[n] for k, n in plan.values.items()}


def _shown(key: str, names: Dict[str, str]) -> str:
    return repr(key) if names.get(key, key) == key else f"{key!r} (checkpoint key {names[key]!r})"
