"""Module state beyond parameters and buffers, through every capability (conformance/SPEC.md SD-29,
SD-30, OS-25, OS-26, FP-22, FP-27).

Two kinds of module state that a fork drops or mis-routes while every parameter test passes:

* **Extra state** (``get_extra_state`` / ``set_extra_state``, under ``<module>._extra_state``;
  Transformer Engine's FP8 modules keep their scaling metadata there, as a ``BytesIO`` or a tensor whose
  length changes once FP8 is initialized). :data:`EXTRA_KINDS` are the values tried, every one of them
  at the model's root and inside a module that sharding makes a unit of its own
  (:class:`~conformance.module_state_support.ExtraModel`), each place and seed with its own value. The
  modules' ``get_extra_state`` returns a fresh copy and ``set_extra_state`` records what it was handed:
  an implementation that writes into the object a get returned (as it would a buffer) changes nothing,
  and is caught. Loads go into a target built from another seed, so every loaded value differs from the
  target's own, and are checked on every rank in the modules themselves.
* **A dtype change after wrapping** (``.to(torch.float64)``, ``.double()``, ``.half()``, ``.bfloat16()``,
  ``.type()``, :data:`DTYPE_FORMS`): a sharded or flattened model converted after wrapping must
  compute, train and save in the new dtype, as the unwrapped model converted the same way does.

And one combination of options: ``cpu_offload`` without ``full_state_dict`` (SD-30) keeps every rank's
own result; only ``full_state_dict`` with ``cpu_offload`` leaves ranks other than 0 ``{}``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import DTensor

from conformance import models as zoo
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.sharding import ShardingPlan, child_units
from conformance.asserts import (
    assert_local_shard,
    assert_names_key,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    clause,
    expect_error,
    expected_local_chunk,
    fail,
    raised,
    snapshot,
)
from conformance.compare import fqn_keyed_optim
from conformance.harness.context import RankContext
from conformance.module_state_support import (
    DTYPE_ATOL,
    DTYPE_FORMS,
    EXTRA_KINDS,
    PLACES,
    SHARDED_GETS,
    assert_extra_entries,
    assert_holds,
    build_extra,
    comparable,
    extra_entries,
    extra_value,
    holders,
    same,
    shard_extra,
    tensors_of,
)
from conformance.state_dict_support import PROMPTLY_S, sd_ops


@pytest.mark.req("FP-22")
@pytest.mark.parametrize("form", list(DTYPE_FORMS))
def test_dtype_change_of_a_flat_param_wrapper(impl: Adapter, form: str) -> None:
    """A wrapped ``nested`` converted by ``form``: its flat parameters stay flat parameters of the new
    dtype, ``state_dict()`` equals the unwrapped model converted the same way bit for bit, it computes
    what that model computes, and a step of an optimizer built afterwards matches it."""
    ops = impl.require("flat_param")
    convert, dtype = DTYPE_FORMS[form]
    plain = zoo.build("nested", seed=0)
    wrapped_model = zoo.build("nested", seed=0)
    wrapped = ops.wrap(wrapped_model, list(wrapped_model.parameters()))
    convert(plain)
    convert(wrapped)
    flats = [p for p in wrapped.parameters() if ops.is_flat_param(p)]
    if not flats or any(f.dtype != dtype for f in flats):
        fail(f"flat parameters after {form}", [(ops.is_flat_param(f), f.dtype) for f in wrapped.parameters()], f"flat parameters of {dtype}")
    assert_same_state(dict(wrapped.state_dict()), dict(plain.state_dict()), what=f"state_dict() after {form}")
    x = zoo.batch("nested", seed=3).to(dtype)
    assert_same_state(wrapped(x), plain(x), what=f"output after {form}")
    for model in (plain, wrapped):
        optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optim.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        optim.step()
    # Trained: the gradient reaches a flat parameter through views, whose rounding in half precision
    # may differ from the unwrapped model's by an ulp.
    atol = None if dtype == torch.float64 else DTYPE_ATOL[dtype]
    assert_same_state(dict(wrapped.state_dict()), dict(plain.state_dict()), what=f"state_dict() trained after {form}", atol=atol)


@pytest.mark.req("FP-27")
def test_extra_state_through_a_flat_param_wrapper(impl: Adapter) -> None:
    """A model whose parameters a wrapper flattens, every kind: ``state_dict()`` has the unwrapped
    model's extra-state entries; ``load_state_dict()`` of another seed's unwrapped dict hands each to its
    module's ``set_extra_state``; a strict load without one raises ``RuntimeError`` naming it by its
    unwrapped key."""
    ops = impl.require("flat_param")
    checks: dict[str, Callable[[], None]] = {}
    for kind in EXTRA_KINDS:

        def check(kind: str = kind) -> None:
            plain = build_extra(kind, 0)
            wrapped_model = build_extra(kind, 0)
            wrapped = ops.wrap(wrapped_model, list(wrapped_model.parameters()))
            got = wrapped.state_dict()
            if list(got) != list(plain.state_dict()):
                fail("state_dict() keys of the wrapped model", list(got), list(plain.state_dict()), kind)
            assert_same_state(comparable(dict(got)), comparable(dict(plain.state_dict())), what="state_dict() of the wrapped model", where=kind)
            target_model = build_extra(kind, 1)
            modules = holders(target_model)
            target = ops.wrap(target_model, list(target_model.parameters()))
            target.load_state_dict(copy.deepcopy(plain.state_dict()))
            assert_holds(modules, kind, 0, "load_state_dict of the wrapped model", kind)
            assert_same_state(comparable(dict(target.state_dict())), comparable(dict(plain.state_dict())),
                              what="state_dict() after the load", where=kind)
            partial = {k: v for k, v in plain.state_dict().items() if k != PLACES["unit"]}
            expect_error(lambda: target.load_state_dict(partial), RuntimeError, keys=[PLACES["unit"]],
                         what="a strict load without an extra-state entry", where=kind)

        checks[kind] = check
    check_each(**checks)


@pytest.mark.req("SD-29")
def test_extra_state_round_trips_on_a_plain_model(impl: Adapter) -> None:
    """Plain model, no process group, every kind: get gives each module's extra state under its key;
    set into another seed's model hands each one to its module's ``set_extra_state``; a strict set
    without one is a ``RuntimeError`` naming it that changes nothing; a non-strict one reports it
    missing and leaves that module's own."""
    ops = sd_ops(impl)
    checks: dict[str, Callable[[], None]] = {}
    for kind in EXTRA_KINDS:

        def get_and_set(kind: str = kind) -> None:
            with clause("SD-29.a"):
                source = build_extra(kind, 0)
                got = ops.get_model_state_dict(source)
                assert_extra_entries(got, kind, 0, "get", "plain model")
                if list(got) != list(source.state_dict()):
                    fail("get: keys", list(got), list(source.state_dict()), "plain model")
            with clause("SD-29.b"):
                target = build_extra(kind, 1)
                ops.set_model_state_dict(target, copy.deepcopy(got))
                assert_holds(holders(target), kind, 0, "set", "plain model")

        def strict(kind: str = kind) -> None:
            partial = {k: v for k, v in ops.get_model_state_dict(build_extra(kind, 0)).items() if k != PLACES["unit"]}
            target = build_extra(kind, 1)
            before = snapshot(model=target)
            with clause("SD-29.c"):
                expect_error(lambda: ops.set_model_state_dict(target, partial), RuntimeError, keys=[PLACES["unit"]],
                             what="a strict set without an extra-state entry", where="plain model")
            with clause("SD-29.d"):
                assert_unchanged(before, model=target, where="after the refused strict set")
                for place, module in holders(target).items():
                    if module.received or not same(module.extra, extra_value(kind, 1, place)):
                        fail(f"a refused strict set changed the {place} module's extra state", comparable(module.extra),
                             comparable(extra_value(kind, 1, place)))

        def nonstrict(kind: str = kind) -> None:
            with clause("SD-7"):
                partial = {k: v for k, v in ops.get_model_state_dict(build_extra(kind, 0)).items() if k != PLACES["unit"]}
                target = build_extra(kind, 1)
                result = ops.set_model_state_dict(target, partial, options=ops.options(strict=False))
                if PLACES["unit"] not in list(getattr(result, "missing_keys", [])):
                    fail("a non-strict set without an extra-state entry: missing_keys", list(getattr(result, "missing_keys", [])),
                         f"a list naming {PLACES['unit']!r}")
                assert_holds({"root": target}, kind, 0, "non-strict set", "plain model")
                assert_same_state(comparable(target.inp.extra), comparable(extra_value(kind, 1, "unit")),
                                  what="the unit's extra state, not given to a non-strict set", where="plain model")

        checks.update({f"{kind}-get-set": get_and_set, f"{kind}-strict": strict, f"{kind}-nonstrict": nonstrict})
    check_each(**checks)


