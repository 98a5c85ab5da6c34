"""A causal language model with a real BPE tokenizer, as a spotrun job.

The byte-level BPE (512 tokens) was trained with Hugging Face ``tokenizers`` on the shipped
corpus by ``train_tokenizer.py`` and committed as ``tokenizer.json``; its sha256 is recorded in
every bundle, and a restore with another tokenizer file is refused. The text comes from the
spec's ``data.shards``; spotrun packs it into sequences of ``seq_len + 1`` tokens and saves the
packer's remainder with every bundle.

    spotrun run examples/bpe_lm/bpe_lm.yaml
    spotrun verify examples/bpe_lm/bpe_lm.yaml --kills 6
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import spotrun

TOKENIZER = Path(__file__).resolve().parent / "tokenizer.json"


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))).masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.drop(self.proj((self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.size(1), device=tokens.device))
        return self.head(self.ln(self.blocks(x)))


def next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["inputs"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())


def build(ctx: spotrun.BuildContext) -> spotrun.Job:
    cfg = ctx.config
    tokenizer = spotrun.HFTokenizer(TOKENIZER, eos="<eos>")
    seq_len = cfg.get("seq_len", 48)
    return spotrun.Job(
        model=lambda: TinyGPT(tokenizer.size, seq_len, cfg.get("width", 48), cfg.get("layers", 2), 2,
                              cfg.get("dropout", 0.1)),
        data=spotrun.TokenData(tokenizer, seq_len=seq_len),
        step=next_token_loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 3e-3), weight_decay=0.01),
        scheduler=lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=3e-4),
        ema_decay=0.99,
    )
