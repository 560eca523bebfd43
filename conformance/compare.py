"""What the test sections compare against, and the tensor conversions they compare with.

The oracle of an FQN-keyed optimizer state dict (:func:`fqn_keyed_optim`) and the small conversions
from what an implementation returns (DTensors, tensors on any device) to what the oracle holds.
Comparison rules themselves (exact or within a tolerance, which keys, in which order) stay with the
section that states them: they differ on purpose from section to section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.fqn import canonical_fqn

__all__ = ["fqn_keyed_optim", "nested_optimizer_state", "on_cpu", "full_on_cpu", "full_tensor", "local_tensor"]



def fqn_keyed_optim(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The oracle of SD-2 and OS-1: ``optim.state_dict()`` of the unwrapped ``model`` with parameter
    ids replaced by the FQN ``named_parameters`` gives first (tied parameters appear once there).

    The model's children may be checkpoint-wrapped in place; their FQNs are spelled as ``state_dict()``
    spells them, without the wrapper's segment. Tensors are ``optim``'s own, not copies."""
    osd = optim.state_dict()
    name_of = {p: canonical_fqn(n) for n, p in model.named_parameters()}
    fqns = [name_of[p] for group in optim.param_groups for p in group["params"]]
    return {
        "state": {fqns[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def full_tensor(value: Any) -> Any:
    """A DTensor's full value (collective: every rank of its mesh calls); anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def local_tensor(value: Any) -> Any:
    """A DTensor's local shard on this rank; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def on_cpu(value: Any) -> Any:
    """``value`` with every tensor moved to the CPU as it is (a DTensor stays one: nothing is gathered, no
    collective); mappings, lists and tuples rebuilt, other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    return value


def full_on_cpu(value: Any) -> Any:
    """``value`` with every tensor a plain tensor on the CPU (DTensors gathered, so collective when it
    holds any); dicts, lists and tuples rebuilt, other values as they are."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: full_on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full_on_cpu(v) for v in value)
    return value


def nested_optimizer_state(osd: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict in the nested form (``{"state": {fqn: {name: value}},
    "param_groups": [{..., "params": [fqn, ...]}]}``), whether given so or flattened as DCP's
    ``flatten_optimizer_state_dict`` and torchtitan save it (``state.<fqn>.<name>``,
    ``param_groups.<fqn>.<hyperparameter>``): the flat form's groups are rebuilt from the FQNs whose
    hyperparameters are equal, in the order they come."""
    if "state" in osd or "param_groups" in osd:
        return osd
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in osd.items():
        section, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if section == "state":
            state.setdefault(fqn, {})[name] = value
        elif section == "param_groups":
            hyper.setdefault(fqn, {})[name] = value
        else:
            raise ValueError(f"{key!r} is neither a state.<fqn>.<name> nor a param_groups.<fqn>.<key> entry")
    groups: list[dict[str, Any]] = []
    for fqn, values in hyper.items():
        same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == values), None)
        if same is None:
            groups.append({**values, "params": [fqn]})
        else:
            same["params"].append(fqn)
    return {"state": state, "param_groups": groups}
