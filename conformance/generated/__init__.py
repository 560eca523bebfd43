"""Generated cases: hypothesis draws model trees and their training state; the oracle is the unwrapped model.

A *case* is a frozen description of everything one example does: the model tree (:class:`ModelSpec`:
depth 1-3, module names that are digits and prefixes of one another, ``Linear`` leaves of small awkward
sizes, tied and frozen parameters, persistent and non-persistent buffers of every dtype of
:data:`conformance.values.EDGE_DTYPES`), the optimizer (SGD with momentum, Adam or AdamW) with its
param groups and parameter order for the source and for the load target, and, for sharded runs, the
world size, sharding strategy, ``use_orig_params`` and sharding units on each side. Its ``repr`` reads
as the model (hypothesis prints it for a shrunk failure).

The oracle of every case is the same: the unwrapped model trained on one process, the "run that never
stopped". The implementation under test trains identically, saves, loads into a target built from
another seed, with perturbed hyperparameters (:func:`conformance.values.perturb_hyperparameters`) and
its parameters in another order, continues, and is compared with the oracle: bit for bit where nothing
was computed (a load, a single-process step), within a float tolerance where ranks average gradients.

Rank bodies (:func:`optim_state_save`, :func:`checkpoint_load`, ...) are module-level functions run by
``pools.run``: hypothesis runs on the controller, one example per call, so shrinking happens there and
every rank body is deterministic in its case.

Known deviations of an adapter (some pinned by the section files' xfails, the others found by these
tests and pinned by ``test_generated_deviation_witness``) are left out of that adapter's generated
domain by its expected-failures file, the one registry of known deviations: an entry ``exclude=NAME``
names a family of cases (:data:`CASE_FAMILIES`), is inherited by adapters derived from it and can be
``!``-cancelled there, so a generated test still checks everything else of each adapter.

The modules, one job each (imports go down this list, never up):

- :mod:`~conformance.generated.profiles`: the hypothesis profiles and each test's example budget.
- :mod:`~conformance.generated.specs`: the description of a case (model tree, optimizer plans, shardings).
- :mod:`~conformance.generated.layout`: which parameters share a unit, a wrapper, a param group.
- :mod:`~conformance.generated.families`: the case families an ``exclude=`` entry names.
- :mod:`~conformance.generated.strategies`: the hypothesis strategies, one per generated test.
- :mod:`~conformance.generated.builders`: models, optimizers and batches made from a spec.
- :mod:`~conformance.generated.execution`: one intra-op thread, a rank's rows, a refused layout.
- :mod:`~conformance.generated.oracles`: the oracle run and the one comparison of a run's state with it.
- ``bodies_<capability>``: the bodies of each generated test (:mod:`~conformance.generated.bodies_state_dict`,
  :mod:`~conformance.generated.bodies_sharded_state_dict`, :mod:`~conformance.generated.bodies_flat_param`,
  :mod:`~conformance.generated.bodies_optim_state`, :mod:`~conformance.generated.bodies_checkpoint`).

This package re-exports what the suite's tests, its conftest and tools use; anything else is imported
from its module.
"""

from __future__ import annotations

from conformance.generated.bodies_checkpoint import checkpoint_load, checkpoint_save
from conformance.generated.bodies_flat_param import flat_param_round_trip
from conformance.generated.bodies_optim_state import optim_state_both, optim_state_load, optim_state_save
from conformance.generated.bodies_sharded_state_dict import sharded_state_dict_round_trip
from conformance.generated.bodies_state_dict import state_dict_round_trip
from conformance.generated.builders import batch, build
from conformance.generated.execution import Refused, single_threaded
from conformance.generated.families import (
    CASE_FAMILIES,
    CHECKPOINT_TEST,
    FLAT_PARAM_TEST,
    OPTIM_STATE_TEST,
    SHARDED_STATE_DICT_TEST,
    STATE_DICT_TEST,
    CaseFamily,
    excluded_families,
    families_of,
)
from conformance.generated.oracles import assert_optimizer_matches, fqn_keyed, to_cpu
from conformance.generated.profiles import budget, register_profiles
from conformance.generated.specs import GLOBAL_BATCH, STRATEGIES, Buffer, Case, Linear, ModelSpec, Module, OptimPlan, Sharding, Tie
from conformance.generated.strategies import (
    checkpoint_cases,
    flat_param_cases,
    model_specs,
    optim_state_cases,
    round_trip_cases,
    sharded_state_dict_cases,
    usable_world_sizes,
)

__all__ = [
    "register_profiles",
    "budget",
    "GLOBAL_BATCH",
    "STRATEGIES",
    "Buffer",
    "Linear",
    "Tie",
    "Module",
    "ModelSpec",
    "OptimPlan",
    "Sharding",
    "Case",
    "STATE_DICT_TEST",
    "SHARDED_STATE_DICT_TEST",
    "FLAT_PARAM_TEST",
    "OPTIM_STATE_TEST",
    "CHECKPOINT_TEST",
    "CaseFamily",
    "CASE_FAMILIES",
    "families_of",
    "excluded_families",
    "Refused",
    "single_threaded",
    "build",
    "batch",
    "model_specs",
    "round_trip_cases",
    "optim_state_cases",
    "flat_param_cases",
    "checkpoint_cases",
    "sharded_state_dict_cases",
    "usable_world_sizes",
    "fqn_keyed",
    "to_cpu",
    "assert_optimizer_matches",
    "state_dict_round_trip",
    "flat_param_round_trip",
    "optim_state_save",
    "optim_state_load",
    "optim_state_both",
    "checkpoint_save",
    "checkpoint_load",
    "sharded_state_dict_round_trip",
]
