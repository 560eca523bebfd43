"""Unit tests of reference.checkpoint's pieces, in one process: planners are tested with plans as plain
values (they never see a process group), records against torch.save's own output, flattening against DCP.

The multi-rank behaviour is the conformance suite's job (``conformance/test_checkpoint.py``)."""

from __future__ import annotations

import fractions
import io
import itertools
import math
import os
import pickle
import signal
import time
import warnings
import zipfile
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten  # the oracle
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from reference.checkpoint import CheckpointError, CheckpointFormatError, StateDictError, load, records, save
from reference.checkpoint.flatten import flatten_state_dict, set_value
from reference.checkpoint.layout import Chunk, check_tiling, overlaps
from reference.checkpoint.planner import ReferenceLoadPlanner, ReferenceSavePlanner
from reference.checkpoint.records import parse_tensor_record, read_region, write_record

# -- flatten ----------------------------------------------------------------------------------


def _nested() -> dict:
    return {
        "model": {"w": torch.ones(2), "0": torch.zeros(1)},
        "optim": {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)}, 1: {}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
        },
        "tensors": [torch.ones(1), torch.zeros(1)],
        "plain_list": [1, 2, 3],
        "step": 4,
    }


def test_flat_keys_match_dcp() -> None:
    sd = _nested()
    ours = flatten_state_dict(sd)
    theirs, mapping = dcp_flatten(sd)
    assert list(ours.values) == list(theirs)
    assert ours.paths == mapping
    assert all(ours.values[k] is theirs[k] for k in theirs), "flattening copied a value"


def test_set_value_keeps_original_key_types() -> None:
    sd = _nested()
    flat = flatten_state_dict(sd)
    set_value(sd, flat.native_paths["optim.state.0.step"], torch.tensor(9.0))
    assert list(sd["optim"]["state"]) == [0, 1] and sd["optim"]["state"][0]["step"].item() == 9.0


def test_colliding_flat_keys_are_an_error() -> None:
    with pytest.raises(ValueError, match="'a.b'"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})


# -- layout -----------------------------------------------------------------------------------


def test_overlaps_of_uneven_row_shards() -> None:
    saved = [Chunk((0, 0), (3, 4)), Chunk((3, 0), (2, 4))]  # 5 rows saved by 2 ranks
    wanted = Chunk((2, 0), (2, 4))  # rows 2..3 at a new world size
    found = overlaps(wanted, saved)
    assert [(i, o.saved_offsets, o.wanted_offsets, o.lengths) for i, o in found] == [
        (0, (2, 0), (0, 0), (1, 4)),
        (1, (0, 0), (1, 0), (1, 4)),
    ]
    assert overlaps(Chunk((5, 0), (0, 4)), saved) == []  # an empty shard reads nothing
    assert len(overlaps(Chunk((), ()), [Chunk((), ())])) == 1  # 0-d tensors


def _tiles_by_every_pair(shape: tuple[int, ...], chunks: list[Chunk]) -> bool:
    """The oracle: every chunk inside, no two intersecting (every pair compared), elements add up."""
    inside = all(
        len(c.offsets) == len(shape) and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(c.offsets, c.sizes, shape))
        for c in chunks
    )
    nonempty = [c for c in chunks if c.numel]
    disjoint = all(not overlaps(a, [b]) for i, a in enumerate(nonempty) for b in nonempty[i + 1 :])
    return inside and disjoint and sum(c.numel for c in nonempty) == math.prod(shape)