@pytest.mark.req("SD-29", "SD-12", "SD-14", "SD-30")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
@pytest.mark.parametrize("get", list(SHARDED_GETS))
def test_extra_state_round_trips_on_a_sharded_model(dist: RankContext, impl: Adapter, get: str) -> None:
    """Sharded model (the unit ``inp`` holds extra state, and so does the root), every kind: on every rank
    the get with ``get``'s options gives each extra state as the module returned it (its tensors on the
    CPU with ``cpu_offload``; ``{}`` on ranks other than 0 with ``full_state_dict`` and ``cpu_offload``);
    a set of that dict (from rank 0 alone, with ``broadcast_from_rank0``, where only rank 0 got it) into
    another seed's sharded model hands every extra state to its module's ``set_extra_state`` on every
    rank, with the parameters loaded too; a strict set lacking the unit's entry on the last rank only
    fails on every rank naming it, and changes nothing."""
    ops = sd_ops(impl)
    fields = SHARDED_GETS[get]
    rank0_only = fields.get("full_state_dict") and fields.get("cpu_offload")
    checks: dict[str, Callable[[], None]] = {}
    for kind in EXTRA_KINDS:

        def check(kind: str = kind) -> None:
            where = f"rank {dist.rank}, {get}, {kind}"
            with clause("SD-29.a"):
                source = shard_extra(impl, build_extra(kind, 0, dist.device), dist.device)
                got = ops.get_model_state_dict(source, options=ops.options(**fields))
                full_source = ops.get_model_state_dict(source, options=ops.options(full_state_dict=True))
                if rank0_only and dist.rank != 0:
                    if got != {}:
                        fail("full_state_dict + cpu_offload on a rank other than 0", sorted(got), "{}", where)
                else:
                    assert_extra_entries(got, kind, 0, "get", where)
                    if fields.get("cpu_offload"):
                        devices = sorted({str(t.device) for t in tensors_of(extra_entries(got))})
                        if devices not in ([], ["cpu"]):
                            fail("cpu_offload: devices of the extra state's tensors", devices, ["cpu"], where)
            with clause("SD-29.b"):
                target_model = build_extra(kind, 1, dist.device)
                modules = holders(target_model)
                target = shard_extra(impl, target_model, dist.device)
                given = copy.deepcopy(got)
                load_options = ops.options(full_state_dict=bool(fields["full_state_dict"]), broadcast_from_rank0=bool(rank0_only))
                ops.set_model_state_dict(target, given, options=load_options)
                assert_holds(modules, kind, 0, "set", where)
                after = ops.get_model_state_dict(target, options=ops.options(full_state_dict=True))
                assert_same_state(comparable(after), comparable(full_source), what="full model state dict after the set", where=where)

        checks[kind] = check
    check_each(**checks)


