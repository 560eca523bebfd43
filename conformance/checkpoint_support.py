"""Helpers the checkpoint sections' test files share (``test_checkpoint.py``, ``test_async_save.py``):
the adapter's ops, values and DTensors to save, bit-exact comparison,
faults and damage applied to a saved checkpoint, and memory measurement; then the set-up of
``test_checkpoint.py``'s tests, section by section (the values a checkpoint holds, the on-disk format,
meta loading, resharding, strict loading, successive saves, crafted checkpoints, loads failing at each
step, killed saves). Self-tests: ``tests/test_checkpoint_support.py``."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import math
import os
import pickle
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypedDict

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance import models
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.checkpoint import CheckpointOps
from conformance.adapters.sharding import ShardingPlan, hybrid_mesh_shape
from conformance.adapters.unsupported import skip_reason
from conformance.asserts import (
    assert_bitwise_equal,
    assert_local_shard,
    assert_names_key,
    assert_same_error_on_every_rank,
    assert_same_state,
    check_each,
    clause,
    expect_error,
    expected_local_chunk,
    fail,
    raised,
    reraise,
    snapshot,
)
from conformance.compare import fqn_keyed_optim, full_on_cpu
from conformance.dcp_files import dcp_directory, read_metadata, storage_bytes_range
from conformance.error_cases import EVERY_RANK, ONE_RANK
from conformance.faults import failing_fsync, failing_writes, is_data_file, unreadable_bytes
from conformance.harness.context import RankContext, per_group_cache
from conformance.values import EDGE_DTYPES, different_like, edge_tensors, lazy_views, perturb_hyperparameters

__all__ = [
    "extension_for_exec",
    "SAVE_FAULTS",
    "ExactFloat",
    "exact",
    "assert_same_bits",
    "call_or_skip",
    "dtensor_of",
    "checkpoint_ops",
    "group_of",
    "record_location",
    "in_checkpoint",
    "data_files_of",
    "file_read_by_one_rank",
    "damage",
    "injected_fault",
    "sharded_values",
    "zoo_model",
    "rss_kib",
    "peak_bytes_during",
    "is_same_bits",
    "child_save",
    "check_after_kill",
    "proves_a_save_loads",
    "proves_round_trip",
    "CODE_ROUTES",
    "NAME_LIES",
    "EXT_CODES",
    "crafted_pickle",
    "crafted_record",
    "replace_record",
    "mesh_2d_of",
    "fails_alike",
    "assert_local_shards",
    "target_like",
    "meta_like",
    "outside_bytes",
    "objects",
    "State",
    "state_of",
    "KINDS",
    "mixed_state",
    "RECORD_OVERHEAD",
    "format_save",
    "format_load",
    "check_built",
    "tp_model",
    "fsdp2_model",
    "assert_meta_load_rebuilds",
    "MarkedTensor",
    "error_checkpoint",
    "save_tp",
    "load_tp",
    "save_training",
    "load_training",
    "GOOD",
    "MISMATCHES",
    "asking_for",
    "job_model",
    "job_optim",
    "job_paths",
    "one_property_state",
    "described_by_states",
    "listed_in_metadata",
    "RAN_ENV",
    "STEPS",
    "step_state",
    "skeleton_of",
    "StepCase",
    "stateful_states",
    "load_with_faults",
    "names_the_failure",
    "most_specific_common_types",
    "KILL_POINTS",
    "PUBLICATION_KILL_POINTS",
    "QUICK_KILL_POINTS",
    "kill_points",
    "QUICK_TWO_RANK_KILLS",
    "two_rank_kills",
]

#: Faults that make a save fail after planning succeeded: the disk fills up before any data, or after
#: a few bytes of it (ENOSPC), every fsync fails (EIO), or the file system is read-only (EROFS), on the last
#: rank only or on every rank.
SAVE_FAULTS = ("full-disk-before-data", "full-disk-mid-data", "fsync-fails", "read-only")


def checkpoint_ops(impl: Adapter) -> CheckpointOps:
    return impl.require("checkpoint")


def call_or_skip(fn: Callable[[], Any]) -> Any:
    """Run an ops call; an option the implementation lacks is a skip naming it."""
    try:
        return fn()
    except Unsupported as exc:
        pytest.skip(str(exc))


def group_of(dist: RankContext) -> Any:
    return dist.group


@dataclass(frozen=True)
class ExactFloat:
    """A Python float compared by its bits: ``-0.0`` is not ``0.0`` and a NaN's payload counts (``==``
    says otherwise, so :func:`assert_same_state` alone would miss a loader that canonicalises them)."""

    bits: int

    def __repr__(self) -> str:
        return f"{struct.unpack('<d', struct.pack('<Q', self.bits))[0]!r} (bits {self.bits:#018x})"


def exact(value: Any) -> Any:
    """``value`` with every Python float replaced by its :class:`ExactFloat` (containers rebuilt, tensors
    and other leaves as they are): compare the results with :func:`assert_same_state`."""
    if type(value) is float:
        return ExactFloat(struct.unpack("<Q", struct.pack("<d", value))[0])
    if isinstance(value, Mapping):
        return {k: exact(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(exact(v) for v in value)
    return value


def assert_same_bits(got: Any, expected: Any, *, what: str = "loaded state", check_order: bool = True) -> None:
    """Nested state equal bit for bit: tensors (DTensors by placements, global shape and local shard),
    non-tensor values of the same type, Python floats by their bits."""
    __tracebackhide__ = True
    assert_same_state(exact(got), exact(expected), what=what, check_order=check_order)


def dtensor_of(full: torch.Tensor, mesh: Any, placements: list[Any]) -> DTensor:
    """A DTensor of ``full`` on ``mesh``, built from this rank's documented piece without any
    collective (so every dtype works on gloo); ``full`` on meta gives a meta DTensor."""
    coordinate = mesh.get_coordinate()
    piece, _ = expected_local_chunk(full, placements, tuple(mesh.shape), tuple(coordinate))
    return DTensor.from_local(piece.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def zoo_model(dist: RankContext, name: str, seed: int, device: str | torch.device) -> nn.Module:
    """Zoo model ``name`` built from ``seed`` on this rank's device, or, for ``device="meta"``, with
    every tensor on meta (the seed does not matter there)."""
    if str(device) == "meta":
        with torch.device("meta"):
            return models.ZOO[name]()
    return models.build(name, seed=seed, device=dist.device)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _release_free_memory() -> None:
    """Return the C allocator's free pages to the system (glibc's ``malloc_trim``): memory an earlier test of
    this rank process freed but the allocator kept would otherwise serve ``fn``'s allocations without
    raising the RSS, so a loader that copies every record would seem to allocate nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure is as good as the allocator lets it be
        pass


def peak_bytes_during(device: torch.device, fn: Callable[[], Any]) -> tuple[int, str]:
    """Bytes by which ``fn`` raised the peak memory of ``device`` above what was in use before it,
    and what was measured: the CUDA caching allocator's peak on a GPU (host memory does not grow when
    tensors are built there), the process's peak RSS (VmHWM, reset first) on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline, f"peak CUDA memory of {device}"
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("peak RSS is measured through Linux's /proc/self/clear_refs and VmHWM")
    gc.collect()
    _release_free_memory()
    baseline = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    fn()
    return (rss_kib("VmHWM") - baseline) * 1024, "peak RSS"


def injected_fault(dist: RankContext, path: Path, fault: str, where: str) -> contextlib.AbstractContextManager[None]:
    """The save fault ``fault`` (:data:`SAVE_FAULTS`) where ``where`` puts it: on every rank, or on the
    last rank only (``"one-rank"``, and ``"last-rank"`` as test_async_save.py spells it)."""
    if where in (ONE_RANK, "last-rank") and dist.rank != dist.world_size - 1:
        return contextlib.nullcontext()
    if fault == "fsync-fails":
        return failing_fsync()
    if fault == "read-only":  # every file of the directory, metadata too (root ignores chmod, so it is injected)
        return failing_writes(path, code=errno.EROFS, which=lambda name: True, at_open=True)
    return failing_writes(path, after_bytes=0 if fault == "full-disk-before-data" else 64)


def sharded_values(dist: RankContext, fill: float) -> dict[str, Any]:
    """A state dict every rank writes a part of (a sharded DTensor, 4 rows per rank) and a replicated value."""
    full = torch.arange(4 * dist.world_size * 3, dtype=torch.float32).reshape(-1, 3) + fill
    return {"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "step": int(fill)}


def proves_round_trip(dist: RankContext, impl: Adapter) -> None:
    """:func:`sharded_values` saved and loaded back whole, on every rank: run first by a test whose
    verdict is about how a save or load *fails* (errors alike on every rank, nothing changed), so that
    an implementation whose every call fails fails that test too instead of passing it."""
    __tracebackhide__ = True
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "unharmed"
    ops.save(sharded_values(dist, 8.0), path, process_group=group_of(dist))
    target = sharded_values(dist, -1.0)
    ops.load(target, path, process_group=group_of(dist))
    assert_same_bits(target, sharded_values(dist, 8.0), what=f"a save and load with nothing wrong (rank {dist.rank})")


def no_record(path: Path, fqn: str, offset: tuple[int, ...] | None = None) -> NoReturn:
    """A test that places a fault in the record of ``fqn`` finds none in DCP's metadata: a skip, since
    the stack keeps that value elsewhere (megatron-core: non-tensor values in its common state), so the
    fault this test is about cannot be placed; the stack's own format would need its own test."""
    pytest.skip(f"{path}: the checkpoint has no DCP record of {fqn!r}" + (f" at {offset}" if offset else "")
                + " to place the fault in (the stack keeps it outside DCP's records)")


