"""``export_full``: one full checkpoint (safetensors, the format ``mindspore.load_checkpoint``
reads) from a distributed one, under MindSpore's names, for the unparallelized model and its
optimizer.

Example::

    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step_10")   # on N ranks
    export_full("ckpt/step_10", "resume.safetensors")                                # one process
    params = ms.load_checkpoint("resume.safetensors", format="safetensors")
    ms.load_param_into_net(net, params, strict_load=True)          # fc.weight, ...
    ms.load_param_into_net(optimizer, params, strict_load=True)    # adam_m.fc.weight, global_step, ...
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import numpy as np

from ._metadata import CheckpointError
from ._names import mindspore_names
from ._reader import open_checkpoint
from ._safetensors import write_file
from ._storage import StorageReader

__all__ = ["export_full"]


def export_full(checkpoint_id: str, path: str, *, prefix: str = "",
                storage_reader: Optional[StorageReader] = None) -> Dict[str, tuple]:
    """Assemble every tensor whose key starts with ``prefix`` (the prefix removed) into one
    safetensors file at ``path`` under MindSpore's names; returns name -> global shape. Runs in
    one process, no collectives; ``storage_reader`` as for ``load``.

    Names (see :mod:`._names`): a state saved as ``{"model": model_sd, "optim": optim_sd}``
    (``get_state_dict``) gives the model's parameter names and the optimizer's
    (``adam_m.<fqn>``, ``moments.<fqn>``, ``global_step``, ``beta1_power``, ...), so that
    ``load_param_into_net(net, ...)`` and ``load_param_into_net(optimizer, ...)`` resume on one
    device (a state saved as ``{"model": model_sd}`` gives the parameter names too);
    ``prefix="model."`` exports the model alone, ``prefix="optim."`` the optimizer alone.

    Args:
        checkpoint_id: the checkpoint (a directory for the default reader).
        path: the safetensors file to write.
        prefix: only keys starting with it, with it removed (``"model."``: the model alone).
        storage_reader: where the checkpoint is read from (default: :class:`FileSystemReader`).

    Example::

        shapes = export_full("ckpt/step_10", "resume.safetensors")
        params = ms.load_checkpoint("resume.safetensors", format="safetensors")
        ms.load_param_into_net(net, params, strict_load=True)
        ms.load_param_into_net(optimizer, params, strict_load=True)

    Raises:
        CheckpointError: no tensor under ``prefix``, or keys whose MindSpore names would be
            wrong (an optimizer moment naming no parameter, of another shape than its
            parameter, two keys with one name).
    """
    reader = open_checkpoint(checkpoint_id, storage_reader)
    meta = reader.metadata
    shapes = {key[len(prefix):]: tuple(entry.shape) for key, entry in meta.tensors.items() if key.startswith(prefix)}
    if not shapes:
        raise CheckpointError(f"checkpoint {reader.source} has no tensor whose key starts with {prefix!r}")
    values = {key[len(prefix):]: v for key, v in meta.values.items() if key.startswith(prefix)}
    names = mindspore_names(shapes, values)
    arrays: Dict[str, np.ndarray] = {}
    for key in sorted(shapes):
        arrays[names[key]] = reader.read_box(prefix + key, (0,) * len(shapes[key]), shapes[key])
    tmp = os.fspath(path) + ".tmp"
    write_file(tmp, arrays)
    os.replace(tmp, path)
    return {name: a.shape for name, a in arrays.items()}
