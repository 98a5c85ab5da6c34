"""Page-aligned host memory: buffers that direct I/O writes from, with no copy.

O_DIRECT wants the memory it writes from, the file offset and the length all aligned to the
device's block size. A capture's large host buffers are allocated here (:func:`empty`): each one
starts on a page and its memory runs on, zeroed, to the next block boundary. The tensor file lays
such a tensor out at a block-aligned offset followed by zero padding to the next boundary
(:mod:`~spotrun.trainer.bundle.tensorfile`), so that the bytes of the file from the tensor's offset are
exactly the buffer's memory: :func:`padded_view` is that memory, and the storage writes it as it
is (:mod:`~spotrun.trainer.storage`). Anything else in the file is gathered into staging buffers.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch

BLOCK = 4096  # the block size O_DIRECT aligns to here, and the page size
MIN_BYTES = 1 << 20  # smaller tensors: the copy into a staging buffer costs less than their padding


def round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor: page-aligned when it holds ``MIN_BYTES`` or more, its storage
    then padded with zeros to a whole number of blocks (the padding is never written)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, round_up(nbytes))  # anonymous: page-aligned and zero-filled
    flat = torch.frombuffer(memory, dtype=torch.uint8)  # the storage keeps ``memory`` alive
    return flat[:nbytes].view(dtype).reshape(shape)


def padded_view(t: torch.Tensor) -> memoryview | None:
    """The memory of ``t`` with its padding, when ``t`` came from :func:`empty` and is aligned
    (a whole storage, page-aligned, a whole number of blocks long); otherwise ``None``."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0:
        return None
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or storage.nbytes() != round_up(nbytes) or storage.data_ptr() % BLOCK:
        return None
    whole: Any = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()  # numpy arrays are buffers
    return memoryview(whole).cast("B")


def address(view: memoryview) -> int:
    """Where ``view``'s bytes start in memory."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
