"""Job spec loading: typos, bad values, ``--set`` overrides, job_id defaults, cross-field rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrun.orchestrator.control.specfile import SpecError, load_spec, parse_override
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.job.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def spec_error(*overrides: str, path: Path | None = TINY) -> str:
    """The message of the SpecError that loading ``path`` with ``overrides`` raises."""
    with pytest.raises(SpecError) as info:
        load_spec(path, list(overrides))
    return str(info.value)


# -- unknown keys -----------------------------------------------------------------------


def test_unknown_nested_key_names_key_and_nearest_spelling():
    """A typo inside a section names the dotted key and suggests the valid dotted key."""
    msg = spec_error("train.updtes=10")
    assert "train.updtes" in msg
    assert "unknown key" in msg
    assert "did you mean 'train.updates'" in msg


def test_unknown_top_level_key_names_key_and_nearest_spelling():
    """A top-level typo (from --set) suggests the top-level key."""
    msg = spec_error("seeed=3")
    assert "seeed" in msg
    assert "did you mean 'seed'" in msg


def test_unknown_key_in_yaml_file_is_reported_with_the_file(tmp_path):
    """A typo written in the YAML file itself is caught too, and the message names the file."""
    path = tmp_path / "typo.yaml"
    path.write_text("seed: 1\nchekpoint: {every_updates: 5}\n")
    msg = spec_error(path=path)
    assert str(path) in msg
    assert "chekpoint" in msg
    assert "did you mean 'checkpoint'" in msg


def test_unknown_key_deep_in_a_section_suggests_within_that_section():
    """The suggestion is drawn from the section the typo sits in, not from the top level."""
    msg = spec_error("checkpoint.keep_lst=2")
    assert "did you mean 'checkpoint.keep_last'" in msg


# -- bad values -------------------------------------------------------------------------


def test_bad_number_names_key_value_and_constraint():
    """An out-of-range value names the key, the value given and the bound it broke."""
    msg = spec_error("train.updates=0")
    assert "train.updates" in msg
    assert "got 0" in msg
    assert "greater than or equal to 1" in msg


def test_bad_choice_names_key_value_and_allowed_values():
    """A value outside a Literal names the key, the value and every allowed value."""
    msg = spec_error("train.precision=fp8")
    assert "train.precision" in msg
    assert "'fp8'" in msg
    for allowed in ("fp32", "bf16", "fp16"):
        assert allowed in msg


def test_cross_field_rule_names_both_values():
    """A section-level rule (n_embd divisible by n_head) names both keys and their values."""
    msg = spec_error("model.n_embd=33", "model.n_head=2")
    assert "model.n_embd=33" in msg
    assert "model.n_head=2" in msg



def test_replacing_stragglers_without_a_spare_is_refused_naming_the_fix():
    msg = spec_error("world.size=2", "world.replace_stragglers=true")
    assert "world.replace_stragglers=true" in msg and "world.spares=0" in msg and "world.spares=1" in msg
    load_spec(TINY, ["world.size=2", "world.replace_stragglers=true", "world.spares=1"])  # with one: accepted


# -- --set overrides --------------------------------------------------------------------


def test_set_parses_yaml_scalars():
    """``--set`` values are YAML: ints become ints, floats floats, strings stay strings."""
    spec = load_spec(TINY, ["train.updates=12", "train.lr=0.01", "seed=7", "job_id=other-job"])
    assert spec.train.updates == 12 and isinstance(spec.train.updates, int)
    assert spec.train.lr == pytest.approx(0.01)
    assert spec.seed == 7
    assert spec.job_id == "other-job"


def test_set_parses_yaml_lists_of_fault_dicts():
    """A flow-style YAML list of mappings becomes a tuple of FaultSpecs."""
    spec = load_spec(TINY, ["faults=[{site: microstep, update: 3, microstep: 1}, "
                            "{site: after_publish, update: 5, attempt: 2}]"])
    assert spec.faults == (
        FaultSpec(site="microstep", update=3, microstep=1),
        FaultSpec(site="after_publish", update=5, attempt=2),
    )


def test_a_hold_fault_is_refused_off_the_training_loop():
    """A HOLD holds the training loop until the supervisor asks: at after_publish it would hold the
    supervisor itself, at bundle_write the background writer; the error names the sites it may use."""
    assert FaultSpec(site="before_update", signal="HOLD", update=3).signal == "HOLD"
    for site in ("after_publish", "bundle_write"):
        with pytest.raises(ValueError, match=f"HOLD fault at site '{site}'.*microstep, backward, before_update"):
            FaultSpec(site=site, signal="HOLD", update=3)


def test_set_parses_a_list_value():
    """A YAML list override fills a tuple field."""
    spec = load_spec(TINY, ["train.betas=[0.8, 0.99]"])
    assert spec.train.betas == (0.8, 0.99)


def test_set_overrides_the_file_and_later_sets_win():
    """Overrides apply after the file, in order; keys not overridden keep the file's values."""
    spec = load_spec(TINY, ["train.updates=3", "train.updates=4"])
    assert spec.train.updates == 4
    assert spec.train.micro_batch == 4  # from tiny.yaml, not the JobSpec default of 8


