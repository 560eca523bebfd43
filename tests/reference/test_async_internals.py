"""The reference's async save from the inside: the stager's arena and its reuse, how staged tensors
reach the writer process, and the argument checks. The requirements themselves are SPEC's AS section,
checked against every adapter by ``conformance/test_async_save.py``."""

from __future__ import annotations

import importlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from reference import checkpoint
from reference.checkpoint.staging import ARENA_ALIGNMENT, Stager
from reference.checkpoint.writer_process import _reference, _resolve

#: The module, which the package's ``async_save`` function shadows.
async_save_module = importlib.import_module("reference.checkpoint.async_save")


def _state(fill: float) -> dict:
    return {
        "a": torch.full((3, 5), fill),
        "b": [torch.arange(7, dtype=torch.int64), torch.tensor(fill, dtype=torch.bfloat16)],
        "empty": torch.empty(0, 4),
        "step": int(fill),
        "nested": {"lr": fill, "history": [fill]},
    }


@pytest.mark.parametrize("shared", [False, True])
def test_staged_state_is_a_copy_in_one_reused_arena(shared: bool) -> None:
    stager = Stager(shared=shared, pin=False)
    source = _state(1.0)
    staged = stager.stage(source).state_dict
    arena = stager.arena
    assert arena is not None and (arena.fd is not None) == shared
    source["a"].add_(5)
    source["nested"]["history"].append(2.0)
    assert torch.equal(staged["a"], torch.full((3, 5), 1.0)) and staged["nested"]["history"] == [1.0]
    start = arena.bytes.data_ptr()
    for tensor in (staged["a"], *staged["b"]):
        offset = tensor.data_ptr() - start
        assert 0 <= offset < arena.bytes.numel() and offset % ARENA_ALIGNMENT == 0
        # The storage writer writes a tensor's whole storage: each staged tensor's is exactly its bytes.
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    again = stager.stage(_state(2.0)).state_dict
    assert stager.arena is arena, "a save of the same layout refills the same arena"
    assert torch.equal(again["a"], torch.full((3, 5), 2.0))
    changed = _state(3.0)
    changed["a"] = torch.zeros(4, 4)
    stager.stage(changed)
    assert stager.arena is not arena and arena.fd is None, "a new layout gets a new arena; the old one is released"
    stager.release()
    assert stager.arena is None and stager.staged_bytes == 0


def test_meta_tensors_cannot_be_staged() -> None:
    with pytest.raises(ValueError, match="'model.w'"):
        Stager(pin=False).stage({"model": {"w": torch.empty(2, device="meta")}})


def test_tensors_reach_the_writer_process_by_their_place_in_the_arena() -> None:
    stager = Stager(shared=True, pin=False)
    staged = stager.stage({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}).state_dict["w"]
    arena = stager.arena
    assert arena is not None
    for view in (staged, staged[1:3], staged.t(), staged[:, 2]):
        ref = _reference(view, arena)
        assert ref[0] == "arena" and ref[1] == arena.id
        assert torch.equal(_resolve(ref, {arena.id: arena.bytes}), view)
    outside = torch.tensor([1.5, -0.0], dtype=torch.bfloat16)
    ref = _reference(outside, arena)
    assert ref[0] == "bytes"
    assert torch.equal(_resolve(ref, {}), outside)


def test_async_save_without_a_directory_is_an_argument_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_id"):
        checkpoint.async_save({"a": torch.ones(1)})
    with pytest.raises(ValueError):
        checkpoint.async_save({"a": torch.ones(1)}, checkpoint_id=tmp_path, async_checkpointer_type="gpu")  # type: ignore[arg-type]


def test_a_second_save_waits_for_the_first_and_each_holds_its_own_values(tmp_path: Path) -> None:
    weight = torch.full((1 << 16,), 1.0)
    state: dict[str, Any] = {"w": weight, "step": 1}
    first = checkpoint.async_save(state, checkpoint_id=tmp_path / "one")
    weight.fill_(2.0)
    state["step"] = 2
    second = checkpoint.async_save(state, checkpoint_id=tmp_path / "two")
    assert first.done(), "the second call returns only once the first save has ended"
    second.result()
    for name, fill in (("one", 1.0), ("two", 2.0)):
        loaded: dict[str, Any] = {"w": torch.zeros(1 << 16), "step": 0}
        checkpoint.load(loaded, checkpoint_id=tmp_path / name)
        assert torch.equal(loaded["w"], torch.full((1 << 16,), fill)) and loaded["step"] == int(fill)
    checkpoint.async_shutdown()


