"""The state labs: the two instruments of the reference texts, as pure functions.

Each returns its whole history, not only the visible state: the lesson of both
is that the visible state alone does not tell you everything a restart needs.
The labs page draws them; ``/api/labs/...`` answers with the same dicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MAX_STEPS = 1000

MODULAR_NOTE = ("Shows that one visible residue stands for many histories (with m=8, a=3 the residue is 1 "
                "after 3 and after 11 additions), so saving only the visible state cannot tell them apart; "
                "it does not model a real random generator, a data loader or a checkpoint.")
DESCENT_NOTE = ("Shows that the next value depends on the transition rule (η) as well as on the current x, "
                "so the rule belongs in a recovery specification; it has no optimizer moments, checkpoint "
                "files, sampler or mixed-precision scaler, which a real inventory must cover separately.")


class LabError(ValueError):
    """A parameter out of range: the API answers 422 with this message."""


def _steps(steps: int) -> int:
    if not 0 <= steps <= MAX_STEPS:
        raise LabError(f"steps must be between 0 and {MAX_STEPS}")
    return steps


def _prediction(history: Sequence[float], at: int | None, value: float | None) -> dict[str, Any] | None:
    """Compare a predicted value at step ``at`` with the history, once the history reaches it."""
    if at is None or value is None:
        return None
    if at < 0:
        raise LabError("a prediction is for step 0 or later")
    if at >= len(history):
        return {"at": at, "value": value, "actual": None, "matches": None}
    actual = history[at]
    return {"at": at, "value": value, "actual": actual,
            "matches": math.isclose(value, actual, rel_tol=1e-9, abs_tol=1e-12)}


def modular(m: int, a: int, steps: int, predict_at: int | None = None,
            predict: float | None = None) -> dict[str, Any]:
    """Residues r_k = (k·a) mod m for k = 0..steps: r_0 = 0, then one addition of ``a`` per step."""
    if not 1 <= m <= 1_000_000:
        raise LabError("m must be between 1 and 1000000")
    history = [0]
    for _ in range(_steps(steps)):
        history.append((history[-1] + a) % m)
    return {"lab": "modular", "m": m, "a": a, "step": steps, "state": history[-1], "history": history,
            "prediction": _prediction(history, predict_at, predict), "note": MODULAR_NOTE}


def descent(eta: float, x0: float, steps: int, predict_at: int | None = None,
            predict: float | None = None) -> dict[str, Any]:
    """Gradient descent on the fixed quadratic f(x) = x²/2: x_{k+1} = x_k − η·f'(x_k) = x_k − η·x_k."""
    if not (math.isfinite(eta) and math.isfinite(x0) and abs(x0) <= 1e6 and abs(eta) <= 100):
        raise LabError("η must be a number in [-100, 100] and x₀ one in [-1e6, 1e6]")
    history = [x0]
    for _ in range(_steps(steps)):
        x = history[-1] - eta * history[-1]
        if not math.isfinite(x * x / 2):
            raise LabError(f"the iterate overflowed after {len(history) - 1} steps (η too large)")
        history.append(x)
    return {"lab": "descent", "eta": eta, "x0": x0, "step": steps, "state": history[-1], "history": history,
            "f": [x * x / 2 for x in history], "prediction": _prediction(history, predict_at, predict),
            "note": DESCENT_NOTE}
