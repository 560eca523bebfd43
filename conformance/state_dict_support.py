"""What the SD tests share (conformance/test_state_dict.py, test_state_dict_options.py,
test_module_state.py): the tolerances, the optimizers a load goes from and into, and the per-rank oracle
comparison. The tests' own set-up stays with them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.adapters.base import Adapter
from conformance.adapters.state_dict import StateDictOps
from conformance.asserts import assert_same_state, expected_local_chunk, fail
from conformance.values import perturb_hyperparameters

__all__ = [
    "ATOL",
    "RTOL",
    "TARGET_ONLY_KEY",
    "PROMPTLY_S",
    "sd_ops",
    "add_source_extras",
    "regroup",
    "target_optimizer",
    "per_parameter",
    "localized",
    "assert_matches_oracle",
]

#: Ranks average identical gradients; a sum over ranks may round. Only results of training are compared
#: with this tolerance; whatever a get or set only moves is compared bit for bit.
ATOL, RTOL = 1e-6, 1e-5

#: A param-group key only the target has: loading a group replaces it whole (``Optimizer.load_state_dict``),
#: so a later get must not show it (test_load_replaces_param_groups_whole).
TARGET_ONLY_KEY = "sdc_target_only"

#: Seconds a rank test that a wrong implementation can leave waiting may take. The reference needs about
#: 0.1 s; torch's first FSDP use in fresh rank processes took 21 s on a loaded 2-core machine.
PROMPTLY_S = 30


def sd_ops(impl: Adapter) -> StateDictOps:
    """``impl``'s state_dict functions, or a skip naming what it lacks."""
    return impl.require("state_dict")


def add_source_extras(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What a real run's param groups carry beyond the defaults: ``initial_lr`` (an LR scheduler
    leaves it) and a key of the user's own. A load must carry both."""
    for index, group in enumerate(optim.param_groups):
        group["initial_lr"] = group["lr"] * 2
        group["sdc_custom"] = f"source-{index}"
    return optim


def regroup(groups: list[list[nn.Parameter]], layout: str) -> list[list[nn.Parameter]]:
    """The target's parameter groups for the source's ``groups``: in reverse order, each with its
    parameters reversed ("reversed"); or first split, each group of two or more parameters in two
    halves, then reversed ("regrouped": a load must match groups by parameter, not by position)."""
    if layout == "regrouped":
        groups = [part for g in groups for part in ((g[: len(g) // 2], g[len(g) // 2 :]) if len(g) > 1 else (g,))]
    elif layout != "reversed":
        raise ValueError(f"unknown layout {layout!r}")
    return [list(reversed(g)) for g in reversed(groups)]


def target_optimizer(groups: list[list[nn.Parameter]], layout: str, *, extra_key: bool = False) -> torch.optim.Optimizer:
    """Adam over ``regroup(groups, layout)`` whose every hyperparameter differs from the source's, with
    ``initial_lr`` and the custom key set to other values (and with ``extra_key``, a key the source lacks)."""
    optim = torch.optim.Adam([{"params": g} for g in regroup(groups, layout)])
    perturb_hyperparameters(optim)
    if extra_key:
        for group in optim.param_groups:
            group[TARGET_ONLY_KEY] = "must not survive a load"
    return optim


def per_parameter(osd: Mapping[str, Any], *, sequence_types: bool = False) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (nested or flattened) as ``{"state.<fqn>.<name>": value,
    "param_groups.<fqn>.<key>": value}``: each parameter's state and its group's hyperparameters,
    whatever the group split. Two optimizers that hold the same state with the same hyperparameters
    for the same parameters give equal dicts (compare without order: the split decides the order).
    A hyperparameter that is a tuple is given as a list unless ``sequence_types``: whether a load keeps
    ``betas`` a tuple is checked once, by test_load_replaces_param_groups_whole."""
    if set(osd) == {"state", "param_groups"}:
        flat: dict[str, Any] = {}
        for fqn, state in osd["state"].items():
            flat.update({f"state.{fqn}.{k}": v for k, v in state.items()})
        for group in osd["param_groups"]:
            for fqn in group["params"]:
                flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    else:
        flat = dict(osd)  # already flattened
    if sequence_types:
        return flat
    return {k: list(v) if isinstance(v, tuple) and k.startswith("param_groups.") else v for k, v in flat.items()}


def localized(got: Any, expected: Any) -> tuple[Any, Any]:
    """``got`` and ``expected`` with each DTensor of ``got`` replaced by its local shard and the plain
    tensor at the same place of ``expected`` by the piece of it that this rank must hold
    (:func:`~conformance.asserts.expected_local_chunk` under the DTensor's placements)."""
    if isinstance(got, DTensor) and isinstance(expected, torch.Tensor) and not isinstance(expected, DTensor):
        if tuple(got.shape) != tuple(expected.shape):
            fail("DTensor: global shape differs", tuple(got.shape), tuple(expected.shape))
        coordinate = got.device_mesh.get_coordinate()
        assert coordinate is not None, "a DTensor of a mesh this rank is not in"
        piece, _ = expected_local_chunk(expected, got.placements, tuple(got.device_mesh.shape), tuple(coordinate))
        return got.to_local(), piece
    if isinstance(got, Mapping) and isinstance(expected, Mapping):
        pairs = {k: localized(got[k], expected[k]) for k in got if k in expected}
        return ({k: pairs[k][0] if k in pairs else v for k, v in got.items()},
                {k: pairs[k][1] if k in pairs else v for k, v in expected.items()})
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)) and len(got) == len(expected):
        elementwise = [localized(g, e) for g, e in zip(got, expected)]
        return type(got)(p[0] for p in elementwise), type(expected)(p[1] for p in elementwise)
    return got, expected


def assert_matches_oracle(got: Any, expected: Any, what: str, *, rank: int, atol: float | None = ATOL,
                          check_order: bool = True, exact: frozenset[str] = frozenset()) -> None:
    """Per-rank truth: ``got`` (plain tensors, or DTensors of the oracle's global shapes) equals the
    oracle's full values ``expected``; a DTensor's local shard is compared with the piece of the oracle's
    value this rank must hold, never gathered. Within ``atol`` for trained values, bit for bit for the
    top-level keys in ``exact`` (what training did not touch: a get only moves it)."""
    __tracebackhide__ = True
    local_got, local_expected = localized(got, expected)
    assert_same_state(local_got, local_expected, what=what, where=f"rank {rank}", atol=atol,
                      rtol=RTOL if atol is not None else 0.0, check_order=check_order)
    for key in sorted(exact & set(local_got) & set(local_expected)):
        assert_same_state(local_got[key], local_expected[key], what=f"{what} (untouched by training: bit for bit)",
                          where=f"rank {rank}, [{key!r}]")