@pytest.mark.req("SD-29", "SD-8")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
@pytest.mark.parametrize("kind", ["bytesio", "tensor"])
def test_strict_sharded_set_without_extra_state_fails_on_every_rank(dist: RankContext, impl: Adapter, kind: str) -> None:
    """A strict set into a sharded model whose dict lacks the unit's extra state on the last rank only:
    every rank raises the same ``RuntimeError`` naming it, and no rank changes anything (the modules'
    extra states included)."""
    ops = sd_ops(impl)
    source = shard_extra(impl, build_extra(kind, 0, dist.device), dist.device)
    given = copy.deepcopy(ops.get_model_state_dict(source))
    if dist.rank == dist.world_size - 1:
        del given[PLACES["unit"]]
    target_model = build_extra(kind, 1, dist.device)
    modules = holders(target_model)
    target = shard_extra(impl, target_model, dist.device)
    before = snapshot(model=target)
    exc = raised(lambda: ops.set_model_state_dict(target, given))
    where = f"rank {dist.rank}"

    def refused() -> None:
        assert_same_error_on_every_rank(dist, exc, what="a strict set lacking an extra-state entry on the last rank")
        if not isinstance(exc, RuntimeError):
            fail("exception type", type(exc).__name__, "RuntimeError", where)
        assert_names_key(str(exc), PLACES["unit"], where=where)

    def unchanged() -> None:
        assert_unchanged(before, model=target, where=f"{where}: after the refused set")
        for place, module in modules.items():
            if module.received:
                fail(f"a refused set called set_extra_state of the {place} module", comparable(module.received), "no call", where)

    check_each({"SD-29.c": refused, "SD-29.d": unchanged})


