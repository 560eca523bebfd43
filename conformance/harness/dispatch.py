"""Running a rank test's body on the ranks and judging what they did, for the hooks of
:mod:`conformance.harness.plugin`: what the plugin keeps for one session (:class:`Session`, under
:data:`SESSION`) and for one test (its known deviation, its ranks' failures, its crashes), the clause a
failure is counted under (the test's requirement IDs), a run on the session's runner and its verdict
(:func:`run_on_ranks`, :func:`judge`, :func:`rank_failures`), the crashes ``--rerun-crashes`` runs
again, and :class:`Pools`, what the ``pools`` fixture gives a test with several phases. The hooks and
fixtures stay in the plugin, where pytest finds them."""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pytest

from conformance.harness.axes import item_impl
from conformance.harness.config import harness_config
from conformance.harness.failures import DIED, HUNG, Failure
from conformance.harness.runner import RankRun, RanksNotStarted, Runner
from conformance.harness.worker import DIST_ARG
from conformance.harness.xfails import XfailEntry

__all__ = [
    "Session",
    "SESSION",
    "ENTRY",
    "RANK_FAILURES",
    "ITEM_CRASHES",
    "GLIBC_HEAP_ERROR",
    "MEMORY_ERROR_SIGNALS",
    "CRASH_OUTPUT_LINES",
    "item_reqs",
    "default_clause",
    "in_clauses",
    "skip_test",
    "format_run",
    "how_died",
    "judge",
    "rank_failures",
    "health_check_body",
    "rank_timeout",
    "run_on_ranks",
    "memory_error",
    "crash_to_rerun",
    "record_crash",
    "Pools",
]


@dataclass
class Session:
    """What the plugin keeps for one pytest session (its settings are :data:`~conformance.harness.config.SETTINGS`)."""

    #: runs the rank bodies: the pools, or a torchrun job's ranks
    runner: Runner
    #: the expected-failures entries (loaded once, at configure)
    entries: list[XfailEntry]
    #: the crashes rerun in the session (``--rerun-crashes``), in order, for the terminal summary
    crashes: list[dict[str, Any]] = field(default_factory=list)


SESSION = pytest.StashKey[Session]()
#: The known-deviation entry applied to a test, for the pin check after it ran.
ENTRY = pytest.StashKey[XfailEntry]()
#: (world size, failures) of a test's last rank run.
RANK_FAILURES = pytest.StashKey[tuple[int, list[Failure]]]()
#: The crashes rerun in one test, for its report.
ITEM_CRASHES = pytest.StashKey[list[dict[str, Any]]]()
#: Signals of a native memory error (the only deaths ``--rerun-crashes`` reruns): a segfault is
#: the sign of a use-after-free or a race in native code, which another run may not meet; an exit
#: code, SIGKILL (the OOM killer) or SIGABRT (gloo's checks on a mismatched collective, an assertion)
#: is what the code decided, and repeats, except for the abort below.
MEMORY_ERROR_SIGNALS = (signal.SIGSEGV, signal.SIGBUS)
#: What glibc writes to stderr before it aborts a process whose heap it found corrupt (malloc.c's
#: ``malloc_printerr``): the same memory error as a segfault, met at the allocator's next check
#: instead of at a bad address. torch's CPU/gloo build dies both ways (in a gloo thread, while DTensor
#: gathers: "malloc(): unaligned tcache chunk detected").
GLIBC_HEAP_ERROR = re.compile(
    r"\b(?:malloc|free|realloc|malloc_consolidate|munmap_chunk|tcache_thread_shutdown|_int_malloc|_int_free)\(\): [a-z]"
    r"|double free or corruption|corrupted size vs\. prev_size|corrupted double-linked list"
)
#: Lines of a crashed rank's output kept with its record (faulthandler's stacks end there).
CRASH_OUTPUT_LINES = 60


# -- the clause of a failure: the test's requirement IDs --------------------------------------------


def item_reqs(item: pytest.Item) -> list[str]:
    return [req for marker in item.iter_markers("req") for req in marker.args]


def default_clause(item: pytest.Item | None) -> str | None:
    """The clause of a failure of ``item`` that named none: the requirement the test names, or its
    requirements joined by ``+`` (in the order the marks name them) when it names several."""
    if item is None:
        return None
    reqs = list(dict.fromkeys(item_reqs(item)))
    return "+".join(reqs) or None


def in_clauses(failures: list[Failure], item: pytest.Item | None) -> list[Failure]:
    default = default_clause(item)
    return [failure.in_clause(default) for failure in failures]


# -- a body run on the ranks, and its verdict ---------------------------------------------------------


