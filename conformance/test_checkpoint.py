"""ML: distributed checkpoints, meta-tensor loading and resharding (SPEC.md, section ML).

Oracles: the values that were saved (round trips, compared bit for bit and, for DTensors, on every
rank against the documented layout of the full saved value), the other implementation
(cross-implementation), and the unsharded zoo model trained identically in one process (resharding
of training state). Every load goes into a state dict that differs from the saved one in every value
it must change: tensors with other bits (:func:`conformance.values.different_like`), non-tensor values
of another value, optimizer param groups with every hyperparameter perturbed, or meta tensors.

Every error requirement is checked twice where ranks can disagree: when every rank sees the bad input
and when only one rank does ("one-rank": the last rank, or for a damaged data file the rank that alone
reads it); then every rank must raise the same error,
promptly (``rank_timeout``), and leave its state dict as it was. At world size 1 the one-rank case is
the every-rank case and is skipped as such.

The inspector's requirements (ML-16, ML-17) are tested in ``tests/test_ckpt_inspect.py``.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance import models
from conformance.adapters.base import Adapter
from conformance.asserts import (
    assert_bitwise_equal,
    assert_local_shard,
    assert_same_error_on_every_rank,
    assert_unchanged,
    check_each,
    clause,
    expected_local_chunk,
    fail,
    raised,
    reraise,
    snapshot,
)
from conformance.checkpoint_crafted_support import (
    CODE_ROUTES,
    LAYOUT_ROUTE,
    NAME_LIES,
    RAN_ENV,
    crafted_pickle,
    crafted_record,
    extension_for_exec,
    repacked_record,
    replace_record,
    reverse_chunks,
)
from conformance.checkpoint_failing_load_support import (
    GOOD,
    MISMATCHES,
    STEPS,
    MarkedTensor,
    StepCase,
    asking_for,
    error_checkpoint,
    load_with_faults,
    most_specific_common_types,
    names_the_failure,
    skeleton_of,
    stateful_states,
    step_state,
)
from conformance.checkpoint_format_support import format_load, format_save
from conformance.checkpoint_job_support import described_by_states, job_model, job_optim, job_paths, listed_in_metadata, one_property_state
from conformance.checkpoint_kill_support import check_after_kill, child_save, kill_points, proves_a_save_loads, two_rank_kills
from conformance.checkpoint_models_support import (
    assert_meta_load_rebuilds,
    check_built,
    fsdp2_model,
    load_tp,
    load_training,
    save_tp,
    save_training,
    tp_model,
    zoo_model,
)
from conformance.checkpoint_support import (
    DAMAGED_RECORDS,
    SAVE_FAULTS,
    assert_local_shards,
    assert_round_trips,
    assert_same_bits,
    bad_checkpoint_b,
    call_or_skip,
    checkpoint_ops,
    damage,
    data_files_of,
    dtensor_of,
    fails_alike,
    group_of,
    injected_fault,
    is_same_bits,
    mesh_2d_of,
    peak_bytes_during,
    proves_round_trip,
    record_location,
    sharded_values,
)
from conformance.checkpoint_values_support import (
    KINDS,
    RECORD_OVERHEAD,
    State,
    large_model_state,
    meta_like,
    mixed_state,
    objects,
    outside_bytes,
    state_of,
    target_like,
)
from conformance.dcp_files import dcp_directory, read_metadata
from conformance.error_cases import EVERY_RANK, ONE_RANK, WHERE, bad_input_here, parametrize_where
from conformance.faults import before_first_read, failing_reads, failing_writes
from conformance.scale_support import counting_opens
from conformance.values import different_like, edge_tensors


@pytest.mark.req("ML-1")
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_restores_every_value(dist, impl, kind: str) -> None:
    """Save edge values of every dtype (NaN payloads, -0.0, inf, float64 beyond float32, int64 beyond
    2**53, 0-d, empty, non-contiguous and offset views), as plain tensors and as DTensors of every
    dtype (Shard/Replicate, uneven, empty local shards, 1-D and 2-D meshes), and non-tensor values
    of every kind; load into a state dict of the same layout whose every value differs; compare bit
    for bit, and each DTensor's local shard on every rank against the documented layout."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = state_of(dist, kind, "saved")
    ops.save(saved.values, path, process_group=group_of(dist))
    target = state_of(dist, kind, "target")
    call_or_skip(lambda: ops.load(target.values, path, process_group=group_of(dist)))
    assert_local_shards(dist, target.values, saved.fulls, what="loaded")
    assert_same_bits(target.values, state_of(dist, kind, "saved").values)


@pytest.mark.req("ML-1")
@pytest.mark.world_size(min=2)
def test_a_state_dict_of_thousands_of_entries_round_trips(dist, impl) -> None:
    """2,560 entries, named as a transformer's model and optimizer state (80 layers of eight
    parameters, each with two states and a step): every value loads back, each DTensor's local shard
    on every rank. What the ranks exchange to plan such a save (each rank's items, by name) outgrows
    a small fixed buffer an implementation might carry it in (the reference's frames of 64 KiB send
    the rest point to point); one that cuts it short or drops what did not fit loads wrong values or
    fails. At one rank nothing is exchanged: ML-1's other tests cover it."""
    assert_round_trips(dist, impl, lambda offset: large_model_state(dist, int(offset)), 0, -100_000, what="a large model's state")


@pytest.mark.dcp_format("ML-2 loads a checkpoint of one implementation with the other (the reference reads and writes DCP's format)")
@pytest.mark.req("ML-2")
@pytest.mark.parametrize("saver", ["impl-saves", "reference-saves"])
def test_checkpoint_loads_across_implementations(dist, impl, reference_impl, saver: str) -> None:
    """Every kind of value (edge tensors, edge DTensors on 1-D and 2-D meshes, non-tensor values) in
    one nested state dict, saved by one implementation and loaded by the other into a state dict
    whose every value differs; bitwise, with per-rank local shards."""
    if impl.name == reference_impl.name and saver == "reference-saves":
        pytest.skip("for the reference itself this is the impl-saves case")
    ops, ref = checkpoint_ops(impl), checkpoint_ops(reference_impl)
    writer, reader = (ops, ref) if saver == "impl-saves" else (ref, ops)
    path = dist.tmp_dir / "ckpt"
    saved = mixed_state(dist, "saved", seed=2)
    writer.save(saved.values, path, process_group=group_of(dist))
    target = mixed_state(dist, "target", seed=2)
    # The implementation loads the path it is given; the reference reads the DCP files the stack wrote there.
    read_at = path if reader is ops else dcp_directory(path)
    call_or_skip(lambda: reader.load(target.values, read_at, process_group=group_of(dist)))
    assert_local_shards(dist, target.values, saved.fulls, what="loaded")
    assert_same_bits(target.values, mixed_state(dist, "saved", seed=2).values)


_ROUTES = ["impl-to-impl", "reference-to-impl", "impl-to-reference"]


@pytest.mark.req("ML-2", "ML-8")
@pytest.mark.parametrize("route", _ROUTES)
def test_reshard_tensor_parallel_model(pools, world_size_pair, impl, reference_impl, tmp_path: Path, route: str) -> None:
    """The grid of saver x loader x (saved world size, loaded world size), on the uneven TP model
    loaded into meta: each rank's local shard is its documented piece of the saved model's value."""
    if impl.name == reference_impl.name and route != "impl-to-impl":
        pytest.skip("for the reference itself this route is impl-to-impl")
    if route != "impl-to-impl":
        impl.require_format("dcp", "ML-2 loads a checkpoint of one implementation with the other")
    saver, loader = (reference_impl if part == "reference" else impl for part in route.split("-to-"))
    saved_at, loaded_at = world_size_pair
    pools.run(saved_at, save_tp, saver, str(tmp_path / "ckpt"))
    # The implementation loads the path it saved to; the reference reads the DCP files the stack wrote there.
    pools.run(loaded_at, load_tp, loader, str(tmp_path / "ckpt" if loader is impl else dcp_directory(tmp_path / "ckpt")))


