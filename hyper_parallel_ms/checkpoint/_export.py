"""``export_full``: one full checkpoint (safetensors, the format ``mindspore.load_checkpoint``
reads) from a distributed one, for the unparallelized model.

Example::

    export_full("ckpt/step_10", "model.safetensors", prefix="model.")
    ms.load_param_into_net(net, ms.load_checkpoint("model.safetensors", format="safetensors"))
"""
from __future__ import annotations

import os
from typing import Dict

import numpy as np

from ._metadata import CheckpointError
from ._reader import open_checkpoint
from ._safetensors import write_file

__all__ = ["export_full"]


def export_full(checkpoint_id: str, path: str, *, prefix: str = "") -> Dict[str, tuple]:
    """Assemble every tensor whose key starts with ``prefix`` (the prefix removed: with
    ``prefix="model."`` the names are the model's parameter names) into one safetensors file
    at ``path``; returns name -> global shape. Runs in one process, no collectives.

    Args:
        checkpoint_id: the checkpoint directory.
        path: the safetensors file to write.
        prefix: only keys starting with it, with it removed (``"model."``: the model's parameter names).

    Example::

        shapes = export_full("ckpt/step_10", "model.safetensors", prefix="model.")
        ms.load_checkpoint("model.safetensors", net, format="safetensors")
    """
    reader = open_checkpoint(os.fspath(checkpoint_id))
    arrays: Dict[str, np.ndarray] = {}
    for key, entry in sorted(reader.metadata.tensors.items()):
        if not key.startswith(prefix):
            continue
        arrays[key[len(prefix):]] = reader.read_box(key, (0,) * len(entry.shape), entry.shape)
    if not arrays:
        raise CheckpointError(f"checkpoint {reader.source} has no tensor whose key starts with {prefix!r}")
    tmp = os.fspath(path) + ".tmp"
    write_file(tmp, arrays)
    os.replace(tmp, path)
    return {k: a.shape for k, a in arrays.items()}
