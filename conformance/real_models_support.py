"""Helpers of ``test_real_models.py``: the grid of sharding sides a real model is saved from and loaded
into, its unwrapped oracle and sharded runs, and the comparisons against the oracle (float tolerance for
sharded training, bit for bit for loads, tied keys, non-persistent buffers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import settings
from torch import nn

from conformance.adapters.sharding import STRATEGIES, ShardingPlan
from conformance.asserts import assert_same_state, fail
from conformance.fqn import canonical_fqn
from conformance.generated import assert_optimizer_matches, fqn_keyed, to_cpu
from conformance.real_models import (
    GLOBAL_BATCH,
    REAL_MODELS,
    RealModel,
    adamw,
    parameter_units,
    train_step,
    weight_decay_groups,
)


def real_model_or_skip(name: str) -> RealModel:
    """The zoo entry, or a skip saying why it cannot be built here (``transformers`` absent)."""
    real = REAL_MODELS[name]
    if real.missing is not None:
        pytest.skip(real.missing)
    return real


#: Steps before the save; one more after the load.
STEPS = 2


#: Sharded and unwrapped training sum gradients in another order (float64, real_models.DTYPE): they agree to this.
ATOL, RTOL = 1e-10, 1e-8


#: The models whose whole strategy x use_orig_params grid runs by default: T5 passes a tensor from block 0
#: to the later blocks and shares one embedding four ways; Mixtral's and Switch's experts see other tokens
#: on each rank, and Switch's (one module each) leave parameters without a gradient on some ranks or all.
GRID_MODELS = ("t5", "mixtral", "switch", "passthrough", "routed")


@dataclass(frozen=True)
class Side:
    """How one side (save or load) of a sharded run is laid out; the units are the model's blocks."""

    strategy: str
    use_orig_params: bool

    def __str__(self) -> str:
        return f"{self.strategy}.{'orig' if self.use_orig_params else 'flat'}"

    def plan(self, real: RealModel | None = None, device: torch.device | None = None) -> ShardingPlan:
        return ShardingPlan(self.strategy, self.use_orig_params, units=real.is_unit if real is not None else None, device=device)


def load_side(save: Side) -> Side:
    """Another strategy (the next one) and the other use_orig_params."""
    return Side(STRATEGIES[(STRATEGIES.index(save.strategy) + 1) % len(STRATEGIES)], not save.use_orig_params)


def os_cells() -> list[Any]:
    """(model, save side, load side). For GRID_MODELS (every model under the ``thorough`` profile) every
    strategy and use_orig_params saves into the next strategy with the other use_orig_params; the other
    models save FULL_SHARD with flat parameters into FULL_SHARD with original ones. Every model also
    saves and loads with original parameters only (FULL_SHARD into SHARD_GRAD_OP): the one cell an
    implementation without flat parameters (``fully_shard``) runs."""
    thorough = settings.get_current_profile_name() == "thorough"
    cells = []
    for name in REAL_MODELS:
        if thorough or name in GRID_MODELS:
            pairs = [(save, load_side(save)) for save in (Side(s, orig) for s in STRATEGIES for orig in (False, True))]
        else:
            pairs = [(Side("FULL_SHARD", False), Side("FULL_SHARD", True))]
        pairs.append((Side("FULL_SHARD", True), Side("SHARD_GRAD_OP", True)))
        cells += [pytest.param(name, save, load, id=f"{name}-{save}-to-{load}") for save, load in pairs]
    return cells


def skip_unless_even(world_size: int) -> None:
    if GLOBAL_BATCH % world_size:
        pytest.skip(f"the global batch of {GLOBAL_BATCH} rows does not split evenly over {world_size} ranks")


def trainable_fqns(model: nn.Module) -> list[str]:
    return [fqn for fqn, p in model.named_parameters() if p.requires_grad]


def flat_units(real: RealModel, side: Side) -> tuple[type[nn.Module], ...] | None:
    """The unit classes the oracle steps as flat parameters for ``side`` (None: original parameters)."""
    return None if side.use_orig_params else real.unit_classes


