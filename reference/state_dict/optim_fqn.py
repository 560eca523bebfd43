"""Optimizer state dicts keyed by canonical FQN (instead of torch's per-optimizer parameter ids).

Vocabulary: an *id-keyed* optimizer state dict is what ``Optimizer.state_dict()`` returns (state and
``param_groups[i]["params"]`` use integer ids, numbered over the groups in order). An *FQN-keyed*
one uses the canonical FQN of each parameter in their place, so that it is independent of how the
parameters were split among optimizers and groups. A *flattened* one is a single-level dict
``{"state.<fqn>.<name>": v, "param_groups.<fqn>.<hyperparameter>": v}`` (torch's
``flatten_optimizer_state_dict``). Nested per-parameter state flattens further with ``.``
(``state.<fqn>.ema.fast``, ``state.<fqn>.history.0``); un-flattening reads an all-digit segment as
an int key, as optimizer state uses ints (the text form cannot tell ``0`` from ``"0"``).

Nothing here talks to a process group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "STATE",
    "PG",
    "PARAMS",
    "init_state",
    "to_fqn_keyed",
    "plan_load",
    "check_keys",
    "part_of",
    "flatten",
    "unflatten",
]

STATE = "state"
PG = "param_groups"
PARAMS = "params"

ParamFQNs = Mapping[torch.Tensor, list[str]]  # parameter -> its canonical FQNs, first one is the key


def init_state(optim: torch.optim.Optimizer) -> None:
    """Create the lazily-initialised state of ``optim`` (torch's ``_init_optim_state``).

    A step with zero gradients and zero learning rate, and only when the optimizer has no state and no
    gradient yet: the parameters do not move, but e.g. Adam's ``step``/``exp_avg`` entries exist."""
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group[PARAMS]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for group in optim.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        optim.zero_grad(set_to_none=True)


def _key_of(param: torch.Tensor, param_fqns: ParamFQNs, where: str) -> str:
    names = param_fqns.get(param)
    if not names:
        raise ValueError(f"{where} holds a parameter of shape {tuple(param.shape)} that is not a parameter of the model")
    return names[0]


def to_fqn_keyed(optims: tuple[torch.optim.Optimizer, ...], param_fqns: ParamFQNs) -> dict[str, Any]:
    """The FQN-keyed state dict of ``optims`` combined: their groups in order, their states merged."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    owner: dict[str, int] = {}
    for oi, optim in enumerate(optims):
        osd = optim.state_dict()
        params = [p for group in optim.param_groups for p in group[PARAMS]]
        # Invariant (torch.optim): ids number the parameters over the groups in order.
        fqn_of_id: dict[int, str] = {}
        for pid, p in enumerate(params):
            fqn = _key_of(p, param_fqns, f"optimizers[{oi}]")
            if fqn in owner:
                raise ValueError(f"parameter {fqn!r} is held by optimizers[{owner[fqn]}] and optimizers[{oi}]")
            owner[fqn] = oi
            fqn_of_id[pid] = fqn
        for pid, st in osd[STATE].items():
            state[fqn_of_id[pid]] = st
        for group in osd[PG]:
            groups.append({**group, PARAMS: [fqn_of_id[pid] for pid in group[PARAMS]]})
    return {STATE: state, PG: groups}


def plan_load(
    optims: tuple[torch.optim.Optimizer, ...],
    osd: Mapping[str, Any],
    param_fqns: ParamFQNs,
    *,
    strict: bool,
) -> Callable[[], None]:
    """Check an FQN-keyed ``osd`` against ``optims`` and return the function that loads it.

    Raises before returning (nothing is changed): ``RuntimeError`` naming the FQN for, under
    ``strict``, a trainable parameter with no state or in no loaded group, and state for an FQN that
    no optimizer holds; ``ValueError`` for a malformed dict. Groups are matched by their parameters,
    not by position, so the optimizers may be split differently than when the dict was saved; a
    tied parameter may be keyed by any of its FQNs."""
    if not isinstance(osd.get(STATE), Mapping) or not isinstance(osd.get(PG), list):
        raise ValueError(f"optimizer state dict: expected {STATE!r} (dict) and {PG!r} (list), got keys {sorted(osd)}")
    loaded_state: Mapping[str, Any] = osd[STATE]
    loaded_groups: list[Mapping[str, Any]] = osd[PG]
    alias: dict[str, str] = {}  # any FQN of a parameter -> its key FQN
    for names in param_fqns.values():
        for name in names:
            alias[name] = names[0]
    group_of: dict[str, int] = {}
    for gi, group in enumerate(loaded_groups):
        for name in group.get(PARAMS, []):
            group_of[alias.get(name, name)] = gi
    state_of = {alias.get(name, name): value for name, value in loaded_state.items()}

    held: set[str] = set()
    new_dicts: list[dict[str, Any]] = []
    for oi, optim in enumerate(optims):
        current = optim.state_dict()
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        pid = 0
        for group, current_group in zip(optim.param_groups, current[PG]):
            hyper = {k: v for k, v in current_group.items() if k != PARAMS}
            chosen: int | None = None
            ids = []
            for p in group[PARAMS]:
                fqn = _key_of(p, param_fqns, f"optimizers[{oi}]")
                held.add(fqn)
                loaded_gi = group_of.get(fqn)
                if loaded_gi is None:
                    if strict:
                        raise RuntimeError(
                            f"optimizer state dict: parameter {fqn!r} of optimizers[{oi}] is in no loaded param group; "
                            "nothing was loaded"
                        )
                elif chosen is None:
                    chosen = loaded_gi
                elif chosen != loaded_gi:
                    raise RuntimeError(
                        f"optimizer state dict: parameter {fqn!r} is in loaded param group {loaded_gi}, but the other parameters "
                        f"of its group in optimizers[{oi}] are in group {chosen}; nothing was loaded"
                    )
                if fqn in state_of:
                    state[pid] = state_of[fqn]
                elif p.requires_grad and strict:
                    raise RuntimeError(
                        f"optimizer state dict: no state for trainable parameter {fqn!r}; nothing was loaded "
                        "(strict=False keeps its current state)"
                    )
                elif pid in current[STATE]:
                    state[pid] = current[STATE][pid]
                ids.append(pid)
                pid += 1
            if chosen is not None:
                # The saved group replaces the current one whole, as Optimizer.load_state_dict does: a
                # key only the current group has (a scheduler's initial_lr, say) does not survive.
                hyper = {k: v for k, v in loaded_groups[chosen].items() if k != PARAMS}
            groups.append({**hyper, PARAMS: ids})
        new_dicts.append({STATE: state, PG: groups})

    unexpected = [name for name in state_of if name not in held]
    if strict and unexpected:
        raise RuntimeError(
            f"optimizer state dict: state for {', '.join(repr(n) for n in unexpected[:10])}, "
            "which no given optimizer holds; nothing was loaded"
        )

    def apply() -> None:
        for optim, new in zip(optims, new_dicts):
            optim.load_state_dict(new)

    return apply


def check_keys(
    optims: tuple[torch.optim.Optimizer, ...],
    osd: Mapping[str, Any],
    param_fqns: ParamFQNs,
    *,
    strict: bool,
    flat_slots: Mapping[torch.Tensor, list[list[str]]] | None = None,
) -> None:
    """The key checks of :func:`plan_load`, for backends that convert state themselves: under
    ``strict``, a trainable parameter none of whose FQNs has state, or state for an FQN that no
    optimizer holds, is a ``RuntimeError`` naming the FQN. ``flat_slots`` gives, for a flat parameter,
    the names of each parameter it flattens (first name, then tied aliases): each needs state."""
    if not isinstance(osd.get(STATE), Mapping) or not isinstance(osd.get(PG), list):
        raise ValueError(f"optimizer state dict: expected {STATE!r} (dict) and {PG!r} (list), got keys {sorted(osd)}")
    if not strict:
        return
    held: set[str] = set()
    for oi, optim in enumerate(optims):
        for group in optim.param_groups:
            for p in group[PARAMS]:
                slots = (flat_slots or {}).get(p) or [param_fqns.get(p) or [_key_of(p, param_fqns, f"optimizers[{oi}]")]]
                for names in slots:
                    held.update(names)
                    if p.requires_grad and not any(n in osd[STATE] for n in names):
                        raise RuntimeError(
                            f"optimizer state dict: no state for trainable parameter {names[0]!r}; nothing was loaded "
                            "(strict=False keeps its current state)"
                        )
    unexpected = [name for name in osd[STATE] if name not in held]
    if unexpected:
        raise RuntimeError(
            f"optimizer state dict: state for {', '.join(repr(n) for n in unexpected[:10])}, "
            "which no given optimizer holds; nothing was loaded"
        )


def part_of(optim: torch.optim.Optimizer, osd: Mapping[str, Any], param_fqns: ParamFQNs) -> dict[str, Any]:
    """The part of a combined FQN-keyed ``osd`` that belongs to ``optim``: the state of its
    parameters and the saved groups that hold any of them."""
    names = {n for group in optim.param_groups for p in group[PARAMS] for n in param_fqns.get(p, ())}
    return {
        STATE: {n: s for n, s in osd[STATE].items() if n in names},
        PG: [g for g in osd[PG] if any(n in names for n in g.get(PARAMS, ()))],
    }


def flatten(osd: Mapping[str, Any]) -> dict[str, Any]:
    """FQN-keyed -> flattened (see the module docstring). Nested state dicts flatten with ``.``."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for fqn, st in osd[STATE].items():
        walk(f"{STATE}.{fqn}", st)
    for group in osd[PG]:
        for fqn in group[PARAMS]:
            for k, v in group.items():
                if k != PARAMS:
                    out[f"{PG}.{fqn}.{k}"] = v
    return out


def unflatten(flat: Mapping[str, Any], param_fqns: ParamFQNs) -> dict[str, Any]:
    """Flattened -> FQN-keyed. The FQN inside a key is found by the model's parameter FQNs: the
    shortest dotted prefix that is one (a parameter FQN is never a prefix of another, parameters
    being leaves). Groups are rebuilt from parameters with equal hyperparameters, in first-seen order."""
    known = {name for names in param_fqns.values() for name in names}

    def split(rest: str, key: str) -> tuple[str, list[str]]:
        parts = rest.split(".")
        for i in range(1, len(parts)):
            candidate = ".".join(parts[:i])
            if candidate in known:
                return candidate, parts[i:]
        raise ValueError(f"flattened optimizer state dict: key {key!r} names no parameter of the model")

    state: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        if section == STATE:
            fqn, path = split(rest, key)
            node = state.setdefault(fqn, {})
            keys = [int(part) if part.isdigit() else part for part in path]  # the flat form spells int keys as text
            for key_part in keys[:-1]:
                node = node.setdefault(key_part, {})
            node[keys[-1]] = value
        elif section == PG:
            fqn, path = split(rest, key)
            hyper.setdefault(fqn, {})[".".join(path)] = value
        else:
            raise ValueError(f"flattened optimizer state dict: key {key!r} starts with neither {STATE!r} nor {PG!r}")
    groups: list[dict[str, Any]] = []
    for fqn, hp in hyper.items():
        for group in groups:
            if {k: v for k, v in group.items() if k != PARAMS} == hp:
                group[PARAMS].append(fqn)
                break
        else:
            groups.append({**hp, PARAMS: [fqn]})
    return {STATE: state, PG: groups}