def test_set_without_equals_is_refused_with_an_example():
    """``--set key`` (no ``=``) is a SpecError that shows the expected form."""
    with pytest.raises(SpecError, match="expected dotted.key=value"):
        parse_override("train.updates")


def test_set_into_a_scalar_is_refused():
    """``--set seed.x=1`` cannot treat the scalar ``seed`` as a section."""
    msg = spec_error("seed.x=1")
    assert "'seed' is a value, not a section" in msg


# -- job_id -----------------------------------------------------------------------------


def test_job_id_defaults_to_the_file_stem(tmp_path):
    """Without ``job_id`` in the file or on the command line, the job is named after the file."""
    path = tmp_path / "nightly-run.yaml"
    path.write_text("seed: 1\n")
    assert load_spec(path).job_id == "nightly-run"
    assert load_spec(TINY).job_id == "tiny"


def test_job_id_from_file_then_argument_take_precedence(tmp_path):
    """A ``job_id`` in the file beats the stem; the ``--job-id`` argument beats both."""
    path = tmp_path / "stem.yaml"
    path.write_text("job_id: from-file\n")
    assert load_spec(path).job_id == "from-file"
    assert load_spec(path, [], "from-arg").job_id == "from-arg"


# -- elastic policy ---------------------------------------------------------------------


def test_elastic_range_that_cannot_divide_global_batch_is_refused_naming_sizes():
    """Elastic sizes 1..4 with a global batch of 8 (micro_batch 4): sizes 3 and 4 are named."""
    overrides = ["world.policy=elastic", "world.size=2", "world.min_size=1", "world.max_size=4",
                 "train.micro_batch=4", "train.accum_steps=1"]
    msg = spec_error(*overrides)
    assert "world.policy=elastic" in msg
    assert "[3, 4]" in msg
    assert "global batch of 8" in msg


def test_elastic_range_that_divides_global_batch_is_accepted():
    """The same job with sizes 1..2 validates, and accum_steps is recomputed per size."""
    spec = load_spec(TINY, ["world.policy=elastic", "world.size=2", "world.min_size=1",
                            "world.max_size=2", "train.micro_batch=4", "train.accum_steps=1"])
    assert spec.allowed_world_sizes() == [1, 2]
    assert spec.accum_steps_for(1) == 2
    assert spec.accum_steps_for(2) == 1


def test_elastic_rule_is_enforced_by_jobspec_itself():
    """The rule lives in JobSpec, so a spec built in code (not from YAML) is refused too."""
    with pytest.raises(ValueError, match=r"\[3\]"):
        JobSpec.model_validate({"world": {"policy": "elastic", "size": 2, "min_size": 2, "max_size": 3},
                                "train": {"micro_batch": 1, "accum_steps": 1}})


# -- the file itself --------------------------------------------------------------------


def test_missing_spec_file_names_the_path(tmp_path):
    """A spec file that does not exist is a SpecError naming the path, not a FileNotFoundError."""
    path = tmp_path / "nope.yaml"
    msg = spec_error(path=path)
    assert str(path) in msg
    assert "does not exist" in msg


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_non_mapping_yaml_names_the_path_and_what_it_got(tmp_path, text, kind):
    """A YAML document that is not a mapping is refused, naming the path and the type found."""
    path = tmp_path / "flat.yaml"
    path.write_text(text)
    msg = spec_error(path=path)
    assert str(path) in msg
    assert "mapping" in msg
    assert kind in msg


def test_invalid_yaml_names_the_path(tmp_path):
    """Unparsable YAML is a SpecError naming the path."""
    path = tmp_path / "broken.yaml"
    path.write_text("seed: [1, 2\n")
    msg = spec_error(path=path)
    assert str(path) in msg
    assert "not valid YAML" in msg


def test_empty_file_gives_the_defaults(tmp_path):
    """An empty file is an empty mapping: every key at its default, job_id from the stem."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    spec = load_spec(path)
    assert spec.job_id == "empty"
    assert spec.train.updates == JobSpec().train.updates


def test_ddp_is_refused_where_strict_cannot_hold_bitwise(tmp_path):
    from tests.conftest import make_spec

    with pytest.raises(SpecError, match="train.grad_sync=ddp cannot keep world.policy=strict bitwise at 3 ranks"):
        make_spec(tmp_path, "train.grad_sync=ddp", "world.size=3")
    assert make_spec(tmp_path, "train.grad_sync=ddp", "world.size=2").train.grad_sync == "ddp"
    assert make_spec(tmp_path, "train.grad_sync=ddp", "world.size=3", "world.policy=elastic").world.size == 3
