"""ML-31 to ML-33: what the first stacks that are not torch taught the suite (issue 46). A list that mixes
tensors and other values round trips (megatron-core saves one and refuses to load it); a save and a load
leave no process behind (megatron-core left a ``multiprocessing`` manager per save); and a load that one
rank cannot read fails on every rank alike (megatron-core raised on that rank while the other walked into
a collective and hung). Each holds for every stack, whatever its on-disk format."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from torch.distributed.tensor import Shard

from conformance.adapters.base import Adapter
from conformance.asserts import check_each, fail, raised, reraise
from conformance.checkpoint_stacks_support import GRACE_S, mixed_lists
from conformance.checkpoint_support import (
    assert_round_trips,
    assert_same_bits,
    call_or_skip,
    checkpoint_ops,
    dtensor_of,
    fails_alike,
    group_of,
    proves_round_trip,
)
from conformance.error_cases import bad_input_here, parametrize_where
from conformance.faults import failing_reads
from conformance.processes import child_processes
from conformance.rank_context import RankContext


@pytest.mark.req("ML-31")
def test_lists_mixing_tensors_and_values_round_trip(dist: RankContext, impl: Adapter) -> None:
    """Lists and tuples whose items mix plain tensors, a DTensor, numbers, strings, None and nested
    containers, saved and loaded into a state dict of the same layout whose every value differs: every
    item comes back bit for bit, lists as lists and tuples as tuples, the DTensor's local shard its
    documented piece on every rank."""
    assert_round_trips(dist, impl, lambda fill: mixed_lists(dist, fill), 3.0, -11.0, what="lists mixing tensors and values")


@pytest.mark.req("ML-32")
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux) to list child processes")
def test_a_save_and_a_load_leave_no_process_behind(dist: RankContext, impl: Adapter) -> None:
    """A save and a load, then each rank lists its child processes, then three more saves and loads: every
    process a call started has ended within seconds of its return, so the list has not grown (a helper
    process per save, a pool left running, piles up over a job's thousands of saves). What the first
    round started and the stack reuses (a server process per process, as megatron-core's results
    queue) is in the list already. Writer processes of async saves are AS's (AS-7: ``shutdown``); a
    synchronous call owns none."""
    ops = checkpoint_ops(impl)

    def round_trip(step: int) -> None:
        state = {"w": dtensor_of(torch.full((4 * dist.world_size, 2), float(step)), dist.mesh(), [Shard(0)]), "step": step}
        ops.save(state, dist.tmp_dir / f"ckpt-{step}", process_group=group_of(dist))
        target = {"w": dtensor_of(torch.zeros(4 * dist.world_size, 2), dist.mesh(), [Shard(0)]), "step": -1}
        call_or_skip(lambda: ops.load(target, dist.tmp_dir / f"ckpt-{step}", process_group=group_of(dist)))
        assert_same_bits(target, {"w": dtensor_of(torch.full((4 * dist.world_size, 2), float(step)), dist.mesh(), [Shard(0)]), "step": step})

    round_trip(0)
    before = child_processes()
    for step in range(1, 4):
        round_trip(step)
    deadline = time.monotonic() + GRACE_S
    left = {pid: cmd for pid, cmd in child_processes().items() if pid not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {pid: cmd for pid, cmd in child_processes().items() if pid not in before}
    if left:
        fail("processes left running after three saves and three loads", left, "none", f"rank {dist.rank}, {GRACE_S:.0f} s after the last call")


@pytest.mark.req("ML-33")
@pytest.mark.rank_timeout(40)
@parametrize_where
@pytest.mark.parametrize("how", ["vanish", "truncate"])
def test_a_load_one_rank_cannot_read_fails_alike_on_every_rank(dist: RankContext, impl: Adapter, how: str, where: str) -> None:
    """A good checkpoint whose every file, metadata included, the last rank (or every rank) cannot
    read from the start of the load: gone (its mount dropped) or cut short after 16 bytes (a copy in
    progress). Whatever the stack reads first, every rank raises the same error, naming a file of the
    checkpoint, within seconds and without a rank waiting in a collective; no entry of the state dict is replaced. A
    save and load with nothing wrong succeed first."""
    proves_round_trip(dist, impl)
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(8))
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "note": "saved"}, path, process_group=group_of(dist))
    dist.barrier()
    target = {"w": dtensor_of(torch.zeros_like(full), dist.mesh(), [Shard(0)]), "note": ""}
    entries = dict(target)
    here = bad_input_here(dist, where)
    start = time.monotonic()
    with failing_reads(path, how, which=lambda name: True) if here else contextlib.nullcontext():
        exc = raised(lambda: call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist))))
    elapsed = time.monotonic() - start
    files = sorted(p.name for p in path.iterdir())

    def agreed() -> None:
        fails_alike(dist, lambda: reraise(exc), what=f"a load the {'last rank' if where == 'one-rank' else 'ranks'} cannot read ({how})")
        if not any(name in str(exc) for name in files):
            fail("the error names no file of the checkpoint", str(exc)[:600], f"one of {files}", f"rank {dist.rank}")
        if elapsed >= 30:
            fail("the error took too long", f"{elapsed:.0f} s", "within seconds", f"rank {dist.rank}")

    def replaces_nothing() -> None:  # a tensor may be filled in place before the failure (ML-20); no entry is replaced
        replaced = sorted(k for k in entries if target.get(k) is not entries[k] or (k == "note" and target[k] != ""))
        if replaced or set(target) != set(entries):
            fail("entries replaced by the failed load", replaced or sorted(target), "none", f"rank {dist.rank}")

    check_each({"ML-33.a": agreed, "ML-33.b": replaces_nothing})
