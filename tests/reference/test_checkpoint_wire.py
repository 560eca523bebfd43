"""``reference.checkpoint.wire``: a save's plans, write results and metadata, pickled compactly, come back as
the same objects field for field (types and index hints included, which ``==`` does not compare), and
anything the compact form does not know exactly pickles as it is."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from reference.checkpoint import wire
from reference.checkpoint.metadata_io import StorageInfo
from reference.checkpoint.planner import ReferenceSavePlanner

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64, torch.float8_e4m3fn]


def _exact(value: Any) -> Any:
    """``value`` as nested tuples that name every type and hold every field, compare=False ones too."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((f.name, _exact(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_exact(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, _exact(v)) for k, v in value.items()))
    return (type(value), value)


def _values_of_their_own(cls: type) -> Any:
    """A value per field of the dataclass ``cls``, each naming its field (types are not checked)."""
    return [f"field {f.name}" for f in dataclasses.fields(cls)]


def _sent(value: Any) -> Any:
    return pickle.loads(pickle.dumps(wire.Compact(value)))


def _reference_plan() -> SavePlan:
    """The reference planner's global plan of a state dict of every dtype, a 0-d and an empty tensor,
    a parameter that requires grad, and non-tensor values (with index hints set)."""
    state_dict: dict[str, Any] = {f"t.{dtype}".replace("torch.", ""): torch.zeros(3, 2, dtype=dtype) for dtype in DTYPES}
    state_dict.update(scalar=torch.tensor(1.5), empty=torch.zeros(0, 4), weight=torch.nn.Parameter(torch.ones(2)),
                      step=7, groups=[{"lr": 0.1, "params": [0, 1]}])
    planner = ReferenceSavePlanner()
    planner.set_up_planner(state_dict, None, True)
    (plan,), _ = planner.create_global_plan([planner.create_local_plan()])
    return plan


def _shard(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...], *, hint: int | None,
           dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, offsets, hint),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype, requires_grad=requires_grad),
            size=torch.Size(size),
        ),
    )


def _sharded_plan() -> SavePlan:
    return SavePlan(
        [_shard("w", (2, 0), (2, 3), (4, 3), hint=1, dtype=torch.bfloat16, requires_grad=True),
         _shard("w", (0, 0), (2, 3), (4, 3), hint=None),
         WriteItem(index=MetadataIndex("opt", None, 5), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(17)),
         WriteItem(index=MetadataIndex("bare"), type=WriteItemType.BYTE_IO)],
        storage_data="__1_abc_",
        planner_data={"paths": {"w": ("model", "w")}},
        usable=False,
    )


@pytest.mark.parametrize("make_plan", [_reference_plan, _sharded_plan], ids=["reference planner", "sharded, by hand"])
def test_a_plan_travels_compactly_and_comes_back_field_for_field(make_plan: Any) -> None:
    plan = make_plan()
    assert wire.Compact(plan).__reduce__()[0] is wire._unpack_plan  # the compact form is taken
    back = _sent(plan)
    assert back == plan
    assert _exact(back) == _exact(plan)
    assert [item.index.index for item in back.items] == [item.index.index for item in plan.items]
    if make_plan is _reference_plan:
        assert [item.index.index for item in back.items if item.tensor_data] == [0] * len(DTYPES + ["scalar", "empty", "weight"])
        assert {item.tensor_data.properties.dtype for item in back.items if item.tensor_data} >= set(DTYPES)
    props = [item.tensor_data.properties for item in back.items if item.tensor_data is not None]
    assert len({id(p) for p in props}) == len(props), "items came back sharing one TensorProperties"
    assert len(pickle.dumps(wire.Compact(plan))) < len(pickle.dumps(plan))


def test_write_results_travel_compactly_and_come_back_field_for_field() -> None:
    results = [
        WriteResult(index=MetadataIndex("w", (2, 0), 1), size_in_bytes=960,
                    storage_data=StorageInfo("__1_abc_0.distcp", 128, 960)),
        WriteResult(index=MetadataIndex("opt"), size_in_bytes=17, storage_data=StorageInfo("__1_abc_0.distcp", 1088, 17)),
        # every field of this torch's StorageInfo, whatever they are, set to a value of its own
        WriteResult(index=MetadataIndex("b", (3,), 0), size_in_bytes=8, storage_data=StorageInfo(
            *_values_of_their_own(StorageInfo))),
    ]
    assert wire.Compact(results).__reduce__()[0] is wire._unpack_results
    back = _sent(results)
    assert _exact(back) == _exact(results)
    assert _sent([]) == []


def _reference_metadata(tmp_path: Any) -> Metadata:
    """What the reference's save returns for the state dict of :func:`_reference_plan` (every field set
    by a real save: storage entries, planner data, storage meta, version)."""
    from reference.checkpoint import save

    state_dict: dict[str, Any] = {f"t.{dtype}".replace("torch.", ""): torch.zeros(3, 2, dtype=dtype) for dtype in DTYPES}
    state_dict.update(scalar=torch.tensor(1.5), empty=torch.zeros(0, 4), weight=torch.nn.Parameter(torch.ones(2)),
                      step=7, groups=[{"lr": 0.1, "params": [0, 1]}])
    return save(state_dict, checkpoint_id=tmp_path / "ckpt")


