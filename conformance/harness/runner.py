"""What runs a rank test's body: the :class:`Runner` protocol the plugin codes against, and what one run
of a body on the ranks returns (:class:`RankRun`).

Two implementations: :class:`conformance.harness.pool.PoolRunner` (the suite's own rank processes,
a pool per world size and backend) and :class:`conformance.harness.torchrun.TorchrunRunner` (the ranks
of a job ``torchrun`` or ``srun`` launched, every one a pytest process). The plugin chooses one at
configure and never asks which it has: what differs (whether a crash is contained, what follows a
hung rank) is a property of the runner.

Call order, on the pytest process (under torchrun: on every rank, in the same order)::

    runner.run(world_size, backend, fn, args, kwargs, tmp_dir=..., timeout_s=...)   # per test phase
    ...
    runner.stop()                                                                   # at session end

``run`` starts the ranks of ``world_size`` when none are up (a pool is spawned; a torchrun job forms
the default group of its first ``world_size`` ranks), runs ``fn`` on every one of them, collects every
rank's :class:`~conformance.harness.worker.RankOutcome` and output, and cuts a rank still running after
``timeout_s`` (reported in :attr:`RankRun.hung` with its Python stack as its output). A run with a dead
or hung rank leaves the runner ready for the next test (a fresh pool, a group made anew) or ends the
job, as :meth:`Runner.after_unhealthy_run` says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from conformance.harness.worker import RankOutcome

__all__ = ["Runner", "RankRun", "RanksNotStarted", "FAILURE_GRACE_S"]

#: After the first rank fails, how long the others get to finish before they count as hung.
FAILURE_GRACE_S = 10.0


class RanksNotStarted(RuntimeError):
    """The ranks of a world size could not form a process group (the test fails with this message)."""


@dataclass
class RankRun:
    """Everything observed on the ranks for one body."""

    world_size: int
    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    output: dict[int, str] = field(default_factory=dict)
    #: rank -> exit code (negative: the signal) of ranks that died during the body; None where the
    #: runner cannot see it (torchrun: only the launcher does)
    died: dict[int, int | None] = field(default_factory=dict)
    #: ranks that neither answered nor died by the deadline (their stacks are in ``output``)
    hung: list[int] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.died and not self.hung


class Runner(Protocol):
    """Runs test bodies on ranks, for one pytest session."""

    #: Whether a rank's crash is contained: the next test runs on fresh ranks (a pool), so a crash may
    #: be run again (``--rerun-crashes``); False where a dead rank ends the run (torchrun).
    contains_crashes: bool

    def run(
        self,
        world_size: int,
        backend: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        tmp_dir: str,
        timeout_s: float,
    ) -> RankRun:
        """Run ``fn(*args, **kwargs)`` on ranks ``0 .. world_size - 1`` (each
        :data:`~conformance.harness.worker.DIST_ARG` replaced by the rank's
        :class:`~conformance.rank_context.RankContext`) and return what each rank did; a rank past
        ``timeout_s`` is cut and reported hung. Raises :class:`RanksNotStarted` when the ranks cannot
        form their group."""
        ...

    def after_unhealthy_run(self) -> str:
        """What follows a run with a hung or dead rank (a line of the test's failure)."""
        ...

    def stop(self) -> None:
        """Tear down every rank this runner started (idempotent; also called at exit)."""
        ...