def _grid(shape: tuple[int, ...], splits: tuple[int, ...]) -> list[Chunk]:
    """torch.chunk's pieces along every dim, crossed: a DTensor's chunks on a mesh of ``splits``."""
    per_dim = []
    for n, k in zip(shape, splits):
        step = -(-n // k)
        per_dim.append([(min(i * step, n), min(step, n - min(i * step, n))) for i in range(k)])
    return [Chunk(tuple(o for o, _ in box), tuple(z for _, z in box)) for box in itertools.product(*per_dim)]


@pytest.mark.parametrize(
    "shape, chunks, problem",
    [
        ((), [Chunk((), ())], None),
        ((), [Chunk((), ()), Chunk((), ())], "0-d"),
        ((4, 4), _grid((4, 4), (2, 2)), None),
        ((5, 3), _grid((5, 3), (4, 2)), None),  # uneven, with empty pieces
        ((4, 4), [*_grid((4, 4), (2, 2)), Chunk((4, 0), (0, 4))], None),  # an empty chunk at the end
        # Overlaps the sweep must find: a chunk still open past others, a later column, a later first row.
        ((6, 2), [Chunk((0, 0), (6, 1)), Chunk((0, 1), (3, 1)), Chunk((3, 1), (2, 1)), Chunk((4, 0), (1, 1))], "overlap"),
        ((4, 4), [Chunk((0, 0), (2, 4)), Chunk((2, 0), (2, 2)), Chunk((2, 2), (2, 2)), Chunk((1, 3), (1, 1))], "overlap"),
        ((4, 4), [Chunk((0, 0), (4, 2)), Chunk((0, 2), (2, 2)), Chunk((2, 2), (2, 2)), Chunk((3, 1), (1, 1))], "overlap"),
        ((4,), [Chunk((0,), (2,)), Chunk((1,), (2,)), Chunk((3,), (1,))], "overlap"),  # covers 5 of 4 too
        ((4, 4), [Chunk((0, 0), (4, 4)), Chunk((0, 0), (-1, 4))], "outside"),
        ((4, 4), [Chunk((0,), (4,))], "dims"),
        ((5,), [Chunk((0,), (3,)), Chunk((3,), (2,))], None),
        ((5,), [Chunk((0,), (3,)), Chunk((2,), (3,))], "overlap"),
        ((5,), [Chunk((0,), (3,))], "cover 3 of 5"),
        ((5,), [Chunk((0,), (3,)), Chunk((3,), (3,))], "outside"),
    ],
)
def test_check_tiling_in_any_number_of_dims(shape: tuple[int, ...], chunks: list[Chunk], problem: str | None) -> None:
    result = check_tiling("k", shape, chunks)
    if problem is None:
        assert result is None and _tiles_by_every_pair(shape, chunks)
    else:
        assert result is not None and problem in result and "'k'" in result, result
        assert not _tiles_by_every_pair(shape, chunks)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_check_tiling_agrees_with_comparing_every_pair(shape: tuple[int, ...], data: Any) -> None:
    """Random boxes, and tilings with one box moved, grown or dropped: the sweep finds exactly what
    comparing every pair finds."""
    splits = tuple(data.draw(st.integers(1, n + 1)) for n in shape)
    chunks = _grid(shape, splits)
    data.draw(st.randoms()).shuffle(chunks)
    edit = data.draw(st.sampled_from(["none", "move", "grow", "drop", "random"]))
    if edit == "random":
        chunks = [
            Chunk(tuple(data.draw(st.integers(0, n)) for n in shape), tuple(data.draw(st.integers(0, n)) for n in shape))
            for _ in range(data.draw(st.integers(1, 6)))
        ]
    elif edit != "none":
        i = data.draw(st.integers(0, len(chunks) - 1))
        dim = data.draw(st.integers(0, len(shape) - 1))
        c = chunks[i]
        if edit == "drop":
            del chunks[i]
        else:
            offsets, sizes = list(c.offsets), list(c.sizes)
            (offsets if edit == "move" else sizes)[dim] += data.draw(st.sampled_from([-1, 1]))
            chunks[i] = Chunk(tuple(offsets), tuple(sizes))
    assert (check_tiling("k", shape, chunks) is None) == _tiles_by_every_pair(shape, chunks)


class _CountedChunk(Chunk):
    """A chunk that counts how often its offsets and sizes are read: any check of a pair reads them."""

    reads = 0

    @property  # a NamedTuple field read through a counting property
    def offsets(self) -> tuple[int, ...]:
        _CountedChunk.reads += 1
        return tuple.__getitem__(self, 0)

    @property
    def sizes(self) -> tuple[int, ...]:
        _CountedChunk.reads += 1
        return tuple.__getitem__(self, 1)


def test_check_tiling_of_thousands_of_row_shards_compares_neighbours_only() -> None:
    """4,096 row shards (a Shard(0) tensor at 4,096 ranks) cost a few reads each, not 8 million pairs
    (pytorch/pytorch#163548: DCP's quadratic global-plan check took minutes at 1,024 ranks): counted
    as reads of the chunks' offsets and sizes, which every comparison of two chunks makes."""
    rows: list[Chunk] = [_CountedChunk((2 * i, 0), (2, 8)) for i in range(4096)]
    _CountedChunk.reads = 0
    assert check_tiling("k", (8192, 8), rows) is None
    assert _CountedChunk.reads < 20 * len(rows), _CountedChunk.reads
    rows[4000] = Chunk((7999, 0), (2, 8))  # one row shared with its neighbour, and one row left uncovered
    assert "overlap" in (check_tiling("k", (8192, 8), rows) or "")


# -- planners, with plans as values --------------------------------------------------------------


def _local_plan(sd: dict) -> SavePlan:
    planner = ReferenceSavePlanner()
    planner.set_up_planner(sd)
    return planner.create_local_plan()


def test_replicated_items_are_written_by_one_rank() -> None:
    plans = [_local_plan({"w": torch.ones(100), "b": torch.ones(10), "step": 3}) for _ in range(3)]
    new_plans, metadata = ReferenceSavePlanner().create_global_plan(plans)
    written = [item.index.fqn for plan in new_plans for item in plan.items]
    assert sorted(written) == ["b", "step", "w"]
    assert len({rank for rank, plan in enumerate(new_plans) if plan.items}) > 1, "all writes landed on one rank"
    assert sorted(metadata.state_dict_metadata) == ["b", "step", "w"]
    assert metadata.planner_data == {"w": ("w",), "b": ("b",), "step": ("step",)}


def test_small_replicated_items_are_spread_by_count_large_ones_by_bytes() -> None:
    """Each record has a fixed cost beside its bytes: an optimizer's 4-byte ``step`` tensors, replicated
    on every rank, must not all go to the rank that happens to be a few bytes behind (one rank wrote 86
    more records than the other at 512 MB, world size 2); large replicated tensors still split by bytes."""
    steps = {f"state.{i}.step": torch.tensor(float(i)) for i in range(86)}
    objects = {"lr": 0.1, "params": [f"layer.{i}" for i in range(86)]}  # pickles of unequal sizes
    big = {f"w{i}": torch.ones(1 << (10 + i % 4)) for i in range(8)}
    plans = [_local_plan({**steps, **objects, **big}) for _ in range(2)]
    new_plans, _ = ReferenceSavePlanner().create_global_plan(plans)
    step_counts = [sum(item.index.fqn.endswith(".step") for item in plan.items) for plan in new_plans]
    assert sorted(step_counts) == [43, 43], step_counts
    big_bytes = [
        sum(4 * math.prod(item.tensor_data.chunk.sizes) for item in plan.items if item.tensor_data and item.index.fqn.startswith("w"))
        for plan in new_plans
    ]
    assert abs(big_bytes[0] - big_bytes[1]) <= 4 * (1 << 13), big_bytes


def test_a_piece_of_a_replicated_tensor_is_written_from_its_own_memory() -> None:
    """A replicated tensor cut into pieces (one per holder) is resolved for writing as a tensor over the
    piece's own bytes of the state, not a copy: a copy per piece was one more copy of the state in the
    training process beside AS-5's two staged ones (a thread-executor save measured 43-51 MiB for four
    saves of 16 MiB against AS-5's bound of 48). A lazy conjugate is still resolved (a copy)."""
    from reference.checkpoint.planner import REPLICA_PIECE_BYTES

    rows = 4 * REPLICA_PIECE_BYTES // (4 * 8)
    state = {"big": torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8), "z": torch.ones(rows, 8, dtype=torch.complex64).conj()}
    planners = [ReferenceSavePlanner() for _ in range(2)]
    for planner in planners:
        planner.set_up_planner(state)
    new_plans, _ = planners[0].create_global_plan([planner.create_local_plan() for planner in planners])
    pieces = 0
    for planner, plan in zip(planners, new_plans):
        for item in planner.finish_plan(plan).items:
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            chunk = item.tensor_data.chunk
            expected = state[item.index.fqn][chunk.offsets[0]:chunk.offsets[0] + chunk.sizes[0]]
            assert torch.equal(data.resolve_conj(), expected.resolve_conj())
            assert data.untyped_storage().nbytes() == data.numel() * data.element_size()  # torch.save writes it all
            if item.index.fqn == "big" and tuple(chunk.sizes) != (rows, 8):
                pieces += 1
                assert data.data_ptr() == expected.data_ptr(), "a piece was copied"
            if item.index.fqn == "z" and tuple(chunk.sizes) != (rows, 8):
                assert data.data_ptr() != expected.data_ptr() and not data.is_conj(), "a lazy conjugate written as its raw bytes"
    assert pieces == 2


def test_ranks_disagreeing_on_a_value_are_named() -> None:
    plans = [_local_plan({"seed": 10 + rank, "w": torch.ones(2, rank + 1)}) for rank in range(2)]
    with pytest.raises(StateDictError) as info:
        ReferenceSavePlanner().create_global_plan(plans)
    text = str(info.value)
    assert "'seed'" in text and "differs across ranks" in text
    assert "'w'" in text and "shape [2, 1]" in text and "shape [2, 2]" in text


def test_meta_tensors_cannot_be_saved() -> None:
    with pytest.raises(StateDictError, match="'w'.*meta"):
        ReferenceSavePlanner().set_up_planner({"w": torch.empty(2, device="meta")})


def _metadata(sd: dict) -> Metadata:
    _, metadata = ReferenceSavePlanner().create_global_plan([_local_plan(sd)])
    return metadata


