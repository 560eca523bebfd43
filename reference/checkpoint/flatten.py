"""Nested state dicts <-> flat keys, with DCP's key names.

A checkpoint stores one entry per *flat key*: the path of a value in the nested state dict joined by
dots (``{"state": {0: {"step": t}}}`` -> ``"state.0.step"``). The rules are DCP's (torch >= 2.4), because
matching key names is what lets a checkpoint written here load with ``torch.distributed.checkpoint``
and the reverse:

- a mapping is always descended into; its keys become ``str(key)``;
- a list is descended into (its indices become path items) only if it holds, at any depth, a tensor
  or a mapping; otherwise the whole list is one value, as is every tuple and every other object.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ObjPath", "FlatStateDict", "flatten_state_dict", "get_value", "set_value"]

#: Where a value lives in a nested state dict: the keys (``str``) and list indices (``int``) leading to it.
ObjPath = tuple[str | int, ...]


def _is_leaf(value: Any) -> bool:
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    # A list is a leaf unless it holds a tensor or a container that is itself not a leaf.
    return not any(isinstance(v, torch.Tensor) or not _is_leaf(v) for v in value)


@dataclass(frozen=True)
class FlatStateDict:
    """A nested state dict seen as flat keys. ``values`` holds the same objects (nothing copied).

    ``paths`` are DCP's paths (mapping keys as ``str``), stored in the checkpoint metadata;
    ``native_paths`` keep the original key objects (an optimizer's ``int`` parameter ids) so that
    :func:`set_value` replaces values where they are instead of adding a ``"0"`` beside ``0``."""

    values: dict[str, Any]
    paths: dict[str, ObjPath]
    native_paths: dict[str, tuple[Any, ...]]


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> FlatStateDict:
    """Flatten ``state_dict`` by the rules above.

    Raises ValueError if two paths flatten to one key (``{"a.b": x, "a": {"b": y}}``)."""
    flat: dict[str, Any] = {}
    paths: dict[str, ObjPath] = {}
    native: dict[str, tuple[Any, ...]] = {}

    def visit(path: ObjPath, native_path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), native_path + (k,), v)
        elif not _is_leaf(value):
            for i, v in enumerate(value):
                visit(path + (i,), native_path + (i,), v)
        else:
            key = ".".join(map(str, path))
            if key in flat:
                raise ValueError(
                    f"state dict paths {paths[key]!r} and {path!r} both flatten to the key {key!r}; rename one"
                )
            flat[key] = value
            paths[key] = path
            native[key] = native_path

    for k, v in state_dict.items():
        visit((str(k),), (k,), v)
    return FlatStateDict(flat, paths, native)


def get_value(root: Mapping[Any, Any], native_path: tuple[Any, ...]) -> Any:
    """The value at ``native_path`` (from :attr:`FlatStateDict.native_paths` of ``root``)."""
    value: Any = root
    for item in native_path:
        value = value[item]
    return value


def set_value(root: MutableMapping[Any, Any], native_path: tuple[Any, ...], value: Any) -> None:
    """Replace the value at ``native_path`` (from :attr:`FlatStateDict.native_paths` of ``root``)."""
    container: Any = root
    for item in native_path[:-1]:
        container = container[item]
    container[native_path[-1]] = value
