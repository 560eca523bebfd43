"""Self-tests of conformance/pairwise.py: the rows hold every pair of values a valid row can hold
(checked against the full product, independently of the generator), every row is valid, the rows are
the same on every call, and they stay few."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from conformance.pairwise import pairwise, uncovered_pairs

#: (factors, constraint or None): binary options, mixed sizes, and constraints that rule pairs out.
CASES: dict[str, tuple[dict[str, list[Any]], Any]] = {
    "seven-binary": ({f"o{i}": [False, True] for i in range(7)}, None),
    "mixed-sizes": ({"a": [0, 1, 2], "b": ["x", "y"], "c": [0, 1, 2, 3], "d": [True, False], "e": ["p", "q", "r"]}, None),
    "requires": (  # broadcast needs full, as StateDictOptions says
        {"full": [False, True], "offload": [False, True], "broadcast": [False, True], "flat": [False, True], "sub": ["none", "keep", "strip"]},
        lambda r: not (r.get("broadcast") is True and r.get("full") is False),
    ),
    "excludes-a-pair-and-ties-a-value": (  # a=2 never with b=1; d="v" only with c=0
        {"a": [0, 1, 2], "b": [0, 1], "c": [0, 1], "d": ["u", "v"]},
        lambda r: not (r.get("a") == 2 and r.get("b") == 1) and not (r.get("d") == "v" and r.get("c", 0) != 0),
    ),
    "two-factors": ({"a": [1, 2, 3], "b": [4, 5]}, None),
}


def _valid_rows(factors: Mapping[str, Sequence[Any]], allowed: Any) -> list[dict[str, Any]]:
    rows = [dict(zip(factors, values)) for values in itertools.product(*factors.values())]
    return [r for r in rows if allowed is None or allowed(r)]


def _pairs(row: Mapping[str, Any]) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(row, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_every_pair_a_valid_row_holds_is_held(case: str) -> None:
    factors, allowed = CASES[case]
    rows = pairwise(factors, allowed)
    valid = _valid_rows(factors, allowed)
    assert all(list(r) == list(factors) for r in rows), rows
    assert all(r in valid for r in rows), f"a row the constraint refuses: {[r for r in rows if r not in valid]}"
    wanted = set().union(*(_pairs(r) for r in valid))
    held = set().union(*(_pairs(r) for r in rows))
    assert wanted - held == set(), f"pairs no row holds: {sorted(wanted - held, key=repr)}"
    assert uncovered_pairs(rows, factors, allowed) == []
    assert pairwise(factors, allowed) == rows, "the rows differ from call to call"
    sizes = sorted((len(v) for v in factors.values()), reverse=True)
    assert len(rows) <= 2 * sizes[0] * sizes[1], f"{len(rows)} rows for factors of sizes {sizes}"
    assert len(rows) < math.prod(sizes) or len(factors) == 2


def test_seven_binary_options_take_few_rows() -> None:
    rows = pairwise({f"o{i}": [False, True] for i in range(7)})
    assert len(rows) <= 8, f"{len(rows)} rows for 7 binary factors (the best known array has 6)"


def test_a_pair_no_valid_row_holds_is_not_asked_for() -> None:
    factors = {"broadcast": [False, True], "full": [False, True], "strict": [False, True]}
    allowed = lambda r: not (r.get("broadcast") is True and r.get("full") is False)  # noqa: E731
    rows = pairwise(factors, allowed)
    assert {"broadcast": True, "full": False} not in [{k: r[k] for k in ("broadcast", "full")} for r in rows]
    assert uncovered_pairs(rows, factors, allowed) == []


def test_uncovered_pairs_names_what_is_missing_and_refuses_bad_rows() -> None:
    factors: dict[str, list[Any]] = {"a": [0, 1], "b": ["x", "y"], "c": [True, False]}
    rows = pairwise(factors)
    dropped = rows[0]
    missing = uncovered_pairs(rows[1:], factors)
    assert missing and all(dropped[a] == va and dropped[b] == vb for (a, va), (b, vb) in missing), (dropped, missing)
    with pytest.raises(ValueError, match="is not a value of that factor"):
        uncovered_pairs([{**rows[0], "a": 7}], factors)
    with pytest.raises(ValueError, match="has factors"):
        uncovered_pairs([{"a": 0, "b": "x"}], factors)
    with pytest.raises(ValueError, match="is not valid"):
        uncovered_pairs(rows, factors, lambda r: r.get("a") != 1)


def test_bad_factors_are_errors() -> None:
    with pytest.raises(ValueError, match="no factors"):
        pairwise({})
    with pytest.raises(ValueError, match="'b' has no values"):
        pairwise({"a": [1], "b": []})
    assert pairwise({"a": [1, 2, 3]}) == [{"a": 1}, {"a": 2}, {"a": 3}]
