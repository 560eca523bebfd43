"""get/set state_dict of a model and its optimizers, keyed by canonical FQNs, with submodule selection.

The reference of ``torch.distributed.checkpoint.state_dict``: the same public names, signatures and
options, on plain models, on models wrapped in DDP / ``torch.compile`` / activation checkpointing /
FlattenParamsWrapper, and on models sharded by the reference ``FullyShardedDataParallel``.

Contracts (see ``conformance/SPEC.md``, SD-*):

* Keys are always canonical FQNs (:mod:`reference.fqn`): no wrapper segment ever shows.
* ``submodules={m, ...}`` keeps the entries of the model state dict that lie in one of those
  modules; a prefix matches only at a ``.`` boundary (``1`` does not select ``10``). With
  ``keep_submodule_prefixes=False`` the module's path is stripped, and two entries that would collide
  are a ``ValueError`` naming both. The filter costs O(number of keys + number of modules).
* ``set_model_state_dict`` accepts a dict keyed by FQN or keyed by submodule
  (``{m: state_dict_relative_to_m}``). A load is checked completely before anything is changed: with
  ``strict=True`` a missing or unexpected key is a ``RuntimeError`` naming it and the model is left as
  it was; a shape mismatch is always such an error. For a submodule-keyed dict, ``strict`` applies to
  the keys of those submodules; the rest of the model is left untouched and reported as missing.
* Which ranks call: every function is collective when the model is sharded or has DTensor
  parameters, or when ``broadcast_from_rank0`` is set: call it on every rank of the process group, in
  the same order. On a plain model without ``broadcast_from_rank0`` each rank may call it alone.
* Errors of a collective call are agreed on (:mod:`reference.comm`): when one rank's input is wrong,
  every rank raises the same exception, naming that rank, before any rank gathers or changes anything.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference import comm
from reference.fqn import FQNResolver, join_fqn, submodule_paths
from reference.state_dict import backend as _backend
from reference.state_dict import optim_fqn as _optim
from reference.state_dict.options import IncompatibleKeys, StateDictOptions

__all__ = [
    "StateDictOptions",
    "IncompatibleKeys",
    "get_state_dict",
    "set_state_dict",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
]

ValueType = Any
ModelStateDict = dict[str, ValueType]
OptimizerStateDict = dict[str, ValueType]
ModuleKeyedStateDict = Mapping[nn.Module, Mapping[str, ValueType]]
Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]

#: The key suffix under which nn.Module stores get_extra_state(): its value may be any object.
_EXTRA_STATE_SUFFIX = "_extra_state"
#: How many keys an error message lists before it says "and N more".
_MAX_KEYS_IN_MESSAGE = 10


# ---------------------------------------------------------------------------------------------------
# helpers


def _is_extra_state(fqn: str) -> bool:
    """Whether ``fqn`` is a module's extra-state entry (its last segment, not merely a suffix of it)."""
    return fqn.rpartition(".")[2] == _EXTRA_STATE_SUFFIX


def _name_keys(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_IN_MESSAGE])
    more = len(keys) - _MAX_KEYS_IN_MESSAGE
    return shown + (f" and {more} more" if more > 0 else "")


def _as_optimizers(optimizers: Optimizers | None) -> tuple[torch.optim.Optimizer, ...]:
    if optimizers is None:
        return ()
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    optims = tuple(optimizers)
    for i, optim in enumerate(optims):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{i}]: expected a torch.optim.Optimizer, got {type(optim).__name__}")
    return optims


def _some_optimizers(optimizers: Optimizers, caller: str) -> tuple[torch.optim.Optimizer, ...]:
    optims = _as_optimizers(optimizers)
    if not optims:
        raise ValueError(f"{caller}: no optimizer given")
    return optims


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    # Building dicts of many tensors triggers the cyclic GC over and over for nothing (torch does the same).
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_submodules(model: nn.Module, submodules: Iterable[nn.Module] | None) -> frozenset[int]:
    if submodules is None:
        return frozenset()
    subs = list(submodules)
    for m in subs:
        if not isinstance(m, nn.Module):
            raise TypeError(f"submodules: expected nn.Module entries, got {type(m).__name__}")
    submodule_paths(model, subs)  # raises ValueError naming any that is not part of the model
    return frozenset(id(m) for m in subs)


# ---------------------------------------------------------------------------------------------------
# model state dict: get


