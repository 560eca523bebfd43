"""The deal of a run into parts (``--shard K/N``, SPEC HX-35) by what each test costs.

Every part computes the same deal from the same whole collection (:func:`deal`): each test goes to
exactly one part, longest first onto the part with the least cost so far, so the parts end at about
the same time however unevenly the expensive tests lie in collection order. What a test costs is read
from a committed table of measured seconds (:data:`COSTS_FILE`, :class:`CostTable`), written by
``python -m tools.shard_costs`` from a run's ``--durations`` output; a test the table does not list
costs what its function's tests usually cost, else the table's default. A missing table makes every
cost equal, which deals by position (round-robin), as a table of equal costs does. Costs decide only
the balance, never which tests run.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["COSTS_FILE", "USUAL", "CostTable", "deal", "deal_together", "load_costs", "split_test_id"]

#: The measured costs the suite ships (package data, so an installed suite deals by them too).
COSTS_FILE = Path(__file__).resolve().with_name("shard_costs.json")


def split_test_id(test_id: str) -> tuple[str, str]:
    """A test id as (its function, ``file::name``; its parameters, the text in its final brackets, ``""``
    for a test without)."""
    if test_id.endswith("]") and "[" in test_id:
        function, _, params = test_id[:-1].partition("[")
        return function, params
    return test_id, ""


#: The key of a function's usual cost: what its tests the table does not list cost.
USUAL = "*"


@dataclass(frozen=True)
class CostTable:
    """Measured seconds per test: ``tests[function][params]`` (see :func:`split_test_id`), where the key
    :data:`USUAL` holds what the function's other tests cost; ``default_s``: a test of a function the
    table does not know."""

    tests: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    default_s: float = 1.0

    def cost(self, test_id: str) -> float:
        """The seconds ``test_id`` is expected to take: its own entry, else its function's usual cost,
        else ``default_s``. Always positive, so that every test weighs in the deal."""
        function, params = split_test_id(test_id)
        measured = self.tests.get(function, {})
        seconds = measured.get(params, measured.get(USUAL, self.default_s))
        return max(seconds, 1e-3)


def load_costs(path: Path = COSTS_FILE) -> CostTable:
    """The table in ``path`` (the format ``tools/shard_costs.py`` writes: ``{"default_s": s, "tests":
    {function: {params or "*": s}}}``); an empty table when there is no such file. A file that is there but
    not such a table raises ValueError naming it."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return CostTable()
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the test costs {path}: {exc}") from None
    try:
        tests = {str(function): {str(p): float(s) for p, s in params.items()} for function, params in raw["tests"].items()}
        return CostTable(tests=tests, default_s=float(raw["default_s"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is not a table of test costs ({type(exc).__name__}: {exc})") from None


def deal(costs: Sequence[float], parts: int) -> list[int]:
    """The part (``0 .. parts - 1``) of each test, given each test's cost in collection order: the
    costliest first (ties: the earlier test first), each onto the part whose tests cost least so far
    (ties: the lower part). Deterministic in ``costs`` alone, every test in exactly one part; equal
    costs deal round-robin by position."""
    loads = [0.0] * parts
    owner = [0] * len(costs)
    for position in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        owner[position] = part
        loads[part] += costs[position]
    return owner


def deal_together(costs: Sequence[float], together: Sequence[Hashable], parts: int) -> list[int]:
    """:func:`deal` of units instead of tests: the tests of one key of ``together`` (one per test, in
    collection order) go to one part, at their summed cost. A key shared by tests that share something
    set up once (a module's fixture) keeps it set up once in the run, not once per part."""
    units: dict[Hashable, list[int]] = {}
    for position, key in enumerate(together):
        units.setdefault(key, []).append(position)
    members = list(units.values())
    unit_owner = deal([sum(costs[i] for i in unit) for unit in members], parts)
    owner = [0] * len(costs)
    for unit, part in zip(members, unit_owner):
        for position in unit:
            owner[position] = part
    return owner
