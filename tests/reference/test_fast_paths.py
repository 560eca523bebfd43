"""The checkpoint's plain path against its fast paths (:mod:`reference.checkpoint.fast_paths`).

The plain path (``torch.save`` and ``torch.load(weights_only=True)`` records, every save planned anew,
one thread) is the reference; the fast paths (record templates and parses, the plan cache, threads,
compact wire forms, ...) exist for speed only. So the same state dict saved both ways must give the
same files byte for byte, each path must load the other's checkpoint to the same bits, and a crafted
record must be refused alike. What each test catches:

- ``test_both_paths_write_the_same_bytes*``: a fast path that writes other bytes than ``torch.save``
  (a template of the wrong geometry, a view's whole storage, CRC32s left on), or a plain path that
  does (a record with CRC32s, a view written whole, another file split, other metadata);
- ``test_each_path_loads_the_others_checkpoint``, ``..._for_dtensor_shards``, ``test_a_region_...`` and
  ``test_gpu_...``: a reader that narrows, converts or places a value wrongly on either path, or drops
  a conj or neg bit (bits compared, NaN payloads and -0.0 included; dtype, shape and kind);
- ``test_the_plain_path_reads_a_whole_tensor_without_a_temporary``: a plain path that holds a record
  twice in memory while loading into meta values (SPEC ML-7);
- ``test_a_crafted_record_is_refused_alike`` and ``test_a_record_of_a_tensor_in_the_wrong_shape_...``:
  a path that runs code from a record, resolves lying member names, skips the metadata's shape, or
  refuses otherwise than the other (the key, the file and the global named alike);
- ``test_the_switch_*``, ``test_no_fast_path_runs_*``, ``test_plans_travel_...``, ``test_the_writer_...``
  and ``test_api_asks_the_switch``: a switch that is ignored (a fast path still called while it is off,
  or not at all while it is on, so that the comparisons above compared one path with itself), not
  read from the environment by the processes the suite starts, or not passed to an async save's
  writer process.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import os
import pickle
import re
import shutil
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance.asserts import raised
from conformance.checkpoint_crafted_support import CODE_ROUTES, NAME_LIES, crafted_record, extension_for_exec, replace_record
from conformance.checkpoint_support import assert_same_bits, dtensor_of
from conformance.checkpoint_values_support import objects
from conformance.child_process import run_child
from conformance.values import EDGE_DTYPES, edge_tensors
from reference.checkpoint import (
    CheckpointFormatError,
    api,
    fast_paths,
    load,
    plan_cache,
    planner,
    records,
    save,
    storage,
    wait_for_removals,
    wire,
    writer_process,
)
from reference.checkpoint.collective import Collective
from reference.host_bytes import element_bytes
from tests.forked import python_c

MODES = ("fast", "plain")


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    with fast_paths.set_enabled(mode == "fast"):
        yield


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside (what monkeypatch does; rank bodies have no fixtures)."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _fixed_save_ids() -> contextlib.AbstractContextManager[None]:
    """Every save names its files and its ``storage_meta.save_id`` by one fixed id instead of a random
    one, so that two saves of one state dict can be compared byte for byte."""
    fixed = uuid.UUID(int=0x5EED)
    return _patched(storage, "uuid", SimpleNamespace(uuid4=lambda: fixed))


# -- the state dicts -----------------------------------------------------------------------------------


#: Every dtype a checkpoint may hold, as far as this torch has it (complex32 left out: experimental).
_DTYPES = [
    dtype
    for name in (
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu", "float4_e2m1fn_x2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
]


def _every_dtype() -> dict[str, torch.Tensor]:
    """The dtypes of :data:`_DTYPES` that :func:`conformance.values.edge_tensors` leaves out, each with its
    edge bits: the one-byte floats with every bit pattern (NaNs included), complex values of float
    edges, integers at their bounds; and tensors whose conj or neg bit is set (``torch.save`` keeps
    the bit, and a reader must apply it)."""
    out: dict[str, torch.Tensor] = {}
    for dtype in _DTYPES:
        if dtype in EDGE_DTYPES:
            continue
        name = str(dtype).removeprefix("torch.")
        if dtype.is_floating_point:
            out[name] = torch.arange(256 * dtype.itemsize, dtype=torch.int32).to(torch.uint8).view(dtype)
        elif dtype.is_complex:
            parts = torch.tensor([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e300, -1e-310], dtype=torch.float64)
            out[name] = torch.complex(parts, parts.flip(0)).to(dtype)
        else:
            info = torch.iinfo(dtype)
            out[name] = torch.tensor([info.min, info.max, 0, 1], dtype=torch.int64 if dtype != torch.uint64 else torch.uint64).to(dtype)
    out["complex64.conj"] = torch.complex(torch.arange(3.0), torch.arange(3.0) + 1).conj()
    out["float32.neg"] = torch._neg_view(torch.arange(-1.0, 2.0))  # no public way to a tensor with the neg bit
    return out


def _non_tensor_values() -> dict[str, Any]:
    """Values a checkpoint stores as ``torch.save`` records of objects (DCP's encoding): every kind the
    suite's ML-1 saves, and an optimizer's hyperparameters."""
    return {
        **objects("saved"),
        "betas": (0.9, 0.999),
        "milestones": [3, 6, 9],
        "options": {"momentum": 0.9, "nesterov": True, "groups": [[0, 1], [2]]},
    }


def _state_dict() -> dict[str, Any]:
    """Every dtype with its edge values, 0-dim, empty, non-contiguous and offset views, a Parameter,
    and non-tensor values, nested."""
    tensors = {**edge_tensors(seed=3), **_every_dtype()}
    tensors["parameter"] = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    tensors["expanded"] = torch.arange(3.0).expand(4, 3)  # stride 0: one storage element per column
    return {"model": tensors, "extra": _non_tensor_values(), "top": torch.tensor(-0.0)}


def _target(value: Any) -> Any:
    """A load target for ``value``: every tensor on the meta device (the load builds it: its dtype and
    shape are the checkpoint's, nothing of an earlier value), every non-tensor value ``None``."""
    if isinstance(value, DTensor):
        return DTensor.from_local(
            torch.empty(value.to_local().shape, dtype=value.dtype, device="meta"), value.device_mesh, value.placements,
            run_check=False, shape=value.shape, stride=value.stride(),
        )
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(torch.empty(value.shape, dtype=value.dtype, device="meta"), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return {k: _target(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict)) for v in value):
        return [_target(v) for v in value]
    return None


def _expected(value: Any) -> Any:
    """What a load of ``value`` gives back: its tensors' values (conj and neg bits applied), the rest as saved."""
    if isinstance(value, dict):
        return {k: _expected(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return value.detach().resolve_conj().resolve_neg()
    return value


def _as_local(value: Any) -> Any:
    """``value`` with each DTensor as its placements, global shape and local shard: compared rank by rank,
    without the collective that comparing DTensors whole makes."""
    if isinstance(value, dict):
        return {k: _as_local(v) for k, v in value.items()}
    if isinstance(value, DTensor):
        return {"placements": tuple(map(str, value.placements)), "shape": tuple(value.shape), "local": value.to_local()}
    return value


# -- saving and loading both ways ----------------------------------------------------------------------


def _files(path: Path) -> dict[str, bytes]:
    return {entry.name: entry.read_bytes() for entry in sorted(path.iterdir()) if entry.is_file()}


def _save_both_ways(state_dict: dict[str, Any], path: Path, *, group: Any = None, rank: int = 0,
                    barrier: Callable[[], None] = lambda: None) -> dict[str, tuple[Path, dict[str, bytes]]]:
    """Save ``state_dict`` to ``path`` with the fast paths (twice: the second save of a layout is the
    plan cache's), then on the plain path; each save's directory is moved aside after it, so that every
    save writes a fresh directory of the same name (its name is in the metadata). Returns, per save,
    its directory and (on rank 0) its files."""
    out: dict[str, tuple[Path, dict[str, bytes]]] = {}
    with _fixed_save_ids():
        for label, mode in (("fast", "fast"), ("fast, plan cached", "fast"), ("plain", "plain")):
            with _mode(mode):
                save(state_dict, checkpoint_id=path, process_group=group)
            wait_for_removals()
            barrier()
            kept = path.with_name(f"{path.name}-{label.replace(', ', '-').replace(' ', '-')}")
            files: dict[str, bytes] = {}
            if rank == 0:
                files = _files(path)
                shutil.rmtree(kept, ignore_errors=True)
                path.rename(kept)
            barrier()
            out[label] = (kept, files)
    return out


def _assert_same_files(saved: dict[str, tuple[Path, dict[str, bytes]]]) -> None:
    """Every save's directory holds the same files, byte for byte, as the plain path's."""
    _, plain = saved["plain"]
    assert plain, "the plain save wrote no files"
    for label, (_, files) in saved.items():
        assert sorted(files) == sorted(plain), f"{label} save: files {sorted(files)}, plain save: {sorted(plain)}"
        for name, data in files.items():
            if data != plain[name]:
                at = next((i for i, (a, b) in enumerate(zip(data, plain[name])) if a != b), min(len(data), len(plain[name])))
                pytest.fail(f"{label} save: {name} differs from the plain save's from byte {at} "
                            f"({len(data)} bytes, plain {len(plain[name])})")


def _load_as(mode: str, path: Path, like: dict[str, Any], group: Any = None) -> dict[str, Any]:
    target = _target(like)
    with _mode(mode):
        load(target, checkpoint_id=path, process_group=group)
    return target


def test_both_paths_write_the_same_bytes(tmp_path: Path) -> None:
    """One process, no group: the data files and ``.metadata`` of the fast save, of a second fast save
    (its plan from the plan cache) and of the plain save are equal byte for byte."""
    _assert_same_files(_save_both_ways(_state_dict(), tmp_path / "ckpt"))


def test_each_path_loads_the_others_checkpoint(tmp_path: Path) -> None:
    """The fast paths load the plain save's checkpoint and the plain path the fast save's, into meta
    targets (so dtype and shape are the checkpoint's), to the saved bits: NaN payloads, -0.0, every
    dtype, views loaded as their own elements, non-tensor values of their own types."""
    state = _state_dict()
    saved = _save_both_ways(state, tmp_path / "ckpt")
    for writer, reader in (("plain", "fast"), ("fast", "plain"), ("plain", "plain"), ("fast", "fast")):
        got = _load_as(reader, saved[writer][0], state)
        assert_same_bits(got, _expected(state), what=f"the {writer} save loaded on the {reader} path")


def test_a_region_of_a_saved_chunk_loads_alike(tmp_path: Path) -> None:
    """A checkpoint saved as one tensor, loaded as a 2x2 tiling of DTensor-like boxes by resharding: each
    path reads a region out of the middle of a record (the fast one straight from the file, the plain
    one by ``torch.load`` and ``narrow``)."""
    from reference.checkpoint.planner import ReferenceLoadPlanner
    from reference.checkpoint.storage import FileSystemReader

    full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5).neg()
    path = tmp_path / "ckpt"
    save({"w": full.t()}, checkpoint_id=path)  # a non-contiguous view: saved as its own elements
    for mode in MODES:
        with _mode(mode):
            reader = FileSystemReader(path)
            metadata = reader.read_metadata()
            target = {"w": torch.zeros(5, 7, dtype=torch.float64)}
            load_planner = ReferenceLoadPlanner()
            load_planner.set_up_planner(target, metadata)
            reader.set_up_storage_reader(metadata, True)
            plan = reader.prepare_local_plan(load_planner.create_local_plan())
            # The same plan, its one read cut into boxes: each box is a region inside the saved record.
            item = plan.items[0]
            boxes = []
            for r0, rows in ((0, 2), (2, 3)):
                for c0, cols in ((0, 4), (4, 3)):
                    boxes.append(type(item)(item.type, item.dest_index, torch.Size([r0, c0]), item.storage_index,
                                            torch.Size([r0, c0]), torch.Size([rows, cols])))
            reader.read_data(type(plan)(boxes), load_planner).wait()
            assert torch.equal(target["w"], full.t()), f"{mode} path: regions read {target['w']}, expected {full.t()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the host copies of GPU tensors are not exercised")
def test_gpu_tensors_are_saved_and_loaded_alike(tmp_path: Path) -> None:
    """GPU tensors (a transposed one among them) reach the host by a pinned copy one ahead on the fast
    path and by a plain copy on the plain one: the same files; and each path fills GPU targets (the
    fast one by non-blocking copies it waits for) with the other's values."""
    gen = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(64, 32, generator=gen).cuda().t(), "b": torch.randn(33, generator=gen, dtype=torch.float64).cuda(),
             "h": torch.randn(8, generator=gen).to(torch.bfloat16).cuda()}
    saved = _save_both_ways(state, tmp_path / "ckpt")
    _assert_same_files(saved)
    for writer, reader in (("plain", "fast"), ("fast", "plain")):
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with _mode(reader):
            load(target, checkpoint_id=saved[writer][0])
        assert_same_bits(target, state, what=f"the {writer} save loaded into GPU tensors on the {reader} path")


def test_the_plain_path_reads_a_whole_tensor_without_a_temporary(tmp_path: Path) -> None:
    """SPEC ML-7 on the plain path: a whole saved tensor loaded into a meta value (built on the CPU) has
    its bytes read from the record straight into the built tensor, never through a temporary of the
    record's size as ``torch.load`` makes; a region, and a tensor whose record is not its elements in
    order (a conjugated one), go through ``torch.load``."""
    path = tmp_path / "ckpt"
    whole, conj = torch.arange(12.0).reshape(3, 4), torch.complex(torch.arange(2.0), torch.ones(2)).conj()
    save({"whole": whole, "conj": conj}, checkpoint_id=path)
    with fast_paths.disabled(), _counting([(records, "_read_member_into")]) as counts:
        target = _target({"whole": whole, "conj": conj})
        load(target, checkpoint_id=path)
    assert counts["_read_member_into"] == 1, f"whole tensors read straight into their targets: {counts} (expected 1 of 2)"
    assert_same_bits(target, {"whole": whole, "conj": conj.resolve_conj()})


@pytest.mark.rank_timeout(60)
def test_both_paths_write_the_same_bytes_for_dtensor_shards(dist: Any) -> None:
    """At world size 1 and 2: DTensors sharded unevenly (an empty shard at world size 2) and replicated,
    a plain tensor and a non-tensor value every rank holds (written once), a value only the last rank
    holds; the three saves' files are equal byte for byte (the plans and results travel between the
    ranks compactly on the fast path, as DCP's dataclasses on the plain one), and each path loads the
    other's checkpoint, every rank its own shards, to the saved bits."""
    mesh = dist.mesh()
    gen = torch.Generator().manual_seed(11)
    full = {"rows": torch.randn(5, 3, generator=gen), "one": torch.randn(1, 4, generator=gen).to(torch.bfloat16),
            "cols": torch.randn(2, 7, generator=gen, dtype=torch.float64)}
    state: dict[str, Any] = {
        "rows": dtensor_of(full["rows"], mesh, [Shard(0)]),
        "one": dtensor_of(full["one"], mesh, [Shard(0)]),  # one row: the last rank's shard is empty at world size 2
        "cols": dtensor_of(full["cols"], mesh, [Shard(1)]),
        "rep": dtensor_of(torch.arange(4.0), mesh, [Replicate()]),
        "plain": torch.tensor([1, -2, 3], dtype=torch.int32),
        "step": 5,
    }
    if dist.rank == dist.world_size - 1:
        state["last_only"] = {"note": "the last rank's", "t": torch.tensor([True, False])}
    path = dist.tmp_dir / "ckpt"
    saved = _save_both_ways(state, path, group=dist.group, rank=dist.rank, barrier=dist.barrier)
    if dist.rank == 0:
        _assert_same_files(saved)
    for writer, reader in (("plain", "fast"), ("fast", "plain")):
        got = _load_as(reader, saved[writer][0], state, group=dist.group)
        assert_same_bits(_as_local(got), _as_local(state), what=f"rank {dist.rank}: the {writer} save loaded on the {reader} path")
    dist.barrier()


# -- crafted records -----------------------------------------------------------------------------------

_RAN_ENV = "SDC_TEST_CRAFTED_CODE_RAN"
#: (the record crafted, the route): every code route and name lie for a non-tensor value's record, the
#: routes of ML-27's tensor tests for a tensor's.
_CRAFTED = [("object", route) for route in CODE_ROUTES + NAME_LIES] + [
    ("tensor", route) for route in ("global", "stack-global", "build", "persistent-id", "ext1", "duplicate-data-pkl", "other-folder", "dot-dot")
]


def _step_free(message: str) -> str:
    """``message`` without the step it names: a tensor record's refusal comes while planning on the plain
    path (its ``torch.load`` onto meta refuses it) and while reading on the fast path (its parse leaves
    such a record to ``torch.load``, which refuses it then); both are before anything is replaced."""
    return re.sub(r"failed in (planning|reading)", "failed in STEP", message)


@pytest.mark.parametrize("kind, route", _CRAFTED, ids=[f"{k}-{r}" for k, r in _CRAFTED])
def test_a_crafted_record_is_refused_alike(tmp_path: Path, kind: str, route: str) -> None:
    """A record replaced by one that would run code (create a file, set an environment variable) by a
    pickle route, or whose member names lie: both paths raise ``CheckpointFormatError`` with the same
    message (up to the step), naming the key, the data file and, for a code route, ``builtins.exec``;
    the code runs on neither."""
    marker = tmp_path / "ran"
    code = f"import os; open({str(marker)!r}, 'a').close(); os.environ[{_RAN_ENV!r}] = '1'"
    errors = {}
    for mode in MODES:
        path = tmp_path / mode
        with _fixed_save_ids():
            save({"b": torch.arange(5.0), "note": "saved"}, checkpoint_id=path)
        key = "b" if kind == "tensor" else "note"
        name = replace_record(path, key, crafted_record(route, code))
        target = {"b": torch.zeros(5), "note": ""}
        with _mode(mode), extension_for_exec(route):
            exc = raised(lambda: load(target, checkpoint_id=path))
        ran = {"marker file": marker.exists(), "environment variable": os.environ.pop(_RAN_ENV, None) is not None}
        assert not any(ran.values()), f"{mode} path: the crafted code ran ({ran})"
        assert type(exc) is CheckpointFormatError, f"{mode} path: raised {exc!r}"
        text = str(exc)
        needles = [repr(key), name] + ([] if route in NAME_LIES else ["builtins.exec"])
        missing = [n for n in needles if n not in text]
        assert not missing, f"{mode} path: the error does not name {missing}: {text}"
        assert target["note"] == "", f"{mode} path: a non-tensor value was loaded from a refused checkpoint"
        errors[mode] = _step_free(text.replace(str(path), "<ckpt>"))
    assert errors["fast"] == errors["plain"], f"refused otherwise:\n  fast:  {errors['fast']}\n  plain: {errors['plain']}"


def test_a_record_of_a_tensor_in_the_wrong_shape_is_refused_alike(tmp_path: Path) -> None:
    """A tensor record overwritten by another tensor's (intact, of another shape): both paths check it
    against the metadata while planning, with the same error."""
    errors = {}
    for mode in MODES:
        path = tmp_path / mode
        with _fixed_save_ids():
            save({"b": torch.arange(5.0)}, checkpoint_id=path)
        stream = io.BytesIO()
        records.write_record(stream, torch.arange(6.0))
        replace_record(path, "b", stream.getvalue())
        with _mode(mode):
            exc = raised(lambda: load({"b": torch.zeros(5)}, checkpoint_id=path))
        assert type(exc) is CheckpointFormatError and "shape [6]" in str(exc), f"{mode} path: {exc!r}"
        errors[mode] = str(exc).replace(str(path), "<ckpt>")
    assert errors["fast"] == errors["plain"], errors


@pytest.mark.parametrize("mode", MODES)
def test_records_torch_load_reads_in_many_threads_at_once(mode: str) -> None:
    """A record that only ``torch.load`` reads, and only with the reference's extra allowance (a
    ``torch.Size``, an empty ``bytes`` value, an ``io.BytesIO``), read by four threads at once (the
    fast path's readers): every read succeeds, and torch's list of safe globals is left as it was."""
    stream = io.BytesIO()
    torch.save((torch.Size([2]), b"", io.BytesIO(b"state")), stream)
    record, before, failures = stream.getvalue(), torch.serialization.get_safe_globals(), []

    def read_many() -> None:
        for _ in range(100):
            try:
                value = records.read_object_record(record)
                assert value[:2] == (torch.Size([2]), b"") and value[2].getvalue() == b"state", value
            except Exception as exc:
                failures.append(exc)

    with _mode(mode):
        threads = [threading.Thread(target=read_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failures, f"{len(failures)} of 400 reads failed; the first: {failures[0]!r}"
    assert torch.serialization.get_safe_globals() == before, "torch's safe globals were left changed"


@pytest.mark.parametrize("mode", MODES)
def test_a_write_the_os_refuses_raises_the_os_error_on_both_paths(mode: str) -> None:
    """A stream whose writes fail past 1 KiB (a full disk): writing a 16 KiB tensor record raises that
    OSError on both paths. torch.save's archive writer swallows it and reports a file position that
    no longer matches; the plain path puts the OS's error back (SPEC AS-4.f)."""

    class FillsUp(io.BytesIO):
        def write(self, data: Any) -> int:
            if self.tell() + len(memoryview(data).cast("B")) > 1024:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    with _mode(mode):
        exc = raised(lambda: records.write_record(FillsUp(), torch.ones(4096)))
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, f"{mode} path: {exc!r}"


# -- the switch ----------------------------------------------------------------------------------------


def test_the_switch_is_on_by_default_and_disabled_restores_it() -> None:
    assert fast_paths.enabled(), f"the fast paths are off in the test process ({fast_paths.ENVIRONMENT_VARIABLE} is set?)"
    with fast_paths.disabled():
        assert not fast_paths.enabled()
        with fast_paths.set_enabled(True):
            assert fast_paths.enabled()
        assert not fast_paths.enabled()
    assert fast_paths.enabled()


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), ("", True), ("maybe", None)])
def test_the_switch_is_read_from_the_environment_at_import(value: str, on: bool | None) -> None:
    """A process started with the variable set (as the suite's rank processes are) has the fast paths on
    or off from its first import; a value that is neither is an error, not a guess."""
    env = {**os.environ, fast_paths.ENVIRONMENT_VARIABLE: value}
    probe = "from reference.checkpoint import fast_paths; print(fast_paths.enabled())"
    # A process forked from the torch-preloaded server, which has imported nothing of reference/.
    status, output = run_child(python_c, [probe], env=env, timeout=120, description="the import probe")
    if on is None:
        assert status != 0 and fast_paths.ENVIRONMENT_VARIABLE in output, output
    else:
        assert status == 0 and output.strip().splitlines()[-1:] == [str(on)], output


