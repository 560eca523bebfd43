"""The oracle of every generated case and the comparisons with it.

The oracle is the unwrapped model of seed 0 trained on one process on whole batches
(:func:`oracle_run`, the one way it is trained): the "run that never stopped". A run of the
implementation under test is compared with it, or with what it saved, as a :class:`TrainingState`
(model state dict, FQN-keyed optimizer state dict) by :func:`assert_state_matches`: keys, buffers
bitwise, parameters bitwise or within a tolerance, and the optimizer parameter by parameter, so that
optimizers whose groups are split or ordered differently compare.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from conformance.asserts import assert_same_state, expected_local_chunk, fail
from conformance.fqn import canonical_fqn
from conformance.generated.builders import batch, build, make_optimizer, oracle_params, train_step
from conformance.generated.execution import whole_batch
from conformance.generated.specs import Case, ModelSpec

__all__ = [
    "TrainingState",
    "Labels",
    "NEVER_STOPPED",
    "tolerance",
    "by_parameter",
    "fqn_keyed",
    "split_state",
    "non_persistent_buffers",
    "to_cpu",
    "assert_optimizer_matches",
    "assert_model_matches",
    "assert_local_shards",
    "assert_state_matches",
    "assert_local_state",
    "assert_buffers_kept",
    "oracle_state",
    "oracle_run",
    "train_steps",
    "warm_target",
    "continue_alongside",
    "continue_and_compare",
]

Run = tuple[nn.Module, torch.optim.Optimizer]


class TrainingState(NamedTuple):
    """What a run is compared by: its model state dict and its FQN-keyed optimizer state dict
    (``{"state": {fqn: ...}, "param_groups": [{..., "params": [fqn, ...]}]}``)."""

    model: dict[str, Any]
    optim: dict[str, Any]


class Labels(NamedTuple):
    """What the two halves of a :class:`TrainingState` comparison are called in its failure messages
    (``optim`` None: the optimizer state is not compared there)."""

    model: str
    optim: str | None


#: The comparison with the unwrapped run that never stopped, after a load and more steps.
NEVER_STOPPED = Labels("model vs the unwrapped run that never stopped", "optimizer vs the unwrapped run that never stopped")


def tolerance(spec: ModelSpec) -> tuple[float, float]:
    """(atol, rtol) for values computed on several ranks that average gradients."""
    return (1e-5, 1e-4) if spec.dtype == "float32" else (1e-10, 1e-8)


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def by_parameter(osd: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as ``{fqn: {"hyperparameters": ..., "state": ...}}`` over
    ``keys`` (in that order), so that two dicts whose groups are split or ordered differently compare
    parameter by parameter. State for FQNs not in ``keys`` is kept under its own FQN (and fails)."""
    hyper: dict[str, Any] = {}
    for group in osd["param_groups"]:
        values = {k: _plain(v) for k, v in sorted(group.items()) if k != "params"}
        for fqn in group["params"]:
            hyper[fqn] = values
    out = {fqn: {"hyperparameters": hyper.get(fqn, "<in no param group>"), "state": dict(osd["state"].get(fqn, {}))} for fqn in keys}
    for fqn in osd["state"]:
        if fqn not in out:
            out[fqn] = {"hyperparameters": hyper.get(fqn), "state": osd["state"][fqn]}
    return out