def skip_test(reason: str) -> NoReturn:
    """Skip the current test, reported at the test's location rather than at this module's line."""
    # `_use_item_location` is pytest's own (private) switch for exactly this; without it every skip
    # of the suite would point at the harness.
    raise pytest.skip.Exception(reason, _use_item_location=True)


def format_run(run: RankRun, backend: str, timeout_s: float, headline: str, runner: Runner) -> str:
    lines = [f"{headline} (world size {run.world_size}, {backend})"]
    for rank in range(run.world_size):
        outcome = run.outcomes.get(rank)
        if rank in run.died:
            lines.append(f"  rank {rank}: DIED ({how_died(run.died[rank])})")
        elif rank in run.hung:
            lines.append(f"  rank {rank}: HUNG (no answer within {timeout_s:.0f}s; Python stacks in its output)")
        elif outcome is not None:
            status = {"ok": "passed", "fail": "FAILED", "skip": "skipped", "xfail": "xfailed"}[outcome.status]
            reason = f": {outcome.error}" if outcome.status in ("skip", "xfail") else ""
            lines.append(f"  rank {rank}: {status}{reason}")
    if not run.healthy:
        lines.append(f"  {runner.after_unhealthy_run()}")
    for rank in range(run.world_size):
        outcome = run.outcomes.get(rank)
        if outcome is not None and outcome.status == "fail":
            lines += ["", f"---------- rank {rank} traceback ----------", outcome.error.rstrip()]
    for rank in range(run.world_size):
        text = run.output.get(rank, "").rstrip()
        if text:
            lines += ["", f"---------- rank {rank} output ----------", text]
    return "\n".join(lines)


def how_died(code: int | None) -> str:
    """A dead rank's exit status; None under torchrun, where only the launcher sees it."""
    if code is None:
        return "its process is gone; torchrun reports its exit status"
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def judge(run: RankRun, backend: str, timeout_s: float, runner: Runner) -> list[Any]:
    """Turn what the ranks did into one pytest outcome; return per-rank values when all passed."""
    statuses = {r: o.status for r, o in run.outcomes.items()}
    kinds = set(statuses.values())
    if not run.healthy or "fail" in kinds:
        culprits = sorted([r for r, s in statuses.items() if s == "fail"] + list(run.died) + run.hung)
        pytest.fail(format_run(run, backend, timeout_s, f"rank test failed on rank(s) {culprits}", runner), pytrace=False)
    if kinds == {"ok"}:
        return [run.outcomes[r].value for r in range(run.world_size)]
    if len(kinds) == 1:
        reasons = {o.error for o in run.outcomes.values()}
        if len(reasons) == 1:
            reason = reasons.pop()
        else:
            reason = "ranks gave different reasons: " + "; ".join(
                f"rank {r}: {run.outcomes[r].error}" for r in sorted(run.outcomes)
            )
        if kinds == {"skip"}:
            skip_test(reason)
        pytest.xfail(reason)
    pytest.fail(format_run(run, backend, timeout_s, "ranks disagree", runner), pytrace=False)


def rank_failures(run: RankRun, timeout_s: float) -> list[Failure]:
    """One :class:`Failure` per rank that failed, died or hung in ``run``, by rank."""
    failures = []
    for rank in range(run.world_size):
        outcome = run.outcomes.get(rank)
        if rank in run.died:
            failures.append(Failure(rank=rank, type=DIED, message=f"the rank process died ({how_died(run.died[rank])})"))
        elif rank in run.hung:
            failures.append(Failure(rank=rank, type=HUNG, message=f"no answer within {timeout_s:.0f}s"))
        elif outcome is not None and outcome.status == "fail":
            lines = outcome.error.strip().splitlines()
            failures.extend(outcome.failures or [Failure(rank=rank, type="Error", message=lines[-1] if lines else "")])
    return failures


def health_check_body(ctx: Any) -> None:
    """Run after ranks ended a test differently: proves the group still completes a collective."""
    ctx.barrier()


def rank_timeout(config: pytest.Config, node: pytest.Item | None) -> float:
    """Seconds a rank test may run: ``--rank-timeout``, or less where the test's ``rank_timeout``
    marker says so (a test that may leave ranks waiting fails in seconds, not minutes)."""
    limit = harness_config(config).rank_timeout_s
    marker = node.get_closest_marker("rank_timeout") if node is not None else None
    if marker is None or node is None:
        return limit
    if len(marker.args) != 1 or not isinstance(marker.args[0], (int, float)) or marker.args[0] <= 0:
        raise pytest.UsageError(f"{node.nodeid}: rank_timeout takes one positive number of seconds; got {marker.args}")
    return min(limit, float(marker.args[0]))


