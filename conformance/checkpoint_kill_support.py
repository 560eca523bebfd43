"""Saves killed at each step: a child process's save of
:func:`~conformance.crash_child.crash_state`, killed where a test says (:func:`child_save`), the proof,
once per configuration, that a save with nothing killed loads (:func:`proves_a_save_loads`), the
verdict on the directory a killed save leaves (:func:`check_after_kill`) and the kill points of the
default and ``thorough`` profiles. Used by ML-13 and ML-29 (``test_checkpoint.py``) and by AS-3's killed
async saves (``test_async_save.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.unsupported import skip_reason
from conformance.asserts import fail, raised
from conformance.checkpoint_support import assert_same_bits, checkpoint_ops, is_same_bits

__all__ = [
    "child_save",
    "check_after_kill",
    "proves_a_save_loads",
    "KILL_POINTS",
    "PUBLICATION_KILL_POINTS",
    "QUICK_KILL_POINTS",
    "kill_points",
    "QUICK_TWO_RANK_KILLS",
    "two_rank_kills",
]


def child_save(impl: Adapter, path: Path, fill: float, kill: tuple[str, int] | None = None, world: int = 1, killed: str = "all",
               *, executor: str | None = None) -> int:
    """Run :mod:`conformance.crash_child` (a save of ``crash_state(fill)``, maybe killed at ``kill``);
    with ``executor``, the save is the adapter's async save on that executor, waited for. Its exit status."""
    from conformance import crash_child
    from conformance.child_process import run_child
    from conformance.crash_child import ASYNC_ENV, KILLED, UNSUPPORTED

    args = [impl.spec, str(path), str(fill)]
    if kill:
        args += [kill[0], str(kill[1])]
        if world > 1:
            args += [str(world), killed]
    env = dict(os.environ)
    env.pop(ASYNC_ENV, None)
    if executor is not None:
        env[ASYNC_ENV] = executor
    status, output = run_child(crash_child.main, args, timeout=120, env=env, description=f"python -m conformance.crash_child {' '.join(args)}")
    if status == UNSUPPORTED:
        pytest.skip(f"{impl.name}: {output.strip().splitlines()[-1] if output.strip() else 'unsupported'}")
    if status not in (0, -9, KILLED):
        fail("a child's save", f"exit status {status}: {output[-800:]}", f"0 (finished), -9 or {KILLED} (killed)", " ".join(args))
    return status


def proves_a_save_loads(impl: Adapter, path: Path, *, world: int = 1, executor: str | None = None) -> None:
    """A child's save of :func:`~conformance.crash_child.crash_state` with nothing killed loads back
    whole in this process: run before a test that allows "nothing loads" as an outcome of a fault, so
    that an implementation that cannot save or load at all fails (or, for an op it lacks, skips) that
    test instead of passing it."""
    __tracebackhide__ = True
    from conformance.crash_child import crash_state

    impl.require_no_process_group("the crash tests' load in the controller process (ML-12)")
    key = (impl.spec, world, executor)
    if key not in _PROVEN:  # once per configuration and session: a child save costs a process start
        def prove() -> None:
            status = child_save(impl, path, 6.0, world=world, executor=executor)
            if status != 0:
                fail("a child's save with nothing killed", f"exit status {status}", "0: the save finished", f"world size {world}")
            target = crash_state(-5.0)
            checkpoint_ops(impl).load(target, path)
            assert_same_bits(target, crash_state(6.0), what=f"a checkpoint saved with nothing killed (world size {world})")

        try:
            prove()
            _PROVEN[key] = None
        except (KeyboardInterrupt, SystemExit, pytest.skip.Exception):
            raise
        except BaseException as exc:  # noqa: B036 - kept, to give every test of this configuration the same verdict
            _PROVEN[key] = exc
    proof = _PROVEN[key]
    if proof is not None:
        if isinstance(proof, Unsupported):
            pytest.skip(skip_reason(proof))
        fail("before any fault: a save, then a load of it", f"{type(proof).__name__}: {proof}"[:800],
             "the values saved, whole (a test that allows 'nothing loads' after a fault first proves a save loads)",
             f"world size {world}" + (f", {executor} async save" if executor else ""))


