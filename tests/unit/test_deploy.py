"""The deploy files (deploy/): checked offline, against what the installed packages say.

- ``deploy/aws-spot.yaml`` validates against the cluster-launcher schema shipped inside the installed
  ``ray`` package, and passes the offline part of ``ray up`` (defaults merged, then validated);
  head on-demand, workers spot GPUs of several types, IMDSv2 reachable, token auth on every node.
- every job spec a deploy file names (``deploy/specs/...``, ``configs/...``, or a path under
  ``/home/ray/spotrun/``, where the nodes and the image hold this repository) exists and validates
  as a ``JobSpec``; found by scanning the files, so a new reference is checked without a new test.
- the KubeRay ``RayJob`` parses and carries what a spot job needs (entrypoint, capacity types,
  secrets, a grace period covering the spec's ``preemption.grace_s``).
- every ``==`` pin in the Dockerfile and in the cluster's setup commands equals ``pyproject.toml``'s.

The last test drives ``deploy/drain_on_stop.py`` (the KubeRay preStop hook) against a real
multi-node local Ray cluster running a spotrun job, as Kubernetes would on a spot eviction.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from spotrun.orchestrator.control.specfile import load_spec
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
NODE_ROOT = "/home/ray/spotrun"  # where the cluster nodes (file mount) and the image (COPY) hold this repository
SPOT_GRACE_MARGIN_S = 15  # the preStop hook connects to Ray (a few seconds) before its drain deadline starts
AWS_NOTICE_S = 120  # an EC2 spot interruption notice comes this long before the instance is reclaimed


def _yaml(name: str):
    return yaml.safe_load((DEPLOY / name).read_text())


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pyproject_pins() -> dict[str, str]:
    pins = {}
    for dep in _pyproject()["project"]["dependencies"]:
        req = Requirement(dep)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[canonicalize_name(req.name)] = exact[0]
    return pins


PIN = re.compile(r"(?<![\w.-])([A-Za-z][A-Za-z0-9_.-]*)(?:\[[^\]]*\])?==([0-9][A-Za-z0-9.+!-]*)")
RAY_IMAGE = re.compile(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)(?:-[a-z0-9]+)?")


def _pins_in(text: str) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in PIN.findall(text)}


def _assert_pins_match_pyproject(text: str, where: str, required: tuple[str, ...]) -> None:
    pins, project = _pins_in(text), _pyproject_pins()
    assert pins, f"{where} pins nothing"
    for name, version in pins.items():
        assert name in project, f"{where} pins {name}=={version}, which pyproject.toml does not pin"
        assert version == project[name], f"{where} pins {name}=={version}, pyproject.toml {name}=={project[name]}"
    missing = [n for n in required if n not in pins]
    assert not missing, f"{where} does not pin {missing} (pyproject.toml: {[project[n] for n in missing]})"


def _assert_ray_image_matches(text: str, where: str) -> None:
    images = RAY_IMAGE.findall(text)
    assert images, f"{where} names no rayproject/ray:X.Y.Z-pyXY image"
    requires = SpecifierSet(_pyproject()["project"]["requires-python"])
    for version, major, minor in images:
        ray_pin = _pyproject_pins()["ray"]
        assert version == ray_pin, f"{where}: image Ray {version}, pyproject ray=={ray_pin}"
        assert f"{major}.{minor}" in requires, f"{where}: image Python {major}.{minor} outside {requires}"


# --- deploy/aws-spot.yaml ---------------------------------------------------------------------------

def _ray_schema() -> dict:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_aws_spot_validates_against_the_installed_ray_schema():
    jsonschema.validate(_yaml("aws-spot.yaml"), _ray_schema())


def test_aws_spot_passes_the_offline_checks_of_ray_up():
    """What ``ray up`` does before it calls AWS: merge the provider's defaults, then validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(_yaml("aws-spot.yaml")))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"


