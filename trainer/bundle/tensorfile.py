"""The bundle's tensor file: raw tensor bytes behind a JSON index, in the safetensors layout.

A bundle payload (a nested dict of tensors and small values, see :class:`~spotrun.trainer.state.training.Capture`)
is split in two files:

- ``<stem>.safetensors``: every tensor of the payload reached through dicts and lists, stored
  as its raw bytes. The layout is safetensors' (an 8-byte little-endian header length, a JSON
  header ``{"<name>": {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with spaces
  to a multiple of 8, then the tensors' bytes back to back). It is written straight from the
  capture's host buffers, without a serialised copy in memory (:func:`chunks` are views of the
  buffers), and read back without unpickling anything (:func:`decode`).
- ``<stem>.pt``: the rest, the *skeleton*: the payload's structure with each tensor replaced
  by a reference ``{"__spotrun_tensor__": "<name>"}``, written with ``torch.save`` and loaded
  with ``weights_only=True``. It holds what raw bytes cannot: version numbers, optimizer
  hyper-parameters, a scheduler's state, the arbitrary (weights-only loadable) objects a job
  registers. It is small (no tensor data), so pickling it costs nothing measurable.

Tensors of a dtype the layout has no name for (complex, say), and tensors inside tuples or
other containers, stay in the skeleton as before: correct, only not zero-copy.
"""

from __future__ import annotations

import itertools
import json
import struct
import warnings
from typing import Any

import torch

from spotrun.trainer.storage import aligned

TENSOR_REF = "__spotrun_tensor__"
PAD = "__pad__"  # padding to a block boundary, listed as a tensor (see chunks); never a payload's

# safetensors' dtype names
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own bound: a larger header is not one of ours


class TensorFileError(ValueError):
    """A tensor file that does not parse, or does not cover its bytes exactly."""


def split(payload: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The payload's skeleton and its tensors by name (``t0``, ``t1``, ... in traversal order)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dtype in DTYPES and obj.device.type == "cpu":
            name = f"t{len(tensors)}"
            tensors[name] = obj
            return {TENSOR_REF: name}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(payload), tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The payload again: every reference in ``skeleton`` replaced by its tensor."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if len(obj) == 1 and TENSOR_REF in obj:
                name = obj[TENSOR_REF]
                if name not in tensors:
                    raise TensorFileError(f"{where}: the skeleton refers to tensor {name!r}, which the tensor "
                                          "file does not hold")
                return tensors[name]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(skeleton)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes."""
    if not t.is_contiguous():
        t = t.contiguous()  # host buffers are contiguous; anything else is copied once here
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.reshape(-1).view(torch.uint8).numpy()  # numpy arrays are buffers; the stubs disagree
    return memoryview(array).cast("B")


def chunks(tensors: dict[str, torch.Tensor]) -> list[bytes | memoryview]:
    """The file's bytes as views: the header, then each tensor's bytes where the tensor lives.

    A tensor in an aligned host buffer (:mod:`~spotrun.trainer.storage.aligned`) is laid out at a
    block-aligned offset, and its view is its whole buffer: its bytes and the zero padding after
    them, to the next block. Direct I/O writes such a view with no copy. The padding before and
    after it is listed in the header as ``U8`` tensors named ``__pad__<k>``, which readers skip: the
    offsets still tile the data, and the file is still a safetensors file. When there is such a
    tensor the header is padded too, so that the data start on a block.

    The views stay valid while the tensors are not overwritten (the writer holds the capture)."""
    index: dict[str, Any] = {}
    views: list[bytes | memoryview] = []
    offset = 0
    any_aligned = False
    pads = itertools.count()

    def put(name: str, dtype: str, shape: list[int], nbytes: int) -> None:
        nonlocal offset
        index[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes

    def pad(nbytes: int) -> None:
        if nbytes:
            put(f"{PAD}{next(pads)}", "U8", [nbytes], nbytes)

    for name, t in tensors.items():
        whole = aligned.padded_view(t)
        view = _bytes_of(t)
        if whole is None:
            put(name, DTYPES[t.dtype], list(t.shape), len(view))
            views.append(view)
            continue
        any_aligned = True
        before = -offset % aligned.BLOCK
        pad(before)
        if before:
            views.append(bytes(before))
        put(name, DTYPES[t.dtype], list(t.shape), len(view))
        pad(len(whole) - len(view))
        views.append(whole)
    header = json.dumps(index, separators=(",", ":")).encode()
    block = aligned.BLOCK if any_aligned else 8  # safetensors pads its header to 8 bytes
    header += b" " * (-(8 + len(header)) % block)
    return [memoryview(struct.pack("<Q", len(header)) + header), *views]


def decode(blob: bytes, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a tensor file, copied out of ``blob``. Raises :class:`TensorFileError`
    naming ``where`` when the header does not parse or its offsets do not tile the data exactly
    (a truncated or extended file). Nothing is unpickled."""
    if len(blob) < 8:
        raise TensorFileError(f"{where}: {len(blob)} bytes, shorter than a tensor file's header length")
    (n,) = struct.unpack_from("<Q", blob)
    if n > _MAX_HEADER or 8 + n > len(blob):
        raise TensorFileError(f"{where}: header of {n} bytes does not fit in the file's {len(blob)} bytes")
    try:
        index = json.loads(blob[8:8 + n])
    except ValueError as e:
        raise TensorFileError(f"{where}: the header is not JSON ({e})") from e
    if not isinstance(index, dict):
        raise TensorFileError(f"{where}: the header is not a JSON object")
    index.pop("__metadata__", None)
    data = memoryview(blob)[8 + n:]
    out: dict[str, torch.Tensor] = {}
    expected = 0
    for name, info in sorted(index.items(), key=lambda kv: _offsets(kv[1], where, kv[0])[0]):
        begin, end = _offsets(info, where, name)
        dtype = _BY_NAME.get(info.get("dtype"))
        shape = info.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise TensorFileError(f"{where}: tensor {name}: unknown dtype {info.get('dtype')!r} or bad shape {shape!r}")
        numel = 1
        for d in shape:
            numel *= d
        size = numel * torch.empty((), dtype=dtype).element_size()
        if begin != expected or end - begin != size:
            raise TensorFileError(f"{where}: tensor {name} at bytes [{begin}, {end}) of the data, expected "
                                  f"[{expected}, {expected + size}) (the file is damaged)")
        if end > len(data):
            raise TensorFileError(f"{where}: tensor {name} ends at byte {end} of the data, the file holds "
                                  f"{len(data)} (truncated)")
        expected = end
        if not name.startswith(PAD):
            out[name] = _tensor(data[begin:end], dtype, shape)
    if expected != len(data):
        raise TensorFileError(f"{where}: the tensors cover {expected} bytes of data, the file holds {len(data)} "
                              "(truncated or extended)")
    return out


def _offsets(info: Any, where: str, name: str) -> tuple[int, int]:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise TensorFileError(f"{where}: tensor {name}: bad data_offsets {offsets!r}")
    return offsets[0], offsets[1]


def _tensor(view: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if len(view) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a read-only buffer: torch warns, and the clone below owns the bytes
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=torch.uint8)
    return flat.clone().view(dtype).reshape(shape)  # cloned first: the copy is aligned for any dtype
