"""The worker API: one rank's training session, as the orchestrator drives it.

    session = TrainSession(spec, rank=r, world_size=n, attempt=a)
    session.restore(bundle)          # optional: a verified LoadedBundle
    session.start()                  # builds the loader (forks prefetch workers)
    record = session.run_update()    # one update; returns its UpdateRecord
    capture = session.capture()      # at a boundary: host copy of the state
    session.close()

The session builds the job from the spec's entrypoint (:func:`spotrun.trainer.job.contract.build_job`)
after seeding every global stream, binds its data to the engine, and builds the state.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from spotrun.trainer.bundle.bundles import LoadedBundle
from spotrun.trainer.bundle.description import Description, describe
from spotrun.trainer.bundle.errors import BundleCorrupt, BundleIncompatible
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.data.feed import TokenFeed, bind
from spotrun.trainer.data.kinds import DataCaution
from spotrun.trainer.data.listing import ShardInfo
from spotrun.trainer.data.loader import PlanDataset, PlanSampler, make_loader
from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.job.contract import build_job
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.observe.trace import UpdateRecord
from spotrun.trainer.run.beacon import Beacon
from spotrun.trainer.run.context import TRACED, Instrumentation
from spotrun.trainer.run.loop import BoundaryFlags, GradSync, TrainLoop
from spotrun.trainer.runtime.device import deterministic_env
from spotrun.trainer.runtime.sharding import ShardError, rows_of
from spotrun.trainer.runtime.streams import seed_all
from spotrun.trainer.state.counters import CountersState
from spotrun.trainer.state.inventory import DATA_CATEGORIES, categories_of, roundtrip_mismatches
from spotrun.trainer.state.rng import GeneratorMismatch
from spotrun.trainer.state.training import Capture, TrainState


class TrainSession:
    def __init__(self, spec: JobSpec, *, rank: int = 0, world_size: int = 1, attempt: int = 1,
                 restore_mode: RestoreMode | None = None, grad_sync: GradSync | None = None,
                 instrument: Instrumentation = TRACED, device: str = "cpu") -> None:
        """Build the job as rank ``rank`` of ``world_size`` in ``attempt``. ``restore_mode``: the data
        planner's (None: the spec's). ``instrument``: what the loop records (stage digests, rank 0's
        occurrence ids) and which state categories a restore drops on purpose (:class:`Instrumentation`;
        a ``ValueError`` names a category this job cannot drop)."""
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.accum_steps = spec.accum_steps_for(world_size)
        deterministic_env()  # before anything can start cuBLAS: the job's build may run on the GPU
        seed_all(spec.seed)  # whatever the entrypoint draws while building is the same on every attempt
        self.build_read: set[str] = set()  # which of rank and world_size the job's build read (can_rejoin)
        self.job = build_job(spec, rank=rank, world_size=world_size, device=device, read=self.build_read)
        self.feed = bind(self.job.data, spec)
        self.state = TrainState(spec, self.job, self.feed, rank, world_size,
                                restore_mode or spec.checkpoint.restore_mode, device)
        self.desc: Description = describe(self.state)
        if rank == 0:  # said once, where the rank's output reaches the terminal of spotrun run
            for caution in self.desc.data.cautions:
                warnings.warn(caution, DataCaution, stacklevel=1)
        self.instrument = instrument.for_rank(rank)
        known = categories_of(self.state)
        unknown = [d for d in self.drop if d not in known or known[d].drop is None]
        if unknown:
            droppable = [n for n, c in known.items() if c.drop is not None]
            raise ValueError(f"cannot drop state categories {unknown}; droppable in this job: {droppable}")
        self.faults = FaultInjector(spec.faults, attempt, rank)
        self.grad_sync = grad_sync
        self._sampler: PlanSampler | None = None
        self._loop: TrainLoop | None = None
        self._iter: Iterator[Any] | None = None
        # where the training thread is, read by the rank's polls (trainer/run/beacon.py)
        self.beacon = Beacon(window=spec.world.straggler_window)

    def rejoin(self, *, rank: int, world_size: int, attempt: int, grad_sync: GradSync | None,
               instrument: Instrumentation) -> None:
        """Serve another attempt in this process as rank ``rank`` of ``world_size``, keeping what was
        built (the job, model, optimizer, data pipeline, host buffers); :meth:`restore` and
        :meth:`start` follow. Only where nothing built depends on the old place (:meth:`can_rejoin`)."""
        reason = self.can_rejoin(rank, world_size)
        if reason is not None:
            raise ValueError(f"this process cannot serve as rank {rank} of {world_size}: {reason}")
        self.close()
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.accum_steps = self.spec.accum_steps_for(world_size)
        self.state.rank, self.state.world_size = rank, world_size
        self.state.forget_update()
        self.faults = FaultInjector(self.spec.faults, attempt, rank)
        self.grad_sync, self.instrument = grad_sync, instrument.for_rank(rank)
        self._sampler = self._loop = None
        self.beacon = Beacon(window=self.spec.world.straggler_window)  # a new attempt: its updates read afresh

    def can_rejoin(self, rank: int, world_size: int) -> str | None:
        """Why this session cannot serve as rank ``rank`` of ``world_size`` (None: it can): the job's
        build read what changes, or the model is bound to its process group (sharded, DDP)."""
        changed = {n for n, old, new in (("rank", self.rank, rank), ("world_size", self.world_size, world_size))
                   if old != new}
        if changed & self.build_read:
            return f"the job's build read ctx.{'/'.join(sorted(changed & self.build_read))}, which changes"
        if self.state.wrapped or self.state.trained is not self.state.model:
            return "its model is bound to the old process group (FSDP or DDP)"
        return None

    @property
    def drop(self) -> tuple[str, ...]:
        """The state categories every restore of this session loses on purpose (a mutant build)."""
        return self.instrument.drop

    @property
    def counters(self):
        return self.state.counters.value

    @property
    def listing(self):
        """The token data's shard listing (``None`` for map and stream data)."""
        return self.feed.listing if isinstance(self.feed, TokenFeed) else None

    def restore(self, bundle: LoadedBundle) -> float:
        """Load a verified bundle; returns the seconds it took. Must precede :meth:`start`."""
        t0 = time.perf_counter()
        # the lineage goes on under the loop convention it began with (counters.py): never mixed
        self.feed.seed_globals = bundle.manifest.loop_convention >= 2
        if isinstance(self.feed, TokenFeed) and self.spec.data.order == "sequential" and bundle.manifest.data.shards:
            self.feed.resume(bundle.manifest.data.shards)  # the shards in the order it read them
        known = categories_of(self.state)
        try:
            self.state.restore(bundle.payloads, skip=[known[d].skip for d in self.drop if known[d].skip])
        except ShardError as e:  # the shards do not add up: an older bundle may still serve
            raise BundleCorrupt(str(e)) from e
        except GeneratorMismatch as e:  # written for another layout of GPUs: no older bundle differs
            raise BundleIncompatible(f"bundle {bundle.key}: {e}") from e
        for name in self.drop:  # a deliberately broken build (oracle tests, verify's mutants)
            drop = known[name].drop
            if drop is not None:
                drop(self.state)
        self.state.planner_state = self.state.planner.state_dict()
        return time.perf_counter() - t0

    def wants(self, manifest: Manifest) -> Callable[[str], bool]:
        """Which files of the bundle ``manifest`` this rank's restore reads (:func:`load_bundle`'s
        ``want``): its own files and rank 0's shared ones (state, stream); of the model and optimizer,
        a replicated bundle's (rank 0's) or, sharded, those of the ranks whose rows overlap the rows
        this rank holds now (its own alone at the same world size)."""
        model_ranks = self._overlapping(manifest) if manifest.world.parallelism == "fsdp" else {0}

        def keep(path: str) -> bool:
            rank_dir, _, name = path.partition("/")
            rank = int(rank_dir.removeprefix("rank-")) if rank_dir.startswith("rank-") else -1
            if name.startswith(("model.", "optimizer.")):
                return rank in model_ranks
            return rank == self.rank or (rank == 0 and name.startswith(("state.", "stream.")))

        return keep

    def _overlapping(self, manifest: Manifest) -> set[int]:
        """The ranks of a sharded bundle holding rows this rank holds now (every sharded tensor has a
        parameter's shape: its moments and EMA weights follow it)."""
        if not self.state.wrapped:  # an unsharded model holds every row
            return set(range(manifest.world.size))
        n, m = manifest.world.size, self.world_size
        found = set()
        for p in manifest.model.params:
            dim0 = p.shape[0] if p.shape else 0
            lo, hi = rows_of(dim0, m, self.rank)
            found |= {r for r in range(n) if (b := rows_of(dim0, n, r))[0] < hi and lo < b[1]}
        return found or {0}  # a rank that holds no rows at all still needs the unsharded values

    def roundtrip(self, bundle: LoadedBundle) -> list[str]:
        """The restore oracle's findings (:meth:`roundtrip_capture`)."""
        return self.roundtrip_capture(bundle)[0]

    def roundtrip_capture(self, bundle: LoadedBundle, keep_replica: bool = False,
                          generation: int = 0) -> tuple[list[str], Capture]:
        """The restore oracle: capture right after :meth:`restore` and name every state category
        that differs from the bundle (empty for a faithful restore).

        At the bundle's world size every file this rank writes is compared, and one the bundle holds
        that the capture lacks is named too (``missing:<file>``). At another world size (elastic) the
        state that is the same at any size is compared: the replicated model, EMA and optimizer,
        counters, scaler, data planner and modes; each rank's random streams and registered state
        where the bundle has that rank's; not a sharded model's rows (they are laid out anew).

        Returns the findings and the capture: with none, it holds the bundle in this rank's host
        buffers (``keep_replica``: a replicated model and optimizer on every rank, see TrainState.capture)."""
        capture = self.state.capture(keep_replica, generation)  # never the buffers ``bundle`` may be in
        capture.wait()
        restored: dict[str, Any] = capture.files()  # a held replica is compared too
        saved = dict(bundle.payloads)
        if bundle.manifest.world.size != self.world_size and bundle.manifest.world.parallelism == "fsdp":
            for files in (saved, restored):
                for path in [p for p in files if p.endswith(("/model.pt", "/optimizer.pt"))]:
                    del files[path]
        state = saved.get("rank-0/state.json")
        if state is not None and "train_modes" not in state:  # older bundles kept the root's flag alone
            restored["rank-0/state.json"] = {k: v for k, v in restored["rank-0/state.json"].items()
                                             if k != "train_modes"} | {"train_mode": self.state.model.training}
        found = roundtrip_mismatches(saved, restored)
        if bundle.manifest.world.size == self.world_size:
            found += [f"missing:{path}" for path in sorted(set(saved) - set(restored)) if self._writes(path)]
        if self.state.planner.restore_mode in ("bounded-repetition", "fresh-epoch"):
            found = [c for c in found if c not in DATA_CATEGORIES]  # the data side moves on purpose
        return found, capture

    def _writes(self, path: str) -> bool:
        """Whether this rank's capture writes bundle file ``path`` (its own files; rank 0's shared ones)."""
        rank_dir, _, name = path.partition("/")
        if rank_dir == f"rank-{self.rank}":
            return self.rank == 0 or self.state.sharded or not name.startswith(("model.", "optimizer."))
        return False

    def known_shards(self) -> list[ShardInfo]:
        """The shards listed when the last consumed update was planned: what a bundle records (the
        planner runs ahead and may have listed more since). Token data only."""
        listing = self.listing
        return listing.infos(self.state.planner_state["records"]) if listing is not None else []

    def source_offsets(self, known: Sequence[ShardInfo]) -> dict[str, int]:
        """Per-shard line offsets of the ``known`` shards a streaming reader has fully consumed at
        the last consumed update (sequential token data only; a permuted order has no meaningful
        per-shard position)."""
        if self.listing is None or self.spec.data.order != "sequential":
            return {}
        return self.listing.shard_offsets(self.state.planner_state["low_water"]["position"], len(known))

    RESETTABLE = ("optimizer", "scheduler", "data")

    def start_new_lineage(self, reset: Iterable[str]) -> None:
        """After restoring another job's bundle: counters restart at zero, and each part named in
        ``reset`` (optimizer, scheduler, data) starts as in a fresh job."""
        reset = tuple(reset)
        unknown = [r for r in reset if r not in self.RESETTABLE]
        if unknown:
            raise ValueError(f"--reset {','.join(unknown)}: can reset only {', '.join(self.RESETTABLE)}")
        st = self.state
        st.counters.load_state_dict(CountersState().state_dict())
        self.feed.seed_globals = True  # a new lineage trains under this release's loop convention
        if "optimizer" in reset:
            st.optimizer.state.clear()  # torch optimizers create their state lazily, as in a fresh job
        if "scheduler" in reset and self.job.scheduler is not None:
            st.scheduler = self.job.scheduler(st.optimizer, self.spec.train.updates)
        if "data" in reset:
            st.planner.reset()
            st.planner_state = st.planner.state_dict()

    def start(self) -> None:
        first = self.counters.attempted_updates + 1
        self._sampler = PlanSampler(self.state.planner, self.feed.locate, self.rank, self.world_size,
                                    self.accum_steps, self.spec.train.micro_batch, first, self.spec.train.updates)
        loader = make_loader(PlanDataset(self.feed.worker()), self._sampler, self.spec.data.workers,
                             self.spec.data.prefetch)
        self._iter = iter(loader)
        self._loop = TrainLoop(self.state, self._counting(self._iter), self.accum_steps, self.attempt, self.faults,
                               self.grad_sync, self.instrument.record_ids, self.instrument.trace,
                               beacon=self.beacon)

    def _counting(self, it: Iterator[Any]) -> Iterator[Any]:
        """The loader's batches, each with its plan again (the workers got only its order)."""
        assert self._sampler is not None
        for key, batch in it:
            yield self._sampler.claim(key), batch

    @property
    def done(self) -> bool:
        return self.counters.attempted_updates >= self.spec.train.updates

    def run_update(self, flags: BoundaryFlags | None = None) -> UpdateRecord:
        """One update; with ``flags`` and a gradient sync, see :attr:`agreed_flags`."""
        if self._loop is None:
            raise RuntimeError("call start() before run_update()")
        return self._loop.run_update(flags)

    @property
    def agreed_flags(self) -> list[bool] | None:
        """The boundary flags every rank agreed on in the last update's gradient sync (and its
        record's loss and metrics are the ranks' means); None when no sync carried them."""
        return self._loop.agreed_flags if self._loop is not None else None

    @property
    def prefetched_ahead(self) -> int:
        """Micro-batches the sampler planned beyond what the loop consumed (replayed after a restore)."""
        if self._sampler is None:
            return 0
        return self._sampler.unclaimed

    def capture(self, keep_replica: bool = False, generation: int = 0) -> Capture:
        t0 = time.perf_counter()
        cap = self.state.capture(keep_replica, generation)
        cap.stall_seconds = time.perf_counter() - t0
        return cap

    def close(self) -> None:
        """Stop the prefetch workers."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
