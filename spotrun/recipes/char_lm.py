"""The built-in job: a character language model on JSONL text, written on spotrun's public API.

A spec without ``job:`` runs this entrypoint. It uses nothing a user's job could not: it reads
its hyperparameters from the spec (``ctx.spec``): the network from ``model``, the vocabulary,
sequence length and masking probability from ``data``, and ``lr``, ``min_lr``,
``warmup_updates``, ``weight_decay``, ``betas`` and ``ema_decay`` from ``train``.

- data: the spec's ``data.shards`` packed into ``seq_len + 1`` character tokens, each input token
  masked with ``data.mask_prob`` (drawn from the occurrence's own generator);
- loss: next-token cross-entropy;
- optimizer: AdamW, weight decay on matrices only;
- schedule: linear warmup to ``lr``, then cosine to ``min_lr`` at the last update;
- an fp32 EMA of the parameters;
- under ``train.parallelism: fsdp``, each transformer block an FSDP2 unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR

import spotrun
from spotrun.recipes.char_models import build_network


def build(ctx: spotrun.BuildContext) -> spotrun.Job:
    spec = ctx.spec
    tokenizer = spotrun.CharTokenizer(spec.data.vocab)
    t = spec.train
    return spotrun.Job(
        model=lambda: build_network(spec.model, tokenizer.size, spec.data.seq_len),
        data=spotrun.TokenData(tokenizer, seq_len=spec.data.seq_len, transform=masking(spec.data.mask_prob)),
        step=next_token_loss,
        optimizer=lambda model: adamw(model, t.lr, t.betas, t.weight_decay),
        scheduler=lambda opt, total: LambdaLR(opt, warmup_cosine(t.lr, t.min_lr, t.warmup_updates, total)),
        ema_decay=t.ema_decay,
        shard=each_block,
    )


def each_block(model: nn.Module, mesh: object) -> None:
    """train.parallelism=fsdp: every transformer block its own FSDP unit (the root holds the rest)."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh)


def next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["inputs"])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch["targets"].reshape(-1))


def masking(prob: float) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None:
    """Each input token but EOS replaced by MASK with ``prob`` (None: no transform)."""
    if prob <= 0:
        return None

    def mask(tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        draw = torch.rand(len(tokens), generator=generator)
        hit = (draw < prob) & (tokens != spotrun.CharTokenizer.EOS)
        return torch.where(hit, torch.full_like(tokens, spotrun.CharTokenizer.MASK), tokens)

    return mask


def adamw(model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW with two groups (decay: matrices; no decay: biases, norms and other 1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=False)


def warmup_cosine(lr: float, min_lr: float, warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup to ``lr`` then cosine to ``min_lr`` at ``total``, as a factor of ``lr``."""
    floor = min_lr / lr

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
