"""The state inventory: every category of state that shapes the next update.

One registry names, for each category, its owner, how it is serialised, how it
is restored, and the oracle that proves it. Each entry also carries ``drop``:
what a build that forgot the category would do after an otherwise faithful
restore. The "oracle can fail" tests and ``spotrun verify``'s mutants apply it
and expect the oracle to notice. ``docs/STATE.md`` is generated from this
registry (``spotrun inventory --markdown``), so the document cannot drift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from spotrun.trainer.data.feed import TokenFeed
from spotrun.trainer.data.listing import scan
from spotrun.trainer.data.planner import Planner
from spotrun.trainer.data.stream import StreamPlanner
from spotrun.trainer.runtime.sharding import full, is_sharded, local
from spotrun.trainer.state.ema import EMA
from spotrun.trainer.state.training import TrainState

ORACLE_TRACE = "per-update occurrence digest and parameter digest equal the uninterrupted run"


def _always(st: TrainState) -> bool:
    return True


@dataclass(frozen=True)
class Category:
    name: str
    owner: str
    serialization: str
    restore: str
    oracle: str
    drop: Callable[[TrainState], None] | None
    needs: str = ""  # what a job must do for the oracle to see a drop (empty: any job)
    undetectable: str = ""  # why no oracle can see it, where that is so
    applies: Callable[[TrainState], bool] = _always  # does this job have the category at all
    skip: str = ""  # a registered state object whose restore a drop skips
    min_ranks: int = 1  # the fewest ranks a job needs to have the category (sharding needs two)


# A drop runs only on a job its category ``applies`` to; these name the part it changes, and refuse
# a job without it (a drop called on the wrong job is a bug of the caller, not a silent no-op).


def _ema(st: TrainState) -> EMA:
    if st.ema is None:
        raise ValueError("the ema category applies to a job with spotrun.Job(ema_decay=...) only")
    return st.ema


def _planner(st: TrainState) -> Planner:
    if not isinstance(st.planner, Planner):
        raise ValueError(f"this category applies to map and token data only, not to a {st.feed.kind} job")
    return st.planner


def _stream_planner(st: TrainState) -> StreamPlanner:
    if not isinstance(st.planner, StreamPlanner):
        raise ValueError(f"the stream_state category applies to stream data only, not to a {st.feed.kind} job")
    return st.planner


def _token_feed(st: TrainState) -> TokenFeed:
    if not isinstance(st.feed, TokenFeed):
        raise ValueError(f"the source_listing category applies to token data only, not to a {st.feed.kind} job")
    return st.feed


def _reinit_params(st: TrainState) -> None:
    with torch.no_grad():
        for p in st.model.parameters():
            mine = local(p)  # a sharded parameter: this rank's rows
            mine.add_(torch.randn(mine.shape, generator=torch.Generator().manual_seed(1)).to(mine) * 0.01)


def _reset_ema(st: TrainState) -> None:
    _ema(st).load_state_dict({n: p.detach().float() for n, p in st.model.named_parameters()})


def _zero_moments(st: TrainState) -> None:
    for s in st.optimizer.state.values():
        for k, v in s.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                v.zero_()


def _reset_steps(st: TrainState) -> None:
    for s in st.optimizer.state.values():
        if isinstance(s.get("step"), torch.Tensor):
            s["step"].zero_()
        elif "step" in s:
            s["step"] = 0


def _reset_scheduler(st: TrainState) -> None:
    if st.scheduler is None or st.scheduler_initial is None:
        raise ValueError("the scheduler category applies to a job with spotrun.Job(scheduler=...) only")
    st.scheduler.load_state_dict(st.scheduler_initial)
    for g, lr in zip(st.optimizer.param_groups, st.scheduler_initial["_last_lr"], strict=True):
        g["lr"] = lr


def _reset_scaler(st: TrainState) -> None:
    if st.scaler.is_enabled():
        st.scaler.load_state_dict({"scale": st.spec.train.grad_scaler.init_scale, "growth_factor": 2.0,
                                   "backoff_factor": 0.5, "growth_interval": st.spec.train.grad_scaler.growth_interval,
                                   "_growth_tracker": 0})


def _empty_shuffle_buffer(st: TrainState) -> None:
    _planner(st).stream.buffer.clear()


def _list_by_name(st: TrainState) -> None:
    # a build that lists the source afresh (every shard, by name) instead of the bundle's shards
    listing = _token_feed(st).listing
    vars(listing).update(vars(scan(listing.root, listing.endpoint_url, listing.measure)))
    _planner(st).tokens = listing.units_of


def _drop_remainder(st: TrainState) -> None:
    _planner(st).packer.current = None


def _cursor_from_prefetch(st: TrainState) -> None:
    # The furthest record the loader had fetched: workers x prefetch micro-batches ahead.
    ahead = st.spec.data.workers * st.spec.data.prefetch
    accum = st.spec.accum_steps_for(st.world_size)
    for _ in range(max(1, math.ceil(ahead / accum))):
        st.planner.next_update()


def _restart_stream(st: TrainState) -> None:
    # a build that forgot the stream's own state: it reads on from where the stream was built
    planner = _stream_planner(st)
    planner.stream.load_state_dict(planner.initial)
    planner.load_state_dict({**planner.state_dict(), "stream": planner.initial})


def _reset_counters(st: TrainState) -> None:
    st.counters.value = type(st.counters.value)()


def _eval_mode(st: TrainState) -> None:
    st.model.eval()


def _rank0_rows(st: TrainState) -> None:
    # a build that restores every rank from rank 0's shard (the layout ignored): each rank's rows of
    # every sharded parameter become the first rows of the whole tensor
    if not any(is_sharded(p) for p in st.model.parameters()):
        raise ValueError("the shard_rows category applies to a sharded job (train.parallelism=fsdp, 2+ ranks)")
    with torch.no_grad():
        for p in st.model.parameters():
            whole, mine = full(p), local(p)
            mine.copy_(whole[:mine.shape[0]])


def _sharded(st: TrainState) -> bool:
    return any(is_sharded(p) for p in st.model.parameters())


def _is(kind: str) -> Callable[[TrainState], bool]:
    return lambda st: st.feed.kind == kind


def _planned(st: TrainState) -> bool:
    return st.feed.kind in ("map", "token")


# The global streams are re-seeded before every microstep (trainer/state/rng.py): what a bundle saves of them
# can never change a later update.
_DERIVED = ("re-derived at the start of every microstep from (seed, update, micro-batch index), so a build "
            "that lost it draws exactly the same; captured anyway")

CATEGORIES: tuple[Category, ...] = (
    Category("model_params", "TrainState.model",
             "rank-0/model.pt ['model'] (the tensors' bytes in rank-0/model.safetensors; fsdp: every rank's "
             "rank-<r>/model.pt, its rows)",
             "model.load_state_dict(strict=True) after the name/shape check", ORACLE_TRACE, _reinit_params),
    Category("ema", "TrainState.ema", "rank-0/model.pt ['ema'] (fp32 tensors)",
             "EMA.load_state_dict (names must match the model's)",
             "parameter digest (it covers the EMA weights)", _reset_ema, needs="spotrun.Job(ema_decay=...)",
             applies=lambda st: st.ema is not None),
    Category("optimizer_moments", "TrainState.optimizer",
             "rank-0/optimizer.pt ['state'], keyed by parameter name (tensors in rank-0/optimizer.safetensors)",
             "load_named_state maps names to this model's parameter positions", ORACLE_TRACE, _zero_moments,
             needs="an optimizer with moments or momentum (AdamW, SGD with momentum, ...)"),
    Category("optimizer_steps", "TrainState.optimizer", "rank-0/optimizer.pt ['state'][name]['step']",
             "restored with the moments", ORACLE_TRACE + " (AdamW's bias correction reads the step)",
             _reset_steps, needs="an optimizer that reads its step count (Adam, AdamW, ...)"),
    Category("scheduler", "TrainState.scheduler", "rank-0/optimizer.pt ['scheduler'] (its state_dict)",
             "scheduler.load_state_dict; the schedule itself is rebuilt by the job's scheduler factory",
             ORACLE_TRACE + " (the next LR differs)", _reset_scheduler, needs="spotrun.Job(scheduler=...)",
             applies=lambda st: st.scheduler is not None),
    Category("grad_scaler", "TrainState.scaler", "rank-0/state.json ['scaler']",
             "GradScaler.load_state_dict (scale and growth tracker)",
             ORACLE_TRACE + " and applied_updates", _reset_scaler,
             needs="train.precision=fp16 with a scale that overflows (e.g. grad_scaler.init_scale 2^30)"),
    Category("rng_torch", "global torch CPU generator", "rank-<r>/rng.json ['torch_cpu']",
             "torch.set_rng_state, last of all; then seeded per micro-batch", ORACLE_TRACE + " (dropout masks differ)",
             None, undetectable=_DERIVED),
    Category("rng_python", "global python random", "rank-<r>/rng.json ['python']",
             "random.setstate, last of all; then seeded per micro-batch", ORACLE_TRACE, None, undetectable=_DERIVED),
    Category("rng_numpy", "global numpy generator", "rank-<r>/rng.json ['numpy']",
             "np.random.set_state, last of all; then seeded per micro-batch", ORACLE_TRACE, None,
             undetectable=_DERIVED),
    Category("rng_cuda", "torch CUDA generator of the rank's own GPU", "rank-<r>/rng.json ['torch_cuda']",
             "torch.cuda.set_rng_state on the rank's device; then seeded per micro-batch", ORACLE_TRACE, None,
             undetectable=_DERIVED),
    Category("data_cursor", "Planner (epoch, index, offset); StreamPlanner (elements read)",
             "rank-0/state.json ['planner']['cursor']",
             "snapshot: loaded with the buffer; replay: fast-forward from the epoch start",
             "occurrence digest per update", _cursor_from_prefetch),
    Category("shuffle_buffer", "EpochStream (contents, order position, generator)",
             "rank-0/state.json ['planner']['snapshot']['stream']",
             "snapshot: loaded as saved; replay: recomputed by drawing again from the epoch start",
             "occurrence digest per update", _empty_shuffle_buffer, needs="data.shuffle_buffer > 0",
             applies=_planned),
    Category("stream_state", "the StreamData stream's own state_dict()", "rank-0/stream.pt ['stream']",
             "snapshot: stream.load_state_dict; replay: its initial state, then read up to the cursor",
             "occurrence digest per update (and the stream's elements through the parameters)", _restart_stream,
             applies=_is("stream")),
    Category("source_listing", "Listing (shards in the order discovered, their hashes) and "
             "EpochStream's growth log", "manifest ['data']['shards']; rank-0/state.json ['planner']['records'] "
             "and ['planner']['snapshot']['stream']['known', 'exhausted']",
             "exactly the bundle's shards, in its order; a replay grows as logged; later rescans adopt "
             "the lineage's growth records (<job>/source/)",
             "occurrence digest per update", _list_by_name,
             needs="data.order=sequential and a shard that appeared after the boundary, named to sort "
                   "before a known one", applies=_is("token")),
    Category("packer_remainder", "Packer.current (occurrence id + tokens already packed)",
             "rank-0/state.json ['planner']['snapshot']['packer']",
             "snapshot: loaded; replay: the occurrence at the cursor, cut at its offset",
             "occurrence digest per update", _drop_remainder,
             needs="a boundary where an occurrence straddles two updates (nearly every boundary)",
             applies=_is("token")),
    Category("shard_rows", "FSDP2's dim-0 shards (train.parallelism=fsdp): each rank's rows of every parameter, "
             "EMA weight and optimizer moment",
             "rank-<r>/model.pt and rank-<r>/optimizer.pt ['layout'] (each sharded tensor's rows [start, stop) and "
             "whole shape; the rows in that rank's .safetensors)",
             "each rank puts together the rows it holds now from the shards that cover them: its own at the same "
             "world size, any overlapping ones at another; rows in no shard are a torn bundle, refused",
             "the restore oracle on every rank (its shard equals the bundle's) and " + ORACLE_TRACE, _rank0_rows,
             needs="train.parallelism=fsdp on 2 or more ranks", applies=_sharded, min_ranks=2),
    Category("counters", "CountersState", "rank-0/state.json ['counters'] and the manifest",
             "CountersState.load_state_dict; read under loop_convention",
             "update numbering and counters in the trace and the next manifest", _reset_counters),
    Category("train_mode", "every submodule's training flag (model.named_modules())",
             "rank-0/state.json ['train_modes'] (module path -> flag)",
             "each submodule's flag set by its path (a frozen backbone kept in eval() stays in eval)",
             "the restore oracle (every submodule's flag) and " + ORACLE_TRACE + " (dropout on or off, batch-norm "
             "statistics kept or updated)", _eval_mode,
             needs="a model whose modes differ (dropout, batch norm)"),
    Category("accumulation", "TrainLoop (microstep position, accumulated gradients)",
             "not stored: bundles are taken at update boundaries only",
             "none: a restore always starts at microstep 0 with zero gradients", "", None,
             undetectable="by construction there is nothing to lose: a bundle is only ever taken after "
                          "optimizer.zero_grad at an update boundary, so the position is always 0"),
    Category("last_update_applied", "Counters.last_update_applied", "rank-0/state.json ['counters']",
             "restored with the counters", "the next manifest", None,
             undetectable="informational: the next update does not read it; the scaler state (which does "
                          "decide skips) is its own category"),
    Category("precision", "spec train.precision; fp32 master parameters", "manifest ['precision']",
             "the parameters are stored and restored in fp32; compute precision comes from the spec",
             "compatibility check (spec train.precision must match)", None,
             undetectable="nothing to drop: stored and master precision are both the fp32 parameters"),
)

BY_NAME = {c.name: c for c in CATEGORIES}

USER_STATE = Category(
    "state:<name>", "the job's registered object spotrun.Job(state={name: obj}), each rank's own copy",
    "rank-<r>/user.pt ['objects'][name] (its state_dict, torch weights-only)",
    "obj.load_state_dict with rank r's copy (a rank beyond the bundle's world keeps its built state)",
    "the restore oracle (its state right after the restore equals the bundle's) and " + ORACLE_TRACE,
    lambda st: None, needs="its state to differ from a freshly built object's at the boundary")


def categories_of(state: TrainState) -> dict[str, Category]:
    """The categories this job has: the static ones that apply, and one per registered object
    (``state:<name>``, whose drop skips that object's restore)."""
    out = {c.name: c for c in CATEGORIES if c.applies(state)}
    for name in state.user:
        out[f"state:{name}"] = replace(USER_STATE, name=f"state:{name}", skip=name)
    return out


# Where each category sits in a capture: (file, path of keys) -> category. A path prefix
# covers everything below it; "*" matches any key at that level.
LOCATIONS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    # rank 0's files, or under fsdp every rank's (its shard)
    ("rank-*/model.pt", ("model",), "model_params"),
    ("rank-*/model.pt", ("ema",), "ema"),
    ("rank-*/model.pt", ("layout",), "shard_rows"),
    ("rank-*/optimizer.pt", ("state", "*", "step"), "optimizer_steps"),
    ("rank-*/optimizer.pt", ("state",), "optimizer_moments"),
    ("rank-*/optimizer.pt", ("param_groups",), "scheduler"),  # the live lr is the schedule's
    ("rank-*/optimizer.pt", ("scheduler",), "scheduler"),
    ("rank-*/optimizer.pt", ("layout",), "shard_rows"),
    ("rank-0/state.json", ("counters",), "counters"),
    ("rank-0/state.json", ("scaler",), "grad_scaler"),
    ("rank-0/state.json", ("planner", "cursor"), "data_cursor"),
    ("rank-0/state.json", ("planner", "low_water"), "data_cursor"),
    ("rank-0/state.json", ("planner", "records"), "source_listing"),
    ("rank-0/state.json", ("planner", "snapshot", "stream", "known"), "source_listing"),
    ("rank-0/state.json", ("planner", "snapshot", "stream", "exhausted"), "source_listing"),
    ("rank-0/state.json", ("planner", "snapshot", "stream"), "shuffle_buffer"),
    ("rank-0/state.json", ("planner", "snapshot", "packer"), "packer_remainder"),
    ("rank-0/state.json", ("train_mode",), "train_mode"),
    ("rank-0/state.json", ("train_modes",), "train_mode"),
    ("rank-0/stream.pt", ("stream",), "stream_state"),
    ("rank-*/rng.json", ("python",), "rng_python"),
    ("rank-*/rng.json", ("numpy",), "rng_numpy"),
    ("rank-*/rng.json", ("torch_cpu",), "rng_torch"),
    ("rank-*/rng.json", ("torch_cuda",), "rng_cuda"),
)