@pytest.mark.dcp_files("ML-3 is checked in DCP's metadata (the chunks and records per key)")
@pytest.mark.req("ML-3")
def test_replicated_data_is_written_once(dist, impl) -> None:
    """Checked in the metadata, on rank 0: the chunks each key lists, the records stored per key, and that
    the chunks tile the tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata


    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    mesh_2d = mesh_2d_of(dist)
    sd = {
        "plain": torch.arange(12.0).reshape(3, 4),
        "replicated": dtensor_of(torch.arange(15.0), dist.mesh(), [Replicate()]),
        "replicate_shard": dtensor_of(torch.arange(30.0).reshape(10, 3), mesh_2d, [Replicate(), Shard(0)]),
    }
    ops.save(sd, path, process_group=group_of(dist))
    if dist.rank != 0:
        return
    md = read_metadata(path)
    # Only the keys saved: a record of the stack's own (megatron-core's common state) is not about ML-3.
    chunks = {k: v.chunks for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata) and k in sd}
    expected = {"plain": 1, "replicated": 1, "replicate_shard": min(mesh_2d.size(1), 10)}
    got = {k: len(v) for k, v in chunks.items()}
    if got != expected:
        fail("chunks per key in the metadata", got, expected, str(path))
    stored: dict[str, int] = {}
    for index in md.storage_data:
        if index.fqn in sd:
            stored[index.fqn] = stored.get(index.fqn, 0) + 1
    if stored != expected:
        fail("stored records per key", stored, expected, str(path))
    for key, key_chunks in chunks.items():
        volume = sum(math.prod(c.sizes) for c in key_chunks)
        if volume != sd[key].numel():
            fail("the saved chunks do not tile the tensor", f"{volume} elements", f"{sd[key].numel()}", key)


@pytest.mark.req("ML-4")
def test_meta_load_builds_every_value(dist, impl) -> None:
    """Edge values of every dtype, plain (views too) and as DTensors on 1-D and 2-D meshes, loaded into
    meta tensors of the same layout: each becomes a tensor on the process group's device with the
    saved bits, each DTensor keeping its layout and holding its documented local shard. The first
    value of each kind is a meta Parameter (as a model's own tensors are, FSDP2's DTensor ones too):
    it comes back a Parameter, and the others plain tensors."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    kinds = ("plain", "dtensor-1d", "dtensor-2d")
    saved = {kind: state_of(dist, kind, "saved") for kind in kinds}
    ops.save({kind: state.values for kind, state in saved.items()}, path, process_group=group_of(dist))
    target = {kind: state_of(dist, kind, "meta").values for kind in kinds}
    first = {kind: next(iter(target[kind])) for kind in kinds}
    for kind, key in first.items():
        target[kind][key] = torch.nn.Parameter(target[kind][key], requires_grad=False)
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    for kind in kinds:
        check_built(dist, target[kind], saved[kind], parameters=frozenset({first[kind]}))


@pytest.mark.req("ML-4")
def test_meta_load_tensor_parallel_model(dist, impl) -> None:
    """PR #113319's test: a tensor-parallel model with uneven shards, loaded into a meta copy."""
    ops = checkpoint_ops(impl)
    model = tp_model(dist, seed=5, device=dist.device)
    assert_meta_load_rebuilds(dist, ops, "mlp", model, lambda: tp_model(dist, seed=0, device="meta"))


@pytest.mark.req("ML-4")
@pytest.mark.parametrize("name", ["mlp", "nested", "groups", "dtypes"])
def test_meta_load_fsdp2_model(dist, impl, name: str) -> None:
    """An FSDP2 model (``dtypes``: float64 parameters, a buffer per edge dtype) loaded into a meta copy."""
    ops = checkpoint_ops(impl)
    model = fsdp2_model(dist, name, seed=6, device=dist.device)
    assert_meta_load_rebuilds(dist, ops, name, model, lambda: fsdp2_model(dist, name, seed=0, device="meta"))


@pytest.mark.req("ML-5")
def test_meta_load_keeps_tied_storage_shared(dist, impl) -> None:
    """Zoo ``tied`` built on meta: after the load its two tied entries are built with the saved bits and
    share one storage; the model assigned from them (re-tied) computes what the saved model computes,
    and one SGD step of each on the same batch leaves them equal bit for bit (checked even when the
    storages are not shared: a loader that builds only the first name of a tie fails there)."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    model = models.build("tied", seed=2, device=dist.device)
    ops.save(model.state_dict(), path, process_group=group_of(dist))

    meta_model = zoo_model(dist, "tied", seed=0, device="meta")
    sd = meta_model.state_dict()
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))

    def shared() -> None:
        check_built(dist, sd, State(model.state_dict(), {}))
        embed, head = sd["embed.weight"].untyped_storage().data_ptr(), sd["head.weight"].untyped_storage().data_ptr()
        if embed != head:
            fail("tied values shared a storage on meta but not after loading", f"{hex(embed)} and {hex(head)}", "one storage",
                 "embed.weight, head.weight")

    def retied() -> None:
        meta_model.load_state_dict(sd, assign=True)
        meta_model.get_submodule("head").weight = meta_model.get_parameter("embed.weight")  # assign=True makes one Parameter per key: re-tie
        inputs = models.batch("tied", seed=1, device=dist.device)
        assert_bitwise_equal(meta_model(inputs).detach(), model(inputs).detach(), what="output of the re-tied model")
        for m in (model, meta_model):
            models.train_step(m, torch.optim.SGD(m.parameters(), lr=0.1), inputs)
        after = meta_model.state_dict()
        for key, value in model.state_dict().items():
            assert_bitwise_equal(after[key], value, what="the re-tied model after one step vs the saved model after one", where=key)

    check_each({"ML-5.a": shared, "ML-5.b": retied})


@pytest.mark.req("ML-6")
@pytest.mark.rank_timeout(30)
@parametrize_where
def test_meta_value_of_unknown_type_is_an_error(dist, impl, where: str) -> None:
    """A meta tensor subclass under ``proj.weight`` (on every rank, or on the last rank only while the
    others hold a plain meta tensor): every rank raises the same error naming the key and the type,
    and the state dict, meta entries and their identities, is unchanged on every rank."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(error_checkpoint(), path, process_group=group_of(dist))
    weight = torch.empty(4, 3, device="meta")
    sd = {"proj.weight": weight.as_subclass(MarkedTensor) if bad_input_here(dist, where) else weight,
          "proj.bias": torch.empty(2, device="meta")}
    before = snapshot(state_dict=sd)
    exc = raised(lambda: ops.load(sd, path, process_group=group_of(dist)))
    check_each({
        "ML-6.a": lambda: fails_alike(dist, lambda: reraise(exc), keys=("proj.weight",), needles=("MarkedTensor",),
                                      what="load into a meta MarkedTensor"),
        "ML-6.b": lambda: assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}"),
    })