def test_load_planner_lists_every_problem_before_changing_anything() -> None:
    metadata = _metadata({"a": torch.ones(2, 3), "b": torch.ones(4), "c": 1})
    sd = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.float64), "c": torch.zeros(1), "d": torch.zeros(1)}
    before = dict(sd)
    with pytest.raises(StateDictError) as info:
        ReferenceLoadPlanner().set_up_planner(sd, metadata)
    text = str(info.value)
    for needle in ("'a': shape [2, 3] in the checkpoint, [3, 2]", "'b': dtype torch.float32", "'c': the checkpoint holds a non-tensor", "'d': missing"):
        assert needle in text, f"{needle!r} not in {text}"
    assert all(sd[k] is v for k, v in before.items())


def test_meta_values_are_built_and_replaced_only_at_commit() -> None:
    metadata = _metadata({"w": torch.ones(2, 3)})
    weight = torch.empty(3, 2, device="meta")
    sd = {"w": weight.t(), "tied": weight.t()}  # two views of one meta storage
    metadata.state_dict_metadata["tied"] = metadata.state_dict_metadata["w"]
    planner = ReferenceLoadPlanner(strict=True)
    planner.set_up_planner(sd, metadata)
    assert sd["w"].device.type == "meta", "the state dict changed before the reads"
    planner.commit()
    assert sd["w"].device.type == "cpu" and sd["w"].stride() == (1, 2), "layout not kept"
    assert sd["w"].untyped_storage().data_ptr() == sd["tied"].untyped_storage().data_ptr()


# -- records ----------------------------------------------------------------------------------


_TENSORS = {
    "contiguous": torch.arange(20.0).reshape(4, 5),
    "transposed": torch.arange(20.0).reshape(5, 4).t(),
    "bfloat16": torch.arange(6, dtype=torch.bfloat16),
    "int64": torch.arange(7),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 3),
}


@pytest.mark.parametrize("name", list(_TENSORS))
def test_records_are_parsed_and_read_in_place(name: str) -> None:
    tensor = _TENSORS[name]
    stream = io.BytesIO(b"x" * 13)  # records start anywhere in a data file
    stream.seek(13)
    torch.save(tensor, stream)
    length = stream.tell() - 13
    layout = parse_tensor_record(stream, 13, length)
    assert layout is not None and layout.dtype == tensor.dtype and layout.size == tuple(tensor.shape)
    for offsets in itertools.product(*[range(min(n, 2)) for n in tensor.shape]):
        lengths = tuple(n - o for n, o in zip(tensor.shape, offsets))
        dest = torch.zeros(lengths, dtype=tensor.dtype)
        read_region(stream, 13, length, layout, tuple(offsets), lengths, dest)
        box = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        assert torch.equal(dest, box), f"{name} at {offsets}"
    dest = torch.zeros(tensor.shape, dtype=tensor.dtype)
    read_region(stream, 13, length, None, (0,) * tensor.dim(), tuple(tensor.shape), dest)  # torch.load fallback
    assert torch.equal(dest, tensor)


def test_a_record_that_is_not_a_zip_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a torch.save record"):
        parse_tensor_record(io.BytesIO(b"\x00" * 100), 0, 100)


def _record(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    write_record(stream, tensor)
    return stream.getvalue()


def test_records_are_written_without_crc32_and_torch_reads_them() -> None:
    tensor = torch.arange(12.0).reshape(3, 4)
    record = _record(tensor)
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor)
    if hasattr(torch.serialization, "set_crc32_options"):
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            assert {info.CRC for info in archive.infolist()} == {0}
        assert torch.serialization.get_crc32_options()  # the global option is restored


@pytest.mark.parametrize("cut", [1, 30, 200])
def test_a_record_cut_short_is_an_error(cut: int) -> None:
    # Cut from the end (the zip directory is there) or the data runs past the given length.
    record = _record(torch.arange(64.0))
    with pytest.raises(ValueError, match="torch.save record"):
        parse_tensor_record(io.BytesIO(record[:-cut]), 0, len(record) - cut)


def test_a_record_damaged_in_its_directory_is_an_error() -> None:
    record = bytearray(_record(torch.arange(8.0)))
    record[record.rfind(b"PK\x01\x02")] = 0  # the last central directory entry's signature
    with pytest.raises(ValueError, match="corrupt torch.save record"):
        parse_tensor_record(io.BytesIO(bytes(record)), 0, len(record))


def _records_in_one_stream(tensors: list[torch.Tensor]) -> tuple[io.BytesIO, list[tuple[int, int]]]:
    """The records of ``tensors`` one after another behind a 7-byte prefix, with each (offset, length)."""
    stream = io.BytesIO(b"p" * 7)
    stream.seek(7)
    spans = []
    for tensor in tensors:
        start = stream.tell()
        spans.append((start, write_record(stream, tensor)))
    return stream, spans


def _fresh_parse(stream: io.BytesIO, offset: int, length: int) -> Any:
    records._PARSED.clear()
    return parse_tensor_record(stream, offset, length)


# Records of one length that differ only where a parse looks: in data.pkl (shape, dtype, storage
# offset, stride), in the storage's local header, in the zip directory. Big ones (more than the
# 4 KiB read at each end) and small ones (read whole, in one read).
_SAME_LENGTH_RECORDS = {
    "shape": [torch.full((2, 3), 1.0), torch.full((3, 2), 2.0), torch.full((6, 1), 3.0)],
    "shape, big": [torch.full((1024, 4), 1.0), torch.full((4, 1024), 2.0), torch.full((2048, 2), 3.0)],
    "dtype": [torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.float32)],
    "dtype, big": [torch.arange(4096, dtype=torch.int32), torch.arange(4096, dtype=torch.float32)],
    "stride": [torch.arange(12.0).reshape(3, 4), torch.arange(12.0).reshape(4, 3).t()],
}


@pytest.mark.parametrize("case", list(_SAME_LENGTH_RECORDS))
def test_a_kept_parse_is_reused_only_for_records_equal_where_the_parse_looks(case: str) -> None:
    # A kept parse (records._PARSED) given to a record that differs from it in any byte the parse
    # consults would read the wrong geometry: each record, parsed after all the others, must give what
    # it gives parsed alone, at its own offset.
    tensors = _SAME_LENGTH_RECORDS[case]
    stream, spans = _records_in_one_stream(tensors)
    assert len({length for _, length in spans}) == 1, "the case needs records of one length"
    alone = [_fresh_parse(stream, offset, length) for offset, length in spans]
    records._PARSED.clear()
    for _ in range(2):
        for (offset, length), expected, tensor in zip(spans, alone, tensors):
            layout = parse_tensor_record(stream, offset, length)
            assert layout == expected
            dest = torch.zeros(tensor.shape, dtype=tensor.dtype)
            read_region(stream, offset, length, layout, (0,) * tensor.dim(), tuple(tensor.shape), dest)
            assert torch.equal(dest, tensor), case


