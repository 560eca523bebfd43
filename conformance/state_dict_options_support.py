"""What the SD-28 test of combined options (``conformance/test_state_dict_options.py``) runs on:
the covering array of the options (:data:`ROWS`), the model every option acts on
(:class:`OptionsModel`), the oracle that applies each option by its own definition, and the checks of
one row's get and set (:func:`check_get`, :func:`check_set`)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance.adapters.base import Unsupported
from conformance.adapters.sharding import ShardingPlan
from conformance.asserts import assert_names_key, assert_same_state, assert_unchanged, expected_local_chunk, fail, raised, snapshot
from conformance.compare import fqn_keyed_optim
from conformance.module_state_support import tensors_of
from conformance.pairwise import pairwise, uncovered_pairs
from conformance.state_dict_support import ATOL, add_source_extras, assert_matches_oracle, per_parameter, sd_ops, target_optimizer
from conformance.values import different_like

__all__ = [
    "FACTORS",
    "valid",
    "ROWS",
    "describe",
    "SELECTED",
    "DROPPED",
    "FROZEN",
    "OptionsModel",
    "row_key",
    "expected_model",
    "expected_optim",
    "Case",
    "options_of",
    "check_get",
    "check_set",
]


# -- the covering array ------------------------------------------------------------------------------

FACTORS: dict[str, tuple[Any, ...]] = {
    "full_state_dict": (False, True),
    "cpu_offload": (False, True),
    "ignore_frozen_params": (False, True),
    "submodules": ("none", "keep", "strip"),
    "strict": (True, False),
    "broadcast_from_rank0": (False, True),
    "flatten_optimizer_state_dict": (False, True),
    "given": ("complete", "missing"),
}


def valid(row: Mapping[str, Any]) -> bool:
    """``broadcast_from_rank0`` needs ``full_state_dict`` (a partial row: False only once both are set)."""
    return not (row.get("broadcast_from_rank0") is True and row.get("full_state_dict") is False)


ROWS: list[dict[str, Any]] = pairwise(FACTORS, valid)
assert not uncovered_pairs(ROWS, FACTORS, valid), "the options' covering array misses a pair"


_SHORT = {"full_state_dict": "full", "cpu_offload": "offload", "ignore_frozen_params": "no-frozen",
          "broadcast_from_rank0": "broadcast", "flatten_optimizer_state_dict": "flat"}


def describe(row: Mapping[str, Any]) -> str:
    """``full+offload+strip+nonstrict+missing``: the settings that are not the default."""
    parts = [_SHORT[k] for k in _SHORT if row[k]]
    if row["submodules"] != "none":
        parts.append({"keep": "select-enc", "strip": "select-enc-stripped"}[row["submodules"]])
    if not row["strict"]:
        parts.append("nonstrict")
    if row["given"] == "missing":
        parts.append("one-entry-missing")
    return "+".join(parts) or "defaults"


#: The selected submodule, the entry a "missing" case leaves out, and the frozen parameters.
SELECTED = "enc"


DROPPED = "enc.2.bias"


FROZEN = ("enc.0.weight", "enc.0.bias")


class OptionsModel(nn.Module):
    """What every option acts on: ``enc`` (a frozen layer ``enc.0`` and a trainable ``enc.2``), a
    trainable ``head`` outside it, and a persistent buffer at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6))
        self.enc[0].requires_grad_(False)
        self.head = nn.Linear(6, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x)) * self.scale


def _build(seed: int, device: torch.device) -> OptionsModel:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model = OptionsModel()
    return model.to(device)


def _batch(step: int, device: torch.device) -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(500 + step)).to(device)


def _as_dtensors(model: nn.Module, dist: Any) -> nn.Module:
    """Every parameter a DTensor sharded on dim 0 over all ranks, no unit (tensor parallelism's way)."""
    mesh = dist.mesh()
    from torch.distributed.tensor import Shard

    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            piece, _ = expected_local_chunk(param.detach(), [Shard(0)], (dist.world_size,), (dist.rank,))
            local = DTensor.from_local(piece.clone(), mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
            module.register_parameter(attr, nn.Parameter(local, requires_grad=param.requires_grad))
    return model


def _make(kind: str, seed: int, impl: Any, dist: Any) -> tuple[nn.Module, nn.Module]:
    """The model of ``kind`` from ``seed``, and its submodule ``enc`` (the user's handle, taken before
    any sharding)."""
    model = _build(seed, dist.device)
    enc = model.enc
    if kind == "plain":
        return model, enc
    if kind == "dtensor":
        return _as_dtensors(model, dist), enc
    plan = ShardingPlan("FULL_SHARD", units=lambda m: isinstance(m, nn.Linear), device=dist.device)
    try:
        return impl.require("sharding").shard(model, plan), enc
    except Unsupported as exc:
        pytest.skip(str(exc))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return add_source_extras(torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01))


