"""Real architectures (conformance/real_models.py) through the suite's oracle: the run that never stopped.

Tiny ``transformers`` models (GPT-2, Llama untied and tied, BERT, T5, Mixtral, SwitchTransformers, ViT) with the block
classes as sharding units. The oracle is the unwrapped model of the same seed trained on every whole
global batch, while the sharded model trains on its rank's equal slice; a load goes into a model of
another seed whose optimizer took a step of its own and then had every hyperparameter perturbed.

* OS-21: sharded by the adapter, AdamW in two param groups, 2 steps: the full model and optimizer state
  dicts equal the unwrapped model's (float tolerance: ranks average gradients); they load into another
  seed's model sharded with another strategy and ``use_orig_params`` (bitwise right after the load), and
  one more step matches the unwrapped run. With flat parameters the oracle steps every parameter of a
  unit that has a gradient (:func:`conformance.real_models.give_flat_parameter_grads`).
* SD-22: ``get_state_dict`` / ``set_state_dict`` on the unwrapped model, one process: bitwise throughout.
  A parameter that never had a gradient (a Switch expert no token reached) has its initial state in
  the get (SD-20, SD-21: :func:`with_initial_state`).
* ML-21: the sharded model and optimizer state saved as a checkpoint and loaded into another seed's
  sharded model: bitwise right after the load, then one more step matches the unwrapped run. Whether
  the state dicts hold initial state for a parameter without gradient is not compared (the checkpoint
  ops may take them from OS's optimizer state dict, which has none, OS-23, or from SD's get, which has).

Every test also checks that a tied parameter keeps every key ``nn.Module.state_dict()`` gives it and
that a load leaves non-persistent buffers (BERT's ``position_ids``, Llama's rotary ``inv_freq``) alone.
Without ``transformers`` every test skips (``pip install statedict-conformance[models]``).

Cost: the full strategy x ``use_orig_params`` grid runs for :data:`GRID_MODELS` (the ones that break
things); the other models run one cell, unless the hypothesis profile is ``thorough``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import settings
from torch import nn

from conformance.adapters.sharding import STRATEGIES, ShardingPlan
from conformance.asserts import assert_same_state, assert_unchanged, clause, expect_error, fail, snapshot
from conformance.fqn import canonical_fqn
from conformance.generated import assert_optimizer_matches, fqn_keyed, single_threaded, to_cpu
from conformance.real_models import (
    GLOBAL_BATCH,
    REAL_MODELS,
    RealModel,
    adamw,
    parameter_units,
    rank_slice,
    train_step,
    weight_decay_groups,
)
from conformance.values import perturb_hyperparameters


def _real(name: str) -> RealModel:
    """The zoo entry, or a skip saying why it cannot be built here (``transformers`` absent)."""
    real = REAL_MODELS[name]
    if real.missing is not None:
        pytest.skip(real.missing)
    return real


#: Steps before the save; one more after the load.
STEPS = 2
#: Sharded and unwrapped training sum gradients in another order (float64, real_models.DTYPE): they agree to this.
ATOL, RTOL = 1e-10, 1e-8
#: The models whose whole strategy x use_orig_params grid runs by default: T5 passes a tensor from block 0
#: to the later blocks and shares one embedding four ways; Mixtral's and Switch's experts see other tokens
#: on each rank, and Switch's (one module each) leave parameters without a gradient on some ranks or all.
GRID_MODELS = ("t5", "mixtral", "switch", "passthrough", "routed")


@dataclass(frozen=True)
class Side:
    """How one side (save or load) of a sharded run is laid out; the units are the model's blocks."""

    strategy: str
    use_orig_params: bool

    def __str__(self) -> str:
        return f"{self.strategy}.{'orig' if self.use_orig_params else 'flat'}"

    def plan(self, real: RealModel | None = None, device: torch.device | None = None) -> ShardingPlan:
        return ShardingPlan(self.strategy, self.use_orig_params, units=real.is_unit if real is not None else None, device=device)


def _load_side(save: Side) -> Side:
    """Another strategy (the next one) and the other use_orig_params."""
    return Side(STRATEGIES[(STRATEGIES.index(save.strategy) + 1) % len(STRATEGIES)], not save.use_orig_params)