def _counting_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets of the records that ``records._parse`` parses from now on (a kept parse is not one)."""
    parses: list[int] = []
    parse = records._parse

    def counted(record: Any) -> Any:
        parses.append(record.offset)
        return parse(record)

    monkeypatch.setattr(records, "_parse", counted)
    return parses


# Big: more than the 4 KiB read at each end. Small: read whole in one read, tensor bytes and zip
# directory in the same buffer (a bias shard, a norm weight).
@pytest.mark.parametrize("shape", [(1024, 3), (2, 3), (512,)], ids=["big", "small", "small 1-D"])
def test_a_kept_parse_is_reused_for_records_of_other_values(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]) -> None:
    # The point of keeping parses: a model's records of one shape are parsed once, whatever they hold
    # (more of them than are kept per length: values must not count as what the parse consulted).
    tensors = [torch.full(shape, float(i)) for i in range(3 * records._KEPT_PER_LENGTH)]
    stream, spans = _records_in_one_stream(tensors)
    records._PARSED.clear()
    parses = _counting_parses(monkeypatch)
    layouts = [parse_tensor_record(stream, offset, length) for offset, length in spans]
    assert parses == [spans[0][0]]
    assert [layout.data_offset - offset for layout, (offset, _) in zip(layouts, spans)] == [layouts[0].data_offset - spans[0][0]] * len(spans)
    for (offset, length), layout, tensor in zip(spans, layouts, tensors):
        dest = torch.empty(tensor.shape)
        read_region(stream, offset, length, layout, (0,) * len(shape), tuple(tensor.shape), dest)
        assert torch.equal(dest, tensor)


def test_records_of_many_geometries_of_one_length_do_not_drop_the_kept_parses_of_other_lengths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # More geometries of one length than are kept for it (shapes with 12 elements, each its own parse)
    # replace that length's oldest parses only: a weight's parse, kept before, is still used after.
    weight = torch.full((1024, 3), 1.0)
    shapes = [(12,), (1, 12), (12, 1), (2, 6), (6, 2), (3, 4), (4, 3), (1, 1, 12), (2, 2, 3), (3, 2, 2), (2, 3, 2), (1, 2, 6)]
    assert len(shapes) > records._KEPT_PER_LENGTH
    stream, spans = _records_in_one_stream([weight, *(torch.zeros(s) for s in shapes), weight * 2])
    assert len({length for _, length in spans[1:-1]}) == 1, "the geometries need records of one length"
    records._PARSED.clear()
    parses = _counting_parses(monkeypatch)
    for offset, length in spans:
        parse_tensor_record(stream, offset, length)
    assert parses == [offset for offset, _ in spans[:-1]]


@pytest.mark.parametrize("where", ["central directory", "local header of data.pkl", "local header of the storage", "data.pkl"])
@pytest.mark.parametrize("big", [False, True])
def test_a_damaged_record_is_an_error_after_an_intact_one_of_its_length_was_parsed(where: str, big: bool) -> None:
    tensor = torch.arange(2048.0 if big else 8.0)
    intact = _record(tensor)
    damaged = bytearray(intact)
    if where == "central directory":
        damaged[damaged.rfind(b"PK\x01\x02")] = 0
    elif where == "local header of data.pkl":
        damaged[damaged.find(b"PK\x03\x04")] = 0
    elif where == "local header of the storage":
        damaged[damaged.find(b"PK\x03\x04", damaged.find(b"/data/0") - 40)] = 0
    else:  # an opcode of the pickle: the stop byte at its end
        pickled_end = damaged.find(b"PK\x03\x04", 10)
        damaged[damaged.rfind(b".", 0, pickled_end)] = ord("\xff")
    records._PARSED.clear()
    assert parse_tensor_record(io.BytesIO(intact), 0, len(intact)) is not None
    with pytest.raises(ValueError, match="torch.save record"):
        parse_tensor_record(io.BytesIO(bytes(damaged)), 0, len(damaged))


def test_a_record_that_disagrees_with_the_metadata_is_an_error(tmp_path) -> None:
    # Two records of the same length swapped in the metadata: each parses, but holds the other tensor.
    path = tmp_path / "ckpt"
    save({"a": torch.zeros(2, 3), "b": torch.ones(3, 2)}, checkpoint_id=path)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, written a moment ago
    index = {i.fqn: i for i in metadata.storage_data}
    metadata.storage_data[index["a"]], metadata.storage_data[index["b"]] = (
        metadata.storage_data[index["b"]], metadata.storage_data[index["a"]])
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    target = {"a": torch.full((2, 3), 7.0), "b": torch.full((3, 2), 7.0)}
    with pytest.raises(CheckpointFormatError, match=r"key '(a|b)'.*metadata says torch.float32 of shape \[(2, 3|3, 2)\]"):
        load(target, checkpoint_id=path)
    assert all(bool((t == 7.0).all()) for t in target.values())  # found before anything was read


# -- Stateful values (DCP's convention), one process ------------------------------------------------


class _Counter:
    """A Stateful: saved and loaded through state_dict()/load_state_dict()."""

    def __init__(self, count: int) -> None:
        self.count = torch.tensor(count)

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.count = state_dict["count"].clone()


def test_stateful_values_are_saved_and_loaded_through_their_state_dicts(tmp_path) -> None:
    from reference import checkpoint

    checkpoint.save({"counter": _Counter(5), "w": torch.ones(2)}, checkpoint_id=tmp_path)
    counter = _Counter(0)
    checkpoint.load({"counter": counter, "w": torch.zeros(2)}, checkpoint_id=tmp_path)
    assert counter.count.item() == 5


def test_top_level_values_are_replaced_in_the_callers_dict(tmp_path) -> None:
    from reference import checkpoint

    checkpoint.save({"counter": _Counter(2), "w": torch.ones(2), "name": "x"}, checkpoint_id=tmp_path)
    sd: dict[str, Any] = {"counter": _Counter(0), "w": torch.empty(2, device="meta"), "name": ""}
    checkpoint.load(sd, checkpoint_id=tmp_path)
    assert sd["w"].device.type == "cpu" and torch.equal(sd["w"], torch.ones(2)) and sd["name"] == "x"


class _Epoch:
    """A Stateful holding non-tensor state (a Stateful's tensors are filled in place while reading)."""

    def __init__(self, epoch: int, refuse: bool = False) -> None:
        self.epoch, self.refuse = epoch, refuse

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.refuse:
            raise ValueError("the saved epoch is out of range")
        self.epoch = state_dict["epoch"]


class _FrozenNote(dict):
    """A mapping whose ``note`` cannot be replaced."""

    def __setitem__(self, key: object, value: object) -> None:
        if key == "note":
            raise TypeError("note is frozen")
        super().__setitem__(key, value)


@pytest.mark.parametrize("refuser", ["stateful", "mapping"])
def test_a_failed_commit_is_undone(tmp_path, refuser: str) -> None:
    """A commit that fails part-way (a Stateful refusing its state after another one loaded, or a
    mapping refusing one of its values after another took its new one) raises a StateDictError naming
    the key, and everything the commit had put in is taken out again: meta entries, non-tensor values,
    top-level values, the Stateful already loaded."""
    from reference import checkpoint

    checkpoint.save({"a": _Epoch(5), "b": _Epoch(6), "w": torch.ones(2), "extra": {"step": 3, "note": "x"}, "top": "saved"},
                    checkpoint_id=tmp_path)
    meta = torch.empty(2, device="meta")
    first = _Epoch(0)
    extra = _FrozenNote(step=0, note="") if refuser == "mapping" else {"step": 0, "note": ""}
    sd: dict[str, Any] = {"a": first, "b": _Epoch(0, refuse=refuser == "stateful"), "w": meta, "extra": extra, "top": ""}
    key = "b" if refuser == "stateful" else "extra.note"
    with pytest.raises(StateDictError, match=rf"key '{key}': .*(out of range|note is frozen)"):
        checkpoint.load(sd, checkpoint_id=tmp_path)
    assert sd["w"] is meta and sd["top"] == "" and dict(extra) == {"step": 0, "note": ""} and sd["extra"] is extra
    assert first.epoch == 0, "the Stateful loaded before the failure kept the loaded state"
    sd["b"].refuse = False
    if refuser == "mapping":
        sd["extra"] = {"step": 0, "note": ""}
    checkpoint.load(sd, checkpoint_id=tmp_path)  # the same state dict loads once nothing refuses
    assert first.epoch == 5 and sd["b"].epoch == 6 and sd["extra"] == {"step": 3, "note": "x"} and sd["top"] == "saved"
    assert torch.equal(sd["w"], torch.ones(2))


def test_non_strided_tensors_cannot_be_saved() -> None:
    """A sparse tensor is refused naming its key, never left out of the checkpoint silently."""
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(StateDictError, match=r"key 'emb': layout torch.sparse_coo is not supported"):
        ReferenceSavePlanner().set_up_planner({"w": torch.ones(2), "emb": sparse})


def test_an_io_error_while_reading_names_the_file_and_key(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error the reader did not foresee (an I/O error mid-read) is a CheckpointFormatError naming the
    data file and the key, and the state dict is left as it was."""
    from reference.checkpoint import CheckpointFormatError, load, save, storage

    save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}, checkpoint_id=tmp_path)
    target = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}

    def failing_read(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(storage, "read_region", failing_read)
    with pytest.raises(CheckpointFormatError) as info:
        load(target, checkpoint_id=tmp_path)
    text = str(info.value)
    assert str(tmp_path) in text and ".distcp" in text and ("'w'" in text or "'b'" in text) and "Input/output error" in text, text
    assert torch.equal(target["w"], torch.zeros(2, 3)) and torch.equal(target["b"], torch.zeros(2)), "a failed load changed the state dict"


# -- the writer's staging, one ahead (on the CPU: values pass through; on a GPU the next copy runs) --


def test_values_are_resolved_one_ahead_of_the_write_and_in_order() -> None:
    from reference.checkpoint.storage import _on_host_one_ahead

    produced: list[int] = []

    def values():
        for k in range(5):
            produced.append(k)
            yield torch.full((2,), float(k)) if k % 2 else io.BytesIO(bytes([k]))

    for k, value in enumerate(_on_host_one_ahead(values())):
        # When value k is handed out, value k + 1 (and no further one) has been resolved.
        assert produced == list(range(min(k + 2, 5))), f"at value {k}"
        got = value.getvalue()[0] if isinstance(value, io.BytesIO) else int(value[0])
        assert got == k
    assert list(_on_host_one_ahead(iter(()))) == []


def test_raw_reads_stay_inside_the_destination() -> None:
    """The raw-address read fills exactly the destination's elements and refuses, rather than
    overruns, a destination whose elements are not one contiguous CPU run inside its storage."""
    import io as _io

    from reference.checkpoint.records import _readinto

    payload = bytes(range(256)) * 4
    storage = torch.full((300,), -1, dtype=torch.uint8)
    dest = storage[10:266]
    _readinto(_io.BytesIO(payload), 0, dest)
    assert dest.tolist() == list(payload[:256])
    assert storage[:10].eq(255).all() and storage[266:].eq(255).all(), "bytes outside the destination changed"
    with pytest.raises(ValueError, match="no raw byte view"):
        _readinto(_io.BytesIO(payload), 0, torch.zeros(8, 8, dtype=torch.uint8).t()[:, :4])


# -- reader threads -------------------------------------------------------------------------------------


def _entries(lengths: list[int]) -> list[Any]:
    from reference.checkpoint.metadata_io import StorageInfo

    out, offset = [], 0
    for i, length in enumerate(lengths):
        out.append((f"item{i}", StorageInfo("f.distcp", offset, length)))
        offset += length
    return out


@pytest.mark.parametrize(
    "lengths, parts, runs",
    [
        ([8 << 20] * 8, 2, [4, 4]),
        ([8 << 20] * 8, 4, [2, 2, 2, 2]),
        ([8 << 20] * 3, 8, [1, 1, 1]),  # never more runs than records
        ([1 << 20] * 6, 4, [6]),  # 6 MiB: below two runs' worth of MIN_RUN_BYTES
        ([32 << 20, 1 << 20, 1 << 20, 1 << 20, 32 << 20], 2, [3, 2]),  # by bytes (34 + 33 MiB), not by count
        ([], 4, []),
    ],
)
def test_records_are_split_into_consecutive_runs_of_about_equal_bytes(lengths: list[int], parts: int, runs: list[int]) -> None:
    from reference.checkpoint.storage import _record_bytes, _split_by_bytes

    entries = _entries(lengths)
    got = _split_by_bytes(entries, parts, _record_bytes)
    assert [len(run) for run in got] == runs
    assert [entry for run in got for entry in run] == entries, "runs must keep every record once, in file order"


@pytest.mark.parametrize("storage_class", ["FileSystemReader", "FileSystemWriter"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_thread_count_must_be_a_positive_int(bad: Any, storage_class: str) -> None:
    from reference.checkpoint import storage

    with pytest.raises(ValueError, match="thread_count"):
        getattr(storage, storage_class)(thread_count=bad)


@pytest.mark.parametrize(
    "cpus, local_world_size, expected",
    [(2, None, 2), (2, "2", 1), (2, "8", 1), (16, "8", 2), (64, "8", 4), (64, None, 4), (3, "junk", 3), (1, "0", 1)],
)
def test_default_reader_and_writer_threads_share_the_cpus_among_the_node_s_ranks(
    monkeypatch: pytest.MonkeyPatch, cpus: int, local_world_size: str | None, expected: int
) -> None:
    """Without ``thread_count``, a rank starts at most its share of the node's CPUs (torchrun's
    ``LOCAL_WORLD_SIZE`` ranks share them), never fewer than one, never more than four."""
    from reference.checkpoint import storage

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    for storage_class in (storage.FileSystemReader, storage.FileSystemWriter):
        assert storage_class().thread_count == expected, storage_class.__name__
        assert storage_class(thread_count=3).thread_count == 3  # asked for: as asked


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_threaded_reads_fill_every_tensor_bit_for_bit(tmp_path, threads: int) -> None:
    """Runs read by several threads land in the right tensors: every value, of every dtype, bit for bit."""
    from reference.checkpoint.storage import FileSystemReader

    generator = torch.Generator().manual_seed(0)
    source: dict[str, Any] = {f"t{i}": torch.randn(1 << 19, generator=generator).to(dtype)
                              for i, dtype in enumerate([torch.float32, torch.float64, torch.bfloat16, torch.int64] * 4)}
    source["step"] = torch.tensor(7)
    source["extra"] = {"lr": 0.5}  # a non-tensor value: read on the calling thread
    save(source, checkpoint_id=tmp_path)
    target: dict[str, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"lr": None} for k, v in source.items()}
    load(target, checkpoint_id=tmp_path, storage_reader=FileSystemReader(thread_count=threads))
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
        else:
            assert target[key] == value, key


def test_a_threaded_read_raises_the_first_failure_in_file_order(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With several reader threads, every run ends before the load raises, and the error is the first
    failing run's (in file order), naming the file and its key, whatever thread failed first."""
    import threading

    from reference.checkpoint import storage

    source = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 4 MiB each
    save(source, checkpoint_id=tmp_path)
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    original = read_region
    late_failure = threading.Event()
    in_flight = [0]

    def flaky(file: Any, offset: int, length: int, layout: Any, saved: Any, lengths: Any, dest: torch.Tensor) -> None:
        in_flight[0] += 1
        try:
            checked(file, offset, length, layout, saved, lengths, dest)
        finally:
            in_flight[0] -= 1

    def checked(file: Any, offset: int, length: int, layout: Any, saved: Any, lengths: Any, dest: torch.Tensor) -> None:
        original(file, offset, length, layout, saved, lengths, dest)
        if torch.equal(dest, source["t6"]):  # in the second run: fails first in time
            late_failure.set()
            raise OSError(5, "late run failed")
        if torch.equal(dest, source["t1"]):  # in the first run: waits so that it fails after the other
            late_failure.wait(5)
            raise OSError(5, "early run failed")

    monkeypatch.setattr(storage, "read_region", flaky)
    with pytest.raises(CheckpointFormatError) as info:
        load(target, checkpoint_id=tmp_path, storage_reader=storage.FileSystemReader(thread_count=2))
    text = str(info.value)
    assert "early run failed" in text and "'t1'" in text and ".distcp" in text, text
    assert in_flight[0] == 0, "the load raised while a reader thread was still reading"


def _mixed_dtype_state(tensors: int) -> dict[str, Any]:
    """``tensors`` tensors of 2-4 MiB (every dtype kind, edge values included), a scalar and non-tensor values."""
    generator = torch.Generator().manual_seed(1)
    state: dict[str, Any] = {}
    for i, dtype in zip(range(tensors), itertools.cycle([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8])):
        value = (torch.randn(1 << 19, generator=generator) * 1e3).to(dtype)
        if dtype.is_floating_point:
            value[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
        state[f"t{i}"] = value
    state["step"] = torch.tensor(7)
    state["extra"] = {"lr": 0.5, "name": "run-1"}
    return state


def _assert_bitwise_equal(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("threads, files", [(1, 1), (2, 2), (4, 4)])
def test_threaded_saves_write_every_tensor_bit_for_bit_in_a_file_per_thread(tmp_path, threads: int, files: int) -> None:
    """Each writer thread writes a run of the rank's records to a data file of its own; the reference and
    torch's own reader both read every value back, bit for bit."""
    import torch.distributed.checkpoint as dcp

    from reference.checkpoint.storage import FileSystemWriter

    source = _mixed_dtype_state(12)
    save(source, checkpoint_id=tmp_path, storage_writer=FileSystemWriter(thread_count=threads))
    assert len(list(tmp_path.glob("__0_*.distcp"))) == files
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, written a moment ago
    assert len({info.relative_path for info in metadata.storage_data.values()}) == files
    for reader in ("reference", "torch"):
        target: dict[str, Any] = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"lr": None, "name": None} for k, v in source.items()
        }
        if reader == "reference":
            load(target, checkpoint_id=tmp_path)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP warns that it loads in one process
                dcp.load(target, checkpoint_id=str(tmp_path))
        _assert_bitwise_equal(target, source)


def test_a_threaded_save_raises_the_first_failure_in_run_order_and_keeps_the_checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With several writer threads, every run ends before the save raises, the error is the first
    failing run's whatever thread failed first, and the previous checkpoint still loads, whole."""
    import threading

    from reference.checkpoint import storage

    before = {f"t{i}": torch.full((1 << 20,), -float(i)) for i in range(8)}  # 4 MiB each
    save(before, checkpoint_id=tmp_path)
    source = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    original = records.write_record
    late_failure = threading.Event()
    in_flight = [0]
    crc32_option = torch.serialization.get_crc32_options()

    def flaky(stream: Any, value: Any) -> int:
        in_flight[0] += 1
        try:
            if isinstance(value, torch.Tensor) and torch.equal(value, source["t6"]):  # the second run: fails first in time
                late_failure.set()
                raise OSError(28, "late run failed")
            if isinstance(value, torch.Tensor) and torch.equal(value, source["t1"]):  # the first run: fails after it
                late_failure.wait(5)
                raise OSError(28, "early run failed")
            return original(stream, value)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(storage, "write_record", flaky)
    with pytest.raises(CheckpointError) as info:
        save(source, checkpoint_id=tmp_path, storage_writer=storage.FileSystemWriter(thread_count=2))
    assert "early run failed" in str(info.value), info.value
    assert in_flight[0] == 0, "the save raised while a writer thread was still writing"
    assert torch.serialization.get_crc32_options() == crc32_option  # torch's global option is as it was
    monkeypatch.undo()
    target = {k: torch.zeros_like(v) for k, v in before.items()}
    load(target, checkpoint_id=tmp_path)
    _assert_bitwise_equal(target, before)


class _OptionPerProcess:
    """torch's CRC32 option as older torch keeps it (2.11 on the GPU machine): one value for the whole
    process, whichever thread sets it."""

    def __init__(self) -> None:
        self.value = True

    def get(self) -> bool:
        return self.value

    def set(self, value: bool) -> None:
        self.value = value


@pytest.mark.parametrize("option", [True, False])
@pytest.mark.parametrize("kept", ["by-this-torch", "per-process"])
def test_overlapping_record_writers_leave_torch_s_crc32_option_as_it_was(
    monkeypatch: pytest.MonkeyPatch, option: bool, kept: str
) -> None:
    """Records are written without CRC32s by switching torch's option off around torch.save (which
    writes the record, or its template: the threads write tensors of two shapes, and no template is
    kept before, so each calls it once). Two writer threads overlap: the second starts while the first
    is inside torch.save, the first ends, then the second. Each must write without CRC32s, and the
    option must be as it was afterwards, whether torch keeps it per thread (a switch made once, by the
    first writer or by the caller, would leave the other threads writing CRC32s) or per process (a
    writer putting back what it found would switch CRC32s on under the other, and the last one out
    would leave them off for good; the first was seen with torch 2.11)."""
    import threading

    from reference.checkpoint.records import write_record

    if kept == "per-process":
        shared = _OptionPerProcess()
        monkeypatch.setattr(torch.serialization, "get_crc32_options", shared.get)
        monkeypatch.setattr(torch.serialization, "set_crc32_options", shared.set)
    monkeypatch.setattr(records, "_CRC32", records._Crc32Writers())  # found out again, for this option
    real_save = torch.save
    first_inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def save(value: Any, stream: Any, *args: Any, **kwargs: Any) -> None:
        name = threading.current_thread().name
        if name == "first":
            first_inside.set()
            assert second_inside.wait(10)
        else:
            second_inside.set()
            assert first_done.wait(10)
        seen[name] = torch.serialization.get_crc32_options()
        real_save(value, stream, *args, **kwargs)

    def first() -> None:
        write_record(io.BytesIO(), torch.ones(8))
        first_done.set()

    def second() -> None:
        assert first_inside.wait(10)
        write_record(io.BytesIO(), torch.ones(9))

    monkeypatch.setattr(records, "_TEMPLATES", {})
    monkeypatch.setattr(torch, "save", save)
    torch.serialization.set_crc32_options(option)
    try:
        threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert seen == {"first": False, "second": False}, "a record was written with CRC32s"
        assert torch.serialization.get_crc32_options() == option  # this thread's (or the process's), as it was
        if kept == "per-process":
            assert records._CRC32.per_thread is False, "an option kept per process was taken for one kept per thread"
    finally:
        torch.serialization.set_crc32_options(True)


def test_reader_threads_are_reused_from_load_to_load(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting threads costs a small load a quarter of its time: loads share one pool per thread
    count instead of starting threads of their own. Ten loads with three threads may start the pool's
    two helper threads (a pool starts them as work needs them), never more."""
    import threading

    from reference.checkpoint.storage import FileSystemReader

    source = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(4)}
    save(source, checkpoint_id=tmp_path)
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    started: list[str] = []
    real_start = threading.Thread.start

    def counted_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted_start)
    for _ in range(10):
        load(target, checkpoint_id=tmp_path, storage_reader=FileSystemReader(thread_count=3))
    monkeypatch.undo()
    assert len(started) <= 2, f"ten loads started {len(started)} threads: {started}"
    assert all(torch.equal(target[k], v) for k, v in source.items())


def test_concurrent_threaded_loads_all_finish(tmp_path) -> None:
    """Loads on several threads at once share the pool; each thread reads its own load's runs while
    no pool thread is free, so none waits on another."""
    import threading

    from reference.checkpoint.storage import FileSystemReader

    source = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(6)}
    save(source, checkpoint_id=tmp_path)
    targets = [{k: torch.zeros_like(v) for k, v in source.items()} for _ in range(4)]
    errors: list[BaseException] = []

    def one(target: dict[str, torch.Tensor]) -> None:
        try:
            load(target, checkpoint_id=tmp_path, storage_reader=FileSystemReader(thread_count=2))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a concurrent load hung"
    assert not errors, errors
    assert all(torch.equal(t[k], v) for t in targets for k, v in source.items())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_loads_with_threads(tmp_path) -> None:
    """A child forked after a threaded load inherits the pool objects but not their threads: it must
    start its own, not wait forever on a pool no thread serves."""
    from reference.checkpoint.storage import FileSystemReader

    source = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(4)}
    save(source, checkpoint_id=tmp_path)
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    load(target, checkpoint_id=tmp_path, storage_reader=FileSystemReader(thread_count=2))  # the pool exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the load finished with the right values
        code = 1
        try:
            # torch's own intra-op threads do not survive a fork either: keep the child's tensor ops on
            # the calling thread, so that only the reader pool is under test.
            torch.set_num_threads(1)
            fresh = {k: torch.zeros_like(v) for k, v in source.items()}
            load(fresh, checkpoint_id=tmp_path, storage_reader=FileSystemReader(thread_count=2))
            code = 0 if all(torch.equal(fresh[k], v) for k, v in source.items()) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the forked child's load failed"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's load hung on the parent's reader pool")


# -- non-tensor values --------------------------------------------------------------------------------


#: Values of pickle's own types: read by the plain unpickler.
PLAIN_VALUES = [
    1e-3, 0.0, -0.0, float("inf"), float("-inf"), float("nan"), 2**63 + 5, -(2**70), 0, True, None, "adamw", "",
    "ünïcode", (0.9, 0.999), [1, [2, (3,)]], {"lr": 0.1, "betas": (0.9, 0.95), "nested": {"a": [None]}},
    [{"params": [0, 1], "lr": 1e-4}],
]
#: Values that need a global: they go to torch.load(weights_only=True).
TORCH_VALUES = [torch.arange(3), torch.Size([2, 3]), {"t": torch.ones(2)}, torch.float16]


@pytest.mark.parametrize("value, plain", [(v, True) for v in PLAIN_VALUES] + [(v, False) for v in TORCH_VALUES], ids=repr)
def test_non_tensor_values_read_as_torch_load_reads_them(monkeypatch: pytest.MonkeyPatch, value: Any, plain: bool) -> None:
    """The same value, of the same type, as torch.load(weights_only=True): plain values through the
    plain unpickler (torch.load is not called), the rest through torch.load."""
    from reference.checkpoint.records import read_object_record

    buffer = io.BytesIO()
    torch.save(value, buffer)
    expected = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    calls: list[object] = []
    real_load = torch.load

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted_load)
    got = read_object_record(buffer.getvalue())
    assert repr(got) == repr(expected) and type(got) is type(expected)
    assert (not calls) == plain, "a plain value went through torch.load" if plain else "torch.load was not asked"


def test_a_value_torch_load_refuses_is_refused() -> None:
    """A value that needs a global outside torch's allow-list is not read by the fast path: it goes to
    torch.load(weights_only=True), which refuses it."""
    from reference.checkpoint.records import read_object_record

    buffer = io.BytesIO()
    torch.save(fractions.Fraction(1, 3), buffer)  # any class torch does not allow
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only|weights_only"):
        read_object_record(buffer.getvalue())
    damaged = buffer.getvalue()[:40]
    with pytest.raises(RuntimeError) as expected:
        torch.load(io.BytesIO(damaged), weights_only=True)
    with pytest.raises(RuntimeError) as got:  # a damaged record: torch.load's own error
        read_object_record(damaged)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("value", [io.BytesIO(b"\x00fp8\xff"), io.BytesIO(b""), b"\x00\x01\xfe", {"meta": io.BytesIO(b"ab"), "n": 2}])
def test_a_bytesio_record_is_read_without_torch_load(monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    """A BytesIO (a module's extra state, as Transformer Engine keeps it; DCP saves it with torch.save)
    and protocol 2's spelling of bytes (``_codecs.encode(str, "latin1")``) are read by the plain
    unpickler, as what was saved, and torch.load is not asked."""
    from reference.checkpoint.records import read_object_record

    buffer = io.BytesIO()
    torch.save(value, buffer)
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("torch.load was asked"))
    got = read_object_record(buffer.getvalue())

    def readable(v: Any) -> Any:
        return ("BytesIO", v.getvalue()) if isinstance(v, io.BytesIO) else {k: readable(x) for k, x in v.items()} if isinstance(v, dict) else v

    assert type(got) is type(value) and readable(got) == readable(value)


def test_protocol_2_bytes_are_taken_in_their_own_spelling_only() -> None:
    """``_codecs.encode`` and ``bytes()`` are how protocol 2 spells bytes; with any other codec, or
    ``bytes`` with arguments (a size to allocate), they are refused (torch.load then decides)."""
    from reference.checkpoint.records import _empty_bytes, _latin1_bytes

    assert _latin1_bytes("\x00\xff", "latin1") == b"\x00\xff"
    for encoding in ("zlib_codec", "utf-8", "rot13"):
        with pytest.raises(Exception, match="_codecs.encode"):
            _latin1_bytes("x", encoding)
    assert _empty_bytes() == b""
    with pytest.raises(Exception, match="bytes"):
        _empty_bytes(10**12)


def test_non_tensor_values_of_one_record_length_each_read_as_themselves() -> None:
    """Records of one length hold other values at the same place: where data.pkl is may be reused from
    one to the next, what it holds must not (see records._parsed)."""
    from reference.checkpoint.records import read_object_record

    values = [1.5, -2.5, float("inf"), 0.0, (0.9, 0.999), (0.8, 0.95), "adamw", "sgdxy"]
    saved = []
    for value in values:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        saved.append(buffer.getvalue())
    assert len({len(data) for data in saved[:4]}) == 1  # the floats share a length
    records._PARSED.clear()
    for _ in range(2):
        assert [read_object_record(data) for data in saved] == values


def test_tensor_bytes_are_64_byte_aligned_in_the_data_files_and_dcp_reads_them(tmp_path) -> None:
    """Records start at multiples of storage.RECORD_ALIGNMENT, so every tensor's bytes are 64-byte
    aligned in its file (a misaligned copy from the page cache is slower); the padding between records
    must not stop torch's own reader."""
    import torch.distributed.checkpoint as dcp

    from reference.checkpoint.storage import RECORD_ALIGNMENT

    source: dict[str, Any] = {
        "odd": torch.arange(7, dtype=torch.int8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "bf16": torch.arange(33, dtype=torch.bfloat16),
        "lr": 0.1,
        "w": torch.arange(12.0).reshape(3, 4),
        "name": "run-1",
    }
    save(source, checkpoint_id=tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, written a moment ago
    for index, info in metadata.storage_data.items():
        assert info.offset % RECORD_ALIGNMENT == 0, index.fqn
        if isinstance(source[index.fqn], torch.Tensor):
            with open(tmp_path / info.relative_path, "rb", buffering=0) as f:
                layout = parse_tensor_record(f, info.offset, info.length)
            assert layout is not None and layout.data_offset % 64 == 0, index.fqn
    target: dict[str, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in source.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it loads in one process
        dcp.load(target, checkpoint_id=str(tmp_path))
    for key, value in source.items():
        assert torch.equal(target[key], value) if isinstance(value, torch.Tensor) else target[key] == value, key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (no GPU visible)")
def test_threaded_save_and_load_of_gpu_tensors_on_a_device_that_is_not_the_threads_current(tmp_path) -> None:
    """Writer and reader threads start with cuda:0 as their current device, whatever GPU the rank's
    tensors are on: the copies to and from pinned memory must be waited for on the tensors' own
    device (with two or more GPUs, the tensors here are on the last one)."""
    from reference.checkpoint.storage import FileSystemReader, FileSystemWriter

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    generator = torch.Generator().manual_seed(2)
    source = {f"t{i}": torch.randn(1 << 20, generator=generator).to(device) for i in range(8)}  # 4 MiB each
    save(source, checkpoint_id=tmp_path, storage_writer=FileSystemWriter(thread_count=2))
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    load(target, checkpoint_id=tmp_path, storage_reader=FileSystemReader(thread_count=2))
    for key, value in source.items():
        assert target[key].device == device
        assert torch.equal(target[key].cpu().view(torch.uint8), value.cpu().view(torch.uint8)), key


# -- the files of earlier saves ----------------------------------------------------------------------


def _data_files(directory: Any) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(".distcp")}


def test_a_save_over_an_earlier_one_removes_its_files_after_publishing_without_waiting(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The removal of the earlier save's files runs after the save has returned: a save returns while
    the removal is held up, and the files go once it may proceed; the user's own files stay."""
    import threading
    from pathlib import Path

    from reference.checkpoint import wait_for_removals

    save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path)
    first = _data_files(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "__mine.bin").write_bytes(b"also mine")
    release, removing = threading.Event(), threading.Event()
    unlink = Path.unlink

    def held_unlink(path: Path, *args: Any, **kwargs: Any) -> None:
        removing.set()
        assert release.wait(30), "the test never released the removal"
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", held_unlink)
    try:
        save({"w": torch.arange(6.0) * 2}, checkpoint_id=tmp_path)  # returns though the removal is held
        assert removing.wait(30)
        assert first <= _data_files(tmp_path)  # not removed yet
        out = {"w": torch.zeros(6)}
        load(out, checkpoint_id=tmp_path)  # the new checkpoint loads meanwhile
        assert torch.equal(out["w"], torch.arange(6.0) * 2)
    finally:
        release.set()
        wait_for_removals()
    second = _data_files(tmp_path)
    assert second and not first & second, (first, second)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "__mine.bin").exists()


def test_files_of_an_earlier_save_that_cannot_be_removed_are_warned_about_and_removed_by_a_later_save(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    from reference.checkpoint import wait_for_removals

    save({"w": torch.ones(3)}, checkpoint_id=tmp_path)
    first = _data_files(tmp_path)
    unlink = Path.unlink

    def refused(path: Path, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "unlink", refused)
    with pytest.warns(RuntimeWarning, match=r"could not remove this file of an earlier save .*Permission denied"):
        save({"w": torch.ones(3) * 2}, checkpoint_id=tmp_path)  # the save itself succeeds
        wait_for_removals()
    assert first <= _data_files(tmp_path)
    monkeypatch.setattr(Path, "unlink", unlink)
    save({"w": torch.ones(3) * 3}, checkpoint_id=tmp_path)
    wait_for_removals()
    assert len(_data_files(tmp_path)) == 1 and not first & _data_files(tmp_path)
    out = {"w": torch.zeros(3)}
    load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], torch.ones(3) * 3)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_asked_globals_names_every_global_by_any_opcode(protocol: int) -> None:
    """GLOBAL (protocols 0-3) and STACK_GLOBAL with memoized strings (4, 5) name the same globals, in
    order, each once; an extension code is named through copyreg's registry."""
    import collections
    import copyreg

    from reference.checkpoint.records import asked_globals

    value = [collections.OrderedDict, collections.Counter, collections.OrderedDict, math.floor]
    assert asked_globals(pickle.dumps(value, protocol=protocol)) == ["collections.OrderedDict", "collections.Counter", "math.floor"]
    copyreg.add_extension("collections", "Counter", 0xF7)
    try:
        assert asked_globals(pickle.dumps(collections.Counter, protocol=2)) == ["collections.Counter (extension code 247)"]
    finally:
        copyreg.remove_extension("collections", "Counter", 0xF7)