def _category_of(path: str, keys: tuple[str, ...]) -> str:
    if path.endswith("/user.pt") and len(keys) >= 2 and keys[0] == "objects":
        return f"state:{keys[1]}"
    for file, prefix, category in LOCATIONS:
        if (file == path or (file.startswith("rank-*") and path.endswith(file[6:]))) and len(keys) >= len(prefix) \
                and all(p in ("*", k) for p, k in zip(prefix, keys, strict=False)):
            return category
    return "unlisted:" + path + ":" + ".".join(keys)


def _differences(a, b, keys: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append((*keys, str(k)))
            else:
                out += _differences(a[k], b[k], (*keys, str(k)))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [keys]
        return [d for x, y in zip(a, b, strict=True) for d in _differences(x, y, keys)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) else [keys]
    return [] if a == b else [keys]


DATA_CATEGORIES = frozenset({"data_cursor", "shuffle_buffer", "packer_remainder", "source_listing", "stream_state"})


def roundtrip_mismatches(saved: Mapping[str, object], restored: Mapping[str, object]) -> list[str]:
    """Categories whose state right after a restore differs from the bundle it was restored from.

    A faithful restore followed by a capture gives back exactly what was saved; a category
    that was lost (or only partly restored) shows up here, by name, before any update runs."""
    found: list[str] = []
    for path in sorted(set(saved) & set(restored)):
        for keys in _differences(saved[path], restored[path]):
            category = _category_of(path, keys)
            if category not in found:
                found.append(category)
    return found


def markdown() -> str:
    """``docs/STATE.md``: the registry as a document."""
    lines = [
        "# State inventory",
        "",
        "Generated by `spotrun inventory --markdown` from `trainer/state/inventory.py`; do not edit by hand.",
        "",
        "Every category of state that shapes the next update, with its owner, where a bundle keeps it,",
        "how a restore puts it back, and the oracle that proves it. The oracle compares, update by",
        "update, the digest of the occurrences fed to the model and the digest of every parameter,",
        "buffer and EMA weight against an uninterrupted run. `tests/unit/test_oracle_can_fail.py`",
        "drops each category in turn after an otherwise faithful restore and asserts the oracle sees it.",
        "",
        "## The job's contract",
        "",
        "A user job (`spotrun.Job`, see the README's *Bring your own job*) restores exactly when:",
        "",
        "- the dataset is fixed for a lineage (or `MapData`/`StreamData` declares a `version`);",
        "- `transform` and `collate` are pure functions of their arguments;",
        "- all randomness comes from the global generators (seeded by spotrun at every microstep from",
        "  (seed, update, micro-batch index)) or from the generator passed to the transform;",
        "- no state that shapes a later update lives outside the model, the optimizer, the scheduler and",
        "  the objects registered in `state` (each rank's copy is saved as `state:<name>` below).",
        "",
        "Detection: the restore oracle compares every category below right after each restore;",
        "`spotrun verify --mutate CATEGORY` runs a build whose restores lose that category and must fail",
        "(or the category has no observable effect on that job); state kept outside `state` fails",
        "`spotrun verify` at the first update after a restore; a changed entrypoint module or",
        "`job.config` refuses the resume (start a new lineage with `--init-from`).",
        "",
        "## Categories",
        "",
        "| category | owner | serialization | restore | oracle | a drop is seen when |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in (*CATEGORIES, USER_STATE):
        seen = "never (see below)" if c.drop is None else (c.needs or "always")
        lines.append(f"| `{c.name}` | {c.owner} | {c.serialization} | {c.restore} | {c.oracle or '-'} | {seen} |")
    lines += ["", "## Categories whose omission no oracle can detect", ""]
    for c in CATEGORIES:
        if c.undetectable:
            lines.append(f"- `{c.name}`: {c.undetectable}.")
    lines += ["", "## Categories the oracle detects only on some jobs", ""]
    for c in (*CATEGORIES, USER_STATE):
        if c.drop is not None and c.needs:
            lines.append(f"- `{c.name}`: needs {c.needs}.")
    return "\n".join(lines) + "\n"
