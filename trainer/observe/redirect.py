"""Where a rank's lines are caught: its process's output descriptors, or the threads that run it.

A rank's code reaches the terminal in many ways: ``print``, ``warnings.warn`` (Python's
``showwarning`` writes to ``sys.stderr``), ``logging`` (the last-resort handler writes to
``sys.stderr``; a library's own handler, transformers' say, to the stream it found when it
was configured), a C extension writing to descriptor 2, a forked data-loader worker. Two
catchers hand each line to a :class:`~spotrun.trainer.observe.ranklog.RankLog`:

- :class:`FdRedirect`, for a process that is one rank (a Ray actor): descriptors 1 and 2 become
  pipes, so every one of the ways above is caught, whatever Python object wrote it and whichever
  process (a forked worker shares the descriptors). Every byte is also passed on to the descriptor
  it replaced, so the process's own log (Ray's worker log files) still has it all.
- :class:`StreamRouter`, for a rank that is a thread of the driver (``spotrun run --no-ray``):
  ``sys.stdout`` and ``sys.stderr`` are replaced by routers that send what a thread working for
  the rank writes (:func:`working_for`) to its log, and everything else on to the stream they
  replaced. Writes to the descriptors themselves (C extensions), from threads the rank's code
  starts, or to a stream a library kept from before the routers were installed are not caught:
  they reach the terminal unprefixed. A forked worker's lines are written, prefixed, straight to
  the stream the router replaced (the rank's log lives in the parent).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from spotrun.trainer.observe.ranklog import RankLog, Stream

_READ_BYTES = 1 << 16


# The copier: a process of its own between each of the rank's descriptors and the one it replaced
# (argv: the drain marker, then triples "read original copy"). It passes every byte on to ``copy``,
# which this process reads, and every byte but the drain markers on to ``original``; being another
# process, it still passes on what the rank wrote just before it died (a C++ abort's message, a
# fatal Python error), and it ends when every writer has gone.
_COPIER = """
import os, select, sys
marker = sys.argv[1].encode() + b"\\n"
ends = {int(r): [int(o), int(c)] for r, o, c in (a.split() for a in sys.argv[2:])}
while ends:
    for r in select.select(list(ends), [], [])[0]:
        chunk = os.read(r, 65536)
        if not chunk:
            del ends[r]
            continue
        for i, fd in enumerate(ends[r]):
            view = memoryview(chunk.replace(marker, b"") if i == 0 else chunk)
            try:
                while fd >= 0 and view:
                    view = view[os.write(fd, view):]
            except OSError:
                ends[r][i] = -1
