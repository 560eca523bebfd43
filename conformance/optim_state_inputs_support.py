"""What the OS tests (``conformance/test_optim_state.py``) put into a sharded optimizer or its calls,
beside the set-up of ``optim_state_support.py``: the documented layout of flat parameters
(:class:`Layout`, OS-2) by which the value-domain states are written on each rank (:func:`edge_state`,
:func:`write_state`: OS-3, OS-5, OS-6, OS-12), the bad inputs of the error tests (:func:`bad_osd`,
:func:`bad_layout`, :func:`check_error`: OS-16, OS-17, OS-19) and the faults injected into state-dict
calls (:data:`FAILING_CALLS`, :func:`state_dict_calls`: OS-20)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from conformance import models
from conformance.adapters.sharding import hybrid_mesh_shape
from conformance.asserts import assert_names_key, assert_same_error_on_every_rank, assert_unchanged, expected_local_chunk, fail
from conformance.asserts import bits as bits_of
from conformance.fqn import canonical_fqn
from conformance.harness.context import RankContext
from conformance.optim_state_support import UNITS, Run, Setup
from conformance.values import EDGE_DTYPES, edge_values

__all__ = [
    "require_per_parameter_state",
    "UnitLayout",
    "Layout",
    "EDGE_KINDS",
    "edge_state",
    "write_state",
    "check_error",
    "assert_not_wrapped",
    "bad_osd",
    "bad_layout",
    "InjectedFault",
    "FAILING_CALLS",
    "state_dict_calls",
]


# -- the documented layout of flat parameters (OS-2), from the unwrapped model -------------------------


@dataclass(frozen=True)
class UnitLayout:
    """One unit's flat parameter: its parameters (first names) in flat order, with shapes and offsets."""

    fqns: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int


