"""The worker API: one rank's training session, as the orchestrator drives it.

    session = TrainSession(spec, rank=r, world_size=n, attempt=a)
    session.restore(bundle)          # optional: a verified LoadedBundle
    session.start()                  # builds the loader (forks prefetch workers)
    record = session.run_update()    # one update; returns its UpdateRecord
    capture = session.capture()      # at a boundary: host copy of the state
    session.close()
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from spotrun.trainer.bundle import Description, LoadedBundle, describe
from spotrun.trainer.counters import CountersState
from spotrun.trainer.data.listing import ShardInfo, scan
from spotrun.trainer.data.loader import PlanSampler, SequenceDataset, make_loader
from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.data.tokenizer import CharTokenizer
from spotrun.trainer.faults import FaultInjector
from spotrun.trainer.inventory import BY_NAME, DATA_CATEGORIES, roundtrip_mismatches
from spotrun.trainer.loop import GradSync, TrainLoop
from spotrun.trainer.optim import build_scheduler
from spotrun.trainer.spec import JobSpec
from spotrun.trainer.state import Capture, TrainState
from spotrun.trainer.trace import UpdateRecord


class TrainSession:
    def __init__(self, spec: JobSpec, *, rank: int = 0, world_size: int = 1, attempt: int = 1,
                 restore_mode: RestoreMode | None = None, drop: Iterable[str] = (),
                 grad_sync: GradSync | None = None, record_ids: bool = False, digests: bool = True) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.accum_steps = spec.accum_steps_for(world_size)
        self.listing = scan(spec.data.shards, spec.storage_endpoint_url)
        self.tokenizer = CharTokenizer(spec.data.vocab)
        self.state = TrainState(spec, self.listing, self.tokenizer, rank, world_size,
                                restore_mode or spec.checkpoint.restore_mode)
        self.desc: Description = describe(self.state, self.listing, self.tokenizer)
        self.drop = tuple(drop)
        unknown = [d for d in self.drop if d not in BY_NAME or BY_NAME[d].drop is None]
        if unknown:
            droppable = [n for n, c in BY_NAME.items() if c.drop is not None]
            raise ValueError(f"cannot drop state categories {unknown}; droppable: {droppable}")
        self.faults = FaultInjector(spec.faults, attempt, rank)
        self.grad_sync = grad_sync
        self.record_ids = record_ids
        self.digests = digests
        self._sampler: PlanSampler | None = None
        self._loop: TrainLoop | None = None
        self._iter = None
        self._consumed_microsteps = 0

    @property
    def counters(self):
        return self.state.counters.value

    def restore(self, bundle: LoadedBundle) -> float:
        """Load a verified bundle; returns the seconds it took. Must precede :meth:`start`."""
        t0 = time.perf_counter()
        if self.spec.data.order == "sequential" and bundle.manifest.data.shards:
            self.state.resume_listing(bundle.manifest.data.shards)  # the shards in the order it read them
        self.state.restore(bundle.payloads)
        for name in self.drop:  # a deliberately broken build (oracle tests, verify's mutants)
            BY_NAME[name].drop(self.state)
        self.state.planner_state = self.state.planner.state_dict()
        return time.perf_counter() - t0

    def roundtrip(self, bundle: LoadedBundle) -> list[str]:
        """The restore oracle: capture right after :meth:`restore` and name every state category
        that differs from the bundle (empty for a faithful restore). Same world size only: at
        another size the ranks' random streams are new by design."""
        if bundle.manifest.world.size != self.world_size:
            return []
        capture = self.state.capture()
        restored = {**capture.torch_files, **capture.json_files}
        found = roundtrip_mismatches(bundle.payloads, restored)
        if self.state.planner.restore_mode in ("bounded-repetition", "fresh-epoch"):
            found = [c for c in found if c not in DATA_CATEGORIES]  # the data side moves on purpose
        return found

    def known_shards(self) -> list[ShardInfo]:
        """The shards listed when the last consumed update was planned: what a bundle records (the
        planner runs ahead and may have listed more since)."""
        return self.listing.infos(self.state.planner_state["records"])

    def source_offsets(self, known: Sequence[ShardInfo]) -> dict[str, int]:
        """Per-shard line offsets of the ``known`` shards a streaming reader has fully consumed at
        the last consumed update (sequential order only; a permuted order has no meaningful
        per-shard position)."""
        if self.spec.data.order != "sequential":
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
        if "optimizer" in reset:
            st.optimizer.state.clear()  # AdamW re-creates moments and steps lazily, as in a fresh job
        if "scheduler" in reset:
            st.scheduler = build_scheduler(st.optimizer, self.spec.train)
        if "data" in reset:
            st.planner.reset()
            st.planner_state = st.planner.state_dict()

    def start(self) -> None:
        first = self.counters.attempted_updates + 1
        self._sampler = PlanSampler(self.state.planner, self.listing.location, self.rank, self.world_size, self.accum_steps,
                                    self.spec.train.micro_batch, first, self.spec.train.updates)
        dataset = SequenceDataset(self.listing.root, self.listing.endpoint_url, self.tokenizer, self.spec.seed, self.spec.data.mask_prob)
        loader = make_loader(dataset, self._sampler, self.spec.data.workers, self.spec.data.prefetch)
        self._iter = iter(loader)
        self._loop = TrainLoop(self.state, self._counting(self._iter), self.listing, self.accum_steps,
                               self.attempt, self.faults, self.grad_sync, self.record_ids, self.digests)

    def _counting(self, it):
        for batch in it:
            self._consumed_microsteps += 1
            yield batch

    @property
    def done(self) -> bool:
        return self.counters.attempted_updates >= self.spec.train.updates

    def run_update(self) -> UpdateRecord:
        if self._loop is None:
            raise RuntimeError("call start() before run_update()")
        return self._loop.run_update()

    @property
    def prefetched_ahead(self) -> int:
        """Micro-batches the sampler planned beyond what the loop consumed (replayed after a restore)."""
        if self._sampler is None:
            return 0
        return max(0, self._sampler.planned_microsteps - self._consumed_microsteps)

    def capture(self) -> Capture:
        t0 = time.perf_counter()
        cap = self.state.capture()
        cap.stall_seconds = time.perf_counter() - t0
        return cap

    def close(self) -> None:
        """Stop the prefetch workers."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

