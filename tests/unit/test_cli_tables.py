"""What `spotrun history` prints for a person: no empty tables, figures without float noise, and the
command line's help says what a job id is."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.cli.main import main, parser
from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.trainer.run.rank import Report
from tests.conftest import make_spec
from tests.helpers.groups import ScriptedGroup


def test_history_of_a_job_never_restarted_prints_no_restarts_table(tmp_path, capsys):
    spec = make_spec(tmp_path, "train.updates=4", job_id="calm")
    group = ScriptedGroup(1, [[Report(rank=0, last_update=4, state="finished")]])
    assert Supervisor(spec, Platform(lambda *a: group, capacity=lambda: 1),
                         Options(sleep=lambda s: None)).run().restarts == 0
    assert main(["history", "calm", "--storage", spec.storage]) == 0
    out = capsys.readouterr().out
    assert "calm: attempts" in out and "goodput" in out
    assert "restarts" not in out.replace("restart budgets", "")


def test_table_cells_show_seconds_to_four_significant_digits():
    """A manifest's stall_seconds is a raw float (0.0034129999999999997): the table shows 0.003413."""
    from spotrun.orchestrator.cli.main import _cell

    assert [_cell(v) for v in (0.0034129999999999997, 12.700000000000001, 3, None)] == ["0.003413", "12.7", "3", "-"]


def test_the_job_commands_say_what_config_and_job_id_are(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the job's spec, a YAML file" in text
    assert "default: the spec's job_id, else the spec file's name without .yaml" in text


def test_a_summary_piped_to_a_file_keeps_each_sentence_on_one_line(tmp_path):
    """rich wraps at 80 columns when its output is not a terminal; a summary read from a log or a pager
    must not be broken mid-sentence."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "-m", "spotrun", "run", str(ROOT / "configs/tiny.yaml"), "--no-ray",
                           "--quiet", "--set", "train.updates=2", "--set", "checkpoint.every_updates=1",
                           "--set", f"data.shards={ROOT / 'configs/data/tiny'}",
                           "--set", f"storage=file://{tmp_path}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stderr.splitlines() if "finished after" in x)
    assert len(line) > 80 and line.rstrip().endswith("tokens"), done.stderr


def test_the_restarts_table_keeps_each_value_whole(tmp_path, capsys):
    """Twelve columns do not fit 160: the table is printed at its natural width, never folding a cell
    mid-word ("process-exi" over "t")."""
    from spotrun.orchestrator.workers.groups import RankLost

    spec = make_spec(tmp_path, "train.updates=4", job_id="bumpy")
    groups = [ScriptedGroup(1, [RankLost(0, "process-exit", "killed", "node-0")]),
              ScriptedGroup(1, [[Report(rank=0, last_update=4, state="finished")]])]
    assert Supervisor(spec, Platform(lambda *a: groups.pop(0), capacity=lambda: 1),
                      Options(sleep=lambda s: None)).run().restarts == 1
    assert main(["history", "bumpy", "--storage", spec.storage]) == 0
    out = capsys.readouterr().out
    assert "│ process-exit │" in out, out


def test_history_shows_a_hung_ranks_evidence_and_the_stragglers(tmp_path, capsys):
    """#49: the hang's signal, where it stopped and its stacks' key, beside the restart it caused; a short
    stragglers table (one row per attempt and rank flagged, replaced or not)."""
    from spotrun.trainer.storage import LocalStorage
    from tests.helpers.evidence import stacks_key, write_evidence_job

    write_evidence_job(LocalStorage(tmp_path), "slow")
    assert main(["history", "slow", "--storage", f"file://{tmp_path}"]) == 0
    out = capsys.readouterr().out
    hung = out[out.index("hung and stuck ranks"):out.index("stragglers (")]
    assert f"stacks: keys under file://{tmp_path}\n" in hung
    assert "│ 2       │ 2    │ node-c  │ host-c │ hang   │ backward      │ 14             │ " \
           f"{stacks_key('slow', 1, 2)} │" in hung, hung
    stragglers = out[out.index("stragglers ("):out.index("restart budgets")]
    assert "│ 2       │ 1    │ node-b  │ 12:01:00   │ 20             │ 2.4          │ yes      │" in stragglers
    assert "│ 3       │ 2    │ node-c  │ 12:02:00   │ 40             │ 1.7          │ no       │" in stragglers


def test_history_prints_a_storage_outages_table_only_when_there_were_outages(tmp_path, capsys):
    from spotrun.orchestrator.ledger.events import AttemptStarted
    from spotrun.orchestrator.ledger.store import Ledger
    from spotrun.trainer.storage import LocalStorage
    from tests.helpers.outage import write_outage_job

    write_outage_job(LocalStorage(tmp_path), "out")
    assert main(["history", "out", "--storage", f"file://{tmp_path}"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("storage outages"):out.index("goodput")]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    assert rows == [["1", "12:00:01", "12:00:04", "3.5", "ledger", "2", "0", "-", "3", "reset"],
                    ["1", "12:00:11", "12:00:39", "28", "ledger, publisher, rank 1 checkpoints", "9", "1",
                     "u0000000008-a1", "6", "PutObject: 503 SlowDown"]], table
    Ledger(LocalStorage(tmp_path), "calm").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    assert main(["history", "calm", "--storage", f"file://{tmp_path}"]) == 0
    assert "storage outages" not in capsys.readouterr().out


def test_history_shows_the_rank_processes_kept_through_warm_restarts_and_what_they_gained(tmp_path, capsys):
    """#50: each attempt's footprints fold into one row per process; `spotrun history` prints the processes that
    served more than one attempt (a survivor of warm restarts), first attempt against last, and no table when
    every process served one."""
    from spotrun.orchestrator.ledger.events import Footprints
    from spotrun.orchestrator.ledger.history import history
    from spotrun.orchestrator.ledger.store import Ledger
    from spotrun.trainer.storage import LocalStorage
    from tests.helpers.footprints import footprint, write_kept_job

    write_kept_job(LocalStorage(tmp_path), "kept")
    rows = history(LocalStorage(tmp_path), "kept").processes
    assert [(r.pid, r.first_attempt, r.last_attempt, r.attempts) for r in rows] == [
        (100, 1, 3, 3), (200, 1, 1, 1), (300, 2, 2, 1), (400, 3, 3, 1)]
    assert main(["history", "kept", "--storage", f"file://{tmp_path}"]) == 0
    table = capsys.readouterr().out.split("rank processes kept through warm restarts")[1]
    lines = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    assert lines[0] == ["100", "0", "1-3 (3)", "460 -> 500", "70 -> 72", "38 -> 38", "1"], lines
    Ledger(LocalStorage(tmp_path), "calm").append(Footprints(attempt=1, ranks={0: footprint(7, 400, 60, 30)}))
    assert main(["history", "calm", "--storage", f"file://{tmp_path}"]) == 0
    assert "kept through warm restarts" not in capsys.readouterr().out
