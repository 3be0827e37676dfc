"""A small, fast GGUF reader: scalar metadata, tensor descriptions, memory-mapped data.

``gguf.GGUFReader`` builds an object for every element of every metadata array, which
takes seconds for a vocabulary of tens of thousands of tokens. kvmesh needs only the scalar
metadata and the tensors, so this reader skips arrays (reading just their lengths) and
memory-maps the tensor data; ``loader.dequantize_gguf`` dequantizes it (Q4_0/Q4_1/Q8_0 in
torch with gguf's bits, other types through ``gguf.quants.dequantize``).
The tokenizer is read by transformers' own GGUF path, once, and cached (worker/tokenizer.py).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64
metadata count; metadata as (string key, u32 type, value); tensor infos as (string name,
u32 n_dims, u64 dims[n_dims] innermost first, u32 ggml type, u64 offset); then tensor data
from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first
    ggml_type: int
    data: np.ndarray  # raw blocks (uint8), (*shape[:-1], bytes per row), memory-mapped

    @property
    def tensor_type(self):
        import gguf

        return gguf.GGMLQuantizationType(self.ggml_type)


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError, OSError) as e:
            raise ValueError(f"cannot read GGUF file {self.path}: {type(e).__name__}: {e}") from e

    def _parse(self) -> None:
        import gguf

        buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        mv = memoryview(buf)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            if pos + size > len(mv):
                raise ValueError(f"file ends at byte {len(mv)} inside a field at {pos}")
            (v,) = struct.unpack_from(fmt, mv, pos)
            pos += size
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > len(mv):
                raise ValueError(f"file ends inside a string at byte {pos}")
            s = bytes(mv[pos : pos + n]).decode("utf-8")
            pos += n
            return s

        def skip_value(vtype: int) -> None:
            nonlocal pos
            if vtype == _STRING:
                n = take("<Q")  # read first: `pos += take()` would add to the stale pos
                pos += n
            elif vtype == _ARRAY:
                etype, n = take("<I"), take("<Q")
                if etype in _SCALARS:
                    pos += n * struct.calcsize(_SCALARS[etype])
                else:
                    for _ in range(n):
                        skip_value(etype)
            else:
                pos += struct.calcsize(_SCALARS[vtype])

        if bytes(mv[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        pos = 4
        self.version = take("<I")
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version}")
        n_tensors, n_kv = take("<Q"), take("<Q")
        self.metadata: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key, vtype = string(), take("<I")
            if vtype == _STRING:
                self.metadata[key] = string()
            elif vtype == _ARRAY:
                start = pos
                take("<I")  # element type
                self.array_lengths[key] = take("<Q")
                pos = start
                skip_value(_ARRAY)
            elif vtype in _SCALARS:
                self.metadata[key] = take(_SCALARS[vtype])
            else:
                raise ValueError(f"metadata {key!r} has unknown type {vtype}")
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            infos.append((name, tuple(reversed(dims)), take("<I"), take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, shape, gtype, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(gtype)]
            n_bytes = int(np.prod(shape)) // block * type_size
            start = data_start + offset
            if start + n_bytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            # rows of raw blocks, the layout gguf.quants.dequantize expects
            row_bytes = shape[-1] // block * type_size
            raw = buf[start : start + n_bytes].reshape(*shape[:-1], row_bytes)
            self.tensors.append(GGUFTensor(name, shape, gtype, raw))

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)
