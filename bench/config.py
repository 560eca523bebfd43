"""Sizes of the benchmark grids, and the quick mode that CI uses.

``BENCH_QUICK=1`` (or pytest's ``--benchmark-disable``, see ``bench/conftest.py``) keeps only the
smallest size of every grid, so each benchmark runs once and a broken one fails fast; it judges no speed.
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
CHECKPOINT_WORLD_SIZES: list[int] = [1, 2]
#: Number of parameters (= model state dict keys) of the state_dict workloads.
STATE_DICT_KEYS: list[int] = [100, 1_000, 10_000, 100_000]
FLAT_PARAM_COUNTS: list[int] = [100, 1_000, 10_000]
FLAT_PARAM_DEPTHS: list[int] = [1, 4, 16]
OPTIM_STATE_PARAMS: list[int] = [100, 1_000, 10_000]


def size_label(nbytes: int) -> str:
    """``64MB`` / ``2GB``: the label of a checkpoint size in benchmark names and tables."""
    return f"{nbytes // 1024 // MiB}GB" if nbytes >= 1024 * MiB and nbytes % (1024 * MiB) == 0 else f"{nbytes // MiB}MB"
