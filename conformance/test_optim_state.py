"""OS: sharded data parallel and its optimizer state dicts keyed by clean FQNs (conformance/SPEC.md).

Oracle: the unwrapped zoo model, built from the same seed and trained on the whole global batch on
every rank, while the sharded model trains on its rank's equal slice of it. Second oracle: the
reference, for round trips across implementations. Goldens pin the structure of one state dict.

How the tests are built:

* Every load goes into a target that differs from the source in what the load must change
  (:func:`load_target`): built from another seed, its optimizer over the parameters in reverse order
  (param groups reversed too), stepped once so it has state of its own, then every hyperparameter
  perturbed (``initial_lr`` and a custom key included). The unwrapped oracle of the target is laid out
  the same way and loads the same dicts by FQN
  (:func:`~conformance.optim_state_support.load_into_oracle`), so right after a load the implementation
  must equal it bit for bit, and one more step later to float tolerance.
* Sharded results are checked on every rank against the documented layout (:class:`Layout` for flat
  parameters and their original parameters, ``torch.chunk`` pieces for DTensors), never only after
  gathering.
* Errors are tried with the bad input on every rank and on one rank only; every rank must then raise
  the same error, promptly, and nothing may change on any rank.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from conformance import models
from conformance.adapters.sharding import STRATEGIES, ShardingPlan
from conformance.asserts import (
    assert_bitwise_equal,
    assert_local_shard,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    clause,
    expect_error,
    fail,
    raised,
    snapshot,
)
from conformance.checkpoint_support import dtensor_of
from conformance.error_cases import EVERY_RANK, ONE_RANK, WHERE, bad_input_here, parametrize_where
from conformance.fqn import canonical_fqn
from conformance.optim_state_inputs_support import (
    FAILING_CALLS,
    InjectedFault,
    Layout,
    assert_not_wrapped,
    bad_layout,
    bad_osd,
    check_error,
    edge_state,
    state_dict_calls,
    write_state,
)
from conformance.optim_state_support import (
    ATOL,
    OPTIMIZERS,
    Run,
    Setup,
    assert_continues,
    assert_model_matches,
    assert_osd_matches,
    attach_optimizer,
    load_phase,
    load_target,
    optimizer_fqn_order,
    same_partition,
    save_phase,
    sharded_positional,
    structure_of,
    trip_id,
)


@pytest.mark.req("OS-1", "OS-3", "OS-5", "OS-6")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_and_optim_state_dict(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """SGD with momentum and AdamW, 3 steps: parameters and the full optimizer state dict equal the
    unwrapped model's; every positional state of the sharded one is, on every rank, the documented
    local shard of the oracle's value; AdamW's sharded one loads into a differing target (another
    seed, reversed parameter order, own state, perturbed hyperparameters), which then equals the
    oracle bitwise and, after one more step, to tolerance."""
    ops = impl.require("optim_state")
    for optimizer in OPTIMIZERS:
        setup = Setup(strategy=strategy, use_orig_params=use_orig_params, optimizer=optimizer)
        run = Run(dist, impl, setup)
        run.train(3)
        assert_model_matches(ops, run, f"{setup} after 3 steps")
        assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{setup} full")
        sharded = ops.optim_state_dict(run.model, run.optim, sharded=True)
        assert_osd_matches(sharded, run.oracle_osd(), f"{setup} sharded on rank {dist.rank}", sharded=True, strategy=strategy)
        if optimizer == "adamw":  # one load per strategy and mode (SGD's loads: test_zoo_model's tiny case)
            assert_continues(load_target(dist, impl, setup), run, sharded, where=f"{setup}: loaded the sharded state dict")


@pytest.mark.req("OS-2")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])
def test_what_the_optimizer_sees(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """Right after wrapping, on every rank: the optimizer's parameters stand for every FQN once; a flat
    parameter lists its unit's FQNs in flat order and holds, bit for bit, this rank's chunk of the
    unit's padded flat parameter made of the unwrapped parameters; an original parameter holds its part
    of that chunk (1-D, possibly empty), a DTensor its ``torch.chunk`` piece."""
    ops = impl.require("optim_state")
    # mlp at world size 2: the root unit's 165 elements pad to 166, and net.2.bias has no element on rank 0
    run = Run(dist, impl, Setup(model="mlp", strategy=strategy, use_orig_params=use_orig_params))
    oracle = dict(run.oracle.named_parameters())
    layout = Layout(run.setup, run.oracle, dist.world_size, dist.rank)
    named = ops.optimizer_params(run.model)
    fqns = sorted(f for group, _ in named for f in group)
    if fqns != sorted(oracle):
        fail("the optimizer's parameters stand for", fqns, sorted(oracle), f"rank {dist.rank}")
    for group, param in named:
        where = f"{run.setup}, rank {dist.rank}, optimizer parameter for {list(group)}"
        if isinstance(param, DTensor):
            assert_local_shard(param.detach(), oracle[group[0]].detach(), what="parameter", where=where)
        elif not use_orig_params:
            unit = layout.unit_of[group[0]]
            if tuple(group) != layout.units[unit].fqns:
                fail("a flat parameter's FQNs (flat order)", list(group), list(layout.units[unit].fqns), where)
            expected = layout.flat_local(unit, {f: oracle[f].detach() for f in group})
            if tuple(param.shape) != tuple(expected.shape):
                fail("flat parameter: local shape", tuple(param.shape), f"{tuple(expected.shape)} = ceil(numel / {layout.shards})", where)
            real = layout.real_numel(unit)
            assert_bitwise_equal(param.detach()[:real], expected[:real], what="flat parameter: local chunk (padding excluded)", where=where)
        else:
            if len(group) != 1:
                fail("an original parameter stands for one FQN", list(group), "one FQN", where)
            expected = layout.orig_local(group[0], oracle[group[0]].detach())
            assert_bitwise_equal(param.detach(), expected, what="original parameter: its part of the local chunk", where=where)


@pytest.mark.req("OS-3", "OS-5", "OS-6", "OS-12")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize(
    ("model", "kind"),
    [("mlp", "param-dtype"), ("dtypes", "param-dtype"), ("mlp", "other-dtypes"), ("mlp", "0-dim")],
    ids=["float32-params-float32-edges", "float64-params-float64-edges", "float32-params-other-dtypes", "float32-params-0-dim"],
)
def test_state_values_are_carried_bit_exactly(dist, impl, model: str, kind: str, use_orig_params: bool) -> None:
    """Optimizer state written directly (see :func:`edge_state`) is gathered into the full optimizer
    state dict bit for bit, sharded into DTensors whose local shard on every rank is the documented
    piece bit for bit; both load into a differing target bit for bit, then one more step matches the
    oracle. ``torch.optim``'s own load casts every state but ``step`` to the parameter's dtype (and CPU
    kernels disagree on the NaN payloads such a cast produces), so the loaded dicts keep the entries of
    the parameter's dtype: float32 edge values for float32 parameters, float64 ones (beyond float32)
    for float64 parameters, and 0-dim float32 NaN payloads and -0.0; the entries of other dtypes load
    with their NaNs made 0, and must be cast as ``torch.optim`` casts them (float64 beyond float32,
    bf16, integers and bools into float32: a state of another run's dtypes). A fork that routes state
    through float32 or a common dtype, canonicalises NaNs, drops -0.0, or keeps a loaded state's own
    dtype fails here."""
    ops = impl.require("optim_state")
    source = Run(dist, impl, Setup(model=model, use_orig_params=use_orig_params))
    write_state(source, edge_state(source, kind))
    expected = source.oracle_osd()
    full = ops.optim_state_dict(source.model, source.optim)
    assert_osd_matches(full, expected, f"{source.setup} {kind}: full optimizer state dict", atol=None)
    sharded = ops.optim_state_dict(source.model, source.optim, sharded=True)
    assert_osd_matches(sharded, expected, f"{source.setup} {kind}: sharded, rank {dist.rank}", atol=None, sharded=True)
    dtype = next(source.oracle.parameters()).dtype
    # A sharded dict's 0-dim states are the full one's. Entries of other dtypes load with their NaNs
    # made 0 (every FQN keeps the same entries: a flat parameter holds one of each for all its FQNs).
    forms = {"param-dtype": ("full", "sharded"), "0-dim": ("full",), "other-dtypes": ("full", "sharded")}[kind]

    def loadable_entry(index: int, entry: dict[str, Any]) -> dict[str, Any]:
        if kind != "other-dtypes":
            return {n: v for n, v in entry.items() if n == "step" or v.dtype == dtype}
        loaded = {n: torch.nan_to_num(v, nan=0.0, posinf=math.inf, neginf=-math.inf) if v.is_floating_point() and n != "step" else v
                  for n, v in entry.items()}
        # States whose dtype differs between parameters, bf16 and float64 in turn, starting with
        # either (a checkpoint that mixed them): each is cast to the parameter's dtype alone, never
        # through another parameter's dtype (as a flat buffer of the first one's would).
        values = loaded["exp_avg"] * 3  # float32 values: not all of them fit in bf16
        bf16, f64 = values.to(torch.bfloat16), values.to(torch.float64)
        loaded["mixed"], loaded["mixed_too"] = (bf16, f64) if index % 2 == 0 else (f64, bf16)
        return loaded

    for name, osd in (("full", full), ("sharded", sharded)):
        if name not in forms:
            continue
        loadable = {"state": {f: loadable_entry(i, e) for i, (f, e) in enumerate(sorted(osd["state"].items()))},
                    "param_groups": osd["param_groups"]}
        assert_continues(load_target(dist, impl, source.setup), source, loadable, where=f"{source.setup} {kind}: {name} state dict loaded")


@pytest.mark.req("OS-4")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_rank0_only_and_cpu_offload(dist, impl, use_orig_params: bool) -> None:
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(use_orig_params=use_orig_params))
    run.train(2)
    options = ((True, False), (False, True), (True, True))
    # Every call first (collectives), then the checks, so a failing check leaves no rank waiting.
    results = [ops.optim_state_dict(run.model, run.optim, rank0_only=r, cpu_offload=c) for r, c in options]
    for (rank0_only, cpu_offload), osd in zip(options, results):
        where = f"{run.setup} rank0_only={rank0_only} cpu_offload={cpu_offload} on rank {dist.rank}"
        if rank0_only and dist.rank != 0:
            assert_same_state(osd, {}, what="rank0_only: the optimizer state dict of a rank other than 0", where=where)
            continue
        assert_osd_matches(osd, run.oracle_osd(), where)
        if cpu_offload:
            devices = sorted({str(v.device) for s in osd["state"].values() for v in s.values() if isinstance(v, torch.Tensor)})
            if devices not in ([], ["cpu"]):
                fail("cpu_offload: devices of the state tensors", devices, ["cpu"], where)


# (saved with, loaded into): strategy and use_orig_params on each side
ROUND_TRIPS = [
    (("FULL_SHARD", False), ("NO_SHARD", True)),
    (("NO_SHARD", True), ("HYBRID_SHARD", False)),
    (("SHARD_GRAD_OP", True), ("FULL_SHARD", False)),
    (("HYBRID_SHARD", True), ("SHARD_GRAD_OP", True)),
]


@pytest.mark.req("OS-6")
@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=trip_id)
def test_load_into_other_strategy(dist, impl, trip) -> None:
    """A full optimizer state dict saved under one strategy and use_orig_params loads under another,
    into a differing target (groups and parameters in reverse order, own state, perturbed
    hyperparameters); bitwise equal to the oracle right after, and after one more step to tolerance."""
    impl.require("optim_state")
    (s1, u1), (s2, u2) = trip
    source = Run(dist, impl, Setup(strategy=s1, use_orig_params=u1, optimizer="adamw"))
    source.train(2)
    target = load_target(dist, impl, Setup(strategy=s2, use_orig_params=u2, optimizer="adamw"))
    assert_continues(target, source, where=trip_id(trip))


@pytest.mark.req("OS-6", "OS-24")
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("stateless", ["net.0.weight", "net.0.bias"], ids=["first-of-its-unit", "last-of-its-unit"])
def test_a_parameter_without_state_into_flat_parameters(dist, impl, stateless: str, optimizer: str) -> None:
    """A full optimizer state dict in which one parameter has no state (it has had no gradient yet: a
    layer no batch reached, an expert no token was routed to), the first or the last of its unit, saved
    with ``use_orig_params=True`` and loaded into flat parameters, which hold one state for all their
    parameters. SGD keeps no scalar state: the dict loads, and every other parameter's state is back
    bit for bit (a loader that lays the saved values out from the wrong offset shifts every value after
    the gap). AdamW's ``step`` is a scalar: the parameter without one would take the others' (OS-24), so
    the load is a ValueError naming it that changes nothing."""
    ops = impl.require("optim_state")
    source = Run(dist, impl, Setup(use_orig_params=True, optimizer=optimizer))
    source.train(2)
    osd = ops.optim_state_dict(source.model, source.optim)
    saved = {"state": {fqn: entry for fqn, entry in osd["state"].items() if fqn != stateless}, "param_groups": osd["param_groups"]}
    target = load_target(dist, impl, Setup(use_orig_params=False, optimizer=optimizer))
    where = f"{optimizer}, no state for {stateless}, rank {dist.rank}"
    if optimizer == "adamw":
        with clause("OS-24"):
            untouched = snapshot(optim=target.optim)
            expect_error(lambda: ops.load_optim_state_dict(target.model, target.optim, saved), ValueError, keys=[stateless],
                         what="loading a parameter without a step into a flat parameter whose others have one", where=where)
            assert_unchanged(untouched, optim=target.optim, where=where)
        return
    with clause("OS-6"):
        ops.load_optim_state_dict(target.model, target.optim, saved)
        loaded = ops.optim_state_dict(target.model, target.optim)["state"]
        assert_same_state({fqn: loaded.get(fqn) for fqn in saved["state"]}, saved["state"], what="optimizer state after the load",
                          where=where, check_order=False)


@pytest.mark.req("OS-7")
@pytest.mark.parametrize("trip", ROUND_TRIPS[:3:2], ids=trip_id)
def test_load_at_other_world_size(pools, world_size_pair, impl, trip) -> None:
    """Saved at one world size, loaded at another (strategy and use_orig_params changing too) into a
    differing target."""
    impl.require("optim_state")
    (s1, u1), (s2, u2) = trip
    save_ws, load_ws = world_size_pair
    saved = pools.run(save_ws, save_phase, impl, Setup(strategy=s1, use_orig_params=u1), 2)[0]
    pools.run(load_ws, load_phase, impl, Setup(strategy=s2, use_orig_params=u2), 2, saved)


@pytest.mark.req("OS-8")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("direction", ["from-reference", "to-reference"])
def test_load_across_implementations(dist, impl, reference_impl, direction: str, use_orig_params: bool) -> None:
    """A full optimizer and model state dict of the reference loads into the implementation under test
    and back, into a differing target; bitwise equal to the oracle right after, and one more step
    matches it."""
    impl.require("optim_state"), reference_impl.require("optim_state")
    if impl.name == reference_impl.name:
        pytest.skip("a differential check needs an implementation other than the reference")
    saver, loader = (reference_impl, impl) if direction == "from-reference" else (impl, reference_impl)
    source = Run(dist, saver, Setup(strategy="FULL_SHARD", use_orig_params=use_orig_params))
    source.train(2)
    target = load_target(dist, loader, Setup(strategy="SHARD_GRAD_OP", use_orig_params=use_orig_params))
    assert_continues(target, source, where=direction)


@pytest.mark.req("OS-9")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_ranks_agree_on_key_order(dist, impl, use_orig_params: bool) -> None:
    """Odd ranks build their optimizer over the parameters in reverse order: every rank still returns
    the same state dict, in rank 0's order, and it loads back."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="nested", use_orig_params=use_orig_params), reversed_params=bool(dist.rank % 2))
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    assert_osd_matches(osd, run.oracle_osd(), f"{run.setup} on rank {dist.rank}")
    orders = dist.all_gather_object((list(osd["state"]), [g["params"] for g in osd["param_groups"]]))
    if any(o != orders[0] for o in orders):
        fail("ranks disagree on the order of keys", orders, "rank 0's order on every rank", f"rank {dist.rank}")
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{run.setup} after reload on rank {dist.rank}")


@pytest.mark.req("OS-9")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("order", ["model", "reversed"])
def test_one_key_order_when_ranks_list_parameters_alike(dist, impl, order: str, use_orig_params: bool) -> None:
    """Every rank's optimizer lists the parameters in one order (the model's, or reversed with the
    groups): every rank returns the state dict with the same key order (``state`` and each group's
    ``params``), the groups listing the FQNs in the order rank 0's optimizer lists them, holding the
    unwrapped model's state; it loads back, and one more step matches the unwrapped model."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="nested", use_orig_params=use_orig_params, groups=use_orig_params, order=order))
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    where = f"{run.setup} ({order} order) on rank {dist.rank}"
    assert_osd_matches(osd, run.oracle_osd(), where)
    order0 = dist.broadcast_object(optimizer_fqn_order(ops, run))
    keys = (list(osd["state"]), [list(g["params"]) for g in osd["param_groups"]])
    every = dist.all_gather_object(keys)
    if any(k != every[0] for k in every):
        fail("ranks disagree on the order of keys", every, "one order on every rank", where)
    got_params = [fqn for group in keys[1] for fqn in group]
    if got_params != order0:
        fail("the order of the param groups' FQNs", keys[1], f"rank 0's optimizer order {order0}", where)
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{where}: one step after the reload")
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{where}: one step after the reload")


@pytest.mark.req("OS-9")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_differently_ordered_optimizers_hold_one_state(dist, impl, use_orig_params: bool) -> None:
    """Odd ranks list the parameters in reverse order: every rank's state dict holds the unwrapped
    model's state and hyperparameters per FQN (order aside) and the same FQNs and groups as every
    other rank's; it loads back on every rank, and one more step matches the unwrapped model, model
    and optimizer state."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="nested", use_orig_params=use_orig_params), reversed_params=bool(dist.rank % 2))
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    where = f"{run.setup} on rank {dist.rank}, odd ranks' optimizers reversed"
    assert_osd_matches(osd, run.oracle_osd(), where)
    contents = dist.all_gather_object((sorted(osd["state"]), sorted(sorted(g["params"]) for g in osd["param_groups"])))
    if any(c != contents[0] for c in contents):
        fail("ranks disagree on the FQNs and groups of the state dict", contents, "the same on every rank", where)
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{where}: one step after the reload")
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{where}: one step after the reload")


ZOO_CASES = [
    pytest.param(Setup(model="tied"), id="tied", marks=pytest.mark.req("OS-10")),
    pytest.param(Setup(model="frozen"), id="frozen", marks=pytest.mark.req("OS-11")),
    pytest.param(Setup(model="groups", groups=True, extra_state=True), id="groups", marks=pytest.mark.req("OS-12")),
    pytest.param(Setup(model="tiny", optimizer="sgd"), id="tiny", marks=pytest.mark.req("OS-13")),
    # Optimizer order b.bias, b.weight, a.weight: at world size 2 rank 0 holds no part (so no state) of
    # the first two, then a part of the third, in one unit's batch.
    pytest.param(Setup(model="tiny", optimizer="sgd", order="reversed"), id="tiny-reversed", marks=pytest.mark.req("OS-13")),
    pytest.param(Setup(model="nested", strategy="SHARD_GRAD_OP"), id="nested", marks=pytest.mark.req("OS-14")),
    pytest.param(Setup(model="checkpoint"), id="checkpoint", marks=pytest.mark.req("OS-14")),
]


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("case", ZOO_CASES)
def test_zoo_model(dist, impl, case: Setup, use_orig_params: bool) -> None:
    """Train, compare the optimizer state dict with the unwrapped model's, load it into a differing
    target, compare bitwise, step again and compare. Tied weights have one entry under their first
    FQN; frozen parameters none; param groups keep their hyperparameters and extra keys, state its
    extra entries; a parameter with an empty shard and wrapper segments (nested units, activation
    checkpointing) change nothing."""
    ops = impl.require("optim_state")
    setup = replace(case, use_orig_params=use_orig_params)
    run = Run(dist, impl, setup)
    run.train(2)
    assert_model_matches(ops, run, str(setup))
    osd = ops.optim_state_dict(run.model, run.optim)
    assert_osd_matches(osd, run.oracle_osd(), str(setup))
    assert_continues(load_target(dist, impl, setup), run, osd, where=f"{setup} reloaded")


@pytest.mark.req("OS-11")
def test_frozen_parameters_stay_frozen_inside_forward(dist, impl) -> None:
    """``use_orig_params=True`` with frozen and trainable parameters in one unit (``frozen``'s stem,
    body and head share the root's): inside the sharded model's forward, as in the unwrapped model's,
    the frozen parameters read ``requires_grad=False`` and the trainable ones ``True``, and after the
    step the frozen ones have no gradient. Code branches on that flag (PEFT's adapters, a frozen
    encoder's ``torch.no_grad`` shortcut), and a frozen parameter whose view still requires grad makes
    backward compute its gradient: the memory freezing was to save (pytorch/pytorch#91167)."""
    run = Run(dist, impl, Setup(model="frozen", use_orig_params=True))
    seen: dict[str, list[bool]] = {}

    def record(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            seen.setdefault(name, [bool(getattr(module, attr).requires_grad) for attr in ("weight", "bias")])

        return hook

    handles = [run.module(name).register_forward_pre_hook(record(name)) for name in ("stem", "body")]
    try:
        run.train(1)
    finally:
        for handle in handles:
            handle.remove()
    expected = {"stem": [False, False], "body": [True, True]}
    if seen != expected:
        fail("requires_grad of (weight, bias) inside forward", seen, expected, f"rank {dist.rank}")
    grads = {n: p.grad is not None for n, p in run.model.named_parameters() if canonical_fqn(n).startswith("stem.")}
    if any(grads.values()):
        fail("frozen parameters with a gradient after the step", grads, "none", f"rank {dist.rank}")


@pytest.mark.req("OS-13")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize(
    "setup",
    [Setup(model="tiny", optimizer="sgd", order="reversed", use_orig_params=True), Setup(model="groups", use_orig_params=True)],
    ids=["tiny-reversed", "groups"],
)
def test_no_state_where_a_parameters_part_is_empty(dist, impl, setup: Setup) -> None:
    """An optimizer that skips parameters without a gradient holds no state on a rank for a parameter
    whose part is empty there (torch's FSDP leaves exactly that); the full optimizer state dict is the
    unwrapped model's all the same, for the parameters after it in the unit too: at world size 2,
    ``tiny`` in reverse order leaves rank 0 without ``b.bias`` and ``b.weight`` before ``a.weight``,
    and ``groups`` leaves the last rank without ``inp.weight`` before the parameters it holds."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, setup)
    run.train(2)
    empty = []
    for fqns, param in ops.optimizer_params(run.model):
        if (param.to_local() if isinstance(param, DTensor) else param).numel() == 0:
            run.optim.state.pop(param, None)  # torch's FSDP never makes it: such a part gets no gradient
            empty.append(fqns[0])
    if not any(dist.all_gather_object(empty)):
        pytest.skip(f"{impl.name}: no parameter's part is empty on any rank at world size {dist.world_size}")
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{run.setup}: no state for {empty} on rank {dist.rank}")


@pytest.mark.req("OS-15")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_fqn_to_param_info_from_any_module(dist, impl, use_orig_params: bool) -> None:
    """From the root: every clean FQN with its unit's flat parameter and its index there. From the
    submodule ``net``: only the units below it, with FQNs relative to ``net``."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="mlp", use_orig_params=use_orig_params))
    try:
        from_root = ops.fqn_to_param_info(run.model)
    except Exception as exc:  # Unsupported is the adapter's way to say "no flat parameters"
        from conformance.adapters.base import Unsupported

        if isinstance(exc, Unsupported):
            pytest.skip(str(exc))
        raise
    assert sorted(from_root) == sorted(n for n, _ in run.oracle.named_parameters()), f"FQNs from the root: {sorted(from_root)}"
    assert same_partition(from_root), f"FQN -> (flat parameter, index) from the root: {from_root}"
    assert all(index == (0 if fqn.endswith("weight") else 1) for fqn, (_, index) in from_root.items()), (
        f"each unit flattens weight, then bias: {from_root}"
    )
    from_net = ops.fqn_to_param_info(run.module("net"))
    assert sorted(from_net) == ["0.bias", "0.weight", "4.bias", "4.weight"], f"FQNs from the submodule 'net': {sorted(from_net)}"
    assert from_net["0.weight"][1] == 0 and from_net["0.bias"][1] == 1, f"indices inside net.0's flat parameter: {from_net}"


@pytest.mark.req("OS-16")
@pytest.mark.rank_timeout(30)
@parametrize_where
@pytest.mark.parametrize(("use_orig_params", "form"), [(False, "full"), (True, "full"), (True, "sharded")], ids=["flat-full", "orig-full", "orig-sharded"])
@pytest.mark.parametrize("kind", ["unknown-fqn", "wrong-shape", "same-numel", "group-mismatch", "extra-group", "malformed"])
def test_bad_optimizer_state_dict_is_a_clear_error(dist, impl, kind: str, use_orig_params: bool, form: str, where: str) -> None:
    """A broken optimizer state dict, full or sharded (on every rank, or on the last rank only while
    the others load a good one): every rank raises the same ValueError/RuntimeError naming the FQN
    whole, and on every rank the optimizer (state, param groups, order) and the model are as they
    were. "extra-group": one more saved param group than the optimizer has, listing parameters of the
    model the optimizer does not hold (frozen ones). "same-numel": a positional state of another shape
    with the parameter's number of elements. "malformed": no optimizer state dict at all, its
    ``param_groups`` left out; the error names ``param_groups`` (never a bare ``KeyError``)."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="frozen" if kind == "extra-group" else "mlp", use_orig_params=use_orig_params))
    run.train(1)
    good = ops.optim_state_dict(run.model, run.optim, sharded=form == "sharded")
    bad, fqn = bad_osd(kind, good)
    before = snapshot(optim=run.optim, model=run.model)
    exc = raised(lambda: ops.load_optim_state_dict(run.model, run.optim, bad if bad_input_here(dist, where) else good))
    check_each({
        "OS-16.a": lambda: check_error(dist, exc, (ValueError, RuntimeError), (fqn,), f"{kind} ({form}) on {where}"),
        "OS-16.b": lambda: assert_unchanged(before, where=f"{kind} ({form}) on {where}: after the failed load, rank {dist.rank}",
                                            optim=run.optim, model=run.model),
    })


@pytest.mark.req("OS-16")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize(("use_orig_params", "form"), [(False, "full"), (True, "full"), (True, "sharded")], ids=["flat-full", "orig-full", "orig-sharded"])
@pytest.mark.parametrize("kind", ["wrong-shape", "same-numel", "group-mismatch"])
def test_bad_optimizer_state_dict_fails_alike_and_changes_nothing(dist, impl, kind: str, use_orig_params: bool, form: str) -> None:
    """A positional state of the wrong shape, or param groups that do not match the optimizer's (a
    parameter moved to a group of its own), in a full or sharded optimizer state dict on every rank:
    every rank raises the same ValueError or RuntimeError (type and message), and on every rank the
    optimizer (state, param groups, order) and the model are as they were; the optimizer then loads a
    good dict and trains on as the unwrapped model. (Naming the FQN, and the dict bad on one rank
    only, are test_bad_optimizer_state_dict_is_a_clear_error's.)"""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="mlp", use_orig_params=use_orig_params))
    run.train(1)
    good = ops.optim_state_dict(run.model, run.optim, sharded=form == "sharded")
    bad, _ = bad_osd(kind, good)
    before = snapshot(optim=run.optim, model=run.model)
    exc = raised(lambda: ops.load_optim_state_dict(run.model, run.optim, bad))
    where = f"{kind} ({form}) on rank {dist.rank}"

    def raises() -> None:
        assert_same_error_on_every_rank(dist, exc, what=f"{kind} ({form})")
        if not isinstance(exc, (ValueError, RuntimeError)):
            fail(f"{kind} ({form}): exception type", f"{type(exc).__name__}: {exc}", "ValueError or RuntimeError", where)

    check_each({"OS-16.a": raises, "OS-16.b": lambda: assert_unchanged(before, where=f"{where}: after the failed load", optim=run.optim, model=run.model)})
    ops.load_optim_state_dict(run.model, run.optim, good)
    run.train(1)
    assert_model_matches(ops, run, f"{where}: one step after loading the good dict")


@pytest.mark.req("OS-17")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize(
    ("kind", "where", "strategy"),
    [("mixed-requires-grad", EVERY_RANK, "FULL_SHARD"), ("mixed-requires-grad", ONE_RANK, "FULL_SHARD"),
     ("mixed-dtype", EVERY_RANK, "FULL_SHARD"), ("mixed-dtype", ONE_RANK, "FULL_SHARD"),
     ("shared-across-units", EVERY_RANK, "FULL_SHARD"), ("shared-across-units:proj/projX", EVERY_RANK, "FULL_SHARD"),
     ("shared-across-units:enc/enc_", EVERY_RANK, "FULL_SHARD"),
     ("mixed-requires-grad", ONE_RANK, "HYBRID_SHARD")],
    ids=lambda value: value.replace("/", "+").replace(":", "-"),
)
def test_bad_layout_is_a_clear_error(dist, impl, kind: str, where: str, strategy: str) -> None:
    """Frozen and trainable parameters in one flat parameter, or float32 and float64 ones (on every
    rank, or on the last rank only: a rank that froze or cast a layer by mistake), or one parameter in
    two units (also units whose names end alike): every rank raises the same ValueError naming the
    parameters whole, and every rank's module is as it was. HYBRID_SHARD's 2-D mesh spans the world
    too: the ranks agree on the error over all of it."""
    model, units, names, orig = bad_layout(kind, bad_input_here(dist, where), dist.device)
    sharding = impl.require("sharding")
    ids = {id(m) for n, m in model.named_modules() if n in units}
    plan = ShardingPlan(strategy, orig, units=lambda m: id(m) in ids, device=dist.device)
    reason = sharding.unsupported(plan)
    if reason:
        pytest.skip(reason)
    before = snapshot(model=model)
    ops = impl.require("optim_state")

    def shard_and_attach() -> None:
        # A stack whose engine takes the optimizer (attach_optimizer) may see the layout only then: the
        # error may come from either step, as it would in a training script.
        wrapped = sharding.shard(model, plan)
        attach_optimizer(ops, wrapped, torch.optim.SGD([p for _, p in ops.optimizer_params(wrapped)], lr=0.1))

    exc = raised(shard_and_attach)
    check_each({
        "OS-17.a": lambda: check_error(dist, exc, (ValueError,), names, f"{kind} on {where}"),
        "OS-17.b": lambda: assert_not_wrapped(before, model, f"{kind} on {where}: rank {dist.rank}"),
    })


@pytest.mark.req("OS-17")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize(("strategy", "mesh_dims"), [("HYBRID_SHARD", 1), ("FULL_SHARD", 2)], ids=["hybrid-on-a-1d-mesh", "full-shard-on-a-2d-mesh"])
def test_mesh_that_does_not_fit_is_a_clear_error(dist, impl, strategy: str, mesh_dims: int) -> None:
    """HYBRID_SHARD given a 1-D mesh (it needs one of (replicate, shard)), FULL_SHARD given a 2-D one,
    ``(1, world)`` (it shards over one dim): every rank raises the same ValueError naming the mesh, and
    the module is as it was, unwrapped. The same model then shards with the strategy's own mesh (the
    adapter's default): the error was the misfit's, not the call's. An implementation that reads a
    misfit mesh as another strategy trains with a layout nobody asked for."""
    shape = (dist.world_size,) if mesh_dims == 1 else (1, dist.world_size)
    case = f"{strategy} on a mesh of shape {shape}"
    sharding = impl.require("sharding")
    model = models.build("mlp", device=dist.device)
    before = snapshot(model=model)
    misfit = ShardingPlan(strategy, device=dist.device, mesh=dist.mesh(*shape))
    exc = raised(lambda: sharding.shard(model, misfit))

    def names_the_mesh() -> None:
        check_error(dist, exc, (ValueError,), (), case)
        if "mesh" not in str(exc).lower():
            fail(f"{case}: the error names the mesh", str(exc), "a message about the mesh", f"rank {dist.rank}")

    check_each({"OS-17.a": names_the_mesh, "OS-17.b": lambda: assert_not_wrapped(before, model, f"{case}: rank {dist.rank}")})
    sharding.shard(model, ShardingPlan(strategy, device=dist.device))


@pytest.mark.req("OS-18")
def test_optim_state_dict_structure_golden(dist, impl) -> None:
    """AdamW on the ``groups`` model (two param groups, use_orig_params): the full optimizer state dict's
    structure, identical at every world size and for every implementation."""
    from expecttest import assert_expected_inline

    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="groups", groups=True))
    run.train(1)
    structure = structure_of(ops.optim_state_dict(run.model, run.optim))
    assert structure == structure_of(run.oracle_osd()), f"structure differs from the unwrapped model's:\n{structure}"
    if dist.rank == 0:  # one rank writes the golden when accepting
        assert_expected_inline(structure, """\
inp.bias: exp_avg=float32[9] exp_avg_sq=float32[9] step=float32[]
inp.weight: exp_avg=float32[9, 5] exp_avg_sq=float32[9, 5] step=float32[]
norm.bias: exp_avg=float32[9] exp_avg_sq=float32[9] step=float32[]
norm.weight: exp_avg=float32[9] exp_avg_sq=float32[9] step=float32[]
out.bias: exp_avg=float32[2] exp_avg_sq=float32[2] step=float32[]
out.weight: exp_avg=float32[2, 9] exp_avg_sq=float32[2, 9] step=float32[]
group 0: {'lr': 0.02, 'weight_decay': 0.01, 'tag': 'group-0', 'betas': (0.9, 0.999)} params=['inp.weight', 'out.weight']
group 1: {'lr': 0.01, 'weight_decay': 0.0, 'tag': 'group-1', 'betas': (0.9, 0.999)} params=['inp.bias', 'norm.bias', 'norm.weight', 'out.bias']
""")


