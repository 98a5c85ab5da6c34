"""A rank actor undoes Ray's worker niceness on every thread of its process (Linux, with the privilege)."""

from __future__ import annotations

import os
import threading

import pytest

from spotrun.orchestrator.workers.priority import run_at_normal_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority") or os.geteuid() != 0,
                                reason="lowering niceness needs Linux and the privilege (root here)")


def test_every_thread_of_the_process_is_set_back_to_niceness_0():
    niced, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def ray_like_thread() -> None:  # a thread started at Ray's worker niceness, like the actor's pool
        tid.append(threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, tid[0], 15)
        niced.set()
        done.wait()

    t = threading.Thread(target=ray_like_thread)
    t.start()
    try:
        assert niced.wait(timeout=30)
        assert os.getpriority(os.PRIO_PROCESS, tid[0]) == 15
        assert run_at_normal_priority()
        assert os.getpriority(os.PRIO_PROCESS, tid[0]) == 0
    finally:
        done.set()
        t.join()
