"""Covering arrays of strength 2: a few rows in which every pair of values of any two factors occurs.

A fault that needs two settings together (two options, an option and a kind of input) is met by
some row without running the full product. :func:`pairwise` builds the rows greedily and
deterministically (the same factors give the same rows, in the same order, on every process), under
a constraint on which combinations are valid; :func:`uncovered_pairs` is the check that every pair a
valid row can hold is held by one. Self-tests: ``tests/test_pairwise.py``.

Vocabulary: a *factor* is a name with its values (an option and its settings); a *row* assigns one
value to every factor; a *pair* is two (factor, value) assignments of two different factors. A pair is
*coverable* when some valid row holds it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Row", "Constraint", "pairwise", "coverable_pairs", "uncovered_pairs"]

#: One test case: a value for every factor, in the factors' order.
Row = dict[str, Any]
#: Whether a partial assignment (some factors set, in the factors' order) can still be made valid:
#: it must answer False as soon as the factors it has decide that no valid row contains them.
Constraint = Callable[[Mapping[str, Any]], bool]
#: ``((factor, value index), (factor, value index))``, the first factor before the second in order.
_Pair = tuple[tuple[str, int], tuple[str, int]]


def _valid_everywhere(_: Mapping[str, Any]) -> bool:
    return True


def _check_factors(factors: Mapping[str, Sequence[Any]]) -> None:
    if not factors:
        raise ValueError("pairwise: no factors")
    for name, values in factors.items():
        if not isinstance(name, str):
            raise TypeError(f"pairwise: factor names are str, got {type(name).__name__} {name!r}")
        if len(values) == 0:
            raise ValueError(f"pairwise: factor {name!r} has no values")


def _completes(factors: Mapping[str, Sequence[Any]], fixed: Mapping[str, int], allowed: Constraint) -> dict[str, int] | None:
    """A valid row (value indices) that keeps ``fixed``, the first in factor and value order; None if none."""
    names = list(factors)

    def extend(i: int, partial: dict[str, int]) -> dict[str, int] | None:
        if i == len(names):
            return dict(partial)
        name = names[i]
        choices = [fixed[name]] if name in fixed else range(len(factors[name]))
        for index in choices:
            partial[name] = index
            if allowed({n: factors[n][partial[n]] for n in names[: i + 1]}):
                found = extend(i + 1, partial)
                if found is not None:
                    return found
            del partial[name]
        return None

    return extend(0, {})


def coverable_pairs(factors: Mapping[str, Sequence[Any]], allowed: Constraint | None = None) -> set[_Pair]:
    """Every pair of two factors' values that some valid row holds (by value index)."""
    _check_factors(factors)
    allowed = allowed or _valid_everywhere
    pairs: set[_Pair] = set()
    for first, second in itertools.combinations(factors, 2):
        for i, j in itertools.product(range(len(factors[first])), range(len(factors[second]))):
            if _completes(factors, {first: i, second: j}, allowed) is not None:
                pairs.add(((first, i), (second, j)))
    return pairs


def _pairs_of(row: Mapping[str, int], names: Sequence[str]) -> set[_Pair]:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def pairwise(factors: Mapping[str, Sequence[Any]], allowed: Constraint | None = None) -> list[Row]:
    """Rows (factor -> value, in the factors' order) that together hold every coverable pair, each row
    valid under ``allowed``.

    Greedy, deterministic: each row starts from the first pair not yet held (in factor and value
    order), then gives every other factor, in order, the value that holds the most pairs not yet held
    with the factors set so far, keeping the row completable (ties: the first value). Every row
    holds at least its starting pair, so the loop ends; the size is near the product of the two
    largest factors' sizes, not the product of all."""
    _check_factors(factors)
    allowed = allowed or _valid_everywhere
    names = list(factors)
    if len(names) == 1:
        only = names[0]
        return [{only: value} for value in factors[only] if allowed({only: value})]
    todo = coverable_pairs(factors, allowed)
    order = {name: i for i, name in enumerate(names)}
    rows: list[Row] = []
    while todo:
        (fa, ia), (fb, ib) = min(todo, key=lambda p: (order[p[0][0]], p[0][1], order[p[1][0]], p[1][1]))
        chosen: dict[str, int] = {fa: ia, fb: ib}
        for name in names:
            if name in chosen:
                continue
            best: tuple[int, int] | None = None
            for index in range(len(factors[name])):
                trial = {**chosen, name: index}
                if _completes(factors, trial, allowed) is None:
                    continue
                gain = sum(1 for other, oi in chosen.items()
                           if (((other, oi), (name, index)) if order[other] < order[name] else ((name, index), (other, oi))) in todo)
                if best is None or gain > best[0]:
                    best = (gain, index)
            # Invariant: ``chosen`` can be completed (its starting pair is coverable), so some value keeps it so.
            assert best is not None, f"no value of {name!r} keeps {chosen} completable"
            chosen[name] = best[1]
        row_pairs = _pairs_of(chosen, names)
        assert ((fa, ia), (fb, ib)) in row_pairs, "a row holds its starting pair"
        todo -= row_pairs
        rows.append({name: factors[name][chosen[name]] for name in names})
    return rows


def uncovered_pairs(rows: Sequence[Mapping[str, Any]], factors: Mapping[str, Sequence[Any]],
                    allowed: Constraint | None = None) -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    """The coverable pairs (by value) that no row of ``rows`` holds: empty for a covering array. A row
    that ``allowed`` refuses, or that misses a factor or has a value the factor lacks, is a ValueError."""
    allowed = allowed or _valid_everywhere
    names = list(factors)
    held: set[_Pair] = set()
    for number, row in enumerate(rows):
        if list(row) != names:
            raise ValueError(f"row {number} has factors {list(row)}, expected {names}")
        indices: dict[str, int] = {}
        for name in names:
            matches = [i for i, value in enumerate(factors[name]) if value == row[name] and type(value) is type(row[name])]
            if not matches:
                raise ValueError(f"row {number}: {name}={row[name]!r} is not a value of that factor ({list(factors[name])})")
            indices[name] = matches[0]
        if not allowed(dict(row)):
            raise ValueError(f"row {number} is not valid: {dict(row)}")
        held |= _pairs_of(indices, names)
    missing = sorted(coverable_pairs(factors, allowed) - held, key=lambda p: (names.index(p[0][0]), p[0][1], names.index(p[1][0]), p[1][1]))
    return [((a, factors[a][i]), (b, factors[b][j])) for (a, i), (b, j) in missing]
