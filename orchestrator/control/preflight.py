"""What ``spotrun run`` settles before it starts anything (Ray, a rank, a process group): the facts
that lie in the job's storage and in the driver's own copy of the job's code.

- The job's newest published manifest cannot take this run: another ``world.size``, changed code
  (the entrypoint or any user module it imports, named file by file), another value of a key that
  shapes the trajectory, a manifest schema this spotrun does not know, or other data (another
  length or other contents: the driver builds the job's data to see it, only when there is a bundle
  to resume). Refused (exit 2, one paragraph): the same
  :func:`~spotrun.trainer.bundle.compat.spec_problems` and :func:`~spotrun.trainer.bundle.compat.data_problems`
  every rank checks when it restores, so the answer comes at once and never from inside a started
  cluster.
- The job is finished: its ledger says so and its newest published bundle reached ``train.updates``.
  Nothing is started (exit 0); the message says how to go on (a higher ``train.updates``) or start
  anew (another ``--job-id``).

Either way the ledger gets a ``run_refused`` event and nothing else, so a refused run never changes
what the job's record says (a finished job stays finished). What only a built job knows (the data and
parameter names and shapes, the ranks' runtime) is still checked by the ranks,
at the restore; a bundle whose files are damaged is the restore's to pass over (it falls back to an
older one), so only manifests are read here.
"""

from __future__ import annotations

from spotrun.orchestrator.ledger.events import RefusalCheck, RunRefused
from spotrun.orchestrator.ledger.history import state_of
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.bundle.compat import bundle_address, data_problems, incompatible, spec_problems
from spotrun.trainer.bundle.errors import BundleCorrupt
from spotrun.trainer.bundle.manifest import Manifest, ManifestError, UnknownSchemaError
from spotrun.trainer.data.feed import bind
from spotrun.trainer.data.identity import DataIdentity
from spotrun.trainer.job.code_identity import code_identity
from spotrun.trainer.job.contract import build_job
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.runtime.streams import forked_streams, seed_all
from spotrun.trainer.storage import Storage, open_storage


def preflight(spec: JobSpec) -> str | None:
    """Check ``spec`` against its job's newest published manifest before anything starts.

    Returns None when the run is to start (a new job, or one with updates left that its newest
    bundle can take), or the paragraph to print when the job is finished (exit 0). Raises
    :class:`~spotrun.trainer.bundle.errors.BundleIncompatible` or
    :class:`~spotrun.trainer.bundle.manifest.UnknownSchemaError` (exit 2) when the newest bundle cannot take
    it. Both record a ``run_refused`` event and write nothing else. The job's entrypoint must be
    imported already (:func:`~spotrun.orchestrator.control.launch.check_entrypoint`): its module's source is
    the code fingerprint."""
    # checked as the supervisor checks it (reachable, the bucket there, the credentials good): a storage
    # that is not is refused here, before Ray, with the same message
    storage = open_storage(spec.storage, spec.storage_endpoint_url)
    newest = _newest_manifest(storage, spec.job_id)
    if newest is None:
        return None
    key, manifest = newest
    where = f"bundle {key}"
    problems = spec_problems(manifest, job_id=spec.job_id, code=code_identity(spec),
                             spec_compat=spec.compat_view(), model_config_hash=spec.model_config_hash(),
                             world_size=spec.world.size, where=where, root=storage.uri)
    if not problems:
        problems = data_problems(manifest, data_identity(spec), sequential=spec.data.order == "sequential",
                                 where=where, root=storage.uri)
    if problems:
        refusal = incompatible(where, problems)
        _record(Ledger(storage, spec.job_id), "incompatible", key, str(refusal))
        raise refusal
    done = manifest.counters.attempted_updates
    ledger = Ledger(storage, spec.job_id)
    if done < spec.train.updates or state_of(ledger.read()) != "finished":
        # updates left; or the last update's bundle is published but the driver died before it recorded
        # the job finished: the run restores it, finds nothing to train and records that
        return None
    address = bundle_address(storage.uri, key)
    message = (f"job {spec.job_id} is finished: its newest bundle {address} is at update {done} and train.updates "
               f"is {spec.train.updates}, so nothing was started. To train it further, run the same command with "
               f"--set train.updates=N for an N above {done}: it resumes from that bundle. To start anew, run it "
               f"with another --job-id (add --init-from {address} to begin from this job's weights).")
    _record(ledger, "finished", key, message)
    return message


def data_identity(spec: JobSpec) -> DataIdentity:
    """The identity of the job's data as a rank computes it: the job built here as rank 0 (its model,
    optimizer and state are factories: not called), its data bound to the engine. The driver's own
    random streams are given back as they were."""
    with forked_streams():
        seed_all(spec.seed)  # as a rank seeds before it builds: a dataset drawn at build is the same
        job = build_job(spec, rank=0, world_size=spec.world.size, device="cpu")
        return bind(job.data, spec).identity()


def _newest_manifest(storage: Storage, job_id: str) -> tuple[str, Manifest] | None:
    """The newest published bundle whose manifest reads, as a restore picks it: a damaged manifest is
    passed over for the one before (the restore records why), an unknown schema refuses the run (older
    bundles will not help). None: the job has no readable manifest."""
    for key in [r.key for r in list_bundles(storage, job_id) if r.published]:
        try:
            return key, read_manifest(storage, key)
        except UnknownSchemaError as e:
            _record(Ledger(storage, job_id), "unreadable", key, str(e))
            raise
        except (BundleCorrupt, ManifestError):
            continue
    return None


def _record(ledger: Ledger, check: RefusalCheck, bundle: str, reason: str) -> None:
    """Append the refusal to the job's ledger: an event of its own, beside (never instead of) its state."""
    ledger.append(RunRefused(attempt=ledger.next_attempt(), check=check, bundle=bundle, reason=reason))
