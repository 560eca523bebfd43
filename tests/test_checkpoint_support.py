"""Self-tests of the checkpoint sections' shared helpers (conformance/checkpoint_support.py) and of
the suite's own reader of checkpoint files (conformance/dcp_files.py): each fails when it should."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conformance.adapters.base import Unsupported
from conformance.checkpoint_support import assert_same_bits, call_or_skip, exact, record_location
from conformance.dcp_files import read_metadata, storage_bytes_range


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
    with pytest.raises(LookupError, match="no record of 'missing'"):
        record_location(tmp_path, "missing")


def test_a_damaged_record_is_refused(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(8)}, checkpoint_id=tmp_path)
    name, offset, length = record_location(tmp_path, "w")
    data = bytearray((tmp_path / name).read_bytes())
    data[offset : offset + length] = b"\0" * length
    (tmp_path / name).write_bytes(bytes(data))
    with open(tmp_path / name, "rb") as file, pytest.raises(ValueError, match="not a torch.save archive"):
        storage_bytes_range(file, offset, length)
