"""A rank's own output: labelled with the rank it serves at the time, queued for the driver (bounded),
kept per attempt in segments beside the job's storage; caught from a process's descriptors (a Ray
actor: print, warnings, C-level writes, a forked worker) or from the threads working for an
in-process rank. The end-to-end runs (Ray, --no-ray) are in test_node_loss.py and test_user_jobs.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spotrun.trainer.observe import ranklog
from spotrun.trainer.observe.ranklog import RankLine, RankLog, list_rank_logs, log_key, read_rank_log
from spotrun.trainer.observe.redirect import routed, working_for
from spotrun.trainer.storage import LocalStorage
from tests.conftest import ROOT


def texts(lines: list[RankLine]) -> list[tuple[str, str, str]]:
    return [(line.label, line.stream, line.text) for line in lines]


def logs(storage: LocalStorage, job: str) -> dict[tuple[int, str], str]:
    return {(ref.attempt, ref.label): read_rank_log(storage, ref) for ref in list_rank_logs(storage, job)}


def test_lines_carry_the_rank_of_their_time_and_each_attempt_keeps_its_own_log(tmp_path):
    """A warm restart renumbers a process (rank 1 of attempt 1 serves as rank 0 in attempt 2): lines
    written before say rank 1 and stay in attempt 1's log, lines after say rank 0."""
    storage = LocalStorage(tmp_path)
    log = RankLog(flush_every_s=3600)  # no periodic write in this test: flush() and close() write
    log.begin(storage, "job", 1, "rank 1")
    log.add("stdout", "before the loss")
    log.add("stderr", "x.py:3: UserWarning: careful")
    log.begin(storage, "job", 2, "rank 0")
    log.add("stdout", "after the restart")
    assert texts(log.take()) == [("rank 1", "stdout", "before the loss"),
                                 ("rank 1", "stderr", "x.py:3: UserWarning: careful"),
                                 ("rank 0", "stdout", "after the restart")]
    assert log.take() == []
    assert logs(storage, "job") == {(1, "rank 1"): "before the loss\nx.py:3: UserWarning: careful\n"}  # on begin
    log.close()
    assert logs(storage, "job") == {(1, "rank 1"): "before the loss\nx.py:3: UserWarning: careful\n",
                                    (2, "rank 0"): "after the restart\n"}
    assert storage.exists("job/logs/attempt-2/rank-0.0000.log")


def test_segments_close_at_their_size_and_a_retried_start_follows_the_failed_one(tmp_path, monkeypatch):
    monkeypatch.setattr(ranklog, "SEGMENT_BYTES", 32)
    storage = LocalStorage(tmp_path)
    first = RankLog(flush_every_s=3600)
    first.begin(storage, "job", 1, "rank 0")
    for i in range(6):
        first.add("stdout", f"line {i} of the failed start")  # 26 bytes each: one line a segment
        first.flush()  # the open segment is rewritten whole as it grows, until it closes
    first.close()
    retry = RankLog(flush_every_s=3600)  # the same attempt number, placed again in a new process
    retry.begin(storage, "job", 1, "rank 0")
    retry.add("stdout", "the retry")
    retry.close()
    [ref] = list_rank_logs(storage, "job")
    assert ref.keys == [log_key("job", 1, "rank 0", s) for s in range(7)]
    assert read_rank_log(storage, ref) == "".join(f"line {i} of the failed start\n" for i in range(6)) + "the retry\n"


def test_the_driver_queue_is_bounded_and_says_what_it_dropped(monkeypatch):
    monkeypatch.setattr(ranklog, "QUEUE_LINES", 3)
    log = RankLog()
    log.begin(None, "job", 1, "rank 2")
    for i in range(5):
        log.add("stdout", str(i))
    lines = log.take()
    assert [line.text for line in lines[1:]] == ["2", "3", "4"]
    assert lines[0].label == "rank 2" and "2 earlier lines" in lines[0].text and "rank log" in lines[0].text


class Refusing(LocalStorage):
    def put(self, key: str, data: bytes) -> None:
        raise PermissionError("read-only bucket")


def test_a_storage_that_refuses_the_log_costs_the_log_not_the_rank(tmp_path):
    log = RankLog(flush_every_s=3600)
    log.begin(Refusing(tmp_path), "job", 1, "rank 0")
    log.add("stdout", "still shown")
    log.flush()  # no exception: the rank trains on
    lines = log.take()
    assert lines[0].text == "still shown"
    assert "could not be written" in lines[1].text and "read-only bucket" in lines[1].text
    log.flush()
    assert log.take() == [], "the same failure is told once"
    log.close()