def in_checkpoint(path: Path, name: str, base: Path | None = None) -> str:
    """The data file ``name`` of DCP's metadata as a path relative to the checkpoint directory ``path``
    (the two differ where the stack keeps each save in a folder of its own); ``base``: the
    :func:`dcp_directory` of ``path``, when the caller has it already (finding it may walk the directory)."""
    return str(((base or dcp_directory(path)) / name).relative_to(path))


def data_files_of(path: Path) -> Callable[[str], bool]:
    """Which file names of the checkpoint at ``path`` are its data files: those DCP's metadata points
    records at, where it has DCP's files (a stack's own metadata, megatron-core's ``metadata.json``, is
    not data), else every file but DCP's metadata and lock (:func:`conformance.faults.is_data_file`)."""
    try:
        names = {Path(info.relative_path).name for info in read_metadata(path).storage_data.values()}
    except Exception:  # noqa: BLE001 - no DCP metadata to read: the stack's own format
        return is_data_file
    return names.__contains__


def record_location(path: Path, fqn: str, offset: tuple[int, ...] | None = None) -> tuple[str, int, int]:
    """(file relative to ``path``, byte offset, length) of the stored record of ``fqn`` (the chunk at ``offset``)."""
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            return in_checkpoint(path, info.relative_path), info.offset, info.length
    no_record(path, fqn, offset)


def file_read_by_one_rank(dist: RankContext, path: Path) -> tuple[str, int, int]:
    """(file, byte offset, length) of the record of one rank's shard of ``w`` in a data file that holds
    nothing else: with ``w`` loaded into the same layout, only that rank reads the file. The last
    such rank's (where replicated ``b`` went depends on the implementation's deduplication)."""

    records, base = read_metadata(path).storage_data, dcp_directory(path)
    files = {index: in_checkpoint(path, info.relative_path, base) for index, info in records.items()}
    for rank in reversed(range(dist.world_size)):
        name, offset, length = record_location(path, "w", (4 * rank, 0))
        if [(i.fqn, tuple(i.offset or ())) for i in records if files[i] == name] == [("w", (4 * rank, 0))]:
            return name, offset, length
    listing = sorted((info.relative_path, i.fqn, tuple(i.offset or ())) for i, info in records.items())
    fail("test set-up: no data file holds one rank's shard alone", listing, "a file holding only one shard of 'w'", str(path))
    raise AssertionError  # unreachable: fail() raises