#: The fast paths' module-level functions, one or more per fast path: none may run while the switch is
#: off, and each runs in a save and load with it on (else the comparisons above compare nothing).
_FAST_FUNCTIONS = [
    (records, "_write_record_fast"),  # record templates, and records written without torch.save
    (records, "_without_crc32"),  # the CRC32 switch with its probe thread
    (records, "_parse"),  # records parsed with struct
    (storage, "read_region"),  # regions read in place (storage's name for records.read_region)
    (records, "_read_object_record_fast"),  # non-tensor values unpickled without torch.load
    (plan_cache, "layout_key"),  # the plan cache
    (planner, "_same_chunk"),  # whole-chunk reads planned without overlaps()
    (storage, "_run_all"),  # reader and writer threads
    (storage, "_on_host_one_ahead"),  # the next chunk copied to the host while one is written
]


@contextlib.contextmanager
def _counting(functions: list[tuple[Any, str]]) -> Iterator[dict[str, int]]:
    """Count the calls of each function inside (each still does its work)."""
    counts = {name: 0 for _, name in functions}
    with contextlib.ExitStack() as stack:
        for owner, name in functions:
            original = getattr(owner, name)

            def counted(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
                counts[__name] += 1
                return __original(*args, **kwargs)

            stack.enter_context(_patched(owner, name, counted))
        yield counts


class _Collector:
    """A top-level ``Stateful``: notes whether the garbage collector ran while the save asked for its state."""

    def __init__(self) -> None:
        self.collector_on: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        self.collector_on.append(gc.isenabled())
        return {"epoch": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _save_and_load_twice(path: Path) -> tuple[list[bool], list[str]]:
    """Two saves of one layout over each other (the second finds the first's plan and files), a load; the
    collector's state inside each save, and the steps of the load's collectives."""
    collector = _Collector()
    steps: list[str] = []

    def noting(method: str) -> Any:
        original = getattr(Collective, method)

        def noted(self: Collective, step: str, *args: Any) -> Any:
            steps.append(f"{method}:{step}")
            return original(self, step, *args)

        return noted

    sd = {"w": torch.arange(12.0).reshape(3, 4)[:, 1:], "note": {"lr": 0.5}, "progress": collector}
    plan_cache.clear()
    records._TEMPLATES.clear()
    with gc_enabled():
        save(sd, checkpoint_id=path)
        save(sd, checkpoint_id=path)
    wait_for_removals()
    with _patched(Collective, "all_succeed", noting("all_succeed")), _patched(Collective, "gather_decide_scatter", noting("gather_decide_scatter")):
        load({"w": torch.zeros(3, 3), "note": {"lr": 0.0}, "progress": _Collector()}, checkpoint_id=path)
    return collector.collector_on, steps


@contextlib.contextmanager
def gc_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was:
            gc.disable()


def test_no_fast_path_runs_while_the_switch_is_off(tmp_path: Path) -> None:
    """With the switch off, a save over an earlier one and a load call none of the fast paths' functions,
    keep the garbage collector on, remove the earlier save's files before returning, and plan the load
    with DCP's gather and scatter; with it on, every one of them runs. (A fast path that stops asking
    the switch fails the first half; a switch nobody asks, the second.)"""
    for mode in MODES:
        removals: list[Any] = []
        original_submit = storage._REMOVALS.submit

        def submit(paths: list[Path], __submit: Any = original_submit) -> None:
            removals.append(paths)
            __submit(paths)

        with _mode(mode), _counting(_FAST_FUNCTIONS) as counts, _patched(storage._REMOVALS, "submit", submit):
            collector_on, steps = _save_and_load_twice(tmp_path / mode)
        planning = [s for s in steps if s.endswith(":planning")]
        if mode == "plain":
            ran = {name: n for name, n in counts.items() if n}
            assert not ran, f"with the fast paths off, fast-path functions ran: {ran}"
            assert collector_on == [True, True], f"the plain path paused the garbage collector: {collector_on}"
            assert not removals, "the plain path left the earlier save's files to the removal thread"
            assert planning == ["gather_decide_scatter:planning"], f"the plain path planned the load with {planning}"
        else:
            idle = sorted(name for name, n in counts.items() if not n)
            assert not idle, f"with the fast paths on, these never ran (is the test still about them?): {idle}"
            assert collector_on == [False, False], f"the fast path left the garbage collector on: {collector_on}"
            assert removals, "the fast path removed the earlier save's files on the saving thread"
            assert planning == ["all_succeed:planning"], f"the fast path planned the load with {planning}"
        assert sorted(p.name for p in (tmp_path / mode).glob("*.distcp")) == [f"__0_{_tag(tmp_path / mode)}_0.distcp"], (
            f"{mode} path: the earlier save's data file was not removed"
        )


def _tag(path: Path) -> str:
    metadata = pickle.loads((path / ".metadata").read_bytes())
    return str(metadata.storage_meta.save_id).replace("-", "")[:12]


def test_plans_travel_as_dcp_dataclasses_on_the_plain_path() -> None:
    """A save's plan, pickled to travel between ranks: in the compact form on the fast path, as it is on
    the plain one; both unpickle to an equal plan."""
    from torch.distributed.checkpoint.planner import SavePlan

    sd_planner = planner.ReferenceSavePlanner()
    sd_planner.set_up_planner({"w": torch.ones(2, 3), "step": 1})
    plan = sd_planner.create_local_plan()
    for mode in MODES:
        with _mode(mode), _counting([(wire, "pack_items")]) as counts:
            data = pickle.dumps(wire.Compact(plan))
        got = pickle.loads(data)
        assert isinstance(got, SavePlan) and got.items == plan.items, f"{mode} path: {got!r}"
        assert (counts["pack_items"] > 0) == (mode == "fast"), f"{mode} path: pack_items ran {counts['pack_items']} times"


class _Connection:
    """What the writer process's loop reads its jobs from and answers on, in this process."""

    def __init__(self, jobs: list[Any]) -> None:
        self.jobs: list[Any] = list(jobs)
        self.replies: list[Any] = []

    def recv(self) -> Any:
        return self.jobs.pop(0)

    def send(self, reply: Any) -> None:
        self.replies.append(reply)


def test_the_writer_process_writes_on_the_path_the_rank_was_on(tmp_path: Path) -> None:
    """An async save's writer process writes each job with the switch the rank had when it sent it (a
    process spawned before ``fast_paths.disabled()``, or with another environment, would otherwise
    write on its own path): its loop, run here, writes a job sent with the switch off on the plain path
    and one sent with it on on the fast path, the same bytes."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    value = torch.arange(6.0)
    item = WriteItem(index=MetadataIndex("w", (0,)), type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([6])), properties=TensorProperties(dtype=value.dtype), size=torch.Size([6])))
    ref = ("bytes", bytes(element_bytes(value)), value.dtype, (6,))
    written = {}
    handler = signal.getsignal(signal.SIGINT)
    try:
        for fast in (False, True):
            directory = tmp_path / str(fast)
            directory.mkdir()
            job: tuple[Any, ...] = ("write", str(directory), "__0_x_", [(item, ref)], False, 1, [], fast)
            connection = _Connection([job, None])
            with _counting([(records, "_write_record_fast")]) as counts:
                writer_process._serve(connection)  # type: ignore[arg-type]  # the loop needs recv and send
            assert connection.replies and connection.replies[0][0] == "ok", connection.replies
            assert (counts["_write_record_fast"] > 0) == fast, f"a job sent with the fast paths {'on' if fast else 'off'} ran {counts}"
            written[fast] = (directory / "__0_x_0.distcp").read_bytes()
    finally:
        signal.signal(signal.SIGINT, handler)
    assert written[False] == written[True], "the writer process wrote other bytes on the plain path"


def test_api_asks_the_switch() -> None:
    """The load's planning shortcut and the plan cache's held items ask the switch (their effect on a
    save and a load is in the test above)."""
    from reference.checkpoint.planner import ReferenceLoadPlanner
    from reference.checkpoint.storage import FileSystemReader, FileSystemWriter

    for mode in MODES:
        with _mode(mode):
            assert api._plans_stay_local(ReferenceLoadPlanner(), FileSystemReader()) == (mode == "fast")
            assert planner.ReferenceSavePlanner()._caching() == (mode == "fast")
            assert api._writer_keeps_items(FileSystemWriter())