def _os_cells() -> list[Any]:
    """(model, save side, load side). For GRID_MODELS (every model under the ``thorough`` profile) every
    strategy and use_orig_params saves into the next strategy with the other use_orig_params; the other
    models save FULL_SHARD with flat parameters into FULL_SHARD with original ones. Every model also
    saves and loads with original parameters only (FULL_SHARD into SHARD_GRAD_OP): the one cell an
    implementation without flat parameters (``fully_shard``) runs."""
    thorough = settings.get_current_profile_name() == "thorough"
    cells = []
    for name in REAL_MODELS:
        if thorough or name in GRID_MODELS:
            pairs = [(save, _load_side(save)) for save in (Side(s, orig) for s in STRATEGIES for orig in (False, True))]
        else:
            pairs = [(Side("FULL_SHARD", False), Side("FULL_SHARD", True))]
        pairs.append((Side("FULL_SHARD", True), Side("SHARD_GRAD_OP", True)))
        cells += [pytest.param(name, save, load, id=f"{name}-{save}-to-{load}") for save, load in pairs]
    return cells


# -- helpers -----------------------------------------------------------------------------------------------


def _skip_unless_even(world_size: int) -> None:
    if GLOBAL_BATCH % world_size:
        pytest.skip(f"the global batch of {GLOBAL_BATCH} rows does not split evenly over {world_size} ranks")


def _trainable(model: nn.Module) -> list[str]:
    return [fqn for fqn, p in model.named_parameters() if p.requires_grad]


def _flat_units(real: RealModel, side: Side) -> tuple[type[nn.Module], ...] | None:
    """The unit classes the oracle steps as flat parameters for ``side`` (None: original parameters)."""
    return None if side.use_orig_params else real.unit_classes


