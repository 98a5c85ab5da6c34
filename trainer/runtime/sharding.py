"""Sharded training state (``train.parallelism: fsdp``): FSDP2 wrapping, and the rows of a tensor a rank holds.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter on dim 0 the way
``torch.chunk`` splits it: with ``N`` ranks and ``D`` rows, each rank holds ``ceil(D / N)``
consecutive rows, the last ones fewer, possibly none. The optimizer's moments and the EMA follow
their parameter. A sharded bundle keeps, for every such tensor, each rank's rows in that rank's
own files and a *layout* beside them: ``{key: [start, stop, *global_shape]}``. A restore then
puts together the rows a rank holds now from whichever pieces cover them, so the same code
restores a bundle of ``N`` ranks onto ``M`` (elastic), a sharded bundle into an unsharded model
(one rank, ``spotrun inspect --explain``, the comparison of two runs) and a replicated one into
a sharded model (``--init-from``).

A world of one rank is never wrapped (there is nothing to shard, and no process group): its
tensors are whole and their layout is the whole range.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

# torch.distributed.tensor (DTensor) is imported where a model is sharded, never at import: it costs
# every rank's start 0.7 s (sympy), and a process that never imported it holds no sharded tensor.
_DTENSOR = "torch.distributed.tensor"

# The job's own wrapping (spotrun.Job(shard=...)): call fully_shard on the submodules that should be
# their own units (each transformer block, say); the engine wraps the root afterwards.
ShardFn = Callable[[nn.Module, Any], None]
LAYOUT = "layout"  # the key of a payload's layout: where each sharded tensor's rows sit


class ShardError(ValueError):
    """The pieces of a sharded tensor do not add up (a torn bundle), or a model cannot be sharded."""


def wrap_each_child(model: nn.Module, mesh: Any) -> None:
    """The default wrapping: each top-level child that holds parameters is a unit of its own."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)


