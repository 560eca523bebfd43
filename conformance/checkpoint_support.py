"""Helpers the checkpoint sections' test files share (``test_checkpoint.py``,
``test_checkpoint_unpinned.py``): the adapter's ops, values and DTensors to save, bit-exact comparison,
faults and damage applied to a saved checkpoint, and memory measurement. Self-tests:
``tests/test_checkpoint_support.py``."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import pickle
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from conformance import models
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.checkpoint import CheckpointOps
from conformance.asserts import (
    assert_same_state,
    expected_local_chunk,
    fail,
    raised,
)
from conformance.dcp_files import read_metadata
from conformance.faults import failing_fsync, failing_writes
from conformance.harness.context import RankContext

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
    "CODE_ROUTES",
    "NAME_LIES",
    "EXT_CODES",
    "crafted_pickle",
    "crafted_record",
    "replace_record",
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
    baseline = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    fn()
    return (rss_kib("VmHWM") - baseline) * 1024, "peak RSS"


def injected_fault(dist: RankContext, path: Path, fault: str, where: str) -> contextlib.AbstractContextManager[None]:
    if where == "last-rank" and dist.rank != dist.world_size - 1:
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


def record_location(path: Path, fqn: str, offset: tuple[int, ...] | None = None) -> tuple[str, int, int]:
    """(file, byte offset, length) of the stored record of ``fqn`` (the chunk at ``offset``)."""
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            return info.relative_path, info.offset, info.length
    raise LookupError(f"{path}: no record of {fqn!r} at {offset}")


def file_read_by_one_rank(dist: RankContext, path: Path) -> tuple[str, int, int]:
    """(file, byte offset, length) of the record of one rank's shard of ``w`` in a data file that holds
    nothing else: with ``w`` loaded into the same layout, only that rank reads the file. The last
    such rank's (where replicated ``b`` went depends on the implementation's deduplication)."""

    records = read_metadata(path).storage_data
    for rank in reversed(range(dist.world_size)):
        name, offset, length = record_location(path, "w", (4 * rank, 0))
        if [(i.fqn, tuple(i.offset or ())) for i, info in records.items() if info.relative_path == name] == [("w", (4 * rank, 0))]:
            return name, offset, length
    listing = sorted((info.relative_path, i.fqn, tuple(i.offset or ())) for i, info in records.items())
    fail("test set-up: no data file holds one rank's shard alone", listing, "a file holding only one shard of 'w'", str(path))
    raise AssertionError  # unreachable: fail() raises


def damage(dist: RankContext, path: Path, case: str, who: str) -> str:
    """Damage the checkpoint at ``path`` (call on rank 0); returns what the error must name.

    Data files: for ``every-rank`` the file holding ``b``, which every rank reads; for ``one-rank`` a
    file holding one rank's shard of ``w`` and nothing else, which only that rank reads.
    A truncation cuts that record in half."""
    meta = path / ".metadata"
    if case in ("missing-data-file", "truncated-data-file"):
        if who == "every-rank":
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


def check_after_kill(impl: Adapter, path: Path, directory: str, kill: tuple[str, int], *, world: int, killed: str,
                     executor: str | None = None) -> None:
    """A child saves over ``directory`` ("fresh" or "overwrite" of a first child's save) and is killed at
    ``kill``: the directory then holds the previous checkpoint whole, nothing that loads (fresh), or the
    new one whole; never a mix. ``executor``: the killed save is an async save on it (AS-3)."""
    __tracebackhide__ = True
    from conformance.crash_child import crash_state

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
    moment ago) pointed at it. Returns the data file's name."""
    import dataclasses

    meta = path / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the save a moment ago
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            with open(path / info.relative_path, "ab") as f:
                start = f.tell()
                f.write(data)
            metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=len(data))
            with open(meta, "wb") as f:
                pickle.dump(metadata, f)
            return str(info.relative_path)
    raise LookupError(f"{path}: no record of {fqn!r} at {offset}")