def _select(
    raw: Mapping[str, ValueType],
    resolver: FQNResolver,
    *,
    frozen: set[str],
    selecting: bool,
    keep_prefixes: bool,
) -> ModelStateDict:
    """Clean, filter and (optionally) strip the keys of ``raw`` in one pass: O(len(raw))."""
    out: ModelStateDict = {}
    origin: dict[str, str] = {}  # output key -> the canonical FQN it came from

    def put(key: str, fqn: str, value: ValueType) -> None:
        # Invariant: one output key comes from one canonical FQN.
        previous = origin.get(key)
        if previous is not None and previous != fqn:
            raise ValueError(
                f"keep_submodule_prefixes=False makes {previous!r} and {fqn!r} both {key!r}; "
                "select submodules whose entries do not collide, or keep the prefixes"
            )
        origin[key] = fqn
        out[key] = value

    for raw_key, value in raw.items():
        resolved = resolver.resolve_key(raw_key)
        if resolved is None:
            resolver.clean_key(raw_key)  # raises the error that names the key
        assert resolved is not None, f"clean_key accepted {raw_key!r}, which resolve_key could not resolve"
        fqn, owner = resolved
        if fqn in frozen:
            continue
        if not selecting:
            put(fqn, fqn, value)
        elif keep_prefixes:
            if owner.selected:
                put(fqn, fqn, value)
        else:
            # A key in nested selected modules (``a`` and ``a.b``) appears once per module, stripped
            # of that module's path, as torch does.
            for prefix in owner.selected:
                put(fqn[len(prefix) + 1 :] if prefix else fqn, fqn, value)
    return out


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> ModelStateDict:
    """The model state dict of ``model``, keyed by canonical FQN. See :func:`get_state_dict`."""
    options = options or StateDictOptions()
    with _gc_paused():
        backend = _backend.for_model(model)
        # Agreed: a rank whose selection is wrong must not leave the others in the gathers below.
        selected = comm.agree(_backend.collective_group(model, backend, False), lambda: _check_submodules(model, submodules))
        resolver = FQNResolver(model, selected)
        frozen = backend.frozen_fqns(model, resolver) if options.ignore_frozen_params else set()
        raw = backend.model_state_dict(model, options)
        sd = _select(
            raw,
            resolver,
            frozen=frozen,
            selecting=submodules is not None,
            keep_prefixes=options.keep_submodule_prefixes,
        )
        return backend.finish(sd, options)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> OptimizerStateDict:
    """The combined state dict of ``optimizers``, keyed by the canonical FQN of each parameter.

    ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}, ...]}``, the groups of the
    optimizers in order; flat if ``flatten_optimizer_state_dict``. A parameter tied under several FQNs
    is keyed by the first one ``named_parameters`` gives. An optimizer that has no state yet is
    initialised first by a step with zero gradients and zero learning rate (torch does the same), so
    that every trainable parameter has its state entries. ``submodules`` is accepted for symmetry with
    :func:`get_state_dict` and does not filter optimizer state (as in torch)."""
    options = options or StateDictOptions()
    with _gc_paused():
        backend = _backend.for_model(model)

        def check() -> tuple[torch.optim.Optimizer, ...]:
            _check_submodules(model, submodules)
            return _some_optimizers(optimizers, "get_optimizer_state_dict")

        optims = comm.agree(_backend.collective_group(model, backend, False), check)
        osd = backend.optim_state_dict(model, optims, options)
        if options.flatten_optimizer_state_dict and osd:  # {} on ranks > 0 with full + cpu_offload
            osd = _optim.flatten(osd)
        return backend.finish(osd, options)


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[ModelStateDict, OptimizerStateDict]:
    """``(model state dict, optimizer state dict)`` of ``model`` and ``optimizers`` (may be empty).

    Both are keyed by canonical FQNs. ``submodules`` keeps only the model entries that lie in one of
    those modules (see the module docstring; an empty set selects nothing, None selects everything).
    ``options`` as in :class:`StateDictOptions`."""
    options = options or StateDictOptions()
    model_sd = get_model_state_dict(model, submodules=submodules, options=options)
    optims = _as_optimizers(optimizers)
    optim_sd = get_optimizer_state_dict(model, optims, options=options) if optims else {}
    return model_sd, optim_sd


# ---------------------------------------------------------------------------------------------------
# model state dict: set


