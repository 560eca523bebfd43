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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import Phase, assume, settings
from hypothesis import strategies as st
from torch import nn

from conformance.adapters.base import Unsupported
from conformance.adapters.sharding import ShardingPlan, child_units, hybrid_mesh_shape
from conformance.asserts import assert_same_state, bits, expected_local_chunk, fail
from conformance.fqn import canonical_fqn
from conformance.values import EDGE_DTYPES, edge_values, perturb_hyperparameters

__all__ = [
    "register_profiles",
    "budget",
    "Buffer",
    "Linear",
    "Tie",
    "Module",
    "ModelSpec",
    "OptimPlan",
    "Sharding",
    "Case",
    "CaseFamily",
    "CASE_FAMILIES",
    "families_of",
    "excluded_families",
    "Refused",
    "build",
    "batch",
    "model_specs",
    "round_trip_cases",
    "optim_state_cases",
    "flat_param_cases",
    "checkpoint_cases",
    "usable_world_sizes",
    "state_dict_round_trip",
    "flat_param_round_trip",
    "optim_state_save",
    "optim_state_load",
    "optim_state_both",
    "checkpoint_save",
    "checkpoint_load",
    "sharded_state_dict_cases",
    "sharded_state_dict_round_trip",
]

# -- hypothesis profiles ------------------------------------------------------------------------------


#: Examples per generated test in each profile, before the per-capability weight of :func:`budget`.
PROFILE_EXAMPLES = {"ci": 25, "thorough": 150}


def register_profiles() -> None:
    """Register the ``ci`` and ``thorough`` profiles and make ``ci`` the default.

    ``ci`` (``make test``): derandomized, so every run draws the same examples (no database needed,
    none written), no deadline (a rank pool may start mid-test), and a bounded number of examples.
    ``thorough`` (``pytest --hypothesis-profile thorough``): random examples, many more of them, and
    the example database, so a failure found once is replayed first next time."""
    settings.register_profile(
        "ci",
        max_examples=PROFILE_EXAMPLES["ci"],
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: it reruns with tracing
    )
    settings.register_profile("thorough", max_examples=PROFILE_EXAMPLES["thorough"], deadline=None, print_blob=True)
    # ``stress`` (``make stress``): as many examples as ``ci``, but random ones, a fresh draw per run
    # (pass --hypothesis-seed to repeat one), and no database: each run of a stress loop is independent.
    settings.register_profile(
        "stress", max_examples=PROFILE_EXAMPLES["ci"], deadline=None, database=None, print_blob=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    if settings.get_current_profile_name() == "default":
        settings.load_profile("ci")


#: How many examples each generated test gets, relative to the profile's ``max_examples``: examples
#: of the local capabilities cost milliseconds, sharded ones a round trip to the rank pools.
WEIGHTS = {"flat_param": 5.0, "state_dict": 5.0, "optim_state": 1.0, "checkpoint": 1.0, "sharded_state_dict": 1.0}


def budget(capability: str) -> int:
    """``max_examples`` for the generated test of ``capability`` under the profile loaded now."""
    return max(1, round(settings.default.max_examples * WEIGHTS[capability]))


# -- the model description ------------------------------------------------------------------------------

#: Module, buffer and tie names: digits and letters that are prefixes of one another.
NAMES: tuple[str, ...] = ("1", "10", "a", "ab", "0", "11", "b", "abc")
PARAM_DTYPES: tuple[str, ...] = ("float32", "float64")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
#: Rows of every global batch: each rank trains on its equal slice (world sizes that divide it).
GLOBAL_BATCH = 24


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True)
class Buffer:
    """A buffer of ``dtype`` and ``shape`` holding edge values of its dtype (permuted by the seed)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    persistent: bool

    def describe(self) -> str:
        shape = ", ".join(map(str, self.shape))
        return f"{self.name}: buffer {self.dtype}[{shape}] {'persistent' if self.persistent else 'NON-persistent'}"


@dataclass(frozen=True)
class Linear:
    """``nn.Linear(in_features, out_features, bias)``; its output is ``tanh`` of it on the first
    ``in_features`` columns of the model input. ``frozen``: ``requires_grad=False``."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    frozen: bool = False

    def describe(self) -> str:
        text = f"{self.name}: Linear({self.in_features} -> {self.out_features}{'' if self.bias else ', no bias'})"
        return text + ("  FROZEN" if self.frozen else "")


@dataclass(frozen=True)
class Tie:
    """The module holding the tie registers the ``weight`` of its descendant Linear at ``source`` (a
    path relative to it) as its own parameter ``name``: one Parameter at two FQNs, used twice in forward."""

    name: str
    source: str

    def describe(self) -> str:
        return f"{self.name}: TIED to {self.source}.weight (same Parameter)"


@dataclass(frozen=True)
class Module:
    """A module whose output is its children's outputs (and its ties' ``tanh(x @ w.T)``) concatenated."""

    name: str
    children: tuple[Linear | Module, ...] = ()
    buffers: tuple[Buffer, ...] = ()
    ties: tuple[Tie, ...] = ()

    def describe(self) -> str:
        return f"{self.name}:"


Node = Linear | Module


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class ParamEntry:
    """One registration of a parameter, as ``named_parameters(remove_duplicate=False)`` yields it."""

    fqn: str
    key: str  #: the first FQN of the same Parameter (the optimizer-state key)
    shape: tuple[int, ...]
    frozen: bool
    owner: str  #: path of the module that registers it
    leaf: str  #: path of the Linear that created it


@dataclass(frozen=True)
class ModelSpec:
    """A model tree; :func:`build` makes it. Parameters are ``dtype`` (one dtype per model, so flat
    parameters are uniform)."""

    root: Module
    dtype: str = "float32"

    # -- walking the tree (the order of nn.Module's named_modules / named_parameters) --

    def nodes(self) -> list[tuple[str, Node]]:
        """(path, node) pre-order, root first (path "")."""
        out: list[tuple[str, Node]] = []

        def walk(prefix: str, node: Node) -> None:
            out.append((prefix, node))
            if isinstance(node, Module):
                for child in node.children:
                    walk(_join(prefix, child.name), child)

        walk("", self.root)
        return out

    def node(self, path: str) -> Node:
        return dict(self.nodes())[path]

    def leaves(self) -> list[tuple[str, Linear]]:
        return [(p, n) for p, n in self.nodes() if isinstance(n, Linear)]

    def params(self) -> list[ParamEntry]:
        """Every parameter registration in ``named_parameters(remove_duplicate=False)`` order."""
        leaves = dict(self.leaves())
        raw: list[tuple[str, str, str, str]] = []  # fqn, leaf path, owner, attr
        for path, node in self.nodes():
            if isinstance(node, Module):
                for tie in node.ties:
                    raw.append((_join(path, tie.name), _join(path, tie.source), path, "weight"))
            else:
                raw.append((_join(path, "weight"), path, path, "weight"))
                if node.bias:
                    raw.append((_join(path, "bias"), path, path, "bias"))
        key_of: dict[tuple[str, str], str] = {}
        out = []
        for fqn, leaf, owner, attr in raw:
            key = key_of.setdefault((leaf, attr), fqn)
            lin = leaves[leaf]
            shape = (lin.out_features, lin.in_features) if attr == "weight" else (lin.out_features,)
            out.append(ParamEntry(fqn, key, shape, lin.frozen, owner, leaf))
        return out

    def trainable(self) -> list[str]:
        """Key FQNs of the trainable parameters, in ``named_parameters()`` order (tied ones once)."""
        return list(dict.fromkeys(e.key for e in self.params() if not e.frozen))

    def names_of(self, key: str) -> list[str]:
        return [e.fqn for e in self.params() if e.key == key]

    def buffers(self) -> list[tuple[str, Buffer]]:
        return [(_join(p, b.name), b) for p, n in self.nodes() if isinstance(n, Module) for b in n.buffers]

    def non_persistent(self) -> list[str]:
        return [fqn for fqn, b in self.buffers() if not b.persistent]

    @property
    def input_width(self) -> int:
        return max(lin.in_features for _, lin in self.leaves())

    def __repr__(self) -> str:
        lines = [f"model ({self.dtype} parameters, input width {self.input_width}):"]

        def walk(node: Node, depth: int) -> None:
            pad = "    " * depth
            lines.append(pad + ("<root>" if depth == 0 else node.describe()))
            if isinstance(node, Module):
                inner = "    " * (depth + 1)
                for child in node.children:
                    walk(child, depth + 1)
                for tie in node.ties:
                    lines.append(inner + tie.describe())
                for buf in node.buffers:
                    lines.append(inner + buf.describe())

        walk(self.root, 0)
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("\n" + repr(self))


