"""AS: async checkpoints (SPEC.md, section AS).

Every test runs on each executor the adapter provides (``thread``, ``process``); a missing one is a skip
naming it. The process executor's cases run at the largest selected world size (every one under
``--hypothesis-profile thorough``). The state is a training job's (:func:`conformance.async_support.training_state`): a sharded
DTensor parameter, optimizer state with a tensor step and hyperparameters, buffers of other dtypes and
non-tensor progress. What the checkpoint holds is read back with the adapter's synchronous load into a
state of other values, and compared bit for bit. A future is never waited for without a timeout: a
save that never ends fails its test instead of stopping the run.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

from conformance.adapters.base import Adapter
from conformance.asserts import assert_same_error_on_every_rank, expect_error, fail, raised, reraise
from conformance.async_support import (
    EXECUTORS,
    HANDOVER_WAIT_S,
    MAX_LOADS_DURING_WRITE,
    PUBLICATION_DELAY_S,
    WRITER_FAULTS,
    WRITER_FILE_LIMIT,
    WRITER_STOPS,
    RefusingStateful,
    Resources,
    assert_holds,
    async_ops,
    async_save,
    check_after_a_failure,
    check_next_group_of_the_job,
    full_training_state,
    handover_entries,
    isolated,
    loaded_state,
    on_every_rank,
    outcome,
    save_and_wait,
    settled_growth,
    signal_writer_processes,
    stop_writers_and_shut_down,
    subgroup_save,
    train_on,
    training_state,
    writer_processes,
)
from conformance.checkpoint_kill_support import check_after_kill
from conformance.checkpoint_support import assert_same_bits, checkpoint_ops, injected_fault, is_same_bits, peak_bytes_during
from conformance.checkpoint_values_support import mixed_state
from conformance.dcp_files import dcp_directory
from conformance.error_cases import WHERE, bad_input_here
from conformance.faults import slowed_publication
from conformance.processes import child_processes, file_size_limit, still_running, thread_blocked_writing

# A save that never ends is cut here, not at the suite's default of 120 s (see async_support.outcome).
pytestmark = pytest.mark.rank_timeout(60)


# -- AS-1 the snapshot -----------------------------------------------------------------------------------------------


@pytest.mark.req("AS-1")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_checkpoint_is_the_state_when_staging_completed(dist, impl, executor: str) -> None:
    """Right after the staging future resolves, training changes every value (in place, replaced,
    stepped, appended to); the checkpoint, once complete, holds the values at staging, bit for bit."""
    ops = async_ops(impl, executor)
    path = dist.tmp_dir / "ckpt"
    state = training_state(dist, 2.0)
    response = async_save(ops, state, path, dist, executor)
    staged = outcome(response.staging_completion, "the staging future", f"rank {dist.rank}")
    if staged is not None:
        fail("staging", f"{type(staged).__name__}: {staged}"[:400], "success", f"rank {dist.rank}")
    train_on(state)
    error = outcome(response.upload_completion, "the completion future", f"rank {dist.rank}")
    if error is not None:
        fail("the async save", f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")
    dist.barrier()
    assert_same_bits(loaded_state(dist, impl, path), training_state(dist, 2.0), what=f"the checkpoint of an async save ({executor}) after training went on")


@pytest.mark.req("AS-1")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_every_kind_of_value_is_staged_as_it_was(dist, impl, executor: str) -> None:
    """ML-1's values, async-saved: tensors of every dtype and edge value, empty ones, 0-d ones, lazy
    views (conjugate, negative, transposed, offset), objects of every kind and DTensors on 1-D and 2-D
    meshes load back bit for bit into targets that differ in every bit. Staging copies each value on
    its own (an arena, a tensor per shape): a kind it mishandles (an empty tensor staged as nothing, a
    lazy view staged as its raw bytes) is lost only in the async save."""
    ops = async_ops(impl, executor)
    path = dist.tmp_dir / "ckpt"
    saved = mixed_state(dist, "saved", seed=5)
    response = async_save(ops, saved.values, path, dist, executor)
    for future, what in ((response.staging_completion, "staging"), (response.upload_completion, "the async save")):
        error = outcome(future, f"the {what} future", f"rank {dist.rank}")
        if error is not None:
            fail(what, f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")
    dist.barrier()
    target = mixed_state(dist, "target", seed=5)
    checkpoint_ops(impl).load(target.values, path, process_group=dist.group)
    assert_same_bits(target.values, mixed_state(dist, "saved", seed=5).values, what=f"every kind of value after an async save ({executor})")


@pytest.mark.req("AS-1", "ML-38")
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_a_meta_tensor_in_an_async_save_is_an_error_naming_its_key(dist, impl, executor: str, where: str) -> None:
    """ML-38 in the background: an async save whose state holds a parameter left on the meta device (on
    every rank or on the last only) fails on every rank, at the call or in its completion future, with
    an error naming the key; the checkpoint saved before still loads whole. Staging copies each tensor
    on its own: one that skips a meta tensor, or copies nothing into its place, publishes a checkpoint
    without its values."""
    ops = async_ops(impl, executor)
    path = dist.tmp_dir / "ckpt"
    save_and_wait(dist, impl, executor, path, 1.0)
    state = training_state(dist, 2.0)
    if bad_input_here(dist, where):
        state["model"]["w"] = torch.empty_like(state["model"]["w"], device="meta")
    issued: list[Any] = []
    error = raised(lambda: issued.append(async_save(ops, state, path, dist, executor)))
    if error is None:
        error = outcome(issued[0].upload_completion, "the completion future of the save of a meta tensor", f"rank {dist.rank}")
    assert_same_error_on_every_rank(dist, error, what=f"an async save of a meta tensor ({executor}, {where})")
    assert error is not None
    expect_error(lambda: reraise(error), BaseException, keys=("model.w",), what=f"an async save of a meta tensor ({executor})",
                 where=f"rank {dist.rank}")
    dist.barrier()
    assert_holds(dist, impl, path, 1.0, what="the checkpoint saved before an async save of a meta tensor")


@pytest.mark.req("AS-1")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_gpu_state_is_staged_as_it_was_at_the_call(dist, impl, executor: str) -> None:
    """State on the rank's GPU (a sharded DTensor on a CUDA mesh, a plain tensor, a step): once the
    staging future resolves, kernels change every tensor; the checkpoint holds the values at the call."""
    if dist.device.type != "cuda":
        pytest.skip(f"CUDA staging needs a GPU per rank (--backend nccl); this run's ranks are on {dist.device.type}")
    ops = async_ops(impl, executor)
    path = dist.tmp_dir / "ckpt"

    def gpu_state(fill: float) -> dict[str, Any]:
        state = training_state(dist, fill)
        state["model"]["bias"] = state["model"]["bias"].to(dist.device)
        state["model"]["scale"] = state["model"]["scale"].to(dist.device)
        return state

    state = gpu_state(2.0)
    response = async_save(ops, state, path, dist, executor)
    outcome(response.staging_completion, "the staging future", f"rank {dist.rank}")
    train_on(state)
    state["model"]["scale"].mul_(-3)  # a kernel on the current stream, as the next step's
    error = outcome(response.upload_completion, "the completion future", f"rank {dist.rank}")
    if error is not None:
        fail("the async save of GPU state", f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")
    dist.barrier()
    target = gpu_state(-7.0)
    checkpoint_ops(impl).load(target, path, process_group=dist.group)
    assert_same_bits(target, gpu_state(2.0), what=f"the checkpoint of GPU state ({executor}) after training went on")


# -- AS-2 completion means published ---------------------------------------------------------------------------------


@pytest.mark.req("AS-2")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_completion_means_the_checkpoint_loads_whole(dist, impl, executor: str) -> None:
    """Over a previous checkpoint, with the publication held back where the test can (thread executor):
    a load made the moment the completion future resolves, with no barrier, gets the new checkpoint."""
    path = dist.tmp_dir / "ckpt"
    save_and_wait(dist, impl, executor, path, 1.0)
    # Checked at once, like the second save below: and the first save's publication, if it were still
    # to come, would otherwise be the one held back.
    assert_holds(dist, impl, path, 1.0, what=f"the checkpoint when the first completion future resolved ({executor})")
    dist.barrier()
    ops = async_ops(impl, executor)
    with slowed_publication(path, PUBLICATION_DELAY_S):
        response = async_save(ops, training_state(dist, 2.0), path, dist, executor)
        error = outcome(response.upload_completion, "the completion future", f"rank {dist.rank}")
    if error is not None:
        fail("the async save", f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")
    assert_holds(dist, impl, path, 2.0, what=f"the checkpoint when the completion future resolved ({executor})")


@pytest.mark.dcp_format("AS-2 loads the async checkpoint with upstream DCP and the reference")
@pytest.mark.req("AS-2", "ML-25")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_async_checkpoint_loads_with_upstream_and_the_reference(dist, impl, reference_impl, executor: str) -> None:
    """An async save's checkpoint is DCP's format: upstream's ``dcp.load`` and the reference's load each
    read it back whole."""
    import torch.distributed.checkpoint as dcp

    path = dist.tmp_dir / "ckpt"
    save_and_wait(dist, impl, executor, path, 3.0)
    dist.barrier()
    upstream = training_state(dist, -7.0)
    path = dcp_directory(path)  # where the stack wrote DCP's files (a folder of the checkpoint, for some)
    dcp.load(upstream, checkpoint_id=path, process_group=dist.group)
    assert_same_bits(upstream, training_state(dist, 3.0), what="an async checkpoint loaded by upstream's dcp.load")
    reference = training_state(dist, -7.0)
    checkpoint_ops(reference_impl).load(reference, path, process_group=dist.group)
    assert_same_bits(reference, training_state(dist, 3.0), what="an async checkpoint loaded by the reference")


# -- AS-3 the previous checkpoint during the write -------------------------------------------------------------------


@pytest.mark.req("AS-3")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_loads_during_the_background_write_get_one_whole_checkpoint(dist, impl, executor: str) -> None:
    """Over a previous checkpoint: the ranks load the path again and again while the background write
    runs (until every rank's completion future has resolved), the first load right after the call
    returned; each load gets the previous checkpoint or the new one whole, never an error and never a
    mix."""
    path = dist.tmp_dir / "ckpt"
    save_and_wait(dist, impl, executor, path, 1.0)
    dist.barrier()
    ops = async_ops(impl, executor)
    seen: list[str] = []
    with slowed_publication(path, PUBLICATION_DELAY_S):
        response = async_save(ops, training_state(dist, 2.0), path, dist, executor)
        while len(seen) < MAX_LOADS_DURING_WRITE and not on_every_rank(dist, response.upload_completion.done()):
            target = training_state(dist, -7.0)
            error = raised(lambda target=target: checkpoint_ops(impl).load(target, path, process_group=dist.group))  # type: ignore[misc]
            if error is not None:
                seen.append(f"{type(error).__name__}: {error}"[:400])
            elif is_same_bits(target, training_state(dist, 1.0)):
                seen.append("previous")
            elif is_same_bits(target, training_state(dist, 2.0)):
                seen.append("new")
            else:
                seen.append("a mix of the two")
        error = outcome(response.upload_completion, "the completion future", f"rank {dist.rank}")
    if error is not None:
        fail("the async save", f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")
    if any(s not in ("previous", "new") for s in seen):
        fail(f"loads during an async save's background write ({executor})", seen, "each the previous or the new checkpoint, whole", f"rank {dist.rank}")
    if not seen:
        pytest.skip("the background write ended before the first load: nothing was tried (a race this test lost)")


@pytest.mark.req("AS-3")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_an_evaluation_job_loading_during_the_write_gets_one_whole_checkpoint(dist, impl, executor: str) -> None:
    """Over a previous checkpoint: an evaluation job of its own (one process, no group) loads the path
    again and again from before the async save until after it completed; each of its loads gets one
    save's checkpoint whole, never an error and never a mix."""
    import json
    import time

    from conformance import eval_child
    from conformance.child_process import start_child

    impl.require_no_process_group("the evaluation job's loads (one process, no group)")
    path = dist.tmp_dir / "ckpt"
    save_and_wait(dist, impl, executor, path, 1.0)
    ops = async_ops(impl, executor)
    files = {name: dist.tmp_dir / f"eval-{name}" for name in ("ready", "stop", "out")}
    job, stderr = None, ""
    if dist.rank == 0:
        job = start_child(eval_child.main, [impl.spec, str(path), str(dist.world_size), str(files["ready"]), str(files["stop"]), str(files["out"])],
                          description="the evaluation job")
        deadline = time.monotonic() + 40
        while not files["ready"].exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    try:
        with slowed_publication(path, PUBLICATION_DELAY_S):
            response = async_save(ops, training_state(dist, 2.0), path, dist, executor)
            error = outcome(response.upload_completion, "the completion future", f"rank {dist.rank}")
        if error is not None:
            fail("the async save", f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")
    finally:
        if job is not None:
            files["stop"].touch()
            job.wait(timeout=60)
            stderr = job.output
            job.close()
    seen = dist.broadcast_object(json.loads(files["out"].read_text()) if job is not None and files["out"].exists() else None)
    if seen is None:
        output = (stderr or "")[-600:] if job is not None else ""
        fail("the evaluation job", f"no record of its loads: {output}", "a list of what each load got", f"rank {dist.rank}")
    if any(s not in ("fill 1.0", "fill 2.0") for s in seen):
        fail(f"an evaluation job's loads during an async save's background write ({executor})", seen[:8],
             "each the previous or the new checkpoint, whole", f"rank {dist.rank}")


#: Where a child doing an async save over a checkpoint is killed: at its n-th write, fsync or rename
#: under the directory (ops its background makes in the training process; a process executor's writer
#: makes its own elsewhere, so some of these land at publication only, or never).
_ASYNC_KILLS = (("thread", ("write", 2)), ("thread", ("rename", 1)), ("process", ("rename", 1)))


@pytest.mark.req("AS-3")
@pytest.mark.parametrize("executor, kill", _ASYNC_KILLS, ids=[f"{e}-{op}-{n}" for e, (op, n) in _ASYNC_KILLS])
def test_a_killed_async_save_leaves_one_whole_checkpoint(impl: Adapter, tmp_path: Path, executor: str, kill: tuple[str, int]) -> None:
    """A process doing an async save over a checkpoint is killed (SIGKILL) during the background write:
    the directory holds the previous checkpoint whole, or the new one whole; never a mix. One process."""
    async_ops(impl, executor)
    check_after_kill(impl, tmp_path / "ckpt", "overwrite", kill, world=1, killed="all", executor=executor)


@pytest.mark.req("AS-3")
@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_async_save_killed_on_one_rank_of_two_leaves_one_whole_checkpoint(impl: Adapter, tmp_path: Path, executor: str) -> None:
    """Two ranks save a sharded tensor asynchronously over a checkpoint; rank 1 is killed at its second
    write or rename: the directory holds the previous checkpoint whole or the new one whole."""
    async_ops(impl, executor)
    check_after_kill(impl, tmp_path / "ckpt", "overwrite", ("write", 2) if executor == "thread" else ("rename", 1), world=2,
                     killed="1", executor=executor)


# -- AS-4 failures ---------------------------------------------------------------------------------------------------


#: Faults of the background write: the I/O faults of ML-13 (injected into the training process's file
#: I/O, where a thread executor writes), a refusing ``Stateful``, and two of a process executor's writer
#: process: killed, or its disk full (a write past a file size limit set on that process alone fails with
#: ``EFBIG``, as one to a full disk fails with ``ENOSPC``; the writer lives on and must report it). A
#: writer is killed while the rank hands it the save, where the rank's hand-over blocks on the frozen
#: writer: a send that fails halfway.
_FAULTS = ("full-disk-mid-data", "fsync-fails", "read-only", "refusing-stateful", "writer-dies", "writer-disk-full")


@pytest.mark.req("AS-4")
@pytest.mark.rank_timeout(90)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("fault", _FAULTS)
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_a_background_failure_reaches_every_rank(dist, impl, executor: str, fault: str, where: str) -> None:
    """Over a previous checkpoint, an async save meets ``fault`` on every rank or on the last only: the
    completion future of every rank resolves, within seconds, with the same error, naming the path (or
    the call raises so on every rank); the previous checkpoint loads whole; the next async save succeeds;
    the failed save's staging future has resolved too."""
    ops = async_ops(impl, executor)
    if fault in WRITER_FAULTS and executor != "process":
        pytest.skip("a thread executor has no writer process (its full disk is full-disk-mid-data)")
    if fault not in ("refusing-stateful", *WRITER_FAULTS) and executor == "process":
        pytest.skip("faults.py breaks file I/O of the training process; a process executor writes in another "
                    "(its failure is tried as writer-dies)")
    here = bad_input_here(dist, where)
    path = dist.tmp_dir / "ckpt"
    save_and_wait(dist, impl, executor, path, 1.0)
    dist.barrier()
    state: dict[str, Any] = training_state(dist, 2.0)
    if fault == "writer-dies":
        state["handover"] = handover_entries()
    if fault == "refusing-stateful" and here:
        state["loader"] = RefusingStateful()
    elif fault == "refusing-stateful":
        state["loader"] = {"position": 5}

    issued: list[Any] = []  # the failing save's response, when the call returned one
    killed: list[int] = []  # the writer processes killed (writer-dies)
    frozen: list[int] = []  # the writer processes kept from the save before, frozen before this one

    def failing_save() -> None:
        if fault in ("refusing-stateful", *WRITER_FAULTS):
            if fault in WRITER_FAULTS and here:
                # A writer kept from the save before is frozen first, so that the fault meets it with this
                # save's write surely not done (a fresh writer of this save is met once staging completed).
                frozen.extend(signal_writer_processes(signal.SIGSTOP, ops))
            response = async_save(ops, state, path, dist, executor)
            issued.append(response)
            if fault in WRITER_FAULTS and here:
                outcome(response.staging_completion, "the staging future", f"rank {dist.rank}")
                if fault == "writer-disk-full":
                    with file_size_limit(writer_processes(ops), WRITER_FILE_LIMIT) as limited:
                        if not limited:
                            fail("a writer process whose disk to fill", "none: no child process of this rank was spawned by multiprocessing",
                                 "the executor's writer process", f"rank {dist.rank}")
                        signal_writer_processes(signal.SIGCONT, ops)
                        reraise(outcome(response.upload_completion, "the completion future of a failing save", f"rank {dist.rank}"))
                    return
                # A frozen writer is handed more than a socket holds, so the hand-over blocks: killed then,
                # the writer dies inside the rank's send (where the background steps get there in time). A
                # fresh writer of this save is killed at once: it reads its work, and may be done soon.
                if frozen:
                    thread_blocked_writing(HANDOVER_WAIT_S)
                killed.extend(signal_writer_processes(signal.SIGKILL, ops))
                if not killed:
                    fail("a writer process to kill", "none: no child process of this rank was spawned by multiprocessing",
                         "the executor's writer process", f"rank {dist.rank}")
        else:
            with injected_fault(dist, path, fault, "every-rank" if where == "every-rank" else "last-rank"):
                response = async_save(ops, state, path, dist, executor)
                issued.append(response)
                error = outcome(response.upload_completion, "the completion future of a failing save", f"rank {dist.rank}")
            if error is not None:
                raise error
            return
        error = outcome(response.upload_completion, "the completion future of a failing save", f"rank {dist.rank}")
        if error is not None:
            raise error

    error = raised(failing_save)
    try:
        if fault in WRITER_FAULTS and not any(dist.all_gather_object(error is not None)):
            # The fault met the writer before the save handed it the write (the background steps before the
            # write ran late on a loaded machine), and the implementation wrote with a new one: no write
            # failed. That is only so if the save is whole, every rank's, and no killed writer writes now.
            assert_holds(dist, impl, path, 2.0, what=f"an async save whose writer met {fault} before it was handed the write")
            replaced = set(killed) & set(signal_writer_processes(0, ops))
            if replaced:
                fail("the writer processes after a save completed without the killed writer", sorted(replaced), "new ones", f"rank {dist.rank}")
            return
        check_after_a_failure(dist, impl, executor, path, fault, where, error, issued[0].staging_completion if issued else None)
    finally:
        # Whatever this implementation kept of its dead writer is not the next test's. A writer whose
        # disk was full has its limit back and lives on: AS-4.d's next save has shown it still works
        # (where it does not, the test failed and @isolated shuts the implementation down).
        if fault == "writer-dies":
            ops.shutdown()


# -- AS-5 saves in flight --------------------------------------------------------------------------------------------


@pytest.mark.req("AS-5")
@pytest.mark.parametrize("target", ["same-path", "new-path"])
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_a_second_save_while_one_is_in_flight_never_mixes(dist, impl, executor: str, target: str) -> None:
    """Two async saves issued back to back, the second before the first completed (into the same path,
    or the next step's directory): each that completed loads whole with its own values (the same path
    holds the second's), a refused one names its path, and none is lost silently."""
    ops = async_ops(impl, executor)
    first_path = dist.tmp_dir / "ckpt-1"
    second_path = first_path if target == "same-path" else dist.tmp_dir / "ckpt-2"
    first = async_save(ops, training_state(dist, 1.0), first_path, dist, executor)
    issued: list[Any] = []
    refused = raised(lambda: issued.append(async_save(ops, training_state(dist, 2.0), second_path, dist, executor)))
    first_error = outcome(first.upload_completion, "the first save's completion future", f"rank {dist.rank}")
    second_error = refused if refused is not None else outcome(issued[0].upload_completion, "the second save's completion future", f"rank {dist.rank}")
    if first_error is not None:
        fail("the first of two async saves", f"{type(first_error).__name__}: {first_error}"[:400], "success", f"rank {dist.rank}")
    if second_error is not None:
        if ops.concurrent_saves != "refuse":
            fail("the second of two async saves", f"{type(second_error).__name__}: {second_error}"[:400],
                 "success (the adapter declares concurrent_saves='wait')", f"rank {dist.rank}")
        if str(second_path) not in str(second_error):
            fail("a refused second save", str(second_error)[:400], f"an error naming {str(second_path)!r}", f"rank {dist.rank}")
    dist.barrier()
    if target == "new-path":
        assert_holds(dist, impl, first_path, 1.0, what="the first of two async saves in flight")
    assert_holds(dist, impl, second_path, 2.0 if second_error is None else 1.0, what="the last of two async saves in flight")


@pytest.mark.req("AS-5")
@pytest.mark.rank_timeout(30)  # four saves of 16 MiB end in seconds; a writer they broke leaves a future pending
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_staged_copies_stay_bounded(dist, impl, executor: str) -> None:
    """Four async saves of 16 MiB per rank issued back to back without waiting (and then waited for)
    raise the process's peak memory by less than three staged copies: an implementation that holds a
    copy per queued save holds four."""
    ops = async_ops(impl, executor)
    big = torch.rand(4 << 20, generator=torch.Generator().manual_seed(dist.rank))
    state: dict[str, Any] = {"big": big, "step": 0}
    copy_bytes = big.numel() * 4
    responses: list[Any] = []

    def four_saves() -> None:
        for step in range(4):
            state["step"] = step
            responses.append(async_save(ops, state, dist.tmp_dir / "ckpt", dist, executor))
        for response in responses:
            outcome(response.upload_completion, "a completion future", f"rank {dist.rank}", timeout=20)

    grown, measured = peak_bytes_during(dist.device, four_saves)
    errors = [r.upload_completion.exception() for r in responses]
    if any(errors) and ops.concurrent_saves != "refuse":
        fail("four async saves back to back", [str(e)[:200] for e in errors if e], "every one succeeds", f"rank {dist.rank}")
    if grown >= 3 * copy_bytes:
        fail(f"{measured} during four async saves back to back ({executor})", f"+{grown / 2**20:.1f} MiB",
             f"under three staged copies (+{3 * copy_bytes / 2**20:.0f} MiB)", f"rank {dist.rank}")


# -- AS-6 training's collectives ---------------------------------------------------------------------------------------


@pytest.mark.req("AS-6")
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_training_collectives_during_the_background_write(dist, impl, executor: str) -> None:
    """While the background write runs, the training thread makes 30 all-reduces on the group the save
    was given: each returns the sum of what the ranks gave, and the save completes."""
    ops = async_ops(impl, executor)
    response = async_save(ops, training_state(dist, 2.0), dist.tmp_dir / "ckpt", dist, executor)
    wrong = []
    for step in range(30):
        value = torch.full((1024,), float(dist.rank + step), device=dist.device)
        torch_dist.all_reduce(value, group=dist.group)
        expected = float(sum(range(dist.world_size)) + step * dist.world_size)
        if not bool((value == expected).all()):
            wrong.append((step, value[0].item(), expected))
    error = outcome(response.upload_completion, "the completion future", f"rank {dist.rank}")
    if wrong:
        fail("all-reduces of training during an async save", wrong[:5], "each the sum of the ranks' values", f"rank {dist.rank}")
    if error is not None:
        fail("the async save during training's collectives", f"{type(error).__name__}: {error}"[:400], "success", f"rank {dist.rank}")


# -- AS-7 resources ----------------------------------------------------------------------------------------------------


@pytest.mark.req("AS-7")
@pytest.mark.rank_timeout(90)
@pytest.mark.largest_world_size
@isolated
def test_shutdown_ends_a_writer_process_that_does_not_answer(dist, impl) -> None:
    """An async save on the process executor, then every writer process it left is stopped and the
    implementation shut down: ``shutdown`` returns within seconds and no stopped process is left behind;
    the next async save starts afresh and loads. Each stop of :data:`WRITER_STOPS` (SIGSTOP, a debugger
    attaching) is met in one run: rank r stops its writers the r-th way (the ranks of one job are
    stopped both ways at once, as a job's are when one rank is under a debugger), and a job of fewer
    ranks than stops takes one round per stop. (The reference's own defect, fixed at db3507c:
    ``shutdown`` raised on a writer that a stop had frozen, and left it there.)"""
    ops = async_ops(impl, "process")
    stops = list(WRITER_STOPS)
    rounds = 1 if dist.world_size >= len(stops) else len(stops)
    refused: list[str] = []  # a kernel that refuses a rank's debugger its writer: that writer is SIGSTOPped
    for round_ in range(rounds):
        stop = stops[(dist.rank + round_) % len(stops)]
        refused += stop_writers_and_shut_down(dist, impl, ops, stop, dist.tmp_dir / f"round{round_}")
    dist.barrier()
    save_and_wait(dist, impl, "process", dist.tmp_dir / "after", 2.0)
    assert_same_bits(loaded_state(dist, impl, dist.tmp_dir / "after"), training_state(dist, 2.0), what="the save after the shutdown")
    everyone_refused: list[str] = sum(dist.all_gather_object(refused), [])
    if everyone_refused:
        pytest.skip(f"the SIGSTOP case held; the debugger's was not tried: this kernel does not let a rank trace its writer "
                    f"process ({everyone_refused[0]})")


@pytest.mark.req("AS-7")
@pytest.mark.rank_timeout(90)
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_shutdown_releases_threads_processes_and_descriptors(dist, impl, executor: str) -> None:
    """Two async saves, a failed one and a shutdown, twice: once the first round's shutdown returned, no
    process the round started is left; after the second round the process has no
    more threads, child processes or file descriptors than after the first (or, where it has, after a
    third round no more than after the second). The first round starts
    what an implementation starts once per process or grows lazily to a bound (the background's group,
    I/O thread pools, torch's intra-op threads, Python's resource tracker); what a round leaves behind
    shows in the second."""
    ops = async_ops(impl, executor)
    multiprocessing.resource_tracker.ensure_running()

    def one_round(path: Path) -> None:
        for fill in (1.0, 2.0):
            save_and_wait(dist, impl, executor, path, fill)
        refusing = {**training_state(dist, 3.0), "loader": RefusingStateful()}
        issued: list[Any] = []
        raised_at_call = raised(lambda: issued.append(async_save(ops, refusing, path, dist, executor)))
        if raised_at_call is None and outcome(issued[0].upload_completion, "the completion future of a failing save", f"rank {dist.rank}") is None:
            fail("an async save with a refusing Stateful", "succeeded", "an error", f"rank {dist.rank}")
        loaded_state(dist, impl, path)
        dist.barrier()
        ops.shutdown()
        dist.barrier()

    children = set(child_processes())
    one_round(dist.tmp_dir / "first")
    # What the round started is gone once shutdown returned: the no-growth check below alone would pass
    # a shutdown that releases nothing, whose kept writer the next round reuses.
    running = still_running(lambda: [pid for pid in child_processes() if pid not in children])
    left = {pid: child_processes().get(pid, "?") for pid in running}
    if left:
        fail(f"processes a round of async saves ({executor}) started, after shutdown returned", left,
             "none: shutdown releases the writer processes async saves hold", f"rank {dist.rank}")
    before = Resources()
    one_round(dist.tmp_dir / "second")
    grown = settled_growth(before)
    if any(dist.all_gather_object(bool(grown))):
        # A leak grows with every round; a bounded pool's thread that the first round happened not to
        # need (gloo starts some lazily) appears once. Every rank runs the third round together.
        before = Resources()
        one_round(dist.tmp_dir / "third")
        grown = settled_growth(before)
    if grown:
        fail(f"what a round of async saves ({executor}) and a shutdown left", grown, "nothing more than the round before left", f"rank {dist.rank}")


# -- AS-8 a save over a subgroup of the job ----------------------------------------------------------------------------


@pytest.mark.req("AS-8")
@pytest.mark.rank_timeout(60)  # a save that waits for ranks outside its group waits until it is cut
@pytest.mark.largest_world_size
@pytest.mark.parametrize("before", ["first-save", "after-a-save-of-the-job"])
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_an_async_save_over_a_subgroup_involves_its_ranks_alone(dist, impl, executor: str, before: str) -> None:
    """The first half of the ranks (one pipeline stage, one replica) async-saves over a group of its own,
    twice, while the other ranks call nothing of the implementation: each save completes, and the
    checkpoint loads back over that group with the second save's values. An implementation whose
    background machinery is made collectively by every rank of the job (``new_group`` without local
    synchronization) waits for ranks that never come. The implementation starts afresh (shut down), and
    the subgroup's saves are its first, or follow an async save of every rank of the job (a pipeline job
    saves some state over the job and each stage's over its stage): machinery made for the job's group
    and kept (a writer process joined with the other ranks' writers) must not serve the subgroup."""
    if dist.world_size < 2:
        pytest.skip("a subgroup of the job needs two ranks or more")
    async_ops(impl, executor).shutdown()  # what earlier tests left decides nothing here
    if before == "after-a-save-of-the-job":
        save_and_wait(dist, impl, executor, dist.tmp_dir / "job", 1.0)
    savers = list(range(dist.world_size // 2))
    group = torch_dist.new_group(savers)  # made by every rank of the job, as new_group asks
    path = dist.tmp_dir / "stage-0"
    for fill in (2.0, 3.0):  # the second save reuses what the first made for the group
        failed = subgroup_save(dist, impl, executor, group, savers, path, fill)
        if failed:
            fail(f"an async save over ranks {savers} of {dist.world_size} ({executor}, fill {fill})", failed,
                 "success on each of them", f"rank {dist.rank}")
    if dist.rank in savers:
        target = full_training_state(len(savers), -7.0)
        checkpoint_ops(impl).load(target, path, process_group=group)
        assert_same_bits(target, full_training_state(len(savers), 3.0), what=f"the checkpoint ranks {savers} saved over their group")
    # The job goes on: a group every rank makes next joins them all. (A group the savers made without
    # local synchronization put their count of groups ahead of the others': the names differ, and the
    # next group every rank makes meets no one.)
    check_next_group_of_the_job(dist, "after an async save over a subgroup")


@pytest.mark.req("AS-8")
@pytest.mark.rank_timeout(60)  # a save whose ranks never meet waits until it is cut
@pytest.mark.world_size(min=3)
@pytest.mark.parametrize("executor", EXECUTORS)
@isolated
def test_async_saves_over_overlapping_subgroups_each_involve_their_ranks_alone(dist, impl, executor: str) -> None:
    """Ranks 0 and 1 async-save over a group of their own, then ranks 1 and 2 over theirs (rank 1 in both,
    as a rank is in a tensor-parallel and a data-parallel group), the other ranks calling nothing: each
    save completes and loads back over its group, and the job's next group joins every rank. Background
    machinery named by what each rank made before (``new_group`` with local synchronization counts the
    groups a rank has made) gets another name on rank 1 than on rank 2 after the first save, and the
    second save waits for ever."""
    async_ops(impl, executor).shutdown()  # what earlier tests left decides nothing here
    groups = {savers: torch_dist.new_group(list(savers)) for savers in ((0, 1), (1, 2))}  # by every rank, as new_group asks
    for fill, (savers, group) in enumerate(groups.items(), start=2):
        path = dist.tmp_dir / f"ranks-{savers[0]}-{savers[1]}"
        failed = subgroup_save(dist, impl, executor, group, list(savers), path, float(fill))
        if failed:
            fail(f"an async save over ranks {list(savers)} of {dist.world_size} ({executor}) after one over "
                 f"{list(next(iter(groups)))}" if fill > 2 else f"an async save over ranks {list(savers)} ({executor})",
                 failed, "success on each of them", f"rank {dist.rank}")
        if dist.rank in savers:
            target = full_training_state(len(savers), -7.0)
            checkpoint_ops(impl).load(target, path, process_group=group)
            assert_same_bits(target, full_training_state(len(savers), float(fill)), what=f"the checkpoint ranks {list(savers)} saved over their group")
    check_next_group_of_the_job(dist, "after async saves over two overlapping subgroups")
