"""A loss with auxiliary state that differs between ranks, registered so that it restores exactly.

A classifier of points from K Gaussian clusters, read from an endless stateful stream
(``spotrun.StreamData``), trained with cross-entropy weighted by class balance plus a *center
loss*: each feature is pulled toward its class's center. Two objects outside the model shape
every later update, and each rank keeps its own copy, updated from its own micro-batches only:

- ``centers``: the center bank, moved toward each class's mean feature after every micro-batch;
- ``seen``: how many examples of each class this rank has seen (the class-balance weights).

Both are registered in ``spotrun.Job(state=...)``, so every bundle holds each rank's copy and a
restore puts it back; ``spotrun verify --mutate state:centers`` proves that losing one is caught.

    spotrun run examples/center_loss/center_loss.yaml
    spotrun verify examples/center_loss/center_loss.yaml --kills 6
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import spotrun

CLASSES, DIM, FEATURES = 4, 16, 8


class ClusterStream:
    """Endless (point, class) pairs; element n is a function of (seed, n) only, so the position is the state."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.means = torch.randn(CLASSES, DIM, generator=g) * 2
        self.seed, self.pos = seed, 0

    def __iter__(self) -> ClusterStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 7_919 + self.pos)
        # an unbalanced stream: class 0 twice as often as the others
        label = int(torch.multinomial(torch.tensor([2.0, 1.0, 1.0, 1.0]), 1, generator=g))
        self.pos += 1
        return self.means[label] + torch.randn(DIM, generator=g), torch.tensor(label)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])


class CenterBank:
    """Per-class feature centers, moved toward each micro-batch's class means (no gradient)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.centers = torch.zeros(CLASSES, FEATURES)

    @torch.no_grad()
    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        for c in labels.unique():
            self.centers[c] += self.rate * (features[labels == c].mean(0) - self.centers[c])

    def state_dict(self) -> dict[str, Any]:
        return {"centers": self.centers.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.centers.copy_(state["centers"])


class ClassCounts:
    """Examples of each class seen so far; the loss weighs classes by the inverse of their share."""

    def __init__(self) -> None:
        self.counts = torch.ones(CLASSES)

    def weights(self) -> torch.Tensor:
        return self.counts.sum() / (CLASSES * self.counts)

    def add(self, labels: torch.Tensor) -> None:
        self.counts += torch.bincount(labels, minlength=CLASSES).float()

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = torch.tensor(state["counts"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, FEATURES))
        self.head = nn.Linear(FEATURES, CLASSES)


def build(ctx: spotrun.BuildContext) -> spotrun.Job:
    centers, seen = CenterBank(ctx.config.get("center_rate", 0.3)), ClassCounts()
    weight = ctx.config.get("center_weight", 0.1)

    def step(model: Net, batch: tuple[torch.Tensor, torch.Tensor]):
        x, y = batch
        features = model.encoder(x)
        ce = F.cross_entropy(model.head(features), y, weight=seen.weights())
        pull = (features - centers.centers[y]).pow(2).sum(1).mean()
        centers.update(features.detach(), y)
        seen.add(y)
        return ce + weight * pull, {"center_loss": float(pull.detach())}

    return spotrun.Job(
        model=Net,
        data=spotrun.StreamData(ClusterStream(ctx.seed)),
        step=step,
        optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=ctx.config.get("lr", 0.01)),
        state={"centers": centers, "seen": seen},
    )