def non_persistent_buffers(real: RealModel, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers by clean FQN, copied to the CPU; all of ``real.non_persistent``."""
    __tracebackhide__ = True
    wanted = set(real.non_persistent)
    found = {canonical_fqn(n): b.detach().cpu().clone() for n, b in model.named_buffers() if canonical_fqn(n) in wanted}
    if set(found) != wanted:
        fail("non-persistent buffers of the model", sorted(found), sorted(wanted), f"{real.name}: named_buffers()")
    return found


def assert_tied_keys(real: RealModel, state: dict[str, Any], where: str) -> None:
    """Every key of a tied parameter that ``nn.Module.state_dict()`` lists is there, all of one value."""
    __tracebackhide__ = True
    for group in real.tied:
        missing = [k for k in group if k not in state]
        if missing:
            fail(f"{real.name}: keys of a tied parameter missing from the state dict", f"missing {missing}", list(group), where)
        for key in group[1:]:
            assert_same_state(state[key], state[group[0]], what=f"{real.name}: tied key {key!r} vs {group[0]!r}", where=where)


def with_initial_state(osd: dict[str, Any], oracle: nn.Module) -> dict[str, Any]:
    """``osd`` (FQN-keyed, on the CPU) with the state AdamW creates before its first update (``step`` 0,
    zero moments; SD-20) for every trainable parameter of the unwrapped ``oracle`` that has none: what a
    get materializes for a parameter that never had a gradient (a Switch expert no token reached; SD-21).
    A step treats that state exactly as no state, so a comparison that gives it to both sides compares
    what training does next."""
    template = next(iter(osd["state"].values()))
    state = dict(osd["state"])
    for fqn, param in oracle.named_parameters():
        if param.requires_grad and fqn not in state:
            state[fqn] = {k: torch.zeros_like(v) if v.dim() == 0 else torch.zeros_like(param.detach().cpu()) for k, v in template.items()}
    return {**osd, "state": state}


def assert_matches(real: RealModel, model_sd: dict[str, Any], osd: dict[str, Any], oracle: nn.Module, oracle_optim: torch.optim.Optimizer,
        *, what: str, where: str, exact: bool, initial_state: str = "") -> None:
    """Model state dict (keys in any order) and FQN-keyed optimizer state dict vs the unwrapped
    ``oracle``'s: bitwise with ``exact``, else within ATOL/RTOL; tied keys all present.
    ``initial_state``: "expected" gives the oracle's stateless parameters their initial state
    (:func:`with_initial_state`: a get must hold it, SD-21); "both" gives it to both sides."""
    __tracebackhide__ = True
    atol, rtol = (None, 0.0) if exact else (ATOL, RTOL)
    assert_tied_keys(real, model_sd, where)
    assert_same_state(model_sd, to_cpu(oracle.state_dict()), what=f"{what}: model state dict", where=where, atol=atol, rtol=rtol, check_order=False)
    expected = to_cpu(fqn_keyed(oracle, oracle_optim))
    if initial_state:
        expected = with_initial_state(expected, oracle)
    if initial_state == "both":
        osd = with_initial_state(osd, oracle)
    assert_optimizer_matches(osd, expected, trainable_fqns(oracle), what=f"{what}: optimizer state dict", where=where, atol=atol, rtol=rtol)


def unwrapped_run(real: RealModel, seed: int, device: Any, *, by_unit: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, bool]]:
    """The unwrapped model of ``seed``, its AdamW and the weight-decay groups (:func:`weight_decay_groups`), untrained."""
    model = real.build(seed, device)
    decay = weight_decay_groups(model, real.unit_classes, by_unit=by_unit)
    return model, adamw([((fqn,), p) for fqn, p in model.named_parameters()], decay), decay


def oracle_run(real: RealModel, device: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, bool]]:
    """The unwrapped model of seed 0 and its AdamW after STEPS steps on whole batches (original parameters)."""
    model, optim, decay = unwrapped_run(real, 0, device)
    for step in range(STEPS):
        train_step(real, model, optim, real.batch(step, GLOBAL_BATCH))
    return model, optim, decay


def shard_real(impl: Any, real: RealModel, seed: int, side: Side, device: torch.device) -> nn.Module:
    return impl.require("sharding").shard(real.build(seed, device), side.plan(real, device))


def sharded_adamw(ops: Any, model: nn.Module, decay: dict[str, bool]) -> torch.optim.Optimizer:
    return adamw([(tuple(canonical_fqn(f) for f in fqns), p) for fqns, p in ops.optimizer_params(model)], decay)


def scalars_differing_in_a_unit(real: RealModel, oracle: nn.Module, osd: dict[str, Any]) -> list[str]:
    """FQNs of parameters whose ``step`` differs from another parameter's of the same unit in ``osd``
    (saved with original parameters: an expert that had no gradient in some steps counts fewer)."""
    units = parameter_units(oracle, real.unit_classes)
    steps: dict[str, dict[float, str]] = {}
    for fqn, entry in osd["state"].items():
        if "step" in entry:
            steps.setdefault(units.get(fqn, ""), {}).setdefault(float(entry["step"]), fqn)
    return [fqn for by_step in steps.values() if len(by_step) > 1 for fqn in sorted(by_step.values())]


def local_numel(model: nn.Module) -> int:
    """Elements this rank holds of the parameters ``model`` exposes (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
