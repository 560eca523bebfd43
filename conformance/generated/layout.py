"""Which parameters of a :class:`~conformance.generated.specs.ModelSpec` end up together: sharding
units, FlattenParamsWrapper lists, and the *atoms* (sets of key FQNs that must share a param group,
because one flat parameter stands for them all).

Pure functions of the spec: no tensors, no hypothesis. A *unit* is a module path that is a nested
sharding unit (or a wrapper); the root ("") always is one, and owns what no other unit does.
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.generated.specs import Linear, ModelSpec, Module, Sharding, join_path

__all__ = [
    "is_below",
    "tie_spans",
    "owner_unit",
    "max_names",
    "fix_units",
    "unit_candidates",
    "param_atoms",
    "join_atoms",
    "flat_atoms",
    "wrapper_lists",
    "fp_atoms",
    "sd_units",
    "units_homogeneous",
]


def is_below(path: str, ancestor: str) -> bool:
    """``path`` lies strictly below ``ancestor`` ("" is the root)."""
    return path != ancestor and (ancestor == "" or path.startswith(ancestor + "."))


def tie_spans(spec: ModelSpec) -> list[tuple[str, str]]:
    """(holder, source leaf) of each tie, as full paths."""
    return [(holder, join_path(holder, tie.source)) for holder, node in spec.nodes() if isinstance(node, Module) for tie in node.ties]


def owner_unit(path: str, units: Sequence[str]) -> str:
    """The unit (nearest ancestor-or-self in ``units``, else the root "") owning what ``path`` registers."""
    best = ""
    for unit in units:
        if (path == unit or is_below(path, unit)) and len(unit) > len(best):
            best = unit
    return best


def max_names(spec: ModelSpec) -> int:
    """The most FQNs any one Parameter is registered under (1 without ties; 0 for no parameters)."""
    counts: dict[str, int] = {}
    for entry in spec.params():
        counts[entry.key] = counts.get(entry.key, 0) + 1
    return max(counts.values(), default=0)


def fix_units(spec: ModelSpec, units: Sequence[str], *, flat: bool) -> tuple[str, ...]:
    """Make drawn nested units valid: no unit separates the two registrations of a tied parameter, and
    with flat parameters (``flat``) no unit owns frozen and trainable parameters together (each frozen
    Linear it owns becomes a unit of its own)."""
    kept = [u for u in units if not any(is_below(u, holder) and (leaf == u or is_below(leaf, u)) for holder, leaf in tie_spans(spec))]
    if flat:
        owned: dict[str, set[bool]] = {}
        for entry in spec.params():
            owned.setdefault(owner_unit(entry.owner, kept), set()).add(entry.frozen)
        for unit, kinds in owned.items():
            if len(kinds) > 1:
                kept += [leaf for leaf, lin in spec.leaves() if lin.frozen and owner_unit(leaf, kept) == unit and leaf not in kept]
    order = [p for p, _ in spec.nodes()]
    return tuple(sorted(set(kept), key=order.index))


def unit_candidates(spec: ModelSpec) -> list[str]:
    """Module paths (not the root) that may become units: Linear leaves and modules holding parameters."""
    return [path for path, node in spec.nodes() if path and (isinstance(node, Linear) or any(e.fqn.startswith(path + ".") for e in spec.params()))]


def param_atoms(spec: ModelSpec) -> list[list[str]]:
    """One atom per trainable key FQN (nothing is flattened)."""
    return [[fqn] for fqn in spec.trainable()]


def join_atoms(spec: ModelSpec, *partitions: Sequence[Sequence[str]]) -> list[list[str]]:
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


def flat_atoms(spec: ModelSpec, sharding: Sharding) -> list[list[str]]:
    """Trainable key FQNs grouped as an optimizer sees them: one flat parameter per unit
    (``use_orig_params=False``), else one entry per parameter."""
    if sharding.use_orig_params:
        return param_atoms(spec)
    by_unit: dict[str, list[str]] = {}
    for entry in spec.params():
        if not entry.frozen and entry.fqn == entry.key:
            by_unit.setdefault(owner_unit(entry.owner, sharding.units), []).append(entry.key)
    return list(by_unit.values())


def wrapper_lists(spec: ModelSpec, wrappers: Sequence[str]) -> dict[str, list[str]]:
    """Per wrapper path (innermost first), the key FQNs it flattens: the parameters registered in its
    subtree outside nested wrappers, the trainable ones if it has any, else the frozen ones."""
    out: dict[str, list[str]] = {}
    entries = spec.params()
    for wrapper in sorted(wrappers, key=lambda w: -len(w.split("."))):
        mine = [e for e in entries if owner_unit(e.owner, wrappers) == wrapper and e.fqn == e.key]
        trainable = [e.key for e in mine if not e.frozen]
        out[wrapper] = trainable or [e.key for e in mine]
    return out


def fp_atoms(spec: ModelSpec, wrappers: Sequence[str]) -> list[list[str]]:
    """The atoms of a model wrapped at ``wrappers``: each wrapper's trainable flat parameter, and each
    trainable parameter no wrapper flattens."""
    flattened = {w: keys for w, keys in wrapper_lists(spec, wrappers).items() if keys}
    in_flat = {k for keys in flattened.values() for k in keys}
    atoms = [keys for keys in flattened.values() if not any(k not in spec.trainable() for k in keys)]
    return atoms + [[k] for k in spec.trainable() if k not in in_flat]


def sd_units(spec: ModelSpec) -> tuple[str, ...]:
    """The nested sharding units :meth:`StateDictOps.shard` makes (conformance/adapters/state_dict.py): each
    direct child of the root holding parameters, none when a parameter is tied."""
    if max_names(spec) > 1:
        return ()
    return tuple(child.name for child in spec.root.children if any(e.fqn.startswith(child.name + ".") for e in spec.params()))


def units_homogeneous(spec: ModelSpec, units: Sequence[str]) -> bool:
    """No unit owns frozen and trainable parameters together (flat-parameter sharding refuses that)."""
    kinds: dict[str, set[bool]] = {}
    for entry in spec.params():
        kinds.setdefault(owner_unit(entry.owner, units), set()).add(entry.frozen)
    return all(len(k) == 1 for k in kinds.values())
