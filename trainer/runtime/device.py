"""Where a rank trains: the GPU Ray assigned to it, or the CPU; and the settings exactness needs there.

A rank given a GPU by Ray (``world.num_gpus_per_rank: 1``) trains on the GPU Ray assigned it,
found by its id: Ray normally sets the actor's ``CUDA_VISIBLE_DEVICES`` to that id alone (the
rank's GPU is then ``cuda:0``), but with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it
leaves the variable as the node had it, and the rank's GPU is wherever the id stands in it (or
physical GPU ``id`` when the variable is unset). The spec admits 0 or 1 GPU per rank: a
fraction would put two ranks on one GPU, which NCCL refuses ("Duplicate GPU detected"), and a
rank trains on one device, so a second GPU would sit idle. A rank that was given a GPU but
whose torch sees no CUDA device (a CPU build of torch on a GPU node, a driver mismatch) is
refused before any update: training silently on the CPU while the GPU idles is the one
outcome a spot user pays for and never sees.

Exactness on a GPU needs deterministic kernels (``torch.use_deterministic_algorithms``, with
``CUBLAS_WORKSPACE_CONFIG`` set before cuBLAS starts: :func:`deterministic_env`, which every
session calls first), cuDNN's autotuner off, and no TF32 unless the spec allows it
(``train.allow_tf32``): TF32 rounds matmul inputs to 10 bits of mantissa, which changes results
from one GPU generation to the next.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from spotrun.trainer.job.contract import JobError


class DeviceError(JobError):
    """The rank cannot train on the device the spec asks for; the message names the node and the fix."""


def select_device(num_gpus_per_rank: float, assigned: Sequence[str], *, cuda_available: bool, device_count: int,
                  node: str, visible: str | None = None) -> str:
    """``"cpu"``, or ``"cuda:<i>"`` for a rank that Ray gave the GPU ids ``assigned``: ``i`` is where
    the first assigned id stands among the ids this process sees (``visible``: its
    ``CUDA_VISIBLE_DEVICES``; unset, every physical GPU by its index)."""
    if num_gpus_per_rank <= 0:
        return "cpu"
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU-only build'})"
    if not assigned:
        raise DeviceError(f"node {node}: world.num_gpus_per_rank={num_gpus_per_rank:g}, but Ray assigned this rank "
                          "no GPU. Start the Ray node with its GPUs (ray start --num-gpus N), or set "
                          "world.num_gpus_per_rank=0 to train on CPUs.")
    if not cuda_available or device_count == 0:
        raise DeviceError(
            f"node {node}: Ray assigned GPU {','.join(assigned)} to this rank, but {build} sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={'(unset)' if visible is None else visible}). spotrun does not train "
            "on the CPU while a GPU is paid for: install a CUDA build of torch that matches the node's driver "
            "(e.g. pip install torch==<version> --index-url https://download.pytorch.org/whl/cu<xx>), or set "
            "world.num_gpus_per_rank=0 to train on CPUs.")
    gpu, shown = assigned[0], "(unset)" if visible is None else visible
    ids = [v.strip() for v in visible.split(",")] if visible is not None else [str(i) for i in range(device_count)]
    if gpu not in ids or ids.index(gpu) >= device_count:
        raise DeviceError(
            f"node {node}: Ray assigned GPU {gpu} to this rank, but this process sees GPUs "
            f"{','.join(ids[:device_count]) or '(none)'} (CUDA_VISIBLE_DEVICES={shown}, "
            f"{device_count} device(s) to torch). Let Ray set CUDA_VISIBLE_DEVICES (unset "
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), or start the Ray node with the same CUDA_VISIBLE_DEVICES "
            "its ranks see.")
    return f"cuda:{ids.index(gpu)}"


def rank_device(num_gpus_per_rank: float, assigned: Sequence[str], node: str) -> str:
    """:func:`select_device` for this process; pins the CUDA device and its deterministic settings."""
    deterministic_env()
    device = select_device(num_gpus_per_rank, assigned, cuda_available=torch.cuda.is_available(),
                           device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0, node=node,
                           visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if device != "cpu":
        torch.cuda.set_device(device)
    return device


CUBLAS_WORKSPACE = ":4096:8"  # one of the two settings cuBLAS documents as giving deterministic GEMMs


def deterministic_env() -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` (unless already set) for deterministic cuBLAS GEMMs.

    cuBLAS reads it once, when the process's first cuBLAS handle is made: set later it is ignored,
    and ``torch.use_deterministic_algorithms`` then makes the first GEMM raise. So every place that
    builds a session or picks a rank's device calls this before anything can touch CUDA; on a CPU
    it is an unread variable."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def set_determinism(threads: int, allow_tf32: bool = False) -> None:
    """Deterministic kernels and a fixed intra-op thread count (reduction order depends on it)."""
    deterministic_env()
    deterministic_algorithms()
    torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = False  # the autotuner may pick another algorithm on another run
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32


def deterministic_algorithms() -> None:
    """What ``torch.use_deterministic_algorithms(True)`` does, without its import of TorchInductor.

    That call imports ``torch._inductor.config`` only to set its ``deterministic`` flag: about
    1.9 s of every rank's start-up, so of every restart, for a compiler most jobs never load.
    Inductor's config reads the flag from ``TORCHINDUCTOR_DETERMINISTIC`` when it is first
    imported, so setting the variable gives a job that compiles later the same flag, and a
    config already imported is set directly. The kernel-level switch is the one the public call
    makes; if a torch release renames it, the public call is used."""
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        setattr(inductor_config, "deterministic", True)  # noqa: B010 (a module found at run time)
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is None:
        torch.use_deterministic_algorithms(True)
    else:
        switch(True, warn_only=False)


def gpu_facts(device: str) -> dict[str, str | None]:
    """The GPU model, and the CUDA runtime, cuDNN, NCCL and driver versions a rank on ``device``
    computes with; all None on the CPU, whose kernels use none of them (nothing here initialises
    CUDA for a CPU rank, even on a machine that has a GPU)."""
    if not device.startswith("cuda"):
        return {"gpu": None, "cuda": None, "cudnn": None, "nccl": None, "driver": None}
    driver = None
    version_file = Path("/proc/driver/nvidia/version")
    if version_file.exists():  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        words = version_file.read_text().split()
        driver = next((w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()), None)
    cudnn = torch.backends.cudnn.version()  # None when this build has no cuDNN
    # a build without NCCL has no version to ask for (torch.cuda.nccl.version() would raise)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch._C, "_nccl_version") else None
    return {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
            "cudnn": None if cudnn is None else str(cudnn), "nccl": nccl, "driver": driver}
