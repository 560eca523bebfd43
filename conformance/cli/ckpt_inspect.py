"""The checkpoint inspector: what a DCP checkpoint holds, without loading it or trusting it.

    statedict-ckpt-inspect CHECKPOINT_DIR            # a table: one row per key, then totals
    statedict-ckpt-inspect CHECKPOINT_DIR --json     # the same as JSON

(``python -m conformance.cli.ckpt_inspect``; in a checkout also ``python -m tools.ckpt_inspect``.)

For every key: its kind (tensor or object), dtype, global shape, number of saved chunks, data bytes
(elements x element size; for an object, its serialized size), bytes stored on disk, and the data
files that hold it. Works on checkpoints written by ``reference.checkpoint`` and by
``torch.distributed.checkpoint``'s filesystem storage.

Safety: DCP's ``.metadata`` is a pickle. It is read with the allow-list unpickler of
:mod:`reference.checkpoint.metadata_io`, which builds only DCP's metadata classes, ``torch.Size``,
dtypes and a few builtins; a file asking for anything else (``os.system``, ...) is refused before
the requested object is even imported, and nothing else in the checkpoint is unpickled.

Exit status: 0 on success, 1 if the checkpoint cannot be read (the message says why), 2 for usage.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from reference.checkpoint.errors import CheckpointError
from reference.checkpoint.metadata_io import METADATA_FILE, read_metadata_file

__all__ = ["KeySummary", "CheckpointSummary", "summarize", "format_table", "main"]


@dataclass(frozen=True)
class KeySummary:
    """One key of a checkpoint."""

    key: str
    kind: str  #: "tensor" or "object"
    dtype: str | None  #: e.g. "float32"; None for objects
    shape: list[int] | None  #: global shape; None for objects
    chunks: int  #: saved pieces (1 for a replicated or unsharded value)
    bytes: int  #: data bytes: numel x element size, or an object's serialized size
    stored_bytes: int  #: bytes its records take in the data files (serialization framing included)
    files: list[str]  #: data files holding it, relative to the checkpoint directory


@dataclass(frozen=True)
class CheckpointSummary:
    """A checkpoint directory: its format version, keys and totals."""

    checkpoint: str
    version: str | None
    keys: list[KeySummary]
    totals: dict[str, int] = field(default_factory=dict)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def summarize(checkpoint_dir: str | Path) -> CheckpointSummary:
    """The summary of the checkpoint in ``checkpoint_dir``. Reads only the metadata (safely).

    Raises :class:`~reference.checkpoint.errors.CheckpointFormatError` (or its subclass
    ``UnsafeCheckpointError``) for a missing, corrupt or unsafe metadata file."""
    metadata: Metadata = read_metadata_file(checkpoint_dir)
    records: dict[str, list[Any]] = {}
    for index, info in (metadata.storage_data or {}).items():
        records.setdefault(index.fqn, []).append(info)
    keys = []
    for key in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[key]
        infos = records.get(key, [])
        stored = sum(int(getattr(info, "length", 0)) for info in infos)
        files = sorted({str(getattr(info, "relative_path", "?")) for info in infos})
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            keys.append(
                KeySummary(
                    key=key,
                    kind="tensor",
                    dtype=_dtype_name(dtype),
                    shape=list(md.size),
                    chunks=len(md.chunks),
                    bytes=math.prod(md.size) * _element_size(dtype),
                    stored_bytes=stored,
                    files=files,
                )
            )
        else:
            keys.append(
                KeySummary(key=key, kind="object", dtype=None, shape=None, chunks=len(infos), bytes=stored, stored_bytes=stored, files=files)
            )
    all_files = sorted({f for k in keys for f in k.files})
    totals = {
        "keys": len(keys),
        "tensors": sum(k.kind == "tensor" for k in keys),
        "objects": sum(k.kind == "object" for k in keys),
        "chunks": sum(k.chunks for k in keys),
        "bytes": sum(k.bytes for k in keys),
        "stored_bytes": sum(k.stored_bytes for k in keys),
        "files": len(all_files),
    }
    return CheckpointSummary(str(checkpoint_dir), metadata.version, keys, totals)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def format_table(summary: CheckpointSummary) -> str:
    """The human-readable report: a header line, one row per key, and the totals."""
    rows = [
        [
            k.key,
            k.dtype if k.kind == "tensor" else "object",
            "x".join(map(str, k.shape)) if k.shape is not None else "-",
            k.chunks,
            k.bytes,
            ", ".join(k.files),
        ]
        for k in summary.keys
    ]
    t = summary.totals
    rows.append(["TOTAL", f"{t['tensors']} tensors, {t['objects']} objects", "", t["chunks"], t["bytes"], f"{t['files']} files"])
    table = tabulate(rows, headers=["key", "dtype", "shape", "chunks", "bytes", "files"], intfmt=",")
    header = (
        f"checkpoint {summary.checkpoint}: format version {summary.version}, {t['keys']} keys, "
        f"{_human(t['bytes'])} of data in {_human(t['stored_bytes'])} stored"
    )
    return header + "\n" + table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="statedict-ckpt-inspect",
        description="List the keys, dtypes, shapes, chunks, bytes and files of a DCP checkpoint, without unpickling untrusted code.",
    )
    parser.add_argument("checkpoint", help=f"checkpoint directory (the one holding {METADATA_FILE})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.checkpoint)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    else:
        print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
