"""Sizes of the benchmark grids, the quick mode that CI uses, and the device of the state dicts.

``BENCH_QUICK=1`` (or pytest's ``--benchmark-disable``, see ``bench/conftest.py``) keeps only the
smallest size of every grid, and a smaller one still for the checkpoint workloads, so each benchmark
runs once and a broken one fails fast; it judges no speed.

``BENCH_DEVICE=cuda`` puts the checkpoint workloads' state dicts on the GPUs (``cuda:<rank>``, nccl),
and adds world size 4 where 4 GPUs are visible; without CUDA those benchmarks skip, saying why. The
default is ``cpu`` (gloo). The other families (state_dict, flat_param, optim_state) measure per-key
Python work on CPU tensors and do not take a device.
"""

from __future__ import annotations

import os

MiB = 1 << 20

#: True when only the smallest size of each grid should run.
QUICK: bool = os.environ.get("BENCH_QUICK", "") not in ("", "0")


def grid(values: list, quick: bool | None = None) -> list:
    """``values``, or only its first (smallest) element in quick mode."""
    return values[:1] if (QUICK if quick is None else quick) else values


#: Bytes of model + Adam state (parameters, exp_avg, exp_avg_sq) of the checkpoint workloads.
CHECKPOINT_SIZES: list[int] = [64 * MiB, 512 * MiB, 2048 * MiB]
#: The one size of the checkpoint workloads in quick mode: every code path of theirs, for less than
#: starting their processes costs.
QUICK_CHECKPOINT_SIZE: int = 4 * MiB
CHECKPOINT_WORLD_SIZES: list[int] = [1, 2]
#: Added to CHECKPOINT_WORLD_SIZES for CUDA state dicts when that many GPUs are visible.
CUDA_EXTRA_WORLD_SIZE = 4

#: The device of the checkpoint workloads' state dicts: ``cpu`` or ``cuda``.
DEVICE: str = os.environ.get("BENCH_DEVICE", "") or "cpu"
#: Number of parameters (= model state dict keys) of the state_dict workloads.
STATE_DICT_KEYS: list[int] = [100, 1_000, 10_000, 100_000]
FLAT_PARAM_COUNTS: list[int] = [100, 1_000, 10_000]
FLAT_PARAM_DEPTHS: list[int] = [1, 4, 16]
OPTIM_STATE_PARAMS: list[int] = [100, 1_000, 10_000]


def checkpoint_sizes(count: int | None = None) -> list[int]:
    """The first ``count`` of :data:`CHECKPOINT_SIZES` (all of them: None), or in quick mode
    :data:`QUICK_CHECKPOINT_SIZE` alone."""
    return [QUICK_CHECKPOINT_SIZE] if QUICK else CHECKPOINT_SIZES[:count]


def size_label(nbytes: int) -> str:
    """``64MB`` / ``2GB``: the label of a checkpoint size in benchmark names and tables."""
    return f"{nbytes // 1024 // MiB}GB" if nbytes >= 1024 * MiB and nbytes % (1024 * MiB) == 0 else f"{nbytes // MiB}MB"


def parse_size(text: str) -> int:
    """``64MB`` / ``2GB`` / a number of bytes: the inverse of :func:`size_label` (1 MB = 2**20 B)."""
    text = text.strip().upper()
    for suffix, scale in (("GB", 1024 * MiB), ("MB", MiB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_unavailable(device: str, world_size: int = 1, *, cuda_devices: int | None = None) -> str | None:
    """None if ``world_size`` ranks can each hold state dicts on ``device`` here, else why not (the skip
    reason). ``cuda_devices`` overrides the count of visible GPUs (tests)."""
    if device == "cpu":
        return None
    if device != "cuda":
        return f"BENCH_DEVICE={device!r} is not a benchmark device: use cpu or cuda"
    visible = _cuda_device_count() if cuda_devices is None else cuda_devices
    if visible == 0:
        return "BENCH_DEVICE=cuda, but no CUDA device is visible here (torch.cuda.is_available() is False)"
    if visible < world_size:
        return f"BENCH_DEVICE=cuda at world size {world_size} needs {world_size} GPUs (one per rank), {visible} visible"
    return None


def checkpoint_world_sizes(device: str, *, cuda_devices: int | None = None) -> list[int]:
    """The checkpoint grid's world sizes for ``device``: 1 and 2, and 4 for CUDA where 4 GPUs are visible."""
    visible = (_cuda_device_count() if cuda_devices is None else cuda_devices) if device == "cuda" else 0
    extra = [CUDA_EXTRA_WORLD_SIZE] if visible >= CUDA_EXTRA_WORLD_SIZE else []
    return CHECKPOINT_WORLD_SIZES + extra


def backend(device: str) -> str:
    """The process-group backend of ranks whose state dicts live on ``device``."""
    return "nccl" if device == "cuda" else "gloo"