@pytest.mark.req("ML-7")
@pytest.mark.parametrize("records, rows, cols", [(1, 4096, 4096), (64, 256, 1024)], ids=["one-record", "many-records"])
def test_meta_load_allocates_local_shards_once(dist, impl, records: int, rows: int, cols: int) -> None:
    """Measured on a 64 MiB-per-rank meta load (one record as large as the shards, or 64 of 1 MiB), on the
    device the shards are built on: RSS on the CPU, the allocator's peak on a GPU. A loader that reads a
    whole data file (or every record) before building the shards, or keeps a copy of each, needs about
    twice."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    gen = torch.Generator().manual_seed(0)
    saved = {f"w{i:02d}": dtensor_of(torch.randn(rows * dist.world_size, cols, generator=gen), dist.mesh(), [Shard(0)]) for i in range(records)}
    ops.save(saved, path, process_group=group_of(dist))
    local_bytes = sum(v.to_local().numel() * 4 for v in saved.values())
    sd = {k: dtensor_of(torch.empty(rows * dist.world_size, cols, device="meta"), dist.mesh(), [Shard(0)]) for k in saved}
    peak, measured = peak_bytes_during(dist.device, lambda: call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist))))
    for key, value in sd.items():
        if value.to_local().device != dist.device:
            fail("the meta load built a shard on another device", value.to_local().device, dist.device, f"{key}, rank {dist.rank}")
        assert_bitwise_equal(value.to_local(), saved[key].to_local(), what="local shard loaded into meta", where=f"{key}, rank {dist.rank}")
    if peak >= 1.5 * local_bytes:
        fail(f"a load of {records} record(s) into meta raised the {measured} too much", f"{peak / 2**20:.1f} MiB",
             f"below 1.5 x {local_bytes / 2**20:.1f} MiB of local shards", f"rank {dist.rank}")


@pytest.mark.req("ML-39")
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_a_save_writes_host_tensors_from_their_own_memory(dist, impl, layout: str) -> None:
    """A save of 32 MiB per rank of CPU tensors (4 of 8 MiB, each replicated on every rank or a shard of
    a DTensor) raises the process's peak RSS by less than a third of those bytes: it writes each
    tensor, or the piece of it this rank writes, from the tensor's own memory, or copies one at a time.
    A save that copies each piece before writing and keeps the copies until its files are written (the
    reference's own defect, fixed at 8f1df9f; torch's writer keeping every staged tensor until its file
    ends, pytorch/pytorch#195982), or stages the whole state to host memory first (megatron-core's
    synchronous save, radixark/Megatron-LM PR #61), needs about as much again as the state."""
    if dist.device.type != "cpu":
        pytest.skip("a save of tensors on a GPU copies every byte to the host to write it: the bound is about host tensors")
    ops = checkpoint_ops(impl)
    rows, cols, count = 2048, 1024, 4  # 8 MiB of float32 each: large enough to be cut into pieces among its holders
    gen = torch.Generator().manual_seed(dist.world_size)
    if layout == "replicated":
        state: dict[str, Any] = {f"w{i:02d}": torch.randn(rows, cols, generator=gen) for i in range(count)}
        local_bytes = count * rows * cols * 4
    else:
        state = {f"w{i:02d}": dtensor_of(torch.randn(rows * dist.world_size, cols, generator=gen), dist.mesh(), [Shard(0)])
                 for i in range(count)}
        local_bytes = sum(v.to_local().numel() * 4 for v in state.values())
    path = dist.tmp_dir / "ckpt"
    ops.save({"w00": state["w00"]}, path / "warm-up", process_group=group_of(dist))  # what a first save sets up once
    peak, measured = peak_bytes_during(dist.device, lambda: ops.save(state, path / "measured", process_group=group_of(dist)))
    if peak >= local_bytes / 3:
        fail(f"a save of {local_bytes >> 20} MiB of {layout} CPU tensors raised the {measured} too much", f"{peak / 2**20:.1f} MiB",
             f"below a third of the state, {local_bytes / 3 / 2**20:.1f} MiB", f"rank {dist.rank}")
    target = {k: torch.zeros_like(v) if layout == "replicated" else dtensor_of(torch.zeros(rows * dist.world_size, cols), dist.mesh(), [Shard(0)])
              for k, v in state.items()}
    ops.load(target, path / "measured", process_group=group_of(dist))
    assert_same_bits(target, state, what=f"the {layout} state the measured save wrote")


@pytest.mark.req("ML-8")
@pytest.mark.parametrize("name", ["groups", "dtypes"])  # zoo "mlp" is resharded by the tensor-parallel test
def test_reshard_model_and_optimizer_state(pools, world_size_pair, impl, tmp_path: Path, name: str) -> None:
    """Train a sharded zoo model at one world size, save model and optimizer state, load at another
    into a model from another seed whose optimizer lists its parameters in reverse and has every
    hyperparameter perturbed: the loaded state is the saved state bit for bit (each rank's shard its
    documented piece, param groups exactly), and matches and resumes like the unsharded run."""
    saved_at, loaded_at = world_size_pair
    args = (str(tmp_path / "ckpt"), str(tmp_path / "saved.pt"))
    pools.run(saved_at, save_training, impl, name, *args)
    pools.run(loaded_at, load_training, impl, name, *args)


@pytest.mark.req("ML-9")
@pytest.mark.rank_timeout(30)
@pytest.mark.world_size(min=2)
@parametrize_where
def test_per_rank_value_under_one_key_is_an_error(dist, impl, where: str) -> None:
    """``rank_seed`` differs on every rank, or only on the last: every rank's save raises the same
    error, naming the key. The job saved the same layout with equal values before, so an
    implementation that reuses that save's plan must still compare the values."""
    if where == ONE_RANK and dist.world_size < 3:
        pytest.skip("at world size 2 one differing rank is every rank differing: the every-rank case covers it")
    ops = checkpoint_ops(impl)
    ops.save({"w": torch.ones(3), "rank_seed": 1000}, dist.tmp_dir / "earlier", process_group=group_of(dist))
    seed = 1000 + (dist.rank if where == EVERY_RANK else int(dist.rank == dist.world_size - 1))
    sd = {"w": torch.ones(3), "rank_seed": seed}
    fails_alike(dist, lambda: ops.save(sd, dist.tmp_dir / "ckpt", process_group=group_of(dist)), keys=("rank_seed",),
                 what="save of a per-rank value")


@pytest.mark.req("ML-9")
@pytest.mark.rank_timeout(30)
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("differs", ["dtype", "shape", "dtensor-dtype"])
def test_a_tensor_held_differently_by_the_ranks_is_an_error(dist, impl, differs: str) -> None:
    """The tensor ``w``, a plain tensor held by every rank (or a DTensor sharded over them), is float64 or
    one row longer on the last rank only (a rank that cast or resized its model by mistake): every
    rank's save raises the same error naming the key. One that keeps one rank's dtype or shape in the
    metadata writes the other rank's bytes under it, or drops them."""
    ops = checkpoint_ops(impl)
    # The same save with every rank alike succeeds: the error below is the difference's, not the call's.
    ops.save({"w": torch.ones(3, 3), "step": 3}, dist.tmp_dir / "alike", process_group=group_of(dist))
    last = dist.rank == dist.world_size - 1
    dtype = torch.float64 if last and differs != "shape" else torch.float32
    if differs == "dtensor-dtype":
        w: torch.Tensor = dtensor_of(torch.ones(2 * dist.world_size, 3, dtype=dtype), dist.mesh(), [Shard(0)])
    else:
        w = torch.ones(4 if last and differs == "shape" else 3, 3, dtype=dtype)
    fails_alike(dist, lambda: ops.save({"w": w, "step": 3}, dist.tmp_dir / "ckpt", process_group=group_of(dist)), keys=("w",),
                what=f"save of a tensor whose {differs} differs on the last rank")


@pytest.mark.req("ML-10")
@pytest.mark.rank_timeout(30)
@parametrize_where
@pytest.mark.parametrize("mismatch", list(MISMATCHES))
def test_strict_load_names_the_key_and_changes_nothing(dist, impl, mismatch: str, where: str) -> None:
    """A key missing from the checkpoint, a shape (of one key, or of two: both named) or a dtype that
    differs (on every rank, or on the last rank only while the others ask for exactly the checkpoint), loading into CPU tensors and then into
    meta tensors: every rank raises the same error naming the key (with both shapes or dtypes), and
    every rank's state dict is unchanged, deeply (meta entries and identities included)."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(error_checkpoint(), path, process_group=group_of(dist))
    spec, keys, needles = MISMATCHES[mismatch]
    asked = spec if bad_input_here(dist, where) else GOOD
    for device in ("cpu", "meta"):
        sd = asking_for(asked, device)
        before = snapshot(state_dict=sd)
        fails_alike(dist, lambda: ops.load(sd, path, process_group=group_of(dist)), keys=keys, needles=needles,
                     what=f"strict load into {device} tensors with a {mismatch} mismatch")
        assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}, {device} tensors")


@pytest.mark.req("ML-10")
def test_non_strict_load_skips_missing_keys(dist, impl) -> None:
    """With strict loading off, a key missing from the checkpoint keeps its object and value; the
    others take the saved bits."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = error_checkpoint()
    ops.save(saved, path, process_group=group_of(dist))
    extra = torch.tensor([1.25, -0.0])
    sd = {"proj.weight": different_like(saved["proj.weight"]), "extra.scale": extra}
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist), strict=False))
    if sd["extra.scale"] is not extra:
        fail("a non-strict load replaced the entry of a missing key", type(sd["extra.scale"]).__name__, "the same tensor", "extra.scale")
    assert_same_bits(sd, {"proj.weight": saved["proj.weight"], "extra.scale": torch.tensor([1.25, -0.0])})


