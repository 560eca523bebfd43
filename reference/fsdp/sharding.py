"""One sharded flat parameter and the module rewiring around it (the engine of :mod:`reference.fsdp`).

Vocabulary. A *unit* is one ``FullyShardedDataParallel`` instance; it owns the parameters of its module
that no nested unit owns, flattened into one 1-D *flat parameter* of ``numel`` elements, padded with
zeros to ``padded_numel`` (a multiple of the shard count) and cut into equal *shards*, one per rank of the
*shard axis*. The *replicate axis* holds identical copies (NO_SHARD: every rank; HYBRID_SHARD: the other
groups). A *slot* is one original parameter inside the flat parameter; an *alias* is a second name of a
slot's parameter (tied weights), flattened once.

States of a handle, and who moves between them (all ranks of the shard axis together):

* *sharded* (between iterations): ``flat_param.data`` is this rank's shard (``local_shard``); with
  ``use_orig_params`` every original ``nn.Parameter`` is registered on its module and its ``.data`` is
  the part of ``local_shard`` it owns (1-D, possibly empty; the original shape when the shard axis is
  trivial); without it the original names hold ``None`` in ``module._parameters`` (placeholders that
  keep the registration order) and only the flat parameter is registered.
* *unsharded* (inside forward, and backward): ``flat_param.data`` is the gathered padded flat tensor and
  every original name holds a plain-tensor view of it, so autograd accumulates one flat gradient.

The gathered buffer is allocated once and its storage freed between uses (``resize_(0)``), so the views
autograd saved in forward see the data again after the all-gather before backward.

The flat parameter is a :class:`reference.flat_param.FlatParameter` (its names, shapes and offsets are
the slots'; ``shard_by_offsets`` records this rank's shard with :func:`~reference.flat_param.even_shard_range`).
The module rewiring is done here rather than by ``FlattenParamsWrapper``: that wrapper exposes views of
an *unsharded* flat parameter (``get_param_views`` needs all ``full_numel`` elements), while a sharded
unit must also expose the sharded state (``use_orig_params``) and mix frozen and trainable parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comm
from reference.flat_param.wrapper import FlatParameter, ParamRange, ShardRange, even_shard_range

__all__ = ["ParamSlot", "AliasSlot", "SlotShard", "FlatParamHandle"]


class ParamSlot(NamedTuple):
    """One original parameter inside a flat parameter."""

    fqn: str  #: name relative to the unit's module (``"0.weight"``)
    module: nn.Module  #: the module that registers it
    name: str  #: its attribute name on ``module``
    shape: torch.Size  #: original shape
    flat: ParamRange  #: the flat indices it occupies (``FlatParameter.param_offsets``, inclusive)


class AliasSlot(NamedTuple):
    """A further name of a slot's parameter (a tied weight): flattened once, shown under both names."""

    fqn: str
    module: nn.Module
    name: str
    slot_index: int  #: index of the :class:`ParamSlot` it aliases


class SlotShard(NamedTuple):
    """The part of one slot held by one shard, in the ranges of :mod:`reference.flat_param`.

    ``part`` are the param indices held (inclusive; empty when ``part.end == part.start - 1``);
    ``shard_offset`` is where ``part.start`` lies in the shard (for an empty part: the nearest
    position, so that views stay in bounds)."""

    part: ParamRange
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.part.numel

    @property
    def in_shard(self) -> slice:
        """Where the part lies in the shard, as a slice of the local shard."""
        return slice(self.shard_offset, self.shard_offset + self.numel)


def slot_shard(flat: ParamRange, part: ParamRange | None, shard: ShardRange) -> SlotShard:
    """The :class:`SlotShard` of a slot at flat indices ``flat`` whose held param indices the flat
    parameter's :meth:`~reference.flat_param.FlatParameter.shard_metadata` gives as ``part`` (None if
    the shard ``shard`` holds none of it)."""
    if part is None:
        nearest = min(max(flat.start, shard.start), shard.end + 1)
        return SlotShard(ParamRange(0, -1), nearest - shard.start)
    return SlotShard(part, flat.start + part.start - shard.start)


