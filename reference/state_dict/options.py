"""The options of :mod:`reference.state_dict` and what a non-strict load reports (names and defaults as in
``torch.distributed.checkpoint.state_dict``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["StateDictOptions", "IncompatibleKeys"]


@dataclass
class StateDictOptions:
    """How get/set state_dict behave. Fields and defaults are those of torch's ``StateDictOptions``."""

    #: Gather sharded values: every tensor of the result is a plain tensor of the full (unsharded)
    #: shape. When False, a sharded model gives its per-rank shards as DTensors.
    full_state_dict: bool = False
    #: Put every tensor of the result on CPU. With ``full_state_dict`` in a process group, only the
    #: coordinator, the first rank of the model's group ("rank 0"), gets the state dict (the others get
    #: an empty one), so that N ranks do not hold N CPU copies.
    cpu_offload: bool = False
    #: Leave parameters with ``requires_grad=False`` out of the model state dict on get, and do not
    #: require them on set.
    ignore_frozen_params: bool = False
    #: With ``submodules``: keep each entry's full FQN (True) or strip the submodule's path (False).
    keep_submodule_prefixes: bool = True
    #: On set: a missing or unexpected key is an error (nothing is loaded) instead of being reported.
    strict: bool = True
    #: On set: the full state dict is present on the coordinator ("rank 0": the first rank of the
    #: model's group) only; it is broadcast to every rank and loaded there. Requires ``full_state_dict``.
    broadcast_from_rank0: bool = False
    #: Optimizer state dicts are one flat ``{"state.<fqn>.<name>": v, "param_groups.<fqn>.<k>": v}``.
    flatten_optimizer_state_dict: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """The rules spanning two fields; checked at construction and again by every set (the fields
        stay assignable)."""
        # Broadcasting sends full tensors, so the dict must be a full one.
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError("StateDictOptions: broadcast_from_rank0=True requires full_state_dict=True")


class IncompatibleKeys(NamedTuple):
    """What a non-strict load did not match: model keys left untouched, and given keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]