@pytest.mark.req("ML-11")
@pytest.mark.rank_timeout(30)
@parametrize_where
def test_unexpected_keys_can_be_an_error(dist, impl, where: str) -> None:
    """A checkpoint key the state dict does not ask for is allowed by default (the rest loads), and with
    ``allow_unexpected=False`` is an error naming it, raised alike by every rank also when only the
    last rank lacks the key; every state dict is then unchanged."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = {"proj.weight": torch.arange(12.0).reshape(4, 3), "surplus.scale": torch.tensor([2.0, -0.0])}
    ops.save(saved, path, process_group=group_of(dist))
    sd = {"proj.weight": different_like(saved["proj.weight"])}
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))  # allowed by default
    assert_bitwise_equal(sd["proj.weight"], saved["proj.weight"], what="proj.weight loaded beside an unexpected key")
    sd = {"proj.weight": different_like(saved["proj.weight"])}
    if not bad_input_here(dist, where):
        sd["surplus.scale"] = different_like(saved["surplus.scale"])
    before = snapshot(state_dict=sd)
    exc = raised(lambda: ops.load(sd, path, process_group=group_of(dist), allow_unexpected=False))
    check_each({
        "ML-11.a": lambda: fails_alike(dist, lambda: reraise(exc), keys=("surplus.scale",), what="load with an unexpected key"),
        "ML-11.b": lambda: assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}"),
    })


@pytest.mark.req("ML-12")
@pytest.mark.parametrize("target", ["filled", "meta"])
def test_save_and_load_without_a_process_group(impl, tmp_path: Path, target: str) -> None:
    """In the controller process (no process group): edge tensors and non-tensor values saved, then
    loaded into tensors whose every value differs, or into meta tensors; bitwise."""
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        pytest.skip("torch.distributed is initialized in the controller process")
    impl.require_no_process_group("ML-12's save and load in one process")
    ops = checkpoint_ops(impl)
    saved = {"plain": edge_tensors(3), "objects": objects("saved")}
    ops.save(saved, tmp_path / "ckpt")
    make = target_like if target == "filled" else meta_like
    state = {"plain": {k: make(v) for k, v in edge_tensors(3).items()}, "objects": objects("target")}
    call_or_skip(lambda: ops.load(state, tmp_path / "ckpt"))
    assert_same_bits(state, {"plain": edge_tensors(3), "objects": objects("saved")})


@pytest.mark.req("ML-13")
@pytest.mark.rank_timeout(30)
@parametrize_where
@pytest.mark.parametrize("fault", SAVE_FAULTS)
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_failed_save_leaves_the_previous_checkpoint_whole(dist, impl, directory: str, fault: str, where: str) -> None:
    """The faults of :data:`~conformance.checkpoint_support.SAVE_FAULTS`, injected while the save writes
    over a previous checkpoint (which must then load whole with its own values) or into a fresh
    directory (which must then hold nothing that loads); then a save into the directory succeeds and
    loads back whole. Every clause is checked whatever the others found."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    if directory == "overwrite":
        ops.save(sharded_values(dist, 1.0), path, process_group=group_of(dist))
    dist.barrier()

    def failing_save() -> None:
        with injected_fault(dist, path, fault, where):
            ops.save(sharded_values(dist, 50.0), path, process_group=group_of(dist))

    exc = raised(failing_save)
    dist.barrier()
    target = sharded_values(dist, -7.0)
    loaded = raised(lambda: ops.load(target, path, process_group=group_of(dist)))
    dist.barrier()
    again = raised(lambda: ops.save(sharded_values(dist, 2.0), path, process_group=group_of(dist)))
    next_target = sharded_values(dist, -7.0)
    reloaded = raised(lambda: ops.load(next_target, path, process_group=group_of(dist))) if again is None else again

    def raises() -> None:
        if exc is None:
            fail(f"a save with {fault} on {where}", "returned normally", "an error on every rank", f"rank {dist.rank}")

    def names() -> None:
        if exc is not None and str(path) not in str(exc) and path.name not in str(exc):
            fail(f"the error of a save with {fault}", f"{type(exc).__name__}: {exc}"[:400], f"a message naming {str(path)!r}", f"rank {dist.rank}")

    def previous_whole() -> None:
        if loaded is not None:
            fail("the previous checkpoint after a failed overwrite", f"{type(loaded).__name__}: {loaded}"[:400], "loads whole", f"rank {dist.rank}")
        assert_same_bits(target, sharded_values(dist, 1.0), what="the previous checkpoint after a failed overwrite")

    def nothing_loads() -> None:
        if loaded is None:
            fail("a fresh directory after a failed save", "a checkpoint that loads", "nothing that loads", f"rank {dist.rank}")

    def next_save() -> None:
        if reloaded is not None:
            fail("the next save into the directory of a failed one, loaded back", f"{type(reloaded).__name__}: {reloaded}"[:400],
                 "a save that succeeds and loads whole", f"rank {dist.rank}")
        assert_same_bits(next_target, sharded_values(dist, 2.0), what="the next save after a failed one, loaded back")

    holds = {"ML-13.c": previous_whole} if directory == "overwrite" else {"ML-13.d": nothing_loads}
    check_each({"ML-13.a": raises, "ML-13.b": names, **holds, "ML-13.e": next_save})


@pytest.mark.req("ML-13")
@pytest.mark.rank_timeout(30)
def test_a_second_save_while_one_is_in_progress_never_mixes(dist, impl) -> None:
    """A save into a directory whose previous save still holds it (its writer locked it and has not
    published): either the second save is refused with an error naming the directory, or it wins
    whole; what loads afterwards is one save's values, never a mix of two."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(sharded_values(dist, 1.0), path, process_group=group_of(dist))
    dist.barrier()
    holder = None
    if dist.rank == 0 and (path / ".lock").exists():
        import fcntl

        holder = os.open(path / ".lock", os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)  # as a save in progress in another job holds it
    dist.barrier()
    try:
        second = raised(lambda: ops.save(sharded_values(dist, 2.0), path, process_group=group_of(dist)))
    finally:
        if holder is not None:
            os.close(holder)
    dist.barrier()
    target = sharded_values(dist, -7.0)
    with clause("ML-13.f"):
        call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
        expected = sharded_values(dist, 1.0 if second is not None else 2.0)
        assert_same_bits(target, expected, what=f"the checkpoint after a {'refused' if second is not None else 'concurrent'} second save")


@pytest.mark.req("ML-13", "ML-29")
@pytest.mark.parametrize("kill", kill_points(), ids=[f"{op}-{n}" for op, n in kill_points()])
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_a_killed_save_leaves_one_whole_checkpoint(impl: Adapter, tmp_path: Path, directory: str, kill: tuple[str, int]) -> None:
    """A process saving a checkpoint is killed (SIGKILL: no cleanup) at a step of the save: the
    directory then holds the previous checkpoint whole (overwrite), nothing that loads (fresh), or,
    if the kill came after publication, the new one whole; never a mix. One process, no group (ML-12)."""
    check_after_kill(impl, tmp_path / "ckpt", directory, kill, world=1, killed="all")


@pytest.mark.req("ML-13", "ML-29")
@pytest.mark.parametrize("kill, killed", two_rank_kills(), ids=[f"{op}-{n}-rank-{who}" for (op, n), who in two_rank_kills()])
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_a_save_killed_on_one_rank_of_two_leaves_one_whole_checkpoint(impl: Adapter, tmp_path: Path, directory: str, kill: tuple[str, int],
                                                                      killed: str) -> None:
    """A two-rank save (a sharded tensor: each rank writes a part) in which one rank, or both, are
    killed at a step of the save: the survivor fails or is stopped, and the directory holds the
    previous checkpoint whole, nothing that loads, or the new one whole; never a mix. Loaded in one
    process (ML-12), which reads every rank's part."""
    check_after_kill(impl, tmp_path / "ckpt", directory, kill, world=2, killed=killed)


@pytest.mark.req("ML-13")
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_two_jobs_saving_to_one_directory_at_once_never_mix(impl: Adapter, tmp_path: Path, directory: str) -> None:
    """Two independent jobs (two processes, no shared group) save different values into one directory
    at the same moment: each either finishes or is refused with an error, and what loads afterwards is
    one save's values whole (or, in a fresh directory, nothing if both were refused); never a mix."""
    from conformance import crash_child
    from conformance.child_process import start_child
    from conformance.crash_child import crash_state

    proves_a_save_loads(impl, tmp_path / "unharmed")
    ops = checkpoint_ops(impl)
    path = tmp_path / "ckpt"
    if directory == "overwrite":
        assert child_save(impl, path, 1.0) == 0
    jobs = [start_child(crash_child.main, [impl.spec, str(path), str(fill)], description=f"the job saving fill {fill}") for fill in (3.0, 4.0)]
    outcomes = [(job.wait(timeout=120), job.output) for job in jobs]
    for job in jobs:
        job.close()
    finished = [fill for fill, (code, _) in zip((3.0, 4.0), outcomes) if code == 0]
    where = f"{directory} directory, exit statuses {[code for code, _ in outcomes]}"
    target = crash_state(-5.0)
    loaded = raised(lambda: ops.load(target, path))
    if loaded is not None:
        if directory == "fresh" and not finished:
            return
        with clause("ML-13.f"):
            fail("the directory after two concurrent saves", f"{type(loaded).__name__}: {loaded}"[:400], "one save's checkpoint, whole", where)
    candidates = [1.0, 3.0, 4.0] if directory == "overwrite" else [3.0, 4.0]
    if not any(is_same_bits(target, crash_state(fill)) for fill in candidates):
        with clause("ML-13.f"):
            fail("the checkpoint after two concurrent saves", {k: (v.flatten()[:3].tolist() if isinstance(v, torch.Tensor) else v) for k, v in target.items()},
                 f"one save's values whole (one of fills {candidates})", where)


@pytest.mark.req("ML-13")
@pytest.mark.rank_timeout(90)
def test_a_load_that_a_save_publishes_over_gets_one_whole_checkpoint(dist, impl) -> None:
    """A checkpoint is loaded while another job saves over it: the other job's save runs to completion
    (publication included) at the moment rank 0 first opens a data file to read, after every rank read
    the metadata and planned from it. Every rank gets one save's values whole (the old or, starting
    again from the new metadata, the new), never an error and never a mix. Deterministic: the publication
    is placed by a hook on rank 0's first read, not by timing."""
    from conformance.crash_child import crash_state

    impl.require_no_process_group("the other job's save (one process, no group)")
    proves_round_trip(dist, impl)
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(crash_state(1.0), path, process_group=group_of(dist))
    dist.barrier()
    other = lambda: child_save(impl, path, 2.0)  # noqa: E731
    target = crash_state(-5.0)
    with before_first_read(path, other) if dist.rank == 0 else contextlib.nullcontext():
        exc = raised(lambda: call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist))))
    with clause("ML-13.g"):
        if exc is not None:
            fail("a load overtaken by another job's publication", f"{type(exc).__name__}: {exc}"[:600],
                 "one save's checkpoint, whole (start again from the new metadata)", f"rank {dist.rank}")
        got = [fill for fill in (1.0, 2.0) if is_same_bits(target, crash_state(fill))]
        if not got:
            fail("a load overtaken by another job's publication", {k: (v.flatten()[:3].tolist() if isinstance(v, torch.Tensor) else v)
                                                                     for k, v in target.items()},
                 "one save's values whole (fill 1.0 or 2.0), never a mix", f"rank {dist.rank}")


