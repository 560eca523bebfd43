"""``save`` and ``load``: the steps of a distributed checkpoint, in order, across ranks.

Both mirror ``torch.distributed.checkpoint.save``/``load``: every rank of the process group calls
them with its own state dict; rank 0 coordinates. Without a process group and with
``torch.distributed`` not initialized, they run in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from reference.checkpoint import fast_paths
from reference.checkpoint.collective import Collective, process_group_device
from reference.checkpoint.errors import CheckpointError, StateDictError
from reference.checkpoint.plan_cache import GlobalItems, SendWholePlan
from reference.checkpoint.planner import LoadResult, ReferenceLoadPlanner, ReferenceSavePlanner
from reference.checkpoint.storage import FileSystemReader, FileSystemWriter
from reference.checkpoint.wire import Compact, unwrap

__all__ = ["save", "load", "run_save", "expand_stateful"]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """A fast path: the cyclic garbage collector off for a save or load (as it was before, after); the
    plain path leaves it alone.

    A save or load makes thousands of short-lived, acyclic objects (plans, metadata, one record per
    tensor); each few hundred allocations trigger a collection, and every tenth of those a full one,
    which walks every object of the process (a training process holds hundreds of thousands) and
    takes several times as long as reading a checkpoint's metadata (figures: docs/benchmark-results.md, "Why the fast paths"). Nothing of
    ours forms cycles, and whatever the caller's objects leave is collected once the collector is back."""
    if not fast_paths.enabled():
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def expand_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """DCP's convention: a top-level value with ``state_dict()``/``load_state_dict()`` (``Stateful``) is
    saved and loaded as its state dict."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


@_collector_paused()
def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_writer: StorageWriter | None = None,
    planner: ReferenceSavePlanner | None = None,
) -> Metadata:
    """Save ``state_dict`` (tensors, DTensors with Shard/Replicate placements, and picklable
    non-tensor values, nested in dicts and lists) as a DCP checkpoint in the directory ``checkpoint_id``.

    Called by every rank of ``process_group`` (default: the default group, if initialized). Each
    rank writes its own shards; data held by several ranks (plain tensors, replicated DTensors,
    non-tensor values) is written once. The metadata is the commit point, replaced atomically once
    every rank's data is on disk: after a failed or killed save the directory holds the previous
    checkpoint whole (or, if it held none, nothing that loads), never a mix; a second save to the
    same directory while one is in progress is refused (see :mod:`reference.checkpoint.storage`).

    Returns the checkpoint's metadata on every rank. Raises, on every rank alike,
    :class:`~reference.checkpoint.errors.StateDictError` for a state dict that cannot be saved (a
    meta tensor, a Partial placement, ranks that disagree on a key's shape or on a non-tensor value)
    and :class:`~reference.checkpoint.errors.CheckpointError` for an I/O failure, naming the key,
    file and rank.
    """
    state_dict = expand_stateful(state_dict)
    collective = Collective(process_group, action=f"save to {str(checkpoint_id)!r}")
    writer = storage_writer if storage_writer is not None else FileSystemWriter()
    return run_save(state_dict, checkpoint_id, collective, writer, planner)


#: ``(plan, planner) -> write results``: how a rank's finished plan reaches its files (the storage
#: writer's own ``write_data`` by default; an async save's writer process otherwise).
WriteData = Callable[[SavePlan, ReferenceSavePlanner], list[WriteResult]]


def run_save(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str] | None,
    collective: Collective,
    writer: StorageWriter,
    planner: ReferenceSavePlanner | None = None,
    *,
    local_error: BaseException | None = None,
    write_data: WriteData | None = None,
) -> Metadata:
    """The steps of a save (plan, write, publish) on the ranks of ``collective``, for a state dict whose
    ``Stateful`` values are already expanded: :func:`save`'s, and an async save's background step.

    ``local_error``: what this rank hit before planning (an async save's staging), raised in the planning
    step so that every rank fails alike. ``write_data`` replaces the storage writer's ``write_data``."""
    writer.reset(checkpoint_id)
    planner = planner if planner is not None else ReferenceSavePlanner()
    metadata_box: list[Metadata] = []

    # Plans, write results and the metadata cross ranks as wire.Compact: pickled, they travel as plain
    # tuples.
    def local_plan() -> Compact[SavePlan]:
        if local_error is not None:
            raise local_error
        planner.set_up_planner(state_dict, writer.storage_meta(), collective.is_coordinator)
        writer.set_up_storage_writer(collective.is_coordinator)
        return Compact(writer.prepare_local_plan(planner.create_local_plan()))

    def global_plan(plans: list[Compact[SavePlan]]) -> list[Compact[SavePlan]]:
        all_plans = [unwrap(plan) for plan in plans]
        if planner.needs_whole_plans(all_plans):  # a rank sent a layout key this coordinator lacks
            return [Compact(SavePlan([], planner_data=SendWholePlan()))] * len(all_plans)
        new_plans, metadata = planner.create_global_plan(all_plans)
        metadata_box.append(metadata)
        new_plans = writer.prepare_global_plan(new_plans)
        if fast_paths.enabled() and _writer_keeps_items(writer):
            # A rank that holds its items from an earlier save of this layout is sent their digest only.
            new_plans = [_without_held_items(plan) for plan in new_plans]
        return [Compact(plan) for plan in new_plans]

    try:
        plan = unwrap(collective.gather_decide_scatter("planning", local_plan, global_plan))
        if isinstance(plan.planner_data, SendWholePlan):  # every rank got it: a second round, items sent

            def whole_plan() -> Compact[SavePlan]:
                return Compact(writer.prepare_local_plan(planner.whole_local_plan()))

            plan = unwrap(collective.gather_decide_scatter("planning", whole_plan, global_plan))
    except BaseException:
        close = getattr(writer, "close", None)
        if callable(close):
            close()
        raise

    def write() -> Compact[list[WriteResult]]:
        final_plan = planner.finish_plan(plan)
        if write_data is not None:
            return Compact(write_data(final_plan, planner))
        future = writer.write_data(final_plan, planner)
        future.wait()
        return Compact(future.value())

    def finish(results: list[Compact[list[WriteResult]]]) -> Compact[Metadata]:
        writer.finish(metadata_box[0], [unwrap(rank_results) for rank_results in results])
        return Compact(metadata_box[0])

    try:
        return unwrap(collective.gather_decide_broadcast("writing", write, finish))
    finally:
        close = getattr(writer, "close", None)
        if callable(close):
            close()  # a failed save releases the directory's save lock here


@_collector_paused()
def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    allow_unexpected: bool = True,
    storage_reader: StorageReader | None = None,
    planner: ReferenceLoadPlanner | None = None,
) -> LoadResult:
    """Load the checkpoint ``checkpoint_id`` into ``state_dict``, in place, resharding as needed.

    Called by every rank of ``process_group``, each with the state dict it wants filled: the keys
    and shapes say what to read, DTensor placements say which part. The checkpoint may have been
    saved at any world size and sharding. Tensors are filled in place; a value on the meta device is
    replaced by a new one on the process group's device (CPU for gloo or without a group, the current
    CUDA device for nccl; a DTensor on its mesh's device), built once and read into directly, so the
    load's peak memory is about the local shards (see
    :class:`~reference.checkpoint.planner.ReferenceLoadPlanner`); non-tensor values are replaced.
    With ``strict=False`` the meta values of keys missing from the checkpoint stay on meta.

    Strictness: by default a key missing from the checkpoint, or a dtype mismatch, is an error;
    ``strict=False`` skips missing keys and converts dtypes. Keys in the checkpoint that the state
    dict does not ask for are returned in ``unexpected_keys``, or are an error with
    ``allow_unexpected=False``. Every mismatch is found before anything is read, and the state dict
    is then unchanged; files are checked (present, long enough, parseable) before anything is read.

    Returns a :class:`~reference.checkpoint.planner.LoadResult`. Raises on every rank alike:
    :class:`~reference.checkpoint.errors.StateDictError` for mismatches,
    :class:`~reference.checkpoint.errors.CheckpointFormatError` for a missing, truncated or corrupt
    checkpoint or an unknown format version.

    A save that publishes over the checkpoint while the load plans or reads it (an async save's
    background write, a training job beside an evaluation job) does not fail it: its files replace the
    old ones, and the load starts again from the new metadata (at most twice), so it gets one save's
    checkpoint whole.

    Tied weights: values that shared a storage on meta share one after loading. ``nn.Module.
    load_state_dict(sd, assign=True)`` still makes one Parameter per key, so re-tie afterwards
    (``model.head.weight = model.embed.weight``, or the model's ``tie_weights()``).

    A top-level ``Stateful`` value (with ``state_dict``/``load_state_dict``) is loaded through its state
    dict, and its ``load_state_dict`` is called once every rank has read successfully.

    All or nothing, on every rank alike: a load that fails while planning, reading or committing
    (putting built and non-tensor values into the state dict, calling the ``Stateful`` values'
    ``load_state_dict``) on any rank raises the same error on every rank (naming each failing rank
    and what it saw) and replaces nothing in any rank's state dict; what a failed commit had put in
    is taken out again, and each ``Stateful`` gets back what its ``state_dict()`` returned before.
    Every rank calls every ``Stateful``'s ``state_dict()``, ``load_state_dict`` and, after a failure
    on any rank, the restoring ``load_state_dict`` in the same order, whatever failed on it, so
    those calls may be collective. Tensors filled in place may hold partial data after a failure
    while reading, and the saved data after a failure while committing.
    """
    user_state_dict, state_dict = state_dict, expand_stateful(state_dict)
    reader = storage_reader if storage_reader is not None else FileSystemReader()
    reader.reset(checkpoint_id)
    planner = (
        planner
        if planner is not None
        else ReferenceLoadPlanner(
            strict=strict, allow_unexpected=allow_unexpected, device=process_group_device(process_group)
        )
    )
    collective = Collective(process_group, action=f"load from {str(checkpoint_id)!r}")

    planned_from: list[str | None] = [None]  # the save whose metadata this rank planned from

    def local_plan() -> LoadPlan:
        metadata = reader.read_metadata()
        planned_from[0] = _save_id(metadata)
        planner.set_up_planner(state_dict, metadata, collective.is_coordinator)
        reader.set_up_storage_reader(metadata, collective.is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    def global_plan(plans: list[LoadPlan]) -> list[LoadPlan]:
        return reader.prepare_global_plan(planner.create_global_plan(plans))

    def plan_and_read() -> None:
        if _plans_stay_local(planner, reader):
            plan = collective.all_succeed("planning", local_plan)
        else:
            plan = collective.gather_decide_scatter("planning", local_plan, global_plan)

        def read() -> None:
            reader.read_data(planner.finish_plan(plan), planner).wait()

        collective.all_succeed("reading", read)

    # A save may publish over the checkpoint while this load plans or reads it (an async save's
    # background write, an evaluation job beside training): the files the old metadata names are then
    # removed, and planning or reading fails on one. The load then starts again from the new metadata,
    # which is whole (AS-3); a failure under metadata that did not change is the load's own.
    for attempt in range(1, _LOADS_AFTER_A_PUBLICATION + 2):
        try:
            plan_and_read()
            break
        except CheckpointError:
            if attempt > _LOADS_AFTER_A_PUBLICATION or not _published_meanwhile(collective, reader, planned_from[0]):
                raise
            reader.reset(checkpoint_id)
    statefuls = {key: value for key, value in user_state_dict.items() if isinstance(value, Stateful)}
    undo: list[Callable[[], None]] = []

    def commit() -> LoadResult:
        # Every rank makes the same calls in the same order whatever fails on it (a Stateful's
        # state_dict/load_state_dict may be collective); the first failure is raised at the end.
        previous = {key: value.state_dict() for key, value in statefuls.items()}
        errors: list[Exception] = []
        result = planner.result
        try:
            result = planner.commit(undo)
            for key, value in user_state_dict.items():
                if key not in statefuls and value is not state_dict[key]:  # commit replaced it in the expanded dict
                    user_state_dict[key] = state_dict[key]
                    undo.append(functools.partial(user_state_dict.__setitem__, key, value))
        except Exception as exc:
            errors.append(exc)
        for key, value in statefuls.items():
            try:
                value.load_state_dict(state_dict[key])
            except Exception as exc:
                cls = StateDictError if isinstance(exc, (ValueError, TypeError)) else CheckpointError
                error = cls(f"key {key!r}: {type(value).__name__}.load_state_dict raised {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                errors.append(error)
                undo.append(functools.partial(_restore_stateful, value, previous[key], refused=True))
            else:
                undo.append(functools.partial(_restore_stateful, value, previous[key], refused=False))
        if errors:
            raise errors[0]
        return result

    try:
        return collective.all_succeed("committing", commit)
    except BaseException as exc:
        problems = _undo(undo)
        add_note = getattr(exc, "add_note", None)  # Python >= 3.11
        if problems and add_note is not None:
            add_note("the state dict could not be restored: " + "; ".join(problems))
        raise


#: How many times a load starts again because a save published over the checkpoint while it read.
_LOADS_AFTER_A_PUBLICATION = 2


def _save_id(metadata: Metadata) -> str | None:
    storage_meta = getattr(metadata, "storage_meta", None)
    return getattr(storage_meta, "save_id", None) if storage_meta is not None else None


def _published_meanwhile(collective: Collective, reader: StorageReader, planned_from: str | None) -> bool:
    """Whether, on any rank, the checkpoint's metadata now names another save than the one this rank
    planned from (collective: every rank gets the same answer). Unknown (no save id, metadata that no
    longer reads) counts as no."""

    def replaced() -> bool:
        if planned_from is None:
            return False
        try:
            return _save_id(reader.read_metadata()) not in (None, planned_from)
        except Exception:  # what the metadata now holds is the next attempt's to report
            return False

    try:
        return bool(collective.gather_decide_broadcast("checking", replaced, any))
    except CheckpointError:
        return False


def _writer_keeps_items(writer: StorageWriter) -> bool:
    """Part of the plan cache, a fast path: whether the writer's global step leaves the planner's items as they are (the reference's
    ``FileSystemWriter`` only names each rank's files): then a rank's held items can stand for the
    items the coordinator would send. Any other writer's plans travel whole."""
    return type(writer).prepare_global_plan is FileSystemWriter.prepare_global_plan


def _without_held_items(plan: SavePlan) -> SavePlan:
    """``plan`` without its items when its rank holds them (see :mod:`reference.checkpoint.plan_cache`)."""
    data = plan.planner_data
    if isinstance(data, GlobalItems) and data.held and plan.items:
        return dataclasses.replace(plan, items=[])
    return plan


def _plans_stay_local(planner: ReferenceLoadPlanner, reader: StorageReader) -> bool:
    """A fast path: whether the global step of load planning returns every rank's plan as it is, as the
    reference planner's and reader's do (each rank reads what it needs): then the plans need not
    travel to the coordinator and back, and only the outcome of planning is agreed (one all-reduce
    instead of pickling every rank's plan), the same errors on every rank (figures:
    docs/benchmark-results.md, "Why the fast paths"). The plain path, and any other planner or
    reader, gets DCP's full gather, global step and scatter."""
    return (
        fast_paths.enabled()
        and type(planner).create_global_plan is ReferenceLoadPlanner.create_global_plan
        and type(reader).prepare_global_plan is FileSystemReader.prepare_global_plan
    )


def _restore_stateful(value: Stateful, previous: Any, *, refused: bool) -> None:
    """Load back what ``value.state_dict()`` returned before the commit (on every rank, in the same
    order as the loads, whatever failed where). A value that refused the loaded state may refuse this
    too: it is then left as it is (its refusal is the error being raised)."""
    try:
        value.load_state_dict(previous)
    except Exception:
        if not refused:
            raise


def _undo(steps: list[Callable[[], None]]) -> list[str]:
    """Run ``steps`` last to first, each even when one before failed; returns the failures (the
    state dict is then not fully restored)."""
    failed: list[str] = []
    for step in reversed(steps):
        try:
            step()
        except Exception as exc:  # every step is tried, every failure reported
            failed.append(f"{type(exc).__name__}: {exc}")
    return failed
