"""Hugging Face ``transformers``' GPT-2, built from a config and trained from scratch, as a spotrun job.

Nothing here is written for spotrun beyond :func:`build`: the model is ``transformers``' own
``GPT2LMHeadModel`` (no download: the weights start from ``GPT2Config``'s initialisation), the
schedule is ``transformers``' linear warmup-and-decay, the tokenizer is the byte-level BPE of
``examples/bpe_lm``. GPT-2's dropout draws from the global torch generator, which spotrun seeds
at every micro-batch; its tied embedding and output weights are one parameter; AdamW's moments,
the schedule's position and every generator are in each bundle.

    spotrun run examples/hf_gpt2/hf_gpt2.yaml
    spotrun verify examples/hf_gpt2/hf_gpt2.yaml --kills 4
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import spotrun

TOKENIZER = Path(__file__).resolve().parent.parent / "bpe_lm" / "tokenizer.json"


def next_token_loss(model: GPT2LMHeadModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    # spotrun's batch holds the targets already shifted by one: the logits of every position are scored
    logits = model(input_ids=batch["inputs"]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())


def build(ctx: spotrun.BuildContext) -> spotrun.Job:
    cfg = ctx.config
    tokenizer = spotrun.HFTokenizer(TOKENIZER, eos="<eos>")
    seq_len = cfg.get("seq_len", 48)
    config = GPT2Config(vocab_size=tokenizer.size, n_positions=seq_len, n_embd=cfg.get("width", 64),
                        n_layer=cfg.get("layers", 2), n_head=cfg.get("heads", 2), resid_pdrop=0.1, embd_pdrop=0.1,
                        attn_pdrop=0.1, bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id)
    warmup = cfg.get("warmup", 4)
    return spotrun.Job(
        model=lambda: GPT2LMHeadModel(config),
        data=spotrun.TokenData(tokenizer, seq_len=seq_len),
        step=next_token_loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 1e-3), weight_decay=0.01),
        scheduler=lambda opt, total: get_linear_schedule_with_warmup(opt, warmup, total),
    )
