"""What a restored bundle will do next: the next LR, the next occurrences, whether the scaler skips.

Used by ``spotrun inspect``. A bundle is data, never code: :func:`read_next` answers from the
bundle's own files alone (its manifest, ``state.json`` and the weights-only optimizer file) and
never imports or calls what the bundle names (``model.factory``, ``job.entrypoint``) nor contacts
a data source or endpoint it names. What needs the job's code and data (the next occurrences,
whether the scaler skips) is :func:`explain_next`, which restores into a throw-away session the
*caller* built from a spec it trusts (the user's local one) and computes the next update's
gradients (every rank's micro-batches, in this one process) without stepping; the bundle is not
modified.
"""

from __future__ import annotations

from typing import Any

import torch

from spotrun.trainer.bundle.bundles import LoadedBundle
from spotrun.trainer.data.loader import WorkOrder, locations
from spotrun.trainer.data.planner import slice_for
from spotrun.trainer.observe.trace import span_ids
from spotrun.trainer.run.loop import forward
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.runtime.streams import microbatch_seed, seed_all


def read_next(bundle: LoadedBundle) -> dict[str, Any]:
    """The next update's number, LR and grad-scaler scale, read from the bundle as data.

    The saved optimizer's LR is the next update's (the scheduler stepped before the boundary);
    the scaler's state is its saved ``state_dict`` (empty when the scaler is off)."""
    m = bundle.manifest
    opt = bundle.payloads["rank-0/optimizer.pt"]
    scaler = bundle.payloads["rank-0/state.json"].get("scaler") or {}
    return {
        "next_update": m.counters.attempted_updates + 1,
        "next_lr": float(opt["param_groups"][0]["lr"]),
        "scheduler_counts": m.spec.get("train", {}).get("scheduler_counts"),
        "scaler": {"enabled": bool(scaler), "scale": float(scaler["scale"]) if scaler else None},
    }


def explain_next(session: TrainSession, bundle: LoadedBundle, show: int = 8) -> dict[str, Any]:
    session.restore(bundle)
    st, spec = session.state, session.spec
    c = st.counters.value
    lr = st.optimizer.param_groups[0]["lr"]
    sequences = st.planner.next_update()
    ids, _ = span_ids(sequences, session.feed.occurrence_id)
    worker = session.feed.worker()
    steps = session.accum_steps * session.world_size
    for m in range(session.accum_steps):
        for r in range(session.world_size):
            part = sequences[slice_for(r, m, session.world_size, spec.train.micro_batch)]
            order = WorkOrder(c.attempted_updates + 1, m, part, locations(part, session.feed.locate))
            seed_all(microbatch_seed(spec.seed, order.update, m * session.world_size + r))
            loss, _ = forward(st, worker(order))
            st.scaler.scale(loss / steps).backward()
    grads_finite = all(torch.isfinite(p.grad).all() for p in st.model.parameters() if p.grad is not None)
    return {
        "next_update": c.attempted_updates + 1,
        "next_lr": lr,
        "scheduler_counts": spec.train.scheduler_counts,
        "next_occurrences": ids[:show],
        "next_update_occurrences": len(ids),
        "scaler": {
            "enabled": st.scaler.is_enabled(),
            "scale": st.scaler.get_scale() if st.scaler.is_enabled() else None,
            "will_skip": st.scaler.is_enabled() and not grads_finite,
        },
    }