@pytest.mark.req("OS-19")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("model", ["tied", "dtypes"])
def test_full_model_state_dict(dist, impl, model: str, use_orig_params: bool) -> None:
    """The full model state dict has the unwrapped model's keys in its order and its values (``tied``
    after a step, to tolerance; ``dtypes``, float64 parameters and a buffer of every edge dtype, right
    after wrapping, bit for bit); it loads into a model built from another seed, whose full state dict
    then equals it bit for bit."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model=model, use_orig_params=use_orig_params))
    trained = model != "dtypes"
    if trained:
        run.train(1)
    with clause("OS-19.a"):
        assert_model_matches(ops, run, f"{run.setup}: full state dict", atol=ATOL if trained else None)
    full = ops.full_state_dict(run.model)
    expected = {k: v.detach().clone() for k, v in full.items()}  # a load may rewrite the dict it is given
    with clause("OS-19.c"):
        target = Run(dist, impl, replace(run.setup, seed=1))
        ops.load_full_state_dict(target.model, full)
        assert_same_state(ops.full_state_dict(target.model), expected, what="full model state dict after the load", where=str(run.setup))


@pytest.mark.req("OS-19")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])  # SHARD_GRAD_OP: FULL_SHARD's layout
def test_sharded_model_state_dict(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """The sharded model state dict has the full one's keys; every parameter is a DTensor of its full
    shape whose local shard on every rank is its documented piece of the full value (bit for bit),
    buffers are as in the full one; it loads into a model built from another seed, which then has the
    same full state dict bit for bit."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="tiny", strategy=strategy, use_orig_params=use_orig_params))
    run.train(1)
    full = ops.full_state_dict(run.model)
    sharded = ops.sharded_state_dict(run.model)
    with clause("OS-19.b"):
        if list(sharded) != list(full):
            fail("sharded model state dict: keys", list(sharded), list(full), str(run.setup))
        params = {n for n, _ in run.oracle.named_parameters()}
        for key, value in sharded.items():
            where = f"{run.setup}: {key!r} on rank {dist.rank}"
            if key in params:
                if not isinstance(value, DTensor):
                    fail("sharded model state dict: a parameter is not a DTensor", type(value).__name__, "DTensor", where)
                sharded_positional(value, full[key], strategy, "sharded model state dict", where, None)
            else:
                assert_same_state(value, full[key], what="sharded model state dict: a buffer", where=where)
    full = {k: v.detach().clone() for k, v in full.items()}
    with clause("OS-19.c"):
        target = Run(dist, impl, replace(run.setup, seed=1))
        ops.load_sharded_state_dict(target.model, sharded)
        assert_same_state(ops.full_state_dict(target.model), full, what="full model state dict after loading the sharded one", where=str(run.setup))


