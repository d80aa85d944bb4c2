"""The safetensors file format, written and read directly so that a reader can fetch one
tensor of a large file without loading the rest: 8 bytes (little-endian header length),
a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with
spaces to a multiple of 8, then the raw bytes. Files written here are read by
``mindspore.load_checkpoint(..., format="safetensors")`` and the ``safetensors`` package.

Example:
    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> _ = write_file(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    >>> SafetensorsFile(path).read("w").tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from ._metadata import CheckpointError

__all__ = ["write_file", "SafetensorsFile", "crc32", "to_safetensors_dtype", "from_safetensors_dtype"]

_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32",
          "uint64": "U64", "bool": "BOOL"}
_NAMES = {v: k for k, v in _CODES.items()}
_BLOCK = 64 << 20


def to_safetensors_dtype(name: str) -> str:
    """Safetensors dtype code of a numpy dtype name (``"float32"`` -> ``"F32"``)."""
    if name not in _CODES:
        raise CheckpointError(f"dtype {name} cannot be stored in safetensors; supported: {sorted(_CODES)}")
    return _CODES[name]


def from_safetensors_dtype(code: str) -> np.dtype:
    """Numpy dtype of a safetensors dtype code (``"BF16"`` needs MindSpore's bfloat16)."""
    if code not in _NAMES:
        raise CheckpointError(f"unknown safetensors dtype {code!r}")
    return numpy_dtype(_NAMES[code])


def numpy_dtype(name: str) -> np.dtype:
    """Numpy dtype for a name, including ``bfloat16`` (the dtype MindSpore's asnumpy uses)."""
    if name == "bfloat16":
        import mindspore as ms
        return ms.Tensor([0.0], ms.bfloat16).asnumpy().dtype
    return np.dtype(name)


def crc32(array: np.ndarray) -> int:
    """CRC-32 of an array's bytes (C order)."""
    data = _bytes(array)
    value = 0
    for start in range(0, len(data), _BLOCK):
        value = zlib.crc32(data[start:start + _BLOCK], value)
    return value


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.asarray(array, order="C").reshape(-1).view(np.uint8))


def write_file(path: str, arrays: Mapping[str, np.ndarray], metadata: Optional[Dict[str, str]] = None,
               *, fsync: bool = True, checksums: Optional[Mapping[str, int]] = None) -> Dict[str, Tuple[int, int]]:
    """Write ``arrays`` to ``path`` in safetensors format (fsync'd); return each key's
    ``(crc32, nbytes)``. ``checksums``: CRC-32s already computed of some of these very arrays
    (not recomputed)."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset, contiguous = 0, {}
    for key, array in arrays.items():
        a = np.asarray(array, order="C")
        contiguous[key] = a
        header[key] = {"dtype": to_safetensors_dtype(a.dtype.name), "shape": list(a.shape),
                       "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool, open(path, "wb") as f:
        # the CRCs are computed in threads beside the writes (both release the GIL)
        known = checksums or {}
        pending = {key: pool.submit(crc32, a) for key, a in contiguous.items() if key not in known}
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in contiguous.values():
            f.write(_bytes(a))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        return {key: (known[key] if key in known else pending[key].result(), a.nbytes)
                for key, a in contiguous.items()}


class SafetensorsFile:
    """A safetensors file opened for reading single tensors: opened once, its header parsed
    and its data memory-mapped from that one open (a file replaced or removed afterwards is
    still read whole, as it was; only the pages touched are read)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{path} is truncated: {size} bytes, no safetensors header")
                (length,) = struct.unpack("<Q", raw)
                if length > size - 8:
                    raise CheckpointError(f"{path} is truncated or corrupted: header of {length} bytes in a "
                                          f"file of {size} bytes")
                header = json.loads(f.read(length))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint file {path} is missing") from exc
        except ValueError as exc:
            raise CheckpointError(f"{path} has a corrupted safetensors header ({exc})") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} has a corrupted safetensors header (not a JSON object)")
        self.data_start = 8 + length
        self.size = size
        self.metadata: Dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: Dict[str, dict] = header

    def keys(self):
        return self.entries.keys()

    def dtype(self, key: str) -> np.dtype:
        return from_safetensors_dtype(self._entry(key)["dtype"])

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def read(self, key: str) -> np.ndarray:
        """The tensor stored under ``key``, as a copy."""
        return self.view(key).copy()

    def view(self, key: str) -> np.ndarray:
        """The tensor stored under ``key`` as a read-only array over a memory map of the file
        (no copy; only the pages touched are read). The map lives as long as its views."""
        entry = self._entry(key)
        begin, end = entry["data_offsets"]
        dtype = from_safetensors_dtype(entry["dtype"])
        shape = tuple(entry["shape"])
        if self.data_start + end > self.size:
            raise CheckpointError(f"{self.path} is truncated: tensor {key!r} needs bytes up to "
                                  f"{self.data_start + end}, the file has {self.size}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != end - begin:
            raise CheckpointError(f"{self.path}: tensor {key!r} has {end - begin} bytes for shape {shape} "
                                  f"{dtype}: corrupted header")
        if not nbytes:
            return np.empty(shape, dtype)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=self.data_start + begin)
        return raw.view(dtype).reshape(shape)

    def _entry(self, key: str) -> dict:
        if key not in self.entries:
            raise CheckpointError(f"tensor {key!r} is not in {self.path}")
        return self.entries[key]
