"""The suite's assertion helpers: one place, one message shape, each with self-tests in tests/.

Every failure reads the same way (array-api-tests' habit)::

    <what>
      got:      <observed>
      expected: <what the requirement says>
      where:    <the path into the value, the call, the rank>

and hides the helpers' own frames (``__tracebackhide__``), so a failing test points at the test line.

Every failure belongs to a clause of SPEC.md (``ML-13.b``, or a requirement ``ML-5`` that has no
lettered clauses): a test names the clause an assertion checks with ``with clause("ML-13.b"):`` or
:func:`check_each`'s keys, and what fails inside (the suite's assertion, or the implementation's own
exception) is reported as that clause's failure. A known deviation pins the clauses it fails
(``clauses=ML-13.b`` in an expected-failures file), never the wording of a message.

==================================  ================================================================
helper                              checks
==================================  ================================================================
:func:`assert_bitwise_equal`        one tensor: kind, dtype, shape and every bit (NaN payloads, -0.0)
:func:`assert_same_state`           nested state (dicts in order, lists, tensors, DTensors, scalars):
                                    bit-exact by default, or within a float tolerance
:func:`assert_local_shard`          a DTensor's local shard against the documented layout of its
                                    full value (``torch.chunk`` along each sharded mesh dim)
:func:`assert_planned_shard`        a DTensor against the layout a sharding plan asked for: its
                                    mesh's ranks and groups, placements, coordinate and local shard
:func:`snapshot`/:func:`assert_unchanged`
                                    "changes nothing", deeply: a module's parameters and buffers
                                    (non-persistent too), an optimizer's ``state`` and
                                    ``param_groups``, a state dict's entries (identity, meta entries)
:func:`assert_names_key`            an error message names the full canonical key, not a wrapper's
                                    internal path
:func:`raised`/:func:`assert_same_error_on_every_rank`
                                    what a call raises (``BaseException`` too); every rank raised the
                                    same type with the same message
==================================  ================================================================
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance import fqn
from conformance.adapters.unsupported import Unsupported
from conformance.harness.failures import CLAUSE_ATTR, PropertiesFailed, clause_of

__all__ = [
    "CLAUSE_ID",
    "clause",
    "check_each",
    "reraise",
    "WRAPPER_SEGMENTS",
    "fail",
    "bits",
    "assert_bitwise_equal",
    "assert_same_state",
    "expected_local_chunk",
    "assert_local_shard",
    "assert_planned_shard",
    "Snapshot",
    "snapshot",
    "assert_unchanged",
    "assert_names_key",
    "raised",
    "expect_error",
    "assert_same_error_on_every_rank",
]

#: Path segments that wrappers insert into parameter names and that must never reach a key or a
#: message a user reads (fairscale/reference FlattenParamsWrapper, FSDP1, torch.compile, activation
#: checkpointing, and the flat parameters' own names).
WRAPPER_SEGMENTS: tuple[str, ...] = (*(segment + "." for segment in fqn.WRAPPER_SEGMENTS), "flat_param_0", "_flat_param")


def fail(what: str, got: Any, expected: Any, where: str = "") -> NoReturn:
    """Fail the test with the suite's one message shape."""
    __tracebackhide__ = True
    lines = [what, f"  got:      {got}", f"  expected: {expected}"]
    if where:
        lines.append(f"  where:    {where}")
    pytest.fail("\n".join(lines), pytrace=False)


#: A clause ID: a requirement (``ML-13``) or one of its lettered clauses (``ML-13.b``).
CLAUSE_ID = re.compile(r"[A-Z]{2}-\d+(\.[a-z])?")


def _checked_clause(clause_id: str) -> str:
    if not isinstance(clause_id, str) or not CLAUSE_ID.fullmatch(clause_id):
        raise ValueError(f"{clause_id!r} is not a clause ID like 'ML-13.b' or 'ML-5' (SPEC.md)")
    return clause_id


@contextmanager
def clause(clause_id: str) -> Iterator[None]:
    """What fails inside (an assertion of the suite, or the implementation's own exception) is a failure
    of SPEC clause ``clause_id``. The innermost clause wins; a skip is not a failure and passes through."""
    _checked_clause(clause_id)
    try:
        yield
    except pytest.skip.Exception:
        raise
    except BaseException as exc:  # tag whatever fails, then let it go on unchanged
        if clause_of(exc) is None:
            try:
                setattr(exc, CLAUSE_ATTR, clause_id)
            except (AttributeError, TypeError):  # an exception type that takes no attributes: report it untagged
                pass
        raise