@pytest.mark.req("SD-29", "ML-1")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
def test_extra_state_through_a_checkpoint(dist: RankContext, impl: Adapter) -> None:
    """A sharded model's state dict carrying extra state is saved as a checkpoint and loaded into the
    state dict of another seed's model (its extra states of the same kinds, other values), which is then
    set: every module holds the saved extra state, on every rank. ``grown-tensor`` is left out: a
    checkpoint load checks a tensor's shape (ML-10), an extra state's too."""
    ckpt = impl.require("checkpoint")
    checks: dict[str, Callable[[], None]] = {}
    for kind in (k for k in EXTRA_KINDS if k != "grown-tensor"):

        def check(kind: str = kind) -> None:
            where = f"rank {dist.rank}, {kind}"
            with clause("SD-29.a"):
                source = shard_extra(impl, build_extra(kind, 0, dist.device), dist.device)
                model_sd, _ = ckpt.get_state_dicts(source, torch.optim.SGD(source.parameters(), lr=0.1))
            with clause("SD-29.e"):
                path = dist.tmp_dir / f"extra-{kind}"
                ckpt.save({"model": model_sd}, path)
                target_model = build_extra(kind, 1, dist.device)
                modules = holders(target_model)
                target = shard_extra(impl, target_model, dist.device)
                optim = torch.optim.SGD(target.parameters(), lr=0.1)
                state, optim_sd = ckpt.get_state_dicts(target, optim)
                box = {"model": state}
                ckpt.load(box, path)
                assert_extra_entries(box["model"], kind, 0, "the state dict a checkpoint load filled", where)
                ckpt.set_state_dicts(target, optim, box["model"], optim_sd)
                assert_holds(modules, kind, 0, "set after the checkpoint load", where)

        checks[kind] = check
    check_each(**checks)


