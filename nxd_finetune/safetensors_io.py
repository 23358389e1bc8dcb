"""Writing safetensors files whose tensors arrive one at a time (a checkpoint stage gathered
across tensor-parallel ranks, an exported model's shards): the header's bytes from the tensors'
keys, dtypes and shapes, then each tensor's bytes as it comes, so a writer never holds more than
one tensor; and reading one without a memory map (:class:`FileTensors`), each tensor into memory of
its own by plain file reads."""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Sequence
from typing import BinaryIO

import torch

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}

Entry = tuple[str, torch.dtype, tuple[int, ...]]
"""``(key, dtype, shape)`` of one tensor, in the order its bytes follow the header."""


def header_bytes(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding ``entries`` back to back
    (padded with spaces to a multiple of 8 bytes, as safetensors itself does). Raises ValueError
    for a dtype safetensors cannot store."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape in entries:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"cannot store {key} of dtype {dtype} in safetensors")
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Append ``tensor``'s bytes (row-major, little-endian as in memory) to ``f``."""
    if tensor.numel():
        f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)


DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class FileSlice:
    """One tensor of a :class:`FileTensors` file, not read yet: ``get_shape()``, and indexing (as
    ``safe_open(...).get_slice`` is indexed) reads the whole tensor with plain file reads into a
    tensor of its own, once, then returns the part the index selects (a view of it)."""

    def __init__(self, fd: int, dtype: torch.dtype, shape: list[int], start: int) -> None:
        self.fd, self.dtype, self.shape, self.start = fd, dtype, shape, start
        self._tensor: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _read(self) -> torch.Tensor:
        if self._tensor is None:
            out = torch.empty(self.shape, dtype=self.dtype)
            # the tensor's bytes as a buffer without numpy, which would mark its storage not resizable
            # (what tells a tensor of its own from a view of a memory map)
            nbytes = out.numel() * out.element_size()
            view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B") if nbytes \
                else memoryview(b"")
            done = 0
            while done < len(view):
                n = os.preadv(self.fd, [view[done:]], self.start + done)
                if n <= 0:
                    raise OSError(f"the file ends {len(view) - done} bytes into a tensor")
                done += n
            self._tensor = out
        return self._tensor

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        return self._read()[index]


class FileTensors:
    """A safetensors file read without a memory map: its header parsed here, each tensor read by
    :class:`FileSlice`. The pages a read touches stay in the page cache, not in this process's
    resident memory (a memory-mapped read keeps every page it touched resident while the map
    lives). ValueError when the header is not a safetensors header or a tensor lies outside the
    file; OSError when the file cannot be opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            head = os.pread(self.fd, 8, 0)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError("no safetensors header")
            header = json.loads(os.pread(self.fd, n, 8))
            header.pop("__metadata__", None)
            self.entries: dict[str, tuple[torch.dtype, list[int], int]] = {}
            for key, info in header.items():
                dtype = DTYPES_BY_NAME.get(info["dtype"])
                begin, end = (int(v) for v in info["data_offsets"])
                shape = [int(d) for d in info["shape"]]
                if dtype is None:
                    raise ValueError(f"tensor {key!r} has dtype {info['dtype']}, which is not read here")
                if not 0 <= begin <= end <= size - 8 - n or end - begin != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"tensor {key!r} lies outside the file or does not fit its shape")
                self.entries[key] = (dtype, shape, 8 + n + begin)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            os.close(self.fd)
            reason = str(e) if isinstance(e, ValueError) else f"malformed header ({type(e).__name__})"
            raise ValueError(reason) from None

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, key: str) -> FileSlice:
        return FileSlice(self.fd, *self.entries[key])

    def close(self) -> None:
        os.close(self.fd)

