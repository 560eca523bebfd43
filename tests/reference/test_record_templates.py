"""Tensor records written from templates (``reference.checkpoint.records``): byte for byte what
``torch.save`` writes without CRC32s, for every kind of tensor, whichever tensor made the template.

A record is a template (torch.save's own bytes under ``torch.serialization.skip_data``) around the
storage's bytes. What could go wrong: a template reused for a tensor whose record differs outside its
storage bytes (a key that misses dtype, shape, stride, offset, storage size, requires_grad, conj or neg
bit, or the storage alignment), the wrong bytes in the middle (a view's instead of its storage's), or a
template kept when torch did not make it as expected. Each test below fails for one of those."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from reference.checkpoint import records
from reference.checkpoint.records import write_record
from reference.host_bytes import storage_bytes

pytestmark = pytest.mark.skipif(not records._CAN_TEMPLATE, reason="this torch has no skip_data or crc32 option: torch.save writes every record")


@pytest.fixture(autouse=True)
def _no_templates() -> Iterator[None]:
    """Each test starts with no templates, so the first record of a geometry makes one."""
    records._TEMPLATES.clear()
    yield
    records._TEMPLATES.clear()


def _ours(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    length = write_record(stream, tensor)
    assert length == len(stream.getvalue())
    return stream.getvalue()


def _torch_s(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    with records._without_crc32():
        torch.save(tensor, stream)
    return stream.getvalue()


def _edge_values(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` values of ``dtype`` that include its edges (inf, nan, -0.0, extremes) and differ."""
    if dtype == torch.bool:
        return torch.arange(numel) % 3 == 0
    if dtype.is_complex:
        real = _edge_values(torch.float64, numel)
        return torch.complex(real, real.flip(0)).to(dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        edges = [float("inf"), float("-inf"), float("nan"), -0.0, info.max, info.min, info.tiny, info.eps]
        values = torch.tensor(edges + [float(i) / 7 for i in range(max(0, numel - len(edges)))], dtype=torch.float64)
        return values[:numel].to(dtype)
    bounds = torch.iinfo(dtype)
    ints = [bounds.min, bounds.max, 0, -1 if bounds.min < 0 else 1] + list(range(2, numel))
    return torch.tensor(ints[:numel], dtype=torch.int64 if dtype != torch.uint64 else torch.uint64).to(dtype)


_DTYPES = [
    dtype
    for name in (
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
]


class _Tagged(torch.Tensor):
    """A tensor subclass: torch.save pickles its type."""


def _with_attribute() -> torch.Tensor:
    tensor = torch.arange(6.0)
    tensor.note = "pickled with the tensor"  # type: ignore[attr-defined]
    return tensor


# (id, a fresh tensor): every dtype, then every geometry and flag torch.save's record depends on.
_KINDS: list[tuple[str, Callable[[], torch.Tensor]]] = [
    *[(f"dtype-{dtype}".replace("torch.", ""), lambda dtype=dtype: _edge_values(dtype, 12).reshape(3, 4)) for dtype in _DTYPES],
    ("0-dim", lambda: torch.tensor(3.5)),
    ("1-element", lambda: torch.tensor([7], dtype=torch.int64)),
    ("transposed", lambda: torch.arange(12.0).reshape(3, 4).t()),
    ("channels-last", lambda: torch.arange(120.0).reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)),
    ("view-with-offset", lambda: torch.arange(20.0)[5:11]),
    ("expanded", lambda: torch.arange(3.0).expand(4, 3)),
    ("requires-grad", lambda: torch.arange(6.0).requires_grad_()),
    ("conj", lambda: torch.complex(torch.arange(4.0), torch.ones(4)).conj()),
    ("neg", lambda: torch.complex(torch.arange(4.0), torch.ones(4)).conj().imag),
    ("empty", lambda: torch.zeros(0, 4)),
    ("big", lambda: torch.arange(300_000, dtype=torch.float32)),
    ("external-memory", lambda: torch.frombuffer(bytearray(range(20)), dtype=torch.int16)),
    ("parameter", lambda: torch.nn.Parameter(torch.arange(4.0))),
    ("subclass", lambda: torch.arange(4.0).as_subclass(_Tagged)),
    ("python-attribute", _with_attribute),
]


@pytest.mark.parametrize("make", [make for _, make in _KINDS], ids=[name for name, _ in _KINDS])
def test_a_record_is_torch_save_s_bytes_when_the_template_is_made_and_when_it_is_reused(make: Callable[[], torch.Tensor]) -> None:
    tensor = make()
    made, reused = _ours(tensor), _ours(tensor)
    expected = _torch_s(tensor)
    assert made == expected
    assert reused == expected
    loaded = torch.load(io.BytesIO(reused), weights_only=False)
    assert (loaded.dtype, loaded.shape, loaded.stride(), loaded.is_conj(), loaded.is_neg()) == (
        tensor.dtype, tensor.shape, tensor.stride(), tensor.is_conj(), tensor.is_neg()
    )
    assert _storage(loaded) == _storage(tensor)


def _storage(tensor: torch.Tensor) -> bytes:
    return bytes(storage_bytes(tensor))


# Pairs that differ in exactly one thing torch.save's record holds outside the storage bytes (and whose
# records have the same length, so a template of the one fits the other): a template kept for the first
# and reused for the second writes the first's header around the second's bytes.
_PAIRS: list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]] = [
    ("dtype", lambda: torch.arange(24, dtype=torch.float32), lambda: torch.arange(24, dtype=torch.int32)),
    ("shape", lambda: torch.arange(24.0).reshape(6, 4), lambda: torch.arange(24.0).reshape(4, 6)),
    ("rank", lambda: torch.arange(24.0).reshape(6, 4), lambda: torch.arange(24.0)),
    ("stride", lambda: torch.arange(24.0).reshape(6, 4), lambda: torch.arange(24.0).reshape(4, 6).t()),
    ("storage-offset", lambda: torch.arange(24.0)[0:20], lambda: torch.arange(24.0)[4:24]),
    ("storage-size", lambda: torch.arange(24.0)[0:20], lambda: torch.arange(20.0)),
    ("requires-grad", lambda: torch.arange(24.0), lambda: torch.arange(24.0).requires_grad_()),
    ("conj", lambda: torch.complex(torch.arange(6.0), torch.ones(6)), lambda: torch.complex(torch.arange(6.0), torch.ones(6)).conj()),
    ("neg", lambda: torch.complex(torch.arange(6.0), torch.ones(6)).imag, lambda: torch.complex(torch.arange(6.0), torch.ones(6)).conj().imag),
]