def _step(kind: str, model: nn.Module, optim: torch.optim.Optimizer, step: int, dist: Any) -> None:
    """One training step. DTensor parameters without a unit have no forward of their own here: they and
    the oracle take the same synthetic gradient (each rank its piece); the others train on a batch,
    the same on every rank (so the averaged gradient is the single-process one)."""
    optim.zero_grad(set_to_none=True)
    if kind != "dtensor":
        model(_batch(step, dist.device)).float().pow(2).mean().backward()
    else:
        for index, (_, param) in enumerate(model.named_parameters()):
            if param.requires_grad:
                param.grad = _synthetic_grad(param, step, index, dist)
    optim.step()


def _synthetic_grad(param: torch.Tensor, step: int, index: int, dist: Any) -> torch.Tensor:
    full = torch.randn(param.shape, generator=torch.Generator().manual_seed(1000 * step + index)).to(dist.device)
    if not isinstance(param, DTensor):
        return full
    piece, _ = expected_local_chunk(full, param.placements, tuple(param.device_mesh.shape), tuple(param.device_mesh.get_coordinate() or ()))
    return DTensor.from_local(piece.clone(), param.device_mesh, param.placements, run_check=False, shape=full.shape, stride=full.stride())


# -- the oracle of a get -------------------------------------------------------------------------------


def row_key(fqn: str, row: Mapping[str, Any]) -> str | None:
    """The key ``row``'s selection gives the model entry ``fqn``: itself, stripped of ``enc.``
    (``keep_submodule_prefixes=False``), or None when the selection leaves it out (SD-4, SD-5)."""
    if row["submodules"] == "none":
        return fqn
    prefix = SELECTED + "."
    if not fqn.startswith(prefix):
        return None
    return fqn[len(prefix):] if row["submodules"] == "strip" else fqn


def expected_model(oracle: nn.Module, row: Mapping[str, Any], *, which: str = "all") -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict with the options of ``row`` applied by their definitions: the
    selection of ``enc`` (:func:`row_key`) and the frozen entries left out (SD-3). ``which``: every entry
    ("all"), the parameters ("parameters"), or what training leaves as it is ("untouched": the frozen
    parameters and the buffer)."""
    params = {n: p for n, p in oracle.named_parameters()}
    keep = {
        "all": lambda k: True,
        "parameters": lambda k: k in params,
        "untouched": lambda k: k not in params or not params[k].requires_grad,
    }[which]
    out = {}
    for fqn, value in oracle.state_dict().items():
        key = row_key(fqn, row)
        frozen = fqn in params and not params[fqn].requires_grad
        if key is not None and keep(fqn) and not (frozen and row["ignore_frozen_params"]):
            out[key] = value
    return out


def expected_optim(oracle: nn.Module, optim: torch.optim.Optimizer, row: Mapping[str, Any]) -> dict[str, Any]:
    """The unwrapped optimizer's state dict keyed by FQN (SD-2), flattened with
    ``flatten_optimizer_state_dict`` (``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``)."""
    osd = fqn_keyed_optim(oracle, optim)
    return per_parameter(osd, sequence_types=True) if row["flatten_optimizer_state_dict"] else osd


# -- one model kind, its source, its target ------------------------------------------------------------


@dataclass
class Case:
    """The source (trained, with its unwrapped oracle) and the target of one model kind, on this rank."""

    kind: str
    impl: Any
    dist: Any
    ops: Any = field(init=False)
    source: nn.Module = field(init=False)
    source_enc: nn.Module = field(init=False)
    source_optim: torch.optim.Optimizer = field(init=False)
    oracle: nn.Module = field(init=False)
    oracle_optim: torch.optim.Optimizer = field(init=False)
    target: nn.Module = field(init=False)
    target_optim: torch.optim.Optimizer = field(init=False)
    #: the target's own state, full (model, optimizer) and sharded (model), to restore and compare with
    own: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.ops = sd_ops(self.impl)
        self.oracle = _build(0, self.dist.device)
        self.oracle_optim = _adam(self.oracle)
        self.source, self.source_enc = _make(self.kind, 0, self.impl, self.dist)
        self.source_optim = _adam(self.source)
        for step in range(2):
            _step(self.kind, self.oracle, self.oracle_optim, step, self.dist)
            _step(self.kind, self.source, self.source_optim, step, self.dist)
        self.make_target()

    @property
    def exact(self) -> bool:
        """Plain models train bit for bit like the oracle; ranks averaging gradients only to tolerance."""
        return self.kind == "plain"

    def make_target(self) -> None:
        """Seed 1, a perturbed optimizer over its parameters in reverse order, one step on another batch,
        and every persistent buffer different from the source's."""
        target, _ = _make(self.kind, 1, self.impl, self.dist)
        optim = target_optimizer([[p for p in target.parameters() if p.requires_grad]], "reversed")
        _step(self.kind, target, optim, 9, self.dist)
        with torch.no_grad():
            for name, buffer in target.named_buffers():
                if name.endswith("scale"):
                    buffer.copy_(different_like(self.oracle.get_buffer("scale")))
        self.target, self.target_optim = target, optim
        full = self.ops.options(full_state_dict=True)
        self.own = {
            "model-full": copy.deepcopy(self.ops.get_model_state_dict(target, options=full)),
            "optim-full": copy.deepcopy(self.ops.get_optimizer_state_dict(target, optim, options=full)),
            "model-sharded": copy.deepcopy(self.ops.get_model_state_dict(target)),
        }

    def restore(self) -> None:
        """The target back to its own state (full sets, checked); rebuilt on every rank if that fails."""
        full = self.ops.options(full_state_dict=True)

        def put_back() -> None:
            self.ops.set_model_state_dict(self.target, copy.deepcopy(self.own["model-full"]), options=full)
            self.ops.set_optimizer_state_dict(self.target, self.target_optim, copy.deepcopy(self.own["optim-full"]), options=full)
            assert_same_state(self.ops.get_model_state_dict(self.target, options=full), self.own["model-full"], what="restored target")

        failed = raised(put_back)
        if any(self.dist.all_gather_object(failed is not None)):
            self.make_target()