def _module_param_names(module: nn.Module, exclude: set[nn.Module]) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """``(fqn, owner, name, param)`` for every registration of a parameter under ``module``, skipping the
    subtrees in ``exclude`` (nested units); aliases included, in ``named_parameters`` order."""
    out = []

    def visit(mod: nn.Module, prefix: str) -> None:
        if mod in exclude:
            return
        for name, param in mod._parameters.items():
            if param is not None:
                out.append((prefix + name, mod, name, param))
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(child, prefix + child_name + ".")

    visit(module, "")
    return out


def _split_aliases(
    registrations: list[tuple[str, nn.Module, str, nn.Parameter]], owned_elsewhere: dict[nn.Parameter, str]
) -> tuple[list[tuple[str, nn.Module, str]], list[AliasSlot], list[nn.Parameter]]:
    """``(primaries, aliases, params)``: the first registration of each distinct parameter (its FQN,
    owning module and attribute name, with the parameter itself in ``params``), and every later
    registration of one of them as an alias of that slot (tied weights)."""
    primaries: list[tuple[str, nn.Module, str]] = []
    aliases: list[AliasSlot] = []
    index_of: dict[nn.Parameter, int] = {}
    params: list[nn.Parameter] = []
    for fqn, owner, name, param in registrations:
        # Invariant: a parameter lives in exactly one flat parameter, or its gradient would be
        # reduced twice and its optimizer state split between two units.
        if param in owned_elsewhere:
            raise ValueError(
                f"parameter {fqn!r} is also registered as {owned_elsewhere[param]!r} in another "
                "FullyShardedDataParallel unit: a shared parameter must be owned by one unit (wrap the "
                "common ancestor of both uses instead)"
            )
        if param in index_of:
            aliases.append(AliasSlot(fqn, owner, name, index_of[param]))
            continue
        index_of[param] = len(primaries)
        primaries.append((fqn, owner, name))
        params.append(param)
    return primaries, aliases, params


def _check_flattenable(primaries: list[tuple[str, nn.Module, str]], params: list[nn.Parameter], *, use_orig_params: bool) -> list[bool]:
    """Each parameter's ``requires_grad``, after checking that ``params`` can share one flat parameter:
    one dtype, and (without ``use_orig_params``, where the flat parameter's own flag is the only one)
    one ``requires_grad``."""
    requires_grad = [p.requires_grad for p in params]
    if not use_orig_params and any(requires_grad) and not all(requires_grad):
        frozen = [s[0] for s, r in zip(primaries, requires_grad) if not r]
        trainable = [s[0] for s, r in zip(primaries, requires_grad) if r]
        raise ValueError(
            "use_orig_params=False needs one requires_grad for all parameters of a unit: "
            f"frozen {frozen} and trainable {trainable} would share a flat parameter "
            "(use use_orig_params=True, or wrap them in separate units)"
        )
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"parameters of one unit must share a dtype, got {sorted(map(str, dtypes))} in {[s[0] for s in primaries]}")
    return requires_grad