def _sharded_metadata() -> Metadata:
    """Metadata of a tensor saved as two shards of two ranks (one property set per key, in an order that
    is not sorted), a non-tensor value, storage entries with and without offsets and hints, and every
    field of this torch's StorageInfo set."""
    bf16 = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(bf16, torch.Size([4, 3]), [
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))]),
            "opt": BytesStorageMetadata(),
            "b": TensorStorageMetadata(TensorProperties(dtype=torch.int8), torch.Size([0]), []),
        },
        planner_data={"w": ("model", "w")},
        storage_data={
            MetadataIndex("w", (2, 0), 0): StorageInfo("__1_0.distcp", 64, 96),
            MetadataIndex("w", (0, 0), 1): StorageInfo("__0_0.distcp", 64, 96),
            MetadataIndex("opt"): StorageInfo(*_values_of_their_own(StorageInfo)),
        },
        storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="s1"),
        version="1.0.0",
    )


@pytest.mark.parametrize("source", ["reference save", "sharded, by hand"])
def test_metadata_travels_compactly_and_comes_back_field_for_field(source: str, tmp_path: Any) -> None:
    metadata = _reference_metadata(tmp_path) if source == "reference save" else _sharded_metadata()
    assert wire.Compact(metadata).__reduce__()[0] is wire._unpack_metadata  # the compact form is taken
    back = _sent(metadata)
    assert back == metadata
    assert _exact(back) == _exact(metadata)  # key order, types, index hints and every field
    assert list(back.storage_data) == list(metadata.storage_data)
    assert [i.index for i in back.storage_data] == [i.index for i in metadata.storage_data]
    props = [md.properties for md in back.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
    assert len({id(p) for p in props}) == len(props), "keys came back sharing one TensorProperties"
    assert len(pickle.dumps(wire.Compact(metadata))) < len(pickle.dumps(metadata))


def _with_entry(key: str, entry: Any) -> Metadata:
    metadata = _sharded_metadata()
    metadata.state_dict_metadata[key] = entry
    return metadata


#: offsets and sizes as plain tuples, where DCP's types say torch.Size (a planner of its own may)
_TUPLES: Any = ((0, 0), (2, 3))
_TUPLE_SIZE: Any = (4,)


def _subclassed_item() -> SavePlan:
    class Item(WriteItem):
        pass

    item = _sharded_plan().items[0]
    return SavePlan([Item(index=item.index, type=item.type, tensor_data=item.tensor_data)])


@pytest.mark.parametrize("value, why", [
    (SavePlan([dataclasses.replace(_sharded_plan().items[0], tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(*_TUPLES), properties=TensorProperties(dtype=torch.float32),
        size=torch.Size([4, 3])))]), "tuples where torch.Size was"),
    ([WriteResult(index=MetadataIndex("w"), size_in_bytes=1, storage_data={"uri": "s3://b/k"})], "a writer's own storage_data"),
    (["not a result"], "a list of something else"),
    ({"plan": 1}, "another value"),
    (_with_entry("w", TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                            [ChunkStorageMetadata(*_TUPLES)])), "metadata: tuples where torch.Size was"),
    (_with_entry("w", TensorStorageMetadata(TensorProperties(dtype=torch.float32), _TUPLE_SIZE, [])), "metadata: a tuple size"),
    (_with_entry("w", "an entry of a planner's own"), "metadata: an entry of another type"),
    (dataclasses.replace(_sharded_metadata(), storage_data={MetadataIndex("w"): {"uri": "s3://b/k"}}),
     "metadata: a writer's own storage_data"),
    (dataclasses.replace(_sharded_metadata(), storage_data=None), "metadata: no storage_data"),
], ids=["tuple offsets", "foreign storage_data", "other list", "other value", "metadata tuple offsets",
        "metadata tuple size", "metadata foreign entry", "metadata foreign storage_data", "metadata without storage_data"])
def test_what_the_compact_form_does_not_know_exactly_pickles_as_it_is(value: Any, why: str) -> None:
    assert wire.Compact(value).__reduce__()[0] is wire._same, why
    assert _exact(_sent(value)) == _exact(value), why


def test_a_subclassed_item_pickles_as_it_is() -> None:
    plan = _subclassed_item()
    assert wire.Compact(plan).__reduce__()[0] is wire._same
    assert wire.pack_items(plan.items) is None


@dataclasses.dataclass(frozen=True)
class _PlanOfAPlanner(SavePlan):
    """A planner's own plan type, with a field ``dataclasses.replace`` cannot set."""

    note: str = dataclasses.field(default="mine", init=False)


def test_a_plan_of_another_type_pickles_as_it_is() -> None:
    plan = _PlanOfAPlanner(_sharded_plan().items)
    assert wire.Compact(plan).__reduce__()[0] is wire._same
    assert _exact(_sent(plan)) == _exact(plan)


def test_with_dataclasses_of_other_fields_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another torch whose classes have other fields: values pickle as they are, never lossily."""
    monkeypatch.setattr(wire, "_KNOWN_FIELDS", False)
    for value in (_sharded_plan(), _sharded_metadata()):
        assert wire.Compact(value).__reduce__()[0] is wire._same
        assert _exact(_sent(value)) == _exact(value)


def test_unwrap_gives_the_value_whether_or_not_it_was_pickled() -> None:
    plan = _sharded_plan()
    assert wire.unwrap(wire.Compact(plan)) is plan  # one rank: nothing pickled
    assert _exact(wire.unwrap(_sent(plan))) == _exact(plan)
