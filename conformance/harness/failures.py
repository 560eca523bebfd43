"""How a test failed, as data: one :class:`Failure` per failing rank (or one for the controller).

The rank processes send theirs with the outcome of a task; the plugin adds ranks that died or hung,
checks them against a pinned known deviation (:class:`conformance.harness.xfails.Pin`) and writes
them to ``--report-json``, so that a fork's CI can tell "fails as it always did" from "fails
differently" without parsing tracebacks.

A failure belongs to a *clause* of SPEC.md (``ML-13.b``): the clause the assertion named
(:func:`conformance.asserts.clause`, :func:`conformance.asserts.check_each`), else the requirement the
test names (its ``req`` IDs joined by ``+`` when it names several). A known deviation pins clauses, not
message text, so rewording an assertion never changes what a pin accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

__all__ = ["Failure", "PropertiesFailed", "DIED", "HUNG", "CLAUSE_ATTR", "clause_of"]

#: ``Failure.type`` of a rank that died during the test (its exit code or signal is the message).
DIED = "DIED"
#: ``Failure.type`` of a rank that gave no answer before the rank timeout.
HUNG = "HUNG"
#: The attribute :func:`conformance.asserts.clause` sets on an exception: the clause ID it failed.
CLAUSE_ATTR = "sdc_clause"


def clause_of(exc: BaseException) -> str | None:
    """The clause ID ``exc`` was raised under (None: outside any clause)."""
    value = getattr(exc, CLAUSE_ATTR, None)
    return value if isinstance(value, str) else None


class PropertiesFailed(pytest.fail.Exception):  # type: ignore[name-defined]  # pytest.fail.Exception is the public name of Failed
    """pytest's ``Failed`` for a test that checked several clauses and saw some fail: ``parts`` holds
    (clause ID, message) per failed clause (each becomes its own :class:`Failure`, so that a pin on one
    clause does not hide another). Reported under the name ``Failed``, as any assertion of the suite."""

    def __init__(self, parts: Sequence[tuple[str | None, str]]) -> None:
        super().__init__("\n".join(f"[{clause}] {text}" if clause else text for clause, text in parts), pytrace=False)
        self.parts = list(parts)


@dataclass(frozen=True)
class Failure:
    """One rank's failure (``rank`` None: the test failed on the controller).

    ``type`` is the exception's class name (``Failed`` for an assertion of the suite, the
    implementation's own class otherwise, :data:`DIED` or :data:`HUNG`); ``types`` its class names
    along the MRO, so that a pin may name a base class; ``message`` its text (``str(exc)``, or the
    suite's failure message); ``clause`` the SPEC clause it failed (None: no clause known yet, or a rank
    that died or hung; :meth:`in_clause` fills the test's default)."""

    rank: int | None
    type: str
    message: str
    types: tuple[str, ...] = ()
    clause: str | None = None

    @classmethod
    def of(cls, exc: BaseException, rank: int | None) -> Failure:
        msg = getattr(exc, "msg", None)  # pytest's outcome exceptions keep their text in .msg
        message = msg if isinstance(msg, str) else str(exc)
        names = tuple(c.__name__ for c in type(exc).__mro__ if c is not object)
        return cls(rank=rank, type=type(exc).__name__, message=message, types=names, clause=clause_of(exc))

    @classmethod
    def all_of(cls, exc: BaseException, rank: int | None) -> list[Failure]:
        """The failures ``exc`` stands for: one per clause that failed when the test checked several
        with :func:`conformance.asserts.check_each` (its ``parts``), else one."""
        if isinstance(exc, PropertiesFailed) and exc.parts:
            names = tuple(c.__name__ for c in type(exc).__mro__ if c is not object)
            return [
                cls(rank=rank, type="Failed", message=f"[{clause}] {text}" if clause else text, types=names, clause=clause or clause_of(exc))
                for clause, text in exc.parts
            ]
        return [cls.of(exc, rank)]

    def in_clause(self, default: str | None) -> Failure:
        """This failure, with ``default`` as its clause where it named none (a rank that died or hung
        failed no clause: it keeps None)."""
        if self.clause is not None or default is None or self.type in (DIED, HUNG):
            return self
        return replace(self, clause=default)

    def is_a(self, name: str) -> bool:
        """Whether the exception is of class ``name`` (its own class or a base class)."""
        return name == self.type or name in self.types

    def headline(self, width: int = 200) -> str:
        """``rank 1: [ML-13.b] ValueError: first line of the message`` (``controller:`` without a rank;
        no brackets without a clause)."""
        where = ("controller" if self.rank is None else f"rank {self.rank}") + (f" [{self.clause}]" if self.clause else "")
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > width:
            first = first[: width - 3] + "..."
        return f"{where}: {self.type}: {first}"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "type": self.type, "message": self.message, "clause": self.clause}