#: OS-19's bad model state dicts: (kind, which state dict, use_orig_params, where). A sharded entry given
#: as a plain tensor is a valid sharded dict when every rank gives it (plain full tensors load); only a
#: mix, a DTensor on some ranks and not on others, is an error.
_BAD_MODEL_STATES = [
    *((kind, state, orig, where) for kind in ("wrong-shape", "missing-key") for state in ("full", "sharded")
      for orig in (False, True) for where in WHERE),
    *(("plain-for-a-dtensor", "sharded", orig, ONE_RANK) for orig in (False, True)),
]


@pytest.mark.req("OS-19")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize(("kind", "state", "use_orig_params", "where"), _BAD_MODEL_STATES,
                         ids=[f"{kind}-{state}-{'orig' if orig else 'flat'}-{where}" for kind, state, orig, where in _BAD_MODEL_STATES])
def test_bad_model_state_dict_is_a_clear_error(dist, impl, kind: str, state: str, where: str, use_orig_params: bool) -> None:
    """A full or sharded model state dict with a wrongly shaped entry (a DTensor in a sharded one) or a
    missing one (on every rank, or on the last rank only), or a sharded one whose parameter is a plain tensor on the last rank only (a
    DTensor on the others: the ranks would gather different entries): every rank raises the same
    ValueError/RuntimeError naming the key whole, and every rank's model is as it was."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="tied", use_orig_params=use_orig_params))
    get, load = ((ops.full_state_dict, ops.load_full_state_dict) if state == "full"
                 else (ops.sharded_state_dict, ops.load_sharded_state_dict))
    good = get(run.model)
    key = "body.bias" if kind == "missing-key" else "body.weight"
    if kind == "missing-key":
        bad = {k: v for k, v in good.items() if k != key}
    elif kind == "wrong-shape":
        wrong = torch.zeros(2 * dist.world_size, 3)
        sharded = isinstance(good[key], DTensor)  # a wrong shape of the entry's own kind
        bad = {**good, key: dtensor_of(wrong, good[key].device_mesh, good[key].placements) if sharded else wrong}
    else:
        bad = {**good, key: ops.full_state_dict(run.model)[key]}
    before = snapshot(model=run.model)
    exc = raised(lambda: load(run.model, bad if bad_input_here(dist, where) else good))
    label = f"{kind} in the {state} state dict on {where}"
    check_each({
        "OS-19.d": lambda: check_error(dist, exc, (ValueError, RuntimeError), (key,), label),
        "OS-19.e": lambda: assert_unchanged(before, where=f"{label}: rank {dist.rank}", model=run.model),
    })


@pytest.mark.req("OS-20")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("call", list(FAILING_CALLS))
def test_state_dict_settings_survive_a_failure(dist, impl, call: str) -> None:
    """A state-dict call that raises from inside (a hook of the optimizer's or a submodule's own
    state_dict/load_state_dict raises once, on every rank) lets that exception through; afterwards
    every state-dict call (the model's default ``state_dict()``, full and sharded model state dicts,
    full and sharded optimizer state dicts) returns exactly what it returned before, and training goes
    on matching the unwrapped model: no state-dict type, option or unsharded parameter is left behind."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="mlp"))
    run.train(1)
    before = state_dict_calls(run)
    arm, failing = FAILING_CALLS[call]
    arm(run)
    exc = raised(lambda: failing(run, before))
    if not isinstance(exc, InjectedFault):
        fail(f"{call}: what the failing call raised", f"{type(exc).__name__}: {exc}" if exc else "nothing",
             "the InjectedFault raised inside it", f"rank {dist.rank}")
    after = state_dict_calls(run)
    for name in before:
        assert_same_state(after[name], before[name], what=f"{name} after a failed {call}", where=f"rank {dist.rank}")
    run.train(1)
    assert_model_matches(ops, run, f"{call}: one step after the failure")