def _unflatten_module_keyed(
    model: nn.Module, state_dict: Mapping[Any, Any]
) -> tuple[ModelStateDict, frozenset[int] | None]:
    """``(FQN-keyed dict, ids of the submodules it was keyed by, or None if it was FQN-keyed)``."""
    keys = list(state_dict)
    module_keys = [k for k in keys if isinstance(k, nn.Module)]
    if not module_keys:
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"model state dict: keys must be str FQNs or submodules, got {type(k).__name__} {k!r}")
        return dict(state_dict), None
    if len(module_keys) != len(keys):
        raise TypeError("model state dict: keys are either all FQNs (str) or all submodules, not a mix")
    paths = submodule_paths(model, module_keys)  # ValueError for a module not in the model
    flat: ModelStateDict = {}
    origin: dict[str, nn.Module] = {}
    for module in module_keys:
        (prefix, *others) = sorted(paths[id(module)])
        if others:
            raise ValueError(
                f"model state dict: submodule {type(module).__name__} is reachable at {sorted(paths[id(module)])}; "
                "key its entries by FQN instead"
            )
        for sub_key, value in state_dict[module].items():
            fqn = join_fqn(prefix, sub_key)
            if fqn in origin:
                raise ValueError(f"model state dict: {fqn!r} is given twice (under two submodule keys)")
            origin[fqn] = module
            flat[fqn] = value
    return flat, frozenset(id(m) for m in module_keys)


@dataclass
class _ModelLoad:
    """A validated model load: what to hand the backend, and what to report."""

    raw: dict[str, ValueType]  # backend key -> value
    missing: list[str]
    unexpected: list[str]


def _plan_model_load(
    model: nn.Module,
    state_dict: ModelStateDict,
    scope: frozenset[int] | None,
    options: StateDictOptions,
    backend: _backend.ModelBackend,
) -> _ModelLoad:
    """Check ``state_dict`` against the model completely; raise before anything is changed."""
    resolver = FQNResolver(model, scope or frozenset())
    local = backend.local_state(model)  # backend key -> current value
    expected: dict[str, str] = {}  # canonical FQN -> backend key
    in_scope: set[str] = set()
    for key in local:
        resolved = resolver.resolve_key(key)
        if resolved is None:
            raise RuntimeError(f"model key {key!r} names no module of {type(model).__name__}")
        fqn, owner = resolved
        expected[fqn] = key
        if scope is None or owner.selected:
            in_scope.add(fqn)
    frozen = backend.frozen_fqns(model, resolver) if options.ignore_frozen_params else set()

    for fqn, value in state_dict.items():
        if not isinstance(value, torch.Tensor) and not _is_extra_state(fqn):
            raise TypeError(f"model state dict: {fqn!r} must be a tensor, got {type(value).__name__}")

    unexpected = [fqn for fqn in state_dict if fqn not in expected]
    missing_in_scope = [fqn for fqn in expected if fqn in in_scope and fqn not in frozen and fqn not in state_dict]
    if options.strict and not state_dict and scope is None and missing_in_scope:
        raise RuntimeError(
            f"model state dict is empty but strict=True and {type(model).__name__} has "
            f"{len(missing_in_scope)} entries, e.g. {_name_keys(missing_in_scope[:3])}; nothing was loaded"
        )
    if options.strict and (missing_in_scope or unexpected):
        parts = []
        if missing_in_scope:
            parts.append(f"missing key(s) {_name_keys(missing_in_scope)}")
        if unexpected:
            parts.append(f"unexpected key(s) {_name_keys(unexpected)}")
        raise RuntimeError(f"strict load into {type(model).__name__}: {'; '.join(parts)}; nothing was loaded")

    mismatched = []
    for fqn, value in state_dict.items():
        model_key = expected.get(fqn)
        # An extra state is opaque (any object, a tensor of any shape: Transformer Engine's grows once FP8
        # is initialized); its module's set_extra_state judges it, as nn.Module.load_state_dict lets it.
        if model_key is None or not isinstance(value, torch.Tensor) or _is_extra_state(fqn):
            continue
        want = tuple(local[model_key].shape)
        if tuple(value.shape) != want:
            mismatched.append(f"{fqn!r}: got shape {tuple(value.shape)}, expected {want}")
    if mismatched:
        raise RuntimeError(
            f"load into {type(model).__name__}: size mismatch for {'; '.join(mismatched)}; nothing was loaded"
        )

    raw = {expected[fqn]: value for fqn, value in state_dict.items() if fqn in expected}
    missing = [fqn for fqn in expected if fqn not in state_dict]
    return _ModelLoad(raw=raw, missing=missing, unexpected=unexpected)


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: ModelStateDict | ModuleKeyedStateDict,
    *,
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load ``model_state_dict`` (keyed by FQN, or by submodule) into ``model``.

    Returns the keys the load did not touch (``missing_keys``) and the given keys the model does not
    have (``unexpected_keys``). Raises, with nothing changed: ``RuntimeError`` for a missing or
    unexpected key under ``strict`` or any shape mismatch; ``TypeError`` for a value that is not a
    tensor; ``ValueError`` for a submodule key that is not part of ``model``."""
    options = options or StateDictOptions()
    with _gc_paused():
        backend = _backend.for_model(model)
        # Collective: every check is agreed on by all ranks before anything is gathered or changed.
        group = _backend.collective_group(model, backend, options.broadcast_from_rank0)
        flat, scope = comm.agree(group, lambda: _checked_unflatten(model, model_state_dict, options))
        if options.broadcast_from_rank0:
            flat = _backend.broadcast_from_rank0(flat, backend.device(model), group)
        plan = comm.agree(group, lambda: _plan_model_load(model, flat, scope, options, backend))
        backend.load_model_state_dict(model, plan.raw, options)
        return IncompatibleKeys(plan.missing, plan.unexpected)


def _checked_unflatten(
    model: nn.Module, model_state_dict: ModelStateDict | ModuleKeyedStateDict, options: StateDictOptions
) -> tuple[ModelStateDict, frozenset[int] | None]:
    options.check()
    return _unflatten_module_keyed(model, model_state_dict)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: OptimizerStateDict,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an FQN-keyed optimizer state dict (nested or flattened) into ``optimizers``; or, with one
    optimizer of a model that is not sharded, that optimizer's own ``state_dict()`` (keyed by parameter
    ids, read as ``Optimizer.load_state_dict`` reads it, then loaded as the FQN-keyed dict it stands for).

    Every optimizer's part is checked before any optimizer is changed. Under ``strict``, a trainable
    parameter without saved state that the optimizer holds state for, a parameter in no loaded group,
    or state for an FQN that no given optimizer holds, is a ``RuntimeError`` naming the FQN; otherwise
    such parameters keep their current state."""
    options = options or StateDictOptions()
    with _gc_paused():
        backend = _backend.for_model(model)
        group = _backend.collective_group(model, backend, options.broadcast_from_rank0)

        def check() -> tuple[torch.optim.Optimizer, ...]:
            options.check()
            return _some_optimizers(optimizers, "set_optimizer_state_dict")

        optims = comm.agree(group, check)
        if options.broadcast_from_rank0:
            optim_state_dict = _backend.broadcast_from_rank0(optim_state_dict, backend.device(model), group)
        _plan_optim_load(model, optims, optim_state_dict, options, backend, group)()


