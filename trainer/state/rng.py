"""Every global random stream a rank's training can draw from: re-derived per micro-batch, captured.

Python's ``random``, NumPy's legacy global generator, torch's CPU generator and, on a GPU rank,
the generator of the rank's own CUDA device (the only one its training uses). At the start of
every microstep the loop seeds all of them from (seed, update, micro-batch index within the
update's global batch): a micro-batch is the same sequences whatever the world size (rank r,
microstep m trains on block m * world_size + r), so dropout and any other draw of the job's step
are the same for the same data on 2 ranks or on 1. That is what keeps an elastic restart's
parameters *close* with dropout on; only the order of gradient sums changes. The streams are
still captured in every bundle and restored *last* (after the model and loader were built,
because building them draws from these streams too), for whatever draws outside the microsteps.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from spotrun.trainer.job.stateful import check_version


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


class GeneratorMismatch(ValueError):
    """The bundle's CUDA generator states do not fit this rank (the session refuses the bundle with this reason)."""


class RngState:
    """Stateful view of the global streams (it owns no generator itself). ``device``: the rank's device;
    on ``cuda:<i>`` the bundle holds that one device's generator (a list of one state)."""

    VERSION = 1
    STREAMS = ("python", "numpy", "torch_cpu", "torch_cuda")

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state = np.random.get_state(legacy=True)
        if not isinstance(state, tuple):  # a dict only for a bit generator other than the global MT19937
            raise TypeError(f"numpy's global generator is not the legacy MT19937: {type(state).__name__} state")
        name, keys, pos, has_gauss, cached = state
        on_gpu = self.device.startswith("cuda")
        return {
            "version": self.VERSION,
            "python": {"version": version, "internal": list(internal), "gauss": gauss},
            "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch_cpu": _b64(torch.get_rng_state()),
            # the rank's own device only: how many GPUs a node shows a rank is no part of its state
            "torch_cuda": [_b64(torch.cuda.get_rng_state(self.device))] if on_gpu else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every stream; raises :class:`GeneratorMismatch` (before changing any) when a GPU rank
        is given other than one CUDA generator state. A CPU rank ignores CUDA states (a GPU bundle
        restored on CPUs, which the compatibility contract allows only under ``elastic``); a GPU rank
        given none (a CPU bundle) keeps its CUDA generator as seeded, re-seeded per micro-batch anyway."""
        check_version("rng", state, self.VERSION)
        cuda = state["torch_cuda"]
        on_gpu = self.device.startswith("cuda")
        if on_gpu and len(cuda) > 1:
            raise GeneratorMismatch(
                f"the bundle holds {len(cuda)} CUDA generator states, and this rank trains on one GPU "
                f"({self.device}) and restores that one's alone: the bundle was written by an earlier spotrun "
                "that saved the generator of every GPU a rank could see, so which is this rank's is unknown. "
                "Resume it with the spotrun release that wrote it, or start the job afresh under a new job id")
        p = state["python"]
        random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
        n = state["numpy"]
        np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
        torch.set_rng_state(_unb64(state["torch_cpu"]))
        if on_gpu and cuda:
            torch.cuda.set_rng_state(_unb64(cuda[0]), self.device)
