"""The EMA of the parameters: ``ema <- decay * ema + (1 - decay) * param`` for every parameter, in fp32."""

from __future__ import annotations

import torch
from torch import nn

from spotrun.trainer.state.ema import EMA


def _reference(start: dict[str, torch.Tensor], history: list[dict[str, torch.Tensor]], decay: float) -> dict:
    """The same average, written out in float64 one tensor at a time."""
    ema = {n: t.double() for n, t in start.items()}
    for params in history:
        ema = {n: decay * ema[n] + (1 - decay) * params[n].double() for n in ema}
    return ema


def _train_and_check(model: nn.Module, decay: float, steps: int) -> tuple[EMA, dict[str, torch.Tensor]]:
    """Move the parameters ``steps`` times, updating an EMA after each; check it against the formula
    and return it with the last parameters."""
    ema = EMA(model, decay)
    start = {n: t.clone() for n, t in ema.state_dict().items()}
    history = []
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        ema.update(model)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    want = _reference(start, history, decay)
    for n, got in ema.state_dict().items():
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want[n], rtol=1e-6, atol=1e-6)
    return ema, history[-1]


def test_every_parameter_is_averaged_with_the_declared_decay() -> None:
    ema, last = _train_and_check(nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)), 0.9, 6)
    # the average lags the parameters: it is neither the start nor the last weights
    assert all(not torch.equal(ema.shadow[n], last[n]) for n in last)


def test_parameters_below_fp32_are_averaged_in_fp32() -> None:
    model = nn.Linear(6, 6).to(torch.bfloat16)
    _train_and_check(model, 0.99, 4)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the model itself is untouched
