"""The smallest correct flat-parameter sharded data parallel: the reference for FSDP state-dict semantics.

``FullyShardedDataParallel`` mirrors the names of ``torch.distributed.fsdp.FullyShardedDataParallel``
(constructor arguments, ``ShardingStrategy``, ``fsdp_modules``, and ``optim_state_dict`` /
``optim_state_dict_to_load``, attached by :mod:`reference.fsdp` from :mod:`reference.fsdp.optim_keys`)
so that a torch user reads it without a glossary. It exists to produce real sharded parameters and
optimizer state for the conformance suite; it is not a training framework
(no prefetching, no mixed precision, no CPU offload of parameters).

Each *unit* (an instance of the class) flattens the parameters of its module that no nested unit owns
into one flat parameter, pads it to a multiple of the shard count and keeps one shard per rank (see
:mod:`reference.fsdp.sharding` for the states and the rewiring). Strategies:

================  ===========================================================================
FULL_SHARD        all-gather before forward, free after it; all-gather again before backward
SHARD_GRAD_OP     all-gather before forward, keep unsharded until the gradient is reduced
NO_SHARD          every rank holds everything; gradients are all-reduced
HYBRID_SHARD      FULL_SHARD inside each group of the mesh's ``shard`` axis, replicated across
                  its ``replicate`` axis (``device_mesh`` of shape ``(replicate, shard)``)
================  ===========================================================================

Gradients are averaged over every data-parallel rank (reduce-scatter over the shard axis, all-reduce
over the replicate axis), so N ranks on N equal slices of a batch match one process on the batch.

Model state dicts of a sharded model are in :mod:`reference.fsdp.model_state` (module-level functions;
every rank of the model's groups calls them, in the same order):

* :func:`full_state_dict` / :func:`load_full_state_dict`: unsharded tensors under clean FQNs
  (the FQNs of the unwrapped model), exactly the keys ``model.state_dict()`` had before wrapping.
* :func:`sharded_state_dict` / :func:`load_sharded_state_dict`: parameters as ``DTensor`` of their
  original shape, ``Shard(0)`` over the shard axis and ``Replicate()`` over the replicate axis (NO_SHARD:
  ``Replicate()`` only; 0-dim parameters: ``Replicate()``); buffers as plain tensors, as in torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comm
from reference.fqn import FQNResolver, register_wrapper
from reference.fsdp.sharding import FlatParamHandle

__all__ = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "AutoWrapPolicy",
    "FSDP_WRAPPED_MODULE",
    "FLAT_PARAM",
    "model_group",
    "units",
    "reshard_all",
]

#: The attribute under which a unit holds the module it wraps: a segment of raw FQNs, never of clean ones.
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
#: The name under which a unit registers its flat parameter (``use_orig_params=False`` only).
FLAT_PARAM = "_flat_param"


class ShardingStrategy(enum.Enum):
    """How a unit's flat parameter is laid out over ranks (names as in ``torch.distributed.fsdp``)."""

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()


AutoWrapPolicy = Callable[[nn.Module], bool]


def _as_policy(policy: AutoWrapPolicy | Iterable[type[nn.Module]] | None) -> AutoWrapPolicy | None:
    """A predicate from ``auto_wrap_policy``: a callable ``module -> bool``, or module classes to wrap."""
    if policy is None or callable(policy) and not isinstance(policy, (set, frozenset, list, tuple)):
        return policy
    classes = tuple(policy)
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"auto_wrap_policy: expected a callable or nn.Module classes, got {policy!r}")
    return lambda module: isinstance(module, classes)


