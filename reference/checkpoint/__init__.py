"""Distributed checkpoints in DCP's format, with meta-tensor loading and resharding (SPEC.md ML-*).

``save(state_dict, checkpoint_id=..., process_group=None)`` and ``load(state_dict, checkpoint_id=...,
process_group=None)`` mirror ``torch.distributed.checkpoint.save``/``load``; checkpoints written by
one load with the other, at any world size.

One job per module:

- :mod:`~reference.checkpoint.api`          save/load: the steps, in order, across ranks
- :mod:`~reference.checkpoint.async_save`   async_save: stage, then the steps of a save in the background
- :mod:`~reference.checkpoint.staging`      the snapshot an async save writes, in reused buffers
- :mod:`~reference.checkpoint.writer_process` the process executor's long-lived writer process
- :mod:`~reference.checkpoint.planner`      what each rank writes/reads (DCP SavePlanner/LoadPlanner)
- :mod:`~reference.checkpoint.layout`       chunks of DTensors, overlaps for resharding
- :mod:`~reference.checkpoint.flatten`      nested state dicts <-> DCP's flat keys
- :mod:`~reference.checkpoint.storage`      the directory layout (DCP StorageWriter/StorageReader)
- :mod:`~reference.checkpoint.records`      one value in a data file: write, parse, read in place
- :mod:`~reference.checkpoint.metadata_io`  the ``.metadata`` pickle, read with an allow-list
- :mod:`~reference.checkpoint.collective`   the steps' collectives: :mod:`reference.comm` with the checkpoint's error policy
- :mod:`~reference.checkpoint.wire`         a save's plans, write results and metadata, pickled compactly between ranks
- :mod:`~reference.checkpoint.errors`       exceptions (all ``Exception`` subclasses)
- :mod:`~reference.checkpoint.fast_paths`   the one switch of the fast paths (off: the plain path, the reference)

Typical meta-device load (PyTorch PR #113319's flow, no ``to_empty`` needed)::

    with torch.device("meta"):
        model = Model()
    model = parallelize_module(model, mesh, plan)      # or fully_shard(model)
    sd = model.state_dict()
    reference.checkpoint.load(sd, checkpoint_id=path)   # meta values -> real, filled
    model.load_state_dict(sd, assign=True)
"""

from __future__ import annotations

from reference.checkpoint.api import load, save
from reference.checkpoint.async_save import AsyncCheckpointerType, AsyncSaveResponse, async_save, async_shutdown, async_writer_pids
from reference.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    StateDictError,
    UnsafeCheckpointError,
)
from reference.checkpoint.metadata_io import read_metadata_file
from reference.checkpoint.planner import LoadResult, ReferenceLoadPlanner, ReferenceSavePlanner
from reference.checkpoint.storage import FileSystemReader, FileSystemWriter, wait_for_removals

__all__ = [
    "save",
    "load",
    "async_save",
    "async_shutdown",
    "async_writer_pids",
    "AsyncCheckpointerType",
    "AsyncSaveResponse",
    "LoadResult",
    "CheckpointError",
    "CheckpointFormatError",
    "StateDictError",
    "UnsafeCheckpointError",
    "ReferenceSavePlanner",
    "ReferenceLoadPlanner",
    "FileSystemWriter",
    "FileSystemReader",
    "read_metadata_file",
    "wait_for_removals",
]
