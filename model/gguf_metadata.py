"""A GGUF file's key-value metadata and tensor table, read fast (no tensor data).

``gguf.GGUFReader`` builds a numpy view for every part of every metadata
value, which for a 262k-token vocabulary (Gemma 3) takes ~20 s on one core
before a single token can be encoded. The tokenizer, chat-template and
config paths need only the values, so this module reads them in one pass
over the header with ``struct`` (strings) and ``numpy.frombuffer`` (numeric
arrays): well under a second for the same file. The weights loader still
opens the file with ``gguf.GGUFReader``, whose tensor views it needs.

Format: ggml's ``docs/gguf.md`` (GGUF v2 and v3; little- or big-endian,
told apart by the version field as ``GGUFReader`` does): magic ``GGUF``,
``u32`` version, ``u64`` tensor count, ``u64`` key-value count, the key-value
pairs (``u64``-length UTF-8 key, ``u32`` value type, value; arrays carry
``u32`` element type and ``u64`` count), then per tensor its name, ``u32``
dimension count, ``u64`` dimensions (innermost first), ``u32`` ggml type and
``u64`` data offset. Values come back as ``GGUFReader``'s ``contents()``
gives them: ``str``, ``int``, ``float``, ``bool``, and lists of those (an
array of arrays as nested lists, where ``contents()`` flattens it).

No JAX here: the gateway's tokenizer path imports this module.
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GGUFHeader", "read_gguf_header"]

_MAGIC = b"GGUF"
# GGUF value types (ggml docs/gguf.md, gguf_type): struct code and numpy dtype.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALARS = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i", _FLOAT32: "f",
            _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}


class GGUFHeader(NamedTuple):
    """What a GGUF file says before its tensor data.

    Attributes:
      version: the GGUF version (2 or 3).
      metadata: key -> value (``str``, ``int``, ``float``, ``bool`` or a list of them).
      tensors: tensor name -> (shape in GGUF order, innermost dimension first; ggml type id).
    """

    version: int
    metadata: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], int]]


class _Cursor:
    def __init__(self, buf: memoryview, order: str, where: str):
        self.buf, self.order, self.pos, self.where = buf, order, 0, where

    def unpack(self, code: str):
        fmt = self.order + code
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.where}: the GGUF header ends early (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"{self.where}: a string at byte {self.pos} runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:  # each element: its own element type, count and items
                return [self.value(_ARRAY) for _ in range(count)]
            code = _SCALARS.get(etype)
            if code is None:
                raise ValueError(f"{self.where}: unknown GGUF array element type {etype} at byte {self.pos}")
            dtype = np.dtype(self.order + code if code != "?" else "?")
            end = self.pos + dtype.itemsize * count
            if end > len(self.buf):
                raise ValueError(f"{self.where}: an array at byte {self.pos} runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos = end
            return arr.tolist()
        code = _SCALARS.get(vtype)
        if code is None:
            raise ValueError(f"{self.where}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.unpack(code)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (memory-mapped; tensor data is not read).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, an unsupported version, or a header that is cut short or
        names an unknown value type (each with the file's name and the byte offset).
    """
    where = os.path.basename(os.fspath(path))
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{where} is not a GGUF file (its first bytes are not 'GGUF')")
        raw = f.read(4)
        if len(raw) < 4:
            raise ValueError(f"{where}: the GGUF header ends early")
        version = struct.unpack("<I", raw)[0]
        order = "<"
        if version & 0xFFFF == 0:  # written on a big-endian host
            version, order = struct.unpack(">I", raw)[0], ">"
        if version not in (2, 3):
            raise ValueError(f"{where}: GGUF version {version} is not read (2 and 3 are)")
        mm = np.memmap(f, np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), order, where)
    cur.pos = 8
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        ggml_type = cur.unpack("I")
        cur.unpack("Q")  # data offset
        tensors[name] = (shape, ggml_type)
    return GGUFHeader(version, metadata, tensors)