class FullyShardedDataParallel(nn.Module):
    """Shards the parameters of ``module`` (and, through ``auto_wrap_policy``, of chosen submodules as
    nested units) over the ranks of ``process_group`` or ``device_mesh``.

    Args:
        module: the module to wrap; moved to the compute device.
        process_group: the group to shard over (default: the default group). Not with HYBRID_SHARD.
        device_mesh: instead of ``process_group``: a 1-D mesh, or for HYBRID_SHARD a 2-D mesh whose
            dimensions are ``(replicate, shard)`` and which covers the whole world.
        sharding_strategy: a :class:`ShardingStrategy` (or its name).
        use_orig_params: expose the original parameters (each a view of its part of the local shard,
            1-D and possibly empty) instead of the flat shard, so that an optimizer on
            ``model.parameters()`` keeps per-parameter state and frozen parameters may share a unit.
        auto_wrap_policy: a predicate ``module -> bool``, or a set of module classes: every matching
            submodule (below ``module``) becomes a nested unit with the same arguments, innermost first.
        device_id: the compute device (``torch.device`` or a CUDA index); default: where ``module`` is.

    Every rank of the groups constructs the unit with an identical ``module`` and calls forward and
    backward the same number of times in the same order. Raises ``ValueError`` for a mesh that does not
    fit the strategy or the world, a parameter shared by two units, or mixed ``requires_grad`` inside
    a unit with ``use_orig_params=False``, each naming what is wrong; nothing is modified then. The
    checks are agreed on (one all-gather): when one rank's module is bad, every rank raises its error.
    """

    _is_root: bool  #: False once an enclosing unit is built around this one

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: Any | None = None,
        sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        use_orig_params: bool = False,
        auto_wrap_policy: AutoWrapPolicy | Iterable[type[nn.Module]] | None = None,
        device_id: torch.device | int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(sharding_strategy, str):
            try:
                sharding_strategy = ShardingStrategy[sharding_strategy]
            except KeyError:
                raise ValueError(
                    f"unknown sharding_strategy {sharding_strategy!r}; expected one of {[s.name for s in ShardingStrategy]}"
                ) from None
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module is already a FullyShardedDataParallel unit")
        self.sharding_strategy: ShardingStrategy = sharding_strategy
        self.use_orig_params = use_orig_params
        self.device = _compute_device(module, device_id)
        # Checked before anything is wrapped, so that a bad layout leaves the model untouched, and agreed
        # on by every rank, so that one rank's bad model (a layer frozen there only) fails every rank.
        def check() -> tuple[Any, dist.ProcessGroup | None, dist.ProcessGroup | None, dist.ProcessGroup | None, AutoWrapPolicy | None]:
            groups = _resolve_groups(sharding_strategy, process_group, device_mesh)
            policy = _as_policy(auto_wrap_policy)
            if policy is not None:
                _check_no_param_shared_across_units(module, policy)
            _check_uniform_units(module, policy, use_orig_params)
            return (*groups, policy)

        self._device_mesh, self._shard_group, self._replicate_group, self.process_group, policy = comm.agree(
            _construction_group(process_group, device_mesh), check
        )
        if policy is not None:
            _auto_wrap(
                module,
                policy,
                lambda m: FullyShardedDataParallel(
                    m,
                    process_group=process_group,
                    device_mesh=device_mesh,
                    sharding_strategy=sharding_strategy,
                    use_orig_params=use_orig_params,
                    device_id=self.device,
                ),
            )
        nested = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        owned_elsewhere = {}
        for unit in nested:
            unit._is_root = False
            if unit._handle is not None:
                for slot, param in zip(unit._handle.slots, unit._handle.orig_params):
                    owned_elsewhere[param] = slot.fqn
        module.to(self.device)
        self._handle: FlatParamHandle | None = FlatParamHandle.build(
            module,
            exclude=set(nested),
            use_orig_params=use_orig_params,
            shard_group=self._shard_group,
            replicate_group=self._replicate_group,
            reshard_after_forward=sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
            device=self.device,
            owned_elsewhere=owned_elsewhere,
        )
        self._is_root = True
        self.add_module(FSDP_WRAPPED_MODULE, module)
        if self._handle is not None and not use_orig_params:
            self.register_parameter(FLAT_PARAM, self._handle.flat_param)

    # -- module protocol ----------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        module = self._modules[FSDP_WRAPPED_MODULE]
        assert module is not None  # added in __init__, never removed
        return module

    @property
    def handle(self) -> FlatParamHandle | None:
        """The flat-parameter handle of this unit (layout, shard, unshard/reshard), or None if it owns
        no parameter. Read-only: the unit owns it."""
        return self._handle

    @property
    def device_mesh(self) -> Any:
        """The mesh that sharded-state-dict DTensors of this unit live on: the one given at
        construction, else a 1-D mesh over ``process_group`` (built on first use)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            if self.process_group is None:
                raise RuntimeError("device_mesh: the unit has no process group (torch.distributed was not initialized)")
            self._device_mesh = DeviceMesh.from_group(self.process_group, self.device.type)
        return self._device_mesh

    @property
    def flat_param(self) -> nn.Parameter | None:
        """This unit's flat parameter (its local shard between iterations), or None if it owns none."""
        return self._handle.flat_param if self._handle is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_root:
            # A unit left unsharded by the last iteration (frozen, or SHARD_GRAD_OP without a backward)
            # is resharded here, so every iteration starts from the sharded state.
            reshard_all(self)
        handle = self._handle
        if handle is None:
            return self.module(*args, **kwargs)
        handle.pre_forward()
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            # The pre-backward all-gather hangs on the outputs this unit computed. An input handed back
            # unchanged (the position bias a T5 block receives from block 0 and returns) is another
            # unit's tensor: its gradient is complete only after every use of it, possibly after this
            # unit's own backward, so a hook on it would gather the parameters again once they had
            # been resharded. Outputs computed from inputs alone can fire late too; the handle ignores
            # a pre-backward that comes after its post-backward (FlatParamHandle.pre_backward).
            inputs = {id(t) for t in _tensors_in((args, kwargs))}
            for tensor in _tensors_in(output):
                if tensor.requires_grad and id(tensor) not in inputs:
                    tensor.register_hook(lambda grad: handle.pre_backward())
        handle.post_forward()
        return output

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FullyShardedDataParallel:
        """What ``.to()``, ``.double()``, ``.half()``, ``.bfloat16()``, ``.cpu()`` apply: to this unit's
        sharded flat parameter and everything derived from it (the gathered buffer, the original
        parameters' views, gradients), as torch's FSDP1 does, and to the rest of the module as usual.

        ``nn.Module._apply`` alone would convert each registered parameter on its own: the flat
        parameter's data, but not the shard the handle gathers from (the next forward would gather the
        old dtype), or with ``use_orig_params`` each original parameter into a tensor that is no longer
        a view of the shard (training would stop reaching the flat parameter). The unit's own
        parameters are therefore hidden from it, and converted through the handle. Local; no collective
        (a unit is converted on every rank, as the model is)."""
        handle = self._handle
        if handle is None:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # nn.Module._apply is untyped
            return self
        if handle.is_unsharded or handle.in_backward:
            handle.reshard()
        flat = self._parameters.get(FLAT_PARAM)
        for slot in handle.slots:
            slot.module._parameters[slot.name] = None
        for alias in handle.aliases:
            alias.module._parameters[alias.name] = None
        if flat is not None:
            self._parameters[FLAT_PARAM] = None
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            if flat is not None:
                self._parameters[FLAT_PARAM] = flat
            handle.use_sharded_params()
        handle.apply(fn)
        self.device = handle.local_shard.device
        return self

    # -- torch-mirroring static API -----------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module) -> list[FullyShardedDataParallel]:
        """Every unit in ``module``'s tree (``module`` itself included), in ``modules()`` order."""
        return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]

    def extra_repr(self) -> str:
        h = self._handle
        shard = f"shard {h.shard_rank}/{h.shard_world} of {h.padded_numel}" if h else "no parameters"
        return f"{self.sharding_strategy.name}, use_orig_params={self.use_orig_params}, {shard}"


