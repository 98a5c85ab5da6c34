"""Every GPU check in one run, on a machine with a CUDA device: tests, a verify with kills, the stall.

    python -m bench.gpu_check            # prints one table; exits 1 if a check failed

1. ``pytest -m gpu``: a rank trains on its GPU, the bundle names the GPU, the capture goes through
   pinned buffers on a side stream, restarts are bitwise in fp32, bf16 and fp16 (tests/gpu/).
2. ``spotrun verify configs/tiny.yaml --no-ray --kills 4`` with ``world.num_gpus_per_rank=1``: the
   contract on one GPU rank (one GPU machine: multi-rank NCCL cannot run there).
3. The checkpoint stall from GPU memory against a synchronous ``torch.save`` (+ fsync) of the same
   GPU state, in this process, at ~100 MB and ~1 GB of training state (parameters, EMA, AdamW's
   two moments): 3 repetitions each, min / median / max.

Without CUDA it says so and exits 2: nothing here can be measured on a CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.synthetic import layers_for
from bench.tables import ROOT, Table

REPS = 3
SIZES = (("~100 MB", 1024, 100e6), ("~1 GB", 2048, 1e9))


def run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - t0


def gpu_state(n_embd: int, state_bytes: float, root: Path):
    from spotrun.orchestrator.control.specfile import load_spec
    from spotrun.trainer.run.session import TrainSession

    spec = load_spec(ROOT / "configs/tiny.yaml", [
        f"storage=file://{root}", f"data.shards={ROOT / 'configs/data/tiny'}", "model.kind=factory",
        "model.factory=bench.synthetic:linear_stack", f"model.n_embd={n_embd}",
        f"model.n_layer={layers_for(int(state_bytes), n_embd)}", "world.num_gpus_per_rank=1"], "gpu-stall")
    state = TrainSession(spec, device="cuda:0").state
    for p in state.model.parameters():  # one step allocates AdamW's moments, as in a job past update 1
        p.grad = torch.zeros_like(p)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return state


def stall(label: str, n_embd: int, state_bytes: float, folder: Path) -> list[str]:
    state = gpu_state(n_embd, state_bytes, folder)
    nbytes = sum(t.numel() * t.element_size() for t in state.model.state_dict().values()) * 4
    state.capture().wait()  # the first capture allocates the pinned buffers: not a steady-state figure
    stalls, landed, syncs = [], [], []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cap = state.capture()  # what the loop waits for: the copies are only issued
        stalls.append(time.perf_counter() - t0)
        cap.wait()
        landed.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        path = folder / "sync.pt"
        with open(path, "wb") as f:
            torch.save({"model": state.model.state_dict(), "ema": state.ema.state_dict(),
                        "optimizer": state.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        syncs.append(time.perf_counter() - t0)
    s, land, sync = (statistics.median(x) for x in (stalls, landed, syncs))
    return [label, f"{nbytes / 1e6:.0f} MB", f"{min(stalls) * 1e3:.2f} / {s * 1e3:.2f} / {max(stalls) * 1e3:.2f}",
            f"{land * 1e3:.1f}", f"{sync * 1e3:.0f}", f"{100 * s / sync:.2f} %"]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU checks need one (this machine's torch sees none)")
        return 2
    name = torch.cuda.get_device_name(0)
    rows: list[list[str]] = []
    ok = True
    code, out, sec = run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], 1200)
    rows.append(["pytest -m gpu", "pass" if code == 0 else "FAIL", out.strip().splitlines()[-1], f"{sec:.0f}"])
    ok &= code == 0
    with tempfile.TemporaryDirectory() as d:
        code, out, sec = run([sys.executable, "-m", "spotrun", "verify", "configs/tiny.yaml", "--no-ray",
                              "--kills", "4", "--json", "--set", f"storage=file://{d}",
                              "--set", "world.num_gpus_per_rank=1", "--set", "train.updates=24",
                              "--set", "checkpoint.every_updates=3"], 1200)
    try:
        rep = json.loads(out[out.index("{"):out.rindex("}") + 1])
        detail = (f"{rep['verdict']}, {rep['observed_contract']}, {rep['faults_delivered']} of "
                  f"{rep['faults_planned']} faults delivered, bitwise {rep['params_bitwise_equal']}")
    except ValueError:
        detail = out.strip().splitlines()[-1] if out.strip() else "no output"
    rows.append(["verify --no-ray --kills 4 (1 GPU rank)", "pass" if code == 0 else "FAIL", detail, f"{sec:.0f}"])
    ok &= code == 0
    checks = Table(f"GPU checks on {name} (torch {torch.__version__}, CUDA {torch.version.cuda})",
                   ["check", "result", "detail", "seconds"], rows)
    checks.print()
    stall_table = Table(f"checkpoint stall from GPU memory on {name}: capture (copies issued on a side stream into "
                        "pinned buffers) vs a synchronous torch.save + fsync of the same GPU state",
                        ["state", "bytes", "stall ms min / median / max", "copies landed ms (median)",
                         "torch.save ms (median)", "stall / save"])
    with tempfile.TemporaryDirectory(dir=ROOT) as d:
        for label, n_embd, size in SIZES:
            stall_table.rows.append(stall(label, n_embd, size, Path(d)))
    stall_table.print()
    print(checks.markdown() + "\n" + stall_table.markdown())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
