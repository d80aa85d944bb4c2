"""Distributed checkpoints: save on one layout, load on any other, nothing lost.

:func:`save` / :func:`load` follow PyTorch's ``torch.distributed.checkpoint`` with
HyperParallel's arguments (``no_dist``, ``use_collectives``, ``remove_redundancy``,
``save_to_minimum_rank``) and DCP's extension points (``storage_writer`` / ``storage_reader``,
``planner``); the state-dict functions follow
``torch.distributed.checkpoint.state_dict``. Files: one safetensors file per writing rank
and ``metadata.json``; :func:`export_full` writes one full MindSpore safetensors checkpoint,
and :func:`load` imports such a file into any layout.

Example::

    from hyper_parallel_ms import checkpoint as dcp
    model_sd, optim_sd = dcp.get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": 10}, checkpoint_id="ckpt/step_10")
    ...                                                    # later, on any layout
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, checkpoint_id="ckpt/step_10")          # parameters and moments filled in place
"""
from ._default_planner import DefaultLoadPlanner, DefaultSavePlanner, LoadPlan
from ._export import export_full
from ._filesystem import FileSystemReader, FileSystemWriter
from ._load import load
from ._metadata import CheckpointError, Chunk, Metadata, TensorEntry
from ._pieces import ShardedTensor
from ._boxes import Piece
from ._reader import open_checkpoint
from ._save import AsyncSave, async_save, save
from ._storage import NO_CHECKSUM, StorageReader, StorageWriter, StoredChunk
from ._state_dict import (IncompatibleKeys, StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                          get_state_dict, set_model_state_dict, set_optimizer_state_dict, set_state_dict)

__all__ = ["save", "async_save", "AsyncSave", "load", "export_full", "open_checkpoint", "CheckpointError", "Metadata",
           "TensorEntry", "Chunk", "ShardedTensor", "StateDictOptions", "IncompatibleKeys", "get_model_state_dict",
           "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict", "StorageWriter", "StorageReader", "StoredChunk", "NO_CHECKSUM", "FileSystemWriter",
           "FileSystemReader", "DefaultSavePlanner", "DefaultLoadPlanner", "LoadPlan", "Piece"]
