"""A continuation on other data or other code is refused before anything starts (exit 2, one paragraph
naming what changed and the ways forward), and the job's record is left as it was.

A user's project in a folder of its own: an entrypoint that imports a helper module and reads its
dataset from a file. One short run writes bundles; then the dataset file is regenerated (same shape,
other values), or the helper module is edited, and the same command is run again: refused. Put back
as it was, the same command resumes. Everything runs in this process (`--no-ray`), from the project's
folder as a user would run it.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from spotrun.orchestrator.cli.main import main
from spotrun.orchestrator.control import launch
from spotrun.orchestrator.ledger.events import AttemptStarted, RunRefused
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import LocalStorage

JOB = textwrap.dedent('''
    import numpy as np
    import torch
    from torch import nn

    import spotrun
    from refuse_augment import NOISE


    class Table:
        def __init__(self, path):
            values = torch.from_numpy(np.load(path))
            self.x, self.y = values[:, :-1], values[:, -1:]

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i] + NOISE * torch.randn(self.x.shape[1]), self.y[i]


    def step(model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


    def build(ctx):
        return spotrun.Job(model=lambda: nn.Linear(4, 1), data=spotrun.MapData(Table(ctx.config["data"])),
                           step=step, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))
''')


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The user's folder: refuse_job.py, refuse_augment.py, data.npy and job.yaml; the working directory."""
    (tmp_path / "refuse_job.py").write_text(JOB)
    (tmp_path / "refuse_augment.py").write_text("NOISE = 0.1\n")
    write_data(tmp_path, seed=0)
    (tmp_path / "job.yaml").write_text(textwrap.dedent(f"""
        job: {{entrypoint: "refuse_job:build", config: {{data: "{tmp_path / 'data.npy'}"}}}}
        storage: file://{tmp_path / 'runs'}
        world: {{size: 1}}
        data: {{workers: 0, shuffle_buffer: 8}}
        train: {{updates: 4, micro_batch: 4, accum_steps: 1}}
        checkpoint: {{every_updates: 2}}
        metrics: {{sinks: []}}
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # spotrun run puts the working directory first
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("refuse_")]:
        del sys.modules[name]


def write_data(folder: Path, seed: int) -> None:
    np.save(folder / "data.npy", np.random.default_rng(seed).standard_normal((200, 5)).astype(np.float32))


def run(*sets: str) -> list[str]:
    argv = ["run", "job.yaml", "--job-id", "ref", "--no-ray", "--quiet"]
    for s in sets:
        argv += ["--set", s]
    return argv


def refused(project: Path, capsys, monkeypatch) -> str:
    """The second run's refusal: exit 2, one paragraph on stderr, no attempt started, the refusal recorded."""
    ledger = Ledger(LocalStorage(project / "runs"), "ref")
    attempts = [e for e in ledger.read() if isinstance(e, AttemptStarted)]
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(launch, "run_in_process", lambda *a, **k: pytest.fail("the refused run started"))
        assert main(run("train.updates=6")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [e for e in ledger.read() if isinstance(e, AttemptStarted)] == attempts
    assert isinstance(ledger.read()[-1], RunRefused)
    return " ".join(err.split())


def test_a_regenerated_dataset_then_an_edited_helper_are_refused_and_resume_once_put_back(project, capsys,
                                                                                          monkeypatch):
    assert main(run()) == 0
    bundle = project / "runs/ref/bundles/u0000000004-a1"
    assert (bundle / "manifest.json").exists()

    write_data(project, seed=1)  # the same file, the same size, other values
    said = refused(project, capsys, monkeypatch)
    assert "dataset: the job's spotrun.MapData over a Table is not the data the bundle was trained on" in said
    assert "records compared differ" in said and "same length, 200" in said
    assert f"--init-from {bundle} --reset data" in said and "restore the data the bundle was trained on" in said

    write_data(project, seed=0)
    (project / "refuse_augment.py").write_text("NOISE = 0.2\n")
    said = refused(project, capsys, monkeypatch)
    assert f"job code: changed: refuse_augment ({(project / 'refuse_augment.py').resolve()})" in said
    assert "--init-from" in said

    (project / "refuse_augment.py").write_text("NOISE = 0.1\n")
    assert main(run("train.updates=6")) == 0  # both put back: the job goes on from its bundle
    assert (project / "runs/ref/bundles/u0000000006-a2/manifest.json").exists()


def test_a_new_lineage_on_regenerated_data_starts_its_data_afresh(project, capsys):
    assert main(run()) == 0
    write_data(project, seed=1)
    bundle = project / "runs/ref/bundles/u0000000004-a1"
    new = ["run", "job.yaml", "--job-id", "ref2", "--no-ray", "--quiet", "--init-from", str(bundle)]
    capsys.readouterr()
    assert main(new) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "64 of the 64 records compared differ" in said and "add --reset data" in said
    assert main([*new, "--reset", "data"]) == 0
    assert (project / "runs/ref2/bundles/u0000000004-a1/manifest.json").exists()