def _non_persistent(real: RealModel, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers by clean FQN, copied to the CPU; all of ``real.non_persistent``."""
    __tracebackhide__ = True
    wanted = set(real.non_persistent)
    found = {canonical_fqn(n): b.detach().cpu().clone() for n, b in model.named_buffers() if canonical_fqn(n) in wanted}
    if set(found) != wanted:
        fail("non-persistent buffers of the model", sorted(found), sorted(wanted), f"{real.name}: named_buffers()")
    return found


def _assert_tied_keys(real: RealModel, state: dict[str, Any], where: str) -> None:
    """Every key of a tied parameter that ``nn.Module.state_dict()`` lists is there, all of one value."""
    __tracebackhide__ = True
    for group in real.tied:
        missing = [k for k in group if k not in state]
        if missing:
            fail(f"{real.name}: keys of a tied parameter missing from the state dict", f"missing {missing}", list(group), where)
        for key in group[1:]:
            assert_same_state(state[key], state[group[0]], what=f"{real.name}: tied key {key!r} vs {group[0]!r}", where=where)


def with_initial_state(osd: dict[str, Any], oracle: nn.Module) -> dict[str, Any]:
    """``osd`` (FQN-keyed, on the CPU) with the state AdamW creates before its first update (``step`` 0,
    zero moments; SD-20) for every trainable parameter of the unwrapped ``oracle`` that has none: what a
    get materializes for a parameter that never had a gradient (a Switch expert no token reached; SD-21).
    A step treats that state exactly as no state, so a comparison that gives it to both sides compares
    what training does next."""
    template = next(iter(osd["state"].values()))
    state = dict(osd["state"])
    for fqn, param in oracle.named_parameters():
        if param.requires_grad and fqn not in state:
            state[fqn] = {k: torch.zeros_like(v) if v.dim() == 0 else torch.zeros_like(param.detach().cpu()) for k, v in template.items()}
    return {**osd, "state": state}


def _assert_matches(real: RealModel, model_sd: dict[str, Any], osd: dict[str, Any], oracle: nn.Module, oracle_optim: torch.optim.Optimizer,
        *, what: str, where: str, exact: bool, initial_state: str = "") -> None:
    """Model state dict (keys in any order) and FQN-keyed optimizer state dict vs the unwrapped
    ``oracle``'s: bitwise with ``exact``, else within ATOL/RTOL; tied keys all present.
    ``initial_state``: "expected" gives the oracle's stateless parameters their initial state
    (:func:`with_initial_state`: a get must hold it, SD-21); "both" gives it to both sides."""
    __tracebackhide__ = True
    atol, rtol = (None, 0.0) if exact else (ATOL, RTOL)
    _assert_tied_keys(real, model_sd, where)
    assert_same_state(model_sd, to_cpu(oracle.state_dict()), what=f"{what}: model state dict", where=where, atol=atol, rtol=rtol, check_order=False)
    expected = to_cpu(fqn_keyed(oracle, oracle_optim))
    if initial_state:
        expected = with_initial_state(expected, oracle)
    if initial_state == "both":
        osd = with_initial_state(osd, oracle)
    assert_optimizer_matches(osd, expected, _trainable(oracle), what=f"{what}: optimizer state dict", where=where, atol=atol, rtol=rtol)


def _unwrapped(real: RealModel, seed: int, device: Any, *, by_unit: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, bool]]:
    """The unwrapped model of ``seed``, its AdamW and the weight-decay groups (:func:`weight_decay_groups`), untrained."""
    model = real.build(seed, device)
    decay = weight_decay_groups(model, real.unit_classes, by_unit=by_unit)
    return model, adamw([((fqn,), p) for fqn, p in model.named_parameters()], decay), decay


def _oracle(real: RealModel, device: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, bool]]:
    """The unwrapped model of seed 0 and its AdamW after STEPS steps on whole batches (original parameters)."""
    model, optim, decay = _unwrapped(real, 0, device)
    for step in range(STEPS):
        train_step(real, model, optim, real.batch(step, GLOBAL_BATCH))
    return model, optim, decay


# -- OS-21: sharded training, full state dicts, a load into another layout ------------------------------------


def _shard(impl: Any, real: RealModel, seed: int, side: Side, device: torch.device) -> nn.Module:
    return impl.require("sharding").shard(real.build(seed, device), side.plan(real, device))


def _sharded_adamw(ops: Any, model: nn.Module, decay: dict[str, bool]) -> torch.optim.Optimizer:
    return adamw([(tuple(canonical_fqn(f) for f in fqns), p) for fqns, p in ops.optimizer_params(model)], decay)


def _scalars_differing_in_a_unit(real: RealModel, oracle: nn.Module, osd: dict[str, Any]) -> list[str]:
    """FQNs of parameters whose ``step`` differs from another parameter's of the same unit in ``osd``
    (saved with original parameters: an expert that had no gradient in some steps counts fewer)."""
    units = parameter_units(oracle, real.unit_classes)
    steps: dict[str, dict[float, str]] = {}
    for fqn, entry in osd["state"].items():
        if "step" in entry:
            steps.setdefault(units.get(fqn, ""), {}).setdefault(float(entry["step"]), fqn)
    return [fqn for by_step in steps.values() if len(by_step) > 1 for fqn in sorted(by_step.values())]


@pytest.mark.req("OS-21", "OS-23", "OS-24")
@pytest.mark.parametrize("name, save, load", _os_cells())
def test_real_model_trains_saves_and_reloads(dist, impl, name: str, save: Side, load: Side) -> None:
    """A real architecture sharded by the adapter (its blocks as units) trains 2 steps with AdamW like
    the unwrapped model on the whole batch: full model and optimizer state dicts equal the oracle's.
    They load into another seed's model sharded with another strategy and use_orig_params (bitwise),
    and one more step matches the unwrapped run that never stopped."""
    ops = impl.require("optim_state")
    for side in (save, load):
        reason = impl.require("sharding").unsupported(side.plan())
        if reason:
            pytest.skip(f"{impl.name} cannot shard {side}: {reason}")
    _skip_unless_even(dist.world_size)
    real, device = _real(name), dist.device
    local = lambda inputs: rank_slice(inputs, dist.rank, dist.world_size)  # noqa: E731
    with single_threaded():
        by_unit = not (save.use_orig_params and load.use_orig_params)  # a flat parameter takes a whole unit into its group
        with clause("OS-21.a"):
            oracle, oracle_optim, decay = _unwrapped(real, 0, device, by_unit=by_unit)
            model = _shard(impl, real, 0, save, device)
            optim = _sharded_adamw(ops, model, decay)
            for step in range(STEPS):
                inputs = real.batch(step, GLOBAL_BATCH)
                train_step(real, oracle, oracle_optim, inputs, flat_units=_flat_units(real, save))
                train_step(real, model, optim, local(inputs))
            where = f"rank {dist.rank}, world size {dist.world_size}, {name} saved from {save}, after {STEPS} steps"
            model_sd = to_cpu(ops.full_state_dict(model))
            osd = to_cpu(ops.optim_state_dict(model, optim))
            _assert_matches(real, model_sd, osd, oracle, oracle_optim, what="sharded training vs the unwrapped model", where=where, exact=False,
                initial_state="expected")

        with clause("OS-21.b"):
            target = _shard(impl, real, 1, load, device)
            target_optim = _sharded_adamw(ops, target, decay)
            train_step(real, target, target_optim, local(real.batch(999, GLOBAL_BATCH)))  # state of its own to overwrite
            perturb_hyperparameters(target_optim)
            before = _non_persistent(real, target)
        where = f"rank {dist.rank}, world size {dist.world_size}, {name} saved from {save}, loaded into {load}"
        mixed = [] if load.use_orig_params else _scalars_differing_in_a_unit(real, oracle, osd)
        if mixed:
            # OS-24: one flat parameter cannot hold its parameters' different steps: a clear error, nothing changed.
            with clause("OS-24"):
                untouched = snapshot(optim=target_optim)
                expect_error(lambda: ops.load_optim_state_dict(target, target_optim, copy.deepcopy(osd)), ValueError, keys=[mixed[0]],
                             what="loading different steps of one unit into a flat parameter", where=where)
                assert_unchanged(untouched, optim=target_optim, where=where)
            return
        with clause("OS-21.b"):
            ops.load_full_state_dict(target, {k: v.to(device) for k, v in copy.deepcopy(model_sd).items()})
            ops.load_optim_state_dict(target, target_optim, copy.deepcopy(osd))
            got_model, got_osd = to_cpu(ops.full_state_dict(target)), to_cpu(ops.optim_state_dict(target, target_optim))
            _assert_tied_keys(real, got_model, where)
            assert_same_state(got_model, model_sd, what="full model state dict right after the load vs the saved one", where=where, check_order=False)
            assert_optimizer_matches(got_osd, osd, _trainable(oracle), what="optimizer state dict right after the load vs the saved one", where=where)
            assert_same_state(_non_persistent(real, target), before, what="non-persistent buffers changed by a load", where=where)

        with clause("OS-21.c"):
            inputs = real.batch(STEPS, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs, flat_units=_flat_units(real, load))
            train_step(real, target, target_optim, local(inputs))
            _assert_matches(real, to_cpu(ops.full_state_dict(target)), to_cpu(ops.optim_state_dict(target, target_optim)), oracle, oracle_optim,
                what="one step after the load vs the unwrapped run that never stopped", where=where, exact=False, initial_state="expected")


# -- SD-22: get_state_dict / set_state_dict of the unwrapped model, one process -------------------------------


@pytest.mark.req("SD-22")
@pytest.mark.parametrize("form", ["nested", "flat"])
@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_model_state_dict_round_trip(impl, name: str, form: str) -> None:
    """get_state_dict of a real model trained 2 steps equals its own state dicts; set into another
    seed's model whose optimizer took a step and has perturbed hyperparameters, get gives back the saved
    dicts bitwise, and one more step equals the run that never stopped bitwise (one process)."""
    ops = impl.require("state_dict")
    real = _real(name)
    options = ops.options(flatten_optimizer_state_dict=form == "flat")
    with single_threaded():
        with clause("SD-22.a"):
            oracle, oracle_optim, decay = _oracle(real, "cpu")
            source, source_optim, _ = _oracle(real, "cpu")
            where = f"{name}, {form} optimizer state dict"
            model_sd, optim_sd = ops.get_state_dict(source, source_optim, options=options)
            _assert_tied_keys(real, model_sd, where)
            assert_same_state(model_sd, oracle.state_dict(), what="get_state_dict: model vs nn.Module.state_dict()", where=where)
            if form == "nested":  # a parameter no step has reached yet: its initial state (SD-21)
                assert_optimizer_matches(optim_sd, with_initial_state(fqn_keyed(oracle, oracle_optim), oracle), _trainable(oracle),
                    what="get_state_dict: optimizer vs Optimizer.state_dict() by FQN", where=where)
        with clause("SD-22.b"):
            saved = copy.deepcopy((model_sd, optim_sd))  # as through a file

            target, target_optim, _ = _unwrapped(real, 1, "cpu")
            train_step(real, target, target_optim, real.batch(999, GLOBAL_BATCH))
            perturb_hyperparameters(target_optim)
            before = _non_persistent(real, target)
            model_in, optim_in = copy.deepcopy(saved)
            ops.set_state_dict(target, target_optim, model_state_dict=model_in, optim_state_dict=optim_in, options=options)
            again_model, again_optim = ops.get_state_dict(target, target_optim, options=options)
            _assert_tied_keys(real, again_model, f"{where}, after set_state_dict")
            assert_same_state(again_model, saved[0], what="get after set: model vs the saved one", where=where)
            if form == "nested":
                assert_optimizer_matches(again_optim, saved[1], _trainable(oracle), what="get after set: optimizer vs the saved one", where=where)
            else:
                assert_same_state(again_optim, saved[1], what="get after set: flattened optimizer vs the saved one", where=where, check_order=False)
            assert_same_state(_non_persistent(real, target), before, what="non-persistent buffers changed by set_state_dict", where=where)

        with clause("SD-22.c"):
            inputs = real.batch(STEPS, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs)
            train_step(real, target, target_optim, inputs)
            _assert_matches(real, target.state_dict(), fqn_keyed(target, target_optim), oracle, oracle_optim,
                what="one step after set_state_dict vs the run that never stopped", where=where, exact=True, initial_state="both")


# -- ML-21: a checkpoint of the sharded model and optimizer --------------------------------------------------


@pytest.mark.req("ML-21")
@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_model_checkpoint_round_trip(dist, impl, name: str) -> None:
    """A real architecture sharded by the adapter (original parameters, its blocks as units) trains 2
    steps; its sharded model and optimizer state dicts, saved to a checkpoint, hold the unwrapped
    model's values; loaded into another seed's sharded model (optimizer stepped, hyperparameters
    perturbed) they come back bitwise, and one more step matches the run that never stopped."""
    ops = impl.require("checkpoint")
    _skip_unless_even(dist.world_size)
    real, device, side = _real(name), dist.device, Side("FULL_SHARD", True)
    local = lambda inputs: rank_slice(inputs, dist.rank, dist.world_size)  # noqa: E731
    path = dist.tmp_dir / "ckpt"
    with single_threaded():
        with clause("ML-21.a"):
            oracle, oracle_optim, decay = _oracle(real, device)
            model = _shard(impl, real, 0, side, device)
            optim = adamw([((canonical_fqn(n),), p) for n, p in model.named_parameters()], decay)
            for step in range(STEPS):
                train_step(real, model, optim, local(real.batch(step, GLOBAL_BATCH)))
            model_sd, optim_sd = ops.get_state_dicts(model, optim)
            saved = to_cpu(model_sd), to_cpu(optim_sd)
            where = f"rank {dist.rank}, world size {dist.world_size}, {name}, saving side after {STEPS} steps"
            _assert_matches(real, *saved, oracle, oracle_optim, what="sharded state dicts vs the unwrapped model", where=where, exact=False,
                initial_state="both")
        with clause("ML-21.b"):
            ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=dist.group)

        with clause("ML-21.b"):
            target = _shard(impl, real, 1, side, device)
            target_optim = adamw([((canonical_fqn(n),), p) for n, p in target.named_parameters()], decay)
            train_step(real, target, target_optim, local(real.batch(999, GLOBAL_BATCH)))
            perturb_hyperparameters(target_optim)
            before = _non_persistent(real, target)
            target_sd, target_osd = ops.get_state_dicts(target, target_optim)
            state = {"model": target_sd, "optim": target_osd}
            ops.load(state, path, process_group=dist.group)
            ops.set_state_dicts(target, target_optim, state["model"], state["optim"])
            where = f"rank {dist.rank}, world size {dist.world_size}, {name}, loading side"
            got_model, got_optim = (to_cpu(sd) for sd in ops.get_state_dicts(target, target_optim))
            _assert_tied_keys(real, got_model, where)
            assert_same_state(got_model, saved[0], what="model state right after the load vs the saved one", where=where, check_order=False)
            assert_optimizer_matches(got_optim, saved[1], _trainable(oracle), what="optimizer state right after the load vs the saved one", where=where)
            assert_same_state(_non_persistent(real, target), before, what="non-persistent buffers changed by a load", where=where)

        with clause("ML-21.c"):
            inputs = real.batch(STEPS, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs)
            train_step(real, target, target_optim, local(inputs))
            got_model, got_optim = (to_cpu(sd) for sd in ops.get_state_dicts(target, target_optim))
            _assert_matches(real, got_model, got_optim, oracle, oracle_optim, what="one step after the load vs the unwrapped run that never stopped",
                where=where, exact=False, initial_state="both")


# -- OS-22: every unit is sharded between iterations -----------------------------------------------------------

#: The plain-torch patterns (no transformers needed) whose units receive, return or reuse what other units made.
PATTERNS = ("passthrough", "shared", "reused", "routed")


def _local_numel(model: nn.Module) -> int:
    """Elements this rank holds of the parameters ``model`` exposes (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


@pytest.mark.req("OS-22")
@pytest.mark.parametrize("use_orig_params", (False, True), ids=("flat", "orig"))
@pytest.mark.parametrize("strategy", ("FULL_SHARD", "SHARD_GRAD_OP"))
@pytest.mark.parametrize("name", PATTERNS)
def test_units_are_sharded_between_iterations(dist, impl, name: str, strategy: str, use_orig_params: bool) -> None:
    """After each training step of a model whose units pass tensors made by other units (T5's position
    bias, unchanged or as a view), share a module, or run several times, the parameters the sharded
    model exposes hold only this rank's shards: no more elements than right after sharding (a unit left
    unsharded by a late pre-backward hook holds all of its elements, and with flat parameters its
    gradient then has the shard's size), and the run matches the unwrapped model."""
    ops = impl.require("optim_state")
    side = Side(strategy, use_orig_params)
    reason = impl.require("sharding").unsupported(side.plan())
    if reason:
        pytest.skip(f"{impl.name} cannot shard {side}: {reason}")
    if dist.world_size < 2:
        pytest.skip("nothing is sharded at world size 1")
    _skip_unless_even(dist.world_size)
    real, device = _real(name), dist.device
    with single_threaded():
        oracle, oracle_optim, decay = _unwrapped(real, 0, device, by_unit=not use_orig_params)
        model = _shard(impl, real, 0, side, device)
        bound = _local_numel(model)  # every unit sharded, as construction leaves it
        optim = _sharded_adamw(ops, model, decay)
        for step in range(STEPS):
            inputs = real.batch(step, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs, flat_units=_flat_units(real, side))
            train_step(real, model, optim, rank_slice(inputs, dist.rank, dist.world_size))
            held = _local_numel(model)
            with clause("OS-22.b"):
                if held > bound:
                    fail(f"{name}: elements of parameters this rank holds after step {step}", held,
                         f"at most {bound}, what it held right after sharding", f"rank {dist.rank}, {side}")
        with clause("OS-22.a"):
            _assert_matches(real, to_cpu(ops.full_state_dict(model)), to_cpu(ops.optim_state_dict(model, optim)), oracle, oracle_optim,
                what="sharded training vs the unwrapped model", where=f"rank {dist.rank}, {name}, {side}", exact=False, initial_state="expected")
