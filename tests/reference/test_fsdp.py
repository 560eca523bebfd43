"""Multi-rank tests of ``reference.fsdp`` alone (no adapter): the OS
requirements' parts that only the reference's own API states. They take ``dist`` and run on the rank
pools of the conformance plugin (loaded for ``tests/`` by ``tests/conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance import models
from conformance.adapters.sharding import STRATEGIES, _mesh, hybrid_mesh_shape
from conformance.asserts import assert_local_shard, assert_same_error_on_every_rank, assert_same_state, assert_unchanged, expect_error, fail, snapshot
from reference.fsdp import FullyShardedDataParallel, full_state_dict, load_sharded_state_dict, sharded_state_dict


@pytest.mark.req("OS-15")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_reference_optim_state_keys(dist, use_orig_params: bool) -> None:
    """The reference's ``_OptimStateKey`` of every optimizer parameter: a flat parameter stands for its
    unit's FQNs, an original parameter for its own; both FSDP-managed. Local (no collective)."""
    from reference.fsdp import _OptimStateKey, get_fqn_to_fsdp_param_info, get_param_to_fqns

    model = models.build("tied", device=dist.device)
    model = FullyShardedDataParallel(model, use_orig_params=use_orig_params, auto_wrap_policy=lambda m: m is model.body, device_id=dist.device)
    infos = get_fqn_to_fsdp_param_info(model)
    keys = sorted(_OptimStateKey(tuple(fqns), fqns[0] in infos) for fqns in get_param_to_fqns(model).values())
    if use_orig_params:
        expected = [
            _OptimStateKey(("body.bias",), True),
            _OptimStateKey(("body.weight",), True),
            _OptimStateKey(("embed.weight", "head.weight"), True),  # tied: first name first
        ]
    else:
        expected = [_OptimStateKey(("body.weight", "body.bias"), True), _OptimStateKey(("embed.weight",), True)]
    assert keys == expected, f"optimizer state keys {keys}, expected {expected}"
    assert infos["head.weight"].param_indices["head.weight"] == infos["embed.weight"].param_indices["embed.weight"] == 0, (
        "a tied alias maps to its parameter's index"
    )


@pytest.mark.req("OS-17")
def test_reference_rejects_a_mesh_that_does_not_fit(dist) -> None:
    """A 1-D mesh for HYBRID_SHARD, a 2-D mesh for FULL_SHARD, no mesh for HYBRID_SHARD: a ValueError
    saying what the strategy needs, raised alike on every rank, and the module is left as it was."""
    model = models.build("mlp", device=dist.device)
    before = snapshot(model=model)
    cases = [
        ("HYBRID_SHARD", _mesh(dist.device, (dist.world_size,)), "HYBRID_SHARD needs a 2-D device_mesh"),
        ("FULL_SHARD", _mesh(dist.device, (1, dist.world_size)), "1-D device_mesh, got shape (1, "),
        ("HYBRID_SHARD", None, "HYBRID_SHARD needs device_mesh"),
    ]
    for strategy, mesh, needle in cases:
        where = f"{strategy} with mesh {None if mesh is None else tuple(mesh.shape)}, rank {dist.rank}"
        expect_error(lambda: FullyShardedDataParallel(model, sharding_strategy=strategy, device_mesh=mesh), ValueError, needles=[needle], where=where)
        assert_unchanged(before, where=where, model=model)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        fail("a refused construction wrapped the model", [type(m).__name__ for m in model.modules()], "no unit", f"rank {dist.rank}")


def _wrap(model: torch.nn.Module, dist: Any, strategy: str, use_orig_params: bool) -> FullyShardedDataParallel:
    mesh = _mesh(dist.device, hybrid_mesh_shape(dist.world_size)) if strategy == "HYBRID_SHARD" else None
    return FullyShardedDataParallel(
        model, sharding_strategy=strategy, device_mesh=mesh, use_orig_params=use_orig_params, auto_wrap_policy=lambda m: m is model.a, device_id=dist.device
    )