@pytest.mark.parametrize(("first", "second"), [(a, b) for _, a, b in _PAIRS], ids=[name for name, _, _ in _PAIRS])
def test_a_template_is_never_reused_for_a_tensor_whose_record_differs_outside_its_bytes(
    first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]
) -> None:
    for make in (first, second, first, second):
        tensor = make()
        assert _ours(tensor) == _torch_s(tensor)


def test_a_template_follows_torch_s_storage_alignment() -> None:
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    if config is None:
        pytest.skip("this torch has no storage_alignment option (its alignment is fixed)")
    tensor = torch.arange(24.0)
    assert _ours(tensor) == _torch_s(tensor)
    before = config.save.storage_alignment
    config.save.storage_alignment = 256
    try:
        realigned, expected = _ours(tensor), _torch_s(tensor)
    finally:
        config.save.storage_alignment = before
    assert realigned == expected
    assert records.parse_tensor_record(io.BytesIO(realigned), 0, len(realigned)).data_offset % 256 == 0


@contextlib.contextmanager
def _counting_saves() -> Iterator[list[bool]]:
    """Every torch.save call while inside, as whether it made a template (wrote to a template's stream)."""
    calls: list[bool] = []
    real = torch.save

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(isinstance(args[1], records._SkipRecorder))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "save", counted)
        yield calls


def test_records_of_one_geometry_share_one_template_and_differ_only_in_the_storage_bytes() -> None:
    tensors = [torch.full((64, 8), float(i)) for i in range(10)]
    with _counting_saves() as calls:
        written = [_ours(tensor) for tensor in tensors]
    assert calls == [True], "one torch.save, for the template; none for the records"
    layout = records.parse_tensor_record(io.BytesIO(written[0]), 0, len(written[0]))
    assert layout is not None
    start, end = layout.data_offset, layout.data_offset + 64 * 8 * 4
    for tensor, record in zip(tensors, written):
        assert record[:start] == written[0][:start] and record[end:] == written[0][end:]
        assert record[start:end] == _storage(tensor)
        assert record == _torch_s(tensor)


def test_a_template_torch_does_not_make_by_skipping_the_storage_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch whose skip_data writes the bytes anyway (or has no effect on this stream): no skip seen.
    monkeypatch.setattr(torch.serialization, "skip_data", contextlib.nullcontext)
    tensor = torch.arange(32.0)
    assert _ours(tensor) == _torch_s(tensor)
    assert list(records._TEMPLATES.values()) == [None]
    assert _ours(tensor + 1) == _torch_s(tensor + 1)


def test_a_template_the_reader_does_not_parse_as_the_tensor_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    real = records.parse_tensor_record

    def off_by_64(file: Any, offset: int, length: int) -> Any:
        layout = real(file, offset, length)
        return None if layout is None else records.TensorLayout(layout.data_offset + 64, *list(vars(layout).values())[1:])

    monkeypatch.setattr(records, "parse_tensor_record", off_by_64)
    tensor = torch.arange(32.0)
    assert _ours(tensor) == _torch_s(tensor)
    assert list(records._TEMPLATES.values()) == [None]


def test_templates_beyond_the_limit_drop_the_kept_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "_TEMPLATE_LIMIT", 3)
    for n in range(1, 8):
        tensor = torch.arange(float(n))
        assert _ours(tensor) == _torch_s(tensor)
        assert len(records._TEMPLATES) <= 3