class Layout:
    """Where every element of a setup's parameters lies on this rank, as OS-2 documents it.

    A unit flattens the parameters no nested unit owns, in ``named_parameters`` order (a tied
    parameter once, under its first name), pads with zeros to a multiple of the shard count and keeps
    chunk ``shard_rank`` of ``ceil(numel / shards)`` elements; an original parameter holds the part of
    that chunk it overlaps (1-D, possibly empty; its own shape when the shard axis is trivial)."""

    def __init__(self, setup: Setup, oracle: nn.Module, world_size: int, rank: int) -> None:
        units = sorted((canonical_fqn(u) for u in UNITS[setup.model][setup.use_orig_params]), key=len, reverse=True)
        members: dict[str, list[tuple[str, nn.Parameter]]] = {u: [] for u in ["", *units]}
        self.unit_of: dict[str, str] = {}
        for fqn, param in oracle.named_parameters():
            unit = next((u for u in units if fqn.startswith(u + ".")), "")
            members[unit].append((fqn, param))
            self.unit_of[fqn] = unit
        self.units: dict[str, UnitLayout] = {}
        for unit, params in members.items():
            offsets = [0]
            for _, p in params:
                offsets.append(offsets[-1] + p.numel())
            self.units[unit] = UnitLayout(tuple(f for f, _ in params), tuple(p.shape for _, p in params), tuple(offsets[:-1]), offsets[-1])
        if setup.strategy == "NO_SHARD":
            self.shards, self.shard_rank = 1, 0
        elif setup.strategy == "HYBRID_SHARD":
            self.shards = hybrid_mesh_shape(world_size)[1]
            self.shard_rank = rank % self.shards
        else:
            self.shards, self.shard_rank = world_size, rank

    def chunk(self, unit: str) -> int:
        return -(-self.units[unit].numel // self.shards)

    def flat_local(self, unit: str, fulls: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of the unit's zero-padded flat tensor made of ``fulls`` (FQN -> a tensor of
        that parameter's shape, any dtype)."""
        layout = self.units[unit]
        flat = torch.cat([fulls[f].reshape(-1) for f in layout.fqns])
        chunk = self.chunk(unit)
        padded = torch.cat([flat, flat.new_zeros(chunk * self.shards - flat.numel())])
        return padded[self.shard_rank * chunk : (self.shard_rank + 1) * chunk].clone()

    def real_numel(self, unit: str) -> int:
        """How many elements of this rank's chunk are not padding."""
        chunk = self.chunk(unit)
        return max(0, min(self.units[unit].numel, (self.shard_rank + 1) * chunk) - self.shard_rank * chunk)

    def orig_local(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` (shaped like the parameter ``fqn``) that this rank's chunk holds."""
        if self.shards == 1:
            return full.clone()
        unit = self.units[self.unit_of[fqn]]
        offset = unit.offsets[unit.fqns.index(fqn)]
        chunk = self.chunk(self.unit_of[fqn])
        lo = min(max(offset, self.shard_rank * chunk), offset + full.numel())
        hi = max(min(offset + full.numel(), (self.shard_rank + 1) * chunk), lo)
        return full.reshape(-1)[lo - offset : hi - offset].clone()

    def local_value(self, fqns: tuple[str, ...], param: torch.Tensor, fulls: dict[str, torch.Tensor], flat: bool) -> torch.Tensor:
        """What the optimizer parameter ``param`` (standing for ``fqns``) holds of ``fulls`` on this rank:
        a DTensor's ``torch.chunk`` piece, a flat parameter's chunk, or an original parameter's part."""
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            coordinate = mesh.get_coordinate()
            assert coordinate is not None, "a DTensor of a mesh this rank is not in"
            piece, _ = expected_local_chunk(fulls[fqns[0]], param.placements, tuple(mesh.shape), tuple(coordinate))
            full = fulls[fqns[0]]
            return DTensor.from_local(piece.clone(), mesh, param.placements, run_check=False, shape=full.shape, stride=full.stride())
        if flat:
            return self.flat_local(self.unit_of[fqns[0]], fulls)
        return self.orig_local(fqns[0], fulls[fqns[0]])


# -- OS-3, OS-5, OS-6, OS-12: whole value domains, bit for bit ------------------------------------------


#: What a value-domain case writes besides AdamW's own state: "param-dtype", a positional entry of the
#: parameter's dtype holding its edge values; "other-dtypes", one positional entry of every other dtype
#: of EDGE_DTYPES; "0-dim", 0-dim entries of several dtypes.
EDGE_KINDS = ("param-dtype", "other-dtypes", "0-dim")


def edge_state(run: Run, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state for every trainable FQN, written rather than trained, so nothing is computed and
    every comparison is bitwise: AdamW's own entries (sane values, so it can step) and the entries of
    ``kind`` (see :data:`EDGE_KINDS`): positional ones have the parameter's shape and hold the edge
    values of their dtype (float64 beyond float32, int64 beyond 2**53, NaN payloads, inf, -0.0,
    subnormals, bf16, bool, ...) shifted per parameter; 0-dim ones are the same for every FQN (a flat
    parameter has one of each)."""
    gen = torch.Generator().manual_seed(7)
    out: dict[str, dict[str, torch.Tensor]] = {}
    params = [(n, p) for n, p in run.oracle.named_parameters() if p.requires_grad]
    for index, (fqn, param) in enumerate(params):
        entry: dict[str, torch.Tensor] = {
            "step": torch.tensor(5.0),
            "exp_avg": torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype),
            "exp_avg_sq": torch.rand(param.shape, generator=gen, dtype=torch.float64).to(param.dtype) + 0.5,
        }
        if kind == "0-dim":
            entry["scalar_float64"] = torch.tensor(1.0 + 2.0**-40, dtype=torch.float64)
            entry["scalar_int64"] = torch.tensor(2**53 + 1, dtype=torch.int64)
            entry["scalar_bool"] = torch.tensor(True)
            entry["scalar_nan"] = edge_values(param.dtype)[10].clone()  # a NaN with a payload
            entry["scalar_negzero"] = torch.tensor(-0.0, dtype=param.dtype)
        else:
            dtypes = [param.dtype] if kind == "param-dtype" else [d for d in EDGE_DTYPES if d != param.dtype]
            for dtype in dtypes:
                edges = edge_values(dtype)
                reps = -(-param.numel() // edges.numel())
                entry[f"edge_{str(dtype).removeprefix('torch.')}"] = edges.repeat(reps).roll(index)[: param.numel()].reshape(param.shape)
        out[fqn] = {k: v.to(param.device) for k, v in entry.items()}
    return out


def _piece_offset(local: torch.Tensor, full: torch.Tensor, where: str) -> int:
    """Where this rank's 1-D part ``local`` of the parameter ``full`` starts in it, found by value (the
    parameters are freshly initialized, so the match is unique): an implementation's own layout, which
    OS-2 checks separately, does not decide what this test can write."""
    flat, k = full.detach().reshape(-1), local.numel()
    if k == 0 or local.shape == full.shape:
        return 0
    rows = (bits_of(flat).unfold(0, k, 1) == bits_of(local.detach().reshape(-1))).all(dim=1).nonzero()
    if rows.numel() == 0:
        fail("an original parameter's local part is no slice of the parameter", tuple(local.shape), f"a slice of {tuple(full.shape)}", where)
    return int(rows[0])


def require_per_parameter_state(run: Run, what: str) -> None:
    """Skip, naming ``what``, where the stack steps an optimizer of its own (:func:`~conformance.optim_state_support.attach_optimizer`):
    its state is kept by its own partitions, not per parameter of the model, so ``what`` (state written
    into, or read from, ``torch.optim``'s per-parameter state) cannot be done to it."""
    if run.optim is not run.built_optim:
        pytest.skip(f"the stack steps an optimizer of its own ({type(run.optim).__name__}, attach_optimizer), whose state "
                    f"is not kept per parameter of the model: {what} is not possible")


def write_state(run: Run, values: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put ``values`` into both optimizers: the oracle's full, the sharded run's as this rank's part
    (a flat parameter's chunk of the documented layout, an original parameter's part where it lies,
    a DTensor's ``torch.chunk`` piece)."""
    require_per_parameter_state(run, "writing edge values into the optimizer's per-parameter state")
    params = dict(run.oracle.named_parameters())
    for fqn, entry in values.items():
        run.oracle_optim.state[params[fqn]] = {n: v.clone() for n, v in entry.items()}
    layout = Layout(run.setup, run.oracle, run.dist.world_size, run.dist.rank)
    in_optim = {p for g in run.optim.param_groups for p in g["params"]}
    for fqns, param in run.ops.optimizer_params(run.model):
        if param not in in_optim:
            continue
        orig_piece = not isinstance(param, DTensor) and run.setup.use_orig_params
        offset = _piece_offset(param, params[fqns[0]], f"{fqns[0]} on rank {run.dist.rank}") if orig_piece else 0
        state: dict[str, torch.Tensor] = {}
        for name, value in values[fqns[0]].items():
            if value.dim() == 0:
                state[name] = value.clone()
            elif orig_piece:
                state[name] = value.reshape(-1)[offset : offset + param.numel()].clone().view(param.shape)
            else:
                fulls = {f: entry[name] for f, entry in values.items()}
                state[name] = layout.local_value(fqns, param, fulls, flat=not run.setup.use_orig_params)
        run.optim.state[param] = state


# -- errors: every rank sees the bad input, or one rank does ---------------------------------------------

# Where the bad input is (WHERE: on every rank, or on the last rank only while the others get a good
# one) and whether this rank gets it (bad_input_here): conformance/error_cases.py.


def assert_not_wrapped(before: Any, model: nn.Module, where: str) -> None:
    """``model`` is as its ``snapshot`` ``before`` says, and no module of it is a sharding unit (a
    refused construction wraps nothing)."""
    __tracebackhide__ = True
    assert_unchanged(before, where=where, model=model)
    wrapped = [type(m).__name__ for m in model.modules() if "FullyShard" in type(m).__name__ or "FSDP" in type(m).__name__]
    if wrapped:
        fail("a refused construction wrapped the module", wrapped, "no unit", where)


def check_error(dist: RankContext, exc: BaseException | None, types: tuple[type[BaseException], ...], keys: tuple[str, ...], where: str) -> None:
    """Every rank raised the same error (type and message), of ``types``, naming every key whole."""
    __tracebackhide__ = True
    assert_same_error_on_every_rank(dist, exc, what=where)
    if not isinstance(exc, types):
        fail(f"{where}: exception type", f"{type(exc).__name__}: {exc}", " or ".join(t.__name__ for t in types), f"rank {dist.rank}")
    for key in keys:
        assert_names_key(str(exc), key, where=f"{where}, rank {dist.rank}")


def bad_osd(kind: str, osd: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``osd`` (full or sharded) broken one way, and the FQN the error must name. New dicts around the
    same values: ``osd`` is left as it was."""
    state = {fqn: dict(entry) for fqn, entry in osd["state"].items()}
    groups = [{**g, "params": list(g["params"])} for g in osd["param_groups"]]
    if kind == "unknown-fqn":
        state["net.9.weight"] = dict(state["net.2.weight"])
        fqn = "net.9.weight"
    elif kind == "wrong-shape":
        exp_avg = state["net.2.weight"]["exp_avg"]
        # sharded: another parameter's DTensor, a well-formed DTensor of the wrong global shape
        state["net.2.weight"]["exp_avg"] = state["net.0.weight"]["exp_avg"] if isinstance(exp_avg, DTensor) else torch.zeros(3, 7)
        fqn = "net.2.weight"
    elif kind == "same-numel":
        # net.2.weight's exp_avg reshaped (15, 10) -> (10, 15): every element there, in order, but not its
        # shape; a check by element count loads it as if it fit. Sharded: a DTensor of that global shape.
        exp_avg = state["net.2.weight"]["exp_avg"]
        if isinstance(exp_avg, DTensor):
            full = exp_avg.full_tensor()
            reshaped = distribute_tensor(full.reshape(full.shape[1], full.shape[0]), exp_avg.device_mesh, exp_avg.placements)
        else:
            reshaped = exp_avg.reshape(exp_avg.shape[1], exp_avg.shape[0]).clone()
        state["net.2.weight"]["exp_avg"] = reshaped
        fqn = "net.2.weight"
    elif kind == "extra-group":  # a saved group of parameters the optimizer does not hold (the frozen stem)
        groups.append({**{k: v for k, v in groups[0].items() if k != "params"}, "params": ["stem.weight", "stem.bias"]})
        fqn = "stem.weight"
    elif kind == "group-mismatch":
        groups[0]["params"].remove("net.4.bias")
        groups.append({**{k: v for k, v in groups[0].items() if k != "params"}, "params": ["net.4.bias"]})
        fqn = "net.4.bias"
    elif kind == "malformed":  # no optimizer state dict at all: its param_groups left out
        return {"state": state}, "param_groups"
    else:
        raise AssertionError(kind)
    return {"state": state, "param_groups": groups}, fqn


class _SharedAcross(nn.Module):
    """Two linear layers named ``first`` and ``second`` whose weights are one parameter."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        setattr(self, first, nn.Linear(4, 4))
        setattr(self, second, nn.Linear(4, 4))
        getattr(self, second).weight = getattr(self, first).weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.children())


def bad_layout(kind: str, bad: bool, device: Any) -> tuple[nn.Module, tuple[str, ...], tuple[str, ...], bool]:
    """A model whose layout is bad in the way ``kind`` says when ``bad`` (else one that would wrap), the
    units to wrap, the FQNs the error must name and the ``use_orig_params`` it needs."""
    if kind == "mixed-requires-grad":
        model = models.build("frozen", device=device)
        if not bad:
            model.stem.requires_grad_(True)  # this rank's model is uniform: it would wrap
        return model, (), ("stem.weight",), False
    if kind == "mixed-dtype":  # one unit (the root) would flatten float32 and float64 parameters together
        model = models.build("mlp", device=device)
        if bad:
            model.get_submodule("net.2").double()
        return model, (), ("net.2.weight", "net.2.bias"), True
    if kind == "shared-across-units":  # embed.weight is head.weight: a unit at `embed` and the root would both hold it
        return models.build("tied", device=device), ("embed",), ("embed.weight", "head.weight"), True
    # shared by units whose names end alike ("proj" and "projX", "h.1" and "h.10"): units are told
    # apart by their whole names, so the shared parameter is still an error naming both
    first, second = kind.removeprefix("shared-across-units:").split("/")
    return _SharedAcross(first, second).to(device), (first, second), (f"{first}.weight", f"{second}.weight"), True


# -- OS-20: settings survive a failure inside a state-dict call ---------------------------------------------


class InjectedFault(RuntimeError):
    """Raised by a hook the test installs, from inside an implementation's state-dict call."""


def _fail_once(register: Callable[[Callable[..., Any]], RemovableHandle]) -> None:
    """Register, through ``register``, a hook that raises :class:`InjectedFault` the first time it runs
    and removes itself."""
    handle: RemovableHandle | None = None

    def hook(*args: Any) -> None:
        assert handle is not None  # registered before anything can run it
        handle.remove()
        raise InjectedFault("fault injected by the test inside a state-dict call")

    handle = register(hook)


#: A state-dict call that fails from inside (a hook of torch's own state_dict/load_state_dict raises),
#: by name: how to arm the fault, and the call.
FAILING_CALLS: dict[str, tuple[Callable[[Run], None], Callable[[Run, dict[str, Any]], Any]]] = {
    "optim_state_dict-full": (
        lambda run: _fail_once(run.optim.register_state_dict_pre_hook),
        lambda run, saved: run.ops.optim_state_dict(run.model, run.optim),
    ),
    "optim_state_dict-sharded": (
        lambda run: _fail_once(run.optim.register_state_dict_pre_hook),
        lambda run, saved: run.ops.optim_state_dict(run.model, run.optim, sharded=True),
    ),
    "load-full-optim_state_dict": (
        lambda run: _fail_once(run.optim.register_load_state_dict_pre_hook),
        lambda run, saved: run.ops.load_optim_state_dict(run.model, run.optim, saved["optim-full"]),
    ),
    "load-sharded-optim_state_dict": (
        lambda run: _fail_once(run.optim.register_load_state_dict_pre_hook),
        lambda run, saved: run.ops.load_optim_state_dict(run.model, run.optim, saved["optim-sharded"]),
    ),
    "full-model-state_dict": (
        lambda run: _fail_once(run.module("net.2").register_state_dict_pre_hook),
        lambda run, saved: run.ops.full_state_dict(run.model),
    ),
    "sharded-model-state_dict": (
        lambda run: _fail_once(run.module("net.2").register_state_dict_pre_hook),
        lambda run, saved: run.ops.sharded_state_dict(run.model),
    ),
}


def state_dict_calls(run: Run) -> dict[str, Any]:
    """What every state-dict call of the implementation returns now (in a fixed order: collectives)."""
    ops = run.ops
    return {
        "model-default": ops.state_dict(run.model),
        "model-full": ops.full_state_dict(run.model),
        "model-sharded": ops.sharded_state_dict(run.model),
        "optim-full": ops.optim_state_dict(run.model, run.optim),
        "optim-sharded": ops.optim_state_dict(run.model, run.optim, sharded=True),
    }
