"""Writing safetensors files whose tensors arrive one at a time (a checkpoint stage gathered
across tensor-parallel ranks, an exported model's shards): the header's bytes from the tensors'
keys, dtypes and shapes, then each tensor's bytes as it comes, so a writer never holds more than
one tensor."""

from __future__ import annotations

import json
import math
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
