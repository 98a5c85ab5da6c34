"""A dead rank's last words from its Ray worker log: the crash report from its first line when there is one
(innermost frames first), the log's end otherwise, bounded either way; nothing when there is no log."""

from __future__ import annotations

from spotrun.orchestrator.workers.lastwords import MAX_CHARS, last_words

CRASH = """training update 4
*** SIGABRT received at time=1 on cpu 0 ***
PC: @     0x7f  (unknown)  (unknown)
Fatal Python error: Aborted
Stack (most recent call first):
  File "job.py", line 12 in step
  File "loop.py", line 84 in forward

Extension modules: numpy._core, torch._C (total: 2)
"""


def test_a_crash_report_is_quoted_from_its_first_line_without_the_extension_list(tmp_path):
    (tmp_path / "worker-abc-01000000-123.err").write_text("noise\n" * 200 + CRASH)
    words = last_words(123, folder=str(tmp_path))
    assert words.startswith("*** SIGABRT received") and 'File "job.py", line 12 in step' in words
    assert "noise" not in words and "Extension modules" not in words


def test_without_a_crash_report_the_log_s_end_is_quoted_and_bounded(tmp_path):
    (tmp_path / "worker-abc-01000000-7.err").write_text("".join(f"line {i} {'x' * 400}\n" for i in range(50)))
    words = last_words(7, folder=str(tmp_path))
    assert words.endswith("x" * 400) and "line 49" in words and len(words) <= MAX_CHARS
    assert last_words(8, folder=str(tmp_path)) == ""  # another process: no log, nothing said