def damage(dist: RankContext, path: Path, case: str, where: str) -> str:
    """Damage the checkpoint at ``path`` (call on rank 0); returns what the error must name.

    Data files: for ``every-rank`` the file holding ``b``, which every rank reads; for ``one-rank`` a
    file holding one rank's shard of ``w`` and nothing else, which only that rank reads.
    A truncation cuts that record in half."""
    meta = dcp_directory(path) / ".metadata"
    if case in ("missing-data-file", "truncated-data-file"):
        if where == EVERY_RANK:
            name, offset, length = record_location(path, "b")
        else:
            name, offset, length = file_read_by_one_rank(dist, path)
        data = path / name
        if case == "missing-data-file":
            data.unlink()
        else:
            with open(data, "r+b") as f:
                f.truncate(offset + length // 2)
        return name
    if case == "missing-metadata":
        meta.unlink()
        return ".metadata"
    if case == "corrupt-metadata":
        meta.write_bytes(meta.read_bytes()[:40] + b"\x00garbage")
        return ".metadata"
    if case == "unknown-version":
        with open(meta, "rb") as f:
            metadata = pickle.load(f)  # our own file, written a moment ago
        metadata.version = "99.0.0"
        with open(meta, "wb") as f:
            pickle.dump(metadata, f)
        return "99.0.0"
    raise ValueError(case)


def is_same_bits(got: Any, expected: Any) -> bool:
    """Whether :func:`assert_same_bits` holds (for trying several candidates)."""
    try:
        assert_same_bits(got, expected)
    except pytest.fail.Exception:
        return False
    return True


def child_save(impl: Adapter, path: Path, fill: float, kill: tuple[str, int] | None = None, world: int = 1, killed: str = "all",
               *, executor: str | None = None) -> int:
    """Run :mod:`conformance.crash_child` (a save of ``crash_state(fill)``, maybe killed at ``kill``);
    with ``executor``, the save is the adapter's async save on that executor, waited for. Its exit status."""
    from conformance import crash_child
    from conformance.child_process import run_child
    from conformance.crash_child import ASYNC_ENV, KILLED, UNSUPPORTED

    args = [impl.spec, str(path), str(fill)]
    if kill:
        args += [kill[0], str(kill[1])]
        if world > 1:
            args += [str(world), killed]
    env = dict(os.environ)
    env.pop(ASYNC_ENV, None)
    if executor is not None:
        env[ASYNC_ENV] = executor
    status, output = run_child(crash_child.main, args, timeout=120, env=env, description=f"python -m conformance.crash_child {' '.join(args)}")
    if status == UNSUPPORTED:
        pytest.skip(f"{impl.name}: {output.strip().splitlines()[-1] if output.strip() else 'unsupported'}")
    if status not in (0, -9, KILLED):
        fail("a child's save", f"exit status {status}: {output[-800:]}", f"0 (finished), -9 or {KILLED} (killed)", " ".join(args))
    return status


def proves_a_save_loads(impl: Adapter, path: Path, *, world: int = 1, executor: str | None = None) -> None:
    """A child's save of :func:`~conformance.crash_child.crash_state` with nothing killed loads back
    whole in this process: run before a test that allows "nothing loads" as an outcome of a fault, so
    that an implementation that cannot save or load at all fails (or, for an op it lacks, skips) that
    test instead of passing it."""
    __tracebackhide__ = True
    from conformance.crash_child import crash_state

    impl.require_no_process_group("the crash tests' load in the controller process (ML-12)")
    key = (impl.spec, world, executor)
    if key not in _PROVEN:  # once per configuration and session: a child save costs a process start
        def prove() -> None:
            status = child_save(impl, path, 6.0, world=world, executor=executor)
            if status != 0:
                fail("a child's save with nothing killed", f"exit status {status}", "0: the save finished", f"world size {world}")
            target = crash_state(-5.0)
            checkpoint_ops(impl).load(target, path)
            assert_same_bits(target, crash_state(6.0), what=f"a checkpoint saved with nothing killed (world size {world})")

        try:
            prove()
            _PROVEN[key] = None
        except (KeyboardInterrupt, SystemExit, pytest.skip.Exception):
            raise
        except BaseException as exc:  # noqa: B036 - kept, to give every test of this configuration the same verdict
            _PROVEN[key] = exc
    proof = _PROVEN[key]
    if proof is not None:
        if isinstance(proof, Unsupported):
            pytest.skip(skip_reason(proof))
        fail("before any fault: a save, then a load of it", f"{type(proof).__name__}: {proof}"[:800],
             "the values saved, whole (a test that allows 'nothing loads' after a fault first proves a save loads)",
             f"world size {world}" + (f", {executor} async save" if executor else ""))


#: (adapter spec, world size, executor) -> what :func:`proves_a_save_loads` raised, None if it passed.
_PROVEN: dict[tuple[str, int, str | None], BaseException | None] = {}


def check_after_kill(impl: Adapter, path: Path, directory: str, kill: tuple[str, int], *, world: int, killed: str,
                     executor: str | None = None) -> None:
    """A child saves over ``directory`` ("fresh" or "overwrite" of a first child's save) and is killed at
    ``kill``: the directory then holds the previous checkpoint whole, nothing that loads (fresh), or the
    new one whole; never a mix. ``executor``: the killed save is an async save on it (AS-3)."""
    __tracebackhide__ = True
    from conformance.crash_child import crash_state

    proves_a_save_loads(impl, path.with_name(path.name + "-unharmed"), world=world, executor=executor)
    ops = checkpoint_ops(impl)
    if directory == "overwrite":
        ops.save(crash_state(1.0), path)  # in this process, without a group (ML-12): the child is the one killed
    status = child_save(impl, path, 2.0, kill, world, killed, executor=executor)
    target = crash_state(-5.0)
    loaded = raised(lambda: ops.load(target, path))
    how = f"{executor} async save" if executor else "save"
    where = f"{how}, {directory} directory, world size {world}, rank {killed} killed at {kill[0]} #{kill[1]} (exit status {status})"
    if loaded is not None:
        if directory == "fresh":
            return  # nothing loads: allowed
        fail("the directory after a killed overwrite", f"{type(loaded).__name__}: {loaded}"[:400], "the previous checkpoint, whole", where)
    old, new = crash_state(1.0), crash_state(2.0)
    if any(is_same_bits(target, candidate) for candidate in ((new,) if directory == "fresh" else (old, new))):
        return
    fail("the checkpoint after a killed save", {k: (v.flatten()[:3].tolist() if isinstance(v, torch.Tensor) else v) for k, v in target.items()},
         "one save's values whole (old or new), never a mix", where)


# -- crafted checkpoints (ML-27) ---------------------------------------------------------------------------------------

#: The pickle opcode routes by which a record reaches code, each asking for ``builtins.exec``:
#: ``global`` (GLOBAL then REDUCE), ``stack-global`` (STACK_GLOBAL, protocol 4), ``build`` (BUILD sets
#: ``__setstate__`` of an ``OrderedDict``, an allow-listed class, and a second BUILD calls it),
#: ``persistent-id`` (the persistent id's tuple is built by a call), ``ext1``/``ext2``/``ext4`` (an
#: extension code that the loading process's ``copyreg`` registry resolves: :data:`EXT_CODES`).
CODE_ROUTES = ("global", "stack-global", "build", "persistent-id", "ext1", "ext2", "ext4")
#: Zip containers whose member names lie: a second ``data.pkl`` (the first a harmless value), a
#: ``data.pkl`` of another archive folder, a ``..`` name; the extra member holds the ``global`` route.
NAME_LIES = ("duplicate-data-pkl", "other-folder", "dot-dot")
#: The extension code each ``ext`` route uses, registered as ``builtins.exec`` around the load.
EXT_CODES = {"ext1": 0xF1, "ext2": 0x1F2, "ext4": 0x10003}


@contextlib.contextmanager
def extension_for_exec(route: str) -> Iterator[None]:
    """Inside, this process's ``copyreg`` registry resolves the ``route``'s extension code (an ``ext``
    route) to ``builtins.exec``, as a library that registers extension codes would leave it."""
    import copyreg

    code = EXT_CODES.get(route)
    if code is None:
        yield
        return
    copyreg.add_extension("builtins", "exec", code)
    try:
        yield
    finally:
        copyreg.remove_extension("builtins", "exec", code)


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def crafted_pickle(route: str, code: str) -> bytes:
    """A pickle that runs ``exec(code)`` when loaded by an unpickler that lets ``route`` through (see
    :data:`CODE_ROUTES`); written opcode by opcode, as an attacker would."""
    call = _unicode(code) + b"\x85R"  # (code,) then REDUCE
    if route == "global":
        return b"\x80\x02cbuiltins\nexec\n" + call + b"."
    if route == "stack-global":
        return b"\x80\x04" + _short("builtins") + _short("exec") + b"\x93" + call + b"."
    if route == "build":
        return (b"\x80\x02ccollections\nOrderedDict\n)R" + b"N}" + _unicode("__setstate__") + b"cbuiltins\nexec\ns\x86b"
                + _unicode(code) + b"b.")
    if route == "persistent-id":
        return b"\x80\x02(" + _unicode("storage") + b"cbuiltins\nexec\n" + call + b"tQ."
    if route in EXT_CODES:
        size = {"ext1": 1, "ext2": 2, "ext4": 4}[route]
        opcode = {"ext1": b"\x82", "ext2": b"\x83", "ext4": b"\x84"}[route]
        return b"\x80\x02" + opcode + EXT_CODES[route].to_bytes(size, "little") + call + b"."
    raise ValueError(f"unknown route {route!r}")


def crafted_record(route: str, code: str) -> bytes:
    """A record (a ``torch.save`` archive, as DCP stores a value) whose ``data.pkl`` is
    :func:`crafted_pickle` of ``route``, or, for a route of :data:`NAME_LIES`, a harmless ``data.pkl``
    beside a lying member that holds the ``global`` route."""
    import io
    import warnings
    import zipfile

    buffer = io.BytesIO()
    torch.save("harmless", buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    lies = route in NAME_LIES
    payload = crafted_pickle("global" if lies else route, code)
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name, which is the point
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
            folder = source.namelist()[0].split("/", 1)[0]
            for info in source.infolist():
                archive.writestr(info.filename, source.read(info) if lies or not info.filename.endswith("/data.pkl") else payload)
            if lies:
                name = {"duplicate-data-pkl": f"{folder}/data.pkl", "other-folder": "other/data.pkl",
                        "dot-dot": f"{folder}/../data.pkl"}[route]
                archive.writestr(name, payload)
    return out.getvalue()


def replace_record(path: Path, fqn: str, data: bytes, offset: tuple[int, ...] | None = None) -> str:
    """Make the checkpoint at ``path`` store ``data`` as the record of ``fqn`` (the chunk at
    ``offset``): appended to the data file that holds it, and the metadata (our own file, written a
    moment ago) pointed at it. Returns the data file's path relative to ``path``."""
    import dataclasses

    meta = dcp_directory(path) / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the save a moment ago
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            with open(meta.parent / info.relative_path, "ab") as f:
                start = f.tell()
                f.write(data)
            metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=len(data))
            with open(meta, "wb") as f:
                pickle.dump(metadata, f)
            return in_checkpoint(path, info.relative_path)
    no_record(path, fqn, offset)


# -- test_checkpoint.py: sharding, meshes, errors alike on every rank ------------------------------


def _shard(impl: Adapter, model: nn.Module, dist: RankContext) -> nn.Module:
    """``model`` sharded by ``impl`` over the pool's 1-D mesh (FULL_SHARD, original parameters, one unit)."""
    return impl.require("sharding").shard(model, ShardingPlan(use_orig_params=True, device=dist.device, mesh=dist.mesh()))


#: 2-D meshes by world size: building one creates process groups (collectively), so each rank builds
#: it once per default group and its tests reuse it.
_MESHES_2D: dict[int, Any] = per_group_cache()


def mesh_2d_of(dist: RankContext) -> Any:
    """The 2-D mesh of HYBRID_SHARD's shape: (2, world_size / 2), (1, world_size) at odd world sizes,
    and under torchrun (nodes, ranks per node) when the world fills whole nodes."""
    if dist.world_size not in _MESHES_2D:
        _MESHES_2D[dist.world_size] = dist.mesh(*hybrid_mesh_shape(dist.world_size))
    return _MESHES_2D[dist.world_size]


def fails_alike(dist: RankContext, fn: Callable[[], Any], *, keys: tuple[str, ...] = (), needles: tuple[str, ...] = (),
                 what: str, agreed: str | None = None, named: str | None = None) -> BaseException:
    """``fn()`` raises on this rank (any type: ML-15 checks the type), naming every key of ``keys``
    whole and containing every string of ``needles``; then every rank compares what it raised: the
    same type and message everywhere (a rank that returned fails the test on every rank). ``agreed``
    and ``named`` are the SPEC clauses of the two checks, where a requirement letters them apart."""
    exc = raised(lambda: call_or_skip(fn))
    with clause(agreed) if agreed else contextlib.nullcontext():
        assert_same_error_on_every_rank(dist, exc, what=what)
    assert exc is not None  # assert_same_error_on_every_rank fails when any rank returned
    with clause(named) if named else contextlib.nullcontext():
        return expect_error(lambda: reraise(exc), BaseException, keys=keys, needles=needles, what=what,
                            where=f"rank {dist.rank} of {dist.world_size}")


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for item in path:
        state = state[item]
    return state


def assert_local_shards(dist: RankContext, got: Any, fulls: dict[tuple[Any, ...], torch.Tensor], *, what: str) -> None:
    """Per-rank truth: every DTensor of ``got`` at a path of ``fulls`` holds, on this rank, exactly the
    piece of that full value that the documented layout (``torch.chunk`` per sharded mesh dim) gives
    this rank, empty shards included; no rank gathers anything."""
    __tracebackhide__ = True
    for path, full in fulls.items():
        assert_local_shard(_at(got, path), full, what=f"{what} {'.'.join(map(str, path))}",
                           where=f"rank {dist.rank} of {dist.world_size}")


# -- the values a checkpoint holds ---------------------------------------------------------------


#: Sharded layouts over a 1-D mesh: uneven at every world size > 1; "one" leaves every rank but 0
#: an empty shard, "rows" leaves rank 3 empty at world size 4.
_SPECS_1D: dict[str, tuple[tuple[int, ...], list[Any]]] = {
    "rows": ((5, 3), [Shard(0)]),
    "cols": ((2, 7), [Shard(1)]),
    "replicated": ((13,), [Replicate()]),
    "one": ((1,), [Shard(0)]),
    "scalar": ((), [Replicate()]),
}


#: Over a 2-D mesh (2, world_size / 2), or (1, world_size) at odd world sizes.
_SPECS_2D: dict[str, tuple[tuple[int, ...], list[Any]]] = {
    "replicate_shard": ((7, 2), [Replicate(), Shard(0)]),
    "shard_shard": ((3, 5), [Shard(0), Shard(1)]),
    "nested_dim0": ((5, 2), [Shard(0), Shard(0)]),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _edge_full(pool: torch.Tensor, shape: tuple[int, ...], shift: int) -> torch.Tensor:
    """A tensor of ``shape`` filled from ``pool`` (edge values and noise of one dtype), rotated by
    ``shift`` so that small tensors get different edge values."""
    numel = math.prod(shape)
    reps = max(1, -(-numel // pool.numel()))
    return torch.roll(pool, shift).repeat(reps)[:numel].reshape(shape).clone()


def _edge_sharded_fulls(specs: dict[str, tuple[tuple[int, ...], list[Any]]], seed: int) -> dict[str, tuple[torch.Tensor, list[Any]]]:
    """Key ``<dtype>.<layout>`` -> (full value of edge values, placements), for every dtype of
    :data:`~conformance.values.EDGE_DTYPES` and every layout of ``specs``."""
    pools = edge_tensors(seed)
    out = {}
    for dtype in EDGE_DTYPES:
        name = _dtype_name(dtype)
        for shift, (layout, (shape, placements)) in enumerate(specs.items()):
            out[f"{name}.{layout}"] = (_edge_full(pools[name], shape, 3 * shift), placements)
    return out


def target_like(value: torch.Tensor) -> torch.Tensor:
    """A tensor laid out exactly as ``value`` (shape, strides, storage offset, storage size) whose
    elements all differ from ``value``'s bitwise, and whose storage bytes outside its elements hold a
    pattern (a load that writes outside a view changes them)."""
    value = value.detach()
    nbytes = value.untyped_storage().nbytes()
    pattern = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    target = torch.empty(0, dtype=value.dtype).set_(
        pattern.untyped_storage(), value.storage_offset(), value.shape, value.stride()
    )
    target.copy_(different_like(value))
    return target


def meta_like(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as ``value`` (shape, strides, storage offset)."""
    storage_numel = value.untyped_storage().nbytes() // value.element_size()
    return torch.empty(storage_numel, dtype=value.dtype, device="meta").as_strided(
        value.shape, value.stride(), value.storage_offset()
    )


def outside_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the bytes of ``tensor``'s storage that belong to none of its elements."""
    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    itemsize = tensor.element_size()
    elements = torch.arange(storage.nbytes() // itemsize).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    mine = torch.zeros(storage.nbytes(), dtype=torch.bool)
    for byte in range(itemsize):
        mine[elements.reshape(-1) * itemsize + byte] = True
    return raw[~mine].clone()


_NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0123))[0]


def objects(role: str) -> dict[str, Any]:
    """Non-tensor values of every kind a checkpoint holds. ``"saved"`` is what is saved; ``"target"``
    is the state dict a load fills: the same structure with every leaf different (in value, sign,
    NaN payload, length or type)."""
    if role == "saved":
        return {
            "step": 7,
            "big": 2**70 + 1,  # beyond int64
            "flag": True,
            "neg_zero": -0.0,
            "nan": _NAN_PAYLOAD,
            "inf": -math.inf,
            "subnormal": 5e-324,
            "name": "adam-ß-🙂",
            "raw": b"\x00\xff\x10",
            "nothing": None,
            "pair": (3, (4.5, "x")),
            "ids": [1, 2, "three"],  # a list without tensors or dicts: one value
            "records": [{"epoch": 3, "loss": 0.5}, {"epoch": 4}],  # a list of dicts: descended into
            "size": torch.Size([2, 3]),
            "dtype": torch.bfloat16,
            "nested": {"a": {"b": {"c": [1.5, None]}}},
        }
    return {
        "step": 0,
        "big": 2**70,
        "flag": False,
        "neg_zero": 0.0,
        "nan": math.nan,
        "inf": math.inf,
        "subnormal": 0.0,
        "name": "",
        "raw": b"",
        "nothing": "None",
        "pair": (0, (0.0, "")),
        "ids": [0],
        "records": [{"epoch": 0, "loss": 0.0}, {"epoch": 0}],
        "size": torch.Size([0]),
        "dtype": torch.float32,
        "nested": {"a": {"b": {"c": [0.0]}}},
    }


def _int_keyed(role: str) -> dict[str, Any]:
    """Non-tensor values under non-string keys, as ``torch.optim`` state dicts key them by parameter
    index; ``"target"`` holds other values under the same keys."""
    if role == "saved":
        return {"by_index": {0: "first", 1: {"lr": 0.1, "betas": (0.9, 0.999)}, 2: [1, 2]}}
    return {"by_index": {0: "", 1: {"lr": 0.0, "betas": (0.0, 0.0)}, 2: [0]}}


@dataclass
class State:
    """A state dict to save or load into, and the full value of each of its DTensors by path."""

    values: dict[str, Any]
    fulls: dict[tuple[Any, ...], torch.Tensor]


def state_of(dist: RankContext, kind: str, role: str, seed: int = 1) -> State:
    """The ``kind`` of state (``plain``, ``objects``, ``dtensor-1d``, ``dtensor-2d``) as saved
    (``role="saved"``), as a load target whose every value differs (``"target"``), or with every
    tensor on meta (``"meta"``). ``fulls`` are the saved full values whatever the role."""
    if kind == "plain":
        saved = {**edge_tensors(seed), **lazy_views(seed)}
        make = {"saved": lambda v: v, "target": target_like, "meta": meta_like}[role]
        return State({k: make(v) for k, v in saved.items()}, {})
    if kind in ("objects", "int-keys"):
        make_objects = objects if kind == "objects" else _int_keyed
        return State(make_objects("saved" if role == "saved" else "target"), {})
    mesh, specs = (dist.mesh(), _SPECS_1D) if kind == "dtensor-1d" else (mesh_2d_of(dist), _SPECS_2D)
    values, fulls = {}, {}
    for key, (full, placements) in _edge_sharded_fulls(specs, seed).items():
        fulls[(key,)] = full
        start = {"saved": full, "target": different_like(full), "meta": full.to("meta")}[role]
        values[key] = dtensor_of(start, mesh, placements)
    return State(values, fulls)


KINDS = ["plain", "objects", "int-keys", "dtensor-1d", "dtensor-2d"]


def mixed_state(dist: RankContext, role: str, seed: int) -> State:
    """Every kind in one nested state dict (but ``int-keys``: ML-1 checks those; ML-2 is about the format)."""
    parts = {kind: state_of(dist, kind, role, seed) for kind in KINDS if kind != "int-keys"}
    fulls = {(kind, *path): full for kind, part in parts.items() for path, full in part.fulls.items()}
    return State({kind: part.values for kind, part in parts.items()}, fulls)


#: Bytes a record may take beyond its elements' (torch.save's zip headers: about 1.5 KiB).
RECORD_OVERHEAD = 4096


# -- ML-25 the on-disk format, read and written by upstream DCP whatever --impl selects ----------------------


def _upstream_save(dist: RankContext, state: dict[str, Any], path: str) -> None:
    """Upstream ``torch.distributed.checkpoint.save`` (default planner, ``FileSystemWriter``), called
    directly: the counterpart of every implementation, whatever ``--impl`` selects."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns on overwrite
        dcp.save(state, checkpoint_id=path, process_group=group_of(dist))


def _upstream_load(dist: RankContext, state: dict[str, Any], path: str) -> None:
    """Upstream ``torch.distributed.checkpoint.load`` with its ``FileSystemReader``, called directly."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_directory(path)), process_group=group_of(dist))


def _optimizer_state(dist: RankContext, role: str, seed: int) -> State:
    """AdamW's state after two steps of a small model, in one process, keyed as a sharded optimizer's
    state dict is (``torch.distributed.checkpoint.state_dict``'s layout): ``state`` by parameter FQN with
    ``step`` a 0-d tensor and the moments as DTensors sharded by rows over the 1-D mesh (uneven at 2
    ranks), ``param_groups`` a list of dicts of hyperparameters naming their parameters by FQN.
    ``"target"``: the same layout with every value different."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    names = {id(p): n for n, p in model.named_parameters()}
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 0.02, "betas": (0.8, 0.95)}], lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=gen)).square().sum().backward()
        optimizer.step()
    state: dict[str, Any] = {}
    fulls: dict[tuple[Any, ...], torch.Tensor] = {}
    for param, s in optimizer.state.items():
        name = names[id(param)]
        entry: dict[str, Any] = {"step": s["step"].clone() if role == "saved" else different_like(s["step"])}
        for moment in ("exp_avg", "exp_avg_sq"):
            full = s[moment].detach().clone()
            fulls[("state", name, moment)] = full
            entry[moment] = dtensor_of(full if role == "saved" else different_like(full), dist.mesh(), [Shard(0)])
        state[name] = entry
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        params = [names[id(p)] for p in group["params"]]
        if role != "saved":  # every value other: floats and ints moved, flags flipped, tuples and names changed
            hyper = {k: (not v if isinstance(v, bool) else v * 2 + 1 if isinstance(v, (int, float)) else
                         tuple(x * 2 + 1 for x in v) if isinstance(v, tuple) else v) for k, v in hyper.items()}
            params = [*params, "other"]
        groups.append({**hyper, "params": params})
    return State({"state": state, "param_groups": groups}, fulls)


def _format_state(dist: RankContext, role: str, seed: int) -> State:
    """Every kind of value in one nested state dict (edge tensors of every dtype, edge DTensors on 1-D and
    2-D meshes, non-tensor values of every kind) and an optimizer's state under ``optim``."""
    mixed, optim = mixed_state(dist, role, seed), _optimizer_state(dist, role, seed)
    return State({**mixed.values, "optim": optim.values},
                  {**mixed.fulls, **{("optim", *path): full for path, full in optim.fulls.items()}})


def _full_values(value: Any, fulls: dict[tuple[Any, ...], torch.Tensor], path: tuple[Any, ...] = ()) -> Any:
    """``value`` with every DTensor replaced by its full value (``fulls`` by path)."""
    if isinstance(value, Mapping):
        return {k: _full_values(v, fulls, (*path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_full_values(v, fulls, (*path, i)) for i, v in enumerate(value)]
    if isinstance(value, DTensor):
        return fulls[path]
    return value


def _metadata_layout(path: str) -> dict[str, Any]:
    """What a checkpoint's metadata says, read with upstream's public reader, that does not depend on
    who wrote it: each key's kind, tensor properties, global shape and chunks, the stored chunks, the
    flattening paths (``planner_data``) and the format version."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(dcp_directory(path)).read_metadata()
    keys: dict[str, tuple[Any, ...]] = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            keys[key] = ("tensor", entry.properties, tuple(entry.size), chunks)
        else:
            keys[key] = (type(entry).__name__,)
    stored = sorted((index.fqn, tuple(index.offset or ())) for index in md.storage_data)
    planner_data = {k: tuple(v) for k, v in (md.planner_data or {}).items()}
    return {"keys": keys, "stored chunks": stored, "planner_data": planner_data, "version": md.version}


def format_save(dist: RankContext, impl: Adapter, route: str, path: str, seed: int) -> None:
    saved = _format_state(dist, "saved", seed).values
    if route == "upstream-saves":
        _upstream_save(dist, saved, path)
        return
    call_or_skip(lambda: checkpoint_ops(impl).save(saved, path, process_group=group_of(dist)))
    _upstream_save(dist, _format_state(dist, "saved", seed).values, path + "-by-upstream")  # the same state dict


def format_load(dist: RankContext, impl: Adapter, route: str, path: str, seed: int, out: str) -> None:
    """Load what :func:`format_save` saved (the other side loads) and check it; with ``impl-saves``,
    also the metadata against upstream's save of the same state dict and, on rank 0, upstream's
    ``dcp_to_torch_save`` of the checkpoint. Each property is reported even when another failed."""
    saved = _format_state(dist, "saved", seed)  # the saved values, laid out at this world size
    target = _format_state(dist, "target", seed)

    def metadata() -> None:
        if route == "impl-saves" and dist.rank == 0:
            assert_same_bits(_metadata_layout(path), _metadata_layout(path + "-by-upstream"), check_order=False,
                              what=f"{impl.name}'s checkpoint metadata vs upstream's of the same state dict")

    def loaded() -> None:  # collective: every rank loads, whatever the other checks found
        if route == "upstream-saves":
            call_or_skip(lambda: checkpoint_ops(impl).load(target.values, path, process_group=group_of(dist)))
        else:
            _upstream_load(dist, target.values, path)
        assert_local_shards(dist, target.values, saved.fulls, what="loaded")
        assert_same_bits(target.values, saved.values, what=f"loaded by {'upstream' if route == 'impl-saves' else impl.name}")

    def converted() -> None:
        if route == "impl-saves" and dist.rank == 0:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(dcp_directory(path), out)  # upstream rebuilds the nested state dict from the metadata alone
            assert_same_bits(torch.load(out, weights_only=False), _full_values(saved.values, saved.fulls), check_order=False,
                              what="upstream's dcp_to_torch_save of the checkpoint (nesting from planner_data)")

    check_each({"ML-25.d": metadata, "ML-25.a" if route == "impl-saves" else "ML-25.c": loaded, "ML-25.b": converted})


# -- ML-4 meta loading ------------------------------------------------------------------------------


def check_built(dist: RankContext, loaded: dict[str, Any], saved: State) -> None:
    """ML-4's checks of a meta load: every value built on the process group's device, no meta left,
    DTensors keep mesh, placements, global shape and stride, and every value (each rank's local
    shard of a DTensor) holds the saved bits."""
    __tracebackhide__ = True
    for key, want in saved.values.items():
        got = loaded[key]
        local = got.to_local() if isinstance(got, DTensor) else got
        if local.device != dist.device:
            fail("a meta value was built on the wrong device", local.device, dist.device, f"{key}, rank {dist.rank}")
        if isinstance(want, DTensor):
            if not isinstance(got, DTensor):
                fail("a meta DTensor was built as another type", type(got).__name__, "DTensor", key)
            if got.device_mesh != want.device_mesh or tuple(got.placements) != tuple(want.placements):
                fail("a meta DTensor's layout changed", (got.device_mesh, got.placements), (want.device_mesh, want.placements), key)
            if got.shape != want.shape or got.stride() != want.stride():
                fail("a meta DTensor's global shape/stride changed", (tuple(got.shape), got.stride()),
                     (tuple(want.shape), want.stride()), key)
    assert_local_shards(dist, loaded, saved.fulls, what="built")
    assert_same_bits(loaded, saved.values)


def _tp_plan() -> dict[str, Any]:
    """PR #113319's plan on zoo "mlp" (5 -> 10 -> 15 -> 1): net.0 row-wise (its 5 input features over the
    ranks: 3+2 at 2 ranks, 2+2+1+0 at 4), net.2 column-wise (15 outputs: 8+7, 4+4+4+3). The layouts at
    the model's edges are Replicate so that the forward runs on the full batch and gives full outputs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"net.0": RowwiseParallel(input_layouts=Replicate()), "net.2": ColwiseParallel(output_layouts=Replicate())}


def tp_model(dist: RankContext, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(zoo_model(dist, "mlp", seed, device), dist.mesh(), _tp_plan())


def fsdp2_model(dist: RankContext, name: str, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = zoo_model(dist, name, seed, device)
    fully_shard(model, mesh=dist.mesh())  # shards in place (and returns ``model``, typed as an FSDPModule)
    return model


def _saved_model_state(model: nn.Module) -> State:
    """A model's state dict and the full value of each DTensor in it (collective)."""
    sd = model.state_dict()
    return State(sd, {(k,): v.full_tensor() for k, v in sd.items() if isinstance(v, DTensor)})


def assert_meta_load_rebuilds(dist: RankContext, ops: Any, name: str, model: nn.Module, meta_model: Callable[[], nn.Module]) -> None:
    """Save ``model``'s state dict, load it into the state dict of ``meta_model()`` (built after the
    save), check what the load built, assign it and compare outputs with ``model``'s exactly."""
    path = dist.tmp_dir / "ckpt"
    saved = _saved_model_state(model)
    ops.save(saved.values, path, process_group=group_of(dist))

    target = meta_model()
    sd = target.state_dict()
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))
    check_built(dist, sd, saved)
    target.load_state_dict(sd, assign=True)
    inputs = models.batch(name, seed=3, device=dist.device)
    assert_bitwise_equal(target(inputs).detach(), model(inputs).detach(), what="output of the model built from meta")


# -- ML-6 unbuildable meta values ----------------------------------------------------------------------


class MarkedTensor(torch.Tensor):
    """A tensor subclass whose data lives elsewhere: allocating one like it is refused."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.empty_like, torch.zeros_like, torch.Tensor.new_empty, torch.Tensor.to):
            raise TypeError("a MarkedTensor cannot be allocated")
        return super().__torch_function__(func, types, args, kwargs or {})


def error_checkpoint() -> dict[str, torch.Tensor]:
    """The small checkpoint of the error tests: distinctive key names, values no target starts with."""
    return {"proj.weight": torch.arange(12.0).reshape(4, 3), "proj.bias": torch.tensor([0.5, -0.0])}


# -- ML-8 resharding across world sizes ----------------------------------------------------------------------


def save_tp(dist: RankContext, impl: Adapter, path: str) -> None:
    model = tp_model(dist, seed=8, device=dist.device)
    checkpoint_ops(impl).save(model.state_dict(), path, process_group=group_of(dist))


def load_tp(dist: RankContext, impl: Adapter, path: str) -> None:
    meta_model = tp_model(dist, seed=0, device="meta")
    sd = meta_model.state_dict()
    call_or_skip(lambda: checkpoint_ops(impl).load(sd, path, process_group=group_of(dist)))
    oracle = models.build("mlp", seed=8, device=dist.device)
    expected = tp_model(dist, seed=8, device=dist.device).state_dict()  # the layout at this world size
    unsharded = oracle.state_dict()
    check_built(dist, sd, State(expected, {(k,): unsharded[k] for k, v in expected.items() if isinstance(v, DTensor)}))
    meta_model.load_state_dict(sd, assign=True)
    inputs = models.batch("mlp", seed=4, device=dist.device)
    # Not bitwise: row-wise parallel sums partial products across ranks in another order.
    assert_same_state(meta_model(inputs).detach(), oracle(inputs).detach(), what="output after resharding", atol=1e-6, rtol=1e-5)


_TRAIN_STEPS = 2


class _Tolerance(TypedDict):
    atol: float
    rtol: float


#: Training on N ranks sums gradients in another order than one process: compare within this.
_TRAINING_TOLERANCE: _Tolerance = {"atol": 1e-5, "rtol": 1e-5}


def _optimizer(model: nn.Module, *, reverse: bool = False) -> torch.optim.Optimizer:
    """Adam over two param groups (weights; the rest) with different hyperparameters, an LR
    scheduler's ``initial_lr`` and a custom key. ``reverse`` lists each group's parameters the other
    way round. Groups are chosen by name, so the sharded model and the oracle group alike."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = [p for n, p in named if n.endswith("weight")]
    others = [p for n, p in named if not n.endswith("weight")]
    if reverse:
        weights, others = weights[::-1], others[::-1]
    groups = [{"params": weights, "lr": 0.02, "weight_decay": 0.01}, {"params": others, "lr": 0.01, "betas": (0.8, 0.95)}]
    optimizer = torch.optim.Adam([g for g in groups if g["params"]], lr=0.01)
    for index, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = group["lr"] * 2
        group["sdc_custom"] = f"source-{index}"
    return optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, name: str, steps: range, device: Any) -> None:
    for step in steps:
        models.train_step(model, optimizer, models.batch(name, seed=step, device=device))


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def save_training(dist: RankContext, impl: Adapter, name: str, path: str, saved_path: str) -> None:
    ops = checkpoint_ops(impl)
    model = _shard(impl, models.build(name, seed=11, device=dist.device), dist)
    optimizer = _optimizer(model)
    _train(model, optimizer, name, range(_TRAIN_STEPS), dist.device)
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    if dist.world_size > 1:  # otherwise this test would not reshard anything
        assert any(isinstance(v, DTensor) for v in model_sd.values()), "the sharded model state dict holds no DTensor"
    ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=group_of(dist))
    full = full_on_cpu({"model": model_sd, "optim": optim_sd})  # collective
    if dist.rank == 0:
        torch.save(full, saved_path)  # the saved values, full, for the loading world size to compare with


def _assert_matches_full(dist: RankContext, got: Any, full: Any, where: str) -> None:
    """``got`` (a state dict of the loading world size) holds exactly the saved values ``full`` (the
    same state gathered at the saving world size): each DTensor's local shard is its documented piece
    of the full value, every other value equal bit for bit. Dict order is not compared (the target's
    optimizer lists its parameters in another order)."""
    __tracebackhide__ = True
    if isinstance(full, Mapping) and isinstance(got, Mapping):
        if set(map(str, got)) != set(map(str, full)):
            fail("resharded state: keys differ", sorted(map(str, got)), sorted(map(str, full)), where)
        by_name = {str(k): v for k, v in got.items()}
        for key, value in full.items():
            _assert_matches_full(dist, by_name[str(key)], value, f"{where}.{key}")
    elif isinstance(got, DTensor):
        assert_local_shard(got, full, what="resharded value", where=f"{where}, rank {dist.rank} of {dist.world_size}")
    else:
        assert_same_state(exact(got), exact(full), what="resharded value", where=where, check_order=False)


def load_training(dist: RankContext, impl: Adapter, name: str, path: str, saved_path: str) -> None:
    ops = checkpoint_ops(impl)
    model = _shard(impl, models.build(name, seed=99, device=dist.device), dist)
    optimizer = _optimizer(model, reverse=True)
    perturb_hyperparameters(optimizer)
    _train(model, optimizer, name, range(50, 51), dist.device)  # optimizer state to load into, from another batch
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    call_or_skip(lambda: ops.load(state, path, process_group=group_of(dist)))
    saved = torch.load(saved_path, weights_only=False)
    _assert_matches_full(dist, state, saved, "loaded")
    ops.set_state_dicts(model, optimizer, state["model"], state["optim"])
    assert_same_bits(_hyperparameters(optimizer.param_groups), _hyperparameters(saved["optim"]["param_groups"]),
                      what="optimizer hyperparameters after loading")
    got_model, got_optim = ops.get_state_dicts(model, optimizer)
    _assert_matches_full(dist, {"model": got_model, "state": got_optim["state"]},
                         {"model": saved["model"], "state": saved["optim"]["state"]}, "after set_state_dicts")

    oracle = models.build(name, seed=11, device=dist.device)
    oracle_optimizer = _optimizer(oracle)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS), dist.device)
    got_model = full_on_cpu(got_model)
    want_model = full_on_cpu(oracle.state_dict())
    assert_same_state({k: got_model[k] for k in want_model}, want_model, what="model after resharding vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
    want_state = full_on_cpu(fqn_keyed_optim(oracle, oracle_optimizer)["state"])
    got_state = full_on_cpu(got_optim["state"])
    assert_same_state({k: got_state.get(k) for k in want_state}, want_state, what="optimizer state after resharding vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
    # Training resumes where the saved run left off.
    _train(model, optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    got_model = full_on_cpu(ops.get_state_dicts(model, optimizer)[0])
    want_model = full_on_cpu(oracle.state_dict())
    assert_same_state({k: got_model[k] for k in want_model}, want_model, what="model after resuming vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)


# -- ML-10 / ML-11 strict loading ------------------------------------------------------------------------------

_F32 = torch.float32


#: What the state dict asks for, per key: (shape, dtype). The good one matches _error_checkpoint().
GOOD = {"proj.weight": ((4, 3), _F32), "proj.bias": ((2,), _F32)}


#: mismatch -> (what the bad rank asks for, the key the error must name, what else it must say)
MISMATCHES: dict[str, tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], str, tuple[str, ...]]] = {
    "missing-key": ({**GOOD, "extra.scale": ((2,), _F32)}, "extra.scale", ()),
    "shape": ({**GOOD, "proj.weight": ((3, 4), _F32)}, "proj.weight", ("3, 4", "4, 3")),
    "dtype": ({**GOOD, "proj.weight": ((4, 3), torch.float64)}, "proj.weight", ("float64", "float32")),
}


def asking_for(spec: dict[str, tuple[tuple[int, ...], torch.dtype]], device: str) -> dict[str, torch.Tensor]:
    """A state dict of ``spec`` on ``device``; on the CPU its values differ from the checkpoint's."""
    out = {}
    for key, (shape, dtype) in spec.items():
        if device == "meta":
            out[key] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            out[key] = torch.arange(math.prod(shape), dtype=torch.float64).add(0.5).neg().reshape(shape).to(dtype)
    return out


# -- ML-26 successive saves of a training job --------------------------------------------------------------------------


def job_model(dist: RankContext, step: float, *, last_rank_key: bool = False, changed: bool = False,
               moved: bool = False) -> dict[str, Any]:
    """A training job's model checkpoint at ``step`` (every value depends on it): a weight sharded over
    the pool's mesh, a replicated bias and scale, a note. The layouts of ML-26: ``last_rank_key``, the
    last rank also holds a counter (one rank's layout changes); ``changed``, every rank's layout
    changes (the bias's shape and dtype, a note that grew); ``moved``, only the nesting changes (the
    scale moves out of ``layers`` to a top-level key of the same flat name)."""
    rows = 4 * dist.world_size
    weight = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * 0.5 + step
    layer: dict[str, Any] = {"weight": dtensor_of(weight, dist.mesh(), [Shard(0)]), "bias": torch.full((3,), step)}
    sd: dict[str, Any] = {"layers": {"0": layer}, "note": f"step {step}"}
    if changed:
        layer["bias"] = torch.full((5,), step, dtype=torch.float64)
        sd["note"] = f"step {step}: " + "grown " * 40
    scale = torch.tensor([step, -step])
    if moved:
        sd["layers.0.scale"] = scale
    else:
        layer["scale"] = scale
    if last_rank_key and dist.rank == dist.world_size - 1:
        sd["last_rank_counter"] = torch.tensor([int(step) * 7])
    return sd


def job_optim(dist: RankContext, step: float) -> dict[str, Any]:
    """The same job's optimizer checkpoint at ``step``: sharded Adam state keyed by FQN and its param group."""
    rows = 4 * dist.world_size
    exp_avg = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * -0.25 + step
    return {
        "state": {"layers.0.weight": {"exp_avg": dtensor_of(exp_avg, dist.mesh(), [Shard(0)]), "step": torch.tensor(step)}},
        "param_groups": [{"lr": 1e-3 / (1 + step), "betas": (0.9, 0.999), "params": ["layers.0.weight"]}],
    }


def job_paths(kind: str, *, last_rank_key: bool = False, changed: bool = False, moved: bool = False) -> dict[str, tuple[Any, ...]]:
    """What the checkpoint's metadata lists for a save of :func:`job_model` or :func:`job_optim`:
    each flat key with its path in the nested state dict (DCP's ``planner_data``)."""
    if kind == "optim":
        state = {f"state.layers.0.weight.{k}": ("state", "layers.0.weight", k) for k in ("exp_avg", "step")}
        return {**state, **{f"param_groups.0.{k}": ("param_groups", 0, k) for k in ("lr", "betas", "params")}}
    paths: dict[str, tuple[Any, ...]] = {f"layers.0.{k}": ("layers", "0", k) for k in ("weight", "bias", "scale")}
    paths["note"] = ("note",)
    if moved:
        paths["layers.0.scale"] = ("layers.0.scale",)
    if last_rank_key:
        paths["last_rank_counter"] = ("last_rank_counter",)
    return paths


def one_property_state(dist: RankContext, prop: str, second: bool, step: float) -> dict[str, Any]:
    """A job's state at ``step`` in the first layout, or (``second``) in the layout that differs from
    it in ``prop`` alone: ``dtype``, the bias float64 instead of float32 (same shape); ``shape``, the
    bias of 5 elements instead of 3 (same dtype); ``nesting``, the scale out of ``layers`` under a
    top-level key of the same flat name (same tensors); ``rank``, a counter held by the last rank
    instead of rank 0 (same key, shape and dtype); ``chunking``, the weight sharded along columns
    instead of rows (same global shape and dtype); ``every-dtype``, every tensor cast alike to bfloat16
    (``model.to(torch.bfloat16)`` between two saves: a key of dtype *changes* sees none if it compares
    the tensors with each other); ``every-shape``, every tensor grown alike along its last dimension;
    ``renamed``, the bias under another name in the same place (same shapes, dtypes and order)."""
    changed = second
    rows, cols = 4 * dist.world_size, 2 * dist.world_size + (2 if prop == "every-shape" and changed else 0)
    every = torch.bfloat16 if prop == "every-dtype" and changed else torch.float32
    weight = (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5 + step).to(every)
    placements = [Shard(1)] if prop == "chunking" and changed else [Shard(0)]
    bias_size = 5 if prop in ("shape", "every-shape") and changed else 3
    bias = (torch.arange(bias_size, dtype=torch.float64 if prop == "dtype" and changed else torch.float32) + step).to(
        torch.float64 if prop == "dtype" and changed else every)
    bias_key = "shift" if prop == "renamed" and changed else "bias"
    layer: dict[str, Any] = {"weight": dtensor_of(weight, dist.mesh(), placements), bias_key: bias}
    sd: dict[str, Any] = {"layers": {"0": layer}, "note": f"step {step}"}
    scale = torch.tensor([step, -step, step, -step] if prop == "every-shape" and changed else [step, -step]).to(every)
    if prop == "nesting" and changed:
        sd["layers.0.scale"] = scale
    else:
        layer["scale"] = scale
    holder = dist.world_size - 1 if prop == "rank" and changed else 0
    if prop == "rank" and dist.rank == holder:
        sd["counter"] = torch.tensor([int(step) * 7])
    return sd


def described_by_states(dist: RankContext, sd: dict[str, Any]) -> dict[str, Any]:
    """What every rank's state dicts together say the metadata must list: flat key -> (its path in
    the nesting, and for a tensor its dtype, global shape and the set of (offsets, sizes) chunks the
    ranks hold; ``bytes`` for a non-tensor value)."""
    mine: dict[str, Any] = {}

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, path + (key,))
            return
        flat = ".".join(map(str, path))
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            coordinate = mesh.get_coordinate()
            assert coordinate is not None  # every rank of the pool is in the mesh
            piece, offsets = expected_local_chunk(torch.empty(value.shape, device="meta"), value.placements, tuple(mesh.shape),
                                                  tuple(coordinate))
            mine[flat] = (path, str(value.dtype), tuple(value.shape), ((tuple(offsets), tuple(piece.shape)),))
        elif isinstance(value, torch.Tensor):
            mine[flat] = (path, str(value.dtype), tuple(value.shape), (((0,) * value.dim(), tuple(value.shape)),))
        else:
            mine[flat] = (path, "bytes")

    walk(sd, ())
    described: dict[str, Any] = {}
    for rank_items in dist.all_gather_object(mine):
        for flat, entry in rank_items.items():
            if flat in described and entry[1] != "bytes":
                entry = entry[:3] + (tuple(sorted(set(described[flat][3]) | set(entry[3]))),)
            described[flat] = entry
    return described


def listed_in_metadata(path: Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """What the checkpoint's metadata lists, in the shape of :func:`described_by_states`. With ``keys``
    (every flat key any state dict of the test holds), only those: a record no state dict of the test
    holds is the stack's own bookkeeping (megatron-core's common state), not a layout's key, while a
    key of another save of the test (a stale plan) is still seen."""
    metadata = read_metadata(path)
    wanted = None if keys is None else set(keys)
    listed: dict[str, Any] = {}
    for flat, entry in metadata.state_dict_metadata.items():
        if wanted is not None and flat not in wanted:
            continue
        nesting = tuple((metadata.planner_data or {}).get(flat, ()))
        if isinstance(entry, TensorStorageMetadata):
            chunks = tuple(sorted({(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks}))
            listed[flat] = (nesting, str(entry.properties.dtype), tuple(entry.size), chunks)
        else:
            listed[flat] = (nesting, "bytes")
    return listed


# -- ML-27 / ML-28 crafted checkpoints -----------------------------------------------------------------------------------

#: The environment variable the crafted code sets (besides creating its marker file) where it runs.
RAN_ENV = "CONFORMANCE_CRAFTED_CODE_RAN"


# -- ML-23 / ML-24 a load that fails at any step ---------------------------------------------------------------------

#: The steps of a load, in order: a failure in one ends the load there.
STEPS = ("planning", "reading", "committing")


#: The tensors of the step tests: key -> (global shape, dtype, placement on the 1-D mesh). Uneven at
#: world size 2 (``w`` 3 + 2 rows, ``b`` 1801 + 1800 elements). The two that reads fail on hold more
#: than 8 KiB per chunk, so that the middle of their data lies apart from the headers a reader may
#: check while planning (a zip record's headers sit at its start and its directory at its end).
_STEP_TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {
    "w": ((5, 2048), torch.float32, Shard(0)),
    "b": ((3601,), torch.float64, Shard(0)),
    "n": ((4,), torch.int64, Replicate()),
}


#: Bytes in the middle of a chunk's data that the reading fault makes unreadable.
_UNREADABLE_BYTES = 64


#: What goes wrong, per step, on the first rank and on the last: another key on each, so that an error
#: naming only one failing rank's problem is seen. Planning: the key is asked for with another shape.
#: Reading: the bytes of the key's saved data cannot be read (EIO). Committing: the value at the key
#: refuses what was read, with the words of :data:`_REFUSALS` (on the first rank a top-level
#: ``Stateful``, after another one loaded; on the last a mapping of non-tensor values whose ``note``
#: is frozen, after its ``step`` took the loaded value).
_STEP_FAULTS: dict[str, tuple[str, str]] = {
    "planning": ("model.w", "model.b"),
    "reading": ("model.w", "model.b"),
    "committing": ("b_progress", "extra.note"),
}


_REFUSALS = ("the saved epoch is older than this run's", "the run's settings are read-only")


class _ReadOnlyEntry(dict[str, Any]):
    """Non-tensor values in a mapping with one entry that cannot be replaced, as a config object refuses
    a frozen field: ``__setitem__`` of ``frozen`` raises ``TypeError(refuse)``; other entries take
    new values."""

    def __init__(self, values: Mapping[str, Any], frozen: str, refuse: str) -> None:
        super().__init__(values)
        self.frozen, self.refuse = frozen, refuse

    def __setitem__(self, key: str, value: Any) -> None:
        if key == self.frozen:
            raise TypeError(self.refuse)
        super().__setitem__(key, value)


class _Progress:
    """A top-level ``Stateful`` (DCP's convention: saved and loaded through ``state_dict()`` and
    ``load_state_dict()``) holding non-tensor state. Its ``load_state_dict`` is collective (a barrier of
    the default group first, as one that loads through ``set_state_dict`` may be), so a loader must
    call it on every rank alike. With ``refuse``, it then raises ``ValueError(refuse)`` and changes
    nothing, as a component does when a loaded value fails its own checks."""

    def __init__(self, epoch: int, tag: str, refuse: str | None = None) -> None:
        self.epoch, self.tag, self.refuse = epoch, tag, refuse

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "tag": self.tag}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized():
            torch_dist.barrier()
        if self.refuse is not None:
            raise ValueError(self.refuse)
        self.epoch, self.tag = state_dict["epoch"], state_dict["tag"]


def _step_full(key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The saved full value of ``key`` (of ``shape``, for a target asking for another shape)."""
    want, dtype, _ = _STEP_TENSORS[key]
    shape = want if shape is None else shape
    return torch.arange(math.prod(shape), dtype=torch.float64).add(1.5).neg().reshape(shape).to(dtype)


def step_state(dist: RankContext, target: str, *, saved: bool, planning: str | None = None, refusing: str | None = None) -> dict[str, Any]:
    """The state dict of the step tests, as saved (``saved=True``: tensors plain for ``target="plain"``,
    DTensors otherwise) or as a load target whose every value differs from the saved one: ``plain``
    tensors and ``dtensor`` DTensors filled in place, or ``meta`` (a meta DTensor, a meta Parameter, a
    meta tensor). Tensors are nested under ``model``, non-tensor values under ``extra``, beside two
    top-level ``Stateful`` values. ``planning`` is the key asked for with another shape; ``refusing``
    the key whose value refuses what is loaded (:data:`_STEP_FAULTS`)."""
    model: dict[str, Any] = {}
    for key, (shape, dtype, placement) in _STEP_TENSORS.items():
        if f"model.{key}" == planning:
            shape = shape[::-1] if len(shape) > 1 else (shape[0] + 1,)
        full = _step_full(key, shape)
        if saved:
            model[key] = full if target == "plain" else dtensor_of(full, dist.mesh(), [placement])
        elif target == "plain":
            model[key] = different_like(full)
        elif target == "dtensor":
            model[key] = dtensor_of(different_like(full), dist.mesh(), [placement])
        elif key == "w":
            model[key] = dtensor_of(full.to("meta"), dist.mesh(), [placement])
        elif key == "b":
            model[key] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        else:
            model[key] = torch.empty(shape, dtype=dtype, device="meta")
    if saved:
        return {"model": model, "extra": {"step": 7, "note": "saved"}, "a_counter": _Progress(3, "run-a"), "b_progress": _Progress(5, "run-b")}
    first, last = (_REFUSALS[i] if refusing == _STEP_FAULTS["committing"][i] else None for i in (0, 1))
    extra = {"step": 0, "note": ""}
    return {"model": model, "extra": extra if last is None else _ReadOnlyEntry(extra, "note", last), "a_counter": _Progress(0, ""),
            "b_progress": _Progress(0, "", refuse=first)}


def skeleton_of(value: Any) -> Any:
    """What a load that fails after planning must leave as it was: every entry's identity, kind, dtype,
    shape, device and memory (a meta entry as it was, a DTensor's local shard over the same memory),
    every non-tensor value bit for bit, each ``Stateful``'s state; not the values of tensors filled in
    place (a failure while reading may leave them partly read)."""
    from torch.distributed.checkpoint.stateful import Stateful

    if isinstance(value, Mapping):
        return {"__type__": type(value).__name__, "items": [(k, id(v), skeleton_of(v)) for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *(skeleton_of(v) for v in value)]
    if isinstance(value, DTensor):
        return ("dtensor", tuple(value.placements), tuple(value.shape), skeleton_of(value.to_local()))
    if isinstance(value, torch.Tensor):
        where = value.device.type if value.device.type == "meta" else (str(value.device), value.data_ptr())
        return ("tensor", type(value).__name__, value.dtype, tuple(value.shape), value.stride(), where)
    if isinstance(value, Stateful):
        return ("stateful", type(value).__name__, exact(value.state_dict()))
    return exact(value)


@dataclass(frozen=True)
class StepCase:
    """Which step fails on the first rank and on the last (None: that rank's load has no fault)."""

    first: str | None
    last: str | None

    @property
    def id(self) -> str:
        return f"first-{self.first or 'ok'}-last-{self.last or 'ok'}"

    def faults(self, world_size: int) -> dict[int, tuple[str, int]]:
        """rank -> (step, 0 for the first rank's fault or 1 for the last's)."""
        out: dict[int, tuple[str, int]] = {}
        if self.first is not None:
            out[0] = (self.first, 0)
        if self.last is not None:
            out[world_size - 1] = (self.last, 1)
        return out


def _unreadable_records(path: Path, fqn: str) -> dict[str, list[tuple[int, int]]]:
    """file -> the byte ranges in the middle of the saved data of every chunk of ``fqn``: far from its
    records' headers and directories, so a reader that checks those while planning plans
    successfully, and fails when it reads the data."""

    regions: dict[str, list[tuple[int, int]]] = {}
    base = dcp_directory(path)
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn != fqn:
            continue
        with open(base / info.relative_path, "rb", buffering=0) as file:
            start, end = storage_bytes_range(file, info.offset, info.length)
        nbytes = end - start
        middle = start + max(0, nbytes - _UNREADABLE_BYTES) // 2
        regions.setdefault(info.relative_path, []).append((middle, middle + min(nbytes, _UNREADABLE_BYTES)))
    if not regions:  # every rank reads the same metadata: every rank skips alike
        no_record(path, fqn)
    return regions


@dataclass
class _StepLoad:
    """One load of the step tests on this rank: the target, what it was before, what the load raised."""

    state: dict[str, Any]
    before: Any
    skeleton: Any
    exc: BaseException | None


def stateful_states(state: dict[str, Any]) -> list[tuple[str, tuple[tuple[str, Any], ...]]]:
    """Each top-level ``Stateful``'s key and the items of its ``state_dict()``, as plain values."""
    return [(k, tuple(v.state_dict().items())) for k, v in state.items() if isinstance(v, _Progress)]


def load_with_faults(dist: RankContext, ops: Any, path: Path, target: str, faults: dict[int, tuple[str, int]]) -> _StepLoad:
    """A load into a fresh ``target`` state dict with this rank's fault of ``faults``, if any."""
    step, which = faults.get(dist.rank, (None, 0))
    state = step_state(dist, target, saved=False, planning=_STEP_FAULTS["planning"][which] if step == "planning" else None,
                        refusing=_STEP_FAULTS["committing"][which] if step == "committing" else None)
    before = snapshot(state_dict=state, stateful=stateful_states(state))
    skeleton = skeleton_of(state)
    fault: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if step == "reading":
        fault = unreadable_bytes(path, _unreadable_records(path, _STEP_FAULTS["reading"][which]))
    with fault:
        exc = raised(lambda: call_or_skip(lambda: ops.load(state, path, process_group=group_of(dist))))
    return _StepLoad(state, before, skeleton, exc)


def names_the_failure(text: str, path: Path, step: str, which: int) -> None:
    """``text`` names what one rank's fault at ``step`` is about: the key (and, for a read, the data
    file; for a refused commit, the words of the refusal)."""
    __tracebackhide__ = True
    key = _STEP_FAULTS[step][which]
    assert_names_key(text, key, what=f"the error of a failed {step}")
    if step == "committing" and _REFUSALS[which] not in text:
        fail("the error of a refused commit lacks the refusal's own words", text[:600], _REFUSALS[which], key)
    if step == "reading":
        files = sorted(_unreadable_records(path, key))
        if not any(name in text for name in files):
            fail("the error of a failed read does not name the data file", text[:600], f"one of {files}", key)


def most_specific_common_types(types: list[type]) -> list[type]:
    """The classes every one of ``types`` derives from that no other such class derives from."""
    common = set.intersection(*(set(t.__mro__) for t in types))
    return [c for c in common if not any(o is not c and issubclass(o, c) for o in common)]


# -- ML-13 a save killed at each step ------------------------------------------------------------------------------

#: (step of the save, which occurrence) a child is killed at: its first data file opened, mid-data,
#: its last writes and fsyncs (after data, before or during metadata), the publication.
KILL_POINTS = (("open", 1), ("write", 1), ("write", 6), ("fsync", 1), ("open", 2), ("fsync", 2), ("rename", 1))


#: Every write and rename of publication (ML-29), whatever the implementation names its files: a
#: metadata file just opened for writing (truncated, if written in place), torn in the middle of a write,
#: just renamed into place (before the old files' removal), and just after a file was removed.
PUBLICATION_KILL_POINTS = (("open-metadata", 1), ("write-metadata", 1), ("renamed", 1), ("removed", 1))


#: Each trial is a fresh process (a second or two): the default profile tries these, ``thorough`` all.
QUICK_KILL_POINTS = (("write", 6), ("fsync", 1), ("open", 2), ("rename", 1))


def kill_points() -> tuple[tuple[str, int], ...]:
    from hypothesis import settings

    points = KILL_POINTS if settings.get_current_profile_name() == "thorough" else QUICK_KILL_POINTS
    return points + PUBLICATION_KILL_POINTS


#: (kill point, which rank) of the two-rank trials: the last rank as it opens its data file, mid-data
#: and after its data before the metadata; the coordinator (rank 0) at every step of publication;
#: ``thorough`` adds every kill point on each rank and on both.
QUICK_TWO_RANK_KILLS = (
    (("open", 1), "1"), (("write", 2), "1"), (("fsync", 1), "1"),
    *((point, "0") for point in PUBLICATION_KILL_POINTS),
)


def two_rank_kills() -> tuple[tuple[tuple[str, int], str], ...]:
    from hypothesis import settings

    if settings.get_current_profile_name() == "thorough":
        return tuple((point, who) for point in KILL_POINTS + PUBLICATION_KILL_POINTS for who in ("0", "1", "all"))
    return QUICK_TWO_RANK_KILLS
