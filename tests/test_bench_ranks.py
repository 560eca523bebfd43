"""Self-tests of the benchmarks' shared rank groups (:mod:`bench.ranks`): which ranks a figure is measured on.

A stand-in for :class:`~bench.ranks.RankGroup` records the groups started, so these check the sharing
rules without starting ranks."""

from __future__ import annotations

from typing import Any

import pytest

from bench import config, ranks


class FakeGroup:
    started: list[FakeGroup] = []

    def __init__(self, world_size: int, *, backend: str = "gloo") -> None:
        self.world_size, self.backend, self.closed = world_size, backend, False
        FakeGroup.started.append(self)

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@pytest.fixture
def fake_groups(monkeypatch: pytest.MonkeyPatch) -> list[FakeGroup]:
    monkeypatch.setattr(ranks, "RankGroup", FakeGroup)
    monkeypatch.setattr(ranks, "_SHARED", {})
    FakeGroup.started = []
    return FakeGroup.started


def test_a_shared_group_is_reused_until_closed_and_replaced_once_gone(fake_groups: list[FakeGroup]) -> None:
    first = ranks.shared_group(2)
    assert fake_groups == [first] and ranks.shared_group(2) is first and ranks.shared_group(2, backend="gloo") is first
    assert ranks.shared_group(1) is not first and ranks.shared_group(2, backend="nccl") is not first  # one per (size, backend)
    fake_groups[0].closed = True  # its ranks were killed: a rank did not answer
    second = ranks.shared_group(2)
    assert second is not first and len(fake_groups) == 4
    ranks.close_shared_groups()
    assert all(group.closed for group in fake_groups)
    assert ranks.shared_group(2) is not second


def test_a_grid_measures_on_ranks_of_its_own_unless_quick(fake_groups: list[FakeGroup], monkeypatch: pytest.MonkeyPatch) -> None:
    """A measuring run: each grid starts its ranks and closes them, so no other grid's leftovers are in
    its figures. Quick mode: the shared group, left open for the next grid and the pytest benchmarks."""
    monkeypatch.setattr(config, "QUICK", False)
    shared = ranks.shared_group(2)
    with ranks.measuring_group(2) as group:
        assert group is not shared and not group.closed
    assert group.closed and not shared.closed
    monkeypatch.setattr(config, "QUICK", True)
    with ranks.measuring_group(2) as quick:
        assert quick is shared
    assert not shared.closed
    ranks.close_shared_groups()
