"""Canonical FQNs: the names a model's state lives under once wrapper segments are removed.

A *canonical FQN* (clean FQN) names a parameter or buffer by its place in the module tree of the
model as the user wrote it: ``layers.1.attn.weight``. Wrappers insert segments of their own:

==============================================  =================================
wrapper                                         segment it inserts
==============================================  =================================
``DistributedDataParallel``                     ``module``
``torch.compile`` (``OptimizedModule``)         ``_orig_mod``
activation checkpointing (``ActivationWrapper``)  ``_checkpoint_wrapped_module``
torch ``FullyShardedDataParallel`` (FSDP1)      ``_fsdp_wrapped_module``
reference ``FullyShardedDataParallel``          ``_fsdp_wrapped_module``
reference ``FlattenParamsWrapper``              ``_fpw_module``
==============================================  =================================

Some wrappers remove their segment from ``state_dict()`` keys themselves (activation
checkpointing, FlattenParamsWrapper) and some do not (DDP, compile), so a raw key may spell each
wrapper segment or leave it out. :class:`FQNResolver` accepts both spellings: a wrapper segment is
*optional* in a raw path. A wrapper that is not registered but hides its segment from its keys and
forwards attribute access to the module it wraps is seen through as well: a segment that is no child
of a module is looked up as its attribute, as torch's ``get_state_dict`` does.

Cost. Resolving is memoized per module path, and a path is resolved from its parent's resolution in
O(1) (plus the length of a wrapper chain), so resolving every key of a state dict costs O(number of
keys + number of modules), whatever the number of selected submodules. This is the contract the
submodule filter of :mod:`reference.state_dict` relies on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "ResolvedPath",
    "FQNResolver",
    "register_wrapper",
    "wrapped_child_attr",
    "join_fqn",
]

# Wrapper class -> the attribute holding the wrapped module (the segment the wrapper inserts).
# Filled lazily by _builtin_wrappers(); extended by register_wrapper().
_WRAPPERS: dict[type, str] = {}
_BUILTINS_LOADED = False


def register_wrapper(cls: type, attr: str) -> None:
    """Declare that instances of ``cls`` hold the module they wrap in ``attr``, a segment that is not
    part of canonical FQNs. Implementations under test that bring their own wrapper call this."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_wrapper: expected an nn.Module subclass, got {cls!r}")
    if not attr or "." in attr:
        raise ValueError(f"register_wrapper: the wrapped-module attribute must be one segment, got {attr!r}")
    _WRAPPERS[cls] = attr


def _builtin_wrappers() -> dict[type, str]:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return _WRAPPERS
    # torch.compile returns an OptimizedModule; it has no public import path, so the class is taken
    # from torch._dynamo (the same one torch.distributed.checkpoint.state_dict uses).
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.nn.parallel import DistributedDataParallel

    _WRAPPERS.setdefault(DistributedDataParallel, "module")
    _WRAPPERS.setdefault(OptimizedModule, "_orig_mod")
    # ActivationWrapper covers CheckpointWrapper and OffloadWrapper; it is the class that
    # torch.distributed.algorithms.checkpoint_wrapper's public functions return.
    _WRAPPERS.setdefault(ActivationWrapper, "_checkpoint_wrapped_module")
    _WRAPPERS.setdefault(TorchFSDP, "_fsdp_wrapped_module")
    # The reference wrappers register themselves when their modules are imported (this module
    # imports none of them): a model can only hold one after its module was imported.
    _BUILTINS_LOADED = True
    return _WRAPPERS


