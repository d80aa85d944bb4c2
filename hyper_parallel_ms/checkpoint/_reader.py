"""Opening a checkpoint for reading: a committed directory (``metadata.json``), a directory
of rank-local parts (``metadata_rank_K.json``, saved without collectives), or one full
MindSpore checkpoint (``.safetensors`` or ``.ckpt``: each tensor one chunk). Chunks are
read whole and checked against their size and CRC-32.

Example::

    reader = open_checkpoint("ckpt/step_10")
    entry = reader.metadata.tensors["model.up.weight"]
    data = reader.read_chunk(entry.chunks[0])
"""
from __future__ import annotations

import glob
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ._commit import previous_dir, staging_dir
from ._metadata import METADATA_FILE, CheckpointError, Chunk, Metadata, TensorEntry
from ._planner import plan_reads
from ._safetensors import SafetensorsFile, crc32, numpy_dtype

__all__ = ["CheckpointReader", "open_checkpoint", "NO_CHECKSUM"]

NO_CHECKSUM = -1


class CheckpointReader:
    """Metadata of a checkpoint and verified reads of its chunks."""

    def __init__(self, source: str, metadata: Metadata, directory: Optional[str] = None,
                 arrays: Optional[Dict[str, np.ndarray]] = None) -> None:
        self.source, self.metadata, self.directory, self._arrays = source, metadata, directory, arrays
        self._files: Dict[str, SafetensorsFile] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._checks: Optional[List[Tuple[str, Chunk, str, Future]]] = None

    def read_chunk(self, key: str, chunk: Chunk) -> np.ndarray:
        """The chunk's data (read-only, over a memory map of its file); raises
        :class:`CheckpointError` naming the tensor and the file when the file is missing,
        truncated or corrupted."""
        if self._arrays is not None:
            return self._arrays[chunk.key]
        path = os.path.join(self.directory, chunk.file)
        if chunk.file not in self._files:
            if not os.path.exists(path):
                raise CheckpointError(f"tensor {key!r}: its data file {path} is missing (the checkpoint {self.source} "
                                      "is incomplete)")
            self._files[chunk.file] = SafetensorsFile(path)
        data = self._files[chunk.file].view(chunk.key)
        if tuple(data.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"tensor {key!r}: chunk {chunk.key!r} in {path} has shape {data.shape}, the metadata "
                                  f"says {chunk.sizes}: the file does not belong to this checkpoint")
        if chunk.crc32 != NO_CHECKSUM:
            if self._checks is None:
                _verify(key, chunk, path, crc32(data))
            else:
                self._checks.append((key, chunk, path, self._pool.submit(crc32, data)))
        return data

    @contextmanager
    def overlapped_checks(self) -> Iterator[None]:
        """Within this block, CRCs are computed in threads beside the next reads, and all are
        checked when the block ends (raising for the first chunk that fails)."""
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            self._pool, self._checks = pool, []
            try:
                yield
                for key, chunk, path, future in self._checks:
                    _verify(key, chunk, path, future.result())
            finally:
                self._pool, self._checks = None, None


    def read_box(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """The box (``offsets``, ``sizes``) of tensor ``key`` (read-only), assembled from the
        saved chunks that overlap it (each checked whole)."""
        entry = self.metadata.tensors[key]
        reads = plan_reads(key, entry, offsets, sizes, self.source)
        if len(reads) == 1 and tuple(reads[0].chunk.sizes) == tuple(sizes):
            return self.read_chunk(key, reads[0].chunk)
        out = np.empty(tuple(sizes), dtype=numpy_dtype(entry.dtype))
        for read in reads:
            out[read.dst] = self.read_chunk(key, read.chunk)[read.src]
        return out


def _verify(key: str, chunk: Chunk, path: str, got: int) -> None:
    if got != chunk.crc32:
        raise CheckpointError(f"tensor {key!r}: chunk {chunk.key!r} in {path} fails its checksum (CRC-32 "
                              f"{got:#010x}, expected {chunk.crc32:#010x}): the file is corrupted")


def open_checkpoint(checkpoint_id: str) -> CheckpointReader:
    """A reader for a checkpoint directory or a full ``.safetensors`` / ``.ckpt`` file.

    Args:
        checkpoint_id: a checkpoint directory or a full ``.safetensors`` / ``.ckpt`` file.

    Example::

        reader = open_checkpoint("ckpt/step_10")
        reader.metadata.tensors["model.fc.weight"].shape
    """
    path = os.fspath(checkpoint_id)
    if os.path.isfile(path):
        return _full_file(path)
    if not os.path.isdir(path) and os.path.exists(os.path.join(previous_dir(path), METADATA_FILE)):
        path = previous_dir(path)      # a save died while replacing it: the previous one is complete
    if not os.path.isdir(path):
        if os.path.isdir(staging_dir(path)):
            raise CheckpointError(f"checkpoint {path} was never committed: only {staging_dir(path)} exists (a save "
                                  "died before every rank finished); load an earlier checkpoint")
        raise CheckpointError(f"checkpoint {path} does not exist")
    meta_path = os.path.join(path, METADATA_FILE)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return CheckpointReader(path, Metadata.from_json(f.read(), meta_path), directory=path)
    parts = sorted(glob.glob(os.path.join(path, "metadata_rank_*.json")))
    if not parts:
        raise CheckpointError(f"{path} has no {METADATA_FILE}: it is not a committed checkpoint")
    return CheckpointReader(path, _merge_rank_parts(path, parts), directory=path)


def _merge_rank_parts(path: str, parts) -> Metadata:
    metas = {}
    for part in parts:
        with open(part) as f:
            metas[int(re.search(r"metadata_rank_(\d+)\.json$", part).group(1))] = Metadata.from_json(f.read(), part)
    world = {m.world_size for m in metas.values()}
    if len(world) != 1:
        raise CheckpointError(f"the rank-local parts of {path} come from saves with different world sizes {world}")
    missing = sorted(set(range(world.pop())) - set(metas))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the parts of ranks {missing} (metadata_rank_K.json missing)")
    tensors: Dict[str, TensorEntry] = {}
    for rank in sorted(metas):
        for key, entry in metas[rank].tensors.items():
            old = tensors.get(key)
            if old is not None and (old.shape, old.dtype) != (entry.shape, entry.dtype):
                raise CheckpointError(f"tensor {key!r}: rank parts of {path} disagree on shape or dtype")
            tensors[key] = TensorEntry(entry.shape, entry.dtype, (old.chunks if old else ()) + entry.chunks)
    return Metadata(tensors, metas[min(metas)].values, len(metas))


def _full_file(path: str) -> CheckpointReader:
    if path.endswith(".safetensors"):
        f = SafetensorsFile(path)
        tensors = {}
        for key in f.keys():
            shape = f.shape(key)
            nbytes = int(np.prod(shape, dtype=np.int64)) * f.dtype(key).itemsize
            chunk = Chunk((0,) * len(shape), shape, os.path.basename(path), key, NO_CHECKSUM, nbytes)
            tensors[key] = TensorEntry(shape, f.dtype(key).name, (chunk,))
        return CheckpointReader(path, Metadata(tensors), directory=os.path.dirname(os.path.abspath(path)))
    if path.endswith(".ckpt"):
        import mindspore as ms
        try:
            params = ms.load_checkpoint(path)
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable MindSpore checkpoint: {exc}") from exc
        arrays = {k: p.asnumpy() for k, p in params.items()}
        tensors = {k: TensorEntry(a.shape, a.dtype.name, (Chunk((0,) * a.ndim, a.shape, os.path.basename(path), k,
                                                                NO_CHECKSUM, a.nbytes),))
                   for k, a in arrays.items()}
        return CheckpointReader(path, Metadata(tensors), arrays=arrays)
    raise CheckpointError(f"{path} is a file but neither a .safetensors nor a .ckpt checkpoint")