# The canonical-FQN rule (reference.fqn) skips our wrapped-module segment.
register_wrapper(FullyShardedDataParallel, FSDP_WRAPPED_MODULE)


# -- construction helpers ---------------------------------------------------------------------------


def _compute_device(module: nn.Module, device_id: torch.device | int | None) -> torch.device:
    if device_id is None:
        first = next(iter(module.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    return torch.device(device_id)


def _resolve_groups(
    strategy: ShardingStrategy, process_group: dist.ProcessGroup | None, device_mesh: Any | None
) -> tuple[Any | None, dist.ProcessGroup | None, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(mesh, shard_group, replicate_group, world_group)``: the two axes (None when trivial) and the
    group spanning both, over which ranks agree on optimizer-state keys."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass process_group or device_mesh, not both")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if device_mesh is None:
            raise ValueError(
                "HYBRID_SHARD needs device_mesh=init_device_mesh(device_type, (replicate, shard)); got "
                + ("a process_group" if process_group is not None else "neither process_group nor device_mesh")
            )
        if device_mesh.ndim != 2:
            raise ValueError(f"HYBRID_SHARD needs a 2-D device_mesh (replicate, shard), got shape {tuple(device_mesh.shape)}")
        world = dist.get_world_size()
        if device_mesh.size() != world:
            raise ValueError(
                f"device_mesh of shape {tuple(device_mesh.shape)} covers {device_mesh.size()} ranks, "
                f"but the world has {world}: the mesh must divide the world into replicate x shard groups"
            )
        return device_mesh, device_mesh.get_group(1), device_mesh.get_group(0), dist.group.WORLD
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{strategy.name} shards over a 1-D device_mesh, got shape {tuple(device_mesh.shape)} "
                "(a 2-D mesh is for HYBRID_SHARD)"
            )
        group = device_mesh.get_group()
    else:
        group = process_group if process_group is not None else dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        return device_mesh, None, group, group
    return device_mesh, group, None, group


def _construction_group(process_group: dist.ProcessGroup | None, device_mesh: Any | None) -> dist.ProcessGroup | None:
    """The ranks that construct a unit together (None without a process group)."""
    if not dist.is_initialized():
        return None
    if process_group is not None:
        return process_group
    if device_mesh is not None and device_mesh.ndim == 1:
        group: dist.ProcessGroup = device_mesh.get_group()
        return group
    return dist.group.WORLD  # a 2-D mesh covers the world (checked by _resolve_groups)


def _check_uniform_units(root: nn.Module, policy: AutoWrapPolicy | None, use_orig_params: bool) -> None:
    """Raise ValueError, naming clean FQNs under ``root``, if a unit that ``policy`` would build (root
    included) cannot be one flat parameter: several dtypes, or with ``use_orig_params=False`` frozen
    and trainable parameters together. Local; nothing is modified."""
    units: dict[str, dict[nn.Parameter, str]] = {}
    names = FQNResolver(root)

    def visit(module: nn.Module, prefix: str, unit: str) -> None:
        if prefix and isinstance(module, FullyShardedDataParallel):
            return  # already a unit: checked when it was built
        if prefix and policy is not None and policy(module):
            unit = prefix
        for name, param in module._parameters.items():
            if param is not None:
                units.setdefault(unit, {}).setdefault(param, names.clean_key(prefix + name))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, prefix + child_name + ".", unit)

    visit(root, "", "")
    for unit, params in units.items():
        where = repr(names.clean_path(unit.rstrip("."))) if unit else "<root>"
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of one unit must share a dtype, got {sorted(map(str, dtypes))} in unit {where}: {list(params.values())}")
        if not use_orig_params and len({p.requires_grad for p in params}) > 1:
            frozen = [fqn for p, fqn in params.items() if not p.requires_grad]
            trainable = [fqn for p, fqn in params.items() if p.requires_grad]
            raise ValueError(
                "use_orig_params=False needs one requires_grad for all parameters of a unit: "
                f"frozen {frozen} and trainable {trainable} would share the flat parameter of unit {where} "
                "(use use_orig_params=True, or wrap them in separate units)"
            )


