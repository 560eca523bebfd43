"""Hypothesis strategies of generated cases, one public strategy per generated test.

Each strategy draws a :class:`~conformance.generated.specs.Case` and takes the case families an
adapter's expected-failures file excludes (:mod:`conformance.generated.families`). The order of the
draws is part of the contract: under the derandomized ``ci`` profile the same strategies drawn in the
same order give the same examples on every run, so a change of order changes what ``make test`` checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from conformance.generated.families import (
    CHECKPOINT_TEST,
    FLAT_PARAM_TEST,
    OPTIM_STATE_TEST,
    SHARDED_STATE_DICT_TEST,
    STATE_DICT_TEST,
    CaseFamily,
    family_names,
    without,
)
from conformance.generated.layout import (
    fix_units,
    flat_atoms,
    fp_atoms,
    join_atoms,
    param_atoms,
    sd_units,
    unit_candidates,
    units_homogeneous,
    wrapper_lists,
)
from conformance.generated.specs import (
    GLOBAL_BATCH,
    NAMES,
    OPTIMIZERS,
    PARAM_DTYPES,
    Buffer,
    Case,
    Linear,
    ModelSpec,
    Module,
    Node,
    OptimPlan,
    Sharding,
    Tie,
    join_path,
)
from conformance.values import EDGE_DTYPES

__all__ = [
    "MAX_LEAVES",
    "SD_STRATEGIES",
    "model_specs",
    "usable_world_sizes",
    "round_trip_cases",
    "flat_param_cases",
    "optim_state_cases",
    "checkpoint_cases",
    "sharded_state_dict_cases",
]

MAX_LEAVES = 6
#: The strategies the SD tests ask :meth:`StateDictOps.shard` for.
SD_STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def usable_world_sizes(world_sizes: Sequence[int]) -> list[int]:
    """The world sizes of ``world_sizes`` that split a global batch of :data:`GLOBAL_BATCH` rows evenly."""
    return [ws for ws in world_sizes if GLOBAL_BATCH % ws == 0]


def _pick(low: int, high: int) -> st.SearchStrategy[int]:
    """An integer in ``[low, high]``, uniformly (``st.integers`` favours its bounds: most models would
    get one leaf, one group, every leaf frozen), shrinking towards ``low``."""
    return st.sampled_from(range(low, high + 1))


# -- models ---------------------------------------------------------------------------------------------------


@st.composite
def model_specs(draw: Any, *, frozen_ties: bool = True) -> ModelSpec:
    """A model tree of depth 1-3 with 1-6 Linear leaves, ties, frozen leaves and buffers.
    ``frozen_ties=False``: a tied weight is never frozen (flat-parameter sharding needs frozen leaves
    in units of their own)."""
    dtype = draw(st.sampled_from(PARAM_DTYPES), label="parameter dtype")
    max_depth = draw(_pick(1, 3), label="depth")
    leaves = [0]

    def module(name: str, depth: int) -> Module:
        n_children = draw(_pick(1 if depth == 0 else 0, 3))
        n_buffers = draw(_pick(0, 2))
        names = draw(st.lists(st.sampled_from(NAMES), min_size=n_children + n_buffers, max_size=n_children + n_buffers, unique=True))
        children: list[Node] = []
        for child_name in names[:n_children]:
            if depth + 1 < max_depth and draw(st.booleans()):
                children.append(module(child_name, depth + 1))
            elif leaves[0] < MAX_LEAVES:
                leaves[0] += 1
                children.append(
                    Linear(child_name, draw(_pick(1, 7)), draw(_pick(1, 7)), bias=draw(st.booleans()), frozen=draw(_pick(0, 3)) == 3)
                )
        buffers = tuple(
            Buffer(
                buf_name,
                draw(st.sampled_from([str(d).removeprefix("torch.") for d in EDGE_DTYPES])),
                draw(st.sampled_from([(), (0,), (1,), (3,), (2, 3), (4, 1)])),
                persistent=draw(st.booleans()),
            )
            for buf_name in names[n_children:]
        )
        return Module(name, tuple(children), buffers)

    root = module("", 0)
    spec = ModelSpec(root, dtype)
    assume(spec.leaves())
    if all(lin.frozen for _, lin in spec.leaves()):  # an optimizer needs a trainable parameter
        first = spec.leaves()[0][0]
        spec = _replace_node(spec, first, lambda n: replace(n, frozen=False))
    # Ties: a module registers the weight of a Linear below it (0-2 of them).
    candidates = [
        (holder, leaf)
        for holder, node in spec.nodes()
        if isinstance(node, Module)
        for leaf, lin in spec.leaves()
        if (leaf.startswith(holder + ".") or (holder == "" and leaf)) and (frozen_ties or not lin.frozen)
    ]
    if candidates:
        for _ in range(draw(_pick(0, 2), label="ties")):
            holder, leaf = draw(st.sampled_from(candidates))
            node = spec.node(holder)
            assert isinstance(node, Module)
            taken = {c.name for c in node.children} | {b.name for b in node.buffers} | {t.name for t in node.ties}
            free = [n for n in NAMES if n not in taken]
            if not free:
                continue
            relative = leaf[len(holder) + 1 :] if holder else leaf
            spec = _replace_node(spec, holder, _add_tie(Tie(draw(st.sampled_from(free)), relative)))
    return spec


def _add_tie(tie: Tie) -> Callable[[Module], Module]:
    return lambda node: replace(node, ties=node.ties + (tie,))


def _replace_node(spec: ModelSpec, path: str, change: Callable[[Any], Any]) -> ModelSpec:
    def walk(node: Node, prefix: str) -> Node:
        if prefix == path:
            return change(node)
        if isinstance(node, Module):
            return replace(node, children=tuple(walk(c, join_path(prefix, c.name)) for c in node.children))
        return node

    root = walk(spec.root, "")
    assert isinstance(root, Module)
    return replace(spec, root=root)


# -- optimizer plans ------------------------------------------------------------------------------------------


def _group_assignment(draw: Any, atoms: Sequence[Sequence[str]], wanted: int, label: str) -> tuple[tuple[str, ...], ...]:
    """Split ``atoms`` (sets of key FQNs that must share a group) into ``wanted`` non-empty groups (fewer
    when there are fewer atoms)."""
    n_groups = min(wanted, len(atoms))
    # The first n_groups atoms of a drawn order found the groups (none stays empty); the others join one.
    order = draw(st.permutations(range(len(atoms))), label=f"{label} group founders")
    homes = [0] * len(atoms)
    for position, atom in enumerate(order):
        homes[atom] = position if position < n_groups else draw(_pick(0, n_groups - 1))
    groups: dict[int, list[str]] = {}
    for atom, home in zip(atoms, homes):
        groups.setdefault(home, []).extend(atom)
    return tuple(tuple(g) for _, g in sorted(groups.items()))


def _other_order(draw: Any, order: Sequence[str], label: str) -> tuple[str, ...]:
    """A permutation of ``order`` that differs from it (when it has two entries or more)."""
    other = tuple(draw(st.permutations(list(order)), label=label))
    if len(order) > 1 and other == tuple(order):
        other = tuple(reversed(order))
    return other


def _permuted_groups(draw: Any, groups: tuple[tuple[str, ...], ...]) -> tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]:
    """The same groups in another order (when there are two or more), with the hyperparameter set each keeps."""
    index = list(range(len(groups)))
    perm = list(draw(st.permutations(index), label="target group order"))
    if len(groups) > 1 and perm == index:
        perm = index[::-1]
    return tuple(groups[i] for i in perm), tuple(perm)


@st.composite
def _plans(draw: Any, spec: ModelSpec, atoms: Sequence[Sequence[str]], target: str, groups_wanted: int) -> tuple[OptimPlan, OptimPlan]:
    """(source plan, target plan). ``target``: ``refine`` (groups split further, any order: loaders that
    match groups by parameter), ``permute`` (the same groups in another order), ``same`` (the same
    groups in the same order), each with the parameters in another order; ``positional`` (the same
    plan: ``Optimizer.load_state_dict`` matches parameters by position). ``groups_wanted``: drawn first
    thing in a case (a draw after the model's many draws comes out 1 far more often than not)."""
    groups = _group_assignment(draw, atoms, groups_wanted, "source")
    order = tuple(draw(st.permutations(spec.trainable()), label="source order"))
    source = OptimPlan(groups, order)
    if target == "positional":
        return source, source
    target_order = _other_order(draw, order, "target order")
    if target == "same":
        return source, OptimPlan(groups, target_order)
    if target == "permute":
        permuted, index = _permuted_groups(draw, groups)
        return source, OptimPlan(permuted, target_order, index)
    pieces: list[tuple[tuple[str, ...], int]] = []
    for gi, group in enumerate(groups):
        if len(group) > 1 and draw(st.booleans()):
            cut = draw(st.integers(1, len(group) - 1))
            pieces += [(group[:cut], gi), (group[cut:], gi)]
        else:
            pieces.append((group, gi))
    perm = list(draw(st.permutations(range(len(pieces))), label="target group order"))
    return source, OptimPlan(tuple(pieces[i][0] for i in perm), target_order, tuple(pieces[i][1] for i in perm))


# -- state_dict (plain models) --------------------------------------------------------------------------------


def round_trip_cases(excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """SD-11 on a plain (or wrapped) model: get, set into another seed's model, continue. The target's
    groups are the source's split further (unless ``split-groups`` is excluded) or reordered, its
    parameters in another order. Cases of the ``excluded`` families are not drawn."""
    regroup = "split-groups" not in family_names(excluded)
    return without(_round_trip_case(regroup), STATE_DICT_TEST, excluded)


@st.composite
def _round_trip_case(draw: Any, regroup: bool) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    source, target = draw(_plans(spec, param_atoms(spec), "refine" if regroup else "permute", groups))
    options = (
        ("wrapper", draw(st.sampled_from(("plain", "checkpoint", "compile")))),
        ("flatten_optimizer_state_dict", draw(st.booleans())),
    )
    return Case(spec, draw(st.sampled_from(OPTIMIZERS)), source, target, draw(st.integers(1, 3)), draw(st.integers(1, 2)), options=options)


# -- optim_state -------------------------------------------------------------------------------------------------


@st.composite
def _sharding(draw: Any, spec: ModelSpec, world_sizes: Sequence[int], choices: Sequence[tuple[str, bool]], label: str) -> Sharding:
    world_size = draw(st.sampled_from(list(world_sizes)), label=f"{label} world size")
    strategy, orig = draw(st.sampled_from(list(choices)), label=f"{label} strategy, use_orig_params")
    candidates = unit_candidates(spec)
    n_units = draw(_pick(0, min(4, len(candidates))), label=f"{label} number of nested units")
    units = list(draw(st.permutations(candidates), label=f"{label} units"))[:n_units]
    return Sharding(world_size, strategy, orig, fix_units(spec, units, flat=not orig))


@st.composite
def _optim_state_case(draw: Any, world_sizes: Sequence[int], choices: Sequence[tuple[str, bool]]) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    flat_anywhere = any(not orig for _, orig in choices)
    spec = draw(model_specs(frozen_ties=not flat_anywhere))
    save = draw(_sharding(spec, world_sizes, choices, "save"))
    load = draw(_sharding(spec, world_sizes, choices, "load"))
    atoms = join_atoms(spec, flat_atoms(spec, save), flat_atoms(spec, load))
    source, target = draw(_plans(spec, atoms, "permute", groups))
    sharded = save.world_size == load.world_size and draw(st.booleans(), label="sharded optimizer state dict")
    return Case(
        spec,
        draw(st.sampled_from(OPTIMIZERS)),
        source,
        target,
        draw(st.integers(1, 3)),
        draw(st.integers(1, 2)),
        save,
        load,
        options=(("optimizer state dict", "sharded (DTensors)" if sharded else "full"),),
    )


def optim_state_cases(world_sizes: Sequence[int], choices: Sequence[tuple[str, bool]], excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """OS-6/OS-7: saved under one sharding (world size, strategy, use_orig_params, units), loaded under
    another; ``choices`` are the (strategy, use_orig_params) pairs the adapter can shard with. Cases of
    the ``excluded`` families are not drawn."""
    return without(_optim_state_case(usable_world_sizes(world_sizes), choices), OPTIM_STATE_TEST, excluded)


# -- checkpoint --------------------------------------------------------------------------------------------------


@st.composite
def _checkpoint_case(draw: Any, world_sizes: Sequence[int]) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    # The checkpoint ops shard the whole model as one unit, their own way: only the world sizes are drawn.
    save = Sharding(draw(st.sampled_from(list(world_sizes)), label="save world size"), "", drawn=False)
    load = Sharding(draw(st.sampled_from(list(world_sizes)), label="load world size"), "", drawn=False)
    source, target = draw(_plans(spec, param_atoms(spec), "same", groups))
    return Case(spec, draw(st.sampled_from(OPTIMIZERS)), source, target, draw(st.integers(1, 3)), draw(st.integers(1, 2)), save, load)


def checkpoint_cases(world_sizes: Sequence[int], excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """ML-1/ML-8: the sharded model and optimizer state saved at one world size, loaded at another.
    Cases of the ``excluded`` families are not drawn."""
    return without(_checkpoint_case(usable_world_sizes(world_sizes)), CHECKPOINT_TEST, excluded)


# -- flat_param (FlattenParamsWrapper plans) --------------------------------------------------------------------


@st.composite
def _flat_param_case(draw: Any, root_only: bool) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    if root_only:
        wrappers = [""]
    else:
        candidates = [""] + unit_candidates(spec)
        wrappers = list(draw(st.lists(st.sampled_from(candidates), unique=True, min_size=1, max_size=3), label="wrapped modules"))
        wrappers = list(fix_units(spec, [w for w in wrappers if w], flat=False)) + ([""] if "" in wrappers else [])
    assume(wrappers)
    lists = wrapper_lists(spec, wrappers)
    orders = tuple((w, tuple(draw(st.permutations(keys), label=f"param_list order of {w or '<root>'}"))) for w, keys in lists.items())
    target_orders = tuple((w, _other_order(draw, keys, f"target param_list order of {w or '<root>'}")) for w, keys in orders)
    source, target = draw(_plans(spec, fp_atoms(spec, wrappers), "positional", groups))
    options = (
        ("wrappers (param_list, source order)", ", ".join(f"{w or '<root>'}: [{', '.join(k)}]" for w, k in orders)),
        ("target param_list order", ", ".join(f"{w or '<root>'}: [{', '.join(k)}]" for w, k in target_orders)),
        ("_wrappers", tuple(w for w, _ in orders)),
        ("_source_lists", orders),
        ("_target_lists", target_orders),
    )
    return Case(spec, draw(st.sampled_from(OPTIMIZERS)), source, target, draw(st.integers(1, 3)), draw(st.integers(1, 2)), options=options)


def flat_param_cases(excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """FP-8/FP-13: wrappers at drawn modules (nested, or only at the root when ``nested-wrappers`` is
    excluded), each flattening its parameters in a drawn order. Cases of the ``excluded`` families are
    not drawn."""
    root_only = "nested-wrappers" in family_names(excluded)
    return without(_flat_param_case(root_only), FLAT_PARAM_TEST, excluded)


# -- sharded state_dict ---------------------------------------------------------------------------------------------


@st.composite
def _sharded_state_dict_case(draw: Any, world_sizes: Sequence[int], reorder_groups: bool) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    units = sd_units(spec)
    assume(units_homogeneous(spec, units))
    world_size = draw(st.sampled_from(list(world_sizes)), label="world size")
    full = draw(st.booleans(), label="full state dicts")
    save_strategy = draw(st.sampled_from(SD_STRATEGIES), label="save strategy")
    load_strategy = draw(st.sampled_from(SD_STRATEGIES), label="load strategy") if full else save_strategy
    atoms = flat_atoms(spec, Sharding(world_size, save_strategy, False, units))
    source, target = draw(_plans(spec, atoms, "permute" if reorder_groups else "same", groups))
    return Case(
        spec,
        draw(st.sampled_from(OPTIMIZERS)),
        source,
        target,
        draw(_pick(1, 3)),
        draw(_pick(1, 2)),
        Sharding(world_size, save_strategy, units=units, drawn=False),
        Sharding(world_size, load_strategy, units=units, drawn=False),
        options=(("state dicts", "full (full_state_dict=True)" if full else "sharded (DTensors)"),),
    )


def sharded_state_dict_cases(world_sizes: Sequence[int], excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """SD-12/SD-13: get from a sharded model, set into another seed's sharded model (another strategy
    when the state dicts are full), at one world size. Groups split at unit granularity (flat parameters),
    reordered in the target unless ``reordered-groups`` is excluded. Cases of the ``excluded`` families
    are not drawn."""
    reorder_groups = "reordered-groups" not in family_names(excluded)
    return without(_sharded_state_dict_case(usable_world_sizes(world_sizes), reorder_groups), SHARDED_STATE_DICT_TEST, excluded)