@pytest.mark.req("SD-30")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_cpu_offload_alone_keeps_every_ranks_own_state(dist: RankContext, impl: Adapter, kind: str) -> None:
    """``cpu_offload=True`` without ``full_state_dict``, on every rank: a sharded model's get gives this
    rank's own DTensors (its local piece of each parameter, of each positional optimizer state) on the
    CPU, never ``{}`` on ranks other than 0; a plain model's gives the whole dict on every rank, on the
    CPU. ``full_state_dict=True`` without ``cpu_offload`` gives every rank the full dict."""
    ops = sd_ops(impl)
    oracle = zoo.build("nested", seed=0, device=dist.device)
    model = zoo.build("nested", seed=0, device=dist.device)
    if kind == "sharded":
        try:
            model = impl.require("sharding").shard(model, ShardingPlan("FULL_SHARD", units=child_units(model), device=dist.device))
        except Unsupported as exc:
            pytest.skip(str(exc))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    oracle_optim = torch.optim.Adam(oracle.parameters(), lr=0.01)
    x = zoo.batch("nested", seed=3, device=dist.device)
    for m, o in ((model, optim), (oracle, oracle_optim)):
        m(x).pow(2).mean().backward()
        o.step()
    where = f"rank {dist.rank} of {dist.world_size}, {kind} model"
    want = oracle.state_dict()

    def offload() -> None:
        got_model = ops.get_model_state_dict(model, options=ops.options(cpu_offload=True))
        got_optim = ops.get_optimizer_state_dict(model, optim, options=ops.options(cpu_offload=True))
        for what, got in (("model", got_model), ("optimizer", got_optim)):
            if not got:
                fail(f"cpu_offload without full_state_dict: the {what} state dict", "{}", "this rank's own state", where)
            devices = sorted({str((t.to_local() if isinstance(t, DTensor) else t).device) for t in tensors_of(got)})
            if devices != ["cpu"]:
                fail(f"cpu_offload: devices of the {what} state dict's tensors", devices, ["cpu"], where)
        if list(got_model) != list(want):
            fail("cpu_offload: model state dict keys", list(got_model), list(want), where)
        want_optim = fqn_keyed_optim(oracle, oracle_optim)["state"]
        if sorted(got_optim["state"]) != sorted(want_optim):
            fail("cpu_offload: FQNs with optimizer state", sorted(got_optim["state"]), sorted(want_optim), where)
        for fqn, state in got_optim["state"].items():
            for name, value in state.items():
                full = want_optim[fqn][name]
                if isinstance(value, DTensor):
                    mesh = value.device_mesh
                    piece, _ = expected_local_chunk(full.detach().cpu(), value.placements, tuple(mesh.shape), tuple(mesh.get_coordinate() or ()))
                    value, full = value.to_local(), piece
                elif kind == "sharded" and isinstance(full, torch.Tensor) and full.dim() > 0 and dist.world_size > 1:
                    fail("cpu_offload: a positional optimizer state is not a DTensor", type(value).__name__, "DTensor", f"{where}: {fqn!r}")
                assert_same_state(value, full.cpu() if isinstance(full, torch.Tensor) else full, what="cpu_offload: optimizer state",
                                  where=f"{where}: {fqn!r}[{name!r}]", atol=None if kind == "plain" else 1e-6)
        params = dict(oracle.named_parameters())
        for key, value in got_model.items():
            full = want[key].detach().cpu()
            if isinstance(value, DTensor):
                assert_local_shard(value, full, what="cpu_offload: model state dict", where=f"{where}: {key!r}")
            elif kind == "sharded" and key in params and dist.world_size > 1:
                fail("cpu_offload: a sharded parameter is not a DTensor", type(value).__name__, "DTensor", f"{where}: {key!r}")
            else:
                assert_same_state(value, full, what="cpu_offload: model state dict", where=f"{where}: {key!r}",
                                  atol=None if kind == "plain" else 1e-6)

    def full_everywhere() -> None:
        got = ops.get_model_state_dict(model, options=ops.options(full_state_dict=True))
        if not got:
            fail("full_state_dict without cpu_offload: the model state dict", "{}", "the full dict on every rank", where)
        assert_same_state(got, want, what="full_state_dict without cpu_offload", where=where, atol=None if kind == "plain" else 1e-6)

    check_each({"SD-30.a": offload, "SD-30.b": full_everywhere})


#: The FSDP model state dicts tried with extra state: (get, load) of the optim_state ops.
FSDP_FORMS = ("full", "sharded")


@pytest.mark.req("OS-25")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
@pytest.mark.parametrize("form", FSDP_FORMS)
def test_extra_state_through_fsdp_model_state_dicts(dist: RankContext, impl: Adapter, form: str) -> None:
    """Through the FSDP implementation's own full and sharded model state dicts (the ``optim_state``
    capability), not the state_dict API, for every kind; the load goes into another seed's sharded model."""
    ops = impl.require("optim_state")
    get = ops.full_state_dict if form == "full" else ops.sharded_state_dict
    load = ops.load_full_state_dict if form == "full" else ops.load_sharded_state_dict
    checks: dict[str, Callable[[], None]] = {}
    for kind in EXTRA_KINDS:

        def check(kind: str = kind) -> None:
            where = f"rank {dist.rank}, {form}, {kind}"
            source = shard_extra(impl, build_extra(kind, 0, dist.device), dist.device)
            got = get(source)
            assert_extra_entries(got, kind, 0, f"{form} model state dict", where)
            dtensors = [key for key, value in extra_entries(got).items() if isinstance(value, DTensor)]
            if dtensors:
                fail("an extra state made a DTensor", dtensors, "the module's own value", where)
            target_model = build_extra(kind, 1, dist.device)
            modules = holders(target_model)
            target = shard_extra(impl, target_model, dist.device)
            load(target, copy.deepcopy(got))
            assert_holds(modules, kind, 0, f"load of the {form} model state dict", where)

        checks[kind] = check
    check_each(**checks)