def _keep_shard(flat_param: FlatParameter, shard_rank: int, shard_world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard ``flat_param`` in place and return ``(local_shard, full)``: this rank's padded chunk (now the
    flat parameter's data; padding zero) and the gathered padded flat tensor, allocated but with its
    storage freed until the first unshard (``local_shard`` itself when the shard axis has one rank)."""
    numel = flat_param.full_numel
    shard = even_shard_range(numel, shard_rank, shard_world)
    chunk = shard.end - shard.start + 1
    flat_param.shard_by_offsets(shard.start, shard.end, shard.num_padded)
    with torch.no_grad():
        local_shard = torch.zeros(chunk, dtype=flat_param.dtype, device=device)
        real = max(0, min(numel, shard.end + 1) - shard.start)
        local_shard[:real].copy_(flat_param.detach()[shard.start : shard.start + real])
    flat_param.data = local_shard
    if shard_world == 1:
        return local_shard, local_shard
    full = torch.empty(chunk * shard_world, dtype=local_shard.dtype, device=device)
    full.untyped_storage().resize_(0)
    return local_shard, full


@dataclass
class FlatParamHandle:
    """Flattens, shards, unshards and reshards the parameters of one unit.

    Built on every rank of the unit's process groups, with identical modules. ``shard_group`` and
    ``replicate_group`` are the two axes (``None`` for a trivial axis)."""

    module: nn.Module
    slots: list[ParamSlot]
    aliases: list[AliasSlot]
    flat_param: FlatParameter
    use_orig_params: bool
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    reshard_after_forward: bool
    numel: int
    padded_numel: int
    shard_numel: int
    shard_rank: int
    shard_world: int  #: number of ranks on the shard axis
    local_shard: torch.Tensor
    #: the gathered padded flat tensor, its storage freed while sharded (``local_shard`` itself when
    #: the shard axis has one rank)
    _full: torch.Tensor
    orig_params: list[nn.Parameter] = field(default_factory=list)
    _is_unsharded: bool = False
    _saved_grad: torch.Tensor | None = None
    _forward_without_grad: bool = False
    _used: set[int] = field(default_factory=set)
    #: slot name -> the param indices this rank's shard holds (from ``flat_param.shard_metadata()``)
    _parts: dict[str, ParamRange] | None = None
    #: True between the pre-backward all-gather and the post-backward reshard
    in_backward: bool = False
    #: True from the post-backward reduce-scatter until the next forward: a pre-backward hook that fires
    #: later in the same backward (on an output whose gradient completes after this unit's parameter
    #: gradient) must not gather again, or the unit would end the iteration unsharded with a sharded
    #: gradient (torch's FSDP keeps the same flag, ``_ran_pre_backward_hook``, for the same reason).
    _reduced_this_backward: bool = False

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        module: nn.Module,
        exclude: set[nn.Module],
        *,
        use_orig_params: bool,
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        reshard_after_forward: bool,
        device: torch.device,
        owned_elsewhere: dict[nn.Parameter, str],
    ) -> FlatParamHandle | None:
        """Flatten the parameters of ``module`` outside ``exclude`` and keep this rank's shard; None when
        there are none. ``owned_elsewhere`` maps parameters of other units to their name, to reject a
        parameter shared across units."""
        registrations = _module_param_names(module, exclude)
        if not registrations:
            return None
        primaries, aliases, params = _split_aliases(registrations, owned_elsewhere)
        requires_grad = _check_flattenable(primaries, params, use_orig_params=use_orig_params)
        shard_world, shard_rank = comm.group_size(shard_group), comm.group_rank(shard_group)
        with torch.no_grad():
            flat_param = FlatParameter(
                [p.detach().to(device) for p in params], requires_grad=any(requires_grad), names=[s[0] for s in primaries]
            )
        # The layout is the FlatParameter's own: each slot's flat indices, and below its shard's parts.
        slots = [
            ParamSlot(fqn, owner, name, shape, flat)
            for (fqn, owner, name), shape, flat in zip(primaries, flat_param.param_shapes, flat_param.param_offsets)
        ]
        local_shard, full = _keep_shard(flat_param, shard_rank, shard_world, device)
        handle = cls(
            module=module,
            slots=slots,
            aliases=aliases,
            flat_param=flat_param,
            use_orig_params=use_orig_params,
            shard_group=shard_group,
            replicate_group=replicate_group,
            reshard_after_forward=reshard_after_forward,
            numel=flat_param.full_numel,
            padded_numel=local_shard.numel() * shard_world,
            shard_numel=local_shard.numel(),
            shard_rank=shard_rank,
            shard_world=shard_world,
            local_shard=local_shard,
            _full=full,
        )
        for param, slot in zip(params, slots):
            # Keep the user's Parameter objects, as views of their part of the shard: with
            # use_orig_params they are what the module registers (optimizers built on them stay valid);
            # without it they are unregistered, but their data is freed all the same.
            param.data = handle.local_view(slot)
            handle.orig_params.append(param)
        if flat_param.requires_grad:
            flat_param.register_post_accumulate_grad_hook(lambda _p: handle.post_backward())
        handle.use_sharded_params()
        return handle

    @property
    def is_unsharded(self) -> bool:
        """Whether the gathered flat parameter is live (between :meth:`unshard` and :meth:`reshard`)."""
        return self._is_unsharded

    # -- views ---------------------------------------------------------------------------------------

    def slot_shard(self, slot: ParamSlot) -> SlotShard:
        """The part of ``slot`` in this rank's shard, from the flat parameter's shard metadata."""
        if self._parts is None:
            held = self.flat_param.shard_metadata()
            self._parts = dict(zip(held.param_names, held.param_offsets))
        return slot_shard(slot.flat, self._parts.get(slot.fqn), self.flat_param.shard_range)

    def local_view(self, slot: ParamSlot) -> torch.Tensor:
        """The view of ``local_shard`` holding this rank's part of ``slot``: the original shape when the
        shard axis is trivial (the whole parameter is local), else 1-D."""
        view = self.local_shard[self.slot_shard(slot).in_shard]
        return view.view(slot.shape) if self.shard_world == 1 else view

    def use_sharded_params(self) -> None:
        """Point every original name at its sharded form (see the module docstring)."""
        for i, slot in enumerate(self.slots):
            slot.module._parameters[slot.name] = self.orig_params[i] if self.use_orig_params else None
        for alias in self.aliases:
            alias.module._parameters[alias.name] = self.orig_params[alias.slot_index] if self.use_orig_params else None

    def use_unsharded_views(self) -> None:
        """Point every original name at a view of the unsharded flat parameter (inside forward)."""
        flat = self.flat_param
        views = []
        for i, slot in enumerate(self.slots):
            frozen = self.use_orig_params and not self.orig_params[i].requires_grad
            # A frozen parameter's view is detached so no gradient reaches its part of the flat one.
            source = flat.detach() if frozen or not flat.requires_grad else flat
            view = source[slot.flat.as_slice()].view(slot.shape)
            if view.requires_grad and torch.is_grad_enabled():
                # Record which parameters took part, so unused ones keep grad None as in eager.
                view.register_hook(lambda g, i=i: self._used.add(i))
            views.append(view)
        self.show_views(views)

    def show_views(self, views: list[torch.Tensor]) -> None:
        """Put ``views`` (one per slot, in slot order) under every original name, tied aliases included."""
        # A plain tensor under the parameter's name, as torch's FSDP does: _parameters is typed as
        # holding Parameters only, hence the ignores.
        for slot, view in zip(self.slots, views, strict=True):
            slot.module._parameters[slot.name] = view  # type: ignore[assignment]
        for alias in self.aliases:
            alias.module._parameters[alias.name] = views[alias.slot_index]  # type: ignore[assignment]

    def full_param_views(self) -> list[torch.Tensor]:
        """Detached views of every slot in the unsharded flat parameter (only while unsharded)."""
        assert self._is_unsharded or self.shard_world == 1, "full_param_views needs the handle unsharded"
        full = self._full if self.shard_world > 1 else self.local_shard
        return [full[s.flat.as_slice()].view(s.shape).detach() for s in self.slots]

    # -- conversion ----------------------------------------------------------------------------------

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Convert the sharded state with ``fn`` (a dtype or device change, as ``nn.Module._apply``
        passes it): the local shard, the flat parameter and its gradients. Afterwards every tensor
        derived from the shard is derived again, so that they keep one dtype and device: the gathered
        buffer (re-allocated, storage freed) and each original parameter's view. The same objects stay
        registered, so an optimizer built before keeps training them. Only while sharded; local."""
        assert not self._is_unsharded, "apply needs the handle sharded"
        with torch.no_grad():
            shard = fn(self.local_shard)
            # Invariant: the shard keeps its layout; only its dtype or device may change.
            if shard.shape != self.local_shard.shape:
                raise RuntimeError(f"{fn!r} changed the shape of a flat parameter's shard: {tuple(self.local_shard.shape)} -> {tuple(shard.shape)}")
            # Gradients are taken off while the data changes dtype (a gradient must match its data).
            grad, self.flat_param.grad = self.flat_param.grad, None
            self.local_shard = shard
            self.flat_param.data = shard
            self.flat_param.grad = None if grad is None else fn(grad)
            self._saved_grad = None if self._saved_grad is None else fn(self._saved_grad)
            if self.shard_world == 1:
                self._full = shard
            else:
                self._full = torch.empty(self._full.numel(), dtype=shard.dtype, device=shard.device)
                self._full.untyped_storage().resize_(0)
            for param, slot in zip(self.orig_params, self.slots):
                param_grad, param.grad = param.grad, None
                param.data = self.local_view(slot)
                param.grad = None if param_grad is None else fn(param_grad)

    # -- unshard / reshard ---------------------------------------------------------------------------

    def unshard(self) -> None:
        """All-gather the shards into the padded flat tensor (collective over the shard axis; no-op when
        already unsharded) and make it the flat parameter's data."""
        if self.shard_world == 1:
            self._is_unsharded = True
            return
        if not self._is_unsharded:
            self._full.untyped_storage().resize_(self._full.numel() * self._full.element_size())
            with torch.no_grad():
                comm.all_gather_flat(self._full, self.local_shard, self.shard_group)
            self._is_unsharded = True
        self.flat_param.data = self._full

    def reshard(self) -> None:
        """Free the gathered tensor and return to the sharded state (local; no collective)."""
        self.flat_param.data = self.local_shard
        if self.shard_world > 1 and self._is_unsharded:
            self._full.untyped_storage().resize_(0)
        self._is_unsharded = False
        self.in_backward = False
        self.use_sharded_params()

    def _used_on_any_rank(self, used: set[int], device: torch.device) -> set[int]:
        """The slots some data-parallel rank used in this backward. A parameter used on one rank only
        (an MoE expert that only that rank's tokens were routed to) has a nonzero averaged gradient on
        every rank, and every rank must apply it to its part, or the shards diverge; a parameter no
        rank used keeps ``grad=None``, as in the unwrapped model on the whole batch. Collective over
        both axes; every rank of the unit reaches it from the same post-backward hook."""
        mask = torch.zeros(len(self.slots), dtype=torch.int32, device=device)
        if used:
            mask[sorted(used)] = 1
        comm.all_reduce_any(mask, self.shard_group)
        comm.all_reduce_any(mask, self.replicate_group)
        return {i for i, flag in enumerate(mask.tolist()) if flag}

    # -- gradients -----------------------------------------------------------------------------------

    def pre_forward(self) -> None:
        """Unshard and expose unsharded views; set aside the sharded gradient so autograd can accumulate
        an unsharded one. A forward without grad (evaluation between a backward and the optimizer's
        step) has no backward to accumulate: the gradient stays where the optimizer reads it, as in
        the unwrapped model, and :meth:`post_forward` returns to the sharded form it belongs to."""
        self._forward_without_grad = not torch.is_grad_enabled()
        grad = self.flat_param.grad
        if not self._forward_without_grad and grad is not None and grad.shape == self.local_shard.shape:
            self._saved_grad = grad
            self.flat_param.grad = None
        self._reduced_this_backward = False
        self.unshard()
        self.use_unsharded_views()

    def post_forward(self) -> None:
        if (self.reshard_after_forward or self._forward_without_grad) and not self.in_backward:
            self.reshard()

    def pre_backward(self) -> None:
        """All-gather again what forward freed (FULL_SHARD), so the saved views are valid."""
        if not self.in_backward and not self._reduced_this_backward:
            self.in_backward = True
            self.unshard()
            # Fresh views for a recomputation (activation checkpointing inside the unit), made with
            # grad enabled (backward runs without) so that it reaches the flat parameter.
            with torch.enable_grad():
                self.use_unsharded_views()

    def post_backward(self) -> None:
        """Average the unsharded gradient into this rank's shard (reduce-scatter over the shard axis, then
        all-reduce over the replicate axis) and reshard. Runs from the flat parameter's
        post-accumulate-grad hook, on every rank in the same order."""
        full_grad = self.flat_param.grad
        assert full_grad is not None, "the post-accumulate-grad hook runs once a gradient exists"
        self.flat_param.grad = None
        if full_grad.numel() != self.padded_numel:
            raise RuntimeError(f"post_backward: gradient of {full_grad.numel()} elements, expected {self.padded_numel}")
        with torch.no_grad():
            grad = comm.reduce_scatter_mean(full_grad.detach().reshape(-1), self.shard_group)
            comm.all_reduce_mean(grad, self.replicate_group)
        used, self._used = self._used, set()
        self.reshard()
        self._reduced_this_backward = True
        if self.use_orig_params:
            used = self._used_on_any_rank(used, grad.device)
            for i, (slot, param) in enumerate(zip(self.slots, self.orig_params)):
                if not param.requires_grad or i not in used:
                    continue
                part = grad[self.slot_shard(slot).in_shard].view_as(param)
                param.grad = part.clone() if param.grad is None else param.grad.add_(part)
            self._saved_grad = None
        else:
            if self._saved_grad is not None:
                grad = self._saved_grad.add_(grad)
                self._saved_grad = None
            self.flat_param.grad = grad