@pytest.mark.req("OS-19")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reference_sharded_model_state_dict(dist, strategy: str, use_orig_params: bool) -> None:
    """``reference.fsdp.sharded_state_dict`` of the ``tiny`` model right after wrapping: every parameter a
    DTensor with the strategy's placements whose local shard on every rank is its ``torch.chunk`` piece
    of the unwrapped value, bit for bit (empty pieces included); ``load_sharded_state_dict`` into a
    model built from another seed gives the unwrapped model's full state dict, bit for bit."""
    oracle = models.build("tiny", seed=0, device=dist.device).state_dict()
    model = _wrap(models.build("tiny", seed=0, device=dist.device), dist, strategy, use_orig_params)
    sharded = sharded_state_dict(model)
    placements = {"FULL_SHARD": (Shard(0),), "SHARD_GRAD_OP": (Shard(0),), "NO_SHARD": (Replicate(),), "HYBRID_SHARD": (Replicate(), Shard(0))}[strategy]
    if list(sharded) != list(oracle):
        fail("sharded state dict keys", list(sharded), list(oracle), f"rank {dist.rank}")
    for key, value in oracle.items():
        where = f"{strategy}, {key!r} on rank {dist.rank}"
        got = sharded[key]
        if not isinstance(got, DTensor) or tuple(got.placements) != placements:
            fail("a parameter of the sharded state dict", f"{type(got).__name__} {getattr(got, 'placements', '')}", f"DTensor {placements}", where)
        assert_local_shard(got, value, what="sharded state dict entry", where=where)
    target = _wrap(models.build("tiny", seed=1, device=dist.device), dist, strategy, use_orig_params)
    load_sharded_state_dict(target, sharded)
    assert_same_state(full_state_dict(target), oracle, what="full state dict after loading the sharded one", where=f"{strategy}, rank {dist.rank}")


@pytest.mark.req("OS-19")
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_reference_reshards_after_forward_as_its_strategy_says(dist, strategy: str, grad: bool) -> None:
    """Between forward and backward a unit holds what its strategy promises: FULL_SHARD only this rank's
    shard (the gathered memory freed), SHARD_GRAD_OP and NO_SHARD the whole flat parameter. A forward
    without grad has no backward to keep the gathered parameter for: every strategy is back on its
    shard, where the gradients of an earlier backward stay visible to the optimizer (OS-26.e)."""
    model = models.build("mlp", device=dist.device)
    unit = FullyShardedDataParallel(model, sharding_strategy=strategy, device_id=dist.device)
    flat = unit.flat_param
    assert flat is not None
    shard_numel = flat.numel()  # between iterations every strategy holds its local shard
    total = sum(p.numel() for p in models.build("mlp").parameters())
    with torch.set_grad_enabled(grad):
        unit(models.batch("mlp", device=dist.device))
    held = unit.flat_param.numel()
    if strategy == "FULL_SHARD" or dist.world_size == 1 or (not grad and strategy == "SHARD_GRAD_OP"):
        expected = shard_numel
    elif strategy == "NO_SHARD":
        expected = total  # never sharded, so never padded
    else:
        expected = -(-total // dist.world_size) * dist.world_size  # gathered: the padded flat parameter
    if held != expected:
        fail(f"{strategy}: flat parameter size between forward and backward", held, expected, f"rank {dist.rank}")


@pytest.mark.req("OS-17")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("given", ["device_mesh", "process_group"])
def test_reference_construction_error_on_one_rank_is_raised_on_every_rank(dist, given: str) -> None:
    """The ranks that construct a unit together are those of the group or 1-D mesh it is given: a layout
    error only the last rank sees (it froze a layer of its copy) is raised alike on every rank."""
    if dist.world_size == 1:
        pytest.skip("at world size 1 the one-rank case is the every-rank case")
    model = models.build("frozen", device=dist.device)
    if dist.rank != dist.world_size - 1:
        model.stem.requires_grad_(True)  # this rank's model is uniform: alone, it would wrap
    before = snapshot(model=model)
    placement = {"device_mesh": _mesh(dist.device, (dist.world_size,))} if given == "device_mesh" else {"process_group": dist.group}
    exc = expect_error(lambda: FullyShardedDataParallel(model, sharding_strategy="FULL_SHARD", device_id=dist.device, **placement),
                       ValueError, needles=["stem.weight"], where=f"rank {dist.rank}")
    assert_same_error_on_every_rank(dist, exc, what=f"construction with a {given}")
    assert_unchanged(before, where=f"rank {dist.rank}", model=model)


@pytest.mark.req("OS-26")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_dtype_change_keeps_parameter_objects_and_views(dist, use_orig_params: bool) -> None:
    """After ``.double()`` every unit's registered parameters are the same objects as before (an
    optimizer built before keeps them), in float64, and each original parameter is still a view of its
    unit's local shard (training reaches the flat parameter), whose gathered buffer is float64 too."""
    model = models.build("nested", device=dist.device)
    model = FullyShardedDataParallel(model, use_orig_params=use_orig_params, auto_wrap_policy=lambda m: m is model.get_submodule("10"),
                                     device_id=dist.device)
    before = [id(p) for p in model.parameters()]
    model.double()
    assert [id(p) for p in model.parameters()] == before, "a dtype change replaced registered parameters"
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit.handle
        assert handle is not None
        shard = handle.local_shard
        assert shard.dtype == handle.flat_param.dtype == handle._full.dtype == torch.float64
        assert handle.flat_param.data_ptr() == shard.data_ptr()
        start, end = shard.data_ptr(), shard.data_ptr() + shard.numel() * shard.element_size()
        for param in handle.orig_params:
            assert param.dtype == torch.float64
            assert param.numel() == 0 or start <= param.data_ptr() < end, "an original parameter is no view of its shard"
