"""Rank tests of how ``reference.comm`` moves the agreements' objects: in frames of ``FRAME_BYTES``, one
collective per exchange, and the rest of a larger pickle point to point (after a gather or a scatter)
or in a second collective (after a broadcast or an all-gather). Each exchange is tried with pickles
that end just inside, exactly at and just past a frame, and far past it, on one rank or on every rank,
and counted: how many collectives each rank makes is part of what is checked. Also what makes an
exchange fail: a value that does not pickle where it is sent, or cannot be unpickled where it lands,
fails on every rank instead of leaving the others waiting."""

from __future__ import annotations

import contextlib
import pickle
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed

from conformance.asserts import raised
from reference import comm
from reference.checkpoint import api

#: The c10d calls an exchange may make; each is counted on the rank that calls it.
CALLS = ("all_reduce", "all_gather", "gather", "scatter", "broadcast", "send", "recv")
ROOM = comm.FRAME_BYTES - 8  # pickle bytes that fit in a frame beside its 8-byte length

#: Lengths of a pickle: small, just inside a frame, exactly filling it, one byte past it, and past
#: three frames.
LENGTHS = {"small": 40, "room-1": ROOM - 1, "room": ROOM, "room+1": ROOM + 1, "3 frames": 3 * comm.FRAME_BYTES + 5}
#: Which ranks send the long pickle (the others send a small one).
WHO = ["every rank", "the last rank", "the coordinator"]


