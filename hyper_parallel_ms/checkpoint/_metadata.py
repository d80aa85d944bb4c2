"""What a checkpoint holds: for every tensor its global shape, dtype and the chunks that
cover it (global offsets, sizes, the file and key they are stored under, a CRC-32), plus
the non-tensor values (step counters, settings) of the state dict.

Stored as ``metadata.json`` beside the data files. Pure Python: no MindSpore import.

Example:
    >>> chunk = Chunk((0, 0), (2, 3), "rank_0.safetensors", "w@0,0", 123, 24)
    >>> meta = Metadata({"w": TensorEntry((4, 3), "float32", (chunk,))}, {"step": 5})
    >>> Metadata.from_json(meta.to_json()) == meta
    True
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

__all__ = ["CheckpointError", "Chunk", "TensorEntry", "Metadata", "FORMAT", "VERSION", "METADATA_FILE"]

FORMAT = "hyper_parallel_ms.checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the tensor and the file.

    Example::

        try:
            dcp.load(state, checkpoint_id="ckpt/step_10")
        except CheckpointError as error:     # nothing was changed
            print(error)
    """


@dataclass(frozen=True)
class Chunk:
    """A box of a global tensor stored in one file: ``offsets`` and ``sizes`` per dim.

    Args:
        offsets: the box's first index along each dim of the global tensor.
        sizes: the box's length along each dim.
        file: the safetensors file (relative to the checkpoint folder) holding it.
        key: its tensor name in that file.
        crc32: the CRC-32 of its bytes.
        nbytes: its size in bytes.

    >>> Chunk((2, 0), (2, 3), "data_1.safetensors", "w#1", 0, 24).to_json()["offsets"]
    [2, 0]
    """

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    file: str
    key: str
    crc32: int
    nbytes: int

    def to_json(self) -> Dict[str, Any]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes), "file": self.file, "key": self.key,
                "crc32": self.crc32, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Chunk":
        return cls(tuple(d["offsets"]), tuple(d["sizes"]), d["file"], d["key"], int(d["crc32"]), int(d["nbytes"]))


@dataclass(frozen=True)
class TensorEntry:
    """A saved tensor: global ``shape``, numpy ``dtype`` name and the ``chunks`` covering it.

    Args:
        shape: the global shape.
        dtype: the numpy dtype name (``"float32"``, ``"bfloat16"``, ...).
        chunks: the :class:`Chunk` s covering the tensor, each element once.

    >>> TensorEntry((4,), "float32", ()).to_json()
    {'shape': [4], 'dtype': 'float32', 'chunks': []}
    """

    shape: Tuple[int, ...]
    dtype: str
    chunks: Tuple[Chunk, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "TensorEntry":
        return cls(tuple(d["shape"]), d["dtype"], tuple(Chunk.from_json(c) for c in d["chunks"]))


@dataclass(frozen=True)
class Metadata:
    """Every tensor (flat key -> :class:`TensorEntry`) and non-tensor value of a checkpoint.

    Args:
        tensors: flat key (``"model.fc.weight"``) -> :class:`TensorEntry`.
        values: flat key -> a non-tensor value (JSON: ints, floats, strings, lists, dicts).
        world_size: the number of ranks that saved it.
        save_id: an id unique to each save (``""`` where none is recorded, e.g. a full MindSpore
            checkpoint); the ranks of a load compare it to be sure they read the same save.

    >>> Metadata({}, {"step": 10}, world_size=2).world_size
    2
    """

    tensors: Dict[str, TensorEntry]
    values: Dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    save_id: str = ""                # unique per save: tells two saves to the same id apart

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION,
                           "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
                           "values": self.values, "world_size": self.world_size, "save_id": self.save_id}, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "metadata") -> "Metadata":
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(f"{source} is not valid JSON ({exc}): the file is truncated or corrupted") from exc
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"{source} is not a {FORMAT} metadata file")
        if d.get("version") != VERSION:
            raise CheckpointError(f"{source} has format version {d.get('version')}; this release reads {VERSION}")
        return cls({k: TensorEntry.from_json(v) for k, v in d["tensors"].items()}, dict(d["values"]),
                   int(d.get("world_size", 1)), str(d.get("save_id", "")))