def check_each(checks: Mapping[str, Callable[[], Any]] | None = None, /, **named: Callable[[], Any]) -> None:
    """Run every check (by clause ID, in order), each even when an earlier one failed, and fail with
    all that failed: one failure per clause, so that a known deviation pinned to one clause
    (``clauses=`` in an expected-failures file) does not hide a regression in another. A check's error
    other than the suite's own ``fail`` counts as that clause's failure too; ``Unsupported`` (an op the
    adapter lacks) does not, and is raised again when no other check failed (the test is a skip).

    ``check_each({"ML-13.a": raises, "ML-13.b": names})``. Keywords (``check_each(raises=...)``) name
    properties that are not clauses of SPEC: their failures belong to the test's requirement."""
    __tracebackhide__ = True
    parts: list[tuple[str | None, str]] = []
    lacking: list[Unsupported] = []
    keyed = {_checked_clause(key): check for key, check in (checks or {}).items()}
    for key, check in [*keyed.items(), *named.items()]:
        try:
            check()
        except pytest.skip.Exception:
            raise
        except Unsupported as exc:  # an op the adapter lacks: this check cannot be made, the others still can
            lacking.append(exc)
        except BaseException as exc:  # every clause is reported, whatever broke it
            text = getattr(exc, "msg", None) if isinstance(exc, pytest.fail.Exception) else f"{type(exc).__name__}: {exc}"
            # The innermost clause wins: a check may tag a part of itself as another clause.
            parts.append((clause_of(exc) or key, str(text)) if key in keyed else (clause_of(exc), f"[{key}] {text}"))
    if parts:
        raise PropertiesFailed(parts)
    if lacking:  # nothing failed, but not everything was checked: a skip naming the op, never a pass
        raise lacking[0]


def _short(value: Any, limit: int = 300) -> str:
    """``repr(value)`` in about ``limit`` characters: its head and its tail. The tail is kept because
    an error's message is often a traceback (DCP's ``CheckpointException`` carries each rank's), whose
    last lines name the exception and say what went wrong; a pin's ``match=`` searches them too."""
    text = repr(value)
    if len(text) <= limit:
        return text
    tail = limit // 3
    head = limit - tail
    return f"{text[:head]} ...({len(text) - limit} of {len(text)} chars cut)... {text[-tail:]}"


