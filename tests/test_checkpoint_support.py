"""Self-tests of the checkpoint sections' shared helpers (conformance/checkpoint_support.py, and the
crafted checkpoints of conformance/checkpoint_crafted_support.py) and of
the suite's own reader of checkpoint files (conformance/dcp_files.py): each fails when it should."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conformance.adapters.base import Unsupported
from conformance.checkpoint_crafted_support import CODE_ROUTES, EXT_CODES, NAME_LIES, crafted_pickle, crafted_record, replace_record
from conformance.checkpoint_support import assert_same_bits, call_or_skip, data_files_of, exact, record_location
from conformance.dcp_files import dcp_directory, read_metadata, storage_bytes_range
from conformance.faults import is_data_file


def _nan_with_payload(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000 | payload))[0]


def test_exact_floats_tell_signed_zeros_and_nan_payloads_apart() -> None:
    assert exact(0.0) != exact(-0.0)
    assert exact(_nan_with_payload(1)) != exact(_nan_with_payload(2))
    assert exact({"a": [1.5, (2.5,)]}) == exact({"a": [1.5, (2.5,)]})
    assert math.isnan(_nan_with_payload(1))


@pytest.mark.parametrize(("got", "expected"), [(-0.0, 0.0), (_nan_with_payload(3), _nan_with_payload(4)), (1.0, 1.0 + 2**-52)])
def test_assert_same_bits_fails_on_values_that_compare_alike_or_almost(got: float, expected: float) -> None:
    with pytest.raises(pytest.fail.Exception):
        assert_same_bits({"step": got}, {"step": expected})
    assert_same_bits({"step": expected}, {"step": expected})


def test_call_or_skip_turns_a_missing_option_into_a_skip_and_lets_other_errors_through() -> None:
    def unsupported() -> None:
        raise Unsupported("no async_save here")

    with pytest.raises(pytest.skip.Exception, match="no async_save here"):
        call_or_skip(unsupported)
    with pytest.raises(ValueError):
        call_or_skip(lambda: int("x"))
    assert call_or_skip(lambda: 3) == 3


def test_records_are_found_and_hold_the_tensors_bytes(tmp_path: Path) -> None:
    """Upstream DCP's own checkpoint: the record the metadata names holds the tensor's storage bytes."""
    values = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.tensor([7, 8, 9], dtype=torch.int64)}
    dcp.save(values, checkpoint_id=tmp_path)
    assert set(read_metadata(tmp_path).state_dict_metadata) == {"w", "b"}
    for key, tensor in values.items():
        name, offset, length = record_location(tmp_path, key)
        with open(tmp_path / name, "rb") as file:
            start, end = storage_bytes_range(file, offset, length)
            file.seek(start)
            stored = file.read(end - start)
        assert offset <= start < end <= offset + length
        assert stored == tensor.numpy().tobytes(), key
    with pytest.raises(pytest.skip.Exception, match="no DCP record of 'missing'"):  # the stack keeps it elsewhere
        record_location(tmp_path, "missing")


def test_dcp_files_in_a_folder_of_the_checkpoint_are_found_there(tmp_path: Path) -> None:
    """A stack that keeps each save in a folder of the checkpoint directory (torchtitan's ``step-N``): the
    metadata read is the newest folder's, record paths are relative to the checkpoint directory, and
    the data files are the files the metadata names (not a stack's own files beside them)."""
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=tmp_path / "step-1")
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "step-2")
    (tmp_path / "step-2" / "metadata.json").write_text("{}")
    assert dcp_directory(tmp_path) == tmp_path / "step-2"
    assert dcp_directory(tmp_path / "step-1") == tmp_path / "step-1"
    assert read_metadata(tmp_path).state_dict_metadata["w"].size == torch.Size([6])
    name, offset, length = record_location(tmp_path, "w")
    assert name.startswith("step-2/") and (tmp_path / name).is_file()
    data = data_files_of(tmp_path)
    assert data(Path(name).name) and not data("metadata.json") and not data(".metadata")
    assert data_files_of(tmp_path / "nothing-here") is is_data_file


def test_a_damaged_record_is_refused(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(8)}, checkpoint_id=tmp_path)
    name, offset, length = record_location(tmp_path, "w")
    data = bytearray((tmp_path / name).read_bytes())
    data[offset : offset + length] = b"\0" * length
    (tmp_path / name).write_bytes(bytes(data))
    with open(tmp_path / name, "rb") as file, pytest.raises(ValueError, match="not a torch.save archive"):
        storage_bytes_range(file, offset, length)


# -- crafted checkpoints: the payloads are real, and torch's weights-only loader refuses each --------------------------


@pytest.mark.parametrize("route", CODE_ROUTES)
def test_each_crafted_pickle_runs_its_code_under_a_plain_unpickler(route: str, tmp_path: Path) -> None:
    """Without the allow-list the crafted pickle of every route does run its code (so a loader that
    lets the route through fails ML-27), and ``torch.load(weights_only=True)`` refuses its record."""
    import copyreg
    import io
    import pickle

    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'a').close()"
    if route in EXT_CODES:
        copyreg.add_extension("builtins", "exec", EXT_CODES[route])
    try:
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(crafted_record(route, code)), weights_only=True)
        assert not marker.exists()
        try:
            pickle.loads(crafted_pickle(route, code))
        except Exception:  # the persistent id route: no persistent_load after the call ran
            pass
    finally:
        if route in EXT_CODES:
            copyreg.remove_extension("builtins", "exec", EXT_CODES[route])
    assert marker.exists(), f"the {route} payload ran nothing"


@pytest.mark.parametrize("route", NAME_LIES)
def test_a_record_with_lying_names_holds_the_lie_beside_a_harmless_data_pkl(route: str) -> None:
    import io
    import zipfile

    names = [info.filename for info in zipfile.ZipFile(io.BytesIO(crafted_record(route, "pass"))).infolist()]
    lie = {"duplicate-data-pkl": "archive/data.pkl", "other-folder": "other/data.pkl", "dot-dot": "archive/../data.pkl"}[route]
    assert names[-1] == lie and "archive/data.pkl" in names[:-1]


def test_replace_record_points_the_metadata_at_the_new_record(tmp_path: Path) -> None:
    import io

    dcp.save({"note": "saved", "w": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
    buffer = io.BytesIO()
    torch.save("replaced", buffer)
    name = replace_record(tmp_path, "note", buffer.getvalue())
    file, offset, length = record_location(tmp_path, "note")
    assert file == name and length == len(buffer.getvalue())
    assert (tmp_path / file).read_bytes()[offset:offset + length] == buffer.getvalue()
    target: dict[str, Any] = {"note": "", "w": torch.zeros(3)}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    assert target["note"] == "replaced" and torch.equal(target["w"], torch.ones(3))