# -- building the model ------------------------------------------------------------------------------------


class GenLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x[:, : self.in_features]))


class GenModule(nn.Module):
    def __init__(self, tie_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.tie_names = tuple(tie_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [child(x) for child in self.children()]
        for name in self.tie_names:
            weight = getattr(self, name)
            outs.append(torch.tanh(F.linear(x[:, : weight.shape[1]], weight)))
        return torch.cat(outs, dim=1) if outs else x[:, :0]


def _value_pool(dtype: torch.dtype) -> torch.Tensor:
    """The edge values of ``dtype``, each bit pattern once (at least two)."""
    values = edge_values(dtype)
    seen: dict[bytes, int] = {}
    for i, raw in enumerate(bits(values).reshape(-1).tolist()):
        seen.setdefault(repr(raw).encode(), i)
    return values[list(seen.values())]


def buffer_value(buf: Buffer, seed: int) -> torch.Tensor:
    """Edge values of the buffer's dtype; two seeds differ in every element (consecutive pool entries)."""
    pool = _value_pool(_dtype(buf.dtype))
    numel = math.prod(buf.shape)
    index = (torch.arange(numel) * 3 + seed + (0 if buf.persistent else 5)) % pool.numel()
    return pool[index].reshape(buf.shape).clone()


def build(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The model of ``spec``; its parameters and buffers depend only on ``seed``."""
    dtype = _dtype(spec.dtype)

    def make(node: Node) -> nn.Module:
        if isinstance(node, Linear):
            return GenLinear(node.in_features, node.out_features, bias=node.bias, dtype=dtype)
        module = GenModule([t.name for t in node.ties])
        for child in node.children:
            module.add_module(child.name, make(child))
        for buf in node.buffers:
            module.register_buffer(buf.name, buffer_value(buf, seed), persistent=buf.persistent)
        return module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make(spec.root)
    for path, node in spec.nodes():
        if isinstance(node, Module):
            holder = model.get_submodule(path)
            for tie in node.ties:
                holder.register_parameter(tie.name, holder.get_submodule(tie.source).weight)
        elif node.frozen:
            model.get_submodule(path).requires_grad_(False)
    return model.to(device)


def batch(spec: ModelSpec, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global batch of training step ``step`` (every world size slices the same rows)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    data = torch.randn(GLOBAL_BATCH, spec.input_width, generator=gen, dtype=torch.float64)
    return data.to(_dtype(spec.dtype)).to(device)


def loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    loss(model(inputs)).backward()
    optim.step()


# -- the optimizer plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimPlan:
    """Param groups (key FQNs of trainable parameters, hyperparameters by group index) and the order of
    the parameters in the optimizer (group by group, each group in ``order``)."""

    groups: tuple[tuple[str, ...], ...]
    order: tuple[str, ...]
    hyper_index: tuple[int, ...] = ()  #: per group, which hyperparameter set it takes (default: its index)

    def describe(self) -> str:
        index = self.hyper_index or tuple(range(len(self.groups)))
        groups = " | ".join(f"h{h}: {', '.join(self._ordered(g))}" for g, h in zip(self.groups, index))
        return f"groups [{groups}]"

    def _ordered(self, group: Sequence[str]) -> list[str]:
        rank = {fqn: i for i, fqn in enumerate(self.order)}
        return sorted(group, key=lambda f: rank.get(f, len(rank)))


def hyperparameters(kind: str, index: int) -> dict[str, Any]:
    """The source hyperparameters of group set ``index``, with a scheduler's and a user's extra key."""
    lr = (0.02, 0.05, 0.01, 0.03)[index % 4]
    weight_decay = (0.0, 0.01, 0.1, 0.02)[index % 4]
    extra = {"initial_lr": lr * 2, "sdc_custom": f"source-{index}"}
    if kind == "sgd":
        return {"lr": lr, "momentum": (0.9, 0.5, 0.8, 0.7)[index % 4], "weight_decay": weight_decay, **extra}
    return {"lr": lr, "betas": ((0.9, 0.99), (0.8, 0.95), (0.85, 0.9), (0.7, 0.999))[index % 4], "eps": 1e-8, "weight_decay": weight_decay, **extra}


def make_optimizer(kind: str, plan: OptimPlan, named: Sequence[tuple[Sequence[str], nn.Parameter]], *, perturb: bool = False) -> torch.optim.Optimizer:
    """An optimizer over ``named`` ((FQNs a parameter stands for, parameter); frozen ones left out),
    grouped and ordered by ``plan``; ``perturb``: every hyperparameter changed afterwards (a load target)."""
    group_of = {fqn: gi for gi, group in enumerate(plan.groups) for fqn in group}
    rank = {fqn: i for i, fqn in enumerate(plan.order)}
    members: list[list[tuple[int, nn.Parameter]]] = [[] for _ in plan.groups]
    for fqns, param in named:
        if not param.requires_grad:
            continue
        homes = {group_of[f] for f in fqns if f in group_of}
        if len(homes) != 1:
            raise AssertionError(f"generated-case layout error: parameter {list(fqns)} falls in groups {sorted(homes)}")
        members[homes.pop()].append((min(rank[f] for f in fqns if f in rank), param))
    index = plan.hyper_index or tuple(range(len(plan.groups)))
    groups = [{"params": [p for _, p in sorted(m, key=lambda t: t[0])], **hyperparameters(kind, h)} for m, h in zip(members, index)]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    optim = cls([g for g in groups if g["params"]])
    if perturb:
        perturb_hyperparameters(optim)
    return optim


def oracle_params(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    return [((name,), p) for name, p in model.named_parameters()]


# -- sharding ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """How one side of a sharded run is laid out. ``units``: module paths that are nested sharding units
    (the root always is one)."""

    world_size: int
    strategy: str = "FULL_SHARD"
    use_orig_params: bool = True
    units: tuple[str, ...] = ()
    drawn: bool = True  #: False: only the world size is drawn, the adapter shards its own way (checkpoint)

    def describe(self) -> str:
        if not self.drawn:
            units = ", ".join(repr(u) for u in self.units) or "none"
            strategy = f"{self.strategy}, " if self.strategy else ""
            return f"world size {self.world_size}, {strategy}units chosen by the adapter (nested: {units})"
        units = ", ".join(repr(u) for u in self.units) or "none"
        return f"world size {self.world_size}, {self.strategy}, use_orig_params={self.use_orig_params}, nested units: {units}"


# -- the case ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One generated example: a model, its optimizer plans, how many steps, and per capability the rest."""

    model: ModelSpec
    optimizer: str
    source: OptimPlan
    target: OptimPlan
    steps: int = 2
    more_steps: int = 1
    save: Sharding | None = None
    load: Sharding | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def __repr__(self) -> str:
        lines = [repr(self.model), f"optimizer {self.optimizer}:"]
        lines.append(f"    source {self.source.describe()}")
        lines.append(f"    source order: {', '.join(self.source.order)}")
        lines.append(f"    target {self.target.describe()} (hyperparameters perturbed before the load)")
        lines.append(f"    target order: {', '.join(self.target.order)}")
        if self.save is not None:
            lines.append(f"save: {self.save.describe()}")
        if self.load is not None:
            lines.append(f"load: {self.load.describe()}")
        for name, value in self.options:
            if not name.startswith("_"):  # internal: the same plan in the form the runner takes
                lines.append(f"{name}: {value}")
        lines.append(f"steps: {self.steps} before saving, {self.more_steps} after loading")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis prints draws with its own pretty-printer, which would spell the dataclass out
        field by field; a case reads better as the model it describes."""
        printer.text("\n" + repr(self))


# -- families of cases an adapter's known deviations leave out of its generated domain ----------------------

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
        {STATE_DICT_TEST: lambda c: c.option("wrapper") == "compile" and _max_names(c.model) >= 3},
    ),
    CaseFamily(
        "three-names",
        "a parameter registered under three names or more (for sharded state dicts: set as full state dicts)",
        {
            OPTIM_STATE_TEST: lambda c: _max_names(c.model) >= 3,
            SHARDED_STATE_DICT_TEST: lambda c: _max_names(c.model) >= 3 and c.option("state dicts", "").startswith("full"),
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
        {FLAT_PARAM_TEST: lambda c: _max_names(c.model) >= 2},
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


def _groups_reordered(case: Case) -> bool:
    index = case.target.hyper_index
    return bool(index) and list(index) != sorted(index)


def _frozen_above_unit(spec: ModelSpec, sharding: Sharding) -> bool:
    """A frozen parameter is owned by a unit (the root included) that has a nested unit below it."""
    owners = {_owner(e.owner, sharding.units) for e in spec.params() if e.frozen}
    return any(any(_is_below(u, owner) for u in sharding.units) for owner in owners)


def _fsdp2_mesh(sharding: Sharding | None) -> tuple[int, ...]:
    """The mesh shape the torch-fsdp2 adapter shards on (conformance/adapters/optim_state.py)."""
    assert sharding is not None
    ws = sharding.world_size
    return {"HYBRID_SHARD": hybrid_mesh_shape(ws), "NO_SHARD": (ws, 1)}.get(sharding.strategy, (ws,))


def _max_names(spec: ModelSpec) -> int:
    counts: dict[str, int] = {}
    for entry in spec.params():
        counts[entry.key] = counts.get(entry.key, 0) + 1
    return max(counts.values(), default=0)


def _without(cases: st.SearchStrategy[Case], test: str, excluded: Sequence[CaseFamily]) -> st.SearchStrategy[Case]:
    """``cases`` without those of the ``excluded`` families that ``test`` picks by predicate (a family
    handled by a switch of the strategy is not drawn at all)."""
    predicates = [p for family in excluded if (p := family.applies.get(test)) is not None]
    if not predicates:
        return cases
    return cases.filter(lambda c: not any(p(c) for p in predicates))


# -- strategies -------------------------------------------------------------------------------------------

MAX_LEAVES = 6


def _pick(low: int, high: int) -> st.SearchStrategy[int]:
    """An integer in ``[low, high]``, uniformly (``st.integers`` favours its bounds: most models would
    get one leaf, one group, every leaf frozen), shrinking towards ``low``."""
    return st.sampled_from(range(low, high + 1))


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
            tie = Tie(draw(st.sampled_from(free)), relative)
            spec = _replace_node(spec, holder, lambda n, tie=tie: replace(n, ties=n.ties + (tie,)))
    return spec


def _replace_node(spec: ModelSpec, path: str, change: Callable[[Any], Any]) -> ModelSpec:
    def walk(node: Node, prefix: str) -> Node:
        if prefix == path:
            return change(node)
        if isinstance(node, Module):
            return replace(node, children=tuple(walk(c, _join(prefix, c.name)) for c in node.children))
        return node

    return replace(spec, root=walk(spec.root, ""))


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


def _atoms(spec: ModelSpec) -> list[list[str]]:
    return [[fqn] for fqn in spec.trainable()]


def _join_atoms(spec: ModelSpec, *partitions: Sequence[Sequence[str]]) -> list[list[str]]:
    """The finest partition of the trainable key FQNs coarser than each of ``partitions``."""
    parent = {fqn: fqn for fqn in spec.trainable()}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for partition in partitions:
        for atom in partition:
            for a, b in zip(atom, atom[1:]):
                parent[find(a)] = find(b)
    merged: dict[str, list[str]] = {}
    for fqn in spec.trainable():
        merged.setdefault(find(fqn), []).append(fqn)
    return list(merged.values())


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


def _names(excluded: Sequence[CaseFamily]) -> set[str]:
    return {family.name for family in excluded}


def round_trip_cases(excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """SD-11 on a plain (or wrapped) model: get, set into another seed's model, continue. The target's
    groups are the source's split further (unless ``split-groups`` is excluded) or reordered, its
    parameters in another order. Cases of the ``excluded`` families are not drawn."""
    regroup = "split-groups" not in _names(excluded)
    return _without(_round_trip_case(regroup), STATE_DICT_TEST, excluded)


@st.composite
def _round_trip_case(draw: Any, regroup: bool) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    source, target = draw(_plans(spec, _atoms(spec), "refine" if regroup else "permute", groups))
    options = (
        ("wrapper", draw(st.sampled_from(("plain", "checkpoint", "compile")))),
        ("flatten_optimizer_state_dict", draw(st.booleans())),
    )
    return Case(spec, draw(st.sampled_from(OPTIMIZERS)), source, target, draw(st.integers(1, 3)), draw(st.integers(1, 2)), options=options)


# -- sharding units --------------------------------------------------------------------------------------------


def _is_below(path: str, ancestor: str) -> bool:
    """``path`` lies strictly below ``ancestor`` ("" is the root)."""
    return path != ancestor and (ancestor == "" or path.startswith(ancestor + "."))


def _tie_spans(spec: ModelSpec) -> list[tuple[str, str]]:
    """(holder, source leaf) of each tie, as full paths."""
    return [(holder, _join(holder, tie.source)) for holder, node in spec.nodes() if isinstance(node, Module) for tie in node.ties]


def _owner(path: str, units: Sequence[str]) -> str:
    """The unit (nearest ancestor-or-self in ``units``, else the root "") owning what ``path`` registers."""
    best = ""
    for unit in units:
        if (path == unit or _is_below(path, unit)) and len(unit) > len(best):
            best = unit
    return best


def fix_units(spec: ModelSpec, units: Sequence[str], *, flat: bool) -> tuple[str, ...]:
    """Make drawn nested units valid: no unit separates the two registrations of a tied parameter, and
    with flat parameters (``flat``) no unit owns frozen and trainable parameters together (each frozen
    Linear it owns becomes a unit of its own)."""
    kept = [u for u in units if not any(_is_below(u, holder) and (leaf == u or _is_below(leaf, u)) for holder, leaf in _tie_spans(spec))]
    if flat:
        owned: dict[str, set[bool]] = {}
        for entry in spec.params():
            owned.setdefault(_owner(entry.owner, kept), set()).add(entry.frozen)
        for unit, kinds in owned.items():
            if len(kinds) > 1:
                kept += [leaf for leaf, lin in spec.leaves() if lin.frozen and _owner(leaf, kept) == unit and leaf not in kept]
    order = [p for p, _ in spec.nodes()]
    return tuple(sorted(set(kept), key=order.index))


def flat_atoms(spec: ModelSpec, sharding: Sharding) -> list[list[str]]:
    """Trainable key FQNs grouped as an optimizer sees them: one flat parameter per unit
    (``use_orig_params=False``), else one entry per parameter."""
    if sharding.use_orig_params:
        return _atoms(spec)
    by_unit: dict[str, list[str]] = {}
    for entry in spec.params():
        if not entry.frozen and entry.fqn == entry.key:
            by_unit.setdefault(_owner(entry.owner, sharding.units), []).append(entry.key)
    return list(by_unit.values())


def _unit_candidates(spec: ModelSpec) -> list[str]:
    return [path for path, node in spec.nodes() if path and (isinstance(node, Linear) or any(e.fqn.startswith(path + ".") for e in spec.params()))]


@st.composite
def _sharding(draw: Any, spec: ModelSpec, world_sizes: Sequence[int], choices: Sequence[tuple[str, bool]], label: str) -> Sharding:
    world_size = draw(st.sampled_from(list(world_sizes)), label=f"{label} world size")
    strategy, orig = draw(st.sampled_from(list(choices)), label=f"{label} strategy, use_orig_params")
    candidates = _unit_candidates(spec)
    n_units = draw(_pick(0, min(4, len(candidates))), label=f"{label} number of nested units")
    units = list(draw(st.permutations(candidates), label=f"{label} units"))[:n_units]
    return Sharding(world_size, strategy, orig, fix_units(spec, units, flat=not orig))


def usable_world_sizes(world_sizes: Sequence[int]) -> list[int]:
    return [ws for ws in world_sizes if GLOBAL_BATCH % ws == 0]


@st.composite
def _optim_state_case(draw: Any, world_sizes: Sequence[int], choices: Sequence[tuple[str, bool]]) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    flat_anywhere = any(not orig for _, orig in choices)
    spec = draw(model_specs(frozen_ties=not flat_anywhere))
    save = draw(_sharding(spec, world_sizes, choices, "save"))
    load = draw(_sharding(spec, world_sizes, choices, "load"))
    atoms = _join_atoms(spec, flat_atoms(spec, save), flat_atoms(spec, load))
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
    another. Cases of the ``excluded`` families are not drawn."""
    return _without(_optim_state_case(usable_world_sizes(world_sizes), choices), OPTIM_STATE_TEST, excluded)


@st.composite
def _checkpoint_case(draw: Any, world_sizes: Sequence[int]) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    # The checkpoint ops shard the whole model as one unit, their own way: only the world sizes are drawn.
    save = Sharding(draw(st.sampled_from(list(world_sizes)), label="save world size"), "", drawn=False)
    load = Sharding(draw(st.sampled_from(list(world_sizes)), label="load world size"), "", drawn=False)
    source, target = draw(_plans(spec, _atoms(spec), "same", groups))
    return Case(spec, draw(st.sampled_from(OPTIMIZERS)), source, target, draw(st.integers(1, 3)), draw(st.integers(1, 2)), save, load)


def checkpoint_cases(world_sizes: Sequence[int], excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """ML-1/ML-8: the sharded model and optimizer state saved at one world size, loaded at another.
    Cases of the ``excluded`` families are not drawn."""
    return _without(_checkpoint_case(usable_world_sizes(world_sizes)), CHECKPOINT_TEST, excluded)


# -- FlattenParamsWrapper plans ---------------------------------------------------------------------------------


def wrapper_lists(spec: ModelSpec, wrappers: Sequence[str]) -> dict[str, list[str]]:
    """Per wrapper path (innermost first), the key FQNs it flattens: the parameters registered in its
    subtree outside nested wrappers, the trainable ones if it has any, else the frozen ones."""
    out: dict[str, list[str]] = {}
    entries = spec.params()
    for wrapper in sorted(wrappers, key=lambda w: -len(w.split("."))):
        mine = [e for e in entries if _owner(e.owner, wrappers) == wrapper and e.fqn == e.key]
        trainable = [e.key for e in mine if not e.frozen]
        out[wrapper] = trainable or [e.key for e in mine]
    return out


def fp_atoms(spec: ModelSpec, wrappers: Sequence[str]) -> list[list[str]]:
    flattened = {w: keys for w, keys in wrapper_lists(spec, wrappers).items() if keys}
    in_flat = {k for keys in flattened.values() for k in keys}
    atoms = [keys for keys in flattened.values() if not any(k not in spec.trainable() for k in keys)]
    return atoms + [[k] for k in spec.trainable() if k not in in_flat]


@st.composite
def _flat_param_case(draw: Any, root_only: bool) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    if root_only:
        wrappers = [""]
    else:
        candidates = [""] + _unit_candidates(spec)
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
    root_only = "nested-wrappers" in _names(excluded)
    return _without(_flat_param_case(root_only), FLAT_PARAM_TEST, excluded)


# -- comparisons ---------------------------------------------------------------------------------------------


def tolerance(spec: ModelSpec) -> tuple[float, float]:
    """(atol, rtol) for values computed on several ranks that average gradients."""
    return (1e-5, 1e-4) if spec.dtype == "float32" else (1e-10, 1e-8)


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def by_parameter(osd: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as ``{fqn: {"hyperparameters": ..., "state": ...}}`` over
    ``keys`` (in that order), so that two dicts whose groups are split or ordered differently compare
    parameter by parameter. State for FQNs not in ``keys`` is kept under its own FQN (and fails)."""
    hyper: dict[str, Any] = {}
    for group in osd["param_groups"]:
        values = {k: _plain(v) for k, v in sorted(group.items()) if k != "params"}
        for fqn in group["params"]:
            hyper[fqn] = values
    out = {fqn: {"hyperparameters": hyper.get(fqn, "<in no param group>"), "state": dict(osd["state"].get(fqn, {}))} for fqn in keys}
    for fqn in osd["state"]:
        if fqn not in out:
            out[fqn] = {"hyperparameters": hyper.get(fqn), "state": osd["state"][fqn]}
    return out


def fqn_keyed(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``optim.state_dict()`` of the unwrapped ``model`` keyed by FQN (``named_parameters`` names)."""
    name_of = {p: canonical_fqn(n) for n, p in model.named_parameters()}
    fqns = [name_of[p] for g in optim.param_groups for p in g["params"]]
    osd = optim.state_dict()
    return {
        "state": {fqns[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def assert_optimizer_matches(got: Mapping[str, Any], expected: Mapping[str, Any], keys: Sequence[str], *, what: str, where: str,
        atol: float | None = None, rtol: float = 0.0) -> None:
    """Parameter by parameter: the same hyperparameters (exactly) and state (bitwise, or within ``atol``)."""
    __tracebackhide__ = True
    g, e = by_parameter(got, keys), by_parameter(expected, keys)
    assert_same_state({k: v["hyperparameters"] for k, v in g.items()}, {k: v["hyperparameters"] for k, v in e.items()},
        what=f"{what}: hyperparameters", where=where)
    assert_same_state({k: v["state"] for k, v in g.items()}, {k: v["state"] for k, v in e.items()}, what=f"{what}: state", where=where, atol=atol,
        rtol=rtol, check_order=False)


def assert_local_shards(got: Any, expected: Any, *, what: str, where: str, atol: float | None = None, rtol: float = 0.0) -> None:
    """Per-rank truth: every DTensor in ``got`` (nested dicts, walked by the keys both have) holds, on this
    rank, the piece of the ``expected`` full value that the documented layout assigns to its mesh
    coordinate (:func:`conformance.asserts.expected_local_chunk`), not only a full value that gathers right."""
    __tracebackhide__ = True
    from torch.distributed.tensor import DTensor

    if isinstance(got, Mapping) and isinstance(expected, Mapping):
        for key in got:
            if key in expected:
                assert_local_shards(got[key], expected[key], what=what, where=f"{where}[{key!r}]", atol=atol, rtol=rtol)
        return
    if not isinstance(got, DTensor) or not isinstance(expected, torch.Tensor):
        return
    coordinate = got.device_mesh.get_coordinate()
    if coordinate is None:
        return
    piece, offsets = expected_local_chunk(expected.detach().cpu(), got.placements, tuple(got.device_mesh.shape), tuple(coordinate))
    assert_same_state(
        got.to_local().detach().cpu(), piece, what=f"{what}: local shard",
        where=f"{where} (mesh coordinate {tuple(coordinate)}, {got.placements}, offsets {offsets})", atol=atol, rtol=rtol
    )


def split_state(spec: ModelSpec, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parameters, buffers) of a model state dict, in its order."""
    params = {e.fqn for e in spec.params()}
    return {k: v for k, v in state.items() if k in params}, {k: v for k, v in state.items() if k not in params}


def assert_model_matches(
    spec: ModelSpec, got: Mapping[str, Any], expected: Mapping[str, Any], *, what: str, where: str,
    atol: float | None = None, rtol: float = 0.0, check_order: bool = True
) -> None:
    """The same keys (in the same order, where the requirement says so: SD-1, FP-12); buffers bitwise
    (never computed), parameters bitwise or within ``atol``."""
    __tracebackhide__ = True
    if (list(got) if check_order else sorted(got)) != (list(expected) if check_order else sorted(expected)):
        fail(f"{what}: keys differ{' (or their order)' if check_order else ''}", list(got), list(expected), where)
    got_params, got_buffers = split_state(spec, got)
    want_params, want_buffers = split_state(spec, expected)
    assert_same_state(got_buffers, want_buffers, what=f"{what}: buffers", where=where, check_order=check_order)
    assert_same_state(got_params, want_params, what=f"{what}: parameters", where=where, atol=atol, rtol=rtol, check_order=check_order)


def non_persistent_buffers(spec: ModelSpec, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers by clean FQN (wrapper segments removed), copied."""
    wanted = set(spec.non_persistent())
    out = {}
    for name, buf in model.named_buffers():
        clean = canonical_fqn(name)
        if clean in wanted:
            out[clean] = buf.detach().clone()
    return out


def to_cpu(obj: Any) -> Any:
    """``obj`` with every plain tensor moved to the CPU, DTensors gathered (collective), containers rebuilt."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().cpu()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run with one intra-op thread, then restore the setting. The generated models are tiny: on a
    loaded machine torch's second thread makes each backward pass ten times slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _single_threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        with single_threaded():
            return fn(*args, **kwargs)

    return run


# -- oracle runs ----------------------------------------------------------------------------------------------


def oracle_run(case: Case, steps: int, device: torch.device | str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """The unwrapped model of seed 0 and its optimizer (source plan) after ``steps`` steps on whole batches."""
    model = build(case.model, 0, device)
    optim = make_optimizer(case.optimizer, case.source, oracle_params(model))
    for step in range(steps):
        train_step(model, optim, batch(case.model, step, device))
    return model, optim


def warm_target(case: Case, model: nn.Module, optim: torch.optim.Optimizer, device: torch.device | str,
        rank_slice: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> None:
    """One step on a batch no source sees, so the target has optimizer state of its own to overwrite."""
    train_step(model, optim, rank_slice(batch(case.model, 999, device)))


def iter_steps(case: Case) -> Iterator[int]:
    return iter(range(case.steps, case.steps + case.more_steps))


def continue_alongside(
    case: Case,
    spec: ModelSpec,
    oracle: tuple[nn.Module, torch.optim.Optimizer],
    target: tuple[nn.Module, torch.optim.Optimizer],
    device: torch.device | str = "cpu",
    local: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> None:
    """``case.more_steps`` more training steps of the oracle and the loaded target on the same global
    batches (the target sees ``local`` of each: its rank's rows when it is sharded)."""
    for step in iter_steps(case):
        x = batch(spec, step, device)
        train_step(*oracle, x)
        train_step(*target, local(x))


# -- rank bodies: optim_state ------------------------------------------------------------------------------------


class Refused(str):
    """What a rank body returns when the adapter cannot lay out the drawn case (it raised
    ``Unsupported``): the controller rejects the example instead of skipping the whole test."""


def _os_run(ctx: Any, impl: Any, case: Case, sharding: Sharding, seed: int, plan: OptimPlan, *, perturb: bool) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """Model of ``seed`` sharded as ``sharding`` by the adapter, and its optimizer laid out by ``plan``."""
    ops = impl.require("optim_state")
    model = build(case.model, seed, ctx.device)
    unit_ids = {id(model.get_submodule(path)) for path in sharding.units}
    sharding_plan = ShardingPlan(sharding.strategy, sharding.use_orig_params, units=lambda m: id(m) in unit_ids, device=ctx.device)
    wrapped = impl.require("sharding").shard(model, sharding_plan)
    optim = make_optimizer(case.optimizer, plan, [(tuple(canonical_fqn(f) for f in fqns), p) for fqns, p in ops.optimizer_params(wrapped)], perturb=perturb)
    return ops, wrapped, optim


def _slice(ctx: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x.chunk(ctx.world_size)[ctx.rank]


@_single_threaded
def optim_state_save(ctx: Any, impl: Any, case: Case, *, keep: bool = False) -> Any:
    """Train the source sharded run ``case.steps`` steps next to the oracle; check it (OS-1, OS-3) and
    return the full model and optimizer state dicts (CPU, every rank) — or, with ``keep``, the run."""
    assert case.save is not None
    try:
        ops, model, optim = _os_run(ctx, impl, case, case.save, 0, case.source, perturb=False)
    except Unsupported as exc:
        return Refused(str(exc))
    oracle = build(case.model, 0, ctx.device)
    oracle_optim = make_optimizer(case.optimizer, case.source, oracle_params(oracle))
    for step in range(case.steps):
        x = batch(case.model, step, ctx.device)
        train_step(oracle, oracle_optim, x)
        train_step(model, optim, _slice(ctx)(x))
    atol, rtol = tolerance(case.model)
    where = f"rank {ctx.rank}, saving side ({case.save.describe()}), after {case.steps} steps"
    model_sd = to_cpu(ops.full_state_dict(model))
    assert_model_matches(case.model, model_sd, to_cpu(oracle.state_dict()), what="full model state dict vs the unwrapped model", where=where,
        atol=atol, rtol=rtol, check_order=False)
    full_osd = to_cpu(ops.optim_state_dict(model, optim))
    keys = case.model.trainable()
    assert_optimizer_matches(full_osd, to_cpu(fqn_keyed(oracle, oracle_optim)), keys, what="full optimizer state dict vs the unwrapped model",
        where=where, atol=atol, rtol=rtol)
    if keep:
        return ops, model, optim, model_sd, full_osd
    return model_sd, full_osd


@_single_threaded
def _continue_and_compare(
    case: Any, ctx: Any, model: nn.Module, optim: torch.optim.Optimizer, read_state: Callable[[], tuple[Any, Any]], where: str
) -> None:
    """Train the loaded ``model`` and the unwrapped run that never stopped for the case's remaining
    steps, then compare ``read_state()`` (model and optimizer state on the CPU) with the oracle's."""
    keys = case.model.trainable()
    oracle, oracle_optim = oracle_run(case, case.steps, ctx.device)
    continue_alongside(case, case.model, (oracle, oracle_optim), (model, optim), ctx.device, _slice(ctx))
    atol, rtol = tolerance(case.model)
    got_model, got_optim = read_state()
    where = f"{where}, {case.more_steps} more step(s) after the load"
    assert_model_matches(case.model, got_model, to_cpu(oracle.state_dict()), what="model vs the unwrapped run that never stopped", where=where,
        atol=atol, rtol=rtol, check_order=False)
    assert_optimizer_matches(got_optim, to_cpu(fqn_keyed(oracle, oracle_optim)), keys, what="optimizer vs the unwrapped run that never stopped",
        where=where, atol=atol, rtol=rtol)


def optim_state_load(ctx: Any, impl: Any, case: Case, saved: Any) -> Any:
    """Load what the source saved into a target of another seed, sharded as ``case.load``, whose
    optimizer has the target plan and perturbed hyperparameters; check the load bitwise, continue
    ``case.more_steps`` steps, and compare with the oracle that never stopped (OS-6, OS-7)."""
    assert case.load is not None
    model_sd, osd, to_load = saved
    try:
        ops, model, optim = _os_run(ctx, impl, case, case.load, 1, case.target, perturb=True)
    except Unsupported as exc:
        return Refused(str(exc))
    warm_target(case, model, optim, ctx.device, _slice(ctx))
    before = non_persistent_buffers(case.model, model)
    where = f"rank {ctx.rank}, loading side ({case.load.describe()})"
    ops.load_full_state_dict(model, {k: v.to(ctx.device) for k, v in model_sd.items()})
    ops.load_optim_state_dict(model, optim, to_load)
    keys = case.model.trainable()
    assert_model_matches(case.model, to_cpu(ops.full_state_dict(model)), model_sd, what="full model state dict right after the load vs the saved one",
        where=where, check_order=False)
    assert_optimizer_matches(to_cpu(ops.optim_state_dict(model, optim)), osd, keys, what="optimizer state dict right after the load vs the saved one",
        where=where)
    assert_same_state(non_persistent_buffers(case.model, model), before, what="non-persistent buffers changed by a load", where=where)
    _continue_and_compare(
        case, ctx, model, optim, lambda: (to_cpu(ops.full_state_dict(model)), to_cpu(ops.optim_state_dict(model, optim))), where
    )
    return None


@_single_threaded
def optim_state_both(ctx: Any, impl: Any, case: Case) -> Any:
    """Save and load in one pool (the same world size); the sharded optimizer state dict is checked rank by
    rank against the full one (OS-5) and passed as is."""
    kept = optim_state_save(ctx, impl, case, keep=True)
    if isinstance(kept, Refused):
        return kept
    ops, model, optim, model_sd, full_osd = kept
    to_load = full_osd
    if case.option("optimizer state dict") != "full":
        to_load = ops.optim_state_dict(model, optim, sharded=True)
        # OS-5 on each rank: every DTensor's local shard is its piece of the full state dict's value.
        assert_local_shards(to_load, full_osd, what="sharded optimizer state dict", where=f"rank {ctx.rank}, saving side ({case.save.describe()})")
    return optim_state_load(ctx, impl, case, (model_sd, full_osd, to_load))


# -- rank bodies: checkpoint ------------------------------------------------------------------------------------


def _ml_run(ctx: Any, impl: Any, case: Case, seed: int, plan: OptimPlan, *, perturb: bool) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    ops = impl.require("checkpoint")
    sharding_plan = ShardingPlan(use_orig_params=True, device=ctx.device, mesh=ctx.mesh())
    model = impl.require("sharding").shard(build(case.model, seed, ctx.device), sharding_plan)
    optim = make_optimizer(case.optimizer, plan, [((canonical_fqn(n),), p) for n, p in model.named_parameters()], perturb=perturb)
    return ops, model, optim


def _pg(ctx: Any) -> Any:
    return ctx.group


@_single_threaded
def checkpoint_save(ctx: Any, impl: Any, case: Case, path: str) -> Any:
    """Train the sharded source next to the oracle, save its sharded model and optimizer state dicts to
    ``path``; return their full values (CPU) from rank 0."""
    ops, model, optim = _ml_run(ctx, impl, case, 0, case.source, perturb=False)
    oracle, oracle_optim = oracle_run(case, case.steps, ctx.device)
    for step in range(case.steps):
        train_step(model, optim, _slice(ctx)(batch(case.model, step, ctx.device)))
    model_sd, optim_sd = ops.get_state_dicts(model, optim)
    ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=_pg(ctx))
    full_model, full_optim = to_cpu(model_sd), to_cpu(optim_sd)
    atol, rtol = tolerance(case.model)
    where = f"rank {ctx.rank}, saving side at world size {ctx.world_size}, after {case.steps} steps"
    assert_local_shards(model_sd, to_cpu(oracle.state_dict()), what="sharded model state dict", where=where, atol=atol, rtol=rtol)
    assert_local_shards(optim_sd, to_cpu(fqn_keyed(oracle, oracle_optim)), what="sharded optimizer state dict", where=where, atol=atol, rtol=rtol)
    assert_model_matches(case.model, full_model, to_cpu(oracle.state_dict()), what="sharded model state dict vs the unwrapped model", where=where,
        atol=atol, rtol=rtol, check_order=False)
    assert_optimizer_matches(full_optim, to_cpu(fqn_keyed(oracle, oracle_optim)), case.model.trainable(),
        what="sharded optimizer state dict vs the unwrapped model", where=where, atol=atol, rtol=rtol)
    return (full_model, full_optim) if ctx.rank == 0 else None


@_single_threaded
def checkpoint_load(ctx: Any, impl: Any, case: Case, path: str, saved: tuple[dict, dict]) -> None:
    """Load the checkpoint at ``path`` into a sharded target of another seed (its optimizer in another
    order, hyperparameters perturbed, state of its own); every value equals the saved one bitwise;
    after ``case.more_steps`` more steps it matches the oracle that never stopped (ML-1, ML-8)."""
    ops, model, optim = _ml_run(ctx, impl, case, 1, case.target, perturb=True)
    warm_target(case, model, optim, ctx.device, _slice(ctx))
    before = non_persistent_buffers(case.model, model)
    model_sd, optim_sd = ops.get_state_dicts(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    ops.load(state, path, process_group=_pg(ctx))
    ops.set_state_dicts(model, optim, state["model"], state["optim"])
    where = f"rank {ctx.rank}, loading side at world size {ctx.world_size}"
    raw_model, raw_optim = ops.get_state_dicts(model, optim)
    assert_local_shards(raw_model, saved[0], what="model state right after the load", where=where)
    assert_local_shards(raw_optim, saved[1], what="optimizer state right after the load", where=where)
    got_model, got_optim = to_cpu(raw_model), to_cpu(raw_optim)
    keys = case.model.trainable()
    saved_model, saved_optim = saved
    assert_model_matches(case.model, got_model, saved_model, what="model state right after the load vs the saved one", where=where, check_order=False)
    assert_optimizer_matches(got_optim, saved_optim, keys, what="optimizer state right after the load vs the saved one", where=where)
    assert_same_state(non_persistent_buffers(case.model, model), before, what="non-persistent buffers changed by a load", where=where)
    _continue_and_compare(case, ctx, model, optim, lambda: tuple(to_cpu(sd) for sd in ops.get_state_dicts(model, optim)), where)


# -- controller-side runners: state_dict (plain models) -------------------------------------------------------


def wrap_for_state_dict(model: nn.Module, how: str) -> nn.Module:
    """``model`` as the SD tests see it: ``plain``, each direct child activation-checkpoint wrapped in
    place (``checkpoint``), or inside ``torch.compile`` (``compile``; never run, so never compiled)."""
    if how == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, child in list(model.named_children()):
            setattr(model, name, checkpoint_wrapper(child))
        return model
    if how == "compile":
        return torch.compile(model)
    return model


@_single_threaded
def state_dict_round_trip(ops: Any, case: Case) -> None:
    """SD-11 (with SD-1, SD-2 on the way): get from a model trained ``case.steps`` steps equals the
    unwrapped model's own state dicts; set into a model of another seed whose optimizer has other
    groups, another order and perturbed hyperparameters makes every get equal the saved one, bitwise;
    ``case.more_steps`` more steps then equal the run that never stopped, bitwise (one process: the
    same arithmetic)."""
    __tracebackhide__ = True
    spec, keys = case.model, case.model.trainable()
    how, flatten = case.option("wrapper"), case.option("flatten_optimizer_state_dict")
    options = ops.options(flatten_optimizer_state_dict=flatten)
    oracle, oracle_optim = oracle_run(case, case.steps)
    source, source_optim = oracle_run(case, case.steps)
    model_sd, optim_sd = ops.get_state_dict(wrap_for_state_dict(source, how), source_optim, options=options)
    assert_model_matches(spec, model_sd, oracle.state_dict(), what="get_state_dict: model state dict vs nn.Module.state_dict()", where=f"wrapper {how}")
    if not flatten:
        assert_optimizer_matches(optim_sd, fqn_keyed(oracle, oracle_optim), keys,
            what="get_state_dict: optimizer state dict vs Optimizer.state_dict() by FQN", where=f"wrapper {how}")
    saved = copy.deepcopy((model_sd, optim_sd))  # as through a file: the target must not share tensors with the source

    target = build(spec, 1)
    target_optim = make_optimizer(case.optimizer, case.target, oracle_params(target), perturb=True)
    warm_target(case, target, target_optim, "cpu")
    before = non_persistent_buffers(spec, target)
    model_in, optim_in = copy.deepcopy(saved)
    ops.set_state_dict(wrap_for_state_dict(target, how), target_optim, model_state_dict=model_in, optim_state_dict=optim_in, options=options)
    again_model, again_optim = ops.get_state_dict(target, target_optim, options=options)
    assert_model_matches(spec, again_model, saved[0], what="get after set: model state dict vs the saved one", where=f"wrapper {how}")
    if flatten:
        assert_same_state(again_optim, saved[1], what="get after set: flattened optimizer state dict vs the saved one", where=f"wrapper {how}",
            check_order=False)
    else:
        assert_optimizer_matches(again_optim, saved[1], keys, what="get after set: optimizer state dict vs the saved one", where=f"wrapper {how}")
    assert_same_state(non_persistent_buffers(spec, target), before, what="non-persistent buffers changed by set_state_dict", where=f"wrapper {how}")

    continue_alongside(case, spec, (oracle, oracle_optim), (target, target_optim))
    where = f"wrapper {how}, {case.more_steps} more step(s) after the load"
    assert_model_matches(spec, target.state_dict(), oracle.state_dict(), what="model vs the unwrapped run that never stopped", where=where)
    assert_optimizer_matches(fqn_keyed(target, target_optim), fqn_keyed(oracle, oracle_optim), keys,
        what="optimizer vs the unwrapped run that never stopped", where=where)


# -- controller-side runners: flat_param -------------------------------------------------------------------------


def _parent(path: str) -> tuple[str, str]:
    head, _, name = path.rpartition(".")
    return head, name


def wrap_flat(ops: Any, spec: ModelSpec, model: nn.Module, lists: Sequence[tuple[str, Sequence[str]]]) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """Wrap ``model`` at each path of ``lists`` (innermost first) flattening the listed key FQNs, in
    that order. Returns the model (the root wrapper when the root is wrapped) and (path, wrapper) pairs."""
    modules = {path: model.get_submodule(path) for path, _ in spec.nodes()}
    params = dict(model.named_parameters())
    wrappers = []
    root = model
    for path, keys in lists:
        wrapper = ops.wrap(modules[path], [params[k] for k in keys])
        wrappers.append((path, wrapper))
        if path:
            parent, name = _parent(path)
            setattr(modules[parent], name, wrapper)
        else:
            root = wrapper
    return root, wrappers


def flat_named_params(ops: Any, spec: ModelSpec, model: nn.Module, wrappers: Sequence[tuple[str, nn.Module]]) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Every parameter of the wrapped ``model`` with the key FQNs it stands for (a flat parameter: those
    of its parameters, in flat order)."""
    key_of = {e.fqn: e.key for e in spec.params()}
    flats: dict[int, tuple[str, ...]] = {}
    for path, wrapper in wrappers:
        flat = ops.flat_param(wrapper)
        if flat is not None:
            flats[id(flat)] = tuple(key_of[canonical_fqn(_join(path, n))] for n in ops.info(flat).names)
    out = []
    for name, param in model.named_parameters():
        out.append((flats[id(param)] if id(param) in flats else (key_of[canonical_fqn(name)],), param))
    return out


def flat_fqn_keyed(ops: Any, named: Sequence[tuple[tuple[str, ...], nn.Parameter]], optim: torch.optim.Optimizer, spec: ModelSpec) -> dict[str, Any]:
    """The wrapped model's optimizer state keyed by FQN: a flat parameter's positional state cut into
    its parameters' pieces (flat order, their shapes), its scalar state given to each."""
    shapes = {e.key: e.shape for e in spec.params()}
    fqns_of = {id(p): fqns for fqns, p in named}
    osd = optim.state_dict()
    ids = [p for g in optim.param_groups for p in g["params"]]
    state: dict[str, Any] = {}
    for pid, entry in osd["state"].items():
        param = ids[pid]
        fqns = fqns_of[id(param)]
        if len(fqns) == 1 and not ops.is_flat_param(param):
            state[fqns[0]] = entry
            continue
        offset = 0
        for fqn in fqns:
            numel = math.prod(shapes[fqn])
            state[fqn] = {
                k: (v.reshape(-1)[offset : offset + numel].reshape(shapes[fqn]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in entry.items()
            }
            offset += numel
    groups = [{**g, "params": [f for pid in g["params"] for f in fqns_of[id(ids[pid])]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


@_single_threaded
def flat_param_round_trip(ops: Any, case: Case) -> None:
    """FP-8, FP-12, FP-13 (with FP-6, FP-9 on the way): the wrapped model trains like the unwrapped one
    and shows its state dict, bitwise; its state dict loads (strict) into a model of another seed
    wrapped with another ``param_list`` order, and the optimizer state into that model's optimizer;
    ``case.more_steps`` more steps equal the run that never stopped, bitwise; the unwrapped model
    loads the wrapped one's state dict."""
    __tracebackhide__ = True
    spec, keys = case.model, case.model.trainable()
    oracle, oracle_optim = oracle_run(case, case.steps)
    source, source_wrappers = wrap_flat(ops, spec, build(spec, 0), case.option("_source_lists"))
    source_named = flat_named_params(ops, spec, source, source_wrappers)
    source_optim = make_optimizer(case.optimizer, case.source, source_named)
    for step in range(case.steps):
        train_step(source, source_optim, batch(spec, step))
    where = f"after {case.steps} steps"
    assert_model_matches(spec, source.state_dict(), oracle.state_dict(), what="wrapped state_dict() vs the unwrapped model trained identically", where=where)
    assert_optimizer_matches(flat_fqn_keyed(ops, source_named, source_optim, spec), fqn_keyed(oracle, oracle_optim), keys,
        what="flat optimizer state vs the unwrapped model's", where=where)
    saved = copy.deepcopy((source.state_dict(), source_optim.state_dict()))

    target, target_wrappers = wrap_flat(ops, spec, build(spec, 1), case.option("_target_lists"))
    target_named = flat_named_params(ops, spec, target, target_wrappers)
    target_optim = make_optimizer(case.optimizer, case.target, target_named, perturb=True)
    warm_target(case, target, target_optim, "cpu")
    before = non_persistent_buffers(spec, target)
    model_in, optim_in = copy.deepcopy(saved)
    target.load_state_dict(model_in)
    target_optim.load_state_dict(optim_in)
    where = "target wrapped with the target param_list order, right after the load"
    assert_model_matches(spec, target.state_dict(), saved[0], what="state_dict() after load_state_dict vs the saved one", where=where)
    assert_same_state(non_persistent_buffers(spec, target), before, what="non-persistent buffers changed by load_state_dict", where=where)
    continue_alongside(case, spec, (oracle, oracle_optim), (target, target_optim))
    where = f"{case.more_steps} more step(s) after the load"
    assert_model_matches(spec, target.state_dict(), oracle.state_dict(), what="model vs the unwrapped run that never stopped", where=where)
    assert_optimizer_matches(flat_fqn_keyed(ops, target_named, target_optim, spec), fqn_keyed(oracle, oracle_optim), keys,
        what="flat optimizer state vs the unwrapped run that never stopped", where=where)
    plain = build(spec, 2)
    plain.load_state_dict(target.state_dict())
    assert_model_matches(spec, plain.state_dict(), target.state_dict(), what="the unwrapped model after loading the wrapped model's state_dict()",
        where="FP-13, wrapped to unwrapped")


# -- sharded state_dict (SD-12, SD-13 with SD-11) ------------------------------------------------------------------


def sd_units(spec: ModelSpec) -> tuple[str, ...]:
    """The nested sharding units :meth:`StateDictOps.shard` makes (conformance/adapters/state_dict.py): each
    direct child of the root holding parameters, none when a parameter is tied."""
    if _max_names(spec) > 1:
        return ()
    return tuple(child.name for child in spec.root.children if any(e.fqn.startswith(child.name + ".") for e in spec.params()))


def _units_homogeneous(spec: ModelSpec, units: Sequence[str]) -> bool:
    """No unit owns frozen and trainable parameters together (flat-parameter sharding refuses that)."""
    kinds: dict[str, set[bool]] = {}
    for entry in spec.params():
        kinds.setdefault(_owner(entry.owner, units), set()).add(entry.frozen)
    return all(len(k) == 1 for k in kinds.values())


@st.composite
def _sharded_state_dict_case(draw: Any, world_sizes: Sequence[int], reorder_groups: bool) -> Case:
    groups = draw(_pick(1, 3), label="param groups")
    spec = draw(model_specs())
    units = sd_units(spec)
    assume(_units_homogeneous(spec, units))
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


#: The strategies the SD tests ask :meth:`StateDictOps.shard` for.
SD_STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def sharded_state_dict_cases(world_sizes: Sequence[int], excluded: Sequence[CaseFamily] = ()) -> st.SearchStrategy[Case]:
    """SD-12/SD-13: get from a sharded model, set into another seed's sharded model (another strategy
    when the state dicts are full), at one world size. Groups split at unit granularity (flat parameters),
    reordered in the target unless ``reordered-groups`` is excluded. Cases of the ``excluded`` families
    are not drawn."""
    reorder_groups = "reordered-groups" not in _names(excluded)
    return _without(_sharded_state_dict_case(usable_world_sizes(world_sizes), reorder_groups), SHARDED_STATE_DICT_TEST, excluded)


def sd_named_params(spec: ModelSpec, units: Sequence[str], model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Parameters of a model sharded by :meth:`StateDictOps.shard` with the key FQNs each stands for: a
    flat parameter (``<unit>._flat_param``) stands for the trainable keys its unit owns."""
    keys = {e.key for e in spec.params()}
    owned: dict[str, list[str]] = {}
    for entry in spec.params():
        if entry.fqn == entry.key:
            owned.setdefault(_owner(entry.owner, units), []).append(entry.key)
    out = []
    for name, param in model.named_parameters():
        clean = canonical_fqn(name)
        if clean in keys:
            out.append(((clean,), param))
        else:
            unit = clean.rpartition(".")[0]
            out.append((tuple(owned.get(unit, ())), param))
    return out


def _sd_shard(impl: Any, case: Case, sharding: Sharding, seed: int, device: torch.device) -> nn.Module:
    """The SD tests' sharding (see conformance.test_state_dict.sd_shard); Unsupported if the adapter lacks it."""
    model = build(case.model, seed, device)
    return impl.sharding().shard(model, ShardingPlan(strategy=sharding.strategy, units=child_units(model), device=device))


@_single_threaded
def sharded_state_dict_round_trip(ctx: Any, impl: Any, case: Case) -> Any:
    """SD-12/SD-13 (and SD-11 on sharded models): get_state_dict of a sharded model trained next to the
    unwrapped one equals it (within the tolerance of averaged gradients); set into a sharded model of
    another seed (optimizer reordered, perturbed, with state of its own) gives back the saved values
    bitwise; training on matches the run that never stopped."""
    assert case.save is not None and case.load is not None
    ops = impl.require("state_dict")
    full = case.option("state dicts", "").startswith("full")
    options = ops.options(full_state_dict=full)
    full_options = ops.options(full_state_dict=True)
    spec, keys = case.model, case.model.trainable()
    try:
        source = _sd_shard(impl, case, case.save, 0, ctx.device)
        target = _sd_shard(impl, case, case.load, 1, ctx.device)
    except Unsupported as exc:
        return Refused(str(exc))
    optim = make_optimizer(case.optimizer, case.source, sd_named_params(spec, case.save.units, source))
    oracle = build(spec, 0, ctx.device)
    oracle_optim = make_optimizer(case.optimizer, case.source, oracle_params(oracle))
    for step in range(case.steps):
        x = batch(spec, step, ctx.device)
        train_step(oracle, oracle_optim, x)
        train_step(source, optim, _slice(ctx)(x))
    atol, rtol = tolerance(spec)
    where = f"rank {ctx.rank}, world size {ctx.world_size}, source {case.save.strategy}, after {case.steps} steps"
    model_sd, optim_sd = ops.get_state_dict(source, optim, options=options)
    oracle_osd = to_cpu(fqn_keyed(oracle, oracle_optim))
    assert_local_shards(model_sd, to_cpu(oracle.state_dict()), what="get_state_dict: model", where=where, atol=atol, rtol=rtol)
    assert_local_shards(optim_sd, oracle_osd, what="get_state_dict: optimizer", where=where, atol=atol, rtol=rtol)
    saved = (to_cpu(model_sd), to_cpu(optim_sd))
    assert_model_matches(spec, saved[0], to_cpu(oracle.state_dict()), what="get_state_dict: model vs the unwrapped model", where=where, atol=atol,
        rtol=rtol, check_order=False)
    assert_optimizer_matches(saved[1], oracle_osd, keys, what="get_state_dict: optimizer vs the unwrapped model", where=where, atol=atol, rtol=rtol)

    target_optim = make_optimizer(case.optimizer, case.target, sd_named_params(spec, case.load.units, target), perturb=True)
    warm_target(case, target, target_optim, ctx.device, _slice(ctx))
    before = non_persistent_buffers(spec, target)
    ops.set_state_dict(target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    where = f"rank {ctx.rank}, world size {ctx.world_size}, target {case.load.strategy}, right after set_state_dict"
    again_raw = ops.get_state_dict(target, target_optim, options=options)
    assert_local_shards(again_raw[0], saved[0], what="get after set: model", where=where)
    assert_local_shards(again_raw[1], saved[1], what="get after set: optimizer", where=where)
    again = [to_cpu(sd) for sd in again_raw]
    assert_model_matches(spec, again[0], saved[0], what="get after set: model vs the saved one", where=where, check_order=False)
    assert_optimizer_matches(again[1], saved[1], keys, what="get after set: optimizer vs the saved one", where=where)
    assert_same_state(non_persistent_buffers(spec, target), before, what="non-persistent buffers changed by set_state_dict", where=where)
    continue_alongside(case, spec, (oracle, oracle_optim), (target, target_optim), ctx.device, _slice(ctx))
    where = f"rank {ctx.rank}, world size {ctx.world_size}, target {case.load.strategy}, {case.more_steps} more step(s)"
    got = [to_cpu(sd) for sd in ops.get_state_dict(target, target_optim, options=full_options)]
    assert_model_matches(spec, got[0], to_cpu(oracle.state_dict()), what="model vs the unwrapped run that never stopped", where=where, atol=atol,
        rtol=rtol, check_order=False)
    assert_optimizer_matches(got[1], to_cpu(fqn_keyed(oracle, oracle_optim)), keys, what="optimizer vs the unwrapped run that never stopped",
        where=where, atol=atol, rtol=rtol)
    return None