# -- tensors, bit for bit ------------------------------------------------------------------------

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous, reinterpreted as integers of the same width: two tensors
    have equal bits exactly when these are ``torch.equal`` (a NaN equals the same NaN payload, and
    ``-0.0`` differs from ``0.0``, unlike ``==``)."""
    plain = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()  # a lazy view's values, not its raw storage
    if plain.dtype == torch.bool:
        return plain.view(torch.uint8)
    if plain.is_complex():
        plain = torch.view_as_real(plain)
    width = plain.element_size()
    return plain if not (plain.is_floating_point() or plain.is_complex()) else plain.view(_INT_OF_WIDTH[width])


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (bits(got) != bits(expected)).reshape(-1).nonzero()
    if diff.numel() == 0:
        return ""
    flat = int(diff[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape)) if expected.dim() else ()
    g = got.detach().cpu().reshape(-1)[flat].item()
    e = expected.detach().cpu().reshape(-1)[flat].item()
    if repr(g) == repr(e):  # NaNs with different payloads, or values the dtype prints alike: show the bits
        g_bits, e_bits = (f"{v!r} (bits {int(bits(t).reshape(-1)[flat]):#x})" for v, t in ((g, got), (e, expected)))
        return f"{diff.numel()} of {expected.numel()} elements differ; first at index {index}: {g_bits} vs {e_bits}"
    return f"{diff.numel()} of {expected.numel()} elements differ; first at index {index}: {g!r} vs {e!r}"


def assert_bitwise_equal(got: Any, expected: torch.Tensor, *, what: str = "tensor", where: str = "") -> None:
    """``got`` is a plain tensor (not a DTensor, unless ``expected`` is one) with ``expected``'s dtype,
    shape and bits. Devices may differ (a CUDA result is compared on the CPU)."""
    __tracebackhide__ = True
    if not isinstance(got, torch.Tensor):
        fail(f"{what}: not a tensor", type(got).__name__, f"a tensor of {expected.dtype}", where)
    if isinstance(got, DTensor) != isinstance(expected, DTensor):
        fail(f"{what}: wrong tensor kind", type(got).__name__, type(expected).__name__, where)
    if got.dtype != expected.dtype:
        fail(f"{what}: dtype differs", got.dtype, expected.dtype, where)
    if got.shape != expected.shape:
        fail(f"{what}: shape differs", tuple(got.shape), tuple(expected.shape), where)
    if got.device.type == "meta" or expected.device.type == "meta":
        if got.device.type != expected.device.type:
            fail(f"{what}: device differs", got.device, expected.device, where)
        return
    if isinstance(got, DTensor) and isinstance(expected, DTensor):  # both or neither (checked above)
        assert_local_shard(got, expected.full_tensor(), what=what, where=where)
        return
    if not torch.equal(bits(got), bits(expected)):
        fail(f"{what}: values differ", _first_difference(got, expected), "the same bits", where)


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> str:
    g, e = got.detach().cpu(), expected.detach().cpu()
    if not (g.is_floating_point() or g.is_complex()):
        return "" if torch.equal(g, e) else _first_difference(g, e)
    ok = torch.isclose(g.double(), e.double(), atol=atol, rtol=rtol, equal_nan=True)
    if bool(ok.all()):
        return ""
    bad = (~ok).reshape(-1).nonzero()
    flat = int(bad[0])
    return (
        f"{bad.numel()} of {e.numel()} elements differ beyond atol={atol}, rtol={rtol}; "
        f"first at flat index {flat}: {g.reshape(-1)[flat].item()!r} vs {e.reshape(-1)[flat].item()!r}"
    )


# -- nested state ---------------------------------------------------------------------------------


def assert_same_state(
    got: Any,
    expected: Any,
    *,
    what: str = "state",
    where: str = "",
    atol: float | None = None,
    rtol: float = 0.0,
    check_order: bool = True,
) -> None:
    """``got`` equals ``expected`` as nested state.

    Dicts have the same keys (in the same order unless ``check_order=False``); lists and tuples the
    same length and kind; tensors the same kind (plain or DTensor), dtype and shape, and equal bits,
    or, with ``atol``, values within ``atol + rtol * |expected|`` (floats only; integers stay exact).
    A DTensor is compared as placements, global shape and local shard, so no rank gathers anything.
    Non-tensor leaves are of the same type and ``==``; floats bit for bit (NaN equals the same NaN,
    ``-0.0`` is not ``0.0``), since a hyperparameter must round-trip exactly."""
    __tracebackhide__ = True
    path = where or "the top"
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            fail(f"{what}: not a dict", type(got).__name__, "a dict", path)
        got_keys, want_keys = list(got), list(expected)
        if set(map(repr, got_keys)) != set(map(repr, want_keys)):
            missing = [k for k in want_keys if k not in got]
            unexpected = [k for k in got_keys if k not in expected]
            fail(f"{what}: keys differ", f"missing {missing}, unexpected {unexpected}", _short(want_keys), path)
        if check_order and got_keys != want_keys:
            fail(f"{what}: key order differs", _short(got_keys), _short(want_keys), path)
        for key in want_keys:
            assert_same_state(
                got[key], expected[key], what=what, where=f"{where}[{key!r}]", atol=atol, rtol=rtol, check_order=check_order
            )
    elif isinstance(expected, (list, tuple)):
        if type(got) is not type(expected) or len(got) != len(expected):
            fail(f"{what}: sequence differs", _short(got), _short(expected), path)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same_state(g, e, what=what, where=f"{where}[{i}]", atol=atol, rtol=rtol, check_order=check_order)
    elif isinstance(expected, DTensor):
        if not isinstance(got, DTensor):
            fail(f"{what}: wrong tensor kind", type(got).__name__, "DTensor", path)
        if tuple(got.placements) != tuple(expected.placements):
            fail(f"{what}: placements differ", got.placements, expected.placements, path)
        if got.shape != expected.shape:
            fail(f"{what}: global shape differs", tuple(got.shape), tuple(expected.shape), path)
        assert_same_state(got.to_local(), expected.to_local(), what=what, where=f"{where} (local shard)", atol=atol, rtol=rtol)
    elif isinstance(expected, torch.Tensor):
        if atol is None:
            assert_bitwise_equal(got, expected, what=what, where=path)
            return
        if not isinstance(got, torch.Tensor) or isinstance(got, DTensor):
            fail(f"{what}: wrong tensor kind", type(got).__name__, "a plain tensor", path)
        if got.dtype != expected.dtype or got.shape != expected.shape:
            fail(f"{what}: dtype/shape differ", (got.dtype, tuple(got.shape)), (expected.dtype, tuple(expected.shape)), path)
        problem = _close(got, expected, atol, rtol)
        if problem:
            fail(f"{what}: values differ", problem, "equal within tolerance", path)
    else:
        if type(got) is not type(expected):
            fail(f"{what}: type differs", f"{type(got).__name__} {_short(got)}", f"{type(expected).__name__} {_short(expected)}", path)
        if isinstance(expected, float):  # bit for bit, as tensors: -0.0 is not 0.0, a NaN payload counts
            if _float_bits(got) != _float_bits(expected):
                fail(f"{what}: value differs", f"{got!r} (bits {_float_bits(got):#x})",
                     f"{expected!r} (bits {_float_bits(expected):#x})", path)
        elif got != expected:
            fail(f"{what}: value differs", _short(got), _short(expected), path)


def _float_bits(value: float) -> int:
    return int.from_bytes(struct.pack("<d", value), "little")


# -- per-rank truth: the local shard of a DTensor -------------------------------------------------


def expected_local_chunk(
    full: torch.Tensor, placements: Iterable[Any], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]
) -> tuple[torch.Tensor, list[int]]:
    """The local shard that the rank at ``coordinate`` of a mesh of ``mesh_shape`` holds of ``full``
    under ``placements``, and its offset in ``full`` per tensor dim.

    The documented layout: mesh dims are applied in order; ``Shard(d)`` splits the current piece
    along tensor dim ``d`` as ``torch.chunk`` does (pieces of ``ceil(n / k)``, the last ones short or
    empty); ``Replicate()`` keeps it whole."""
    piece = full
    offsets = [0] * full.dim()
    for size, coord, placement in zip(mesh_shape, coordinate, placements):
        if isinstance(placement, Shard):
            dim = placement.dim % full.dim()
            length = piece.shape[dim]
            chunk = -(-length // size) if length else 0
            start = min(coord * chunk, length)
            stop = min(start + chunk, length)
            piece = piece.narrow(dim, start, stop - start)
            offsets[dim] += start
        elif not isinstance(placement, Replicate):
            raise TypeError(f"expected_local_chunk: unsupported placement {placement!r}")
    return piece, offsets


def assert_local_shard(value: Any, full: torch.Tensor, *, what: str = "shard", where: str = "") -> None:
    """``value`` is a DTensor whose global shape is ``full``'s and whose local shard on this rank is
    exactly (shape and bits) the piece :func:`expected_local_chunk` assigns to this rank."""
    __tracebackhide__ = True
    if not isinstance(value, DTensor):
        fail(f"{what}: not a DTensor", type(value).__name__, "DTensor", where)
    if value.shape != full.shape:
        fail(f"{what}: global shape differs", tuple(value.shape), tuple(full.shape), where)
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return
    piece, offsets = expected_local_chunk(full, value.placements, tuple(mesh.shape), tuple(coordinate))
    local = value.to_local()
    rank_where = f"{where} (mesh coordinate {tuple(coordinate)}, {value.placements}, offsets {offsets})"
    if tuple(local.shape) != tuple(piece.shape):
        fail(f"{what}: local shard shape differs", tuple(local.shape), tuple(piece.shape), rank_where)
    assert_bitwise_equal(local, piece.to(local.dtype) if local.dtype != piece.dtype else piece, what=f"{what}: local shard", where=rank_where)


def _group_ranks(mesh: Any, dim: int) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(mesh.get_group(dim)))


def assert_planned_shard(
    value: Any,
    full: torch.Tensor,
    *,
    replicas: int,
    shards: int,
    rank: int,
    what: str = "shard",
    where: str = "",
    atol: float | None = None,
    rtol: float = 0.0,
) -> None:
    """``value`` is a DTensor of ``full`` (a tensor of positive dimension) laid out as a plan asked for:
    the world of ``replicas * shards`` ranks in ``replicas`` shard groups of ``shards`` consecutive
    ranks (:func:`conformance.adapters.sharding.strategy_layout`), rank ``r`` holding chunk
    ``r % shards`` of ``torch.chunk(full, shards)`` along dim 0. Checked on this rank (``rank``):

    * the mesh: 2-D of shape ``(replicas, shards)`` whose global ranks are ``arange(world).reshape(
      replicas, shards)`` (dim 0 the replicate groups, dim 1 the shard groups), placements
      ``(Replicate(), Shard(0))``; or, when one of the two is trivial, 1-D over every rank in order
      with ``Shard(0)`` (``replicas == 1``) or ``Replicate()`` (``shards == 1``). A shard axis of
      size 1 may hold ``Shard(0)`` or ``Replicate()``: both leave the whole value on every rank;
    * the process group of each mesh dim holds exactly the ranks that share it with this rank (a
      mesh read the wrong way round shares shards with the wrong ranks), and this rank's
      coordinate is ``(r // shards, r % shards)`` (``(r,)`` on a 1-D mesh);
    * the global shape and dtype are ``full``'s, and the local shard is this rank's planned piece of
      ``full`` (bit for bit, or within ``atol + rtol * |expected|``), computed from the plan, not from
      the coordinate the DTensor reports."""
    __tracebackhide__ = True
    world = replicas * shards
    if not isinstance(value, DTensor):
        fail(f"{what}: not a DTensor", type(value).__name__, "DTensor", where)
    if full.dim() == 0:
        raise TypeError("assert_planned_shard: the full value must have a positive dimension (a positional value)")
    if value.shape != full.shape or value.dtype != full.dtype:
        fail(f"{what}: global shape/dtype differ", (tuple(value.shape), value.dtype), (tuple(full.shape), full.dtype), where)
    mesh = value.device_mesh
    placements = tuple(value.placements)
    layout = f"{replicas} replica(s) x {shards} shard(s) over {world} ranks"
    ranks = mesh.mesh.tolist()
    if mesh.ndim == 2:
        if tuple(mesh.shape) != (replicas, shards):
            fail(f"{what}: mesh shape", tuple(mesh.shape), f"{(replicas, shards)} (replicate, shard): {layout}", where)
        want_ranks: list[Any] = torch.arange(world).reshape(replicas, shards).tolist()
        dim_groups = {0: [rank % shards + i * shards for i in range(replicas)],
                      1: [(rank // shards) * shards + j for j in range(shards)]}
        coordinate: tuple[int, ...] = (rank // shards, rank % shards)
        shard_ok = placements[1] == Shard(0) or (shards == 1 and placements[1] == Replicate())
        if placements[0] != Replicate() or not shard_ok:
            fail(f"{what}: placements", placements, "(Replicate(), Shard(0)): mesh dim 0 replicates, dim 1 shards", where)
    elif mesh.ndim == 1 and (replicas == 1 or shards == 1):
        want_ranks = list(range(world))
        dim_groups = {0: list(range(world))}
        coordinate = (rank,)
        allowed = [(Shard(0),)] if shards > 1 else [(Replicate(),)] if replicas > 1 else [(Shard(0),), (Replicate(),)]
        if placements not in allowed:
            fail(f"{what}: placements", placements, f"one of {allowed} on a 1-D mesh: {layout}", where)
    else:
        fail(f"{what}: mesh dimensions", f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}",
             f"a 2-D mesh (replicate, shard) of shape {(replicas, shards)}: {layout}", where)
    if ranks != want_ranks:
        fail(f"{what}: the mesh's global ranks (a mesh read the wrong way round?)", ranks, want_ranks, where)
    for dim, want in dim_groups.items():
        got = _group_ranks(mesh, dim)
        if got != want:
            fail(f"{what}: ranks of mesh dim {dim}'s process group, seen from rank {rank}", got, want, where)
    got_coordinate = mesh.get_coordinate()
    if got_coordinate is None or tuple(got_coordinate) != coordinate:
        fail(f"{what}: this rank's mesh coordinate", got_coordinate, coordinate, where)
    piece, offsets = expected_local_chunk(full, (Replicate(), Shard(0)), (replicas, shards), (rank // shards, rank % shards))
    local = value.to_local()
    here = f"{where} (rank {rank}: chunk {rank % shards} of {shards} along dim 0, offsets {offsets})"
    if tuple(local.shape) != tuple(piece.shape):
        fail(f"{what}: local shard shape", tuple(local.shape), tuple(piece.shape), here)
    if atol is None:
        assert_bitwise_equal(local, piece, what=f"{what}: local shard", where=here)
        return
    problem = _close(local, piece, atol, rtol)
    if problem:
        fail(f"{what}: local shard values differ", problem, "equal within tolerance", here)


# -- "changes nothing" -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A deep copy of what a failed call must leave as it was, taken by :func:`snapshot`."""

    labels: tuple[str, ...]
    states: tuple[Any, ...]
    # The modules' parameter and buffer objects, held so that no new object can take the address of
    # one that was replaced: identity is recorded by id().
    keepalive: tuple[Any, ...] = ()


def _tensor_record(value: torch.Tensor) -> Any:
    """A meta tensor has no values: its type, dtype, shape and stride are what must not change."""
    if isinstance(value, DTensor):
        local = value.to_local()
        return ("dtensor", tuple(value.placements), tuple(value.shape), _tensor_record(local))
    if value.device.type == "meta":
        return ("meta", type(value).__name__, value.dtype, tuple(value.shape), value.stride())
    return value.detach().clone()


def _state_of(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        params = {name: _tensor_record(p) for name, p in obj.named_parameters(remove_duplicate=False)}
        buffers = {name: _tensor_record(b) for name, b in obj.named_buffers(remove_duplicate=False)}
        grads = {name: _tensor_record(p.grad) for name, p in obj.named_parameters(remove_duplicate=False) if p.grad is not None}
        # Identity counts: a call that swaps a Parameter for an equal new one cuts it off from the
        # optimizers and hooks that hold the old one.
        identity = {name: id(t) for name, t in (*obj.named_parameters(remove_duplicate=False), *obj.named_buffers(remove_duplicate=False))}
        return {"parameters": params, "buffers": buffers, "grads": grads, "identity": identity}
    if isinstance(obj, torch.optim.Optimizer):
        index = {id(p): i for i, p in enumerate(p for g in obj.param_groups for p in g["params"])}
        groups = [{k: (list(range(len(v))) if k == "params" else _state_of(v)) for k, v in g.items()} for g in obj.param_groups]
        order = [[index[id(p)] for p in g["params"]] for g in obj.param_groups]
        state = {index.get(id(p), repr(p.shape)): _state_of(s) for p, s in obj.state.items()}
        return {"param_groups": groups, "param_order": order, "state": state}
    if isinstance(obj, Mapping):
        return {"__type__": type(obj).__name__, "items": [(k, id(v), _state_of(v)) for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, *(_state_of(v) for v in obj)]
    if isinstance(obj, torch.Tensor):
        return _tensor_record(obj)
    return obj


def snapshot(**objects: Any) -> Snapshot:
    """Deep copies of ``objects`` (modules, optimizers, state dicts, by label) to compare against
    after a call that must change nothing. A module's parameters and buffers, and a state dict's
    entries, are recorded with their identity, so replacing one by an equal new object (say, a meta
    tensor by a built one) counts as a change."""
    keepalive = tuple(t for obj in objects.values() if isinstance(obj, nn.Module) for t in (*obj.parameters(), *obj.buffers()))
    return Snapshot(tuple(objects), tuple(_state_of(obj) for obj in objects.values()), keepalive)


def assert_unchanged(before: Snapshot, *, where: str = "", **objects: Any) -> None:
    """Every object of ``before`` (passed again under its label) is as it was, deeply."""
    __tracebackhide__ = True
    if tuple(objects) != before.labels:
        raise TypeError(f"assert_unchanged: pass the objects of the snapshot, {before.labels}; got {tuple(objects)}")
    for label, old, obj in zip(before.labels, before.states, objects.values()):
        assert_same_state(_state_of(obj), old, what=f"{label} changed by a call that must change nothing", where=where)


# -- error messages ----------------------------------------------------------------------------------


def assert_names_key(message: str, key: str, *, what: str = "error message", where: str = "",
                     forbidden: Iterable[str] = WRAPPER_SEGMENTS) -> None:
    """``message`` names ``key`` whole (not as part of a longer dotted name, so ``weight`` is not
    found in ``net.0.weight``), and no internal wrapper segment appears in it."""
    __tracebackhide__ = True
    leaked = [segment for segment in forbidden if segment in message]
    if leaked:
        fail(f"{what} names a wrapper's internal path", _short(message, 600), f"{key!r} without {leaked}", where)
    pattern = re.compile(r"(?<![\w.])" + re.escape(key) + r"(?![\w.]*\w)")
    if not pattern.search(message):
        fail(f"{what} does not name the key {key!r} whole", _short(message, 600), f"a message naming {key!r}", where)


def reraise(exc: BaseException | None) -> None:
    """Raise ``exc`` again, nothing when it is None: for checks (:func:`expect_error`) of what a call
    raised earlier, run inside :func:`check_each`."""
    if exc is not None:
        raise exc


def raised(fn: Callable[[], Any]) -> BaseException | None:
    """What ``fn()`` raises, of any type (DCP's ``CheckpointException`` is a ``BaseException``), or None.
    pytest's own outcomes (skip, fail, xfail) and interrupts pass through, and so does ``Unsupported``:
    an op the adapter does not provide is a skip of the test, never the error a test asked for."""
    try:
        fn()
    except (KeyboardInterrupt, SystemExit, Unsupported, pytest.skip.Exception, pytest.fail.Exception, pytest.xfail.Exception):
        raise
    except BaseException as exc:  # noqa: B036 - the point is to see what the implementation raises
        return exc
    return None


def expect_error(fn: Callable[[], Any], types: type[BaseException] | tuple[type[BaseException], ...], *,
                 keys: Iterable[str] = (), needles: Iterable[str] = (), what: str = "call", where: str = "") -> BaseException:
    """``fn()`` raises an instance of ``types`` whose message names every key of ``keys`` whole (see
    :func:`assert_names_key`) and contains every string of ``needles``; returns the exception."""
    __tracebackhide__ = True
    exc = raised(fn)
    wanted = types if isinstance(types, tuple) else (types,)
    expected = " or ".join(t.__name__ for t in wanted)
    if exc is None:
        fail(f"{what}: no error raised", "a normal return", expected, where)
    if not isinstance(exc, wanted):
        fail(f"{what}: wrong exception type", f"{type(exc).__name__}: {_short(str(exc), 600)}", expected, where)
    text = str(exc)
    for key in keys:
        assert_names_key(text, key, what=f"{what}: {type(exc).__name__} message", where=where)
    missing = [n for n in needles if n not in text]
    if missing:
        fail(f"{what}: the message lacks {missing}", _short(text, 600), f"a message containing {missing}", where)
    return exc


def assert_same_error_on_every_rank(ctx: Any, exc: BaseException | None, *, what: str = "error") -> None:
    """Collective: every rank of ``ctx`` (a :class:`~conformance.harness.context.RankContext`) raised,
    with the same exception type and the same message. Call it on every rank, after the failing call,
    with what that call raised there (``None`` when it returned): a rank that returned, or raised
    something else, fails the test on every rank. A rank that never gets here (left waiting in a
    collective) is cut by the test's rank timeout (``@pytest.mark.rank_timeout``)."""
    __tracebackhide__ = True
    mine = None if exc is None else (type(exc).__module__ + "." + type(exc).__qualname__, str(exc))
    every = ctx.all_gather_object(mine)
    if len(set(every)) > 1 or every[0] is None:
        listing = "; ".join(f"rank {r}: " + ("returned normally" if e is None else f"{e[0]}: {e[1][:300]}") for r, e in enumerate(every))
        if all(e is None for e in every):  # nothing to agree on: the call succeeded everywhere
            headline = f"{what}: no error raised" + ("" if ctx.world_size == 1 else " on any rank")
        else:
            headline = f"{what}: ranks did not raise the same error"
        fail(headline, listing, "the same exception type and message on every rank", f"rank {ctx.rank} of {ctx.world_size}")
