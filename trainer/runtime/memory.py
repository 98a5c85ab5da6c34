"""Giving a long-lived process's freed memory back to the system.

A warm restart keeps a rank's process and drops what the attempt before held (its captures' host copies,
its process group, its data pipeline's buffers). glibc's allocator keeps much of what is freed, in its
heap and arenas, for later use: on a 2-rank job with ~20 MB of state per capture, a surviving process's
resident memory grew in steps of one to three captures over 20 warm restarts (442 -> 794 MiB) with
nothing of them kept alive. ``malloc_trim`` hands the free pages back (the same run: 442 -> 681 MiB), so
resident memory follows what the process holds. It takes 2-10 ms there, and runs on a thread of its own:
ctypes releases the GIL for the call, so training does not wait for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable


def release_freed_memory_soon() -> None:
    """Return the allocator's free pages to the system, from a thread of its own (glibc ``malloc_trim``; a C
    library without it: nothing to do)."""
    trim = _malloc_trim()
    if trim is not None:
        threading.Thread(target=trim, args=(0,), name="spotrun-malloc-trim", daemon=True).start()


@functools.cache  # looked up once: find_library runs ``ldconfig -p`` in a subprocess, on a restart's path
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None
