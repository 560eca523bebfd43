"""State-dict hooks that hide one path segment: the child a wrapper module keeps its wrapped module in.

A wrapper that stores the module it wraps as a child (``FlattenParamsWrapper._fpw_module``, an
activation-checkpoint wrapper's ``_checkpoint_wrapped_module``) adds that child's name to every key
below it. :func:`register_prefix_hooks` registers four hooks on the wrapper so that

- ``state_dict()`` saves ``P<child>.rest`` as ``Prest`` (``P`` is the wrapper's own prefix), and the
  ``_metadata`` entry of the wrapped module takes the wrapper's place;
- ``load_state_dict()`` reads ``Prest`` back into ``P<child>.rest``, and the missing/unexpected keys
  and error messages it reports name ``Prest`` again.

This holds at any nesting: the hooks run wherever the wrapper sits in a larger model, and wrappers
inside wrappers each remove their own segment. Keys of the wrapper's own parameters and buffers, and of
its other children, keep their names.

Cost: each hook touches only the keys under its wrapper (the state_dict post-hook walks the tail of
the destination that its own ``state_dict`` call wrote), so a model with wrappers nested ``d`` deep
costs ``O(keys * d)``, the same order as ``nn.Module.load_state_dict``'s own recursion.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, NamedTuple

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = ["PrefixHookHandles", "register_prefix_hooks", "hidden_child", "clean_named_modules"]

# Set in the wrapper's __dict__ by register_prefix_hooks: the name of the child it hides.
_HIDDEN_CHILD_ATTR = "_state_dict_hidden_child"


@dataclass(frozen=True)
class PrefixHookHandles:
    """The handles of the hooks :func:`register_prefix_hooks` registered; ``remove()`` removes them all."""

    handles: tuple[RemovableHandle, ...]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _LoadFrame(NamedTuple):
    """What the load pre-hook remembers for the matching post-hook (which is not given the prefix)."""

    prefix: str  # the wrapper's prefix in this load, e.g. "encoder." ("" at the root)
    error_msgs: list[str]  # torch's list of error messages of this load
    first_error: int  # index of the first message written below this wrapper


# Load pre-hook -> post-hook hand-over; transient, so kept out of the modules (and their pickles).
_LOAD_FRAMES: weakref.WeakKeyDictionary[nn.Module, list[_LoadFrame]] = weakref.WeakKeyDictionary()


def _own_names(wrapper: nn.Module, child_name: str) -> set[str]:
    """First key segments that belong to the wrapper itself rather than to the wrapped child."""
    names = {name for name, _ in wrapper.named_parameters(recurse=False)}
    names.update(name for name, _ in wrapper.named_buffers(recurse=False))
    names.update(name for name, _ in wrapper.named_children() if name != child_name)
    names.add("_extra_state")
    return names


def hidden_child(module: nn.Module) -> str | None:
    """The child name ``module`` hides from state_dict keys (see :func:`register_prefix_hooks`), or None."""
    # Read from __dict__: wrappers often forward unknown attributes to the module they wrap.
    return module.__dict__.get(_HIDDEN_CHILD_ATTR)


def clean_named_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()`` with the hidden segments of wrappers removed from the paths.

    These are the paths the state_dict keys use (``"layers.0"`` rather than
    ``"layers._fpw_module.0"``). Each module is yielded once, at its first path, as ``named_modules``
    does; a wrapper and the module it wraps share one path and are both yielded.
    """
    memo: set[int] = set()

    def walk(m: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        if id(m) in memo:
            return
        memo.add(id(m))
        yield path, m
        hidden = hidden_child(m)
        for name, child in m.named_children():
            if name == hidden:
                child_path = path
            else:
                child_path = f"{path}.{name}" if path else name
            yield from walk(child, child_path)

    yield from walk(module, prefix)


def register_prefix_hooks(wrapper: nn.Module, child_name: str) -> PrefixHookHandles:
    """Hide ``wrapper.<child_name>`` from the state_dict keys of ``wrapper`` (see the module docstring).

    Call once, from the wrapper's ``__init__``, after ``child_name`` is registered as a child. The
    hooks use only the public hook APIs of ``nn.Module`` and are module-level functions bound with
    :func:`functools.partial`, so the wrapper still deep-copies and pickles. They read the child's
    name, not the child, so replacing the child object later is fine. The name is recorded on the
    wrapper for :func:`hidden_child` and :func:`clean_named_modules`.

    Raises:
        TypeError: ``wrapper`` is not an ``nn.Module``.
        ValueError: ``child_name`` is empty or contains ``"."``, or the wrapper already hides a child.
    """
    if not isinstance(wrapper, nn.Module):
        raise TypeError(f"register_prefix_hooks: wrapper must be an nn.Module, got {type(wrapper).__name__}")
    if not child_name or "." in child_name:
        raise ValueError(f"register_prefix_hooks: child_name must be one path segment, got {child_name!r}")
    if hidden_child(wrapper) is not None:
        raise ValueError(
            f"register_prefix_hooks: {type(wrapper).__name__} already hides child {hidden_child(wrapper)!r}"
        )
    wrapper.__dict__[_HIDDEN_CHILD_ATTR] = child_name
    return PrefixHookHandles(
        (
            wrapper.register_state_dict_post_hook(partial(_post_state_dict, child_name)),
            wrapper.register_load_state_dict_pre_hook(partial(_pre_load, child_name)),
            wrapper.register_load_state_dict_post_hook(partial(_post_load, child_name)),
        )
    )


def _post_state_dict(
    child_name: str, module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + child_name + "."
    # Invariant (nn.Module.state_dict): this hook runs right after the wrapper's subtree was written,
    # so the subtree's keys are the tail of `destination`, and no earlier key starts with `prefix`
    # (a prefix is one path, written once).
    _rename_tail(destination, prefix, lambda key: prefix + key[len(inner):] if key.startswith(inner) else key)
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        own_path, inner_path = prefix[:-1], inner[:-1]

        def rename_path(path: str) -> str:
            if path == inner_path:
                return own_path  # the wrapped module's version entry takes the wrapper's place
            return prefix + path[len(inner):] if path.startswith(inner) else path

        _rename_tail(metadata, prefix, rename_path, first=own_path, collisions_ok=True)


def _pre_load(
    child_name: str,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    # The post-hook is not given the prefix; a stack because one wrapper object can sit at two paths
    # of a model (a shared submodule).
    _LOAD_FRAMES.setdefault(module, []).append(_LoadFrame(prefix, error_msgs, len(error_msgs)))
    own = _own_names(module, child_name)
    segment = child_name + "."
    # `state_dict` is torch's private copy for this subtree (a fresh dict per child), so renaming in
    # place never touches the caller's dict. Keys that already carry the segment are moved too:
    # `P<child>.x` is not a key of the unwrapped model, so it must come out unexpected under that name.
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if rest.split(".", 1)[0] in own:
            continue
        state_dict[prefix + segment + rest] = state_dict.pop(key)


def _post_load(child_name: str, module: nn.Module, incompatible_keys: Any) -> None:
    frames = _LOAD_FRAMES.get(module)
    if not frames:  # only if someone calls this hook by hand
        return
    prefix, error_msgs, first_error = frames.pop()
    inner = prefix + child_name + "."
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        for i, key in enumerate(keys):
            if key.startswith(inner):
                keys[i] = prefix + key[len(inner):]
    for i in range(first_error, len(error_msgs)):
        error_msgs[i] = error_msgs[i].replace(inner, prefix)


def _rename_tail(
    mapping: dict[str, Any],
    prefix: str,
    rename: Any,
    first: str | None = None,
    collisions_ok: bool = False,
) -> None:
    """Rename the trailing keys of ``mapping`` that start with ``prefix`` (or equal ``first``), in order.

    Only the tail is walked, from the end, so the cost is the size of the wrapper's subtree.
    """
    tail: list[str] = []
    for key in reversed(mapping):
        if not (key.startswith(prefix) or key == first):
            break
        tail.append(key)
    if not any(rename(key) != key for key in tail):
        return
    items = [(key, mapping.pop(key)) for key in reversed(tail)]
    for key, value in items:
        new_key = rename(key)
        if new_key in mapping and not collisions_ok:
            raise RuntimeError(
                f"state_dict: key {new_key!r} is written twice: once by the wrapper itself and once as "
                f"{key!r} by the module it wraps; rename one of them"
            )
        mapping[new_key] = value