def run_on_ranks(
    config: pytest.Config,
    world_size: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    node: pytest.Item | None = None,
    *,
    rerun_crash: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks of the session's runner and judge the outcomes (:func:`judge`).
    ``rerun_crash``: the call is the whole test, which ``--rerun-crashes`` may run again (a phase of a
    ``pools`` test is not: the state its earlier phases left on the ranks died with them)."""
    runner = config.stash[SESSION].runner
    timeout_s = rank_timeout(config, node)
    tmp_dir = tempfile.mkdtemp(prefix="sdc-test-")
    try:
        try:
            run = runner.run(world_size, backend, fn, args, kwargs, tmp_dir=tmp_dir, timeout_s=timeout_s)
            if rerun_crash and node is not None and crash_to_rerun(config, node, run, timeout_s):
                record_crash(config, node, run, backend, timeout_s)
                # The crashed pool was stopped: the test runs again from the start on fresh ranks.
                shutil.rmtree(tmp_dir, ignore_errors=True)
                tmp_dir = tempfile.mkdtemp(prefix="sdc-test-")
                run = runner.run(world_size, backend, fn, args, kwargs, tmp_dir=tmp_dir, timeout_s=timeout_s)
        except RanksNotStarted as exc:
            pytest.fail(str(exc), pytrace=False)
        if node is not None:
            node.stash[RANK_FAILURES] = (world_size, in_clauses(rank_failures(run, timeout_s), node))
        if run.healthy and len({o.status for o in run.outcomes.values()}) > 1:
            runner.run(world_size, backend, health_check_body, (DIST_ARG,), {}, tmp_dir=tmp_dir, timeout_s=30.0)
        return judge(run, backend, timeout_s, runner)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# -- --rerun-crashes: an intermittent native crash of an adapter the suite does not test -------------


def memory_error(code: int | None, output: str = "") -> bool:
    """Whether a rank that ended with ``code`` (its exit status) having written ``output`` during the
    test died of a native memory error: a segfault or bus error, or glibc's abort on a corrupt heap."""
    if code is None or code >= 0:
        return False
    return -code in MEMORY_ERROR_SIGNALS or (-code == signal.SIGABRT and GLIBC_HEAP_ERROR.search(output) is not None)


def crash_to_rerun(config: pytest.Config, item: pytest.Item, run: RankRun, timeout_s: float) -> bool:
    """Whether ``run`` of ``item`` is a crash ``--rerun-crashes`` reruns: its adapter is named there
    (by its own name: an adapter derived from a named one is not), a rank died of a memory error, and
    that death is not the failure the test's known deviation expects (an entry with no pin, or one
    that the run matches, already accounts for it)."""
    impl = item_impl(item)
    if impl is None or impl.name not in harness_config(config).rerun_crashes:
        return False
    if not config.stash[SESSION].runner.contains_crashes:  # a dead rank ended the run: nothing reruns
        return False
    if not any(memory_error(code, run.output.get(rank, "")) for rank, code in run.died.items()):
        return False
    entry = item.stash.get(ENTRY, None)
    if entry is None:
        return True
    return bool(entry.pin) and entry.pin.mismatch(in_clauses(rank_failures(run, timeout_s), item), run.world_size) is not None


def record_crash(config: pytest.Config, item: pytest.Item, run: RankRun, backend: str, timeout_s: float) -> None:
    """Keep the crash of ``item``'s first run for the terminal summary and its report."""
    record = {
        "nodeid": item.nodeid,
        "died": {str(rank): how_died(code) for rank, code in sorted(run.died.items())},
        "output": {
            str(rank): "\n".join(run.output.get(rank, "").rstrip().splitlines()[-CRASH_OUTPUT_LINES:])
            for rank in sorted(run.died)
        },
        "first_run": format_run(run, backend, timeout_s, "first run", config.stash[SESSION].runner)[:4000],
    }
    config.stash[SESSION].crashes.append(record)
    item.stash.setdefault(ITEM_CRASHES, []).append(record)


class Pools:
    """Controller-side access to the pools, for tests with several phases (``pools`` fixture)."""

    def __init__(self, config: pytest.Config, node: pytest.Item | None = None) -> None:
        self._config = config
        self._node = node

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank of the ``world_size`` pool; per-rank return values."""
        settings = harness_config(self._config)
        reason = settings.why_not_run(world_size)
        if reason is not None:
            skip_test(reason)
        return run_on_ranks(self._config, world_size, settings.backend_for(world_size), fn, (DIST_ARG, *args), kwargs, self._node)