#: (adapter spec, world size, executor) -> what :func:`proves_a_save_loads` raised, None if it passed.
_PROVEN: dict[tuple[str, int, str | None], BaseException | None] = {}


def check_after_kill(impl: Adapter, path: Path, directory: str, kill: tuple[str, int], *, world: int, killed: str,
                     executor: str | None = None) -> None:
    """A child saves over ``directory`` ("fresh" or "overwrite" of a first child's save) and is killed at
    ``kill``: the directory then holds the previous checkpoint whole, nothing that loads (fresh), or the
    new one whole; never a mix. ``executor``: the killed save is an async save on it (AS-3)."""
    __tracebackhide__ = True
    from conformance.crash_child import crash_state

    proves_a_save_loads(impl, path.with_name(path.name + "-unharmed"), world=world, executor=executor)
    ops = checkpoint_ops(impl)
    if directory == "overwrite":
        ops.save(crash_state(1.0), path)  # in this process, without a group (ML-12): the child is the one killed
    status = child_save(impl, path, 2.0, kill, world, killed, executor=executor)
    target = crash_state(-5.0)
    loaded = raised(lambda: ops.load(target, path))
    how = f"{executor} async save" if executor else "save"
    where = f"{how}, {directory} directory, world size {world}, rank {killed} killed at {kill[0]} #{kill[1]} (exit status {status})"
    if loaded is not None:
        if directory == "fresh":
            return  # nothing loads: allowed
        fail("the directory after a killed overwrite", f"{type(loaded).__name__}: {loaded}"[:400], "the previous checkpoint, whole", where)
    old, new = crash_state(1.0), crash_state(2.0)
    if any(is_same_bits(target, candidate) for candidate in ((new,) if directory == "fresh" else (old, new))):
        return
    fail("the checkpoint after a killed save", {k: (v.flatten()[:3].tolist() if isinstance(v, torch.Tensor) else v) for k, v in target.items()},
         "one save's values whole (old or new), never a mix", where)


# -- ML-13 a save killed at each step ------------------------------------------------------------------------------

#: (step of the save, which occurrence) a child is killed at: its first data file opened, mid-data,
#: its last writes and fsyncs (after data, before or during metadata), the publication.
KILL_POINTS = (("open", 1), ("write", 1), ("write", 6), ("fsync", 1), ("open", 2), ("fsync", 2), ("rename", 1))


#: Every write and rename of publication (ML-29), whatever the implementation names its files: a
#: metadata file just opened for writing (truncated, if written in place), torn in the middle of a write,
#: just renamed into place (before the old files' removal), and just after a file was removed.
PUBLICATION_KILL_POINTS = (("open-metadata", 1), ("write-metadata", 1), ("renamed", 1), ("removed", 1))


#: Each trial is a fresh process (a second or two): the default profile tries these, ``thorough`` all.
QUICK_KILL_POINTS = (("write", 6), ("fsync", 1), ("open", 2), ("rename", 1))


def kill_points() -> tuple[tuple[str, int], ...]:
    from hypothesis import settings

    points = KILL_POINTS if settings.get_current_profile_name() == "thorough" else QUICK_KILL_POINTS
    return points + PUBLICATION_KILL_POINTS


#: (kill point, which rank) of the two-rank trials: the last rank as it opens its data file, mid-data
#: and after its data before the metadata; the coordinator (rank 0) at every step of publication;
#: ``thorough`` adds every kill point on each rank and on both.
QUICK_TWO_RANK_KILLS = (
    (("open", 1), "1"), (("write", 2), "1"), (("fsync", 1), "1"),
    *((point, "0") for point in PUBLICATION_KILL_POINTS),
)


def two_rank_kills() -> tuple[tuple[tuple[str, int], str], ...]:
    from hypothesis import settings

    if settings.get_current_profile_name() == "thorough":
        return tuple((point, who) for point in KILL_POINTS + PUBLICATION_KILL_POINTS for who in ("0", "1", "all"))
    return QUICK_TWO_RANK_KILLS