def _auto_wrap(module: nn.Module, policy: AutoWrapPolicy, wrap: Callable[[nn.Module], nn.Module]) -> None:
    """Replace every strict descendant of ``module`` matching ``policy`` by ``wrap(descendant)``,
    innermost first, so a unit never flattens a nested unit's parameters."""
    for name, child in list(module.named_children()):
        if isinstance(child, FullyShardedDataParallel):
            continue
        _auto_wrap(child, policy, wrap)
        if policy(child):
            setattr(module, name, wrap(child))


def _check_no_param_shared_across_units(root: nn.Module, policy: AutoWrapPolicy) -> None:
    """Raise if one parameter would be flattened into two units by ``policy`` (root included)."""
    owner: dict[nn.Parameter, tuple[str, str]] = {}
    names = FQNResolver(root)

    def visit(module: nn.Module, prefix: str, unit: str) -> None:
        if prefix and (policy(module) or isinstance(module, FullyShardedDataParallel)):
            unit = prefix.rstrip(".")
        for name, param in module._parameters.items():
            if param is None:
                continue
            fqn = prefix + name
            if param in owner and owner[param][1] != unit:
                first_fqn, first_unit = owner[param]
                raise ValueError(
                    f"parameter {names.clean_key(fqn)!r} (unit {names.clean_path(unit) or '<root>'!r}) is the same parameter "
                    f"as {names.clean_key(first_fqn)!r} (unit {names.clean_path(first_unit) or '<root>'!r}): a shared parameter "
                    "must be owned by one unit (wrap the common ancestor of both uses instead)"
                )
            owner.setdefault(param, (fqn, unit))
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, prefix + child_name + ".", unit)

    visit(root, "", "")


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward output (tensors, and lists, tuples and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors_in(item)


def reshard_all(model: nn.Module) -> None:
    """Return every unit under ``model`` to the sharded state (local; no collective)."""
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        if unit.handle is not None and (unit.handle.is_unsharded or unit.handle.in_backward):
            unit.handle.reshard()


# -- units of a model ------------------------------------------------------------------------------


def model_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group over which the units under ``model`` agree and exchange state (for HYBRID_SHARD the
    group spanning both axes), or None when ``model`` holds no unit."""
    units = FullyShardedDataParallel.fsdp_modules(model)
    return units[0].process_group if units else None


def units(model: nn.Module) -> list[tuple[str, FullyShardedDataParallel]]:
    """``(raw prefix of the unit's wrapped module, unit)`` for every unit under ``model`` owning parameters."""
    out = []
    for prefix, unit in model.named_modules():
        if isinstance(unit, FullyShardedDataParallel) and unit.handle is not None:
            out.append(((prefix + "." if prefix else "") + FSDP_WRAPPED_MODULE + ".", unit))
    return out