def _plan_optim_load(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    osd: OptimizerStateDict,
    options: StateDictOptions,
    backend: _backend.ModelBackend,
    group: dist.ProcessGroup | None,
) -> Any:
    def check() -> OptimizerStateDict:
        if not osd:
            raise RuntimeError("optimizer state dict is empty; nothing was loaded")
        if _optim.is_id_keyed(osd):
            # The optimizer's own dict (pytorch/pytorch#124942): read as the FQN-keyed dict it stands for,
            # then loaded, and checked, exactly like one.
            nested = backend.from_ids(model, optims, osd)
        else:
            nested = osd if _optim.STATE in osd else _optim.unflatten(osd, backend.param_fqns(model))
        backend.check_optim_load(model, optims, nested, options)
        return nested

    nested = comm.agree(group, check)
    # Agreed again: the plan may gather (DTensor state) before its last checks.
    return comm.agree(group, lambda: backend.plan_optim_load(model, optims, nested, options))


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: ModelStateDict | ModuleKeyedStateDict,
    optim_state_dict: OptimizerStateDict,
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load a model state dict and an optimizer state dict; both are checked before either is loaded.

    An empty ``model_state_dict`` loads the optimizers only (as torch does); an empty
    ``optim_state_dict`` loads the model only."""
    options = options or StateDictOptions()
    with _gc_paused():
        backend = _backend.for_model(model)
        group = _backend.collective_group(model, backend, options.broadcast_from_rank0)
        plan: _ModelLoad | None = None
        optims = comm.agree(group, lambda: _as_optimizers(optimizers))
        flat, scope = comm.agree(group, lambda: _checked_unflatten(model, model_state_dict or {}, options))
        if options.broadcast_from_rank0:
            flat = _backend.broadcast_from_rank0(flat, backend.device(model), group)
        if flat:
            plan = comm.agree(group, lambda: _plan_model_load(model, flat, scope, options, backend))
        apply_optim = None
        if optims and options.broadcast_from_rank0:
            optim_state_dict = _backend.broadcast_from_rank0(optim_state_dict or {}, backend.device(model), group)
        if optims and optim_state_dict:
            apply_optim = _plan_optim_load(model, optims, optim_state_dict, options, backend, group)
        if apply_optim is not None:
            apply_optim()
        if plan is None:
            return IncompatibleKeys([], [])
        backend.load_model_state_dict(model, plan.raw, options)
        return IncompatibleKeys(plan.missing, plan.unexpected)
