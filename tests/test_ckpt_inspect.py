"""The checkpoint inspector (``statedict-ckpt-inspect``, ``python -m tools.ckpt_inspect`` in a checkout): ML-16 (what it lists), ML-17 (it runs no code)."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from conformance.cli import ckpt_inspect as inspector
from reference import checkpoint
from reference.checkpoint.metadata_io import StorageInfo

REPO_ROOT = Path(__file__).resolve().parent.parent


def _state_dict() -> dict[str, Any]:
    return {
        "model": {"proj.weight": torch.randn(10, 5), "proj.bias": torch.zeros(10, dtype=torch.bfloat16)},
        "step": 3,
    }


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = inspector.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.req("ML-16")
@pytest.mark.parametrize("writer", ["reference", "torch"])
def test_inspector_lists_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str) -> None:
    if writer == "reference":
        checkpoint.save(_state_dict(), checkpoint_id=tmp_path)
    else:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group, assuming one process"
            dcp.save(_state_dict(), checkpoint_id=tmp_path)

    code, out, err = _run(capsys, str(tmp_path), "--json")
    assert code == 0, err
    report = json.loads(out)
    rows = {row["key"]: row for row in report["keys"]}
    assert sorted(rows) == ["model.proj.bias", "model.proj.weight", "step"]
    weight, bias, step = rows["model.proj.weight"], rows["model.proj.bias"], rows["step"]
    assert (weight["kind"], weight["dtype"], weight["shape"], weight["chunks"], weight["bytes"]) == ("tensor", "float32", [10, 5], 1, 200)
    assert (bias["dtype"], bias["shape"], bias["bytes"]) == ("bfloat16", [10], 20)
    assert step["kind"] == "object" and step["dtype"] is None and step["bytes"] > 0
    files = {f for row in rows.values() for f in row["files"]}
    assert files and all((tmp_path / f).is_file() for f in files), f"listed files {files} are not in the checkpoint"
    totals = report["totals"]
    assert totals["keys"] == 3 and totals["tensors"] == 2 and totals["objects"] == 1
    assert totals["bytes"] == sum(row["bytes"] for row in rows.values())
    # The records account for the data files: DCP packs them end to end; the reference starts each at a
    # multiple of 64 bytes (reference.checkpoint.storage.RECORD_ALIGNMENT), so less than that lies
    # between two records.
    padding = sum((tmp_path / f).stat().st_size for f in files) - totals["stored_bytes"]
    assert padding == 0 if writer == "torch" else 0 <= padding < 64 * totals["chunks"], padding

    code, out, err = _run(capsys, str(tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    assert "format version" in lines[0] and "3 keys" in lines[0]
    assert lines[1].split() == ["key", "dtype", "shape", "chunks", "bytes", "files"]
    assert any(line.split()[:5] == ["model.proj.weight", "float32", "10x5", "1", "200"] for line in lines), out
    assert lines[-1].startswith("TOTAL")


@pytest.mark.req("ML-16")
def test_inspector_counts_chunks_and_files_of_sharded_tensors(tmp_path: Path) -> None:
    """A tensor saved in two chunks by two ranks (metadata written as DCP writes it)."""
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])), ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 4]))]
    metadata = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.float16), torch.Size([5, 4]), chunks),
            "lr": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("w", [0, 0]): StorageInfo("__0_0.distcp", 0, 100),
            MetadataIndex("w", [3, 0]): StorageInfo("__1_0.distcp", 0, 90),
            MetadataIndex("lr"): StorageInfo("__0_0.distcp", 100, 30),
        },
        version="1.0.0",
    )
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    summary = inspector.summarize(tmp_path)
    w = next(k for k in summary.keys if k.key == "w")
    assert (w.chunks, w.bytes, w.stored_bytes, w.files) == (2, 5 * 4 * 2, 190, ["__0_0.distcp", "__1_0.distcp"])
    assert summary.totals["files"] == 2 and summary.totals["chunks"] == 3


@pytest.mark.req("ML-16")
def test_inspector_runs_as_a_module(tmp_path: Path) -> None:
    checkpoint.save(_state_dict(), checkpoint_id=tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "tools.ckpt_inspect", str(tmp_path), "--json"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["totals"]["keys"] == 3


@pytest.mark.req("ML-16")
def test_inspector_reports_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, str(tmp_path / "nothing-here"))
    assert code == 1 and not out
    assert ".metadata" in err and "not found" in err


# -- ML-17: crafted metadata -----------------------------------------------------------------------


class _RunsShell:
    """Unpickling this runs a shell command (the classic pickle exploit)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


class _CallsExec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _payload(kind: str, marker: Path) -> bytes:
    if kind == "os.system":
        return pickle.dumps(_RunsShell(marker))
    if kind == "exec":
        return pickle.dumps(_CallsExec(marker))
    if kind == "inside-metadata":  # a real Metadata with the exploit in a field
        return pickle.dumps(Metadata(state_dict_metadata={"w": BytesStorageMetadata()}, planner_data=_RunsShell(marker), version="1.0.0"))
    raise ValueError(kind)


@pytest.mark.req("ML-17")
@pytest.mark.parametrize("kind", ["os.system", "exec", "inside-metadata"])
def test_crafted_metadata_is_refused_without_running(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(_payload(kind, marker))

    code, out, err = _run(capsys, str(ckpt))
    assert code == 1 and not out
    assert "refusing to load" in err and ".metadata" in err, err
    assert ("system" in err) if kind != "exec" else ("exec" in err), f"the error does not say what was asked for: {err}"
    assert not marker.exists(), "the inspector ran code from the checkpoint"

    with pytest.raises(checkpoint.UnsafeCheckpointError, match="refusing to load"):
        checkpoint.load({"w": torch.zeros(1)}, checkpoint_id=ckpt)
    assert not marker.exists(), "reference.checkpoint.load ran code from the checkpoint"


@pytest.mark.req("ML-17")
def test_corrupt_metadata_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint.save(_state_dict(), checkpoint_id=tmp_path)
    data = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[: len(data) // 2])
    code, _, err = _run(capsys, str(tmp_path))
    assert code == 1 and "corrupt checkpoint metadata" in err, err
