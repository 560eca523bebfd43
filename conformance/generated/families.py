"""Families of generated cases that an adapter's known deviations leave out of its generated domain.

An expected-failures entry ``<generated test id>  exclude=NAME  # why`` names a family of
:data:`CASE_FAMILIES`; it is inherited by adapters derived from the one whose file holds it and can be
``!``-cancelled there (:mod:`conformance.harness.xfails`). The strategies of
:mod:`conformance.generated.strategies` then do not draw the family's cases (:func:`without`, or a
switch of the strategy), so a generated test still checks everything else of each adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from conformance.generated.layout import is_below, max_names, owner_unit
from conformance.generated.specs import Case, ModelSpec, Sharding
from conformance.rank_context import hybrid_mesh_shape

__all__ = [
    "STATE_DICT_TEST",
    "SHARDED_STATE_DICT_TEST",
    "FLAT_PARAM_TEST",
    "OPTIM_STATE_TEST",
    "CHECKPOINT_TEST",
    "CaseFamily",
    "CASE_FAMILIES",
    "families_of",
    "excluded_families",
    "family_names",
    "without",
]

#: The generated tests, by function name (the keys of :attr:`CaseFamily.applies`).
STATE_DICT_TEST = "test_generated_state_dict_round_trip"
SHARDED_STATE_DICT_TEST = "test_generated_sharded_state_dict_round_trip"
FLAT_PARAM_TEST = "test_generated_flat_param_round_trip"
OPTIM_STATE_TEST = "test_generated_optim_state_reload"
CHECKPOINT_TEST = "test_generated_checkpoint_reshard"


@dataclass(frozen=True)
class CaseFamily:
    """A family of generated cases that an implementation's known deviation spoils: an expected-failures
    entry ``<generated test id>  exclude=NAME  # why`` leaves it out of that adapter's drawn domain (and
    of adapters derived from it, like every entry), so the generated test still checks every other case.

    ``applies`` maps each generated test that draws the family (by function name) to the predicate that
    picks the family's cases among that test's cases, or to None where the test's strategy simply draws
    none of them when the family is excluded (a switch of the strategy, e.g. targets whose param groups
    are never split)."""

    name: str
    description: str
    applies: Mapping[str, Callable[[Case], bool] | None] = field(compare=False)


def _either(case: Case, test: Callable[[Sharding], bool]) -> bool:
    return any(s is not None and test(s) for s in (case.save, case.load))


def _groups_reordered(case: Case) -> bool:
    index = case.target.hyper_index
    return bool(index) and list(index) != sorted(index)


def _frozen_above_unit(spec: ModelSpec, sharding: Sharding) -> bool:
    """A frozen parameter is owned by a unit (the root included) that has a nested unit below it."""
    owners = {owner_unit(e.owner, sharding.units) for e in spec.params() if e.frozen}
    return any(any(is_below(u, owner) for u in sharding.units) for owner in owners)


def _fsdp2_mesh(sharding: Sharding | None) -> tuple[int, ...]:
    """The mesh shape the torch-fsdp2 adapter shards on (conformance/adapters/optim_state.py)."""
    assert sharding is not None
    ws = sharding.world_size
    return {"HYBRID_SHARD": hybrid_mesh_shape(ws, _ranks_per_node()), "NO_SHARD": (ws, 1)}.get(sharding.strategy, (ws,))


def _ranks_per_node() -> int | None:
    """The launched job's ranks per node, which shapes HYBRID_SHARD's mesh when the world fills whole
    nodes. Families are decided while collecting, outside any test body, so the rank context has no
    layout yet: under torchrun it is the job's (joined before collection); None for the pools."""
    from conformance.harness.torchrun.job import current_job

    job = current_job()
    return job.layout[1] if job is not None and job.layout else None