def test_the_router_takes_what_the_rank_s_threads_write_and_passes_the_rest_on(capsys):
    log = RankLog()
    log.begin(None, "job", 1, "rank 0")
    with routed():
        handler = logging.StreamHandler()  # made under the routers, as a library configured after them
        logger = logging.getLogger("tests.rank_output")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            def rank() -> None:
                with working_for(log):
                    print("from the rank", end="")  # a line in two writes
                    print(", in two parts")
                    logger.warning("a library's warning")

            thread = threading.Thread(target=rank)
            thread.start()
            thread.join()
            print("from the driver")
        finally:
            logger.removeHandler(handler)
    assert texts(log.take()) == [("rank 0", "stdout", "from the rank, in two parts"),
                                 ("rank 0", "stderr", "a library's warning")]
    out = capsys.readouterr()
    assert out.out == "from the driver\n" and out.err == ""
    assert not type(sys.stdout).__name__ == "StreamRouter", "the routers are gone after the block"


FD_SCRIPT = """
import json, os, sys, threading, warnings
from spotrun.trainer.observe.ranklog import RankLog
from spotrun.trainer.observe.redirect import FdRedirect

log = RankLog()
log.begin(None, "job", 1, "rank 1")
redirect = FdRedirect(log, keep=lambda line: not line.startswith(":actor_name:"))
print("a print")
print(":actor_name:RankActor")
warnings.warn("a warning")
os.write(2, b"written to the descriptor, as C code does\\n")
pid = os.fork()
if pid == 0:
    print("from a forked worker", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
redirect.drain()
with open(sys.argv[1], "w") as f:
    json.dump([[line.label, line.stream, line.text] for line in log.take()], f)
reached = threading.Event()

def stall(stream, text):  # the reading thread takes the next line and reads no further
    reached.set()
    threading.Event().wait()

log.add = stall
os.write(2, b"a line the reader stalls on\\n")
reached.wait()
os.write(2, b"last words of a process that is killed at once\\n")  # this process will never read them
os.kill(os.getpid(), 9)
"""


def test_a_process_redirect_catches_print_warnings_c_level_writes_and_forked_workers(tmp_path):
    """What a Ray rank actor installs, in a process of its own: everything written to descriptors 1 and 2 is
    a line of the rank's, save Ray's control lines; and everything still reaches the old descriptors,
    even what the process wrote the instant before it was killed (the copier is another process)."""
    done = subprocess.run([sys.executable, "-c", FD_SCRIPT, str(tmp_path / "lines.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    assert "last words of a process that is killed at once" in done.stderr
    lines = [tuple(x) for x in json.loads((tmp_path / "lines.json").read_text())]
    assert ("rank 1", "stdout", "a print") in lines and ("rank 1", "stdout", "from a forked worker") in lines
    assert ("rank 1", "stderr", "written to the descriptor, as C code does") in lines
    assert any(s == "stderr" and t.endswith("UserWarning: a warning") for _, s, t in lines), lines
    assert not any(":actor_name:" in t for _, _, t in lines)
    assert "a print" in done.stdout and ":actor_name:RankActor" in done.stdout  # passed on, as before
    assert "a warning" in done.stderr and "rank output drained" not in done.stdout + done.stderr


@pytest.mark.parametrize("label", ["rank 0", "rank 12", "spare 3"])
def test_a_log_key_reads_back_as_its_attempt_and_label(tmp_path, label):
    storage = LocalStorage(tmp_path)
    storage.put(log_key("j", 7, label, 0), b"x\n")
    storage.put("j/logs/attempt-7/notes.txt", b"not a log")
    [ref] = list_rank_logs(storage, "j")
    assert (ref.attempt, ref.label) == (7, label)
    assert Path(tmp_path, ref.keys[0]).read_text() == "x\n"


def test_an_outage_keeps_one_copy_of_the_open_segment_however_many_flushes_it_refuses(tmp_path):
    """The open segment is rewritten whole as it grows; while storage refuses, each flush's newer whole replaces
    the one waiting (not a copy per flush: a long outage would hold one every 5 s), and once storage answers the
    log holds every line once, in order."""
    from tests.helpers.outage import Flaky

    storage = Flaky(tmp_path)
    log = RankLog(flush_every_s=3600)
    log.begin(storage, "job", 1, "rank 0")
    storage.down = True
    for i in range(50):
        log.add("stdout", f"line {i}")
        log.flush()
    assert len(log._sealed) == 1  # one segment waits, whole
    storage.down = False
    log.flush()
    assert logs(storage.inner, "job")[1, "rank 0"] == "".join(f"line {i}\n" for i in range(50))
    log.close()