def wrapped_child_attr(module: nn.Module) -> str | None:
    """The segment ``module`` inserts as a wrapper (``"module"`` for DDP), or None if it is no wrapper."""
    for cls, attr in _builtin_wrappers().items():
        if isinstance(module, cls):
            return attr
    return None


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` when ``prefix`` is the root (empty)."""
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class ResolvedPath:
    """Where a raw module path (as spelled in a state dict key, wrapper segments optional) leads.

    ``fqn`` is the canonical path of the module ("" for the root). ``selected`` holds the canonical
    paths of the selected submodules this module lies in (itself included), outermost first."""

    fqn: str
    module: nn.Module
    selected: tuple[str, ...] = ()


@dataclass
class FQNResolver:
    """Maps raw module paths and raw state-dict keys of ``root`` to canonical FQNs.

    ``selected`` (optional) is a set of submodules; every resolution also says which of them the
    path lies in. A selected module is matched by identity, whether the caller passed a wrapper or the
    module it wraps (both have the same canonical path)."""

    root: nn.Module
    selected: frozenset[int] = field(default_factory=frozenset)  # ids of selected modules
    _memo: dict[str, ResolvedPath | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._memo[""] = ResolvedPath("", self.root, self._mark(self.root, "", ()))

    # -- the walk ----------------------------------------------------------------------------------

    def _mark(self, module: nn.Module, fqn: str, selected: tuple[str, ...]) -> tuple[str, ...]:
        """``selected`` plus ``fqn`` if ``module`` or a module it wraps (at any depth) is selected.
        A wrapper and the module it wraps share one canonical path, so either counts."""
        if not self.selected:
            return selected
        node: nn.Module | None = module
        while node is not None:
            if id(node) in self.selected:
                if not selected or selected[-1] != fqn:
                    selected = selected + (fqn,)
            attr = wrapped_child_attr(node)
            node = getattr(node, attr) if attr is not None else None
        return selected

    def resolve(self, raw_path: str) -> ResolvedPath | None:
        """The module a raw module path names, or None if it names none. Memoized: O(1) amortized."""
        hit = self._memo.get(raw_path, self)
        if hit is not self:
            return hit  # type: ignore[return-value]
        parent_path, _, segment = raw_path.rpartition(".")
        parent = self.resolve(parent_path)
        result = self._step(parent, segment) if parent is not None else None
        self._memo[raw_path] = result
        return result

    def _step(self, parent: ResolvedPath, segment: str) -> ResolvedPath | None:
        """One segment below ``parent``. ``parent.module`` may be a wrapper: the segment is then
        either the wrapper's own (spelled out, as DDP's ``module``) or a child of a module further
        down the wrapper chain (the wrapper segments left out, as checkpoint wrappers do)."""
        module = parent.module
        while True:
            attr = wrapped_child_attr(module)
            if attr is not None and attr == segment:
                # A wrapper segment: same canonical path, one module further down.
                return ResolvedPath(parent.fqn, getattr(module, attr), parent.selected)
            child = module._modules.get(segment)
            if child is not None:
                fqn = join_fqn(parent.fqn, segment)
                return ResolvedPath(fqn, child, self._mark(child, fqn, parent.selected))
            if attr is None:
                return self._forwarded(parent, module, segment)
            module = getattr(module, attr)

    def _forwarded(self, parent: ResolvedPath, module: nn.Module, segment: str) -> ResolvedPath | None:
        """``segment`` as an attribute of ``module`` that is a module but not a child: a wrapper nobody
        registered that hides its own segment from its keys (state_dict hooks) and forwards attribute
        access to the module it wraps, as fairscale's and many trainers' wrappers do. torch's
        ``get_state_dict`` finds such modules by ``getattr``; so does this, so they need no registration."""
        try:
            forwarded = getattr(module, segment)
        except AttributeError:
            return None
        if not isinstance(forwarded, nn.Module):
            return None
        fqn = join_fqn(parent.fqn, segment)
        return ResolvedPath(fqn, forwarded, self._mark(forwarded, fqn, parent.selected))

    # -- keys ----------------------------------------------------------------------------------------

    def resolve_key(self, raw_key: str) -> tuple[str, ResolvedPath] | None:
        """``(canonical FQN, owning module's resolution)`` of a state-dict key, or None."""
        prefix, _, leaf = raw_key.rpartition(".")
        owner = self.resolve(prefix)
        if owner is None:
            return None
        return join_fqn(owner.fqn, leaf), owner

    def clean_path(self, raw_path: str) -> str:
        """The canonical path of the module at ``raw_path``; a path that names no module is an error."""
        resolved = self.resolve(raw_path)
        if resolved is None:
            raise RuntimeError(f"{raw_path!r} names no module of {type(self.root).__name__}")
        return resolved.fqn

    def clean_key(self, raw_key: str) -> str:
        """The canonical FQN of ``raw_key``; a key that names no module of the model is an error."""
        resolved = self.resolve_key(raw_key)
        if resolved is None:
            raise RuntimeError(
                f"state dict key {raw_key!r} does not name a parameter or buffer of "
                f"{type(self.root).__name__}: no module at {raw_key.rpartition('.')[0]!r}"
            )
        return resolved[0]


def submodule_paths(root: nn.Module, submodules: Iterable[nn.Module]) -> dict[int, set[str]]:
    """Canonical path(s) of each of ``submodules`` in ``root``, found in one walk of the module tree.

    A module reachable at several paths (shared between two parents) has several. A module that is
    not part of ``root`` is a ``ValueError`` naming its type."""
    wanted = {id(m): m for m in submodules}
    resolver = FQNResolver(root, frozenset(wanted))
    found: dict[int, set[str]] = {}
    # One walk: named_modules with duplicates gives every raw path of every module.
    for raw_path, module in root.named_modules(remove_duplicate=False):
        if id(module) in wanted:
            resolved = resolver.resolve(raw_path)
            if resolved is not None:
                found.setdefault(id(module), set()).add(resolved.fqn)
    missing = [m for key, m in wanted.items() if key not in found]
    if missing:
        names = ", ".join(f"{type(m).__name__} at 0x{id(m):x}" for m in missing)
        raise ValueError(f"submodules: {names} is not a submodule of {type(root).__name__}")
    return found


def named_parameter_fqns(root: nn.Module, resolver: FQNResolver | None = None) -> dict[torch.Tensor, list[str]]:
    """Every parameter of ``root`` -> its canonical FQNs in ``named_parameters`` order (tied ones
    have several; the first is the one optimizer state dicts use)."""
    resolver = resolver or FQNResolver(root)
    out: dict[torch.Tensor, list[str]] = {}
    for raw, param in root.named_parameters(remove_duplicate=False):
        fqn = resolver.clean_key(raw)
        names = out.setdefault(param, [])
        if fqn not in names:
            names.append(fqn)
    return out