"""


class FdRedirect:
    """Descriptors 1 and 2 of this process read line by line into ``log``; ``keep(line)`` False
    leaves a line out of it (a Ray control line, say). Install it once per process.

    Each descriptor becomes a pipe to a small copier process, which passes every byte on to the
    descriptor it replaced (so the process's own log, Ray's worker log files, still has it all,
    up to the last byte a dying process wrote) and to a pipe this process reads on a thread. Where
    the copier cannot be started this process passes the bytes on itself (what it had not read when
    it died is then lost). Lines reach the log a moment after they were written: :meth:`drain`
    waits until every line this process wrote before the call is in the log."""

    def __init__(self, log: RankLog, keep: Callable[[str], bool] = lambda line: True) -> None:
        self.log, self.keep = log, keep
        # A line no job writes, behind what was written before a drain (kept out of the process's own log;
        # one a read of over 64 KiB cuts in two would reach it, harmlessly)
        self._marker = f"[spotrun: rank output drained {os.urandom(6).hex()}]".encode()
        self._drained = {1: threading.Event(), 2: threading.Event()}
        self._drain_lock = threading.Lock()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()  # what Python buffered before goes where it was meant to
        originals = {fd: os.dup(fd) for fd in (1, 2)}
        into = {fd: os.pipe() for fd in (1, 2)}
        self.copier, reads = _start_copier(into, originals, self._marker)
        if self.copier is not None:
            for fd in originals.values():
                os.close(fd)  # the copier has its own
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(into[fd][1], fd)
            os.close(into[fd][1])
            passed_on = None if self.copier is not None else originals[fd]  # else the copier passes it on
            threading.Thread(target=self._pump, args=(reads[fd], passed_on, name, self._drained[fd]),
                             daemon=True, name=f"spotrun-{name}").start()
        # A print to a pipe or file is block-buffered: it would reach the log (and the driver) only
        # when the buffer fills. Line buffering sends each line as a terminal would.
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)

    def drain(self, timeout: float = 2.0) -> bool:
        """Return once every line written to descriptors 1 and 2 before this call (by this process) is
        in the log, or after ``timeout`` (False)."""
        with self._drain_lock:
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
                if stream is not None:
                    stream.flush()
                self._drained[fd].clear()
                os.write(fd, self._marker + b"\n")  # far below PIPE_BUF: one piece, never interleaved
            deadline = time.monotonic() + timeout
            return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self._drained.values())

    def _pump(self, read: int, original: int | None, stream: Stream, drained: threading.Event) -> None:
        """Hand each complete line to the log (and, without a copier, pass it on to ``original``)."""
        partial = b""
        while chunk := os.read(read, _READ_BYTES):
            if original is not None:
                _pass_on(original, chunk.replace(self._marker + b"\n", b""))
            *lines, partial = (partial + chunk).split(b"\n")
            for raw in lines:
                if raw == self._marker:
                    drained.set()
                    continue
                try:
                    text = _as_shown(raw.decode(errors="replace"))
                    if self.keep(text):
                        self.log.add(stream, text)
                except Exception:  # the line is lost, never the pump: a pump that stopped
                    continue  # reading would leave the pipe full and every later write of the rank blocked


def _start_copier(into: dict[int, tuple[int, int]], originals: dict[int, int],
                  marker: bytes) -> tuple[subprocess.Popen[bytes] | None, dict[int, int]]:
    """Start the copier between ``into`` (each descriptor's new pipe) and ``originals``; returns it and,
    per descriptor, the end this process reads. Without one (it could not start): None, and the
    ``into`` pipes' read ends."""
    copies = {fd: os.pipe() for fd in into}
    args = [f"{into[fd][0]} {originals[fd]} {copies[fd][1]}" for fd in into]
    keep = [x for fd in into for x in (into[fd][0], originals[fd], copies[fd][1])]
    try:
        copier = subprocess.Popen([sys.executable, "-I", "-S", "-c", _COPIER, marker.decode(), *args],
                                  pass_fds=keep, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    except OSError:
        for r, w in copies.values():
            os.close(r)
            os.close(w)
        return None, {fd: into[fd][0] for fd in into}
    for fd in into:
        os.close(into[fd][0])  # the copier's now: it ends when every process writing to them has ended
        os.close(copies[fd][1])
    return copier, {fd: copies[fd][0] for fd in into}


def _pass_on(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``; a descriptor that is gone (the process's own log closed) is
    left alone: the rank log has the lines."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        return


class StreamRouter:
    """A stand-in for ``sys.stdout`` or ``sys.stderr``: a thread working for a rank (:func:`working_for`)
    writes into that rank's log, line by line; every other thread writes to ``inner``, untouched."""

    def __init__(self, inner: TextIO, stream: Stream) -> None:
        self.inner, self.stream = inner, stream
        self.pid = os.getpid()
        self._partial = threading.local()  # each thread's unfinished line

    def write(self, text: str) -> int:
        log: RankLog | None = getattr(_working, "log", None)
        if log is None:
            return self.inner.write(text)
        partial = getattr(self._partial, "text", "") + text
        *lines, self._partial.text = partial.split("\n")
        for line in lines:
            if os.getpid() == self.pid:
                log.add(self.stream, _as_shown(line))
            else:  # a forked worker: the log and its writer live in the parent
                self.inner.write(f"[{log.label or 'rank ?'}] {line}\n")
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno, ...: the replaced stream's
        return getattr(self.inner, name)


_working = threading.local()  # .log: the RankLog of the rank the current thread works for


@contextmanager
def working_for(log: RankLog) -> Iterator[None]:
    """While this block runs, what the current thread writes to ``sys.stdout``/``sys.stderr`` is the
    rank's (where :func:`routed` installed the routers)."""
    before = getattr(_working, "log", None)
    _working.log = log
    try:
        yield
    finally:
        _working.log = before


@contextmanager
def routed() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` replaced by :class:`StreamRouter` for this block (nested
    blocks reuse the routers in place). On the way out a router is removed only where it is still
    installed: something that replaced it meanwhile (a live progress display) put back what it found."""
    installed = []
    names: tuple[Stream, ...] = ("stdout", "stderr")
    for name in names:
        current = getattr(sys, name)
        if current is None or isinstance(current, StreamRouter):
            continue
        router = StreamRouter(current, name)
        setattr(sys, name, router)
        installed.append((name, router))
    try:
        yield
    finally:
        for name, router in installed:
            if getattr(sys, name) is router:
                setattr(sys, name, router.inner)


def _as_shown(line: str) -> str:
    """A line as a terminal leaves it: after a carriage return only what follows it (a progress bar
    redrawn in place is its last state), without a trailing one."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]