# -- the checks of one row ----------------------------------------------------------------------------


def options_of(ops: Any, row: Mapping[str, Any]) -> Any:
    return ops.options(
        full_state_dict=row["full_state_dict"],
        cpu_offload=row["cpu_offload"],
        ignore_frozen_params=row["ignore_frozen_params"],
        keep_submodule_prefixes=row["submodules"] != "strip",
        strict=row["strict"],
        broadcast_from_rank0=row["broadcast_from_rank0"],
        flatten_optimizer_state_dict=row["flatten_optimizer_state_dict"],
    )


def _quiet(fn: Callable[[], Any]) -> Any:
    """``fn()`` without the FutureWarning torch emits for ``submodules=`` (deprecated, still implemented)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn()


def check_get(case: Case, row: Mapping[str, Any], label: str) -> None:
    """Get of the source with ``row``'s options equals the oracle with them applied (module docstring)."""
    __tracebackhide__ = True
    ops, dist = case.ops, case.dist
    options = options_of(ops, row)
    submodules = None if row["submodules"] == "none" else {case.source_enc}
    model_sd = _quiet(lambda: ops.get_model_state_dict(case.source, submodules=submodules, options=options))
    optim_sd = ops.get_optimizer_state_dict(case.source, case.source_optim, options=options)
    where = f"rank {dist.rank}, {label}"
    if row["full_state_dict"] and row["cpu_offload"] and dist.rank != 0:
        for name, got in (("model", model_sd), ("optimizer", optim_sd)):
            if got != {}:
                fail(f"{name} state dict on a rank other than 0 with full_state_dict and cpu_offload", f"keys {list(got)[:6]}", "{}", where)
        return
    device = torch.device("cpu") if row["cpu_offload"] else dist.device
    for name, tree in (("model", model_sd), ("optimizer", optim_sd)):
        devices = sorted({str((t.to_local() if isinstance(t, DTensor) else t).device) for t in tensors_of(tree)})
        if devices not in ([], [str(device)]):
            fail(f"{name} state dict: devices of its tensors", devices, [str(device)], where)
        kinds = {type(t).__name__ for t in tensors_of(tree)}
        if row["full_state_dict"] and "DTensor" in kinds:
            fail(f"{name} state dict with full_state_dict: a DTensor", sorted(kinds), "plain tensors only", where)
    flat = row["flatten_optimizer_state_dict"]
    nested = set(optim_sd) == {"state", "param_groups"}
    if flat == nested or (flat and not all(k.startswith(("state.", "param_groups.")) for k in optim_sd)):
        fail("optimizer state dict form", sorted(optim_sd)[:8], "flat keys state.<fqn>.<name>, param_groups.<fqn>.<key>" if flat
             else "{'state', 'param_groups'}", where)
    atol = None if case.exact else ATOL
    want_model = expected_model(case.oracle, row)
    if not row["full_state_dict"] and case.kind != "plain" and dist.world_size > 1:
        params = expected_model(case.oracle, row, which="parameters")
        plain = [k for k in params if not isinstance(model_sd.get(k), DTensor)]
        if plain:
            fail("sharded model state dict: parameters that are not DTensors", sorted(plain), "DTensors", where)
    assert_matches_oracle(model_sd, want_model, "model state dict", rank=dist.rank, atol=atol, check_order=True,
                          exact=frozenset(expected_model(case.oracle, row, which="untouched")))
    assert_matches_oracle(per_parameter(optim_sd), per_parameter(expected_optim(case.oracle, case.oracle_optim, row)),
                          "optimizer state dict", rank=dist.rank, atol=atol, check_order=False)


