"""FlatParameter and FlattenParamsWrapper: many parameters of a module as one 1-D parameter.

Vocabulary used throughout:

- *flat parameter*: the 1-D :class:`FlatParameter` holding the listed parameters of a module,
  flattened and concatenated in module order (the order of the unwrapped ``state_dict``).
- *flat index*: an element index into the (unsharded) flat parameter, ``0 <= i < full_numel``.
- *param index*: an element index into one original parameter flattened, ``param.reshape(-1)``.
- *shard*: the inclusive flat-index range ``[start, end]`` one rank holds of the flat parameter,
  which is padded at its end so that every rank holds the same number of elements; the shard's last
  ``num_padded`` elements are padding (flat indices ``>= full_numel``). See :func:`even_shard_range`.
- *name*: a parameter's path relative to the wrapped module (``"layers.0.weight"``), the key the
  unwrapped module's ``state_dict`` uses for it.

What :class:`FlattenParamsWrapper` promises (each is a requirement FP-* of ``conformance/SPEC.md``):
the wrapped module computes exactly what it did; gradients land on ``flat_param`` as the original
gradients concatenated; ``state_dict``/``load_state_dict`` of the wrapper, or of any model containing
wrappers at any depth, use the unwrapped keys; ``unflatten_params()`` restores real parameters and
re-flattens on exit, also on error. What it asks of the caller: do not hold on to the parameter
views (they are rebuilt at every forward, ``.to()`` and ``unflatten_params()``; read them from the
module), and do not tie a listed parameter to a module outside the wrapped one (the wrapper cannot
see it; see :class:`FlattenParamsWrapper`).

Helpers for other wrappers: :mod:`reference.flat_param.prefix_hooks` (hide a wrapper's path segment from
state_dict keys; clean FQNs of a model with wrappers).
"""

from __future__ import annotations

import contextlib
import functools
import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any, NamedTuple, SupportsIndex, cast

import torch
import torch.nn as nn
from torch import Tensor

from reference.flat_param.prefix_hooks import clean_named_modules, register_prefix_hooks
from reference.fqn import register_wrapper

__all__ = [
    "FlatParameter",
    "FlattenParamsWrapper",
    "ParamRange",
    "FlatParamMetadata",
    "ShardMetadata",
    "ShardRange",
    "even_shard_range",
]

#: Name of the wrapped module inside the wrapper; removed from state_dict keys by the prefix hooks.
FPW_MODULE = "_fpw_module"
#: Name under which the wrapper registers its FlatParameter.
FLAT_PARAM = "flat_param"


class ParamRange(NamedTuple):
    """An inclusive range ``[start, end]`` of element indices; where it is used says what it indexes.

    An empty range has ``end == start - 1`` (a parameter with no elements).
    """

    start: int
    end: int

    @property
    def numel(self) -> int:
        """How many indices the range holds."""
        return self.end - self.start + 1

    def as_slice(self) -> slice:
        """The range as a Python slice (``[start, end + 1)``), to index a 1-D tensor with."""
        return slice(self.start, self.end + 1)


class FlatParamMetadata(NamedTuple):
    """What a flat parameter is made of: one entry per original parameter, in flat order."""

    param_names: tuple[str, ...]  # names relative to the wrapped module
    param_shapes: tuple[torch.Size, ...]  # original shapes
    param_numels: tuple[int, ...]  # original numels
    param_offsets: tuple[ParamRange, ...]  # flat indices each parameter occupies


class ShardMetadata(NamedTuple):
    """Which parameters, and which elements of each, one shard of a flat parameter holds.

    One entry per parameter with at least one element in the shard, in flat order; a shard that is
    all padding holds none. The whole flat parameter (no sharding) is the shard
    ``[0, full_numel - 1]`` with no padding.
    """

    param_names: tuple[str, ...]  # names of the parameters the shard holds (part of)
    param_shapes: tuple[torch.Size, ...]  # their full, unsharded shapes
    param_numels: tuple[int, ...]  # their full numels
    param_offsets: tuple[ParamRange, ...]  # param indices of each parameter that the shard holds
    num_padded: int  # padding elements at the end of the shard


class ShardRange(NamedTuple):
    """Arguments of :meth:`FlatParameter.shard_by_offsets` for one rank: flat indices ``[start, end]``."""

    start: int
    end: int
    num_padded: int


