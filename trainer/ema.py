"""Exponential moving average of the parameters, kept in fp32 beside the model."""

from __future__ import annotations

import torch
from torch import nn

from spotrun.trainer.sharding import local


class EMA:
    """``ema <- decay * ema + (1 - decay) * param`` after every applied update.

    Each shadow tensor is placed like its parameter: sharded under FSDP, so the update needs no
    communication."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone().float() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for n, p in model.named_parameters():
            self.shadow[n].mul_(self.decay).add_(p.detach().float(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) ^ set(state)
        if missing:
            raise ValueError(f"EMA state names differ from the model's: {sorted(missing)}")
        for n, t in state.items():  # a sharded shadow takes the rows this rank holds
            local(self.shadow[n]).copy_(local(t))