_BAD_CHECKPOINTS = [
    *((case, where) for case in ("missing-data-file", "truncated-data-file", *DAMAGED_RECORDS) for where in WHERE),
    *((case, EVERY_RANK) for case in ("swapped-records", "record-not-in-metadata", "missing-metadata", "corrupt-metadata", "not-metadata", "unknown-version",
                                      "no-storage-data")),
]


@pytest.mark.dcp_files("the damage is placed by DCP's metadata (which file holds which record)")
@pytest.mark.req("ML-14")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("case, where", _BAD_CHECKPOINTS, ids=[f"{c}-{w}" for c, w in _BAD_CHECKPOINTS])
def test_bad_checkpoint_fails_fast_naming_the_file(dist, impl, case: str, where: str) -> None:
    """The damage (:func:`~conformance.checkpoint_support.damage`) lies in a data file every rank reads,
    in one only one rank reads, or in the metadata. The failing load is not started again: it opens
    the data files no more often than a load of the same checkpoint did before the damage (a load that
    retries every failure replans and reads again on every rank each time, and its error waits for the
    last try)."""
    bad_input_here(dist, where)  # skips the one-rank case at world size 1
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(5))
    b = bad_checkpoint_b(case, where)
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "b": b}, path, process_group=group_of(dist))

    def target_state() -> dict[str, torch.Tensor]:
        return {"w": dtensor_of(different_like(full), dist.mesh(), [Shard(0)]), "b": different_like(b)}

    is_data = data_files_of(path)
    with counting_opens() as opened:
        ops.load(target_state(), path, process_group=group_of(dist))
    good_opens = opened(is_data)
    dist.barrier()
    needle = dist.on_one_rank(lambda: damage(dist, path, case, where))
    target = target_state()
    before = snapshot(state_dict=target)
    start = time.monotonic()
    with counting_opens() as opened:
        exc = raised(lambda: ops.load(target, path, process_group=group_of(dist)))
    elapsed, bad_opens = time.monotonic() - start, opened(is_data)

    def raises() -> None:
        fails_alike(dist, lambda: reraise(exc), needles=(needle,), what=f"load of a checkpoint with a {case}", agreed="ML-14.a", named="ML-14.b")
        if elapsed >= 30:
            fail(f"{case}: the error took too long", f"{elapsed:.0f} s", "within seconds", f"rank {dist.rank}")

    def not_started_again() -> None:
        if bad_opens > good_opens:
            fail(f"{case}: the failing load opened data files more often than a good load", bad_opens,
                 f"at most {good_opens}, as the good load", f"rank {dist.rank}")

    check_each({"ML-14.a": raises, "ML-14.c": lambda: assert_unchanged(before, state_dict=target, where=f"rank {dist.rank}"),
                "ML-14.d": not_started_again})


@pytest.mark.req("ML-14", "ML-20")
@pytest.mark.rank_timeout(30)
@parametrize_where
@pytest.mark.parametrize("how", ["vanish", "truncate"])
def test_files_that_vanish_or_shrink_during_a_load_fail_it_cleanly(dist, impl, how: str, where: str) -> None:
    """The data files of a good checkpoint vanish, or are cut short, between the load's planning and its
    reads (another job cleaning up, a copy in progress)."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(sharded_values(dist, 1.0), path, process_group=group_of(dist))
    dist.barrier()
    target = sharded_values(dist, -7.0)
    entries = dict(target)
    faulty = where == EVERY_RANK or dist.rank == dist.world_size - 1
    data_files = data_files_of(path)

    def load() -> None:
        with failing_reads(path, how, which=data_files) if faulty else contextlib.nullcontext():
            ops.load(target, path, process_group=group_of(dist))

    exc = raised(load)

    def names_the_file() -> None:
        if exc is not None and ".distcp" not in str(exc) and "__" not in str(exc):
            fail(f"the error of a load whose data files {how}", f"{type(exc).__name__}: {exc}"[:400], "a message naming the data file",
                 f"rank {dist.rank}")

    def an_exception() -> None:
        if exc is not None and not isinstance(exc, Exception):
            fail("the error is not an Exception", type(exc).__name__, "a subclass of Exception", f"rank {dist.rank}")

    def replaces_nothing() -> None:
        if target["step"] != -7 or any(target[k] is not v for k, v in entries.items()):
            fail("the state dict after a failed load", {k: type(v).__name__ for k, v in target.items()}, "the same objects, 'step' still -7",
                 f"rank {dist.rank}")

    check_each({
        "ML-20.a": lambda: assert_same_error_on_every_rank(dist, exc, what=f"a load whose data files {how}"),
        "ML-20.b": names_the_file,
        "ML-15.a": an_exception,
        "ML-20.c": replaces_nothing,
    })


@pytest.mark.req("ML-15")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("failure", ["missing-key", "missing-metadata", "shape-mismatch", "save-fails-on-rank-0", "save-fails-on-the-last-rank"])
def test_errors_are_exceptions_alike_on_every_rank(dist, impl, failure: str) -> None:
    """The errors: a load of a key the checkpoint lacks, a load of a directory without metadata, a load
    of a shape the checkpoint does not hold, and a save whose data file one rank (the first or the last)
    cannot write. Both clauses are checked whatever the other found, after a save and load with nothing
    wrong succeeded (an implementation that fails every call does not pass by failing alike)."""
    proves_round_trip(dist, impl)
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    if failure.startswith("save-fails"):
        failing_rank = 0 if failure.endswith("rank-0") else dist.world_size - 1

        def call() -> None:
            with failing_writes(path) if dist.rank == failing_rank else contextlib.nullcontext():
                ops.save(sharded_values(dist, 3.0), path, process_group=group_of(dist))
    else:
        if failure != "missing-metadata":
            ops.save({"w": torch.ones(2)}, path, process_group=group_of(dist))
            dist.barrier()
        target = {"w": torch.zeros(3)} if failure == "shape-mismatch" else {"w": torch.zeros(2), "v": torch.zeros(2)}
        call = lambda: ops.load(target, path, process_group=group_of(dist))  # noqa: E731
    exc = raised(lambda: call_or_skip(call))

    def an_exception() -> None:
        if exc is None:
            fail("no error raised", "a normal return", "an error, on every rank", f"{failure}, rank {dist.rank}")
        if not isinstance(exc, Exception):
            fail("the error is not an Exception: `except Exception` misses it",
                 f"{type(exc).__module__}.{type(exc).__qualname__} (bases {[b.__name__ for b in type(exc).__mro__[1:]]})",
                 "a subclass of Exception", failure)

    check_each({"ML-15.a": an_exception, "ML-15.b": lambda: assert_same_error_on_every_rank(dist, exc, what=failure)})


@pytest.mark.req("ML-18")
def test_load_fills_tensors_in_place(dist, impl) -> None:
    """Load into plain tensors laid out as the saved ones (views included), whose storages hold a
    pattern outside their elements, and into DTensors: every entry stays the same object over the
    same memory, takes the saved bits, and no byte outside its elements changes."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = {"plain": state_of(dist, "plain", "saved").values, "sharded": state_of(dist, "dtensor-1d", "saved").values}
    ops.save(saved, path, process_group=group_of(dist))
    target = {"plain": state_of(dist, "plain", "target").values, "sharded": state_of(dist, "dtensor-1d", "target").values}
    entries = {(part, key): value for part, values in target.items() for key, value in values.items()}
    memory = {where: (v.to_local() if isinstance(v, DTensor) else v).data_ptr() for where, v in entries.items()}
    outside = {where: outside_bytes(v) for where, v in entries.items() if not isinstance(v, DTensor)}
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    for (part, key), value in entries.items():
        got = target[part][key]
        if got is not value:
            fail("load replaced a tensor instead of filling it", f"a new {type(got).__name__}", "the same object", f"{part}.{key}")
        local = got.to_local() if isinstance(got, DTensor) else got
        if local.data_ptr() != memory[(part, key)]:
            fail("load moved a tensor to other memory", hex(local.data_ptr()), hex(memory[(part, key)]), f"{part}.{key}")
        if (part, key) in outside:
            assert_bitwise_equal(outside_bytes(got), outside[(part, key)], what="storage bytes outside the view's elements",
                                 where=f"{part}.{key} (shape {tuple(got.shape)}, stride {got.stride()}, offset {got.storage_offset()})")
    assert_same_bits(target, saved)


