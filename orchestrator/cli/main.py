"""``spotrun``: the command line (``spotrun --help``; scripts and tests rely on its commands and flags).

Exit status 0 means success (a finished job run again says so and starts nothing); a refused
contract (bad spec, incompatible or corrupt bundle, ...) exits 2 with one paragraph on stderr; a
driver told to stop exits 143 after its emergency bundle; ``verify`` exits 1 when the contract did
not hold or nothing was tested (with ``--mutate``: 1 when the broken build went unnoticed).
``--json`` prints one JSON document on stdout and nothing else there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from spotrun.orchestrator.control.specfile import SpecError, load_spec
from spotrun.orchestrator.control.supervisor import JobFailedError
from spotrun.orchestrator.ledger.goodput import TERMS as GOODPUT_TERMS
from spotrun.orchestrator.workers.groups import RankFailed
from spotrun.orchestrator.workers.ray_internals import RayInternalsChanged
from spotrun.trainer.bundle.bundles import load_bundle
from spotrun.trainer.bundle.errors import BundleError
from spotrun.trainer.bundle.manifest import Manifest, ManifestError
from spotrun.trainer.storage import Storage, StorageError, UnsafeKeyError, open_storage

if TYPE_CHECKING:
    from spotrun.orchestrator.ledger.history_model import History

# soft_wrap: a sentence piped to a file or a pager stays one line (rich would break it at 80 columns)
err = Console(stderr=True, soft_wrap=True)
# Every command that reads a job's storage takes the S3-compatible service it lives on the same way.
ENDPOINT_HELP = "an S3-compatible service for s3:// storage (a spec's storage_endpoint_url)"


def _out(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) and "/bundles/" in value and " " not in value:  # an address, not a sentence
        return value.rsplit("/", 1)[-1]  # the bundle's own name; the job is in the title
    if isinstance(value, str) and len(value) > 19 and value[10:11] == "T":
        return value[11:19]  # an ISO timestamp: the time of day is what a reader scans for
    if isinstance(value, float):
        return f"{value:.4g}"  # seconds and ratios: four significant digits, never float noise (--json has all)
    return str(value)


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c.replace("_", " "), overflow="fold")
    for r in rows:
        t.add_row(*(_cell(r.get(c)) for c in columns))
    # at its natural width (up to 240 columns): narrower, rich folds cells mid-word ("process-exi" / "t")
    console = Console()
    natural = Measurement.get(console, console.options.update(width=240), t).maximum
    Console(width=max(console.width, min(natural, 240))).print(t)


def cmd_run(a: argparse.Namespace) -> int:
    """Run the job to its end (0), or stop it on SIGTERM (143). What its storage and code already show
    is settled before anything starts (:mod:`~spotrun.orchestrator.control.preflight`): a finished job says
    so (0), a newest bundle that cannot take this spec refuses the run (2); neither starts Ray."""
    from spotrun.orchestrator.control.launch import check_entrypoint, run_in_process, run_on_ray
    from spotrun.orchestrator.control.preflight import preflight
    from spotrun.orchestrator.control.progress import for_terminal
    from spotrun.trainer.metrics.mlflow_sink import check_tracker

    if (a.config is None) == (a.spec_json is None):
        raise SpecError("spotrun run takes a CONFIG file or --spec-json TEXT (one of them)")
    spec = load_spec(a.config, a.set, a.job_id, text=a.spec_json)
    init_from = _split_bundle_uri(a.init_from) if a.init_from else None
    reset = tuple(r for r in (a.reset or "").split(",") if r)
    if reset and not init_from:
        raise SpecError("--reset applies to --init-from BUNDLE_URI only")
    check_entrypoint(spec)  # the code fingerprint is its module's source
    if "mlflow" in spec.metrics.sinks:
        check_tracker(spec.metrics.mlflow)  # before Ray starts
    finished = preflight(spec)
    if finished is not None:
        err.print(f"spotrun run: {escape(finished)}", highlight=False, soft_wrap=True)
        return 0
    kw = dict(trace_path=a.trace, record_ids=a.trace_ids, init_from=init_from, reset=reset,
              drop=getattr(a, "drop", ()),  # set only by spotrun.orchestrator.cli.mutant (verify --mutate)
              progress=for_terminal(spec.train.updates, spec.global_sequences, sys.stdout, quiet=a.quiet))
    outcome = run_in_process(spec, **kw) if a.no_ray else run_on_ray(spec, address=a.address, **kw)
    if outcome.state == "stopped":
        err.print(f"spotrun run: {escape(outcome.reason)}", highlight=False, soft_wrap=True)
        return 143
    c = outcome.counters
    if c is None:  # a finished job always has its final counters (supervisor.Finished)
        raise RuntimeError(f"job {spec.job_id} finished without counters")
    err.print(f"[bold]{spec.job_id}[/] finished after {outcome.attempts} attempt(s), {outcome.restarts} restart(s) "
              f"in this run: attempted {c.attempted_updates}, applied {c.applied_updates}, "
              f"{c.samples_consumed} samples, {c.tokens_consumed} tokens", highlight=False)
    return 0


def cmd_submit(a: argparse.Namespace) -> int:
    from spotrun.orchestrator.cli.submit import submit

    return submit(a.config, a.set, a.job_id, address=a.address, wait=a.wait, as_json=a.json)


def _split_bundle_uri(uri: str) -> tuple[str, str]:
    """``<root>/<job>/bundles/<name>`` -> (storage root URI, bundle key)."""
    uri = uri.rstrip("/")
    head, sep, name = uri.rpartition("/bundles/")
    if not sep or "/" in name or not name:
        raise SpecError(f"{uri!r} is not a bundle address; expected <storage>/<job_id>/bundles/<bundle>")
    root, _, job = head.rpartition("/")
    root = root or "."
    if "://" not in root:  # a local path: absolute, since ranks may run in another working directory
        root = f"file://{Path(root).resolve()}"
    return root, f"{job}/bundles/{name}"


def cmd_inspect(a: argparse.Namespace) -> int:
    """A bundle is data: without ``--explain`` nothing the bundle names is imported, called or
    contacted. ``--explain CONFIG`` builds the job from the user's LOCAL spec (never the bundle's),
    checks the bundle fits it as a restore would, and computes the next occurrences and scaler skip."""
    from spotrun.trainer.run.explain import read_next

    root, key = _split_bundle_uri(a.bundle)
    storage = open_storage(root, a.endpoint_url, check=False)  # read only: no write probe
    bundle = load_bundle(storage, key, None)  # checksums, JSON and weights-only tensors: no code runs
    m = bundle.manifest
    doc: dict[str, Any] = {"bundle": key, "manifest": json.loads(m.model_dump_json()), "next": read_next(bundle)}
    if a.explain:
        doc["next"] = _explain(a, storage, key, m.job_id, m.world.size)
    elif a.set or a.job_id:
        raise SpecError("--set and --job-id apply to --explain CONFIG only")
    if a.json:
        _out(doc)
        return 0
    _print_inspect(key, m, doc["next"])
    return 0


def _explain(a: argparse.Namespace, storage: Storage, key: str, job_id: str, world_size: int) -> dict[str, Any]:
    from spotrun.orchestrator.control.launch import check_entrypoint
    from spotrun.trainer.run.explain import explain_next
    from spotrun.trainer.run.session import TrainSession

    spec = load_spec(a.explain, a.set, a.job_id or job_id)
    check_entrypoint(spec)  # as `spotrun run` imports it: from the working directory first
    session = TrainSession(spec, world_size=world_size)
    # the local job must fit the bundle exactly as a restore requires, or its explanation is not the bundle's
    return explain_next(session, load_bundle(storage, key, session.desc))


def _print_inspect(key: str, m: Manifest, nxt: dict[str, Any]) -> None:
    c, d = m.counters, m.data
    console = Console(soft_wrap=True)
    console.print(f"[bold]{key}[/]  job {m.job_id}  lineage {m.lineage_id}  attempt {m.attempt}  "
                  f"label {m.recovery_label}")
    console.print(f"counters: attempted {c.attempted_updates}, applied {c.applied_updates}, microsteps "
                  f"{c.microsteps}, samples {c.samples_consumed}, tokens {c.tokens_consumed}, "
                  f"last update applied: {c.last_update_applied}")
    console.print(f"cursor: epoch {d.cursor.epoch}, occurrence {d.cursor.index}, token offset "
                  f"{d.cursor.offset} ({d.prefetched_ahead} prefetched micro-batches will be replayed)")
    shards = f" ({d.records} records in {len(d.shards)} shards, the last read: {d.shards[-1].name})" if d.shards else ""
    console.print(f"data {d.dataset_version}{shards}, tokenizer {d.tokenizer_version}, model {m.model.kind} "
                  f"{m.model.config_hash}, {len(m.files)} files, {m.total_bytes} bytes")
    sc = nxt["scaler"]
    scaler = f"scale {sc['scale']:g}" if sc["enabled"] else "off"
    if "will_skip" in sc and sc["enabled"]:
        scaler += f", will {'SKIP' if sc['will_skip'] else 'apply'}"
    console.print(f"next: update {nxt['next_update']} at lr {nxt['next_lr']:.6g} (scheduler follows "
                  f"{nxt['scheduler_counts']} updates); scaler {scaler}")
    if "next_occurrences" in nxt:
        console.print(f"next occurrences ({nxt['next_update_occurrences']} in the update): "
                      + ", ".join(nxt["next_occurrences"]))
    else:
        console.print("next occurrences and the scaler's skip need the job's code and data: add "
                      "--explain CONFIG (your local spec; the bundle's own code is never run)")


def _storage_for(a: argparse.Namespace):
    return open_storage(a.storage, a.endpoint_url)


def cmd_history(a: argparse.Namespace) -> int:
    from spotrun.orchestrator.ledger.history import history

    storage = _storage_for(a)
    doc = history(storage, a.job_id, metrics_local_dir=a.metrics_dir)
    if a.json:
        _out(doc.model_dump(mode="json"))
        return 0
    _table(f"{a.job_id}: attempts ({doc.state})", _rows(doc.attempts),
           ["attempt", "started_at", "world_size", "published", "last_update", "ended"])
    if doc.restarts:
        t = doc.totals
        lost = "not known" if t.lost_updates is None else t.lost_updates
        _table(f"restarts: {t.restarts}, updates lost {lost}, time lost {t.time_lost_seconds:.4g} s "
               "(README \"What a restart cost\")", _rows(doc.restarts),
               ["attempt", "cause", "loss", "detected_at", "restored_from", "recovery_label", "recovery_path",
                "world_size_before", "world_size_after", "lost_updates", "lost_updates_source", "downtime_seconds",
                "time_lost_seconds"])
    _evidence_tables(doc, storage.uri)
    _space_pruned_lines(doc)
    b, run = doc.budgets, doc.budgets.this_run
    _table("restart budgets (losses by class)", [
        {"class": "preemption", "losses": b.preemptions, "this_run": run.preemptions,
         "budget": "no limit" if run.failures is not None and run.max_preemptions is None
         else run.max_preemptions, "left": run.preemptions_left},
        {"class": "failure", "losses": b.failures, "this_run": run.failures, "budget": run.max_restarts,
         "left": run.failures_left},
    ], ["class", "losses", "this_run", "budget", "left"])
    if doc.notices:
        _table("preemption notices", _rows(doc.notices), ["attempt", "at", "source", "node_id", "deadline", "action",
                                                         "reason"])
    if doc.refusals:
        _table("refused runs (none trained; the state above stands)", _rows(doc.refusals),
               ["at", "check", "bundle", "reason"])
    if doc.outages:
        _table("storage outages (training went on; at risk: updates done past the newest bundle when storage answered)",
               [{**r, "paths": ", ".join(r["paths"])} for r in _rows(doc.outages)],
               ["attempt", "began_at", "ended_at", "seconds", "paths", "requests_refused", "bundles_skipped",
                "newest_bundle", "updates_at_risk", "first_error"])
    if doc.checkpoint_intervals:
        _table(f"checkpoint interval (auto; {len(doc.checkpoint_intervals)} decisions in --json)",
               _rows(doc.checkpoint_intervals[-1:]), ["at", "reason", "interval_s", "interval_updates", "bound",
                                                      "checkpoint_cost_s", "mtbp_losing_work_s",
                                                      "expected_lost_work_s", "expected_overhead"])
    g = doc.goodput
    money = ["cost_usd", "badput_usd"] if g.cost_usd is not None else []
    _table(f"goodput {_percent(g.goodput)} (productive / wall; README \"Goodput\")",
           [*_rows(g.attempts), {"attempt": "job", **g.model_dump(mode="json", exclude={"attempts"})}],
           ["attempt", "wall_seconds", *GOODPUT_TERMS, "goodput", "productive_updates", "replayed_updates", *money])
    return 0


def _evidence_tables(doc: History, storage_uri: str) -> None:
    """Beside the restarts table: the ranks found hung or stuck (what found them, where they stopped, their
    stacks' key), the ranks flagged as stragglers, and the rank processes kept through warm restarts with what
    each gained (its footprints); none printed when empty."""
    from spotrun.orchestrator.ledger.access import redact

    hung = [r for r in _rows(doc.restarts) if r["signal"]]
    if hung:
        _table("hung and stuck ranks (by the restart's attempt)", hung,
               ["attempt", "rank", "node_id", "host", "signal", "stopped_phase", "stopped_update", "stacks"])
        Console(soft_wrap=True).print(f"stacks: keys under {redact(storage_uri)}", markup=False, highlight=False)
    if doc.stragglers:
        _table("stragglers (slowdown: a rank's own work over its peers' median)",
               [{**r, "replaced": "yes" if r["replaced"] else "no"} for r in _rows(doc.stragglers)],
               ["attempt", "rank", "node_id", "flagged_at", "flagged_update", "max_slowdown", "replaced"])
    kept = [r for r in _rows(doc.processes) if r["attempts"] > 1]
    if kept:
        _table("rank processes kept through warm restarts (first attempt -> last)",
               [{**r, "attempts": f"{r['first_attempt']}-{r['last_attempt']} ({r['attempts']})",
                 "rss_mib": f"{r['rss_first_bytes'] / 2**20:.0f} -> {r['rss_last_bytes'] / 2**20:.0f}",
                 "fds": f"{r['fds_first']} -> {r['fds_last']}",
                 "threads": f"{r['threads_first']} -> {r['threads_last']}"} for r in kept],
               ["pid", "rank", "attempts", "rss_mib", "fds", "threads", "process_groups_max"])


def _space_pruned_lines(doc: History) -> None:
    """One line per prune on a full disk: why the job kept fewer bundles than keep_last for a while."""
    for r in doc.space_pruned:
        names = ", ".join(b.rsplit("/", 1)[-1] for b in r.bundles)
        Console(soft_wrap=True).print(
            f"storage full at {r.at} (attempt {r.attempt}): removed {len(r.bundles)} older bundle(s), "
            f"{r.freed_bytes} bytes, so that the next checkpoint fits: {names} ({r.reason})",
            markup=False, highlight=False)


def _rows(models: Sequence[BaseModel]) -> list[dict[str, Any]]:
    """Models as the rows :func:`_table` renders: what ``--json`` prints of each."""
    return [m.model_dump(mode="json") for m in models]


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def cmd_bundles(a: argparse.Namespace) -> int:
    from spotrun.orchestrator.ledger.history import bundles

    rows = bundles(_storage_for(a), a.job_id)
    if a.json:
        _out(rows)
        return 0
    _table(f"{a.job_id}: bundles", rows, ["bundle", "update", "published", "bytes", "stall_seconds",
                                          "write_seconds", "recovery_label"])
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    import dataclasses
    import tempfile

    from spotrun.orchestrator.verify.faultplan import draw_seed
    from spotrun.orchestrator.verify.oracle import Verifier
    from spotrun.orchestrator.verify.report import render

    workdir = Path(tempfile.mkdtemp(prefix="spotrun-verify-"))
    seed = draw_seed() if a.seed is None else a.seed  # reported either way: --seed replays the plan
    verifier = Verifier(a.config, a.set, kills=a.kills, seed=seed, no_ray=a.no_ray, workdir=workdir,
                        load=lambda path, overrides: load_spec(path, overrides, a.job_id), nodes=a.nodes,
                        mutate=tuple(c for c in (a.mutate or "").split(",") if c), address=a.address,
                        sites=tuple(c.strip() for c in (a.sites or "").split(",") if c.strip()))
    report = verifier.run()
    if a.json:
        _out(dataclasses.asdict(report))
    else:
        render(report, Console(soft_wrap=True))
        err.print(f"traces in {workdir}; jobs {report.reference_job} and {report.chaos_job} in "
                  f"{verifier.spec.storage}", highlight=False)
    return 0 if report.succeeded() else 1


def cmd_spec(a: argparse.Namespace) -> int:
    from spotrun.trainer.job import specdoc

    if a.explain is not None:
        text = specdoc.explain_text(specdoc.explain(a.explain))
    elif a.defaults:
        text = specdoc.defaults_yaml()
    else:
        text = specdoc.markdown()
    if a.write:
        Path(a.write).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_inventory(a: argparse.Namespace) -> int:
    from spotrun.trainer.state.inventory import CATEGORIES, markdown

    if a.markdown:
        text = markdown()
        if a.write:
            Path(a.write).write_text(text)
        else:
            sys.stdout.write(text)
        return 0
    _table("state inventory", [c.__dict__ for c in CATEGORIES], ["name", "owner", "serialization", "restore"])
    return 0


def cmd_dashboard(a: argparse.Namespace) -> int:
    from spotrun.orchestrator.dashboard.server import resolve_token, serve

    def say(line: str) -> None:
        err.print(line, markup=False, highlight=False, soft_wrap=True)

    serve(a.storage, a.host, a.port, token=resolve_token(a.token_file, a.token, warn=say),
          allow_remote=a.allow_remote, endpoint_url=a.endpoint_url, tls_cert=a.tls_cert, tls_key=a.tls_key,
          announce=say)
    return 0


def _job_arguments(p: argparse.ArgumentParser, config_optional: bool = False) -> None:
    """What every command that starts a job takes: the spec, overrides, the job id."""
    p.add_argument("config", nargs="?" if config_optional else None,
                   help="the job's spec, a YAML file (`spotrun spec --defaults` prints every key)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec key")
    p.add_argument("--job-id", help="the job's id in its storage (default: the spec's job_id, else the spec "
                                    "file's name without .yaml); a new id starts a new job")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotrun", description="Provably faithful restarts for preemptible training.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job; resumes from its newest published bundle")
    _job_arguments(r, config_optional=True)
    r.add_argument("--spec-json", metavar="TEXT", help="the spec itself instead of CONFIG (what submit sends)")
    r.add_argument("--trace", metavar="PATH", help="append one JSON line per completed update")
    r.add_argument("--trace-ids", action="store_true", help="include the occurrence ids in --trace lines")
    r.add_argument("--address", help="an existing Ray cluster (default: an embedded local Ray)")
    r.add_argument("--no-ray", action="store_true", help="world size 1 in this process, without Ray")
    r.add_argument("--init-from", metavar="BUNDLE_URI", help="start a new lineage from another job's bundle")
    r.add_argument("--reset", metavar="PARTS", help="with --init-from: optimizer,scheduler,data start afresh")
    r.add_argument("--quiet", action="store_true", help="no progress on stdout (a bar on a terminal, lines otherwise)")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("submit", help="run a job on a Ray cluster through its Jobs API")
    _job_arguments(s)
    s.add_argument("--address", required=True, metavar="http://HEAD:8265", help="the cluster's dashboard")
    s.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True,
                   help="follow the job until it ends; exit 0 only when it succeeded (default)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_submit)

    i = sub.add_parser("inspect", help="a bundle's manifest and what it will do next")
    i.add_argument("bundle", metavar="BUNDLE_URI")
    i.add_argument("--explain", metavar="CONFIG",
                   help="also compute the next occurrences and scaler skip by building the job from this LOCAL "
                        "spec (runs your code; the bundle's own factory/entrypoint is never imported)")
    i.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --explain: override a key")
    i.add_argument("--job-id", help="with --explain: the job id (default: the bundle's)")
    i.add_argument("--endpoint-url", help=ENDPOINT_HELP)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    for name, func, help_ in (("history", cmd_history, "attempts and restarts of a job"),
                              ("bundles", cmd_bundles, "a job's bundles, published and orphaned")):
        h = sub.add_parser(name, help=help_)
        h.add_argument("job_id", metavar="JOB_ID")
        h.add_argument("--storage", default="file://./runs")
        h.add_argument("--endpoint-url", help=ENDPOINT_HELP)
        h.add_argument("--json", action="store_true")
        h.set_defaults(func=func)
        if name == "history":
            h.add_argument("--metrics-dir", default="./spotrun-metrics",
                           help="where a job on object storage kept its local metric sinks (metrics.local_dir)")

    f = sub.add_parser("verify", help="prove the recovery contract on this job: a reference run, then faults")
    _job_arguments(f)
    f.add_argument("--kills", type=int, default=10, help="faults to inject (default 10)")
    f.add_argument("--seed", type=int, help="seed of the fault plan (default: a fresh one; the report prints it, and "
                                            "--seed with it plans the same faults again)")
    f.add_argument("--no-ray", action="store_true", help="world size 1 in this process, without Ray")
    f.add_argument("--nodes", type=int, default=0,
                   help="run on a local cluster of this many nodes and remove nodes too (one rank per node)")
    f.add_argument("--address", help="run both runs on this existing Ray cluster (default: a local one verify "
                                     "starts and stops)")
    f.add_argument("--mutate", metavar="CATEGORIES",
                   help="prove the proof: a deliberately broken chaos run whose restores lose these state "
                        "categories (`spotrun inventory` lists them; state:NAME for a registered object), or "
                        "mlflow:send-at-write, whose mlflow sink sends each point as it is written instead of at "
                        "publish; its verdict must FAIL: exit 0 when verify caught it, 1 when not")
    f.add_argument("--sites", metavar="SITES",
                   help="plan faults only at these sites, comma-separated (default: every site this job can have: "
                        "mid-accumulation, mid-microstep, warm-rejoin, bundle-write, publish-to-offsets, notice, "
                        "hang, node-removed); e.g. --sites hang --kills 1 on Ray with 2 or more ranks")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=cmd_verify)

    sp = sub.add_parser("spec", help="the job spec's keys: defaults, one key explained, or the whole reference")
    what = sp.add_mutually_exclusive_group(required=True)
    what.add_argument("--defaults", action="store_true", help="print the default spec as YAML (a valid spec)")
    what.add_argument("--explain", metavar="KEY",
                      help="one dotted key (e.g. train.grad_clip): type, default, unit, meaning, and whether it "
                           "applies to your own job or only to the built-in character LM")
    what.add_argument("--markdown", action="store_true", help="every key as one Markdown reference")
    sp.add_argument("--write", metavar="PATH", help="write to PATH instead of stdout")
    sp.set_defaults(func=cmd_spec)

    v = sub.add_parser("inventory", help="the state inventory: what a bundle saves and how each part is restored")
    v.add_argument("--markdown", action="store_true")
    v.add_argument("--write", metavar="PATH")
    v.set_defaults(func=cmd_inventory)

    d = sub.add_parser("dashboard", help="a read-only web dashboard of every job under a storage root")
    d.add_argument("--storage", default="file://./runs")
    d.add_argument("--endpoint-url", help=ENDPOINT_HELP)
    d.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    d.add_argument("--port", type=int, default=8263)
    d.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host (needs a token)")
    d.add_argument("--token-file", metavar="PATH",
                   help="a file whose first line is the token required on every request "
                        "(default: $SPOTRUN_DASHBOARD_TOKEN)")
    d.add_argument("--token", help="deprecated: visible to every user in ps; use --token-file")
    d.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (with --tls-key)")
    d.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    d.set_defaults(func=cmd_dashboard)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_parsed(parser().parse_args(argv))


def run_parsed(a: argparse.Namespace) -> int:
    """Run a parsed command line; a refused contract is one paragraph on stderr and exit 2."""
    try:
        return a.func(a)
    except (SpecError, BundleError, ManifestError, StorageError, UnsafeKeyError, JobFailedError, RankFailed,
            RayInternalsChanged, ValueError) as e:
        err.print(f"[red]spotrun {a.command}: {escape(str(e))}[/]", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