def test_a_broken_cluster_config_is_refused_by_the_schema():
    """The schema check above can fail: a misspelled top-level key and a node type without resources."""
    validator = jsonschema.Draft7Validator(_ray_schema())
    typo = dict(_yaml("aws-spot.yaml"), max_worker=4)
    assert any("max_worker" in e.message for e in validator.iter_errors(typo))
    no_resources = copy.deepcopy(_yaml("aws-spot.yaml"))
    del next(iter(no_resources["available_node_types"].values()))["resources"]
    assert any("resources" in e.message for e in validator.iter_errors(no_resources))


def test_aws_spot_head_is_on_demand_and_workers_are_spot_gpus_of_several_types():
    cfg = _yaml("aws-spot.yaml")
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"], "the head must be on-demand"
    assert head["resources"].get("CPU") == 0, "no rank may be placed on the head"
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert len({w["node_config"]["InstanceType"] for w in workers.values()}) >= 3, "several types, for capacity"
    for name, w in workers.items():
        assert w["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot", name
        assert w["resources"].get("GPU", 0) >= 1, name
        assert w.get("min_workers", 0) == 0 and w["max_workers"] >= 1, name
    assert cfg["provider"].get("cache_stopped_nodes") is False, "spot instances cannot be stopped and reused"
    assert "," in cfg["provider"]["availability_zone"], "several zones, for capacity"


def test_aws_spot_autoscaling_limits_fit_the_specs_it_runs():
    cfg = _yaml("aws-spot.yaml")
    specs = _specs_named_by("aws-spot.yaml")
    assert specs, "aws-spot.yaml names the spec it is sized for"
    for spec in specs:
        assert cfg["max_workers"] >= spec.max_world, f"{spec.job_id}: {spec.max_world} ranks > max_workers"
        gpu_types = [w for w in cfg["available_node_types"].values() if w["resources"].get("GPU", 0)]
        for w in gpu_types:
            assert w["resources"]["GPU"] >= spec.world.num_gpus_per_rank
            assert w["resources"]["CPU"] >= spec.world.cpus_per_rank + spec.data.workers


def test_aws_spot_keeps_capacity_asked_for_the_specs_ranks():
    """spotrun waits for rank slots but does not ask Ray's autoscaler for them: the head's standing
    request_resources is what launches spot workers and replaces a reclaimed one. It must ask for
    exactly the spec's ranks, each with the spec's resources."""
    import ast

    starts = "\n".join(_yaml("aws-spot.yaml")["head_start_ray_commands"])
    m = re.search(r"request_resources\(bundles=\[(\{[^}]*\})\]\s*\*\s*(\d+)\)", starts)
    assert m, "the head must ask the autoscaler for the ranks' capacity"
    bundle, count = ast.literal_eval(m.group(1)), int(m.group(2))
    for spec in _specs_named_by("aws-spot.yaml"):
        assert count == spec.max_world
        assert bundle == {"CPU": spec.world.cpus_per_rank, "GPU": spec.world.num_gpus_per_rank}


def test_aws_spot_every_node_reaches_imds_and_has_an_instance_profile():
    for name, node_type in _yaml("aws-spot.yaml")["available_node_types"].items():
        conf = node_type["node_config"]
        md = conf.get("MetadataOptions", {})
        assert md.get("HttpTokens") == "required" and md.get("HttpEndpoint") == "enabled", name
        assert md.get("HttpPutResponseHopLimit", 1) >= 2, f"{name}: containers need 2 hops to reach IMDS"
        assert conf.get("IamInstanceProfile"), f"{name}: ranks and driver write to S3 with the instance role"


def test_aws_spot_installs_pinned_spotrun_and_turns_token_auth_on():
    cfg = _yaml("aws-spot.yaml")
    setup = "\n".join(cfg["setup_commands"])
    _assert_pins_match_pyproject(setup, "aws-spot.yaml setup_commands", ("torch", "torchdata", "ray"))
    assert re.search(r"pip install .*-e ~/spotrun", setup), "spotrun itself must be installed on every node"
    assert cfg["file_mounts"]["~/spotrun"] == "."
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    _assert_ray_image_matches(cfg["docker"]["image"], "aws-spot.yaml docker.image")
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"], "ray exec shells need token mode too"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cfg[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token ray start" in c for c in starts), key
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=0.0.0.0" in head_start  # reachable through `ray dashboard`'s SSH tunnel


