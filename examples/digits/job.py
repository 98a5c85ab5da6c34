"""An image classifier on a map-style dataset with random augmentation, as a spotrun job.

scikit-learn's digits (1,797 8x8 images, shipped inside the package: no download), a small CNN
with dropout, SGD with momentum and a one-cycle schedule. The augmentation (a random shift of up
to one pixel and a little noise) draws only from the generator spotrun passes, so it is the same
for an occurrence whichever worker, rank or attempt makes it.

    spotrun run examples/digits/digits.yaml
    spotrun verify examples/digits/digits.yaml --kills 6
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import spotrun


class Digits(torch.utils.data.Dataset):
    """The first ``train_fraction`` of scikit-learn's digits as (image [1, 8, 8] in [0, 1], label)."""

    def __init__(self, train_fraction: float = 0.8) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        n = int(len(d.target) * train_fraction)
        self.images = torch.tensor(d.images[:n], dtype=torch.float32).unsqueeze(1) / 16.0
        self.labels = torch.tensor(d.target[:n], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def augment(sample: tuple[torch.Tensor, torch.Tensor], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift by -1..1 pixels in each direction (zero fill) and add a little noise."""
    image, label = sample
    dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=g))
    shifted = torch.zeros_like(image)
    src = image[:, max(0, -dy):8 - max(0, dy), max(0, -dx):8 - max(0, dx)]
    shifted[:, max(0, dy):max(0, dy) + src.shape[1], max(0, dx):max(0, dx) + src.shape[2]] = src
    return (shifted + 0.05 * torch.randn(image.shape, generator=g)).clamp(0, 1), label


class SmallCNN(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.head(self.drop(x.flatten(1)))


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    images, labels = batch
    logits = model(images)
    accuracy = (logits.argmax(1) == labels).float().mean()
    return F.cross_entropy(logits, labels), {"accuracy": float(accuracy)}


def build(ctx: spotrun.BuildContext) -> spotrun.Job:
    cfg = ctx.config
    return spotrun.Job(
        model=lambda: SmallCNN(cfg.get("dropout", 0.25)),
        data=spotrun.MapData(Digits(), transform=augment, version="sklearn-digits-train-0.8"),
        step=step,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.3), momentum=0.9),
        scheduler=lambda opt, total: torch.optim.lr_scheduler.OneCycleLR(opt, cfg.get("lr", 0.3), total_steps=total),
    )
