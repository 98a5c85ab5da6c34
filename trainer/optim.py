"""Optimizer, LR schedule and grad scaler, and the optimizer state mapped by parameter *name*.

``torch.optim`` keys its state by the position of a parameter in its groups;
a bundle keys it by name so that a renamed or reordered parameter is caught by
the compatibility check instead of silently receiving another tensor's moments.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from spotrun.trainer.spec import TrainSpec


def build_optimizer(model: nn.Module, spec: TrainSpec) -> tuple[torch.optim.AdamW, list[list[str]]]:
    """AdamW with two groups (decay: matrices; no decay: biases, norms, embeddings' 1-D params)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(name)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": spec.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, foreach=False)
    return opt, [decay, no_decay]


def lr_multiplier(spec: TrainSpec):
    """Linear warmup to ``lr`` then cosine to ``min_lr`` at ``updates``, as a factor of ``lr``."""
    floor = spec.min_lr / spec.lr

    def factor(i: int) -> float:
        if i < spec.warmup_updates:
            return (i + 1) / spec.warmup_updates
        span = max(1, spec.updates - spec.warmup_updates)
        progress = min(1.0, (i - spec.warmup_updates) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(opt: torch.optim.Optimizer, spec: TrainSpec) -> LambdaLR:
    return LambdaLR(opt, lr_multiplier(spec))


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
    index_to_name = {}
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
    name_to_index = {}
    groups = []
    i = 0
    for g in named["param_groups"]:
        idx = list(range(i, i + len(g["params"])))
        name_to_index.update(zip(g["params"], idx))
        groups.append({**g, "params": idx})
        i += len(idx)
    opt.load_state_dict({"state": {name_to_index[n]: s for n, s in named["state"].items()}, "param_groups": groups})
