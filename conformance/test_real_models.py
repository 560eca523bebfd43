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
things); the other models run one cell, unless the hypothesis profile is ``thorough``. OS-21 and ML-21
run at the largest selected world size only (``largest_world_size``; every size under ``thorough``):
the generated and zoo tests cover one rank with small models, and the world-size-1 runs of the real
models kill no mutant of their section that the largest size misses (docs/power.md).
"""

from __future__ import annotations

import copy

import pytest

from conformance.asserts import assert_same_state, assert_unchanged, clause, expect_error, fail, snapshot
from conformance.compare import nested_optimizer_state
from conformance.fqn import canonical_fqn
from conformance.generated import assert_optimizer_matches, fqn_keyed, single_threaded, to_cpu
from conformance.real_models import (
    GLOBAL_BATCH,
    REAL_MODELS,
    adamw,
    rank_slice,
    train_step,
)
from conformance.real_models_support import (
    STEPS,
    Side,
    assert_matches,
    assert_tied_keys,
    flat_units,
    local_numel,
    non_persistent_buffers,
    oracle_run,
    os_cells,
    real_model_or_skip,
    scalars_differing_in_a_unit,
    shard_real,
    sharded_adamw,
    skip_unless_even,
    trainable_fqns,
    unwrapped_run,
    with_initial_state,
)
from conformance.values import perturb_hyperparameters

# -- helpers -----------------------------------------------------------------------------------------------


# -- OS-21: sharded training, full state dicts, a load into another layout ------------------------------------


@pytest.mark.req("OS-21", "OS-23", "OS-24")
@pytest.mark.largest_world_size
@pytest.mark.parametrize("name, save, load", os_cells())
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
    skip_unless_even(dist.world_size)
    real, device = real_model_or_skip(name), dist.device
    local = lambda inputs: rank_slice(inputs, dist.rank, dist.world_size)  # noqa: E731
    with single_threaded():
        by_unit = not (save.use_orig_params and load.use_orig_params)  # a flat parameter takes a whole unit into its group
        with clause("OS-21.a"):
            oracle, oracle_optim, decay = unwrapped_run(real, 0, device, by_unit=by_unit)
            model = shard_real(impl, real, 0, save, device)
            optim = sharded_adamw(ops, model, decay)
            for step in range(STEPS):
                inputs = real.batch(step, GLOBAL_BATCH)
                train_step(real, oracle, oracle_optim, inputs, flat_units=flat_units(real, save))
                train_step(real, model, optim, local(inputs))
            where = f"rank {dist.rank}, world size {dist.world_size}, {name} saved from {save}, after {STEPS} steps"
            model_sd = to_cpu(ops.full_state_dict(model))
            osd = to_cpu(ops.optim_state_dict(model, optim))
            assert_matches(real, model_sd, osd, oracle, oracle_optim, what="sharded training vs the unwrapped model", where=where, exact=False,
                initial_state="expected")

        with clause("OS-21.b"):
            target = shard_real(impl, real, 1, load, device)
            target_optim = sharded_adamw(ops, target, decay)
            train_step(real, target, target_optim, local(real.batch(999, GLOBAL_BATCH)))  # state of its own to overwrite
            perturb_hyperparameters(target_optim)
            before = non_persistent_buffers(real, target)
        where = f"rank {dist.rank}, world size {dist.world_size}, {name} saved from {save}, loaded into {load}"
        mixed = [] if load.use_orig_params else scalars_differing_in_a_unit(real, oracle, osd)
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
            assert_tied_keys(real, got_model, where)
            assert_same_state(got_model, model_sd, what="full model state dict right after the load vs the saved one", where=where, check_order=False)
            assert_optimizer_matches(got_osd, osd, trainable_fqns(oracle), what="optimizer state dict right after the load vs the saved one", where=where)
            assert_same_state(non_persistent_buffers(real, target), before, what="non-persistent buffers changed by a load", where=where)

        with clause("OS-21.c"):
            inputs = real.batch(STEPS, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs, flat_units=flat_units(real, load))
            train_step(real, target, target_optim, local(inputs))
            assert_matches(real, to_cpu(ops.full_state_dict(target)), to_cpu(ops.optim_state_dict(target, target_optim)), oracle, oracle_optim,
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
    real = real_model_or_skip(name)
    options = ops.options(flatten_optimizer_state_dict=form == "flat")
    with single_threaded():
        with clause("SD-22.a"):
            oracle, oracle_optim, decay = oracle_run(real, "cpu")
            source, source_optim, _ = oracle_run(real, "cpu")
            where = f"{name}, {form} optimizer state dict"
            model_sd, optim_sd = ops.get_state_dict(source, source_optim, options=options)
            assert_tied_keys(real, model_sd, where)
            assert_same_state(model_sd, oracle.state_dict(), what="get_state_dict: model vs nn.Module.state_dict()", where=where)
            if form == "nested":  # a parameter no step has reached yet: its initial state (SD-21)
                assert_optimizer_matches(optim_sd, with_initial_state(fqn_keyed(oracle, oracle_optim), oracle), trainable_fqns(oracle),
                    what="get_state_dict: optimizer vs Optimizer.state_dict() by FQN", where=where)
        with clause("SD-22.b"):
            saved = copy.deepcopy((model_sd, optim_sd))  # as through a file

            target, target_optim, _ = unwrapped_run(real, 1, "cpu")
            train_step(real, target, target_optim, real.batch(999, GLOBAL_BATCH))
            perturb_hyperparameters(target_optim)
            before = non_persistent_buffers(real, target)
            model_in, optim_in = copy.deepcopy(saved)
            ops.set_state_dict(target, target_optim, model_state_dict=model_in, optim_state_dict=optim_in, options=options)
            again_model, again_optim = ops.get_state_dict(target, target_optim, options=options)
            assert_tied_keys(real, again_model, f"{where}, after set_state_dict")
            assert_same_state(again_model, saved[0], what="get after set: model vs the saved one", where=where)
            if form == "nested":
                assert_optimizer_matches(again_optim, saved[1], trainable_fqns(oracle), what="get after set: optimizer vs the saved one", where=where)
            else:
                assert_same_state(again_optim, saved[1], what="get after set: flattened optimizer vs the saved one", where=where, check_order=False)
            assert_same_state(non_persistent_buffers(real, target), before, what="non-persistent buffers changed by set_state_dict", where=where)

        with clause("SD-22.c"):
            inputs = real.batch(STEPS, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs)
            train_step(real, target, target_optim, inputs)
            assert_matches(real, target.state_dict(), fqn_keyed(target, target_optim), oracle, oracle_optim,
                what="one step after set_state_dict vs the run that never stopped", where=where, exact=True, initial_state="both")


# -- ML-21: a checkpoint of the sharded model and optimizer --------------------------------------------------


@pytest.mark.req("ML-21")
@pytest.mark.largest_world_size
@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_model_checkpoint_round_trip(dist, impl, name: str) -> None:
    """A real architecture sharded by the adapter (original parameters, its blocks as units) trains 2
    steps; its sharded model and optimizer state dicts, saved to a checkpoint, hold the unwrapped
    model's values; loaded into another seed's sharded model (optimizer stepped, hyperparameters
    perturbed) they come back bitwise, and one more step matches the run that never stopped."""
    ops = impl.require("checkpoint")
    skip_unless_even(dist.world_size)
    real, device, side = real_model_or_skip(name), dist.device, Side("FULL_SHARD", True)
    local = lambda inputs: rank_slice(inputs, dist.rank, dist.world_size)  # noqa: E731
    path = dist.tmp_dir / "ckpt"
    with single_threaded():
        with clause("ML-21.a"):
            oracle, oracle_optim, decay = oracle_run(real, device)
            model = shard_real(impl, real, 0, side, device)
            optim = adamw([((canonical_fqn(n),), p) for n, p in model.named_parameters()], decay)
            for step in range(STEPS):
                train_step(real, model, optim, local(real.batch(step, GLOBAL_BATCH)))
            model_sd, optim_sd = ops.get_state_dicts(model, optim)
            saved = to_cpu(model_sd), nested_optimizer_state(to_cpu(optim_sd))
            where = f"rank {dist.rank}, world size {dist.world_size}, {name}, saving side after {STEPS} steps"
            assert_matches(real, *saved, oracle, oracle_optim, what="sharded state dicts vs the unwrapped model", where=where, exact=False,
                initial_state="both")
        with clause("ML-21.b"):
            ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=dist.group)

        with clause("ML-21.b"):
            target = shard_real(impl, real, 1, side, device)
            target_optim = adamw([((canonical_fqn(n),), p) for n, p in target.named_parameters()], decay)
            train_step(real, target, target_optim, local(real.batch(999, GLOBAL_BATCH)))
            perturb_hyperparameters(target_optim)
            before = non_persistent_buffers(real, target)
            target_sd, target_osd = ops.get_state_dicts(target, target_optim)
            state = {"model": target_sd, "optim": target_osd}
            ops.load(state, path, process_group=dist.group)
            ops.set_state_dicts(target, target_optim, state["model"], state["optim"])
            where = f"rank {dist.rank}, world size {dist.world_size}, {name}, loading side"
            got_model, got_optim = (to_cpu(sd) for sd in ops.get_state_dicts(target, target_optim))
            got_optim = nested_optimizer_state(got_optim)
            assert_tied_keys(real, got_model, where)
            assert_same_state(got_model, saved[0], what="model state right after the load vs the saved one", where=where, check_order=False)
            assert_optimizer_matches(got_optim, saved[1], trainable_fqns(oracle), what="optimizer state right after the load vs the saved one", where=where)
            assert_same_state(non_persistent_buffers(real, target), before, what="non-persistent buffers changed by a load", where=where)

        with clause("ML-21.c"):
            inputs = real.batch(STEPS, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs)
            train_step(real, target, target_optim, local(inputs))
            got_model, got_optim = (to_cpu(sd) for sd in ops.get_state_dicts(target, target_optim))
            assert_matches(real, got_model, nested_optimizer_state(got_optim), oracle, oracle_optim,
                           what="one step after the load vs the unwrapped run that never stopped",
                where=where, exact=False, initial_state="both")


# -- OS-22: every unit is sharded between iterations -----------------------------------------------------------

#: The plain-torch patterns (no transformers needed) whose units receive, return or reuse what other units made.
PATTERNS = ("passthrough", "shared", "reused", "routed")


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
    skip_unless_even(dist.world_size)
    real, device = real_model_or_skip(name), dist.device
    with single_threaded():
        oracle, oracle_optim, decay = unwrapped_run(real, 0, device, by_unit=not use_orig_params)
        model = shard_real(impl, real, 0, side, device)
        bound = local_numel(model)  # every unit sharded, as construction leaves it
        optim = sharded_adamw(ops, model, decay)
        for step in range(STEPS):
            inputs = real.batch(step, GLOBAL_BATCH)
            train_step(real, oracle, oracle_optim, inputs, flat_units=flat_units(real, side))
            train_step(real, model, optim, rank_slice(inputs, dist.rank, dist.world_size))
            held = local_numel(model)
            with clause("OS-22.b"):
                if held > bound:
                    fail(f"{name}: elements of parameters this rank holds after step {step}", held,
                         f"at most {bound}, what it held right after sharding", f"rank {dist.rank}, {side}")
        with clause("OS-22.a"):
            assert_matches(real, to_cpu(ops.full_state_dict(model)), to_cpu(ops.optim_state_dict(model, optim)), oracle, oracle_optim,
                what="sharded training vs the unwrapped model", where=f"rank {dist.rank}, {name}, {side}", exact=False, initial_state="expected")