@pytest.mark.dcp_files("ML-19 reads each record's length from DCP's metadata")
@pytest.mark.req("ML-19")
def test_views_are_saved_as_their_own_elements(dist, impl) -> None:
    """Views of a 1 MiB storage (a slice at an offset, a strided slice, a DTensor whose local shard is
    such a view); each record's length is read from the metadata."""

    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    big = torch.randn(2**18, generator=torch.Generator().manual_seed(3))
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(4))
    piece, _ = expected_local_chunk(full, [Shard(0)], (dist.world_size,), (dist.rank,))
    local = big[1000 : 1000 + piece.numel()].view(piece.shape)
    local.copy_(piece)
    sd = {
        "slice": big[7:13],
        "strided": big[100:400:37],
        "shard": DTensor.from_local(local, dist.mesh(), [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()),
    }
    ops.save(sd, path, process_group=group_of(dist))
    dist.barrier()
    records = read_metadata(path).storage_data
    for index, info in records.items():
        if index.fqn not in sd:  # the stack's own bookkeeping, not a view of ours
            continue
        value = sd[index.fqn]
        chunk = value.to_local() if isinstance(value, DTensor) else value
        elements = chunk.numel() * chunk.element_size()
        if info.length > elements + RECORD_OVERHEAD:
            fail(f"the record of {index.fqn!r} is larger than its elements", f"{info.length} bytes",
                 f"at most {elements} + {RECORD_OVERHEAD} (the view's storage is {big.untyped_storage().nbytes()} bytes)",
                 f"chunk at {list(index.offset or [])}, rank {dist.rank}")
    target = {k: target_like(v) if not isinstance(v, DTensor) else dtensor_of(different_like(full), dist.mesh(), [Shard(0)]) for k, v in sd.items()}
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    assert_local_shard(target["shard"], full, what="loaded shard")
    assert_same_bits({k: target[k] for k in ("slice", "strided")}, {k: sd[k] for k in ("slice", "strided")})


@pytest.mark.dcp_files("the unreadable record is found in DCP's metadata")
@pytest.mark.req("ML-20")
@pytest.mark.rank_timeout(30)
@parametrize_where
def test_failed_read_replaces_nothing(dist, impl, where: str) -> None:
    """The record of the non-tensor value ``note`` is overwritten with zeros (planning cannot see it;
    reading fails), and it is asked for by every rank, or only by the last (the others do not ask for
    it, so they read everything else successfully). Targets: a DTensor on meta and a non-tensor
    value. Every rank raises the same error naming the file and the key, and no rank's state dict has
    a meta entry or a non-tensor value replaced."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(6))
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "step": 7, "note": "saved"}, path, process_group=group_of(dist))
    dist.barrier()
    def zero_the_note() -> str:
        name, offset, length = record_location(path, "note")
        with open(path / name, "r+b") as f:
            f.seek(offset)
            f.write(b"\0" * length)
        return name

    name = dist.on_one_rank(zero_the_note)
    sd: dict[str, Any] = {"w": dtensor_of(full.to("meta"), dist.mesh(), [Shard(0)]), "step": 0}
    if bad_input_here(dist, where):
        sd["note"] = ""
    before = snapshot(state_dict=sd)
    exc = raised(lambda: ops.load(sd, path, process_group=group_of(dist)))
    check_each({
        "ML-20.a": lambda: fails_alike(dist, lambda: reraise(exc), keys=("note",), needles=(name,),
                                       what="load of a checkpoint with a corrupt record", agreed="ML-20.a", named="ML-20.b"),
        "ML-20.c": lambda: assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}"),
    })


@pytest.mark.req("ML-22")
def test_values_held_by_some_ranks_only_are_saved(dist, impl) -> None:
    """The keys: a non-tensor and a tensor on the last rank only, and a value on every rank but the first,
    so that the coordinator does not hold it."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    last = dist.rank == dist.world_size - 1

    def state(fill: float) -> dict[str, Any]:
        values: dict[str, Any] = {"common": torch.full((3,), fill)}
        if last:
            values["last_only_count"] = int(fill * 10) + 7
            values["last_only_tensor"] = torch.full((2, 2), fill + 0.5, dtype=torch.float64)
        if dist.rank > 0:
            values[f"rank{dist.rank}_note"] = f"rank {dist.rank}: {fill}"
        return values

    ops.save(state(1.0), path, process_group=group_of(dist))
    target = state(-2.0)
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    assert_same_bits(target, state(1.0))


_STEP_CASES = [StepCase(first, last) for first in (None, *STEPS) for last in (None, *STEPS) if (first, last) != (None, None)]


@pytest.mark.dcp_files("the failing reads are placed by DCP's metadata")
@pytest.mark.req("ML-23", "ML-24")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("case", _STEP_CASES, ids=[c.id for c in _STEP_CASES])
@pytest.mark.parametrize("target", ["plain", "dtensor", "meta"])
def test_a_load_failing_at_any_step_replaces_nothing(dist, impl, target: str, case: StepCase) -> None:
    """A load fails while planning (a key asked for with another shape), while reading (the middle of a
    key's saved data cannot be read: EIO, on this rank only) or while committing (on the first rank a
    top-level ``Stateful`` refuses its loaded state after another one loaded; on the last a mapping of
    non-tensor values refuses one, a frozen entry), into plain tensors, DTensors or meta values, on
    the first rank, the last, both (each with its own key) or both at different steps. Every rank
    raises the same error; it names each rank whose fault lies in the earliest failing step (its
    rank, its key, for a read its data file, for a refusal its words); with two such ranks its type
    is the most specific type both ranks' errors alone have; with a rank whose fault lies in a later
    step, it is exactly the error the earlier fault alone gives. No rank's state dict has anything
    replaced (after a planning failure, nothing changed at all) and each ``Stateful`` holds its state
    from before."""
    if case.last is not None and dist.world_size == 1 and case.first is not None:
        pytest.skip("at world size 1 the first rank is the last: the first rank's cases cover it")
    if case.first is None and dist.world_size == 1:
        pytest.skip("at world size 1 the last rank is the first: the first rank's cases cover it")
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(step_state(dist, target, saved=True), path, process_group=group_of(dist))
    dist.barrier()
    faults = case.faults(dist.world_size)
    earliest = min(STEPS.index(step) for step, _ in faults.values())
    failing = {rank: fault for rank, fault in faults.items() if STEPS.index(fault[0]) == earliest}
    alone = {}  # rank -> what the load raised here when that rank alone had its fault
    if len(failing) < len(faults) or len(failing) > 1:
        alone = {rank: load_with_faults(dist, ops, path, target, {rank: fault}).exc for rank, fault in failing.items()}
    load = load_with_faults(dist, ops, path, target, faults)
    exc, text = load.exc, str(load.exc)

    def names() -> None:
        if exc is None:
            with clause("ML-23.a"):
                fail("the load returned normally", "no error", f"an error naming the failure of ranks {sorted(failing)}", f"rank {dist.rank}")
        for rank, (step, which) in sorted(failing.items()):
            names_the_failure(text, path, step, which)
            if dist.world_size > 1 and not re.search(rf"\brank\W{{0,2}}{rank}\b", text, re.IGNORECASE):
                fail("the error does not name a failing rank", text[:600], f"rank {rank} named", f"rank {dist.rank} of {dist.world_size}")

    def agreed_type() -> None:
        if not alone:
            return
        if any(e is None for e in alone.values()):
            with clause("ML-23.a"):
                fail("a load with one rank's fault alone returned normally here", {r: repr(e)[:200] for r, e in alone.items()},
                     "an error on every rank", f"rank {dist.rank}")
        if len(failing) < len(faults):  # the later step's fault was never reached
            (single,) = alone.values()
            if type(exc) is not type(single) or text != str(single):
                with clause("ML-24.d"):
                    fail("a failure in an earlier step must end the load: the error differs from the one that fault alone gives",
                         f"{type(exc).__name__}: {text[:400]}", f"{type(single).__name__}: {str(single)[:400]}", f"rank {dist.rank}")
            return
        types = [type(e) for e in alone.values()]
        wanted = most_specific_common_types(types)
        if type(exc) not in wanted:
            fail("the agreed error's type is not the most specific type of every failing rank's own error",
                 type(exc).__qualname__, f"one of {[t.__qualname__ for t in wanted]} (ranks alone: {[t.__qualname__ for t in types]})",
                 f"rank {dist.rank}")

    def unchanged() -> None:
        if earliest == 0:
            assert_unchanged(load.before, state_dict=load.state, stateful=stateful_states(load.state), where=f"rank {dist.rank}, failed while planning")
        else:
            assert_same_bits(skeleton_of(load.state), load.skeleton, what=f"the state dict after a load that failed while {STEPS[earliest]} "
                              "(entries replaced, meta built, non-tensor or Stateful values loaded)")

    check_each({
        "ML-24.a": lambda: assert_same_error_on_every_rank(dist, exc, what=f"load failing ({case.id})"),
        "ML-24.b": names,
        "ML-24.c": agreed_type,
        "ML-23.b": unchanged,
    })


_FORMAT_ROUTES = ["impl-saves", "upstream-saves"]


@pytest.mark.dcp_format("ML-25 is DCP's format")
@pytest.mark.req("ML-25")
@pytest.mark.parametrize("route", _FORMAT_ROUTES)
def test_checkpoint_format_matches_upstream(dist, impl, route: str) -> None:
    """Every kind of value (nested dicts, edge tensors and DTensors of every dtype on 1-D and 2-D meshes,
    non-tensor values of every kind, AdamW state keyed by FQN with sharded moments) saved by the
    implementation and read by upstream ``torch.distributed.checkpoint`` called directly (``load``
    with ``FileSystemReader``; on rank 0 also ``dcp_to_torch_save``, which rebuilds the nesting from
    the metadata alone), or saved by upstream and loaded by the implementation, into a state dict
    whose every value differs: bitwise, each DTensor's local shard its documented piece. The
    implementation's metadata, read with ``FileSystemReader.read_metadata``, lists what upstream's own
    save of the same state dict lists. Whatever ``--impl`` selects (the reference alone too),
    upstream is the other side."""
    path = str(dist.tmp_dir / "ckpt")
    format_save(dist, impl, route, path, 7)
    dist.barrier()
    format_load(dist, impl, route, path, 7, str(dist.tmp_dir / "converted.pt"))


@pytest.mark.dcp_format("ML-25 is DCP's format")
@pytest.mark.req("ML-25")
@pytest.mark.parametrize("route", _FORMAT_ROUTES)
def test_checkpoint_format_matches_upstream_across_world_sizes(pools, world_size_pair, impl, tmp_path: Path, route: str) -> None:
    """As :func:`test_checkpoint_format_matches_upstream`, saved at one world size and read at another
    (upstream or the implementation resharding the DTensors)."""
    saved_at, loaded_at = world_size_pair
    path = str(tmp_path / "ckpt")
    pools.run(saved_at, format_save, impl, route, path, 7)
    pools.run(loaded_at, format_load, impl, route, path, 7, str(tmp_path / "converted.pt"))


@pytest.mark.dcp_files("the chunks are reordered in DCP's .metadata")
@pytest.mark.req("ML-25")
@pytest.mark.world_size(min=2)
def test_chunks_listed_in_any_order_load_alike(dist, impl) -> None:
    """A checkpoint of a DTensor sharded over every rank whose ``.metadata`` then lists its chunks in
    reverse (:func:`~conformance.checkpoint_crafted_support.reverse_chunks`): loaded whole into a
    plain tensor on every rank, and as the same DTensor, every value is the saved one. A reader that
    finds a tensor's chunks by assuming them in offset order misses some and fails, or reads them
    wrong."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    full = torch.arange(4.0 * dist.world_size * 3).reshape(4 * dist.world_size, 3)
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)])}, path, process_group=group_of(dist))
    dist.barrier()
    dist.on_one_rank(lambda: reverse_chunks(path))
    whole = {"w": different_like(full)}
    call_or_skip(lambda: ops.load(whole, path, process_group=group_of(dist)))
    assert_same_bits(whole, {"w": full}, what=f"the whole tensor read from chunks listed in reverse (rank {dist.rank})")
    sharded = {"w": dtensor_of(different_like(full), dist.mesh(), [Shard(0)])}
    ops.load(sharded, path, process_group=group_of(dist))
    assert_local_shards(dist, sharded, {("w",): full}, what="the shard read from chunks listed in reverse")


@pytest.mark.req("ML-26")
@pytest.mark.rank_timeout(60)
def test_successive_saves_each_hold_their_own_state(dist, impl) -> None:
    """A job's saves in turn, as :func:`job_model`'s docstring lists the layouts: each checkpoint,
    loaded strictly right after its save and again after every other save, holds exactly its own keys
    and values on every rank. A plan cache that serves a save anything of an earlier one (its keys, its
    shapes, which rank writes what, its file names, its directory) fails here."""
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    last_saved: dict[str, tuple[Callable[[float], dict[str, Any]], float, dict[str, tuple[Any, ...]]]] = {}

    def save_and_check(directory: str, kind: str, step: float, **layout: bool) -> None:
        def build(at: float) -> dict[str, Any]:
            return job_optim(dist, at) if kind == "optim" else job_model(dist, at, **layout)

        ops.save(build(step), dist.tmp_dir / directory, process_group=group)
        last_saved[directory] = (build, step, job_paths(kind, **layout))
        check(directory, after=f"its save ({kind}, step {step})")

    def check(directory: str, *, after: str) -> None:
        build, step, paths = last_saved[directory]
        path = dist.tmp_dir / directory
        if impl.checkpoint_format == "dcp":  # the metadata part (DCP's keys and nesting paths); the load below holds for every format
            metadata = read_metadata(path)
            # Keys of any save of this test (a stale plan's) count; the stack's own records do not.
            known = {key for _, _, held in last_saved.values() for key in held} | set(paths)
            listed = {key: tuple((metadata.planner_data or {}).get(key, ())) for key in metadata.state_dict_metadata if key in known}
            assert listed == paths, (
                f"{directory} after {after}: the metadata lists {listed}, the save held {paths} "
                f"(missing {sorted(paths.keys() - listed.keys())}, from another save {sorted(listed.keys() - paths.keys())})"
            )
        target = build(-100.0 - step)
        call_or_skip(lambda: ops.load(target, path, process_group=group))
        assert_same_bits(target, build(step), what=f"{directory} (step {step}) loaded after {after}")

    save_and_check("model-a", "model", 1.0)
    save_and_check("optim-a", "optim", 1.0)
    # The same layout, other values, another directory: one whose parents do not exist yet, as a job's
    # first save into its run's folder finds it.
    save_and_check("run/step-2/model", "model", 2.0)
    save_and_check("optim-b", "optim", 2.0)
    save_and_check("model-c", "model", 3.0, last_rank_key=True)  # one rank's layout changed
    save_and_check("model-d", "model", 4.0, changed=True)  # every rank's layout changed
    save_and_check("model-f", "model", 5.0, moved=True)  # only the nesting changed
    save_and_check("model-a", "model", 5.0)  # the first layout again, over the first checkpoint
    if dist.world_size > 1:
        # A value that differs on the last rank only (ML-9), in the layout saved before (the note
        # pickles to as many bytes): refused on every rank alike, the failed global step of the plan
        # caches' reports. An implementation that lets it through (an ML-9 deviation, which ML-9's own
        # test reports) saves it on every rank; either way the next save must be whole.
        refused = {**job_model(dist, 6.0), "note": "step 6.1" if dist.rank == dist.world_size - 1 else "step 6.0"}
        exc = raised(lambda: ops.save(refused, dist.tmp_dir / "model-e", process_group=group))
        if any(dist.all_gather_object(exc is not None)):
            fails_alike(dist, lambda: reraise(exc), keys=("note",), what="a save of a per-rank value between good saves")
    save_and_check("model-e", "model", 6.0)  # the save after a refused one
    for directory in last_saved:
        check(directory, after="every save")


#: The layout properties ML-30 changes one at a time between two saves of a job.
_ONE_PROPERTY = ("dtype", "shape", "nesting", "rank", "chunking", "every-dtype", "every-shape", "renamed")


@pytest.mark.req("ML-26", "ML-30")
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("prop", _ONE_PROPERTY)
def test_a_save_that_changes_one_property_of_its_layout_holds_its_own(dist, impl, prop: str) -> None:
    """Two saves of a job whose layouts differ in one property only (see :func:`one_property_state`),
    then the first layout again: after each save its metadata lists exactly that save's keys, paths,
    dtypes, global shapes and chunks (as every rank's state dict describes them), and it loads back
    strictly into a target of its own layout with its own values, bit for bit on every rank; each
    earlier checkpoint still does. A plan cache whose key ignores the changed property (the dtypes,
    say: ML-26's own case changes shape and dtype together) reuses the earlier save's metadata here."""
    if prop in ("rank", "chunking") and dist.world_size == 1:
        pytest.skip(f"at world size 1 there is no other rank to move a {prop!r} to")
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    saves: list[tuple[str, bool, float]] = []

    def check(directory: str, second: bool, step: float, *, after: str) -> None:
        path = dist.tmp_dir / directory
        described = described_by_states(dist, one_property_state(dist, prop, second, step))
        keys = set(described_by_states(dist, one_property_state(dist, prop, not second, step))) | set(described)
        listed = listed_in_metadata(path, keys) if impl.checkpoint_format == "dcp" else described  # the metadata part: DCP's format
        if listed != described:
            differ = sorted(k for k in described.keys() | listed.keys() if described.get(k) != listed.get(k))
            fail(f"the metadata of {directory} after {after}", {k: listed.get(k) for k in differ},
                 {k: described.get(k) for k in differ}, f"{prop} changed, rank {dist.rank} of {dist.world_size}")
        target = one_property_state(dist, prop, second, -100.0 - step)
        call_or_skip(lambda: ops.load(target, path, process_group=group))
        assert_same_bits(target, one_property_state(dist, prop, second, step), what=f"{directory} (step {step}) loaded after {after}")

    for directory, second, step in (("first", False, 1.0), ("second", True, 2.0), ("first-again", False, 3.0)):
        ops.save(one_property_state(dist, prop, second, step), dist.tmp_dir / directory, process_group=group)
        saves.append((directory, second, step))
        check(directory, second, step, after="its save")
    for directory, second, step in saves:
        check(directory, second, step, after="every save")


#: (what is crafted, the route, who reads it). ``object``: the record of the non-tensor value ``note``
#: (asked for by every rank, or by the last only); ``tensor``: the record of the replicated tensor ``b``
#: (every rank reads it) or of the last rank's shard of ``w`` (only that rank reads it); ``metadata``:
#: the ``.metadata`` file itself (every rank reads it).
_CRAFTED = (
    [("object", route, where) for route in CODE_ROUTES + NAME_LIES for where in WHERE]
    + [("tensor", route, where) for route in ("global", "stack-global", "ext1", "duplicate-data-pkl", "other-folder") for where in WHERE]
    + [("metadata", route, EVERY_RANK) for route in (*CODE_ROUTES, LAYOUT_ROUTE)]
)


@pytest.mark.dcp_files("the crafted records are DCP's pickled records and metadata")
@pytest.mark.req("ML-27", "ML-28")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("target, route, where", _CRAFTED, ids=[f"{t}-{r}-{w}" for t, r, w in _CRAFTED])
def test_a_crafted_checkpoint_runs_no_code(dist, impl, target: str, route: str, where: str) -> None:
    """A good checkpoint with a record (of ``note``, or of a tensor chunk) or its ``.metadata`` replaced
    by a crafted one (:data:`_CRAFTED`). The crafted code would create a marker file and set an
    environment variable: afterwards neither exists on any rank. The global every code route asks for
    is ``builtins.exec``, which the error must name; the layout route asks for ``torch.save`` (it would
    write the marker file), which the error must name."""
    bad_input_here(dist, where)  # skips the one-rank case at world size 1
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    path = dist.tmp_dir / "ckpt"
    marker = dist.tmp_dir / "crafted-code-ran"
    os.environ.pop(RAN_ENV, None)
    code = f"import os; open({str(marker)!r}, 'a').close(); os.environ[{RAN_ENV!r}] = '1'"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(7))
    saved_b = torch.arange(5.0)
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "b": saved_b, "step": 7, "note": "saved"}, path, process_group=group)
    dist.barrier()
    key = {"object": "note", "metadata": None, "tensor": "b" if where == EVERY_RANK else "w"}[target]
    def craft() -> str:
        if target == "metadata":
            (dcp_directory(path) / ".metadata").write_bytes(crafted_pickle(route, code, marker=str(marker)))
            return ".metadata"
        offset = (4 * (dist.world_size - 1), 0) if key == "w" else None
        return replace_record(path, str(key), crafted_record(route, code), offset)

    name = dist.on_one_rank(craft)
    sd: dict[str, Any] = {"w": dtensor_of(full.to("meta"), dist.mesh(), [Shard(0)]), "b": different_like(saved_b), "step": 0}
    if target != "object" or bad_input_here(dist, where):
        sd["note"] = ""

    def checked() -> dict[str, Any]:  # what a failed load leaves as it was (``b`` is filled in place: ML-20)
        return {k: v for k, v in sd.items() if k != "b"}

    before = snapshot(state_dict=checked())
    with extension_for_exec(route):
        exc = raised(lambda: ops.load(sd, path, process_group=group))
    ran = dist.all_gather_object((marker.exists(), os.environ.pop(RAN_ENV, None) is not None))
    what = f"load of a checkpoint with a crafted {target} ({route})"

    def no_code_ran() -> None:
        if any(created or set_env for created, set_env in ran):
            fail(f"{what}: the crafted code ran", [f"rank {r}: marker file {c}, environment variable {e}" for r, (c, e) in enumerate(ran)],
                 "nothing from the checkpoint runs", f"rank {dist.rank}")

    needles = (name,) if route in NAME_LIES else (name, "torch.save" if route == LAYOUT_ROUTE else "builtins.exec")
    check_each({
        "ML-27.b": no_code_ran,
        # a record whose member names lie is ML-28's refusal; one that asks for a global, ML-27's
        "ML-28" if route in NAME_LIES else "ML-27.a":
            lambda: fails_alike(dist, lambda: reraise(exc), keys=(key,) if key else (), needles=needles, what=what),
        "ML-27.c": lambda: assert_unchanged(before, state_dict=checked(), where=f"rank {dist.rank}"),
    })


@pytest.mark.dcp_files("the records are DCP's torch.save archives, written again by a zip tool")
@pytest.mark.req("ML-28")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("form", ["zip", "zip64"])
def test_a_record_written_again_by_a_zip_tool_loads_as_torch_reads_it(dist, impl, form: str) -> None:
    """The records of a replicated tensor, of the last rank's shard of a sharded one and of a value,
    each written again with an extra field and a comment on every entry (as ``zip`` writes them), and
    in the zip64 form a record of 4 GiB or more has (sizes and offsets in zip64 extra fields, the
    directory found through a zip64 end record): every rank loads what was saved, as ``torch.load``
    of the same bytes does."""
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    path = dist.tmp_dir / "ckpt"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(7))
    saved_b = torch.arange(5.0) - 2.5
    # The value sits one level down: a top-level one is another requirement (ML-31), which torchtitan fails.
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "b": saved_b, "extra": {"note": "saved"}}, path, process_group=group)
    dist.barrier()

    def repack() -> None:
        for key, offset in (("b", None), ("w", (4 * (dist.world_size - 1), 0)), ("extra.note", None)):
            record = repacked_record(path, key, offset, zip64=form == "zip64")
            torch.load(io.BytesIO(record), weights_only=True)  # the oracle: torch reads the repacked record
            replace_record(path, key, record, offset)

    dist.on_one_rank(repack)
    sd: dict[str, Any] = {"w": dtensor_of(torch.zeros_like(full), dist.mesh(), [Shard(0)]), "b": different_like(saved_b),
                          "extra": {"note": ""}}
    ops.load(sd, path, process_group=group)
    assert_bitwise_equal(sd["b"], saved_b, what=f"b on rank {dist.rank}")
    assert_bitwise_equal(sd["w"].to_local(), full.chunk(dist.world_size)[dist.rank], what=f"w's shard on rank {dist.rank}")
    assert sd["extra"]["note"] == "saved", f"extra.note on rank {dist.rank}: {sd['extra']['note']!r}"


@pytest.mark.req("ML-38")
@pytest.mark.rank_timeout(30)
@parametrize_where
def test_a_meta_tensor_in_a_save_is_an_error_naming_its_key(dist, impl, where: str) -> None:
    """A save whose state holds a parameter left on the meta device (a model built on meta and never
    materialized, on every rank or on the last only): every rank's save raises the same error naming
    the key, and the checkpoint saved at the path before still loads whole. A save that skips the key
    (NVIDIA-NeMo/Speech PR #10647: megatron's dist checkpointing did) or writes whatever bytes it
    finds under it leaves a checkpoint that loads without the parameter's values."""
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    path = dist.tmp_dir / "ckpt"
    saved = {"layer": {"weight": torch.arange(12.0).reshape(4, 3), "bias": torch.ones(4)}, "step": 3}
    ops.save(saved, path, process_group=group)  # the same save with real values succeeds
    weight = torch.empty(4, 3, device="meta") if bad_input_here(dist, where) else torch.zeros(4, 3)
    fails_alike(dist, lambda: ops.save({"layer": {"weight": weight, "bias": torch.zeros(4)}, "step": 4}, path, process_group=group),
                keys=("layer.weight",), what=f"save of a meta tensor ({where})")
    target = {"layer": {"weight": torch.full((4, 3), -1.0), "bias": torch.zeros(4)}, "step": 0}
    ops.load(target, path, process_group=group)
    assert_same_bits(target, {"layer": {"weight": torch.arange(12.0).reshape(4, 3), "bias": torch.ones(4)}, "step": 3},
                     what="the checkpoint saved before the failed save")
