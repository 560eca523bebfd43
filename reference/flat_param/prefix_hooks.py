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

Cost: ``state_dict()`` renames each key once, whatever the nesting: a wrapper inside another one's
hidden child leaves its keys to the enclosing wrapper, which renames its whole subtree at its end
(the tail of the destination its ``state_dict`` call wrote). Loading touches the keys under each
wrapper, ``O(keys * d)`` for wrappers nested ``d`` deep, the same order as
``nn.Module.load_state_dict``'s own recursion (it filters the keys again for every child).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

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


@dataclass
class _SaveFrame:
    """A wrapper whose ``state_dict`` is running, as its post-hook needs to know (see _post_state_dict)."""

    # A weak reference: a frame left by an error holds no module, and a wrapper created later at the
    # same address (an id() reused) is never taken for the one that left it.
    wrapper: weakref.ref[nn.Module]
    prefix: str  # the wrapper's prefix in this call, e.g. "encoder."
    inner: str  # the prefix of its hidden child in this call, e.g. "encoder._fpw_module."
    hidden: list[str] = field(default_factory=list)  # hidden-child prefixes of wrappers inside, left to it


# state_dict pre-hook -> post-hook hand-over, innermost last; per thread, as state_dict calls are.
_SAVING = threading.local()


def _save_frames() -> list[_SaveFrame]:
    frames = getattr(_SAVING, "frames", None)
    if frames is None:
        frames = _SAVING.frames = []
    return frames


# Load pre-hook -> post-hook hand-over; transient, so kept out of the modules (and their pickles).
_LOAD_FRAMES: weakref.WeakKeyDictionary[nn.Module, list[_LoadFrame]] = weakref.WeakKeyDictionary()


def _own_names(wrapper: nn.Module, child_name: str) -> set[str]:
    """First key segments that belong to the wrapper itself rather than to the wrapped child."""
    names = {name for name, _ in wrapper.named_parameters(recurse=False)}
    names.update(name for name, _ in wrapper.named_buffers(recurse=False))
    names.update(name for name, _ in wrapper.named_children() if name != child_name)
    # The wrapper's own extra state, if its class has one; otherwise "_extra_state" is the wrapped
    # module's (a model whose root keeps extra state, wrapped whole).
    if type(wrapper).get_extra_state is not nn.Module.get_extra_state:
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
            wrapper.register_state_dict_pre_hook(partial(_pre_state_dict, child_name)),
            wrapper.register_state_dict_post_hook(partial(_post_state_dict, child_name)),
            wrapper.register_load_state_dict_pre_hook(partial(_pre_load, child_name)),
            wrapper.register_load_state_dict_post_hook(partial(_post_load, child_name)),
        )
    )


def _pre_state_dict(child_name: str, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _save_frames().append(_SaveFrame(weakref.ref(module), prefix, prefix + child_name + "."))


def _post_state_dict(
    child_name: str, module: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + child_name + "."
    frames = _save_frames()
    # Invariant (nn.Module.state_dict): pre-hook, subtree, post-hook, so this wrapper's frame is the
    # top one, unless a state_dict call inside the subtree raised and was caught (its frames are
    # above ours: drop them). No frame of ours: the hook was called by hand; rename alone.
    mine = next((i for i in range(len(frames) - 1, -1, -1) if frames[i].wrapper() is module), None)
    hidden = [inner]
    if mine is not None and frames[mine].inner == inner:
        hidden += frames[mine].hidden
        del frames[mine:]
    # Inside an enclosing wrapper's hidden child in the same call: leave the renaming to it, so that
    # every key is renamed once, not once per level.
    if frames and _encloses(frames[-1], module, prefix):
        frames[-1].hidden.extend(hidden)
        return
    if len(hidden) == 1:

        def rename(key: str) -> str:
            return prefix + key[len(inner):] if key.startswith(inner) else key
    else:
        rename = partial(_strip_hidden, inner, _clean_prefixes(hidden))
    # Invariant (nn.Module.state_dict): this hook runs right after the wrapper's subtree was written,
    # so the subtree's keys are the tail of `destination`, and no earlier key starts with `prefix`
    # (a prefix is one path, written once).
    _rename_tail(destination, prefix, rename)
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        own_path = prefix[:-1]

        def rename_path(path: str) -> str:
            # The wrapped module's version entry takes the wrapper's place.
            return own_path if path + "." == inner else rename(path + ".")[:-1]

        _rename_tail(metadata, prefix, rename_path, first=own_path, collisions_ok=True)


def _encloses(frame: _SaveFrame, module: nn.Module, prefix: str) -> bool:
    """Whether ``frame`` is a wrapper whose running ``state_dict`` holds ``module`` at ``prefix``, inside
    its hidden child.

    A prefix alone cannot tell: prefixes are relative to the module a ``state_dict`` call started at,
    and a frame may be left by a call that raised and was caught (a module's ``get_extra_state`` that
    reads a wrapped child's ``state_dict``). That frame's hidden prefix may well start ``prefix``, yet
    its wrapper's post-hook never runs: keys left to it would keep their hidden segments. So the
    module must also be the frame's wrapper's submodule at the path between them; the path is the
    distance to the nearest enclosing wrapper, so the check costs that path's length.
    """
    if not prefix.startswith(frame.inner):
        return False
    owner = frame.wrapper()
    if owner is None:
        return False
    try:
        return owner.get_submodule(prefix[len(frame.prefix) : -1]) is module
    except AttributeError:
        return False


def _clean_prefixes(hidden: list[str]) -> dict[str, str]:
    """Each hidden-child prefix (``"a._fpw_module.b._ckpt."``) mapped to its clean form (``"a.b."``)."""
    hidden_set = set(hidden)
    clean = {}
    for h in hidden:
        kept, path = [], ""
        for part in h[:-1].split("."):
            path += part + "."
            if path not in hidden_set:
                kept.append(part + ".")
        clean[h] = "".join(kept)
    return clean


def _strip_hidden(inner: str, clean: dict[str, str], key: str) -> str:
    """``key`` without hidden segments; ``clean`` maps every hidden prefix below ``inner`` (included)."""
    if not key.startswith(inner):
        return key
    # The longest hidden prefix of `key` is the last one on its path: search from the right, so
    # that the cost is the key's depth below its innermost wrapper, not the nesting depth.
    end = len(key)
    while end > 0:
        end = key.rfind(".", 0, end)
        head = key[: end + 1]
        if head in clean:
            return clean[head] + key[end + 1 :]
    return key  # unreachable: `inner` is a hidden prefix of `key`


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
    tail.reverse()
    renamed = [rename(key) for key in tail]
    if renamed == tail:
        return
    if len(tail) == len(mapping):  # the wrapper is the root of this call: one clear, not a pop per key
        values = list(mapping.values())
        mapping.clear()
    else:
        values = [mapping.pop(key) for key in tail]
    for key, new_key, value in zip(tail, renamed, values):
        if new_key in mapping and not collisions_ok:
            raise RuntimeError(
                f"state_dict: key {new_key!r} is written twice: once by the wrapper itself and once as "
                f"{key!r} by the module it wraps; rename one of them"
            )
        mapping[new_key] = value
