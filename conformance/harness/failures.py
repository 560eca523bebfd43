"""How a test failed, as data: one :class:`Failure` per failing rank (or one for the controller).

The rank processes send theirs with the outcome of a task; the plugin adds ranks that died or hung,
checks them against a pinned known deviation (:class:`conformance.harness.xfails.Pin`) and writes
them to ``--report-json``, so that a fork's CI can tell "fails as it always did" from "fails
differently" without parsing tracebacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["Failure", "PropertiesFailed", "DIED", "HUNG"]

#: ``Failure.type`` of a rank that died during the test (its exit code or signal is the message).
DIED = "DIED"
#: ``Failure.type`` of a rank that gave no answer before the rank timeout.
HUNG = "HUNG"


class PropertiesFailed(pytest.fail.Exception):  # type: ignore[name-defined]  # pytest.fail.Exception is the public name of Failed
    """pytest's ``Failed`` for a test that checked several properties and saw some fail: one message
    per failed property in ``parts`` (each becomes its own :class:`Failure`, so that a pin on one
    property does not hide another). Reported under the name ``Failed``, as any assertion of the suite."""

    def __init__(self, parts: Sequence[str]) -> None:
        super().__init__("\n".join(parts), pytrace=False)
        self.parts = list(parts)


@dataclass(frozen=True)
class Failure:
    """One rank's failure (``rank`` None: the test failed on the controller).

    ``type`` is the exception's class name (``Failed`` for an assertion of the suite, the
    implementation's own class otherwise, :data:`DIED` or :data:`HUNG`); ``types`` its class names
    along the MRO, so that a pin may name a base class; ``message`` its text (``str(exc)``, or the
    suite's failure message)."""

    rank: int | None
    type: str
    message: str
    types: tuple[str, ...] = ()

    @classmethod
    def of(cls, exc: BaseException, rank: int | None) -> Failure:
        msg = getattr(exc, "msg", None)  # pytest's outcome exceptions keep their text in .msg
        message = msg if isinstance(msg, str) else str(exc)
        names = tuple(c.__name__ for c in type(exc).__mro__ if c is not object)
        return cls(rank=rank, type=type(exc).__name__, message=message, types=names)

    @classmethod
    def all_of(cls, exc: BaseException, rank: int | None) -> list[Failure]:
        """The failures ``exc`` stands for: one per property that failed when the test checked several
        with :func:`conformance.asserts.check_each` (its ``parts``), else one."""
        if isinstance(exc, PropertiesFailed) and exc.parts:
            names = tuple(c.__name__ for c in type(exc).__mro__ if c is not object)
            return [cls(rank=rank, type="Failed", message=part, types=names) for part in exc.parts]
        return [cls.of(exc, rank)]

    def is_a(self, name: str) -> bool:
        """Whether the exception is of class ``name`` (its own class or a base class)."""
        return name == self.type or name in self.types

    def headline(self, width: int = 200) -> str:
        """``rank 1: ValueError: first line of the message`` (``controller:`` without a rank)."""
        where = "controller" if self.rank is None else f"rank {self.rank}"
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > width:
            first = first[: width - 3] + "..."
        return f"{where}: {self.type}: {first}"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "type": self.type, "message": self.message}
