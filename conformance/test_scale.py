"""ML-34 to ML-37 through the adapter: what a save and a load at scale costs, in the parts that show at
the world sizes the suite runs. Growth with the world size (ML-34, ML-35, ML-36's tensor larger than
the mean, the planning half of ML-37) is checked by simulating thousands of ranks on the reference's planners (tests/reference/
test_scale.py; figures: bench.scale, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from conformance.asserts import fail
from conformance.checkpoint_support import checkpoint_ops, group_of
from conformance.scale_support import check_written_in_turn, counting_opens


@pytest.mark.dcp_files("ML-36 is read from which rank's data file holds each record")
@pytest.mark.req("ML-36")
@pytest.mark.world_size(min=2)
def test_replicated_tensors_are_written_by_every_holder_in_turn(dist, impl) -> None:
    """Four equal plain tensors per rank, held by every rank: each rank writes some of them and none
    more than 10% over the mean. A writer that leaves replicated data to the lowest rank (or
    any one rank) writes all of it there. The writer of a record is read from its data file's name
    (``__<rank>_``, as DCP's filesystem writers name them)."""
    sd = {f"replicated.{i}": torch.full((128, 64), float(i)) for i in range(4 * dist.world_size)}
    path = dist.tmp_dir / "ckpt"
    checkpoint_ops(impl).save(sd, path, process_group=group_of(dist))
    check_written_in_turn(dist, path, set(sd))


@pytest.mark.dcp_files("ML-36 is read from which rank's data file holds each record")
@pytest.mark.req("ML-36")
@pytest.mark.world_size(min=2)
def test_a_replicated_tensor_larger_than_the_mean_is_cut_among_its_holders(dist, impl) -> None:
    """One plain tensor of 16 MiB held by every rank, and nothing else: larger than the mean a rank
    writes, so its holders write it in pieces, each rank some and none more than 10% over the mean,
    and it loads back whole. It has as many rows as holders, the fewest that a cut along its first
    dim can share among them. A writer that cuts only tensors above a size or a row count of its own
    (or never) leaves it to one rank."""
    ops, path, rows = checkpoint_ops(impl), dist.tmp_dir / "ckpt", dist.world_size
    columns = (4 << 20) // rows
    saved = torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns)
    ops.save({"embedding": saved}, path, process_group=group_of(dist))
    target = {"embedding": torch.zeros(rows, columns)}
    ops.load(target, path, process_group=group_of(dist))
    if not torch.equal(target["embedding"], saved):
        fail("the replicated tensor written in pieces, loaded back", "other values", "the saved values", f"rank {dist.rank}")
    check_written_in_turn(dist, path, {"embedding"})


@pytest.mark.req("ML-37")
def test_a_load_reads_the_metadata_once_per_rank(dist, impl) -> None:
    """Each rank's load opens the checkpoint's ``.metadata`` exactly once (counted by Python's ``open``
    audit event on that rank): a load that reads it again per step or per key pays its size again, which
    grows with the world that saved."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = torch.arange(64.0).reshape(8, 8)
    ops.save({"w": saved, "b": torch.ones(8), "step": 3}, path, process_group=group_of(dist))
    target: dict[str, object] = {"w": torch.zeros(8, 8), "b": torch.zeros(8), "step": 0}
    with counting_opens() as opened:
        ops.load(target, path, process_group=group_of(dist))
        count = opened(".metadata")
    if count != 1:
        fail(f"times rank {dist.rank} opened .metadata during one load", count, 1, str(path))
    loaded = target["w"]
    if not isinstance(loaded, torch.Tensor) or not torch.equal(loaded, saved):
        fail("the loaded value", loaded, saved, "w")
