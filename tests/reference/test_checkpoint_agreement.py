"""Rank tests of the checkpoint's failure agreement (:class:`reference.checkpoint.collective.Collective`,
:mod:`reference.comm` with the checkpoint's error policy): a step failing on some ranks is one
checkpoint error on every rank, of one class, whose message names the action, the step, every failing
rank and what it saw, with ``failures`` by rank and each failing rank's own exception as the cause."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed

from conformance.asserts import raised
from reference.checkpoint.collective import Collective
from reference.checkpoint.errors import CheckpointError, CheckpointFormatError, StateDictError

ACTION = "save to '/ckpt'"
METHODS = ["all_succeed", "gather_decide_scatter", "gather_decide_broadcast"]


def _fail(error: Exception | None, value: Any = None) -> Any:
    if error is not None:
        raise error
    return value


def _call(collective: Collective, method: str, local: Callable[[], Any],
          decide: Callable[[list[Any]], Any] | None = None) -> Any:
    """``method`` of ``collective`` for the step "planning" with ``local`` on every rank; the deciding
    function, if the method takes one, is ``decide`` (default: one value per rank, ``10 * rank``)."""
    if method == "all_succeed":
        return collective.all_succeed("planning", local)
    if method == "gather_decide_scatter":
        return collective.gather_decide_scatter("planning", local, decide or (lambda rs: [10 * r for r in range(len(rs))]))
    return collective.gather_decide_broadcast("planning", local, decide or (lambda rs: list(rs)))


@pytest.mark.parametrize("method", METHODS)
def test_the_steps_return_their_values(dist: Any, method: str) -> None:
    collective = Collective(dist.group, action=ACTION)
    assert collective.is_coordinator == (dist.rank == 0)
    got = _call(collective, method, lambda: dist.rank + 100)
    expected = {
        "all_succeed": dist.rank + 100,
        "gather_decide_scatter": 10 * dist.rank,
        "gather_decide_broadcast": [r + 100 for r in range(dist.world_size)],
    }[method]
    assert got == expected, f"rank {dist.rank}: {method} returned {got!r}, expected {expected!r}"


def _check(rank: int, exc: BaseException | None, cls: type[CheckpointError], text: str,
           failures: dict[int, str], cause: BaseException | None) -> None:
    assert type(exc) is cls, f"rank {rank}: raised {exc!r}, expected {cls.__name__}"
    assert isinstance(exc, CheckpointError)
    assert str(exc) == text, f"rank {rank}: message {str(exc)!r}, expected {text!r}"
    assert exc.failures == failures, f"rank {rank}: failures {exc.failures!r}, expected {failures!r}"
    assert exc.__cause__ is cause, f"rank {rank}: cause {exc.__cause__!r}, expected {cause!r}"


@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("method", METHODS)
def test_one_ranks_value_error_is_a_state_dict_error_naming_it(dist: Any, method: str) -> None:
    """Only the last rank fails, with a ValueError (a bad value from inside torch): every rank raises
    StateDictError naming that rank (and the group size) and the original type."""
    last = dist.world_size - 1
    error = ValueError("bad value for key 'w'") if dist.rank == last else None
    exc = raised(lambda: _call(Collective(dist.group, action=ACTION), method, lambda: _fail(error, 1)))
    text = f"{ACTION} failed in planning on rank {last} of {dist.world_size}: ValueError: bad value for key 'w'"
    _check(dist.rank, exc, StateDictError, text, {last: "ValueError: bad value for key 'w'"}, error)


@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("method", METHODS)
def test_one_message_on_every_rank_names_the_ranks_as_a_range(dist: Any, method: str) -> None:
    """Every rank fails alike with a checkpoint error: its own class and message, the ranks as a range."""
    error = CheckpointFormatError("data file '__0_0.distcp' is truncated")
    exc = raised(lambda: _call(Collective(dist.group, action=ACTION), method, lambda: _fail(error)))
    label = "rank 0" if dist.world_size == 1 else f"ranks 0-{dist.world_size - 1}"
    text = f"{ACTION} failed in planning on {label} of {dist.world_size}: data file '__0_0.distcp' is truncated"
    _check(dist.rank, exc, CheckpointFormatError, text, dict.fromkeys(range(dist.world_size), str(error)), error)


@pytest.mark.world_size(min=3)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("method", METHODS)
def test_different_failures_are_listed_by_rank_under_the_common_class(dist: Any, method: str) -> None:
    """Ranks 0 and 2 fail with the same OSError, rank 1 with a StateDictError, any others not at all:
    the common class is CheckpointError, one line per message, ranks with the same message together."""
    error = {0: OSError("disk full"), 1: StateDictError("key 'b' missing"), 2: OSError("disk full")}.get(dist.rank)
    exc = raised(lambda: _call(Collective(dist.group, action=ACTION), method, lambda: _fail(error)))
    text = f"{ACTION} failed in planning on 3 ranks of {dist.world_size}:\nranks 0, 2: OSError: disk full\nrank 1: key 'b' missing"
    failures = {0: "OSError: disk full", 1: "key 'b' missing", 2: "OSError: disk full"}
    _check(dist.rank, exc, CheckpointError, text, failures, error)


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("method", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_different_failures_on_two_ranks(dist: Any, method: str) -> None:
    """The first and last rank fail with different messages of one class: that class, one line each."""
    last = dist.world_size - 1
    error = {0: StateDictError("key 'a' missing"), last: StateDictError("key 'z' missing")}.get(dist.rank)
    exc = raised(lambda: _call(Collective(dist.group, action=ACTION), method, lambda: _fail(error)))
    text = f"{ACTION} failed in planning on 2 ranks of {dist.world_size}:\nrank 0: key 'a' missing\nrank {last}: key 'z' missing"
    _check(dist.rank, exc, StateDictError, text, {0: "key 'a' missing", last: "key 'z' missing"}, error)


@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("method", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_a_failed_decision_is_the_coordinators_failure(dist: Any, method: str) -> None:
    """Every local step succeeds and the coordinator's decision raises: every rank raises a
    CheckpointError naming rank 0, the coordinator with its own exception as the cause."""
    error = KeyError("plan")

    def decide(results: list[Any]) -> Any:
        raise error

    exc = raised(lambda: _call(Collective(dist.group, action=ACTION), method, lambda: dist.rank, decide))
    text = f"{ACTION} failed in planning on rank 0 of {dist.world_size}: KeyError: 'plan'"
    _check(dist.rank, exc, CheckpointError, text, {0: "KeyError: 'plan'"}, error if dist.rank == 0 else None)


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("method", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_no_decision_after_a_failed_local_step(dist: Any, method: str) -> None:
    """The last rank's local step fails: the coordinator does not decide, every rank raises that failure."""
    last = dist.world_size - 1
    error = CheckpointError("cannot write") if dist.rank == last else None
    decided: list[Any] = []
    exc = raised(lambda: _call(Collective(dist.group, action=ACTION), method, lambda: _fail(error, 1), decided.append))
    assert not decided, f"rank {dist.rank}: decided on {decided!r} after a rank failed"
    _check(dist.rank, exc, CheckpointError, f"{ACTION} failed in planning on rank {last} of {dist.world_size}: cannot write",
           {last: "cannot write"}, error)