def check_set(case: Case, row: Mapping[str, Any], label: str) -> None:
    """Set of the source's own dict, as ``row`` gives it, into the differing target (module docstring)."""
    __tracebackhide__ = True
    ops, dist = case.ops, case.dist
    full = row["full_state_dict"]
    model_in = copy.deepcopy(ops.get_model_state_dict(case.source, options=ops.options(full_state_dict=full)))
    optim_in = copy.deepcopy(ops.get_optimizer_state_dict(
        case.source, case.source_optim, options=ops.options(full_state_dict=full, flatten_optimizer_state_dict=row["flatten_optimizer_state_dict"])))
    if row["ignore_frozen_params"]:
        model_in = {k: v for k, v in model_in.items() if k not in FROZEN}
    if row["given"] == "missing":
        del model_in[DROPPED]
    given = list(model_in)
    expected_model_sd = {k: (model_in[k] if k in model_in else v)
                         for k, v in case.own["model-full" if full else "model-sharded"].items()}
    expected_optim_sd = copy.deepcopy(optim_in)
    holds = not row["broadcast_from_rank0"] or dist.rank == 0
    options = options_of(ops, row)
    before = snapshot(model=case.target, optim=case.target_optim)
    box: list[Any] = []
    exc = raised(lambda: box.append(ops.set_model_state_dict(case.target, model_in if holds else {}, options=options)))
    if exc is None:
        exc = raised(lambda: ops.set_optimizer_state_dict(case.target, case.target_optim, optim_in if holds else {}, options=options))
    every = dist.all_gather_object(None if exc is None else (type(exc).__name__, str(exc)))
    where = f"rank {dist.rank}, {label}"
    if row["strict"] and row["given"] == "missing":
        if exc is None or any(e != every[0] for e in every):
            fail("a strict set without one entry: what each rank raised (None: returned)", every,
                 f"the same RuntimeError naming {DROPPED!r} on every rank", where)
        if not isinstance(exc, RuntimeError):
            fail("a strict set without one entry: exception type", f"{type(exc).__name__}: {exc}", "RuntimeError", where)
        assert_names_key(str(exc), DROPPED, where=where)
        assert_unchanged(before, model=case.target, optim=case.target_optim, where=f"{where}: after the refused strict set")
        return
    if any(e is not None for e in every):
        fail("a set that must load: what each rank raised (None: returned)", every, "no error on any rank", where)
    after_model = ops.get_model_state_dict(case.target, options=ops.options(full_state_dict=full))
    after_optim = ops.get_optimizer_state_dict(case.target, case.target_optim, options=ops.options(full_state_dict=full))
    assert_same_state(after_model, expected_model_sd, what="model state dict after the set", where=where)
    assert_same_state(per_parameter(after_optim), per_parameter(expected_optim_sd), what="optimizer state dict after the set",
                      where=where, check_order=False)
    result = box[0]
    missing = sorted(k for k in expected_model_sd if k not in given)
    reported = (sorted(getattr(result, "missing_keys", [])), sorted(getattr(result, "unexpected_keys", [])))
    if reported != (missing, []):
        fail("missing and unexpected keys reported by the set", reported, (missing, []), where)