_FAMILIES: tuple[CaseFamily, ...] = (
    CaseFamily(
        "split-groups",
        "load targets whose optimizer splits a saved param group into several (targets are drawn with the saved groups reordered, never split)",
        {STATE_DICT_TEST: None},
    ),
    CaseFamily(
        "reordered-groups",
        "load targets whose optimizer lists the saved param groups in another order (targets keep the saved group order)",
        {SHARDED_STATE_DICT_TEST: None, OPTIM_STATE_TEST: lambda c: _groups_reordered(c)},
    ),
    CaseFamily(
        "compiled-three-names",
        "a torch.compile'd model with a parameter registered under three names or more",
        {STATE_DICT_TEST: lambda c: c.option("wrapper") == "compile" and max_names(c.model) >= 3},
    ),
    CaseFamily(
        "three-names",
        "a parameter registered under three names or more (for sharded state dicts: set as full state dicts)",
        {
            OPTIM_STATE_TEST: lambda c: max_names(c.model) >= 3,
            SHARDED_STATE_DICT_TEST: lambda c: max_names(c.model) >= 3 and c.option("state dicts", "").startswith("full"),
        },
    ),
    CaseFamily(
        "hybrid-shard-replicas",
        "HYBRID_SHARD at a world size above 1 (more than one replica) on the saving or the loading side",
        {OPTIM_STATE_TEST: lambda c: _either(c, lambda s: s.strategy == "HYBRID_SHARD" and s.world_size > 1)},
    ),
    CaseFamily(
        "flat-to-orig",
        "saved with use_orig_params=False (flat parameters), loaded with use_orig_params=True",
        {OPTIM_STATE_TEST: lambda c: c.save is not None and c.load is not None and not c.save.use_orig_params and c.load.use_orig_params},
    ),
    CaseFamily(
        "no-shard-frozen-above-unit",
        "NO_SHARD (or any strategy at world size 1) with use_orig_params=True, where a frozen parameter belongs to a unit that has nested units",
        {
            OPTIM_STATE_TEST: lambda c: _either(
                c, lambda s: (s.strategy == "NO_SHARD" or s.world_size == 1) and s.use_orig_params and _frozen_above_unit(c.model, s)
            )
        },
    ),
    CaseFamily(
        "sharded-osd-other-mesh",
        "a sharded optimizer state dict loaded into a model on another device mesh (the mesh the torch-fsdp2 adapter builds for each "
        "strategy: NO_SHARD (ws, 1), HYBRID_SHARD (replicate, shard), FULL_SHARD (ws,))",
        {OPTIM_STATE_TEST: lambda c: c.option("optimizer state dict") != "full" and _fsdp2_mesh(c.save) != _fsdp2_mesh(c.load)},
    ),
    CaseFamily(
        "nested-wrappers",
        "FlattenParamsWrappers below the root (only the root module is wrapped)",
        {FLAT_PARAM_TEST: None},
    ),
    CaseFamily(
        "tied-parameters",
        "models with a parameter registered under two names or more",
        {FLAT_PARAM_TEST: lambda c: max_names(c.model) >= 2},
    ),
)
#: Every family of generated cases an ``exclude=`` entry may name, by name.
CASE_FAMILIES: dict[str, CaseFamily] = {family.name: family for family in _FAMILIES}


def families_of(test: str) -> tuple[str, ...]:
    """The names of the families the generated test ``test`` draws (its ``case_families`` marker)."""
    return tuple(name for name, family in CASE_FAMILIES.items() if test in family.applies)


def excluded_families(names: Sequence[str], test: str) -> tuple[CaseFamily, ...]:
    """The families ``names`` (the ``exclude=`` entries that apply to this run of ``test``), checked:
    each is a family that ``test`` draws (the plugin checked the names against the test's marker)."""
    unknown = [n for n in names if n not in CASE_FAMILIES or test not in CASE_FAMILIES[n].applies]
    if unknown:
        raise ValueError(f"{test} draws no case families {unknown}; it draws {list(families_of(test))}")
    return tuple(CASE_FAMILIES[n] for n in names)


def family_names(excluded: Sequence[CaseFamily]) -> set[str]:
    """The names of the families ``excluded`` (a strategy switch asks whether its family is among them)."""
    return {family.name for family in excluded}


def without(cases: st.SearchStrategy[Case], test: str, excluded: Sequence[CaseFamily]) -> st.SearchStrategy[Case]:
    """``cases`` without those of the ``excluded`` families that ``test`` picks by predicate (a family
    handled by a switch of the strategy is not drawn at all)."""
    predicates = [p for family in excluded if (p := family.applies.get(test)) is not None]
    if not predicates:
        return cases
    return cases.filter(lambda c: not any(p(c) for p in predicates))
