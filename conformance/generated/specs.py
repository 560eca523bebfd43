"""The description of a generated case: frozen values that say everything one example does.

A :class:`ModelSpec` is a model tree (:class:`Module` nodes with :class:`Linear` leaves, :class:`Tie`
registrations and :class:`Buffer` s), an :class:`OptimPlan` the optimizer's param groups and
parameter order, a :class:`Sharding` one side of a sharded run, and a :class:`Case` all of it for one
example. Their ``repr`` reads as the model (hypothesis prints it for a shrunk failure). Nothing here
builds a tensor: :mod:`conformance.generated.builders` makes models and optimizers from these.

Vocabulary: a *path* is a module's dotted name in the tree ("" is the root); an *FQN* is a
parameter's or buffer's name as ``named_parameters(remove_duplicate=False)`` yields it; a *key FQN*
is the first FQN of a Parameter (what the optimizer state is keyed by when a parameter is tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "NAMES",
    "PARAM_DTYPES",
    "OPTIMIZERS",
    "STRATEGIES",
    "GLOBAL_BATCH",
    "torch_dtype",
    "join_path",
    "Buffer",
    "Linear",
    "Tie",
    "Module",
    "Node",
    "ParamEntry",
    "ModelSpec",
    "OptimPlan",
    "Sharding",
    "Case",
]

#: Module, buffer and tie names: digits and letters that are prefixes of one another.
NAMES: tuple[str, ...] = ("1", "10", "a", "ab", "0", "11", "b", "abc")
PARAM_DTYPES: tuple[str, ...] = ("float32", "float64")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
#: Rows of every global batch: each rank trains on its equal slice (world sizes that divide it).
GLOBAL_BATCH = 24


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype spelled ``name`` (``"float32"`` -> ``torch.float32``)."""
    return getattr(torch, name)


def join_path(prefix: str, name: str) -> str:
    """``name`` below the module path ``prefix`` ("" is the root)."""
    return f"{prefix}.{name}" if prefix else name


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
    """A model tree; :func:`conformance.generated.builders.build` makes it. Parameters are ``dtype``
    (one dtype per model, so flat parameters are uniform)."""

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
                    walk(join_path(prefix, child.name), child)

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
                    raw.append((join_path(path, tie.name), join_path(path, tie.source), path, "weight"))
            else:
                raw.append((join_path(path, "weight"), path, path, "weight"))
                if node.bias:
                    raw.append((join_path(path, "bias"), path, path, "bias"))
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
        return [(join_path(p, b.name), b) for p, n in self.nodes() if isinstance(n, Module) for b in n.buffers]

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

    def _ordered(self, group: tuple[str, ...]) -> list[str]:
        rank = {fqn: i for i, fqn in enumerate(self.order)}
        return sorted(group, key=lambda f: rank.get(f, len(rank)))


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


@dataclass(frozen=True)
class Case:
    """One generated example: a model, its optimizer plans, how many steps, and per capability the rest.

    ``save``/``load``: the sharding of each side (None for the single-process capabilities).
    ``options``: (name, value) pairs of the capability (a wrapper, which state dicts); names starting
    with ``_`` hold the same plan in the form a rank body takes and are not printed."""

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
