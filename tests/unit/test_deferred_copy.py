"""On the CPU a capture defers the copies of parameters, EMA and optimizer state to a thread; the
next update's optimizer step must wait for them, so the bundle still holds the boundary's values.

The copy thread is held on a gate until the loop is seen waiting for it: were the step not to
wait, it would change the parameters before they were copied, and the capture would hold the
values after the next update instead of those at the boundary."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

import spotrun.trainer.state.training as state_module
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.state.training import Capture, CopiesDone
from tests.conftest import make_spec


def capture_then(session: TrainSession, monkeypatch, act: Callable[[], None]) -> tuple[bool, Capture]:
    """Take a capture whose deferred copies are held on a gate, run ``act`` on a thread, and return
    whether ``act`` waited for the copies (the gate opens once it waits, or once it ended without)."""
    gate, waiting, either = threading.Event(), threading.Event(), threading.Event()
    real_copy_all, real_wait = state_module._copy_all, CopiesDone.wait_in_loop

    def gated_copy_all(pairs):
        assert gate.wait(timeout=60), "nothing waited for the deferred copies"
        real_copy_all(pairs)

    def seen_waiting(self):
        waiting.set()
        either.set()
        real_wait(self)

    def acting():
        try:
            act()
        finally:
            either.set()  # an act that did not wait ends without setting ``waiting``

    monkeypatch.setattr(state_module, "_copy_all", gated_copy_all)
    monkeypatch.setattr(CopiesDone, "wait_in_loop", seen_waiting)
    capture = session.capture()
    assert isinstance(capture.ready, CopiesDone)  # the copies really were deferred
    thread = threading.Thread(target=acting)
    thread.start()
    either.wait(timeout=60)
    seen = waiting.is_set()
    gate.set()
    thread.join(timeout=60)
    return seen, capture


def test_the_next_step_waits_for_the_deferred_copies(tmp_path, monkeypatch):
    session = TrainSession(make_spec(tmp_path, "data.workers=0", "train.updates=3"))
    session.start()
    try:
        session.run_update()
        at_boundary = {k: v.clone() for k, v in session.state.model.state_dict().items()}
        seen, capture = capture_then(session, monkeypatch, session.run_update)
        assert seen, "the next update never waited for the capture's copies"
        capture.wait()
        saved = capture.torch_files["rank-0/model.pt"]["model"]
        assert saved.keys() == at_boundary.keys()
        assert all(torch.equal(saved[k], at_boundary[k]) for k in saved)
        assert any(not torch.equal(v, at_boundary[k]) for k, v in session.state.model.state_dict().items())
        assert capture.ready.loop_wait_seconds > 0
    finally:
        session.close()


def test_forgetting_an_update_waits_for_the_deferred_copies(tmp_path, monkeypatch):
    """A warm restart drops what the stopped update left (``forget_update``) and restores over the
    parameters: a capture's copies still reading them are waited for first."""
    session = TrainSession(make_spec(tmp_path, "data.workers=0", "train.updates=3"))
    session.start()
    try:
        session.run_update()
        seen, _ = capture_then(session, monkeypatch, session.state.forget_update)
        assert seen, "forget_update dropped the capture's copies without waiting for them"
        assert session.state.pending_copy is None
    finally:
        session.close()