def test_shutdown_closes_the_arena_descriptor(tmp_path: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    checkpoint.async_save({"w": torch.ones(1024)}, checkpoint_id=tmp_path,
                          async_checkpointer_type=checkpoint.AsyncCheckpointerType.PROCESS).result()
    checkpoint.async_shutdown()
    left = {fd for fd in set(os.listdir("/proc/self/fd")) - before if os.path.exists(f"/proc/self/fd/{fd}")}
    memfds = [os.readlink(f"/proc/self/fd/{fd}") for fd in left if "memfd" in os.readlink(f"/proc/self/fd/{fd}")]
    assert not memfds, memfds


def test_the_writer_process_leaves_ctrl_c_to_the_rank(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the terminal's process group. The writer process ignores it, so
    what an interrupted save does is the rank's to decide: the writer stays alive and writes the next
    save (a writer that died of it would fail that save, or be replaced by a fresh one)."""
    process = checkpoint.AsyncCheckpointerType.PROCESS
    checkpoint.async_save({"w": torch.ones(8)}, checkpoint_id=tmp_path / "one", async_checkpointer_type=process).result()
    writer = async_save_module._SAVER.writer
    assert writer is not None and writer.alive
    os.kill(writer.process.pid, signal.SIGINT)
    writer.process.join(0.5)  # returns at once where the signal ended it
    assert writer.alive, f"the writer process ended on SIGINT (exit status {writer.process.exitcode})"
    checkpoint.async_save({"w": torch.full((8,), 2.0)}, checkpoint_id=tmp_path / "two", async_checkpointer_type=process).result()
    assert async_save_module._SAVER.writer is writer
    loaded = {"w": torch.zeros(8)}
    checkpoint.load(loaded, checkpoint_id=tmp_path / "two")
    assert torch.equal(loaded["w"], torch.full((8,), 2.0))
    checkpoint.async_shutdown()


def _stopped_writer(tmp_path: Path) -> Any:
    """The process executor's writer after a save, stopped with SIGSTOP."""
    process = checkpoint.AsyncCheckpointerType.PROCESS
    checkpoint.async_save({"w": torch.ones(8)}, checkpoint_id=tmp_path, async_checkpointer_type=process).result()
    writer = async_save_module._SAVER.writer
    assert writer is not None
    os.kill(writer.process.pid, signal.SIGSTOP)
    return writer


def _closed(writer: Any, timeout: float) -> int:
    """Close ``writer``; its exit status, once it is reaped."""
    process = writer.process
    pid, release, exitcodes = process.pid, process.close, []

    def close() -> None:  # the status, read before close() releases the Process object
        exitcodes.append(process.exitcode)
        release()

    process.close = close
    try:
        writer.close(timeout=timeout)
    finally:
        async_save_module._SAVER.writer = None
    [exitcode] = exitcodes
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended and reaped
    checkpoint.async_shutdown()
    return exitcode


def test_shutdown_continues_a_stopped_writer_process_and_lets_it_end(tmp_path: Path) -> None:
    """A writer stopped as Ctrl-Z stops it is continued and ends when asked (exit status 0), without
    waiting for the timeouts to terminate or kill it."""
    assert _closed(_stopped_writer(tmp_path), timeout=60.0) == 0


def test_shutdown_kills_a_writer_process_that_does_not_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that neither ends when asked nor on SIGTERM (stopped, and not continued by SIGCONT, as a
    debugger's stop is not) is killed: shutdown returns, with no writer process left behind."""
    writer = _stopped_writer(tmp_path)
    kill = os.kill
    monkeypatch.setattr(os, "kill", lambda pid, signum: None if signum == signal.SIGCONT else kill(pid, signum))
    assert _closed(writer, timeout=0.2) == -signal.SIGKILL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA staging needs a GPU; none is visible")
def test_cuda_staging_copies_into_pinned_memory_on_the_current_stream() -> None:
    weight = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    stager = Stager()
    staged = stager.stage({"w": weight, "step": 4})
    assert stager.arena is not None and stager.arena.bytes.is_pinned()
    assert staged.copies_done is not None, "copies from the GPU are waited for through an event"
    weight.add_(5)  # queued after the copies on the same stream: never in the staged copy
    staged.wait()
    assert torch.equal(staged.state_dict["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert staged.state_dict["w"].device.type == "cpu"
    stager.release()


def test_a_load_that_a_publication_overtakes_starts_again_from_the_new_metadata(tmp_path: Path) -> None:
    """AS-3 at the reference's load: a save publishes over the checkpoint (and removes the old files)
    between the load's planning and its reading; the load starts again and gets the new checkpoint."""
    from reference.checkpoint import FileSystemReader, wait_for_removals

    checkpoint.save({"w": torch.full((64,), 1.0), "step": 1}, checkpoint_id=tmp_path)

    class Overtaken(FileSystemReader):
        reads = 0

        def read_data(self, plan: Any, planner: Any) -> Any:
            Overtaken.reads += 1
            if Overtaken.reads == 1:  # the publication lands after this load planned from the old metadata
                checkpoint.save({"w": torch.full((64,), 2.0), "step": 2}, checkpoint_id=tmp_path)
                wait_for_removals()
            return super().read_data(plan, planner)

    loaded: dict[str, Any] = {"w": torch.zeros(64), "step": 0}
    checkpoint.load(loaded, checkpoint_id=tmp_path, storage_reader=Overtaken())
    assert Overtaken.reads == 2
    assert torch.equal(loaded["w"], torch.full((64,), 2.0)) and loaded["step"] == 2


def test_a_load_failing_under_unchanged_metadata_is_not_retried(tmp_path: Path) -> None:
    checkpoint.save({"w": torch.full((64,), 1.0)}, checkpoint_id=tmp_path)
    for data_file in tmp_path.glob("*.distcp"):
        data_file.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="distcp"):
        checkpoint.load({"w": torch.zeros(64)}, checkpoint_id=tmp_path)