def fqn_keyed(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``optim.state_dict()`` of the unwrapped ``model`` keyed by FQN (``named_parameters`` names)."""
    name_of = {p: canonical_fqn(n) for n, p in model.named_parameters()}
    fqns = [name_of[p] for g in optim.param_groups for p in g["params"]]
    osd = optim.state_dict()
    return {
        "state": {fqns[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def split_state(spec: ModelSpec, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parameters, buffers) of a model state dict, in its order."""
    params = {e.fqn for e in spec.params()}
    return {k: v for k, v in state.items() if k in params}, {k: v for k, v in state.items() if k not in params}


def non_persistent_buffers(spec: ModelSpec, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers by clean FQN (wrapper segments removed), copied."""
    wanted = set(spec.non_persistent())
    out = {}
    for name, buf in model.named_buffers():
        clean = canonical_fqn(name)
        if clean in wanted:
            out[clean] = buf.detach().clone()
    return out


def to_cpu(obj: Any) -> Any:
    """``obj`` with every plain tensor moved to the CPU, DTensors gathered (collective), containers rebuilt."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().cpu()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# -- comparisons ---------------------------------------------------------------------------------------------


def assert_optimizer_matches(got: Mapping[str, Any], expected: Mapping[str, Any], keys: Sequence[str], *, what: str, where: str,
        atol: float | None = None, rtol: float = 0.0) -> None:
    """Parameter by parameter: the same hyperparameters (exactly) and state (bitwise, or within ``atol``)."""
    __tracebackhide__ = True
    g, e = by_parameter(got, keys), by_parameter(expected, keys)
    assert_same_state({k: v["hyperparameters"] for k, v in g.items()}, {k: v["hyperparameters"] for k, v in e.items()},
        what=f"{what}: hyperparameters", where=where)
    assert_same_state({k: v["state"] for k, v in g.items()}, {k: v["state"] for k, v in e.items()}, what=f"{what}: state", where=where, atol=atol,
        rtol=rtol, check_order=False)


def assert_model_matches(
    spec: ModelSpec, got: Mapping[str, Any], expected: Mapping[str, Any], *, what: str, where: str,
    atol: float | None = None, rtol: float = 0.0, check_order: bool = True
) -> None:
    """The same keys (in the same order, where the requirement says so: SD-1, FP-12); buffers bitwise
    (never computed), parameters bitwise or within ``atol``."""
    __tracebackhide__ = True
    if (list(got) if check_order else sorted(got)) != (list(expected) if check_order else sorted(expected)):
        fail(f"{what}: keys differ{' (or their order)' if check_order else ''}", list(got), list(expected), where)
    got_params, got_buffers = split_state(spec, got)
    want_params, want_buffers = split_state(spec, expected)
    assert_same_state(got_buffers, want_buffers, what=f"{what}: buffers", where=where, check_order=check_order)
    assert_same_state(got_params, want_params, what=f"{what}: parameters", where=where, atol=atol, rtol=rtol, check_order=check_order)


def assert_local_shards(got: Any, expected: Any, *, what: str, where: str, atol: float | None = None, rtol: float = 0.0) -> None:
    """Per-rank truth: every DTensor in ``got`` (nested dicts, walked by the keys both have) holds, on this
    rank, the piece of the ``expected`` full value that the documented layout assigns to its mesh
    coordinate (:func:`conformance.asserts.expected_local_chunk`), not only a full value that gathers right."""
    __tracebackhide__ = True
    from torch.distributed.tensor import DTensor

    if isinstance(got, Mapping) and isinstance(expected, Mapping):
        for key in got:
            if key in expected:
                assert_local_shards(got[key], expected[key], what=what, where=f"{where}[{key!r}]", atol=atol, rtol=rtol)
        return
    if not isinstance(got, DTensor) or not isinstance(expected, torch.Tensor):
        return
    coordinate = got.device_mesh.get_coordinate()
    if coordinate is None:
        return
    piece, offsets = expected_local_chunk(expected.detach().cpu(), got.placements, tuple(got.device_mesh.shape), tuple(coordinate))
    assert_same_state(
        got.to_local().detach().cpu(), piece, what=f"{what}: local shard",
        where=f"{where} (mesh coordinate {tuple(coordinate)}, {got.placements}, offsets {offsets})", atol=atol, rtol=rtol
    )


def assert_state_matches(spec: ModelSpec, got: TrainingState, expected: TrainingState, labels: Labels, *, where: str,
        atol: float | None = None, rtol: float = 0.0, check_order: bool = True) -> None:
    """The one comparison of a run's state: the model state dicts (:func:`assert_model_matches`; key
    order only with ``check_order``), then, unless ``labels.optim`` is None, the optimizer state dicts
    parameter by parameter over the spec's trainable key FQNs (:func:`assert_optimizer_matches`)."""
    __tracebackhide__ = True
    assert_model_matches(spec, got.model, expected.model, what=labels.model, where=where, atol=atol, rtol=rtol, check_order=check_order)
    if labels.optim is not None:
        assert_optimizer_matches(got.optim, expected.optim, spec.trainable(), what=labels.optim, where=where, atol=atol, rtol=rtol)


def assert_local_state(got: TrainingState, expected: TrainingState, labels: Labels, *, where: str, atol: float | None = None,
        rtol: float = 0.0) -> None:
    """:func:`assert_local_shards` of the model, then of the optimizer state (``got`` as the
    implementation returned it, DTensors not gathered; ``expected`` full values)."""
    __tracebackhide__ = True
    assert_local_shards(got.model, expected.model, what=labels.model, where=where, atol=atol, rtol=rtol)
    if labels.optim is not None:
        assert_local_shards(got.optim, expected.optim, what=labels.optim, where=where, atol=atol, rtol=rtol)


def assert_buffers_kept(spec: ModelSpec, model: nn.Module, before: Mapping[str, torch.Tensor], *, by: str, where: str) -> None:
    """The non-persistent buffers of ``model`` are still ``before`` (what :func:`non_persistent_buffers`
    copied before ``by``, a load that must not touch them)."""
    __tracebackhide__ = True
    assert_same_state(non_persistent_buffers(spec, model), before, what=f"non-persistent buffers changed by {by}", where=where)


# -- the oracle and training --------------------------------------------------------------------------------------


def train_steps(spec: ModelSpec, run: Run, steps: Iterable[int], device: torch.device | str = "cpu",
        local: Callable[[torch.Tensor], torch.Tensor] = whole_batch) -> None:
    """Train ``run`` one step on ``local`` of the global batch of each of ``steps`` (its rank's rows
    when it is sharded)."""
    model, optim = run
    for step in steps:
        train_step(model, optim, local(batch(spec, step, device)))


def oracle_run(case: Case, steps: int, device: torch.device | str = "cpu") -> Run:
    """The unwrapped model of seed 0 and its optimizer (source plan) after ``steps`` steps on whole batches."""
    model = build(case.model, 0, device)
    optim = make_optimizer(case.optimizer, case.source, oracle_params(model))
    train_steps(case.model, (model, optim), range(steps), device)
    return model, optim


def oracle_state(oracle: Run) -> TrainingState:
    """The oracle's :class:`TrainingState` on the CPU."""
    model, optim = oracle
    return TrainingState(to_cpu(model.state_dict()), to_cpu(fqn_keyed(model, optim)))


def warm_target(case: Case, model: nn.Module, optim: torch.optim.Optimizer, device: torch.device | str,
        rank_slice: Callable[[torch.Tensor], torch.Tensor] = whole_batch) -> None:
    """One step on a batch no source sees, so the target has optimizer state of its own to overwrite."""
    train_step(model, optim, rank_slice(batch(case.model, 999, device)))


def continue_alongside(case: Case, oracle: Run, target: Run, device: torch.device | str = "cpu",
        local: Callable[[torch.Tensor], torch.Tensor] = whole_batch) -> None:
    """``case.more_steps`` more training steps of the oracle and the loaded target on the same global
    batches (the target sees ``local`` of each: its rank's rows when it is sharded)."""
    for step in range(case.steps, case.steps + case.more_steps):
        train_steps(case.model, oracle, (step,), device)
        train_steps(case.model, target, (step,), device, local)


def continue_and_compare(case: Case, oracle: Run, target: Run, read_state: Callable[[], TrainingState], labels: Labels = NEVER_STOPPED, *,
        where: str, device: torch.device | str = "cpu", local: Callable[[torch.Tensor], torch.Tensor] = whole_batch,
        atol: float | None = None, rtol: float = 0.0, check_order: bool = True) -> None:
    """Train the loaded ``target`` next to the ``oracle`` (trained ``case.steps`` steps) for the case's
    remaining steps, then compare ``read_state()`` (the target's state on the CPU, keyed by FQN) with
    the oracle's: the run that never stopped."""
    __tracebackhide__ = True
    continue_alongside(case, oracle, target, device, local)
    assert_state_matches(case.model, read_state(), oracle_state(oracle), labels, where=where, atol=atol, rtol=rtol, check_order=check_order)