def test_no_cluster_config_names_a_bucket():
    """The bucket is given once, in the job spec: the cluster files carry no s3:// value."""
    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    for name in ("aws-spot.yaml", "kuberay-rayjob.yaml"):
        docs = list(yaml.safe_load_all((DEPLOY / name).read_text()))
        assert not [s for d in docs for s in strings(d) if "s3://" in s], name
    buckets = {m for spec in _all_deploy_specs() for m in [spec.storage] if m.startswith("s3://")}
    assert buckets, "the deploy specs store bundles in S3"


# --- job specs named by the deploy files ------------------------------------------------------------

REPO_REF = re.compile(r"(?<![\w/.-])((?:deploy/specs|configs)/[\w./-]*[\w-]\.ya?ml)\b")
NODE_REF = re.compile(re.escape(NODE_ROOT) + r"/([\w./-]*[\w-])")


def _deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _references(*names: str) -> tuple[set[str], set[str]]:
    """(spec paths relative to the repository, paths under NODE_ROOT) named in the deploy files."""
    files = [DEPLOY / n for n in names] if names else _deploy_files()
    specs, node_paths = set(), set()
    for f in files:
        text = f.read_text()
        specs |= set(REPO_REF.findall(text))
        node_paths |= set(NODE_REF.findall(text))
    specs |= {p for p in node_paths if re.search(r"\.ya?ml$", p)}
    return specs, node_paths


def _specs_named_by(*names: str):
    return [load_spec(ROOT / p) for p in sorted(_references(*names)[0])]


def _all_deploy_specs():
    return [load_spec(p) for p in sorted((DEPLOY / "specs").glob("*.y*ml"))]


def test_the_deploy_files_name_specs():
    specs, _ = _references()
    assert "deploy/specs/gpt-char-spot.yaml" in specs, sorted(specs)


@pytest.mark.parametrize("path", sorted(_references()[0]))
def test_every_spec_a_deploy_file_names_exists_and_validates(path):
    assert (ROOT / path).is_file(), f"a deploy file names {path}, which does not exist"
    load_spec(ROOT / path)  # raises SpecError naming the key otherwise


@pytest.mark.parametrize("path", sorted(_references()[1]))
def test_every_node_path_a_deploy_file_names_is_in_the_repository(path):
    """Nodes and the image hold this repository at NODE_ROOT: what the deploy files name there must exist."""
    assert (ROOT / path).exists(), f"a deploy file names {NODE_ROOT}/{path}; {path} is not in the repository"


def test_every_deploy_spec_is_set_up_for_spot():
    specs = _all_deploy_specs()
    assert specs
    for spec in specs:
        assert spec.storage.startswith("s3://"), spec.job_id
        assert spec.preemption.imds_url == "http://169.254.169.254", spec.job_id
        assert spec.preemption.grace_s < AWS_NOTICE_S, spec.job_id
        assert spec.preemption.watch_ray_drain, spec.job_id
        assert spec.world.num_gpus_per_rank >= 1, spec.job_id
        assert spec.world.capacity_timeout_s >= 300, f"{spec.job_id}: a new spot node takes minutes to join"
        shards = Path(spec.data.shards)
        assert shards.is_absolute() and str(shards).startswith(NODE_ROOT + "/"), spec.job_id
        local = ROOT / shards.relative_to(NODE_ROOT)
        assert list(local.glob("*.jsonl")), f"{spec.job_id}: {local} holds no shard"


# --- deploy/kuberay-rayjob.yaml ---------------------------------------------------------------------

def _rayjob() -> dict:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text()) if d]
    jobs = [d for d in docs if d.get("kind") == "RayJob"]
    assert len(jobs) == 1 and jobs[0]["apiVersion"] == "ray.io/v1"
    return jobs[0]


