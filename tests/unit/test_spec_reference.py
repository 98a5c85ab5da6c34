"""The spec reference: docs/SPEC.md and `spotrun spec` are generated from the models and cannot drift
from them, every key says what it does and who reads it, and a user's job is told about keys that
only the built-in recipe reads."""

from __future__ import annotations

import pytest
import yaml

from spotrun.orchestrator.cli.main import main
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.job.specdoc import APPLIES_TO, keys, markdown
from tests.conftest import ROOT

USER_JOB = "job.entrypoint=tests.helpers.jobs:stream_job"


def test_spec_doc_is_current():
    assert (ROOT / "docs/SPEC.md").read_text() == markdown(), "run `make docs` to regenerate docs/SPEC.md"


def test_every_key_has_a_description_and_says_who_reads_it():
    docs = keys()
    assert len(docs) > 60  # the walk reached every section
    for d in docs:
        assert d.description.strip(), f"{d.key} has no Field(description=...)"
        assert d.applies in APPLIES_TO, f"{d.key} has no applies-to (json_schema_extra on the field or its model)"


def test_recipe_keys_are_those_only_the_built_in_lm_reads():
    applies = {d.key: d.applies for d in keys()}
    assert {k for k, a in applies.items() if a == "recipe"} == {
        "model.kind", "model.n_layer", "model.n_head", "model.n_embd", "model.dropout", "model.factory",
        "data.vocab", "data.seq_len", "data.mask_prob", "train.lr", "train.min_lr", "train.warmup_updates",
        "train.weight_decay", "train.betas", "train.ema_decay"}
    assert applies["train.grad_clip"] == "both"  # the engine clips every job's gradients
    assert applies["job.entrypoint"] == "job"


def test_explain_prints_one_key(capsys):
    assert main(["spec", "--explain", "train.grad_clip"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "train.grad_clip"
    assert "float, >= 0" in out and "default     1.0" in out and APPLIES_TO["both"] in out
    assert "clips the global gradient norm" in out


def test_explain_gives_the_unit_and_the_recipe_only_mark(capsys):
    assert main(["spec", "--explain", "world.capacity_timeout_s"]) == 0
    assert "unit        seconds" in capsys.readouterr().out
    assert main(["spec", "--explain", "train.lr"]) == 0
    assert APPLIES_TO["recipe"] in capsys.readouterr().out


@pytest.mark.parametrize(("key", "nearest"), [("train.gradclip", "train.grad_clip"), ("grad_clip", "train.grad_clip"),
                                              ("world.capacity_timeout", "world.capacity_timeout_s")])
def test_explain_an_unknown_key_names_the_nearest_valid_one(capsys, key, nearest):
    assert main(["spec", "--explain", key]) == 2
    err = capsys.readouterr().err
    assert f"no key {key!r}" in err and f"did you mean {nearest!r}" in err


def test_explain_a_section_lists_its_keys(capsys):
    assert main(["spec", "--explain", "checkpoint"]) == 2
    assert "is a section" in (err := capsys.readouterr().err) and "checkpoint.keep_last" in err


def test_defaults_round_trip_through_the_loader(capsys):
    assert main(["spec", "--defaults"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["train"]["grad_clip"] == 1.0
    assert load_spec(None, text=text) == load_spec(None)


def test_a_recipe_key_on_a_user_job_is_a_warning_naming_it(capsys):
    load_spec(None, [USER_JOB, "train.lr=0.1", "data.seq_len=128"])
    err = capsys.readouterr().err
    assert "warning" in err and "sets data.seq_len, train.lr," in err and "does not apply them to your job" in err


@pytest.mark.parametrize("sets", [[USER_JOB], [USER_JOB, "train.grad_clip=0.5", "train.lr=0.003"], ["train.lr=0.1"]],
                         ids=["user-job-defaults", "user-job-engine-key-and-recipe-default", "built-in-recipe"])
def test_no_warning_without_a_recipe_key_changed_on_a_user_job(capsys, sets):
    load_spec(None, sets)
    assert capsys.readouterr().err == ""
