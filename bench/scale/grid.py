"""The grid of the scale figures: world sizes, model size, layouts; quick mode keeps the smallest.

``BENCH_QUICK=1`` (``make test``) simulates 64 ranks of a 48-tensor model; the full grid 64 to 16,384
ranks (``python -m bench.scale``, ``make bench``, asv). A world size whose simulation would not fit this
machine's memory is left out by ``--max-items`` (the coordinator holds every rank's plan)."""

from __future__ import annotations

from bench import config

#: World sizes of the full grid; quick mode keeps the first.
WORLD_SIZES: list[int] = [64, 256, 1024, 4096, 16384]
#: Tensors of the model (llama-like, see bench.scale.layouts.model); quick mode's is smaller, since it
#: only checks that every step runs.
TENSORS = 48 if config.QUICK else 200
#: The largest number of local write items (ranks x items per rank) one simulation holds by default:
#: about 1.5 GB for both implementations' plans at once.
MAX_ITEMS = 1_200_000


#: World sizes of ``make bench`` (pytest-benchmark): minutes, not the hour the full grid takes here.
PYTEST_WORLD_SIZES: list[int] = WORLD_SIZES[:3]


def world_sizes(*, pytest: bool = False) -> list[int]:
    """The grid's world sizes (``pytest``: make bench's), or in quick mode the smallest."""
    return config.grid(PYTEST_WORLD_SIZES if pytest else WORLD_SIZES)
