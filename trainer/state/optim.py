"""The grad scaler, and the optimizer state mapped by parameter *name*.

``torch.optim`` keys its state by the position of a parameter in its groups;
a bundle keys it by name so that a renamed or reordered parameter is caught by
the compatibility check instead of silently receiving another tensor's moments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spotrun.trainer.job.sections import TrainSpec


def group_names(opt: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    """The parameter *names* of each of ``opt``'s groups (what a bundle keys the state by)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = []
    for i, g in enumerate(opt.param_groups):
        missing = [tuple(p.shape) for p in g["params"] if id(p) not in name_of]
        if missing:
            raise ValueError(f"optimizer group {i} holds parameters that are not the model's (shapes {missing}); "
                             "build the optimizer from the model it is given")
        names.append([name_of[id(p)] for p in g["params"]])
    return names


def build_scaler(spec: TrainSpec, device: str) -> torch.amp.GradScaler:
    """A real scaler for fp16; a disabled (pass-through, empty-state) one otherwise."""
    return torch.amp.GradScaler(
        device,
        init_scale=spec.grad_scaler.init_scale,
        growth_interval=spec.grad_scaler.growth_interval,
        enabled=spec.precision == "fp16",
    )


def named_state(opt: torch.optim.Optimizer, group_names: list[list[str]]) -> dict[str, Any]:
    """``opt.state_dict()`` with positions replaced by parameter names."""
    sd = opt.state_dict()
    index_to_name: dict[int, str] = {}
    groups = []
    for g, names in zip(sd["param_groups"], group_names, strict=True):
        index_to_name.update(zip(g["params"], names, strict=True))
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(names)})
    state = {index_to_name[i]: dict(s) for i, s in sd["state"].items()}
    return {"version": 1, "param_groups": groups, "state": state}


def load_named_state(opt: torch.optim.Optimizer, group_names: list[list[str]], named: dict[str, Any]) -> None:
    saved = [g["params"] for g in named["param_groups"]]
    if saved != group_names:
        raise ValueError(f"optimizer groups differ: bundle has {saved}, this model has {group_names}")
    name_to_index: dict[str, int] = {}
    groups = []
    i = 0
    for g in named["param_groups"]:
        idx = list(range(i, i + len(g["params"])))
        name_to_index.update(zip(g["params"], idx, strict=True))
        groups.append({**g, "params": idx})
        i += len(idx)
    opt.load_state_dict({"state": {name_to_index[n]: s for n, s in named["state"].items()}, "param_groups": groups})
