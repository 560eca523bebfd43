"""ML: distributed checkpoints, meta-tensor loading and resharding (SPEC.md, section ML).

Oracles: the values that were saved (round trips), the other implementation (cross-implementation),
and the unsharded zoo model trained identically in one process (resharding of training state).
The inspector's requirements (ML-16, ML-17) are tested in ``tests/test_inspect.py``.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from conformance import models
from conformance.adapters.base import Unsupported

# -- helpers ----------------------------------------------------------------------------------


def _ops(impl: Any) -> Any:
    return impl.require("checkpoint")


def _call(fn: Callable[[], Any]) -> Any:
    """Run an ops call; an option the implementation lacks is a skip naming it."""
    try:
        return fn()
    except Unsupported as exc:
        pytest.skip(str(exc))


def _raised(fn: Callable[[], Any]) -> BaseException | None:
    """The exception ``fn`` raises, of any type (DCP's CheckpointException is a BaseException), or None."""
    try:
        _call(fn)
    except (KeyboardInterrupt, SystemExit, pytest.skip.Exception, pytest.fail.Exception):
        raise
    except BaseException as exc:  # noqa: B036 - the point is to see what the implementation raises
        return exc
    return None


def _expect_error(fn: Callable[[], Any], *needles: str, what: str) -> BaseException:
    exc = _raised(fn)
    assert exc is not None, f"{what}: expected an error, the call returned normally"
    text = str(exc)
    missing = [n for n in needles if n not in text]
    assert not missing, f"{what}: the error does not name {missing}; it says:\n{text[:2000]}"
    return exc


def _pg(dist: Any) -> Any:
    return dist.group


def _mesh_2d(dist: Any) -> Any:
    return dist.mesh(2, dist.world_size // 2) if dist.world_size % 2 == 0 else dist.mesh(1, dist.world_size)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _plain(seed: int) -> dict[str, Any]:
    g = _gen(seed)
    return {
        "f32": torch.randn(10, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 1000, (3, 4), generator=g),
        "flags": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.randn((), generator=g),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(4, 6, generator=g).t(),
    }


def _objects(seed: int) -> dict[str, Any]:
    if seed < 0:  # the "blank" state dict a load fills in
        return {"step": 0, "lr": 0.0, "name": "", "nested": {"ids": [0, 0, {"tag": ""}], "pair": (0, 0)}}
    return {"step": 7 + seed, "lr": 0.25, "name": f"adam-{seed}", "nested": {"ids": [1, 2, {"tag": "x"}], "pair": (3, 4)}}


def _dtensors_1d(dist: Any, seed: int, blank: bool = False) -> dict[str, Any]:
    mesh = dist.mesh()
    g = _gen(seed)
    spec = {  # uneven at every world size > 1; (3,) leaves rank 3 empty at world size 4
        "rows": ((5, 3), [Shard(0)]),
        "cols": ((3, 10), [Shard(1)]),
        "replicated": ((15,), [Replicate()]),
        "short": ((3,), [Shard(0)]),
    }
    out = {}
    for key, (shape, placements) in spec.items():
        full = torch.randn(*shape, generator=g)
        out[key] = distribute_tensor(torch.zeros_like(full) if blank else full, mesh, placements)
    return out


def _dtensors_2d(dist: Any, seed: int, blank: bool = False) -> dict[str, Any]:
    mesh = _mesh_2d(dist)
    g = _gen(seed)
    spec = {
        "replicate_shard": ((10, 3), [Replicate(), Shard(0)]),
        "shard_shard": ((5, 15), [Shard(0), Shard(1)]),
        "nested_dim0": ((15, 2), [Shard(0), Shard(0)]),
    }
    out = {}
    for key, (shape, placements) in spec.items():
        full = torch.randn(*shape, generator=g)
        out[key] = distribute_tensor(torch.zeros_like(full) if blank else full, mesh, placements)
    return out


#: A small checkpoint for the error tests: distinctive key names, so messages can be searched for them.
_SAVED = {"proj.weight": torch.ones(4, 3), "proj.bias": torch.ones(2)}


def _blank_plain(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    """Exact equality of nested state dicts: keys, tensor kinds, local shards, non-tensor values."""
    if isinstance(want, DTensor):
        assert isinstance(got, DTensor), f"{where}: got {type(got).__name__}, want DTensor"
        assert got.placements == want.placements, f"{where}: placements {got.placements} != {want.placements}"
        assert torch.equal(got.to_local(), want.to_local()), f"{where}: local shards differ"
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and not isinstance(got, DTensor), f"{where}: got {type(got).__name__}"
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(map(str, got)) == list(map(str, want)), f"{where}: keys {list(got)} != {list(want)}"
        for (k, g), w in zip(got.items(), want.values()):
            _assert_same(g, w, f"{where}.{k}" if where else str(k))
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _no_meta(sd: Any, where: str = "") -> None:
    if isinstance(sd, dict):
        for k, v in sd.items():
            _no_meta(v, f"{where}.{k}" if where else str(k))
    elif isinstance(sd, torch.Tensor):
        local = sd.to_local() if isinstance(sd, DTensor) else sd
        assert local.device.type != "meta", f"{where}: still on meta after load"


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


# -- ML-1 round trip ---------------------------------------------------------------------------

_KINDS: dict[str, Callable[..., dict[str, Any]]] = {
    "plain": lambda dist, seed, blank=False: _blank_plain(_plain(seed)) if blank else _plain(seed),
    "objects": lambda dist, seed, blank=False: _objects(-1 if blank else seed),
    "dtensor-1d": _dtensors_1d,
    "dtensor-2d": _dtensors_2d,
}


@pytest.mark.req("ML-1")
@pytest.mark.parametrize("kind", list(_KINDS))
def test_round_trip_restores_every_value(dist, impl, kind: str) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = _KINDS[kind](dist, 1)
    ops.save(saved, path, process_group=_pg(dist))
    target = _KINDS[kind](dist, 1, blank=True)
    _call(lambda: ops.load(target, path, process_group=_pg(dist)))
    _assert_same(target, _KINDS[kind](dist, 1))


# -- ML-2 cross-implementation ------------------------------------------------------------------


def _mixed(dist: Any, seed: int, blank: bool = False) -> dict[str, Any]:
    return {
        "plain": _KINDS["plain"](dist, seed, blank),
        "sharded": _dtensors_1d(dist, seed, blank),
        "sharded_2d": _dtensors_2d(dist, seed + 1, blank),
        "meta": _objects(-1 if blank else seed),
    }


@pytest.mark.req("ML-2")
@pytest.mark.parametrize("saver", ["impl-saves", "reference-saves"])
def test_checkpoint_loads_across_implementations(dist, impl, reference_impl, saver: str) -> None:
    ops, ref = _ops(impl), _ops(reference_impl)
    writer, reader = (ops, ref) if saver == "impl-saves" else (ref, ops)
    path = dist.tmp_dir / "ckpt"
    writer.save(_mixed(dist, 2), path, process_group=_pg(dist))
    target = _mixed(dist, 2, blank=True)
    _call(lambda: reader.load(target, path, process_group=_pg(dist)))
    _assert_same(target, _mixed(dist, 2))


# -- ML-3 replicated data written once ------------------------------------------------------------


@pytest.mark.req("ML-3")
def test_replicated_data_is_written_once(dist, impl) -> None:
    from reference.checkpoint import read_metadata_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    mesh_2d = _mesh_2d(dist)
    sd = {
        "plain": torch.arange(12.0).reshape(3, 4),
        "replicated": distribute_tensor(torch.arange(15.0), dist.mesh(), [Replicate()]),
        "replicate_shard": distribute_tensor(torch.arange(30.0).reshape(10, 3), mesh_2d, [Replicate(), Shard(0)]),
    }
    ops.save(sd, path, process_group=_pg(dist))
    if dist.rank != 0:
        return
    md = read_metadata_file(path)
    chunks = {k: v.chunks for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    shards_along_dim1 = mesh_2d.size(1)
    expected = {"plain": 1, "replicated": 1, "replicate_shard": min(shards_along_dim1, 10)}
    assert {k: len(v) for k, v in chunks.items()} == expected, f"chunks per key: {chunks}"
    stored = {}
    for index in md.storage_data:
        stored[index.fqn] = stored.get(index.fqn, 0) + 1
    assert stored == expected, f"stored records per key {stored}, expected {expected}"
    for key, key_chunks in chunks.items():
        volume = sum(math.prod(c.sizes) for c in key_chunks)
        assert volume == sd[key].numel(), f"{key}: chunks cover {volume} of {sd[key].numel()} elements"


# -- ML-4 meta loading: tensor parallel and FSDP2 ------------------------------------------------------


def _tp_plan() -> dict[str, Any]:
    """PR #113319's plan on zoo "mlp" (5 -> 10 -> 15 -> 1): net.0 row-wise (its 5 input features over the
    ranks: 3+2 at 2 ranks, 2+2+1+0 at 4), net.2 column-wise (15 outputs: 8+7, 4+4+4+3). The layouts at
    the model's edges are Replicate so that the forward runs on the full batch and gives full outputs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"net.0": RowwiseParallel(input_layouts=Replicate()), "net.2": ColwiseParallel(output_layouts=Replicate())}


def _tp_model(dist: Any, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    if str(device) == "meta":
        with torch.device("meta"):
            model = models.ZOO["mlp"]()
    else:
        model = models.build("mlp", seed=seed, device=dist.device)
    return parallelize_module(model, dist.mesh(), _tp_plan())


def _check_built(dist: Any, loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    """ML-4's checks of a meta load: no meta left, values and DTensor layout as saved, right device."""
    _no_meta(loaded)
    for key, want in saved.items():
        got = loaded[key]
        local = got.to_local() if isinstance(got, DTensor) else got
        assert local.device == dist.device, f"{key}: built on {local.device}, expected {dist.device}"
        if isinstance(want, DTensor):
            assert isinstance(got, DTensor), f"{key}: became {type(got).__name__}"
            assert got.device_mesh == want.device_mesh and got.placements == want.placements, f"{key}: layout changed"
            assert got.shape == want.shape and got.stride() == want.stride(), f"{key}: global shape/stride changed"
        assert torch.equal(_full(got), _full(want)), f"{key}: loaded values differ from the saved ones"


@pytest.mark.req("ML-4")
def test_meta_load_tensor_parallel_model(dist, impl) -> None:
    """PR #113319's test: a tensor-parallel model with uneven shards, loaded into a meta copy."""
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    model = _tp_model(dist, seed=5, device=dist.device)
    saved = model.state_dict()
    ops.save(saved, path, process_group=_pg(dist))

    meta_model = _tp_model(dist, seed=0, device="meta")
    sd = meta_model.state_dict()
    _call(lambda: ops.load(sd, path, process_group=_pg(dist)))
    _check_built(dist, sd, saved)
    meta_model.load_state_dict(sd, assign=True)
    inputs = models.batch("mlp", seed=3, device=dist.device)
    torch.testing.assert_close(meta_model(inputs), model(inputs), rtol=0, atol=0)


@pytest.mark.req("ML-4")
@pytest.mark.parametrize("name", ["mlp", "nested", "groups"])
def test_meta_load_fsdp2_model(dist, impl, name: str) -> None:
    from torch.distributed.fsdp import fully_shard

    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    model = fully_shard(models.build(name, seed=6, device=dist.device), mesh=dist.mesh())
    saved = model.state_dict()
    ops.save(saved, path, process_group=_pg(dist))

    with torch.device("meta"):
        meta_model = models.ZOO[name]()
    meta_model = fully_shard(meta_model, mesh=dist.mesh())
    sd = meta_model.state_dict()
    _call(lambda: ops.load(sd, path, process_group=_pg(dist)))
    _check_built(dist, sd, saved)
    meta_model.load_state_dict(sd, assign=True)
    inputs = models.batch(name, seed=3, device=dist.device)
    torch.testing.assert_close(meta_model(inputs), model(inputs), rtol=0, atol=0)


# -- ML-5 tied parameters -------------------------------------------------------------------------


@pytest.mark.req("ML-5")
def test_meta_load_keeps_tied_storage_shared(dist, impl) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    model = models.build("tied", seed=2, device=dist.device)
    ops.save(model.state_dict(), path, process_group=_pg(dist))

    with torch.device("meta"):
        meta_model = models.ZOO["tied"]()
    sd = meta_model.state_dict()
    _call(lambda: ops.load(sd, path, process_group=_pg(dist)))
    _no_meta(sd)
    assert sd["embed.weight"].untyped_storage().data_ptr() == sd["head.weight"].untyped_storage().data_ptr(), (
        "embed.weight and head.weight shared a storage on meta but not after loading"
    )
    meta_model.load_state_dict(sd, assign=True)
    meta_model.head.weight = meta_model.embed.weight  # assign=True makes one Parameter per key: re-tie
    inputs = models.batch("tied", seed=1, device=dist.device)
    torch.testing.assert_close(meta_model(inputs), model(inputs), rtol=0, atol=0)


# -- ML-6 unbuildable meta values ----------------------------------------------------------------------


class MarkedTensor(torch.Tensor):
    """A tensor subclass whose data lives elsewhere: allocating one like it is refused."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.empty_like, torch.zeros_like, torch.Tensor.new_empty, torch.Tensor.to):
            raise TypeError("a MarkedTensor cannot be allocated")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.req("ML-6")
def test_meta_value_of_unknown_type_is_an_error(dist, impl) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(_SAVED, path, process_group=_pg(dist))
    odd = torch.empty(4, 3, device="meta").as_subclass(MarkedTensor)
    plain = torch.empty(2, device="meta")
    sd = {"proj.weight": odd, "proj.bias": plain}
    _expect_error(
        lambda: ops.load(sd, path, process_group=_pg(dist)), "proj.weight", "MarkedTensor", what="meta MarkedTensor"
    )
    assert sd["proj.weight"] is odd and sd["proj.bias"] is plain, "a failed load changed the state dict"


# -- ML-7 peak memory of a meta load -----------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


@pytest.mark.req("ML-7")
def test_meta_load_allocates_local_shards_once(dist, impl) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("peak RSS is measured through Linux's /proc/self/clear_refs and VmHWM")
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    rows = 4096 * dist.world_size
    full = torch.randn(rows, 4096, generator=_gen(0))  # 64 MiB per rank
    saved = {"w": distribute_tensor(full, dist.mesh(), [Shard(0)])}
    ops.save(saved, path, process_group=_pg(dist))
    local_bytes = saved["w"].to_local().numel() * 4
    del full
    with torch.device("meta"):
        sd = {"w": distribute_tensor(torch.empty(rows, 4096), dist.mesh(), [Shard(0)])}
    import gc

    gc.collect()
    baseline = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    _call(lambda: ops.load(sd, path, process_group=_pg(dist)))
    peak = (_rss_kib("VmHWM") - baseline) * 1024
    assert torch.equal(sd["w"].to_local(), saved["w"].to_local())
    assert peak < 1.5 * local_bytes, (
        f"load into meta raised peak RSS by {peak / 2**20:.1f} MiB for {local_bytes / 2**20:.1f} MiB of local shards"
    )


# -- ML-8 resharding across world sizes ----------------------------------------------------------------------


def _save_tp(dist: Any, impl: Any, path: str) -> None:
    model = _tp_model(dist, seed=8, device=dist.device)
    _ops(impl).save(model.state_dict(), path, process_group=_pg(dist))


def _load_tp(dist: Any, impl: Any, path: str) -> None:
    meta_model = _tp_model(dist, seed=0, device="meta")
    sd = meta_model.state_dict()
    _call(lambda: _ops(impl).load(sd, path, process_group=_pg(dist)))
    _no_meta(sd)
    oracle = models.build("mlp", seed=8, device=dist.device).state_dict()
    for key, value in sd.items():
        assert torch.equal(_full(value), oracle[key]), f"{key}: resharded values differ from the saved model"
    meta_model.load_state_dict(sd, assign=True)
    inputs = models.batch("mlp", seed=4, device=dist.device)
    torch.testing.assert_close(meta_model(inputs), models.build("mlp", seed=8, device=dist.device)(inputs))


_ROUTES = ["impl-to-impl", "reference-to-impl", "impl-to-reference"]


@pytest.mark.req("ML-2", "ML-8")
@pytest.mark.parametrize("route", _ROUTES)
def test_reshard_tensor_parallel_model(pools, world_size_pair, impl, reference_impl, tmp_path: Path, route: str) -> None:
    """The grid of saver x loader x (saved world size, loaded world size), on the uneven TP model."""
    if impl.name == reference_impl.name and route != "impl-to-impl":
        pytest.skip("for the reference itself this route is impl-to-impl")
    saver, loader = (reference_impl if part == "reference" else impl for part in route.split("-to-"))
    saved_at, loaded_at = world_size_pair
    pools.run(saved_at, _save_tp, saver, str(tmp_path / "ckpt"))
    pools.run(loaded_at, _load_tp, loader, str(tmp_path / "ckpt"))


_TRAIN_STEPS = 2


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, name: str, steps: range, device: Any) -> None:
    for step in steps:
        models.train_step(model, optimizer, models.batch(name, seed=step, device=device))


def _save_training(dist: Any, impl: Any, name: str, path: str) -> None:
    ops = _ops(impl)
    model = ops.shard(models.build(name, seed=11, device=dist.device), dist.mesh())
    optimizer = _optimizer(model)
    _train(model, optimizer, name, range(_TRAIN_STEPS), dist.device)
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    if dist.world_size > 1:  # otherwise this test would not reshard anything
        assert any(isinstance(v, DTensor) for v in model_sd.values()), "the sharded model state dict holds no DTensor"
    ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=_pg(dist))


def _full_dict(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _full_dict(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_full_dict(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return _full(sd).detach().cpu()
    return sd


def _load_training(dist: Any, impl: Any, name: str, path: str) -> None:
    ops = _ops(impl)
    model = ops.shard(models.build(name, seed=99, device=dist.device), dist.mesh())
    optimizer = _optimizer(model)
    _train(model, optimizer, name, range(1), dist.device)  # creates optimizer state to load into
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _call(lambda: ops.load(state, path, process_group=_pg(dist)))
    ops.set_state_dicts(model, optimizer, state["model"], state["optim"])

    oracle = models.build(name, seed=11, device=dist.device)
    oracle_optimizer = _optimizer(oracle)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS), dist.device)
    got_model, got_optim = ops.get_state_dicts(model, optimizer)
    for key, value in oracle.state_dict().items():
        torch.testing.assert_close(_full(got_model[key]).cpu(), value.cpu(), msg=lambda m: f"model {key}: {m}")
    names = {id(p): n for n, p in oracle.named_parameters()}
    got_state = _full_dict(got_optim["state"])
    for param, state_values in oracle_optimizer.state.items():
        fqn = names[id(param)]
        for slot, value in state_values.items():
            torch.testing.assert_close(got_state[fqn][slot], value.cpu(), msg=lambda m: f"optim {fqn}.{slot}: {m}")
    # Training resumes where the saved run left off.
    _train(model, optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    got_model, _ = ops.get_state_dicts(model, optimizer)
    for key, value in oracle.state_dict().items():
        torch.testing.assert_close(_full(got_model[key]).cpu(), value.cpu(), msg=lambda m: f"after resuming, {key}: {m}")


@pytest.mark.req("ML-8")
@pytest.mark.parametrize("name", ["mlp", "groups"])
def test_reshard_model_and_optimizer_state(pools, world_size_pair, impl, tmp_path: Path, name: str) -> None:
    saved_at, loaded_at = world_size_pair
    pools.run(saved_at, _save_training, impl, name, str(tmp_path / "ckpt"))
    pools.run(loaded_at, _load_training, impl, name, str(tmp_path / "ckpt"))


# -- ML-9 per-rank values -----------------------------------------------------------------------------------


@pytest.mark.req("ML-9")
@pytest.mark.world_size(min=2)
def test_per_rank_value_under_one_key_is_an_error(dist, impl) -> None:
    ops = _ops(impl)
    sd = {"w": torch.ones(3), "rank_seed": 1000 + dist.rank}
    _expect_error(lambda: ops.save(sd, dist.tmp_dir / "ckpt", process_group=_pg(dist)), "rank_seed", what="per-rank value")


# -- ML-10 / ML-11 strict loading ------------------------------------------------------------------------------

_MISMATCHES: dict[str, tuple[Callable[[torch.device], dict[str, Any]], tuple[str, ...]]] = {
    "missing-key": (
        lambda d: {"proj.weight": torch.zeros(4, 3, device=d), "extra.scale": torch.zeros(2, device=d)},
        ("extra.scale",),
    ),
    "shape": (
        lambda d: {"proj.weight": torch.zeros(3, 4, device=d), "proj.bias": torch.zeros(2, device=d)},
        ("proj.weight", "3, 4", "4, 3"),
    ),
    "dtype": (
        lambda d: {"proj.weight": torch.zeros(4, 3, device=d, dtype=torch.float64), "proj.bias": torch.zeros(2, device=d)},
        ("proj.weight", "float64", "float32"),
    ),
}


@pytest.mark.req("ML-10")
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("mismatch", list(_MISMATCHES))
def test_strict_load_names_the_key_and_changes_nothing(dist, impl, mismatch: str, device: str) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(_SAVED, path, process_group=_pg(dist))
    make, needles = _MISMATCHES[mismatch]
    sd = make(torch.device(device))
    before = dict(sd)
    values = {k: v.clone() for k, v in sd.items() if v.device.type != "meta"}
    _expect_error(lambda: ops.load(sd, path, process_group=_pg(dist)), *needles, what=f"{mismatch} mismatch")
    assert all(sd[k] is v for k, v in before.items()) and sd.keys() == before.keys(), "the state dict's entries changed"
    for key, value in values.items():
        assert torch.equal(sd[key], value), f"{key}: values changed by a failed load"


@pytest.mark.req("ML-10")
def test_non_strict_load_skips_missing_keys(dist, impl) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(_SAVED, path, process_group=_pg(dist))
    sd = {"proj.weight": torch.zeros(4, 3), "extra.scale": torch.zeros(2)}
    _call(lambda: ops.load(sd, path, process_group=_pg(dist), strict=False))
    assert torch.equal(sd["proj.weight"], torch.ones(4, 3)), "the key present in the checkpoint was not loaded"
    assert torch.equal(sd["extra.scale"], torch.zeros(2)), "the missing key was changed"


@pytest.mark.req("ML-11")
def test_unexpected_keys_can_be_an_error(dist, impl) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save({"proj.weight": torch.ones(4, 3), "surplus.scale": torch.ones(2)}, path, process_group=_pg(dist))
    _call(lambda: ops.load({"proj.weight": torch.zeros(4, 3)}, path, process_group=_pg(dist)))  # allowed by default
    sd = {"proj.weight": torch.zeros(4, 3)}
    _expect_error(
        lambda: ops.load(sd, path, process_group=_pg(dist), allow_unexpected=False), "surplus.scale", what="unexpected key"
    )
    assert torch.equal(sd["proj.weight"], torch.zeros(4, 3)), "a failed load changed the state dict"


# -- ML-12 one process -----------------------------------------------------------------------------------------


@pytest.mark.req("ML-12")
def test_save_and_load_without_a_process_group(impl, tmp_path: Path) -> None:
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        pytest.skip("torch.distributed is initialized in the controller process")
    ops = _ops(impl)
    saved = {"plain": _plain(3), "meta": _objects(3)}
    ops.save(saved, tmp_path / "ckpt")
    with torch.device("meta"):
        target = {"plain": _blank_plain(_plain(3)), "meta": _objects(-1)}
    _call(lambda: ops.load(target, tmp_path / "ckpt"))
    _assert_same(target, {"plain": _plain(3), "meta": _objects(3)})


# -- ML-13 failed saves ----------------------------------------------------------------------------------------


@pytest.mark.req("ML-13")
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_failed_save_leaves_no_complete_checkpoint(dist, impl, directory: str) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    sd = {"w": distribute_tensor(torch.randn(4 * dist.world_size, 3), dist.mesh(), [Shard(0)])}
    if directory == "overwrite":
        ops.save(sd, path, process_group=_pg(dist))
    dist.barrier()
    if dist.rank == 0:
        # Rank 0's data file cannot be created: its writes fail after planning succeeded.
        path.mkdir(exist_ok=True)
        blocker = path / "__0_0.distcp"
        if blocker.exists():
            blocker.unlink()
        blocker.mkdir()
    dist.barrier()
    exc = _raised(lambda: ops.save(sd, path, process_group=_pg(dist)))
    assert exc is not None, "the save succeeded although rank 0 could not write its data file"
    dist.barrier()
    assert not (path / ".metadata").exists(), (
        "after a failed save the directory still has .metadata: it looks like a complete checkpoint"
    )


# -- ML-14 / ML-15 bad checkpoints and error types ---------------------------------------------------------------------


def _corrupt(path: Path, case: str) -> str:
    """Damage the checkpoint at ``path``; returns what the error must name."""
    data = path / "__0_0.distcp"
    meta = path / ".metadata"
    if case == "missing-data-file":
        data.unlink()
        return "__0_0.distcp"
    if case == "truncated-data-file":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
        return "__0_0.distcp"
    if case == "missing-metadata":
        meta.unlink()
        return ".metadata"
    if case == "corrupt-metadata":
        meta.write_bytes(meta.read_bytes()[: 40] + b"\x00garbage")
        return ".metadata"
    if case == "unknown-version":
        with open(meta, "rb") as f:
            metadata = pickle.load(f)  # our own file, written a moment ago
        metadata.version = "99.0.0"
        with open(meta, "wb") as f:
            pickle.dump(metadata, f)
        return "99.0.0"
    raise ValueError(case)


@pytest.mark.req("ML-14")
@pytest.mark.parametrize(
    "case", ["missing-data-file", "truncated-data-file", "missing-metadata", "corrupt-metadata", "unknown-version"]
)
def test_bad_checkpoint_fails_fast_naming_the_file(dist, impl, case: str) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save({"w": distribute_tensor(torch.randn(4 * dist.world_size, 3), dist.mesh(), [Shard(0)]), "b": torch.ones(5)}, path, process_group=_pg(dist))
    dist.barrier()
    needle = _corrupt(path, case) if dist.rank == 0 else None
    needle = dist.broadcast_object(needle)
    dist.barrier()
    target = {"w": distribute_tensor(torch.zeros(4 * dist.world_size, 3), dist.mesh(), [Shard(0)]), "b": torch.zeros(5)}
    start = time.monotonic()
    _expect_error(lambda: ops.load(target, path, process_group=_pg(dist)), needle, what=case)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"{case}: the error took {elapsed:.0f} s"
    assert torch.equal(target["b"], torch.zeros(5)) and torch.equal(target["w"].to_local(), torch.zeros_like(target["w"].to_local())), (
        f"{case}: the failed load changed the state dict"
    )


@pytest.mark.req("ML-15")
@pytest.mark.parametrize("failure", ["missing-key", "missing-metadata"])
def test_errors_are_exceptions_alike_on_every_rank(dist, impl, failure: str) -> None:
    ops = _ops(impl)
    path = dist.tmp_dir / "ckpt"
    if failure == "missing-key":
        ops.save({"w": torch.ones(2)}, path, process_group=_pg(dist))
    sd = {"w": torch.zeros(2), "v": torch.zeros(2)}
    exc = _expect_error(lambda: ops.load(sd, path, process_group=_pg(dist)), what=failure)
    assert isinstance(exc, Exception), (
        f"{type(exc).__module__}.{type(exc).__qualname__} is not an Exception: `except Exception` misses it"
    )
    seen = dist.all_gather_object((type(exc).__qualname__, str(exc)))
    assert all(s == seen[0] for s in seen), f"ranks raised different errors: {seen}"
