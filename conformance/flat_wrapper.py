"""The suite's own flat-parameter wrapper: a test input, not an implementation under test.

Some tests hand the implementation a model wrapped the way third-party flattening wrappers (fairscale's
``FlattenParamsWrapper`` and the like) wrap one: the trainable parameters live in one flat
``nn.Parameter``, the modules read views of it, and the state dict still shows the original keys.
The suite builds that input itself, here, rather than borrowing the reference's wrapper: an input
made by the implementation that the suite checks (the reference is one) cannot catch a bug the two
share. Like :mod:`conformance.fqn`, the suite's own FQN oracle, it is written independently of
``reference/`` and kept minimal: only what the tests need. Self-tests: ``tests/test_flat_wrapper.py``.

What :class:`FlatParamsWrapper` does:

- ``flat_param`` holds the listed parameters, flattened and concatenated in the order given; each of
  them stops being a registered parameter, and every name it was registered under (ties included)
  becomes a plain attribute holding a view of its slice of ``flat_param`` (rebuilt at every forward,
  so that gradients reach ``flat_param``).
- The wrapped module is the child ``_fpw_module`` (the segment fairscale's wrapper uses, which
  :data:`conformance.fqn.WRAPPER_SEGMENTS` lists); attributes the wrapper does not have are looked up
  on it, as DDP-style wrappers do.
- ``state_dict()`` has the unwrapped module's keys, in its order: no ``_fpw_module.`` segment, no
  ``flat_param`` key; values share memory with ``flat_param``. ``load_state_dict()`` takes those
  keys and writes the values into ``flat_param``; missing, unexpected and mis-shaped keys are
  reported by their unwrapped names (a ``flat_param`` key is unexpected). This holds wherever the
  wrapper sits in a larger model. The ``_metadata`` of a state dict keeps the raw module paths.

How: a state_dict or load pre-hook registers each flattened parameter again where it was, as an
``nn.Parameter`` over its view (so the wrapped modules save and load as if unwrapped), and the
matching post-hook renames the keys and goes back to views. Public ``nn.Module`` hook APIs only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["FlatParamsWrapper", "FLAT_PARAM", "WRAPPED_MODULE"]

#: Name of the wrapper's flat parameter.
FLAT_PARAM = "flat_param"
#: Name of the child holding the wrapped module; hidden from state dict keys.
WRAPPED_MODULE = "_fpw_module"


class _Slot(NamedTuple):
    """One registration of a flattened parameter: ``owner.<attr>``, holding slice ``flat_index`` of flat_param."""

    owner: nn.Module
    attr: str
    flat_index: int


class FlatParamsWrapper(nn.Module):
    """``module`` with the parameters of ``params`` held in one flat parameter, ``self.flat_param``.

    Args:
        module: the module to wrap.
        params: parameters of ``module`` (duplicates ignored), at least one; one dtype, one device and
            one ``requires_grad``.

    Raises:
        ValueError: ``params`` is empty, holds a tensor that is not a parameter of ``module``, or mixes
            dtypes, devices or ``requires_grad``.
    """

    def __init__(self, module: nn.Module, params: Iterable[nn.Parameter]) -> None:
        super().__init__()
        listed = list({id(p): p for p in params}.values())
        if not listed:
            raise ValueError("FlatParamsWrapper: params is empty")
        for attr in ("dtype", "device", "requires_grad"):
            if len({getattr(p, attr) for p in listed}) > 1:
                raise ValueError(f"FlatParamsWrapper: the params mix {attr}s: {sorted({str(getattr(p, attr)) for p in listed})}")
        index = {id(p): i for i, p in enumerate(listed)}
        slots: list[_Slot] = []
        # Per module holding a listed parameter: the names of its parameters in registration order,
        # to register them again in that order (the order of the unwrapped state dict).
        orders: list[tuple[nn.Module, tuple[str, ...]]] = []
        for _, owner in module.named_modules():
            own = list(owner.named_parameters(recurse=False, remove_duplicate=False))
            mine = [_Slot(owner, attr, index[id(p)]) for attr, p in own if id(p) in index]
            if mine:
                slots.extend(mine)
                orders.append((owner, tuple(attr for attr, _ in own)))
        missing = set(index.values()) - {slot.flat_index for slot in slots}
        if missing:
            raise ValueError(f"FlatParamsWrapper: params[{min(missing)}] is not a parameter of the wrapped {type(module).__name__}")

        self.add_module(WRAPPED_MODULE, module)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in listed])
        self.register_parameter(FLAT_PARAM, nn.Parameter(flat, requires_grad=listed[0].requires_grad))
        self._shapes = tuple(p.shape for p in listed)
        self._slots = tuple(slots)
        self._orders = tuple(orders)
        self._unflattened = False
        for slot in self._slots:
            delattr(slot.owner, slot.attr)
        with torch.no_grad():
            self._set_views()
        self.register_state_dict_pre_hook(_pre_state_dict)
        self.register_state_dict_post_hook(_post_state_dict)
        self.register_load_state_dict_pre_hook(_pre_load)
        self.register_load_state_dict_post_hook(_post_load)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        wrapped = self._modules[WRAPPED_MODULE]
        assert wrapped is not None  # registered in __init__
        return wrapped

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            # Never the flat_param of a wrapper inside: registering ours checks that the name is free.
            if name == FLAT_PARAM or WRAPPED_MODULE not in modules:
                raise
            return getattr(modules[WRAPPED_MODULE], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._flatten()  # after a load that raised before its post-hook
        self._set_views()  # views made now carry this forward's autograd link to flat_param
        return self.module(*args, **kwargs)

    def _views(self) -> list[torch.Tensor]:
        flat = self.flat_param
        pieces = flat.split([s.numel() for s in self._shapes])
        return [piece.view(shape) for piece, shape in zip(pieces, self._shapes)]

    def _set_views(self) -> None:
        views = self._views()
        for slot in self._slots:
            setattr(slot.owner, slot.attr, views[slot.flat_index])

    def _unflatten(self) -> None:
        """Register every flattened parameter again where it was, in its place among the module's own
        parameters, as an ``nn.Parameter`` over its slice of flat_param (memory shared, no copy)."""
        if self._unflattened:
            return
        with torch.no_grad():
            params = [nn.Parameter(view, requires_grad=self.flat_param.requires_grad) for view in self._views()]
        flattened = {(id(slot.owner), slot.attr): slot.flat_index for slot in self._slots}
        for owner, names in self._orders:
            registered = dict(owner.named_parameters(recurse=False, remove_duplicate=False))
            later = [name for name in registered if name not in names]  # registered after wrapping
            for name in (*names, *later):
                if hasattr(owner, name):
                    delattr(owner, name)
            for name in (*names, *later):
                i = flattened.get((id(owner), name))
                if i is not None:
                    owner.register_parameter(name, params[i])
                elif name in registered:
                    owner.register_parameter(name, registered[name])
        self._unflattened = True

    def _flatten(self) -> None:
        """Back to views; a parameter a load replaced (``assign=True``) is copied into flat_param first."""
        if not self._unflattened:
            return
        with torch.no_grad():
            for view, slot in zip(self._views(), self._first_slots()):
                value = getattr(slot.owner, slot.attr)
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value)
        for slot in self._slots:
            delattr(slot.owner, slot.attr)
        self._unflattened = False
        with torch.no_grad():
            self._set_views()

    def _first_slots(self) -> list[_Slot]:
        """The first registration of each flattened parameter, in flat order."""
        first: dict[int, _Slot] = {}
        for slot in self._slots:
            first.setdefault(slot.flat_index, slot)
        return [first[i] for i in range(len(self._shapes))]


def _unwrapped_key(key: str, prefix: str) -> str:
    """``key`` without the wrapper's segment (``P_fpw_module.rest`` -> ``Prest``)."""
    inner = prefix + WRAPPED_MODULE + "."
    return prefix + key[len(inner) :] if key.startswith(inner) else key


