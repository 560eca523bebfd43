"""Optimizer state dicts keyed by canonical FQN (instead of torch's per-optimizer parameter ids).

Vocabulary: an *id-keyed* optimizer state dict is what ``Optimizer.state_dict()`` returns (state and
``param_groups[i]["params"]`` use integer ids, numbered over the groups in order). An *FQN-keyed*
one uses the canonical FQN of each parameter in their place, so that it is independent of how the
parameters were split among optimizers and groups. A *flattened* one is a single-level dict
``{"state.<fqn>.<name>": v, "param_groups.<fqn>.<hyperparameter>": v}`` (torch's
``flatten_optimizer_state_dict``). Nested per-parameter state flattens further with ``.``
(``state.<fqn>.ema.fast``, ``state.<fqn>.history.0``); un-flattening reads an all-digit segment as
an int key, as optimizer state uses ints (the text form cannot tell ``0`` from ``"0"``).

An *id-keyed* dict given to a set is read as the FQN-keyed dict it stands for in its optimizer
(:func:`from_ids`); after that there is one path, with one set of checks, for every form.

Nothing here talks to a process group.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

__all__ = [
    "STATE",
    "PG",
    "PARAMS",
    "init_state",
    "stateful_after_load",
    "to_fqn_keyed",
    "is_id_keyed",
    "from_ids",
    "plan_load",
    "check_keys",
    "empty_group_matches",
    "part_of",
    "flatten",
    "unflatten",
]

STATE = "state"
PG = "param_groups"
PARAMS = "params"

ParamFQNs = Mapping[torch.Tensor, list[str]]  # parameter -> its canonical FQNs, first one is the key


#: The hyperparameters zeroed while state is materialized: with a zero gradient, these are what would
#: otherwise move a parameter or its moments (decoupled and coupled weight decay, ASGD's decay). The
#: learning rate is not among them: with a zero gradient and no decay every ``torch.optim`` update is
#: zero whatever it is, and some optimizers start their state from it (Rprop's step sizes, ASGD's
#: eta): made at a zero learning rate, Rprop's step sizes start at 0 and never grow.
_INERT_HYPERPARAMETERS = ("weight_decay", "lambd")
#: State entries that count steps: set back to zero after materializing, so the first real update is
#: the optimizer's first (bias correction of Adam/AdamW at step 1).
_STEP_COUNTERS = ("step",)
#: State entries that multiply a factor in at every step: set back to one after materializing (NAdam's
#: product of momentum coefficients, which its first real update would otherwise start one step on).
_STEP_PRODUCTS = ("mu_product",)


def init_state(optim: torch.optim.Optimizer, only: Collection[torch.Tensor] | None = None) -> None:
    """Materialize the state of every trainable parameter of ``optim`` that has none, as the optimizer
    creates it lazily, without changing what any later step computes.

    Per parameter, not per optimizer: a parameter that has not received a gradient yet (an MoE expert
    no token was routed to) gets its state even when the others have theirs. The state comes from one
    ``step()`` in which only those parameters have a gradient, of zeros, with every group's weight
    decay (and ASGD's decay) at 0; the step counters it advanced are then set back to 0 (and NAdam's
    momentum product to 1), so that for Adam, AdamW, SGD (dampening 0), Rprop, ASGD and NAdam the
    materialized state computes exactly what no state would.
    Everything else is as before: parameters with state keep it untouched (their ``grad`` is ``None``
    during the step), every ``grad`` (accumulated gradients included) and hyperparameter is restored,
    and an optimizer that keeps no state (SGD without momentum) is left with no entry at all.
    ``only``: materialize these parameters' state at most (a sharded caller passes those that no rank
    has state for)."""
    params = [p for group in optim.param_groups for p in group[PARAMS]]
    missing = [p for p in params if p.requires_grad and not optim.state.get(p) and (only is None or p in only)]
    if not missing:
        return
    grads = [p.grad for p in params]
    saved_hyper = [{k: group[k] for k in _INERT_HYPERPARAMETERS if k in group} for group in optim.param_groups]
    try:
        for p in params:
            p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        for group, hyper in zip(optim.param_groups, saved_hyper):
            for k, v in hyper.items():
                group[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0
        optim.step()
    finally:
        for group, hyper in zip(optim.param_groups, saved_hyper):
            group.update(hyper)
        for p, grad in zip(params, grads):
            p.grad = grad
    for p in missing:
        entry = optim.state.get(p)
        if not entry:
            optim.state.pop(p, None)  # a stateless optimizer: no empty entry left behind
            continue
        for names, start in ((_STEP_COUNTERS, 0), (_STEP_PRODUCTS, 1)):
            for name in names:
                value = entry.get(name)
                if isinstance(value, torch.Tensor):
                    value.fill_(start)
                elif isinstance(value, (int, float)):
                    entry[name] = type(value)(start)


def stateful_after_load(optim: torch.optim.Optimizer, hyper_of: Mapping[torch.Tensor, Mapping[str, Any]]) -> set[torch.Tensor]:
    """The parameters of ``optim`` among ``hyper_of`` for which ``optim`` holds state once its groups have
    the hyperparameters ``hyper_of`` gives them (those of the loaded groups: SGD keeps a momentum
    buffer only with ``momentum > 0``). Frozen parameters hold none (nothing steps them).

    Decided by the optimizer itself, not by a list of classes: its state is materialized as
    :func:`init_state` does, with those hyperparameters, and everything is then put back as it was:
    every state entry (in its order), hyperparameter and gradient. Local: no collective."""
    candidates = [p for p in hyper_of if p.requires_grad]
    if not candidates:
        return set()
    home = {p: group for group in optim.param_groups for p in group[PARAMS]}
    groups_before = [dict(group) for group in optim.param_groups]
    state_before = list(optim.state.items())
    try:
        for p in candidates:
            optim.state.pop(p, None)  # materialized afresh, under the loaded hyperparameters
            home[p].update({k: v for k, v in hyper_of[p].items() if k != PARAMS})
        init_state(optim, only=set(candidates))
        return {p for p in candidates if optim.state.get(p)}
    finally:
        optim.state.clear()
        optim.state.update(state_before)
        for group, before in zip(optim.param_groups, groups_before):
            group.clear()
            group.update(before)


def _missing_state_error(fqn: str, oi: int, optim: torch.optim.Optimizer) -> RuntimeError:
    return RuntimeError(
        f"Missing optimizer state for parameter {fqn!r} of optimizers[{oi}]: it requires gradients and "
        f"{type(optim).__name__} with the loaded hyperparameters holds state for it, but the optimizer state dict has none "
        "(strict=False keeps its current state); nothing was loaded"
    )


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


def _is_id(name: Any) -> bool:
    return isinstance(name, int) and not isinstance(name, bool)


def is_id_keyed(osd: Mapping[str, Any]) -> bool:
    """Whether ``osd`` is an optimizer's own state dict (``Optimizer.state_dict()``): its param groups
    list parameters by integer id (a dict without a parameter anywhere is not told apart, and is read
    as FQN-keyed: both forms load it alike)."""
    groups, state = osd.get(PG), osd.get(STATE)
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return False
    names = [n for g in groups if isinstance(g, Mapping) for n in g.get(PARAMS, ())] + list(state)
    return any(_is_id(n) for n in names)


def from_ids(optims: tuple[torch.optim.Optimizer, ...], osd: Mapping[str, Any], param_fqns: ParamFQNs) -> dict[str, Any]:
    """The FQN-keyed dict that the id-keyed ``osd`` stands for in the one optimizer given, read as
    ``Optimizer.load_state_dict`` reads it: saved group ``k`` is the optimizer's group ``k``, and the
    ids it lists are that group's parameters in order. ``ValueError`` (nothing is loaded) when it does
    not fit: several optimizers (ids name positions in one), another number of groups or of
    parameters in a group, state for an id that no group lists, ids mixed with FQNs."""
    if len(optims) != 1:
        raise ValueError(
            f"an optimizer's own state dict (keyed by parameter ids) names parameters by their position in one optimizer, "
            f"but {len(optims)} optimizers were given: load it into its own optimizer, or pass the FQN-keyed dict of "
            "get_optimizer_state_dict; nothing was loaded"
        )
    (optim,) = optims
    saved_groups: list[Mapping[str, Any]] = osd[PG]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(
            f"optimizer state dict keyed by ids: {len(saved_groups)} param groups, but optimizers[0] has "
            f"{len(optim.param_groups)}; nothing was loaded"
        )
    fqn_of_id: dict[int, str] = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, optim.param_groups)):
        ids = list(saved.get(PARAMS, ()))
        odd = [i for i in ids if not _is_id(i)]
        if odd:
            raise ValueError(f"optimizer state dict keyed by ids: param group {gi} also lists {odd[:3]}, which are not ids; nothing was loaded")
        if len(ids) != len(group[PARAMS]):
            raise ValueError(
                f"optimizer state dict keyed by ids: param group {gi} lists {len(ids)} parameters, but group {gi} of "
                f"optimizers[0] holds {len(group[PARAMS])}; nothing was loaded"
            )
        for pid, p in zip(ids, group[PARAMS]):
            fqn_of_id[pid] = _key_of(p, param_fqns, "optimizers[0]")
    unknown = [pid for pid in osd[STATE] if pid not in fqn_of_id]
    if unknown:
        raise ValueError(
            f"optimizer state dict keyed by ids: state for {unknown[:10]}, which no param group lists; nothing was loaded"
        )
    return {
        STATE: {fqn_of_id[pid]: entry for pid, entry in osd[STATE].items()},
        PG: [{**g, PARAMS: [fqn_of_id[pid] for pid in g.get(PARAMS, ())]} for g in saved_groups],
    }


def _copied(entry: Any) -> Any:
    """``entry`` with every tensor cloned (detached), containers rebuilt, other values as they are."""
    if isinstance(entry, torch.Tensor):
        return entry.detach().clone()
    if isinstance(entry, Mapping):
        return {k: _copied(v) for k, v in entry.items()}
    if isinstance(entry, (list, tuple)):
        return type(entry)(_copied(v) for v in entry)
    return entry


def empty_group_matches(optims: tuple[torch.optim.Optimizer, ...], loaded_groups: list[Mapping[str, Any]], *, strict: bool) -> dict[tuple[int, int], int]:
    """``(optimizer index, group index) -> loaded group index`` for the param groups that hold no
    parameter: they cannot be matched by their parameters, so the k-th such group over the optimizers
    in order takes the k-th loaded group without parameters (a group kept for a scheduler or a later
    ``add_param_group`` has hyperparameters all the same). Under ``strict``, different numbers of such
    groups are a ``RuntimeError``; otherwise the unmatched keep their own hyperparameters."""
    local = [(oi, gi) for oi, optim in enumerate(optims) for gi, group in enumerate(optim.param_groups) if not group[PARAMS]]
    saved = [i for i, group in enumerate(loaded_groups) if not group.get(PARAMS)]
    if strict and len(local) != len(saved):
        raise RuntimeError(
            f"optimizer state dict: {len(saved)} saved param group(s) without parameters (at {saved}), but the optimizers have "
            f"{len(local)} (at {[f'optimizers[{oi}] group {gi}' for oi, gi in local]}); nothing was loaded"
        )
    return dict(zip(local, saved))


def plan_load(
    optims: tuple[torch.optim.Optimizer, ...],
    osd: Mapping[str, Any],
    param_fqns: ParamFQNs,
    *,
    strict: bool,
) -> Callable[[], None]:
    """Check an FQN-keyed ``osd`` against ``optims`` and return the function that loads it.

    A parameter listed in a loaded param group takes that group's hyperparameters and its saved state;
    saved state of a frozen parameter is loaded like any other. A parameter listed without saved
    state: under ``strict`` (the dict is the whole truth) it is an error exactly when the optimizer,
    with the loaded hyperparameters, holds state for it (:func:`stateful_after_load`: Adam's moments
    would be dropped silently), and otherwise it has no state after the load (a stateless optimizer,
    or a frozen parameter); without ``strict`` it keeps its own (a partial dict). Groups are matched by
    their parameters, not by position, so the optimizers may be split differently than when the dict
    was saved; groups without parameters by :func:`empty_group_matches`; a tied parameter may be keyed
    by any of its FQNs.

    Raises before returning (nothing is changed): ``RuntimeError`` naming the FQN for, under
    ``strict``, a parameter in no loaded group, a missing state as above, and state for an FQN that no
    optimizer holds (otherwise the first keeps its current state and group, the last is ignored);
    ``ValueError`` for a malformed dict."""
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
    empty_matches = empty_group_matches(optims, loaded_groups, strict=strict)

    held: set[str] = set()
    new_dicts: list[dict[str, Any]] = []
    unsaved: list[dict[torch.Tensor, tuple[str, Mapping[str, Any]]]] = [{} for _ in optims]  # listed, no saved state
    for oi, optim in enumerate(optims):
        current = optim.state_dict()
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        pid = 0
        for gi, (group, current_group) in enumerate(zip(optim.param_groups, current[PG])):
            hyper = {k: v for k, v in current_group.items() if k != PARAMS}
            chosen: int | None = empty_matches.get((oi, gi))
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
                if loaded_gi is not None and fqn in state_of:
                    # Copies: Optimizer.load_state_dict keeps tensors that need no cast, so the caller's
                    # dict (or the source optimizer's own tensors) would be stepped by this one too.
                    state[pid] = _copied(state_of[fqn])
                elif (loaded_gi is None or not strict) and pid in current[STATE]:
                    state[pid] = current[STATE][pid]  # not given: left as it is (SD-7)
                elif loaded_gi is not None:
                    unsaved[oi][p] = (fqn, loaded_groups[loaded_gi])
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
    if strict:
        _check_unsaved_state(optims, unsaved)

    def apply() -> None:
        for optim, new in zip(optims, new_dicts):
            optim.load_state_dict(new)

    return apply


def _check_unsaved_state(
    optims: tuple[torch.optim.Optimizer, ...], unsaved: list[dict[torch.Tensor, tuple[str, Mapping[str, Any]]]]
) -> None:
    """Under ``strict``: ``unsaved[oi]`` maps each parameter of ``optims[oi]`` that a loaded group lists
    without saved state to (its FQN, that group); one the optimizer would hold state for is an error."""
    for oi, (optim, params) in enumerate(zip(optims, unsaved)):
        stateful = stateful_after_load(optim, {p: group for p, (_, group) in params.items()})
        for p, (fqn, _) in params.items():
            if p in stateful:
                raise _missing_state_error(fqn, oi, optim)


def check_keys(
    optims: tuple[torch.optim.Optimizer, ...],
    osd: Mapping[str, Any],
    param_fqns: ParamFQNs,
    *,
    strict: bool,
    flat_slots: Mapping[torch.Tensor, list[list[str]]] | None = None,
) -> None:
    """The key checks of :func:`plan_load`, for backends that convert state themselves: a malformed
    dict is a ``ValueError``; under ``strict``, a parameter that no loaded param group lists (under any
    of its names), state for an FQN that no optimizer holds, or groups without parameters that do not
    pair up, a ``RuntimeError`` naming them. ``flat_slots`` gives, for a flat parameter, the names of
    each parameter it flattens (first name, then tied aliases): each must be listed. A parameter listed
    without saved state (for a flat parameter: any of the parameters it flattens) is an error exactly
    when the optimizer would hold state for it, as in :func:`plan_load`."""
    if not isinstance(osd.get(STATE), Mapping) or not isinstance(osd.get(PG), list):
        raise ValueError(f"optimizer state dict: expected {STATE!r} (dict) and {PG!r} (list), got keys {sorted(osd)}")
    if not strict:
        return
    empty_group_matches(optims, osd[PG], strict=True)
    group_of = {name: group for group in osd[PG] for name in group.get(PARAMS, ())}
    held: set[str] = set()
    unsaved: list[dict[torch.Tensor, tuple[str, Mapping[str, Any]]]] = [{} for _ in optims]
    for oi, optim in enumerate(optims):
        for group in optim.param_groups:
            for p in group[PARAMS]:
                slots = (flat_slots or {}).get(p) or [param_fqns.get(p) or [_key_of(p, param_fqns, f"optimizers[{oi}]")]]
                for names in slots:
                    held.update(names)
                    home = next((group_of[n] for n in names if n in group_of), None)
                    if home is None:
                        raise RuntimeError(
                            f"optimizer state dict: parameter {names[0]!r} of optimizers[{oi}] is in no loaded param group; nothing was loaded"
                        )
                    if p not in unsaved[oi] and not any(n in osd[STATE] for n in names):
                        unsaved[oi][p] = (names[0], home)
    unexpected = [name for name in osd[STATE] if name not in held]
    if unexpected:
        raise RuntimeError(
            f"optimizer state dict: state for {', '.join(repr(n) for n in unexpected[:10])}, "
            "which no given optimizer holds; nothing was loaded"
        )
    _check_unsaved_state(optims, unsaved)


def part_of(
    optims: tuple[torch.optim.Optimizer, ...], index: int, osd: Mapping[str, Any], param_fqns: ParamFQNs
) -> dict[str, Any]:
    """The part of a combined FQN-keyed ``osd`` that belongs to ``optims[index]``: the state of its
    parameters, the saved groups that hold any of them, and the saved groups without parameters that
    :func:`empty_group_matches` pairs with its own, in the order of the saved dict."""
    optim = optims[index]
    names = {n for group in optim.param_groups for p in group[PARAMS] for n in param_fqns.get(p, ())}
    empties = {saved for (oi, _), saved in empty_group_matches(optims, osd[PG], strict=False).items() if oi == index}
    return {
        STATE: {n: s for n, s in osd[STATE].items() if n in names},
        PG: [g for i, g in enumerate(osd[PG]) if i in empties or any(n in names for n in g.get(PARAMS, ()))],
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