def _value(length: int, tag: int) -> bytes:
    """A ``bytes`` value whose pickle (``comm``'s protocol) is ``length`` bytes long and whose content
    depends on ``tag`` and on each position, so that a truncated, shifted or misrouted payload cannot
    unpickle to an equal value."""
    # Byte i is (7 i + 31 tag) mod 251, which repeats every 251 bytes: built from one period.
    period = bytes((i * 7 + tag * 31) % 251 for i in range(251))
    whole = period * (length // 251 + 1)
    for size in range(max(0, length - 32), length + 1):
        value = whole[:size]
        if len(comm._pickled(value)) == length:
            return value
    raise AssertionError(f"no bytes value pickles to {length} bytes")


def _length_of(rank: int, who: str, world: int, length: int) -> int:
    sends_long = who == "every rank" or (who == "the last rank" and rank == world - 1) or (who == "the coordinator" and rank == 0)
    return length if sends_long else LENGTHS["small"]


@contextlib.contextmanager
def _counted() -> Iterator[Counter[str]]:
    """Count the c10d calls made on this rank while inside."""
    counts: Counter[str] = Counter()
    with contextlib.ExitStack() as stack:
        for name in CALLS:
            real = getattr(torch.distributed, name)

            def counting(*args: Any, _real: Callable[..., Any] = real, _name: str = name, **kwargs: Any) -> Any:
                counts[_name] += 1
                return _real(*args, **kwargs)

            stack.enter_context(mock.patch.object(torch.distributed, name, counting))
        yield counts


def _collectives(counts: Counter[str]) -> dict[str, int]:
    return {name: n for name, n in counts.items() if name not in ("send", "recv")}


def _p2p(counts: Counter[str]) -> dict[str, int]:
    return {name: n for name, n in counts.items() if name in ("send", "recv")}


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("length", LENGTHS)
def test_gather_then_scatter_carries_every_pickle_whole(dist: Any, length: str, who: str) -> None:
    """Every rank's value reaches the coordinator whole, and each rank's decided value reaches it whole,
    in one gather and one scatter; the rest of a long pickle goes between its rank and the coordinator
    only (one send, one receive), never through a collective of every rank."""
    world, rank = dist.world_size, dist.rank
    sizes = [_length_of(r, who, world, LENGTHS[length]) for r in range(world)]
    sent = [_value(sizes[r], r) for r in range(world)]
    # The decision sent to rank r is as long as what r sent, with other content.
    answers = [_value(sizes[r], r + 100) for r in range(world)]
    gathered: list[Any] = []

    def decide(results: list[bytes]) -> list[bytes]:
        gathered.extend(results)
        return answers

    with _counted() as counts:
        got = comm.gather_decide_scatter(dist.group, lambda: sent[rank], decide)
    assert got == answers[rank], f"rank {rank}: received {len(got)} bytes, not its {len(answers[rank])}-byte decision"
    if rank == 0:
        assert gathered == sent, f"the coordinator gathered lengths {[len(g) for g in gathered]}, sent {[len(s) for s in sent]}"
    assert _collectives(counts) == {"gather": 1, "scatter": 1}, f"rank {rank}: {dict(counts)}"
    long_pickles = [r for r in range(1, world) if sizes[r] > ROOM]
    if rank == 0:
        expected = {"recv": len(long_pickles), "send": len(long_pickles)} if long_pickles else {}
    else:
        expected = {"send": 1, "recv": 1} if rank in long_pickles else {}
    assert _p2p(counts) == {k: v for k, v in expected.items() if v}, f"rank {rank}: {dict(counts)}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("length", LENGTHS)
def test_gather_then_broadcast_carries_every_pickle_whole(dist: Any, length: str, who: str) -> None:
    """The coordinator's decision reaches every rank whole: one broadcast when its pickle fits a frame,
    a second one of the rest when it does not (every rank reads the length, so all take part)."""
    world, rank = dist.world_size, dist.rank
    sizes = [_length_of(r, who, world, LENGTHS[length]) for r in range(world)]
    sent = [_value(sizes[r], r) for r in range(world)]
    decision = _value(max(sizes), 200)

    def decide(results: list[bytes]) -> bytes:
        assert results == sent, f"the coordinator gathered lengths {[len(g) for g in results]}"
        return decision

    with _counted() as counts:
        got = comm.gather_decide_broadcast(dist.group, lambda: sent[rank], decide)
    assert got == decision, f"rank {rank}: received {len(got)} bytes, not the {len(decision)}-byte decision"
    broadcasts = 2 if max(sizes) > ROOM else 1
    assert _collectives(counts) == {"gather": 1, "broadcast": broadcasts}, f"rank {rank}: {dict(counts)}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("length", LENGTHS)
def test_all_gather_carries_every_pickle_whole(dist: Any, length: str, who: str) -> None:
    """Every rank gets every rank's value whole, in rank order: one all-gather when every pickle fits a
    frame, a second of the rests (padded to the longest) when any does not, on every rank alike."""
    world, rank = dist.world_size, dist.rank
    sizes = [_length_of(r, who, world, LENGTHS[length]) for r in range(world)]
    sent = [_value(sizes[r], r) for r in range(world)]
    with _counted() as counts:
        got = comm.gather_agreed(dist.group, lambda: sent[rank])
        objects = comm.all_gather_objects(sent[rank], dist.group)
    assert got == sent and objects == sent, f"rank {rank}: received lengths {[len(g) for g in got]}, {[len(o) for o in objects]}"
    all_gathers = 2 * (2 if max(sizes) > ROOM else 1)
    assert _collectives(counts) == {"all_gather": all_gathers}, f"rank {rank}: {dict(counts)}"
    assert not _p2p(counts), f"rank {rank}: {dict(counts)}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("length", ["small", "room", "room+1", "3 frames"])
def test_broadcast_from_the_coordinator_carries_its_pickle_whole(dist: Any, length: str) -> None:
    value = _value(LENGTHS[length], 7)
    with _counted() as counts:
        got = comm.broadcast_from_coordinator(dist.group, lambda: value if dist.rank == 0 else None)
    assert got == value, f"rank {dist.rank}: received {len(got or b'')} bytes, not the {len(value)} sent"
    broadcasts = 2 if LENGTHS[length] > ROOM else 1
    assert _collectives(counts) == {"broadcast": broadcasts}, f"rank {dist.rank}: {dict(counts)}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
def test_agreement_on_success_is_one_flag(dist: Any) -> None:
    with _counted() as counts:
        assert comm.agree(dist.group, lambda: dist.rank) == dist.rank
    assert dict(counts) == {"all_reduce": 1}, f"rank {dist.rank}: {dict(counts)}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(120)
def test_a_save_makes_four_collectives_and_a_load_three(dist: Any) -> None:
    """A checkpoint save at this world size is one gather of plans, one scatter of the global plans, one
    gather of write results and one broadcast of the metadata; a load is three one-flag agreements (after
    planning, after reading, after committing). No point-to-point traffic while the objects fit a frame."""
    root = dist.tmp_dir
    state: dict[str, Any] = {f"layer{i}.weight": torch.full((4, 4), float(i)) for i in range(3)}
    state["step"] = 5
    with _counted() as counts:
        api.save(state, checkpoint_id=f"{root}/ckpt", process_group=dist.group)
    assert dict(counts) == {"gather": 2, "scatter": 1, "broadcast": 1}, f"rank {dist.rank}, save: {dict(counts)}"
    target: dict[str, Any] = {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0 for key, value in state.items()}
    with _counted() as counts:
        api.load(target, checkpoint_id=f"{root}/ckpt", process_group=dist.group)
    assert dict(counts) == {"all_reduce": 3}, f"rank {dist.rank}, load: {dict(counts)}"
    assert all(torch.equal(target[key], state[key]) for key in state if key != "step"), f"rank {dist.rank}"
    assert target["step"] == 5


@pytest.mark.world_size(4)
@pytest.mark.rank_timeout(60)
def test_frames_and_their_rests_stay_within_a_group_whose_coordinator_is_not_global_rank_0(dist: Any) -> None:
    """Groups ``[0, 1]`` and ``[2, 3]``, each exchanging pickles longer than a frame: in ``[2, 3]`` the
    coordinator is global rank 2, so a rest sent to or from "rank 0" by global rank would leave the
    group (and hang or land in the other group's exchange)."""
    groups = [torch.distributed.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank makes both
    try:
        group = groups[dist.rank // 2]
        first = dist.rank - dist.rank % 2
        long = LENGTHS["3 frames"]
        mine = _value(long, dist.rank)
        got = comm.gather_decide_scatter(group, lambda: mine, lambda sent: [_value(long, 100 + first + r) for r in range(len(sent))])
        assert got == _value(long, 100 + dist.rank), f"rank {dist.rank}: got another rank's decision"
        every = comm.gather_decide_broadcast(group, lambda: mine, list)
        assert every == [_value(long, first), _value(long, first + 1)], f"rank {dist.rank}: gathered another group's values"
        assert comm.gather_agreed(group, lambda: mine) == every, f"rank {dist.rank}"
    finally:
        for group in groups:
            torch.distributed.destroy_process_group(group)


def _unpicklable() -> Callable[[], int]:
    return lambda: 1  # a function defined in a function does not pickle


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("how", ["gather_agreed", "gather_decide_scatter", "gather_decide_broadcast"])
def test_a_result_that_does_not_pickle_on_one_rank_fails_every_rank(dist: Any, how: str) -> None:
    """One rank's step returns a value that cannot be pickled: that rank reports the pickling error as
    its failure, and every rank raises it, naming that rank, instead of the rank raising alone and the
    others waiting for its value."""
    last = dist.world_size - 1
    result: Any = _unpicklable() if dist.rank == last else dist.rank
    decided: list[Any] = []

    def decide(results: list[Any]) -> list[Any]:
        decided.append(results)
        return list(results)

    exc = raised(lambda: {
        "gather_agreed": lambda: comm.gather_agreed(dist.group, lambda: result),
        "gather_decide_scatter": lambda: comm.gather_decide_scatter(dist.group, lambda: result, decide),
        "gather_decide_broadcast": lambda: comm.gather_decide_broadcast(dist.group, lambda: result, decide),
    }[how]())
    assert exc is not None, f"rank {dist.rank}: {how} returned although rank {last}'s result does not pickle"
    assert f"(raised on rank {last} of {dist.world_size}; every rank raises it)" in str(exc), f"rank {dist.rank}: {exc!r}"
    assert "pickle" in str(exc).lower(), f"rank {dist.rank}: the error does not say what failed: {exc!r}"
    assert not decided, f"rank {dist.rank}: decided although rank {last} failed"
    assert (exc.__cause__ is not None) == (dist.rank == last), f"rank {dist.rank}: cause {exc.__cause__!r}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("how", ["gather_decide_scatter", "gather_decide_broadcast", "broadcast_from_coordinator"])
def test_a_decision_that_does_not_pickle_fails_every_rank_as_the_coordinators(dist: Any, how: str) -> None:
    last = dist.world_size - 1
    exc = raised(lambda: {
        # Only the last rank's value is unpicklable: the coordinator finds out before sending anything.
        "gather_decide_scatter": lambda: comm.gather_decide_scatter(
            dist.group, lambda: dist.rank, lambda rs: [*range(last), _unpicklable()]),
        "gather_decide_broadcast": lambda: comm.gather_decide_broadcast(dist.group, lambda: dist.rank, lambda rs: _unpicklable()),
        "broadcast_from_coordinator": lambda: comm.broadcast_from_coordinator(dist.group, _unpicklable),
    }[how]())
    assert exc is not None, f"rank {dist.rank}: {how} returned although the decision does not pickle"
    assert f"(raised on rank 0 of {dist.world_size}; every rank raises it)" in str(exc), f"rank {dist.rank}: {exc!r}"
    assert (exc.__cause__ is not None) == (dist.rank == 0), f"rank {dist.rank}: cause {exc.__cause__!r}"


def _refuse_on_the_coordinator(payload: bytes) -> bytes:
    """Unpickling hook: fails on the coordinator only (as a class it cannot import would)."""
    if torch.distributed.get_rank() == 0:
        raise ModuleNotFoundError("No module named 'fork_only'")
    return payload


class _ReadableElsewhere:
    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _refuse_on_the_coordinator, (b"x",)


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("how", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_a_value_the_coordinator_cannot_unpickle_fails_every_rank_naming_the_sender(dist: Any, how: str) -> None:
    last = dist.world_size - 1
    value: Any = _ReadableElsewhere() if dist.rank == last else dist.rank
    step = comm.gather_decide_scatter if how == "gather_decide_scatter" else comm.gather_decide_broadcast
    exc = raised(lambda: step(dist.group, lambda: value, lambda rs: list(rs)))
    assert type(exc) is RuntimeError, f"rank {dist.rank}: {exc!r}"
    assert str(exc).startswith(f"what rank {last} sent cannot be unpickled on the coordinator: "
                               "ModuleNotFoundError: No module named 'fork_only'"), f"rank {dist.rank}: {exc!r}"
    assert f"(raised on rank {last} of {dist.world_size}; every rank raises it)" in str(exc)


@pytest.mark.parametrize("size", [comm.FRAME_BYTES, comm.MIN_FRAME_BYTES])
def test_a_frame_is_read_back_at_every_length(size: int) -> None:
    """Without ranks: a frame and its rest carry pickles of every length around the frame's size, and
    a frame that announces more than it holds is not read without its rest."""
    cpu = torch.device("cpu")
    room = size - 8
    for length in [0, 1, room - 1, room, room + 1, 2 * size]:
        data = bytes(i % 253 for i in range(length))
        frame = comm._frame(data, size, cpu)
        assert frame.numel() == size
        view = comm._rows(frame.unsqueeze(0))[0]
        rest = comm._rest(data, size, cpu)
        assert (rest is None) == (length <= room), length
        assert bytes(comm._payload(view, rest)) == data, length
        if rest is not None:
            assert raised(lambda: comm._payload(view, None)) is not None, length


def test_frames_shrink_past_64_ranks_so_that_an_exchange_stays_within_its_budget() -> None:
    """Each rank's frame has FRAME_BYTES up to 64 frames an exchange; past that the frames of one
    exchange add up to at most FRAMES_BUDGET, a multiple of 64 bytes each, never under MIN_FRAME_BYTES."""
    assert [comm.frame_bytes(n) for n in (1, 2, 8, 64)] == [comm.FRAME_BYTES] * 4
    for frames in (65, 100, 512, 1000, 4096, 10_000, 100_000):
        size = comm.frame_bytes(frames)
        assert size % 64 == 0 and comm.MIN_FRAME_BYTES <= size < comm.FRAME_BYTES, (frames, size)
        assert size * frames <= comm.FRAMES_BUDGET or size == comm.MIN_FRAME_BYTES, (frames, size)
    assert comm.frame_bytes(4096) == 1024


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("length", [40, 1015, 1016, 1017, 5000])
def test_exchanges_in_frames_shrunk_for_a_large_group_carry_every_pickle_whole(dist: Any, length: int) -> None:
    """The frame size a large group would get (1 KiB, as for 4096 ranks), at this world size: the last
    rank's long pickle reaches the coordinator whole and back, and every rank's reaches every rank."""
    world, rank, last = dist.world_size, dist.rank, dist.world_size - 1
    budget = 1024 * world
    sent = [_value(length if r == last else LENGTHS["small"], r) for r in range(world)]
    answers = [_value(length if r == last else LENGTHS["small"], 50 + r) for r in range(world)]
    def decide(results: list[bytes]) -> list[bytes]:
        assert results == sent, f"the coordinator gathered lengths {[len(r) for r in results]}"
        return answers

    with mock.patch.object(comm, "FRAMES_BUDGET", budget), _counted() as counts:
        assert comm.frame_bytes(world) == 1024
        got = comm.gather_decide_scatter(dist.group, lambda: sent[rank], decide)
        every = comm.gather_agreed(dist.group, lambda: sent[rank])
    assert got == answers[rank], f"rank {rank}: received {len(got or b'')} bytes, not its {len(answers[rank])}-byte decision"
    assert every == sent, f"rank {rank}: gathered lengths {[len(e) for e in every]}"
    long_pickle = length > 1016
    assert _collectives(counts) == {"gather": 1, "scatter": 1, "all_gather": 2 if long_pickle else 1}, f"rank {rank}: {dict(counts)}"
    p2p = {"send": 1, "recv": 1} if long_pickle and rank in (0, last) else {}
    assert _p2p(counts) == p2p, f"rank {rank}: {dict(counts)}"


def test_pickles_use_the_highest_protocol() -> None:
    assert comm._pickled(b"x")[:2] == bytes([0x80, pickle.HIGHEST_PROTOCOL])