def _pre_state_dict(wrapper: FlatParamsWrapper, prefix: str, keep_vars: bool) -> None:
    wrapper._flatten()  # after a load that raised before its post-hook
    wrapper._unflatten()


# A post-hook registered through the public API must edit the dict in place (returning one is an error).
def _post_state_dict(wrapper: FlatParamsWrapper, destination: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    wrapper._flatten()
    # The wrapper's keys were written last: they are the tail of `destination`, in the unwrapped order.
    tail = [key for key in destination if key.startswith(prefix)]
    values = [destination.pop(key) for key in tail]
    for key, value in zip(tail, values):
        if key != prefix + FLAT_PARAM:
            destination[_unwrapped_key(key, prefix)] = value


def _pre_load(
    wrapper: FlatParamsWrapper,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    wrapper._unflatten()
    # `state_dict` is torch's own copy for this subtree: renaming in place leaves the caller's dict alone.
    # Every key moves under the wrapped module, a `flat_param` key too (which it then reports unexpected).
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + WRAPPED_MODULE + "." + key[len(prefix) :]] = state_dict.pop(key)
    wrapper.__dict__["_load_frame"] = (prefix, error_msgs, len(error_msgs))


def _post_load(wrapper: FlatParamsWrapper, incompatible_keys: Any) -> None:
    prefix, error_msgs, first_error = wrapper.__dict__.pop("_load_frame")
    wrapper._flatten()
    missing = [key for key in incompatible_keys.missing_keys if key != prefix + FLAT_PARAM]
    incompatible_keys.missing_keys[:] = [_unwrapped_key(key, prefix) for key in missing]
    incompatible_keys.unexpected_keys[:] = [_unwrapped_key(key, prefix) for key in incompatible_keys.unexpected_keys]
    inner = prefix + WRAPPED_MODULE + "."
    for i in range(first_error, len(error_msgs)):
        error_msgs[i] = error_msgs[i].replace(inner, prefix)