@pytest.mark.parametrize("method", METHODS)
def test_without_a_process_group_no_group_size_is_named(method: str) -> None:
    """One process, ``torch.distributed`` not initialized: the steps run locally and a failure is still
    the checkpoint's error, naming rank 0 but no group size."""
    if torch.distributed.is_initialized():
        pytest.skip("torch.distributed is initialized in this process: Collective(None) means its default group")
    collective = Collective(None, action=ACTION)
    assert collective.is_coordinator
    assert _call(collective, method, lambda: 7) == {"all_succeed": 7, "gather_decide_scatter": 0, "gather_decide_broadcast": [7]}[method]
    error = OSError("disk full")
    exc = raised(lambda: _call(collective, method, lambda: _fail(error)))
    _check(0, exc, CheckpointError, f"{ACTION} failed in planning on rank 0: OSError: disk full",
           {0: "OSError: disk full"}, error)



class _Travelled:
    """A value that knows whether it was pickled on its way (an unpickled copy says so)."""

    def __init__(self, rank: int, travelled: bool = False) -> None:
        self.rank, self.travelled = rank, travelled

    def __reduce__(self) -> tuple[Any, tuple[int, bool]]:
        return _Travelled, (self.rank, True)


@pytest.mark.parametrize("method", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_the_coordinator_keeps_its_own_values_and_receives_the_other_ranks_values(dist: Any, method: str) -> None:
    """What the coordinator gathers from itself, and scatters to itself, is its own object, not a
    pickled copy (as with one rank: a save's plans are costly to pickle); every other rank's value
    arrives, in rank order, and each rank gets its own decision."""
    collective = Collective(dist.group, action=ACTION)
    mine = _Travelled(dist.rank)
    gathered: list[Any] = []

    def decide(results: list[Any]) -> Any:
        gathered.extend(results)
        return [_Travelled(r) for r in range(len(results))] if method == "gather_decide_scatter" else "decided"

    got = _call(collective, method, lambda: mine, decide)
    if dist.rank == 0:
        assert gathered[0] is mine, "the coordinator's own value was pickled to itself"
        assert [(r.rank, r.travelled) for r in gathered[1:]] == [(r, True) for r in range(1, dist.world_size)]
    if method == "gather_decide_scatter":
        assert (got.rank, got.travelled) == (dist.rank, dist.rank != 0), f"rank {dist.rank} got {vars(got)}"
    else:
        assert got == "decided"
