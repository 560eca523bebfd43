"""The axes a test of the suite runs along, as the plugin reads them from the options and a test's
parameters: world sizes (:func:`selected_world_sizes`), the process-group backend of a test
(:func:`item_backend`), the adapters under test (:func:`impl_specs`, :func:`item_impl`), the value of
``dist`` on the controller (:class:`DistSpec`), and the id a test has wherever the suite is installed
(:func:`suite_test_id`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.adapters.base import Adapter
from conformance.harness.config import harness_config

__all__ = [
    "CONFORMANCE_DIR", "DistSpec", "selected_world_sizes", "impl_specs", "item_impl", "item_backend",
    "suite_test_id", "below_the_largest_world_size",
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
    """The world sizes ``--world-size`` selects (the default when it is not given), sorted, each once.
    Tests that pick their own world sizes read them here."""
    return list(harness_config(config).world_sizes)


def impl_specs(config: pytest.Config) -> list[str]:
    """The adapters ``--impl`` names (comma-separated or repeated), each once, in order; every shipped one by default."""
    return list(harness_config(config).impls)


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
        return harness_config(item.config).backend_for(max(pair))
    return None


def below_the_largest_world_size(item: pytest.Item) -> str | None:
    """Why a case marked ``largest_world_size`` is skipped at this item's world size, or None when it
    runs. Such a case (one parameter of a grid whose cost is a process per rank, say) runs at the largest
    selected world size this run can run (the runner has its ranks, nccl a GPU for each) and checks
    there everything it would at a smaller one; under the ``thorough`` hypothesis profile, the suite's
    exhaustive run, it runs at every selected world size. A run that can run one world size runs it there."""
    if item.get_closest_marker("largest_world_size") is None:
        return None
    callspec = getattr(item, "callspec", None)
    spec = callspec.params.get("dist") if callspec is not None else None
    if not isinstance(spec, DistSpec):
        return None
    from hypothesis import settings

    config = harness_config(item.config)
    runnable = [size for size in config.world_sizes if config.can_run(size)]
    if not runnable or spec.world_size >= max(runnable) or settings.get_current_profile_name() == "thorough":
        return None
    return (f"this case runs at the largest world size this run can run ({max(runnable)}), which checks all it would "
            f"check at {spec.world_size}; --hypothesis-profile thorough runs it at every world size")


def suite_test_id(item: pytest.Item) -> str:
    """The id known-deviation entries and reports use: for a test of the suite,
    ``conformance/<file>::<name>[<params>]`` wherever the suite is (this checkout, or installed and run
    with ``--pyargs conformance`` from any directory); any other test's own node id."""
    path = Path(str(item.path)).resolve()
    if CONFORMANCE_DIR not in path.parents or "::" not in item.nodeid:
        return item.nodeid
    return f"conformance/{path.relative_to(CONFORMANCE_DIR).as_posix()}::{item.nodeid.split('::', 1)[1]}"


