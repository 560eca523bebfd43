"""The axes a test of the suite runs along, as the plugin reads them from the options and a test's
parameters: world sizes (:func:`selected_world_sizes`), the process-group backend of a world size
(:func:`backend_for`), the adapters under test (:func:`impl_specs`, :func:`item_impl`), the value of
``dist`` on the controller (:class:`DistSpec`), and the id a test has wherever the suite is installed
(:func:`suite_test_id`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.adapters.base import SHIPPED, Adapter

__all__ = [
    "CONFORMANCE_DIR", "DistSpec", "selected_world_sizes", "impl_specs", "cuda_count", "backend_for", "item_impl", "item_backend",
    "suite_test_id",
]

#: The directory of the suite (``conformance/``), wherever it is installed.
CONFORMANCE_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class DistSpec:
    """The value the controller holds for ``dist`` until the body runs on the ranks."""

    world_size: int
    backend: str

    def __repr__(self) -> str:
        return f"ws{self.world_size}"


def selected_world_sizes(config: pytest.Config) -> list[int]:
    """The world sizes ``--world-size`` selects (the default when it is not given), sorted, each once; a
    usage error for anything but positive integers. Tests that pick their own world sizes read them here."""
    raw = config.getoption("--world-size")
    try:
        sizes = sorted({int(part) for part in str(raw).split(",") if part.strip()})
    except ValueError:
        raise pytest.UsageError(f"--world-size expects integers like 1,2,4; got {raw!r}") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-size expects positive integers; got {raw!r}")
    return sizes


def impl_specs(config: pytest.Config) -> list[str]:
    """The adapters ``--impl`` names (comma-separated or repeated), each once, in order; every shipped one by default."""
    specs = [s.strip() for opt in config.getoption("--impl") for s in opt.split(",") if s.strip()]
    return list(dict.fromkeys(specs)) or list(SHIPPED)


def cuda_count() -> int:
    """CUDA devices for the ranks: this machine's; under torchrun, how many of the job's first ranks drive one."""
    import torch

    from conformance.harness.torchrun import job_cuda_count

    launched = job_cuda_count()
    if launched is not None:
        return launched

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for(config: pytest.Config, world_size: int) -> str:
    """The backend ``--backend`` gives ``world_size``: ``auto`` is nccl where every rank has a GPU, else gloo."""
    choice = config.getoption("--backend")
    if choice == "auto":
        return "nccl" if cuda_count() >= world_size else "gloo"
    return choice


def item_impl(item: pytest.Item) -> Adapter | None:
    """The adapter a test runs against (its ``impl`` parameter); None for a test without one."""
    callspec = getattr(item, "callspec", None)
    value = callspec.params.get("impl") if callspec is not None else None
    return value if isinstance(value, Adapter) else None


def item_backend(item: pytest.Item) -> str | None:
    """The process-group backend a test runs with; None for a test on the controller."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    spec = callspec.params.get("dist")
    if isinstance(spec, DistSpec):
        return spec.backend
    pair = callspec.params.get("world_size_pair")
    if pair:
        return backend_for(item.config, max(pair))
    return None


def suite_test_id(item: pytest.Item) -> str:
    """The id known-deviation entries and reports use: for a test of the suite,
    ``conformance/<file>::<name>[<params>]`` wherever the suite is (this checkout, or installed and run
    with ``--pyargs conformance`` from any directory); any other test's own node id."""
    path = Path(str(item.path)).resolve()
    if CONFORMANCE_DIR not in path.parents or "::" not in item.nodeid:
        return item.nodeid
    return f"conformance/{path.relative_to(CONFORMANCE_DIR).as_posix()}::{item.nodeid.split('::', 1)[1]}"