def _capacity_values(pod_spec: dict) -> set[str]:
    """Every value the pod's node selection accepts for a capacity-type label."""
    keys = {"karpenter.sh/capacity-type", "eks.amazonaws.com/capacityType"}
    values = {v for k, v in (pod_spec.get("nodeSelector") or {}).items() if k in keys}
    terms = (pod_spec.get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
    for term in terms:
        for expr in term.get("matchExpressions", []):
            if expr["key"] in keys:
                assert expr["operator"] == "In", expr
                values |= set(expr["values"])
    return values


def _pod_specs(job: dict):
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    return head, [(g, g["template"]["spec"]) for g in cluster["workerGroupSpecs"]]


def _rayjob_spec(job: dict):
    """The spec the entrypoint runs: /configs/<name> is the ConfigMap made from deploy/specs/<name>."""
    argv = shlex.split(job["spec"]["entrypoint"])
    config = next(a for a in argv if a.endswith((".yaml", ".yml")))
    assert config.startswith("/configs/")
    return load_spec(DEPLOY / "specs" / Path(config).name)


def test_rayjob_entrypoint_runs_spotrun_on_the_cluster():
    job = _rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["spotrun", "run"] or argv[:4] == ["python", "-m", "spotrun", "run"], argv
    assert argv[argv.index("--address") + 1] == "auto"
    spec = _rayjob_spec(job)
    head, _ = _pod_specs(job)
    mounts = {m["mountPath"]: m["name"] for c in head["containers"] for m in c.get("volumeMounts", [])}
    volume = next(v for v in head["volumes"] if v["name"] == mounts["/configs"])
    assert volume["configMap"]["name"], "the spec reaches the head through a ConfigMap"
    assert f"deploy/specs/{spec.job_id}.yaml" in (DEPLOY / "kuberay-rayjob.yaml").read_text()


def test_rayjob_head_is_on_demand_and_workers_are_spot_gpus():
    job = _rayjob()
    head, workers = _pod_specs(job)
    assert _capacity_values(head) and _capacity_values(head) <= {"on-demand", "ON_DEMAND"}
    assert not head.get("tolerations"), "the head must not tolerate spot or GPU taints"
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"
    assert workers
    for group, pod in workers:
        assert _capacity_values(pod) and _capacity_values(pod) <= {"spot", "SPOT"}, group["groupName"]
        assert pod.get("tolerations"), group["groupName"]
        gpu = pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert int(gpu) >= _rayjob_spec(job).world.num_gpus_per_rank
        assert group["maxReplicas"] >= _rayjob_spec(job).max_world
    # spotrun waits for GPUs but does not request them: the group must keep them asked for
    assert sum(g["minReplicas"] for g, _ in workers) >= _rayjob_spec(job).max_world


def test_rayjob_takes_s3_credentials_from_a_secret():
    job = _rayjob()
    head, workers = _pod_specs(job)
    for pod in [head, *(p for _, p in workers)]:
        c = pod["containers"][0]
        from_secret = [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
        from_secret += [e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
        assert from_secret, f"{c['name']}: S3 credentials must come from a Kubernetes secret"
        literal = {e["name"] for e in c.get("env", []) if "value" in e}
        assert not literal & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, "never credentials in the manifest"


def test_rayjob_grace_period_covers_an_emergency_bundle():
    job = _rayjob()
    grace = _rayjob_spec(job).preemption.grace_s
    _, workers = _pod_specs(job)
    for group, pod in workers:
        period = pod["terminationGracePeriodSeconds"]
        assert period >= grace + SPOT_GRACE_MARGIN_S, f"{group['groupName']}: {period}s < grace_s {grace} + margin"
        hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        script = next(a for a in hook if a.endswith("drain_on_stop.py"))
        assert (ROOT / Path(script).relative_to(NODE_ROOT)).is_file()
        assert float(hook[hook.index("--deadline-s") + 1]) == grace


def test_rayjob_versions_and_token_auth():
    job = _rayjob()
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == _pyproject_pins()["ray"]
    assert cluster["authOptions"]["mode"] == "token"
    head, workers = _pod_specs(job)
    images = {c["image"] for pod in [head, *(p for _, p in workers)] for c in pod["containers"]}
    assert len(images) == 1, f"head and workers must run one image: {images}"
    assert next(iter(images)).rsplit(":", 1)[1] == _pyproject()["project"]["version"]


# --- deploy/Dockerfile ------------------------------------------------------------------------------

def test_dockerfile_pins_equal_pyproject():
    text = (DEPLOY / "Dockerfile").read_text()
    _assert_pins_match_pyproject(text, "deploy/Dockerfile", ("torch", "torchdata", "ray"))
    _assert_ray_image_matches(text, "deploy/Dockerfile")
    assert re.search(r"^FROM \$\{RAY_IMAGE\}|^FROM rayproject/ray:", text, re.M)
    assert re.search(rf"^COPY .* {re.escape(NODE_ROOT)}/?$", text, re.M), "the repository goes to NODE_ROOT"


def test_pin_check_catches_a_drifted_pin():
    text = (DEPLOY / "Dockerfile").read_text().replace("torch==2.13.0", "torch==2.12.0")
    assert "torch==2.12.0" in text
    with pytest.raises(AssertionError, match="torch==2.12.0"):
        _assert_pins_match_pyproject(text, "drifted", ("torch",))


def test_the_readme_walks_through_the_deploy_files():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("ray up deploy/aws-spot.yaml", "ray dashboard deploy/aws-spot.yaml", "--port-forward 8263",
                   "spotrun submit", "spotrun history", "spotrun dashboard",
                   "kubectl apply -f deploy/kuberay-rayjob.yaml",
                   "aws:ec2:send-spot-instance-interruptions", "ray drain-node", "RAY_AUTH_MODE", "deploy/Dockerfile"):
        assert needle in text, needle
    assert "deploy/README.md" in (ROOT / "README.md").read_text()


# --- deploy/drain_on_stop.py on a real multi-node cluster ------------------------------------------

@pytest.mark.slow
def test_drain_on_stop_moves_a_running_job_off_the_node(tmp_path):
    """What Kubernetes does to a spot worker pod, minus Kubernetes: the preStop hook runs on rank 1's
    node; the job takes an emergency bundle, loses nothing, continues elastically on the other node,
    and the hook returns once no rank is left on its node."""
    from spotrun.orchestrator.control.launch import run_on_ray
    from spotrun.orchestrator.ledger.events import AttemptStarted, NoticeHandled, Restored
    from spotrun.orchestrator.ledger.store import Ledger
    from spotrun.trainer.storage import open_storage
    from tests.conftest import make_spec
    from tests.helpers.ray_local import job_thread, local_cluster
    from tests.helpers.runs import hold, wait_until_held

    # Every rank holds before update 6's optimizer step until the drain is acted on: the job cannot
    # finish before the hook has run, and the emergency bundle is update 6's (no periodic one is due).
    spec = make_spec(tmp_path, "world.size=2", "world.policy=elastic", "world.min_size=1", "train.updates=10",
                     "checkpoint.every_updates=1000", "data.workers=1", "world.placement=STRICT_SPREAD",
                     "world.restart_backoff_s=0.1", "preemption.drain_poll_s=0.1", f"faults=[{hold(6)}]",
                     job_id="prestop")
    with local_cluster(workers=2) as cluster:
        outcome: dict = {}
        job = job_thread(lambda: outcome.update(result=run_on_ray(spec)), spec.job_id)
        ledger = Ledger(open_storage(spec.storage), spec.job_id)
        wait_until_held(open_storage(spec.storage), spec.job_id, job.is_alive)
        node = [e for e in ledger.read() if isinstance(e, AttemptStarted)][-1].node_ids[1]
        hook = subprocess.run([sys.executable, str(DEPLOY / "drain_on_stop.py"), "--address", cluster.address,
                               "--node-id", node, "--deadline-s", "60", "--poll-s", "0.2"],
                              capture_output=True, text=True, timeout=120)
        assert hook.returncode == 0, hook.stderr
        assert "no spotrun rank left" in hook.stderr
        job.join(timeout=180)
        assert not job.is_alive() and outcome["result"].restarts == 1
        events = ledger.read()
        handled = next(e for e in events if isinstance(e, NoticeHandled))
        assert handled.source == "ray-drain" and handled.update == 6
        restored = next(e for e in events if isinstance(e, Restored))
        assert restored.lost_updates == 0 and restored.update == handled.update
        assert restored.world_size_after == 1 and node not in \
            [e for e in events if isinstance(e, AttemptStarted)][-1].node_ids