@pytest.mark.req("OS-26")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("form", list(DTYPE_FORMS))
def test_dtype_change_after_sharding(dist: RankContext, impl: Adapter, form: str, use_orig_params: bool) -> None:
    """``nested`` (units ``1``, ``1.inner``, ``10`` and the root) sharded, then converted by ``form``: on
    every rank the full model state dict equals the unwrapped model converted the same way, bit for bit
    and in the new dtype; the sharded one (and the state-dict API's) holds DTensors of the new dtype whose
    local shard is this rank's piece; a forward computes what the converted unwrapped model computes; and
    a step of an optimizer built afterwards (each rank on the whole batch) leaves parameters and optimizer
    state equal to the unwrapped model's, in the new dtype."""
    convert, dtype = DTYPE_FORMS[form]
    ops = impl.require("optim_state")
    sd = sd_ops(impl)
    units = ("1", "1.inner", "10")
    oracle = zoo.build("nested", seed=0, device=dist.device)
    model = zoo.build("nested", seed=0, device=dist.device)
    names = {id(model.get_submodule(u)) for u in units}
    plan = ShardingPlan("FULL_SHARD", units=lambda m: id(m) in names, use_orig_params=use_orig_params, device=dist.device)
    try:
        sharded = impl.require("sharding").shard(model, plan)
    except Unsupported as exc:
        pytest.skip(str(exc))
    # Gradients left by a backward before the conversion (a dtype change between accumulation steps):
    # nn.Module._apply converts each parameter's .grad with it, and the sharded model's must follow.
    for m in (oracle, sharded):
        m(zoo.batch("nested", seed=5, device=dist.device)).float().pow(2).mean().backward()
    grads_before = {name: p.grad.detach().clone() for name, p in sharded.named_parameters() if p.grad is not None}
    convert(oracle)
    result = convert(sharded)
    where = f"rank {dist.rank}, {form}, use_orig_params={use_orig_params}"

    def grads() -> None:
        after = {name: p.grad for name, p in sharded.named_parameters() if p.grad is not None}
        if sorted(after) != sorted(grads_before):
            fail(f"parameters holding a gradient after {form} and a forward without grad", sorted(after), sorted(grads_before), where)
        for name, grad in after.items():
            assert_same_state(grad.detach(), grads_before[name].to(dtype), what=f"the gradient of {name!r} after {form}", where=where)
    if result is not sharded:
        fail(f"{form} returned another module", type(result).__name__, "the model itself", where)
    atol = DTYPE_ATOL[dtype]
    x = zoo.batch("nested", seed=3, device=dist.device).to(dtype)

    def full() -> None:
        got = ops.full_state_dict(sharded)
        assert_same_state(got, oracle.state_dict(), what=f"full model state dict after {form}", where=where)

    def sharded_dicts() -> None:
        params = dict(oracle.named_parameters())
        for what, got in (("sharded model state dict", ops.sharded_state_dict(sharded)),
                          ("state-dict API's sharded get", sd.get_model_state_dict(sharded))):
            for key, value in got.items():
                if key not in params:
                    continue
                here = f"{where}: {what}[{key!r}]"
                if value.dtype != dtype:
                    fail(f"{what}: dtype after {form}", value.dtype, dtype, here)
                if isinstance(value, DTensor):
                    assert_local_shard(value, params[key].detach(), what=what, where=here)
                else:
                    assert_same_state(value, params[key].detach(), what=what, where=here)

    def forward() -> None:
        with torch.no_grad():
            got, want = sharded(x), oracle(x)
        assert_same_state(got, want, what=f"output after {form}", where=where, atol=atol)

    def train() -> None:
        optim = torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)
        oracle_optim = torch.optim.SGD(oracle.parameters(), lr=0.05, momentum=0.9)
        for m, o in ((sharded, optim), (oracle, oracle_optim)):
            o.zero_grad(set_to_none=True)
            m(x).float().pow(2).mean().backward()
            o.step()
        assert_same_state(ops.full_state_dict(sharded), oracle.state_dict(), what=f"parameters trained after {form}",
                          where=where, atol=atol)
        osd = ops.optim_state_dict(sharded, optim)
        dtypes = sorted({str(s["momentum_buffer"].dtype) for s in osd["state"].values()})
        if dtypes != [str(dtype)]:
            fail(f"optimizer state after {form}: dtypes of the momentum buffers", dtypes, [str(dtype)], where)

    # .e after .c: the gradients are still there after a forward without grad (an evaluation between
    # a backward and the optimizer's step), as in the unwrapped model.
    check_each({"OS-26.a": full, "OS-26.b": sharded_dicts, "OS-26.c": forward, "OS-26.e": grads, "OS-26.d": train})
