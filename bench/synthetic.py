"""A model of a chosen size for the stall bench (``model.kind: factory``).

``n_layer`` square linear layers of width ``n_embd`` between an embedding and
a head: parameters ~ ``n_layer * n_embd**2``, so the whole training state
(parameters, EMA, and AdamW's two moments: four fp32 copies) is about
``16 * n_layer * n_embd**2`` bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.job.sections import ModelSpec
from spotrun.trainer.run.session import TrainSession

ROOT = Path(__file__).resolve().parent.parent


class LinearStack(nn.Module):
    def __init__(self, vocab_size: int, n_embd: int, n_layer: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.ModuleList(nn.Linear(n_embd, n_embd) for _ in range(n_layer))
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def linear_stack(spec: ModelSpec, vocab_size: int) -> nn.Module:
    return LinearStack(vocab_size, spec.n_embd, spec.n_layer)


def layers_for(state_bytes: int, n_embd: int) -> int:
    """Layers of width ``n_embd`` whose four fp32 copies come closest to ``state_bytes``."""
    per_layer = 16 * (n_embd * n_embd + n_embd)
    return max(1, round(state_bytes / per_layer))


def synthetic_session(n_embd: int, state_bytes: float, storage: Path, job_id: str, *sets: str, rank: int = 0,
                      world_size: int = 1) -> TrainSession:
    """A real session (model, EMA, AdamW with its moments allocated, as in a job past update 1) over the
    linear stack whose training state is about ``state_bytes``; ``sets`` are further spec overrides."""
    spec = load_spec(ROOT / "configs/tiny.yaml", [
        f"storage=file://{storage}", f"data.shards={ROOT / 'configs/data/tiny'}", "model.kind=factory",
        "model.factory=bench.synthetic:linear_stack", f"model.n_embd={n_embd}",
        f"model.n_layer={layers_for(int(state_bytes), n_embd)}", *sets], job_id)
    session = TrainSession(spec, rank=rank, world_size=world_size)
    state = session.state
    for p in state.model.parameters():
        p.grad = torch.zeros_like(p)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return session