def apply_fsdp(model: nn.Module, shard: ShardFn | None, world_size: int, device: str) -> nn.Module:
    """Shard ``model`` over the default process group's ``world_size`` ranks (in place; returned)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh(device.split(":")[0], (world_size,))
    (shard or wrap_each_child)(model, mesh)
    fully_shard(model, mesh=mesh)
    for name, p in model.named_parameters():
        if not is_sharded(p) or tuple(p.placements) != (Shard(0),):  # type: ignore[attr-defined]
            raise ShardError(f"parameter {name} is not sharded on dim 0 after wrapping ({type(p).__name__}); "
                             "spotrun.Job(shard=...) may only call fully_shard on submodules")
    return model


def rows_of(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` rank ``rank`` of ``world_size`` holds of a tensor of ``dim0`` rows."""
    per = -(-dim0 // world_size) if dim0 else 0
    start = min(rank * per, dim0)
    return start, min(start + per, dim0)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's sharded parameters, their moments and EMA weights)."""
    module = sys.modules.get(_DTENSOR)
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds (a sharded tensor's local part, or the tensor itself)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def held_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows of ``t``'s global tensor this rank holds (all of them for an unsharded tensor)."""
    if not is_sharded(t):
        return 0, t.shape[0] if t.dim() else 0
    mesh = t.device_mesh  # type: ignore[attr-defined]
    start, stop = rows_of(t.shape[0], mesh.size(), mesh.get_local_rank())
    if local(t).shape[0] != stop - start:
        raise ShardError(f"a sharded tensor of {t.shape[0]} rows holds {local(t).shape[0]} on rank "
                         f"{mesh.get_local_rank()} of {mesh.size()}, not {stop - start}: not a dim-0 chunking")
    return start, stop


def layout_entry(t: torch.Tensor) -> list[int]:
    """``[start, stop, *global_shape]``: what a layout records of a sharded tensor."""
    start, stop = held_rows(t)
    return [start, stop, *t.shape]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a sharded one: every rank must call it, in the same order)."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]


def gathered(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor whole, in name order (see :func:`full`)."""
    return {n: full(named[n]) for n in sorted(named)}


def like(ref: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as ``ref`` holds them: a sharded tensor placed like ``ref``, or ``rows`` itself."""
    if not is_sharded(ref):
        return rows
    from torch.distributed.tensor import DTensor

    assert isinstance(ref, DTensor)
    return DTensor.from_local(rows.to(ref.to_local().device), ref.device_mesh, ref.placements, shape=ref.shape,
                              stride=ref.stride(), run_check=False)


class Pieces:
    """The pieces of every tensor of one kind of payload (``model.pt``, ``optimizer.pt``) across the
    rank files a bundle (or the part of it a rank read) holds.

    ``payloads`` maps a file path to its payload. A payload with a layout holds, for each key in
    it, rows ``[start, stop)`` of a tensor of the recorded shape; a payload without one (a
    replicated bundle's ``rank-0`` file) holds whole tensors. The lowest rank present gives
    everything that is not sharded (settings, step counts, buffers: equal on every rank)."""

    def __init__(self, payloads: Mapping[str, Any], name: str, where: str) -> None:
        self.where = where
        self.name = name
        ranks = sorted(int(p.split("/")[0].removeprefix("rank-")) for p in payloads
                       if p.startswith("rank-") and p.endswith(f"/{name}"))
        if not ranks:
            raise ShardError(f"{where}: no rank file holds {name}")
        self.files = [(r, payloads[f"rank-{r}/{name}"]) for r in ranks]
        self.template = self.files[0][1]

    def get(self, key: str, value: Any, start: int | None = None, stop: int | None = None) -> Any:
        """The value of ``key`` (a ``/``-joined path of the template), rows ``[start, stop)`` of it
        for a sharded tensor (``None``: all of them)."""
        if not isinstance(value, torch.Tensor):
            return value
        spans = []
        for rank, payload in self.files:
            entry = payload.get(LAYOUT, {}).get(key)
            part = _at(payload, key) if entry is not None or rank == self.files[0][0] else None
            if part is None:
                continue
            lo, hi, *shape = entry if entry is not None else [0, part.shape[0] if part.dim() else 0, *part.shape]
            spans.append((lo, hi, shape, part))
        if not spans[0][3].dim():
            return value
        dim0 = spans[0][2][0]
        start, stop = (0, dim0) if start is None else (start, stop if stop is not None else dim0)
        return _join(spans, start, stop, f"{self.where}: {self.name} {key}")

    def shape(self, key: str, value: torch.Tensor) -> tuple[int, ...]:
        """The whole tensor's shape at ``key`` (``value`` is the template's piece of it)."""
        entry = self.template.get(LAYOUT, {}).get(key)
        return tuple(entry[2:]) if entry is not None else tuple(value.shape)

    def tree(self, key: str, value: Any, rows: Callable[[str, torch.Tensor], tuple[int, int] | None]) -> Any:
        """The template's subtree at ``key`` with every tensor replaced by the rows ``rows(key, tensor)``
        asks for (``None``: all of them)."""
        if isinstance(value, dict):
            return {k: self.tree(f"{key}/{k}" if key else str(k), v, rows) for k, v in value.items() if k != LAYOUT}
        if isinstance(value, torch.Tensor):
            want = rows(key, value)
            return self.get(key, value, *(want if want is not None else (None, None)))
        return value

    def whole(self) -> dict[str, Any]:
        """The payload as one rank holding every row would have written it (no layout)."""
        return self.tree("", self.template, lambda key, t: None)


def _at(payload: Any, key: str) -> Any:
    for part in key.split("/"):
        if not isinstance(payload, dict) or part not in payload:
            return None
        payload = payload[part]
    return payload


def _join(spans: Iterable[tuple[int, int, list[int], torch.Tensor]], start: int, stop: int, what: str) -> torch.Tensor:
    """Rows ``[start, stop)`` put together from pieces ``(lo, hi, shape, rows)``; a gap is a torn bundle."""
    spans = sorted(spans, key=lambda s: s[0])
    parts, at = [], start
    for lo, hi, _, rows in spans:
        if hi <= at or lo >= stop:  # wholly before the rows still wanted, or after them
            continue
        if lo > at:  # the rows between at and lo are in no piece
            break
        take = min(hi, stop)
        parts.append(rows[at - lo:take - lo])
        at = take
    if at < stop:
        raise ShardError(f"{what}: rows {at} to {stop} are in no shard of the bundle (a torn sharded bundle)")
    if not parts:  # a rank that holds no rows of a short tensor
        return spans[0][3][:0]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# -- parameters a rank's backward did not reach -------------------------------------------------


def _fsdp_params(model: nn.Module) -> Iterable[tuple[nn.Module, str, Any]]:
    """(unit, parameter name, FSDP2's record of it) for every parameter of every unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    name_of = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[attr-defined]
                for fsdp_param in group.fsdp_params:
                    yield module, name_of[id(fsdp_param.sharded_param)], fsdp_param


class GradUse:
    """Which trainable parameters of an FSDP2 model this rank's backward passes reached in an update.

    FSDP2 is told to reduce-scatter zeros for a parameter without a gradient
    (``set_reduce_scatter_unused_params``), so that a unit's reduce-scatter has the same length on
    every rank; whether a parameter was reached is seen on its unsharded copy (a hook on its
    gradient's accumulation) and travels with the update's riders: a parameter no rank reached gets
    its gradient taken off again (``TorchCollective.sync_sharded``), as a single process would have none.

    What FSDP2 itself cannot do: a *unit* whose forward runs on some ranks and not on others.
    Its parameters are all-gathered when its forward starts, a collective the other ranks never
    join, so a submodule a step may skip must sit inside a unit every rank runs (the root unit:
    ``spotrun.Job(shard=...)`` does not call ``fully_shard`` on it)."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(model, FSDPModule)
        model.set_reduce_scatter_unused_params(True)  # recursive: every unit
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.reached: set[str] = set()
        # The unsharded copies exist from a unit's first all-gather on: gather each unit once, one at a
        # time (never the whole model at once), and free it again. Names are read while sharded.
        records = [(unit, name, fp) for unit, name, fp in _fsdp_params(model) if name in self.names]
        for unit in dict.fromkeys(u for u, _, _ in records):
            unit.unshard()  # type: ignore[operator]
            for name, fp in ((n, f) for u, n, f in records if u is unit):
                fp.unsharded_param.register_post_accumulate_grad_hook(lambda _, name=name: self.reached.add(name))
            unit.reshard()  # type: ignore[operator]

    def take(self) -> list[bool]:
        """The update's mask in the model's order, and a fresh start for the next update."""
        mask = [n in self.reached for n in self.names]
        self.reached = set()
        return mask