def even_shard_range(full_numel: int, rank: int, world_size: int) -> ShardRange:
    """The shard of ``rank`` when a flat parameter of ``full_numel`` elements is split evenly.

    The flat parameter is padded at the end to ``world_size * ceil(full_numel / world_size)``
    elements and cut into ``world_size`` equal shards, so that trailing ranks may hold padding only.
    """
    for name, value in (("full_numel", full_numel), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"even_shard_range: {name} must be an int, got {type(value).__name__}")
    if full_numel < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"even_shard_range: need full_numel >= 0, world_size >= 1 and 0 <= rank < world_size, "
            f"got full_numel={full_numel}, rank={rank}, world_size={world_size}"
        )
    shard_numel = max(1, -(-full_numel // world_size))
    start = rank * shard_numel
    end = start + shard_numel - 1
    return ShardRange(start, end, max(0, end + 1 - max(start, full_numel)))


@dataclass(frozen=True)
class _Layout:
    """The immutable part of a FlatParameter's metadata (shared by copies of it)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    starts: tuple[int, ...]  # the flat index of each parameter's first element
    full_numel: int

    # The ParamRanges are made on first use: a wrapper of n parameters needs only `starts`, and n
    # more objects that live as long as the model make every full garbage collection longer.
    @functools.cached_property
    def offsets(self) -> tuple[ParamRange, ...]:
        return tuple(ParamRange(start, start + n - 1) for start, n in zip(self.starts, self.numels))

    @classmethod
    def build(cls, names: Sequence[str], shapes: Sequence[torch.Size]) -> _Layout:
        sizes = tuple(s if isinstance(s, torch.Size) else torch.Size(s) for s in shapes)
        numels = tuple(math.prod(s) for s in sizes)
        starts = tuple(accumulate(numels, initial=0))[:-1]
        return cls(tuple(names), sizes, numels, starts, sum(numels))

    def shard(self, start: int, end: int, num_padded: int) -> ShardMetadata:
        """Metadata of the shard ``[start, end]`` (flat indices, padding included); inputs validated."""
        held = []
        for i, offset in enumerate(self.offsets):
            # A parameter is held if its flat range meets [start, end]; padding (flat indices
            # >= full_numel) meets no parameter, and an empty parameter meets no shard.
            if self.numels[i] == 0 or offset.end < start or offset.start > end:
                continue
            first = max(start, offset.start) - offset.start
            last = min(end, offset.end) - offset.start
            held.append((i, ParamRange(first, last)))
        return ShardMetadata(
            tuple(self.names[i] for i, _ in held),
            tuple(self.shapes[i] for i, _ in held),
            tuple(self.numels[i] for i, _ in held),
            tuple(r for _, r in held),
            num_padded,
        )


def _check_int(method: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{method}: {name} must be an int, got {type(value).__name__} {value!r}")
    return value


class FlatParameter(nn.Parameter):
    """A 1-D parameter made of a list of parameters, flattened and concatenated in order.

    The data is a copy: the given tensors are not modified and do not alias the result. The metadata
    (names, shapes, numels, flat offsets of each parameter) is immutable and is what
    :meth:`get_param_views` and :meth:`shard_metadata` use. :meth:`shard_by_offsets` records which
    part of the flat parameter this rank holds; it does not touch the data (the sharding wrapper
    owns that).

    Args:
        params: the parameters (any tensors) to flatten, in order; non-empty, one dtype, one device,
            none of them a FlatParameter.
        requires_grad: whether the flat parameter requires grad.
        names: one name per parameter (default ``"0"``, ``"1"``, ...); the wrapper passes the
            parameters' names relative to the wrapped module.

    Raises:
        TypeError: ``params`` is not a list or tuple of tensors, or ``names`` not a sequence of str.
        ValueError: ``params`` is empty, mixes dtypes or devices, contains a FlatParameter, or
            ``names`` has the wrong length or repeats a name.
    """

    _layout: _Layout
    _shard: ShardMetadata | None  # metadata of _shard_range, made on first use (see shard_metadata)
    _shard_range: ShardRange

    def __new__(
        cls, params: Sequence[Tensor], requires_grad: bool = True, *, names: Sequence[str] | None = None
    ) -> FlatParameter:
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"FlatParameter: params must be a list or tuple of tensors, got {type(params).__name__}")
        if len(params) == 0:
            raise ValueError("FlatParameter: params must hold at least one parameter, got an empty sequence")
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"FlatParameter: params[{i}] must be a tensor, got {type(p).__name__}")
            # Flattening makes both the tensor and the module hierarchy flat; a FlatParameter inside
            # another would bring the hierarchy back, so it is refused rather than absorbed.
            # (issubclass of the type: isinstance would run nn.Parameter's Python-level metaclass
            # check, a cost per parameter.)
            if issubclass(type(p), FlatParameter):
                raise ValueError(f"FlatParameter: params[{i}] is already a FlatParameter; nesting is not supported")
        # Invariant: one dtype and one device, so that torch.cat neither promotes nor moves data.
        for attr in ("dtype", "device"):
            first = getattr(params[0], attr)
            for i, p in enumerate(params):
                if getattr(p, attr) != first:
                    raise ValueError(
                        f"FlatParameter: all params must have one {attr}: params[0] has {first}, params[{i}] has "
                        f"{getattr(p, attr)}"
                    )
        # Under no_grad the copy records no history (no detach needed); 1-D tensors go in as they are.
        with torch.no_grad():
            data = torch.cat([p if p.ndim == 1 else p.reshape(-1) for p in params])
        return super().__new__(cls, data, requires_grad=requires_grad)

    def __init__(
        self, params: Sequence[Tensor], requires_grad: bool = True, *, names: Sequence[str] | None = None
    ) -> None:
        if names is None:
            names = [str(i) for i in range(len(params))]
        elif isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError("FlatParameter: names must be a sequence of str, one per parameter")
        if len(names) != len(params):
            raise ValueError(f"FlatParameter: got {len(names)} names for {len(params)} params")
        if len(set(names)) != len(names):
            raise ValueError(f"FlatParameter: names must be unique, got {list(names)}")
        self._set_layout(_Layout.build(names, [p.shape for p in params]))

    def _set_layout(self, layout: _Layout) -> None:
        self._layout = layout
        self._shard_range = ShardRange(0, layout.full_numel - 1, 0)
        self._shard = None

    # -- metadata -----------------------------------------------------------------------------

    @property
    def full_numel(self) -> int:
        """Number of elements of all original parameters together (the unsharded, unpadded size)."""
        return self._layout.full_numel

    @property
    def param_names(self) -> tuple[str, ...]:
        return self._layout.names

    @property
    def param_shapes(self) -> tuple[torch.Size, ...]:
        return self._layout.shapes

    @property
    def param_numels(self) -> tuple[int, ...]:
        return self._layout.numels

    @property
    def param_offsets(self) -> tuple[ParamRange, ...]:
        """The flat indices each original parameter occupies, inclusive."""
        return self._layout.offsets

    def metadata(self) -> FlatParamMetadata:
        """Names, shapes, numels and flat offsets of the original parameters, in flat order."""
        layout = self._layout
        return FlatParamMetadata(layout.names, layout.shapes, layout.numels, layout.offsets)

    # -- views --------------------------------------------------------------------------------

    def get_param_views(self, external_data: Tensor | None = None) -> Iterator[Tensor]:
        """Views of ``external_data`` (default: this parameter) in the original shapes, in flat order.

        The views share memory with the data; when the data requires grad they carry autograd
        history back to it. ``external_data`` must have ``full_numel`` elements (an unsharded copy).
        """
        data = self if external_data is None else external_data
        if not isinstance(data, Tensor):
            raise TypeError(f"get_param_views: external_data must be a tensor, got {type(data).__name__}")
        if data.numel() != self.full_numel:
            raise ValueError(
                f"get_param_views: data has {data.numel()} elements, expected full_numel={self.full_numel}"
                + (" (this FlatParameter is sharded; pass the unsharded data)" if external_data is None else "")
            )
        layout = self._layout
        pieces = data.reshape(-1).split_with_sizes(layout.numels)
        # A piece of a 1-D parameter already has its shape: a view of it would only cost time.
        return (t if len(s) == 1 else t.view(s) for t, s in zip(pieces, layout.shapes))

    # -- sharding -----------------------------------------------------------------------------

    def shard_by_offsets(self, start: int, end: int, num_padded: int) -> None:
        """Record that this rank's shard is the flat indices ``[start, end]`` (inclusive), with padding.

        The shard has ``end - start + 1`` elements of which the last ``num_padded`` are padding.
        Padding only ever follows the last real element, so ``num_padded`` must be exactly the part
        of ``[start, end]`` at or past ``full_numel``: ``max(0, end + 1 - max(start, full_numel))``.
        See :func:`even_shard_range` for the usual split. On error nothing is recorded.

        Raises:
            TypeError: an argument is not an int.
            ValueError: ``start < 0``, ``end < start``, ``num_padded`` negative or larger than the
                shard, or inconsistent with where the flat parameter ends.
        """
        start = _check_int("shard_by_offsets", "start", start)
        end = _check_int("shard_by_offsets", "end", end)
        num_padded = _check_int("shard_by_offsets", "num_padded", num_padded)
        if start < 0 or end < start:
            raise ValueError(
                f"shard_by_offsets: invalid shard range [{start}, {end}]: need 0 <= start <= end (inclusive range)"
            )
        shard_numel = end - start + 1
        if num_padded < 0 or num_padded > shard_numel:
            raise ValueError(
                f"shard_by_offsets: num_padded={num_padded} must be between 0 and the shard size "
                f"{shard_numel} of [{start}, {end}]"
            )
        full = self.full_numel
        expected = max(0, end + 1 - max(start, full))
        if num_padded != expected:
            raise ValueError(
                f"shard_by_offsets: shard [{start}, {end}] of a flat parameter with {full} elements has "
                f"{expected} padding elements (padding follows the last element), got num_padded={num_padded}"
            )
        self._shard_range = ShardRange(start, end, num_padded)
        self._shard = None

    @property
    def shard_range(self) -> ShardRange:
        """The last recorded shard (the whole flat parameter until :meth:`shard_by_offsets` is called)."""
        return self._shard_range

    def shard_metadata(self) -> ShardMetadata:
        """Which parameters, and which param indices of each, the recorded shard holds."""
        if self._shard is None:  # made on first use: a wrapper that never shards does not need it
            self._shard = self._layout.shard(*self._shard_range)
        return self._shard

    # -- copying ------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatParameter:
        if id(self) in memo:
            return cast(FlatParameter, memo[id(self)])
        result = _rebuild_flat_param(
            self.data.clone(memory_format=torch.preserve_format), self.requires_grad, self._layout, self._shard_range
        )
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto: SupportsIndex) -> tuple[Any, ...]:
        # nn.Parameter's reduce would call FlatParameter(data, requires_grad), which means "flatten
        # [data]"; rebuild from data plus metadata instead. Hooks are not pickled, as for Parameter.
        return (_rebuild_flat_param, (self.data, self.requires_grad, self._layout, self._shard_range))

    # torch declares Tensor.__repr__ through a decorator that mypy reads as untyped, with a keyword it
    # cannot name: neither the override nor the call can be checked.
    def __repr__(self) -> str:  # type: ignore[override]
        contents = Tensor.__repr__(self)  # type: ignore[no-untyped-call]
        return f"FlatParameter({len(self._layout.names)} params, {self.full_numel} elements) containing:\n{contents}"


def _rebuild_flat_param(data: Tensor, requires_grad: bool, layout: _Layout, shard_range: ShardRange) -> FlatParameter:
    """A FlatParameter over ``data`` (used, not copied) with the given metadata: pickle, deepcopy, moves."""
    flat = torch.Tensor._make_subclass(FlatParameter, data, requires_grad)
    flat._set_layout(layout)
    flat._shard_range = ShardRange(*shard_range)
    return flat


class _Slot(NamedTuple):
    """One registration of a flattened parameter: ``module.<attr>`` at ``name``."""

    name: str  # name relative to the wrapped module ("layers.0.weight")
    module: nn.Module
    attr: str


class _Owner(NamedTuple):
    """A module that registers flattened parameters, with its parameter order from before wrapping."""

    module: nn.Module
    order: tuple[tuple[str, int], ...]  # every name in `_parameters`, with its flat index (-1: not flattened)
    flattened: tuple[str, ...]  # the names with a flat index


def _owners(slots: Sequence[_Slot], ties: Sequence[tuple[int, _Slot]]) -> tuple[_Owner, ...]:
    """The owner of every registration (``slots[i]`` and the ties of flat index i), each listed once."""
    index: dict[nn.Module, dict[str, int]] = {}
    for i, slot in chain(enumerate(slots), ties):
        attrs = index.get(slot.module)
        if attrs is None:
            attrs = index[slot.module] = {}
        attrs[slot.attr] = i
    owners = []
    for module, flat_index in index.items():
        # `_parameters` rather than named_parameters(): names registered as None keep their place.
        order = tuple((name, flat_index.get(name, -1)) for name in module._parameters)
        owners.append(_Owner(module, order, tuple(flat_index)))
    return tuple(owners)


class FlattenParamsWrapper(nn.Module):
    """Replace the listed parameters of ``module`` by one :class:`FlatParameter`, ``self.flat_param``.

    Each listed parameter, wherever it is registered inside ``module`` (at any depth, under any
    number of names), stops being a registered parameter; its attributes become views into
    ``flat_param``, rebuilt at every forward, so the module computes exactly what it did and its
    gradients accumulate in ``flat_param.grad``. Parameters not listed stay as they are.

    Tied parameters: ties are by identity. A listed parameter registered under several names is
    flattened once and every name gets the same view. A listed parameter that shares memory with a
    parameter or buffer of ``module`` that is not listed (a tie by storage) is refused with a
    ``ValueError``: flattening copies the listed one, which would silently cut the tie. So when every
    listed parameter is tied that way, nothing is flattened and the constructor raises; list both
    sides, or neither. A tie to a module outside ``module`` is invisible here and is the caller's to
    avoid (wrap the common parent instead).

    ``state_dict()``/``load_state_dict()`` use the unwrapped module's keys, also when the wrapper sits
    inside a larger model (see :mod:`reference.flat_param.prefix_hooks`); there is no ``flat_param`` key.
    For the call, the wrapped modules are unflattened (their parameters registered again, as
    ``nn.Parameter``s over ``flat_param``), so their own state_dict code runs as unwrapped; this
    costs a few dict operations per parameter, no copy.
    Attribute access and indexing that the wrapper does not answer fall through to ``module``.

    Args:
        module: the module to wrap.
        param_list: parameters of ``module`` to flatten (duplicates ignored); empty leaves ``module``
            untouched, ``flat_param`` is None and the wrapper is transparent.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``param_list`` is not an iterable of
            ``nn.Parameter``.
        ValueError: a listed parameter is a FlatParameter, is not a parameter of ``module``, or is
            tied by storage to an unlisted tensor; the listed parameters mix dtypes or
            ``requires_grad`` (wrap each group separately).
    """

    def __init__(self, module: nn.Module, param_list: Iterable[nn.Parameter]) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"FlattenParamsWrapper: module must be an nn.Module, got {type(module).__name__}")
        params = _checked_param_list(param_list)
        found = _find_registrations(module, params) if params else None
        super().__init__()
        self._fpw_module = module
        # `self.flat_param` is the registered parameter while flattened, this stash otherwise.
        self.__dict__["_flat"] = None  # FlatParameter | None; __dict__ so nn.Module does not register it
        self._slots: tuple[_Slot, ...] = ()  # per flattened parameter, in flat order: its first registration
        self._ties: tuple[tuple[int, _Slot], ...] = ()  # every further registration, with its flat index
        self._flattened = False
        self._loading = False  # unflattened by the load pre-hook, awaiting the post-hook
        self._owners: tuple[_Owner, ...] = ()  # modules that register flattened parameters
        self.__dict__["_views"] = ()  # the installed views, in flat order (see _set_views)
        self.__dict__["_params"] = ()  # Parameters registered while unflattened (see _unflatten)

        if found is not None:
            _check_uniform(found.slots, found.tensors)
            _check_no_storage_ties(found)
            flat = FlatParameter(found.tensors, found.tensors[0].requires_grad, names=[s.name for s in found.slots])
            self._slots = tuple(found.slots)
            self._ties = tuple(found.ties)
            self._owners = _owners(self._slots, self._ties)
            self.__dict__["_flat"] = flat
            self._flatten()

        # The unflatten hook must run before the prefix hook reads the wrapper's own names (it
        # deregisters flat_param), so it is registered first.
        self.register_load_state_dict_pre_hook(FlattenParamsWrapper._pre_load_hook)
        self.register_load_state_dict_post_hook(FlattenParamsWrapper._post_load_hook)
        register_prefix_hooks(self, FPW_MODULE)

    # -- public surface -----------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (as ``DistributedDataParallel.module``)."""
        return self._fpw_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, children of the wrapper
        except AttributeError:
            # While unflattened (or never flattened), flat_param is not registered but still readable.
            # Not while flattened: then a miss means it is being registered (register_parameter
            # checks hasattr first).
            if name == FLAT_PARAM:  # never the flat_param of a wrapper inside this one
                if not self.__dict__.get("_flattened", False):
                    return self.__dict__["_flat"]
                raise
            return getattr(self._fpw_module, name)

    def __getitem__(self, key: Any) -> Any:
        """Indexing falls through to the wrapped module (an ``nn.Sequential``, ``nn.ModuleList``)."""
        module: Any = self._fpw_module  # nn.Module declares no __getitem__; its subclasses here do
        return module[key]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._finish_interrupted_load()
        if self._flattened:
            # Views made now carry this forward's autograd link to flat_param (views made earlier
            # may be detached, e.g. by copying, or stale after an optimizer replaced .data).
            self._set_views()
        return self._fpw_module(*args, **kwargs)

    @contextlib.contextmanager
    def unflatten_params(self) -> Iterator[None]:
        """Make the listed parameters real ``nn.Parameter``s again for the body; re-flatten on exit.

        Inside, each one is registered where it was (in its original order), holds the current
        values (it shares memory with ``flat_param``), and ``flat_param`` is not registered (still
        readable as ``self.flat_param``). On exit, also when the body raises, the current value of
        each parameter attribute is written into ``flat_param`` (so a parameter replaced inside
        keeps its new value) and the views come back. Gradients accumulated inside are not moved to
        ``flat_param.grad``. Re-entrant: inside, a nested call changes nothing. A no-op for an
        empty ``param_list``.

        Raises (on exit):
            RuntimeError: a parameter was deleted or given another shape inside the body.
        """
        self._finish_interrupted_load()
        if not self._flattened:
            yield
            return
        self._unflatten()
        try:
            yield
        finally:
            self._reflatten(keep_params=False)  # the body had them: the next unflatten makes new ones

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state_dict with its own keys (no ``flat_param``, no wrapper segment).

        Values share memory with ``flat_param`` (as an unwrapped module's share memory with its
        parameters). With ``keep_vars=True`` the parameter values are new ``nn.Parameter``s over
        that memory, not registered anywhere after the call.

        During the call (and during ``load_state_dict``) the wrapped modules are unflattened: each
        sees its parameters registered as ``nn.Parameter``s in their original order, so its own
        ``_save_to_state_dict``/``_load_from_state_dict`` and hooks work as unwrapped. Those
        Parameters are reused by the next call unless they reached user code (``keep_vars=True``,
        :meth:`unflatten_params`) or flat_param's memory moved.
        """
        # nn.Module.state_dict recurses by calling each child's state_dict(), so this override
        # runs at any depth of a model that contains the wrapper.
        self._finish_interrupted_load()
        if not self._flattened:
            return super().state_dict(*args, **kwargs)
        keep_vars = kwargs.get("keep_vars", len(args) > 2 and args[2])  # positional args: deprecated
        self._unflatten()
        try:
            return super().state_dict(*args, **kwargs)
        finally:
            # Without keep_vars the Parameters were seen only by the modules' own state_dict code,
            # so the next call may register them again.
            self._reflatten(keep_params=not keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state_dict keyed like the unwrapped module (``nn.Module.load_state_dict`` semantics).

        Values of flattened parameters are written into ``flat_param``. Errors are the ones the
        unwrapped module raises (``RuntimeError`` naming the keys by their unwrapped FQNs), and a load
        that fails leaves every parameter and buffer as it was (unless ``assign=True``, which
        replaces tensors instead of writing into them).
        """
        # nn.Module.load_state_dict reports every problem at the end, after writing whatever fit
        # (in place, unless assign=True); keep a copy of every tensor it can write into to put back.
        # Flattened parameters are written through to their flat_param, so a copy of each
        # flat_param (this wrapper's and nested ones') covers them: one copy, not one per key.
        tensors = {} if assign else {id(t): t for t in (*self.parameters(), *self.buffers())}
        before = [(t, t.detach().clone()) for t in tensors.values()]
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except BaseException:
            self._finish_interrupted_load()
            with torch.no_grad():
                for live, saved in before:
                    live.copy_(saved)
            raise
        finally:
            self._finish_interrupted_load()

    def extra_repr(self) -> str:
        if self._flat is None:
            return "flat_param=None"
        return f"flat_param: {len(self._slots)} params, {self._flat.full_numel} elements"

    # -- flattening ---------------------------------------------------------------------------

    def _set_views(self, views: Sequence[Tensor] | None = None) -> None:
        """Point every registration of every flattened parameter at its view of flat_param.

        ``views`` (default: new views of flat_param) must be views of flat_param's current memory.
        """
        flat = self._flat
        assert flat is not None and self._flattened
        views = tuple(flat.get_param_views()) if views is None else tuple(views)
        # A plain attribute (not a parameter): the module reads it as before. Invariant: `attr`
        # names no parameter, buffer or submodule of the module (flattening deregistered it, and
        # nn.Module refuses to register a name that is an attribute), so this is what
        # nn.Module.__setattr__ would store; writing __dict__ skips its checks, which would
        # otherwise be paid at every forward.
        for slot, view in zip(self._slots, views):
            slot.module.__dict__[slot.attr] = view
        for index, slot in self._ties:  # every name of a tied parameter gets the same view
            slot.module.__dict__[slot.attr] = views[index]
        self.__dict__["_views"] = views

    def _current_views(self) -> tuple[Tensor, ...] | None:
        """The installed views if they still view flat_param's memory, else None (rebuild them)."""
        views, flat = self._views, self._flat
        assert flat is not None
        # views[0] starts at flat index 0, so equal pointers mean the same memory (the views keep
        # their storage alive, so a replaced flat_param.data cannot reuse the address).
        if len(views) == len(self._slots) and views and views[0].data_ptr() == flat.data_ptr():
            return cast(tuple[Tensor, ...], views)
        return None

    def _flatten(self) -> None:
        """Deregister the listed parameters, register flat_param, install the views."""
        flat = self._flat
        assert flat is not None and not self._flattened
        for owner in self._owners:
            for name in owner.flattened:
                del owner.module._parameters[name]
        self._flattened = True  # first: see __getattr__
        self.register_parameter(FLAT_PARAM, flat)
        self._set_views()

    # Unflattening and re-flattening run around every state_dict() and load_state_dict(), so they
    # edit the owners' `_parameters` dicts directly: nn.Module has no API to register a parameter
    # at a position (the unwrapped key order needs it), and register_parameter/delattr per
    # parameter cost more than the state_dict itself.

    def _unflatten(self) -> None:
        """Register each listed parameter again, as a Parameter over its slice of flat_param."""
        flat = self._flat
        assert flat is not None and self._flattened
        params = self._params
        # Reuse the Parameters of the last state_dict/load if they are still over flat_param's
        # memory: a Parameter per parameter costs as much as the rest of a state_dict() call.
        # They never reached user code (see _reflatten's keep_params), so nothing else can have
        # changed them.
        if not (params and params[0].data_ptr() == flat.data_ptr() and params[0].requires_grad == flat.requires_grad):
            views = self._current_views() or tuple(flat.get_param_views(flat.detach()))
            # nn.Parameter(view) detaches: a leaf sharing the view's memory, as the unwrapped one is.
            params = tuple(nn.Parameter(view, requires_grad=flat.requires_grad) for view in views)
        self.__dict__["_params"] = params
        delattr(self, FLAT_PARAM)
        self._flattened = False
        for owner in self._owners:
            module, registered = owner.module, owner.module._parameters
            others = dict(registered)
            registered.clear()
            # Invariant: each owner's parameters come back in their order from before wrapping
            # (ties included: every name of a parameter gets the same object); parameters
            # registered after wrapping follow.
            for name, index in owner.order:
                if index >= 0:
                    module.__dict__.pop(name, None)  # the plain view attribute
                    registered[name] = params[index]
                elif name in others:
                    registered[name] = others.pop(name)
            registered.update(others)

    def _reflatten(self, keep_params: bool) -> None:
        """Write the current parameter values into flat_param and go back to views.

        Always ends flattened; a parameter that was deleted or reshaped inside keeps the value
        flat_param had, and is reported afterwards. ``keep_params``: the registered Parameters
        were seen only by nn.Module's state_dict/load code (and the modules' own overrides and
        hooks), so the next :meth:`_unflatten` may reuse them; otherwise it makes new ones.
        """
        flat = self._flat
        assert flat is not None and not self._flattened
        problems = []
        base, itemsize = flat.data_ptr(), flat.element_size()
        params, layout = self._params, flat._layout
        with torch.no_grad():
            per_param = zip(params, self._slots, layout.shapes, layout.starts, layout.numels)
            for param, slot, shape, start, numel in per_param:
                value = slot.module._parameters.get(slot.attr)
                if value is not param:
                    keep_params = False  # replaced (load with assign=True) or removed
                    value = getattr(slot.module, slot.attr, None)  # e.g. a plain tensor assigned inside
                if not isinstance(value, Tensor):
                    problems.append(f"{slot.name!r} was removed (expected a tensor of shape {tuple(shape)})")
                elif value.shape != shape:
                    problems.append(f"{slot.name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
                elif value.data_ptr() != base + start * itemsize or value.dtype != flat.dtype:
                    # Replaced inside the body (e.g. load with assign=True, or .data set by
                    # .to()): copy into the slice, and make new Parameters next time.
                    flat.detach()[start : start + numel].copy_(value.reshape(-1))
                    keep_params = False
        for owner in self._owners:
            for name in owner.flattened:
                owner.module._parameters.pop(name, None)
                owner.module.__dict__.pop(name, None)  # a plain tensor assigned inside the body
        if not keep_params:
            self.__dict__["_params"] = ()
        self._flattened = True  # first: see __getattr__
        self.register_parameter(FLAT_PARAM, flat)
        self._set_views(self._current_views())
        if problems:
            raise RuntimeError(
                "unflatten_params: cannot re-flatten: " + "; ".join(problems) + " (flat_param kept its old values)"
            )

    # -- state_dict / load_state_dict support ----------------------------------------------------

    @staticmethod
    def _pre_load_hook(module: FlattenParamsWrapper, *args: Any) -> None:
        # Load into real parameters (so the wrapped modules' own _load_from_state_dict and hooks see
        # what they expect); the post-hook writes them back into flat_param.
        if module._flattened:
            module._unflatten()
            module._loading = True  # torch writes in place (or assigns: _reflatten notices)

    @staticmethod
    def _post_load_hook(module: FlattenParamsWrapper, incompatible_keys: Any) -> None:
        module._finish_interrupted_load()

    def _finish_interrupted_load(self) -> None:
        """Re-flatten after a load that unflattened (normally the post-hook; after an error, the next use)."""
        if self._loading:
            self._loading = False
            self._reflatten(keep_params=True)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> FlattenParamsWrapper:
        # .to()/.cuda()/.double() may replace flat_param by a plain Parameter (on a device change, or
        # with swap_module_params_on_conversion), and always leave the views on the old memory.
        flat = self._flat
        nn.Module._apply(self, fn, *args, **kwargs)  # not super(): mypy checks the call only this way
        if flat is None:
            return self
        if self._flattened:
            current = dict(self.named_parameters(recurse=False))[FLAT_PARAM]
        else:  # inside unflatten_params(): the stash is not registered, so convert it here
            with torch.no_grad():
                current = fn(flat)
        if not isinstance(current, FlatParameter):
            rebuilt = _rebuild_flat_param(current.data, flat.requires_grad, flat._layout, flat.shard_range)
            rebuilt.grad = current.grad
            if self._flattened:
                delattr(self, FLAT_PARAM)
                self.register_parameter(FLAT_PARAM, rebuilt)
            current = rebuilt
        self.__dict__["_flat"] = current
        if self._flattened:
            self._set_views()
        return self

    # -- copying ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # The views are plain attributes of the wrapped modules and may carry autograd history,
        # which neither deepcopy nor pickle accepts. Swap in detached views (same memory, same
        # values) before the module tree is copied; __setstate__ rebuilds them on the copy.
        if self._flattened:
            with torch.no_grad():
                self._set_views()
        state = dict(nn.Module.__getstate__(self))
        state["_views"] = ()  # the views are the modules' attributes; __setstate__ rebuilds them
        state["_params"] = ()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        if self._flattened:
            self._set_views()


# The canonical-FQN rule (reference.fqn) skips the wrapper's segment.
register_wrapper(FlattenParamsWrapper, FPW_MODULE)


def _checked_param_list(param_list: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """``param_list`` as a list of distinct parameters (first occurrence kept), type-checked."""
    if isinstance(param_list, (Tensor, nn.Module, str)) or not isinstance(param_list, Iterable):
        raise TypeError(
            f"FlattenParamsWrapper: param_list must be an iterable of nn.Parameter, got {type(param_list).__name__}"
        )
    seen: dict[int, nn.Parameter] = {}
    for i, p in enumerate(param_list):
        # A plain nn.Parameter passes both checks; each runs nn.Parameter's Python-level metaclass
        # isinstance check, a cost per parameter, so only other types are checked.
        if type(p) is not nn.Parameter:
            if not isinstance(p, nn.Parameter):
                raise TypeError(
                    f"FlattenParamsWrapper: param_list[{i}] must be an nn.Parameter, got {type(p).__name__}"
                )
            if isinstance(p, FlatParameter):
                raise ValueError(
                    f"FlattenParamsWrapper: param_list[{i}] is a FlatParameter (of a wrapper inside this module); "
                    f"nesting FlatParameters is not supported: list the inner module's other parameters only"
                )
        seen.setdefault(id(p), p)
    return list(seen.values())


class _Registrations(NamedTuple):
    """Where the listed parameters are registered in a module, and what else it holds (see _find_registrations)."""

    tensors: list[nn.Parameter]  # each listed parameter once, in module order: the flat order
    slots: list[_Slot]  # the first registration of each, in the same order (its name is the parameter's)
    ties: list[tuple[int, _Slot]]  # every further registration, with its parameter's flat index
    unlisted: list[tuple[str, Tensor]]  # the other parameters and the buffers, for the storage-tie check


def _find_registrations(module: nn.Module, params: list[nn.Parameter]) -> _Registrations:
    """Every registration of each listed parameter in ``module`` in module order, and the other tensors."""
    listed = {id(p) for p in params}
    flat_index: dict[int, int] = {}  # id of a listed parameter -> its flat index
    found = _Registrations([], [], [], [])
    # Names as the state_dict uses them: without the segments of wrappers nested inside `module`.
    # `_parameters` rather than named_parameters(recurse=False), which reads the same dict through
    # two generators per module: with wrappers nested n deep the walks visit O(n^2) modules, and
    # those generators were a tenth of a deep wrapping's time.
    for module_name, submodule in clean_named_modules(module):
        prefix = f"{module_name}." if module_name else ""
        for attr, p in submodule._parameters.items():
            if p is None:
                continue
            if id(p) not in listed:
                found.unlisted.append((prefix + attr, p))
            elif id(p) in flat_index:
                found.ties.append((flat_index[id(p)], _Slot(prefix + attr, submodule, attr)))
            else:
                flat_index[id(p)] = len(found.slots)
                found.slots.append(_Slot(prefix + attr, submodule, attr))
                found.tensors.append(p)
        buffers = submodule.named_buffers(recurse=False, remove_duplicate=False)
        found.unlisted.extend((prefix + attr, b) for attr, b in buffers)
    for i, p in enumerate(params):
        if id(p) not in flat_index:
            raise ValueError(
                f"FlattenParamsWrapper: param_list holds a parameter that is not a parameter of the wrapped "
                f"{type(module).__name__} (position {i} after removing duplicates, shape {tuple(p.shape)}, "
                f"dtype {p.dtype})"
            )
    return found


def _check_uniform(primaries: list[_Slot], tensors: Sequence[Tensor]) -> None:
    """Invariant: one dtype and one requires_grad per flat parameter (one tensor, one grad flag)."""
    for attr, hint in (("dtype", ""), ("requires_grad", "; wrap frozen and trainable parameters separately")):
        first = getattr(tensors[0], attr)
        for slot, t in zip(primaries, tensors):
            if getattr(t, attr) != first:
                raise ValueError(
                    f"FlattenParamsWrapper: all listed parameters must have one {attr}: {primaries[0].name!r} has "
                    f"{first}, {slot.name!r} has {getattr(t, attr)}{hint}"
                )


def _byte_span(t: Tensor) -> tuple[int, int, int]:
    """(storage pointer, first byte, one past the last byte) of the memory ``t`` can touch."""
    size = t.element_size()
    first = int(t.storage_offset())
    last = first + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), first * size, (last + 1) * size


def _check_no_storage_ties(found: _Registrations) -> None:
    """Refuse a listed parameter whose memory overlaps an unlisted parameter or buffer of the module."""
    spans: dict[int, list[tuple[int, int, str]]] = {}  # storage pointer -> (first byte, end byte, name)
    for name, t in found.unlisted:
        if t.numel() > 0 and t.device.type != "meta":
            ptr, lo, hi = _byte_span(t)
            spans.setdefault(ptr, []).append((lo, hi, name))
    if not spans:
        return
    # Per storage, the unlisted spans sorted by first byte, and for each the furthest end byte of it
    # and the spans before it (with that span's name): a listed span [lo, hi) meets an unlisted one
    # iff, among those that start before hi, the furthest end lies past lo. One sort, then a binary
    # search per listed parameter, however many tensors share a storage.
    index: dict[int, tuple[list[int], list[tuple[int, str]]]] = {}
    for ptr, group in spans.items():
        group.sort()
        index[ptr] = ([lo for lo, _, _ in group], list(accumulate(((hi, name) for _, hi, name in group), max)))
    for slot, t in zip(found.slots, found.tensors):
        if t.is_meta:
            continue
        # The storage's address without making a storage object (the full span only on a match).
        if t.data_ptr() - t.storage_offset() * t.element_size() not in index or t.numel() == 0:
            continue
        ptr, lo, hi = _byte_span(t)
        starts, reach = index[ptr]
        before = bisect_left(starts, hi)  # the unlisted spans that start before this one ends
        if before and reach[before - 1][0] > lo:
            other_name = reach[before - 1][1]
            raise ValueError(
                f"FlattenParamsWrapper: listed parameter {slot.name!r} shares memory with {other_name!r}, which is "
                f"not listed; flattening copies {slot.name!r} and would cut that tie. List both or neither"
            )
