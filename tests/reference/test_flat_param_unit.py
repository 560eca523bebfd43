"""Unit tests of reference.flat_param internals (wrapper and prefix_hooks) (single process).

The behaviour every implementation owes is checked by conformance/test_flat_param.py; these tests pin
what is particular to the reference: the reusable prefix hooks (with a second wrapper kind), clean
names, the shard helper, metadata renaming, and recovery paths.
"""

from __future__ import annotations

import copy
import pickle
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from conformance import models
from reference.flat_param import (
    FlatParameter,
    FlattenParamsWrapper,
    ParamRange,
    ShardRange,
    even_shard_range,
)

# The frame stacks are the hooks' private hand-over state: these tests check that nothing is left in them.
from reference.flat_param.prefix_hooks import _LOAD_FRAMES, _save_frames, clean_named_modules, hidden_child, register_prefix_hooks


class CheckpointLike(nn.Module):
    """An activation-checkpoint wrapper: the second user of the prefix hooks."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module
        register_prefix_hooks(self, "_checkpoint_wrapped_module")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._checkpoint_wrapped_module, x, use_reentrant=False)


def _metadata(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The ``_metadata`` that ``nn.Module.state_dict`` sets on the dict it returns (torch's stubs type
    that dict as a plain one)."""
    metadata = getattr(state_dict, "_metadata", None)
    assert isinstance(metadata, dict), f"a state dict without _metadata: {type(state_dict).__name__}"
    return metadata


def _fpw_all(module: nn.Module) -> FlattenParamsWrapper:
    return FlattenParamsWrapper(module, list(module.parameters()))


def _mixed_wrappers(seed: int) -> nn.Module:
    """The nested zoo model with checkpoint and flatten wrappers interleaved."""
    model = models.build("nested", seed=seed)
    block = getattr(model, "1")
    block.inner = CheckpointLike(_fpw_all(block.inner))
    model.add_module("10", _fpw_all(CheckpointLike(getattr(model, "10"))))
    return CheckpointLike(model)


# -- the prefix hooks, on their own and mixed with FlattenParamsWrapper ---------------------------------


@pytest.mark.parametrize(
    "name, build",
    [("buffers", lambda s: CheckpointLike(models.build("buffers", seed=s))), ("nested", _mixed_wrappers)],
    ids=["checkpoint-buffers", "mixed-nested"],
)
def test_prefix_hooks_show_unwrapped_keys_and_metadata(name, build) -> None:
    plain, wrapped = models.build(name, seed=0), build(0)
    sd_plain, sd_wrapped = plain.state_dict(), wrapped.state_dict()
    assert list(sd_wrapped) == list(sd_plain)
    assert all(torch.equal(sd_wrapped[k], v) for k, v in sd_plain.items())
    assert list(_metadata(sd_wrapped)) == list(_metadata(sd_plain))
    x = models.batch(name)
    assert torch.equal(wrapped(x), plain(x))


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if not isinstance(p, FlatParameter)]


def _deep_wrappers(depth: int) -> tuple[nn.Module, nn.Module]:
    """(plain, wrapped): Sequential(Linear, Sequential(Linear, ...)) with every level wrapped."""
    plain: nn.Module = nn.Linear(2, 2)
    for _ in range(depth - 1):
        plain = nn.Sequential(nn.Linear(2, 2), plain)
    wrapped = copy.deepcopy(plain)
    level, parents = wrapped, []
    while isinstance(level, nn.Sequential):
        parents.append(level)
        level = level[1]
    for i, parent in enumerate(reversed(parents)):  # innermost first; alternate the two wrapper kinds
        inner = parent[1]
        parent[1] = CheckpointLike(inner) if i % 2 else FlattenParamsWrapper(inner, _own_params(inner))
    return plain, FlattenParamsWrapper(wrapped, _own_params(wrapped))


def test_nested_state_dict_renames_each_key_once_and_survives_errors() -> None:
    plain, wrapped = _deep_wrappers(6)
    sd = wrapped.state_dict()
    assert list(sd) == list(plain.state_dict()) and list(_metadata(sd)) == list(_metadata(plain.state_dict()))
    # A state_dict that raises inside the nesting leaves no state behind for the next call.
    deepest = [m for m in wrapped.modules() if isinstance(m, (FlattenParamsWrapper, CheckpointLike))][-1]
    handle = deepest.register_state_dict_pre_hook(lambda *_: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        wrapped.state_dict()
    handle.remove()
    assert list(wrapped.state_dict()) == list(sd)
    # A separate state_dict call from a hook inside the traversal gets its own clean keys.
    seen = []
    inner = wrapped.module[1]
    handle = wrapped.module[0].register_state_dict_post_hook(lambda *_: seen.append(list(inner.state_dict())))
    assert list(wrapped.state_dict()) == list(sd)
    assert seen == [list(plain[1].state_dict())]
    handle.remove()


class _Tolerant(nn.Module):
    """Saves what it can: a child whose state_dict raises is skipped (its error caught here, inside
    an enclosing wrapper's traversal, after the child's own wrapper pushed its frame)."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child
        self.scale = nn.Parameter(torch.ones(1))

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        try:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        except OSError:
            return destination


class _Exploding(nn.Linear):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        raise OSError("disk")


def test_error_caught_inside_the_traversal_leaves_keys_clean_and_no_frames() -> None:
    """A wrapper whose subtree raised, with the error caught by a module above it but still inside an
    enclosing wrapper: the enclosing wrapper finds its own frame below the stale one, renames what the
    nested wrappers left to it, and the thread's frame stack is empty afterwards."""
    def build(wrap: bool) -> nn.Module:
        torch.manual_seed(0)
        first, exploding = nn.Linear(2, 2), _Exploding(2, 2)
        body = nn.Sequential(
            CheckpointLike(first) if wrap else first,
            _Tolerant(CheckpointLike(exploding) if wrap else exploding),
        )
        return CheckpointLike(body) if wrap else body

    wrapped, plain = build(True), build(False)
    stale = len(_save_frames())  # frames an earlier, uncaught error left (the next calls step over them)
    for _ in range(2):  # the second call sees whatever the first one left behind
        assert list(wrapped.state_dict()) == list(plain.state_dict()) == ["0.weight", "0.bias", "1.scale"]
        assert len(_save_frames()) == stale, "state_dict left frames behind"


def test_state_dict_and_load_leave_no_frames_behind() -> None:
    plain, wrapped = _deep_wrappers(4)
    stale = len(_save_frames())  # frames an earlier, uncaught error left (the next calls step over them)
    for _ in range(3):
        wrapped.load_state_dict(wrapped.state_dict())
    assert len(_save_frames()) == stale and not any(_LOAD_FRAMES.get(m) for m in wrapped.modules())


def test_prefix_hooks_load_both_ways_and_name_keys() -> None:
    wrapped = _mixed_wrappers(0)
    source = models.build("nested", seed=1)
    wrapped.load_state_dict(source.state_dict())
    assert all(torch.equal(wrapped.state_dict()[k], v) for k, v in source.state_dict().items())
    back = models.build("nested", seed=2)
    back.load_state_dict(_mixed_wrappers(3).state_dict())
    assert all(torch.equal(back.state_dict()[k], v) for k, v in models.build("nested", seed=3).state_dict().items())
    partial = dict(source.state_dict())
    del partial["10.proj.bias"]
    partial["1.inner.surplus"] = torch.zeros(1)
    result = wrapped.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["10.proj.bias"] and result.unexpected_keys == ["1.inner.surplus"]


def test_size_mismatch_message_names_the_unwrapped_key() -> None:
    wrapped = nn.ModuleDict({"m": CheckpointLike(models.build("buffers"))})
    sd = dict(wrapped.state_dict())
    sd["m.norm.running_mean"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"size mismatch for m\.norm\.running_mean:") as info:
        wrapped.load_state_dict(sd)
    assert "_checkpoint_wrapped_module" not in str(info.value)


def test_wrapper_own_entries_keep_their_keys_and_collisions_are_named() -> None:
    class WithOwnBuffer(CheckpointLike):
        def __init__(self, module: nn.Module) -> None:
            super().__init__(module)
            self.register_buffer("calls", torch.zeros(()))

    wrapped = WithOwnBuffer(nn.Linear(2, 2))
    assert list(wrapped.state_dict()) == ["calls", "weight", "bias"]
    wrapped.load_state_dict({"calls": torch.ones(()), "weight": torch.ones(2, 2), "bias": torch.ones(2)})
    assert wrapped.get_buffer("calls").item() == 1.0 and bool((wrapped._checkpoint_wrapped_module.weight == 1).all())
    clash = WithOwnBuffer(nn.Module())
    clash._checkpoint_wrapped_module.register_buffer("calls", torch.zeros(()))
    with pytest.raises(RuntimeError, match="'calls' is written twice"):
        clash.state_dict()


def test_register_prefix_hooks_checks_input_and_removes() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        register_prefix_hooks(object(), "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one path segment"):
        register_prefix_hooks(nn.Module(), "a.b")
    wrapped = CheckpointLike(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already hides"):
        register_prefix_hooks(wrapped, "other")
    module = nn.Module()
    module.inner = nn.Linear(2, 2)
    handles = register_prefix_hooks(module, "inner")
    assert list(module.state_dict()) == ["weight", "bias"]
    handles.remove()
    assert list(module.state_dict()) == ["inner.weight", "inner.bias"]


def test_clean_named_modules_drops_hidden_segments() -> None:
    wrapped = _mixed_wrappers(0)
    paths = [p for p, _ in clean_named_modules(wrapped)]
    assert paths[:3] == ["", "", "1"]  # the outer wrapper and the model share the root path
    assert "1.inner.0" in paths and "10.proj" in paths
    assert not any("_fpw_module" in p or "_checkpoint_wrapped_module" in p for p in paths)
    assert hidden_child(wrapped) == "_checkpoint_wrapped_module" and hidden_child(nn.Linear(1, 1)) is None


def test_wrappers_pickle_and_deepcopy_with_their_hooks() -> None:
    wrapped = _mixed_wrappers(0)
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert list(clone.state_dict()) == list(models.build("nested").state_dict())


# -- FlatParameter details -----------------------------------------------------------------------------


def test_flat_param_metadata_and_offsets() -> None:
    flat = FlatParameter([torch.zeros(2, 3), torch.zeros(0), torch.zeros(4)], names=["a", "empty", "b"])
    assert flat.param_names == ("a", "empty", "b") and flat.full_numel == 10
    assert flat.param_offsets == (ParamRange(0, 5), ParamRange(6, 5), ParamRange(6, 9))
    flat.shard_by_offsets(4, 7, 0)
    meta = flat.shard_metadata()
    assert meta.param_names == ("a", "b") and meta.param_offsets == (ParamRange(4, 5), ParamRange(0, 1))
    assert flat.shard_range == ShardRange(4, 7, 0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"names": ["a"]}, ValueError, "2 params"),
        ({"names": ["a", "a"]}, ValueError, "unique"),
        ({"names": "ab"}, TypeError, "sequence of str"),
    ],
)
def test_flat_param_names_are_checked(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        FlatParameter([torch.zeros(1), torch.zeros(2)], **kwargs)


def test_flat_param_copies_keep_metadata_and_shard() -> None:
    flat = FlatParameter([torch.randn(3), torch.randn(2, 2)], names=["x", "y"])
    flat.shard_by_offsets(4, 7, 1)
    for clone in (copy.deepcopy(flat), pickle.loads(pickle.dumps(flat))):
        assert isinstance(clone, FlatParameter) and torch.equal(clone, flat)
        assert clone.metadata() == flat.metadata() and clone.shard_metadata() == flat.shard_metadata()
        assert clone.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("numel", [1, 4, 6, 10, 241])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_even_shard_range_tiles_the_padded_flat_param(numel: int, world_size: int) -> None:
    shards = [even_shard_range(numel, r, world_size) for r in range(world_size)]
    sizes = {s.end - s.start + 1 for s in shards}
    assert len(sizes) == 1, "shards differ in size"
    assert shards[0].start == 0 and all(a.end + 1 == b.start for a, b in zip(shards, shards[1:]))
    assert sum(s.end - s.start + 1 - s.num_padded for s in shards) == numel
    flat = FlatParameter([torch.zeros(numel)])
    for s in shards:
        flat.shard_by_offsets(*s)  # consistent with shard_by_offsets' padding rule


def test_even_shard_range_checks_input() -> None:
    with pytest.raises(ValueError, match="rank"):
        even_shard_range(10, 4, 4)
    with pytest.raises(TypeError, match="world_size"):
        even_shard_range(10, 0, 2.0)  # type: ignore[arg-type]


def _spans_module(spans: list[tuple[int, int]]) -> nn.Module:
    """Parameters ``p0``, ``p1``, ... over the element ranges ``[a, b)`` of one 64-element storage."""
    storage = torch.arange(64.0)
    module = nn.Module()
    for i, (a, b) in enumerate(spans):
        module.register_parameter(f"p{i}", nn.Parameter(storage[a:b]))
    return module


def test_storage_tie_found_behind_a_nearer_unlisted_span() -> None:
    """The listed ``p2`` over [40, 45) overlaps ``p0`` over [0, 50) only: ``p1`` over [10, 20) starts
    nearer but ends before it."""
    module = _spans_module([(0, 50), (10, 20), (40, 45)])
    with pytest.raises(ValueError, match="'p2' shares memory with 'p0'"):
        FlattenParamsWrapper(module, [module.get_parameter("p2")])


@pytest.mark.parametrize("seed", range(30))
def test_storage_tie_check_matches_pairwise_overlap(seed: int) -> None:
    """The tie check (sorted spans, one binary search per listed parameter) refuses exactly the
    listings where some listed range overlaps some unlisted one, and names such a pair."""
    gen = torch.Generator().manual_seed(seed)
    spans = []
    for _ in range(int(torch.randint(2, 9, (1,), generator=gen))):
        a = int(torch.randint(0, 60, (1,), generator=gen))
        spans.append((a, a + int(torch.randint(1, 64 - a + 1, (1,), generator=gen))))
    listed = [i for i in range(len(spans)) if torch.rand(1, generator=gen) < 0.4] or [0]
    overlapping = {
        (f"p{i}", f"p{j}")
        for i in listed
        for j in range(len(spans))
        if j not in listed and spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]
    }
    module = _spans_module(spans)
    params = [getattr(module, f"p{i}") for i in listed]
    if not overlapping:
        FlattenParamsWrapper(module, params)
        return
    with pytest.raises(ValueError, match="shares memory") as info:
        FlattenParamsWrapper(module, params)
    named = re.search(r"listed parameter '(p\d+)' shares memory with '(p\d+)'", str(info.value))
    assert named is not None and named.groups() in overlapping, f"{info.value} (spans {spans}, listed {listed})"


# -- FlattenParamsWrapper recovery paths and details -----------------------------------------------------


def test_state_dict_keep_vars_and_no_flat_key() -> None:
    wrapped = _fpw_all(models.build("mlp"))
    sd = wrapped.state_dict(keep_vars=True)
    assert all(isinstance(v, nn.Parameter) for v in sd.values())
    assert sd["net.0.weight"].untyped_storage().data_ptr() == wrapped.flat_param.untyped_storage().data_ptr()
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param"]


def test_load_with_assign_writes_into_flat_param() -> None:
    wrapped = _fpw_all(models.build("mlp"))
    source = models.build("mlp", seed=1).state_dict()
    wrapped.load_state_dict(source, assign=True)
    assert isinstance(wrapped.flat_param, FlatParameter)
    assert all(torch.equal(wrapped.state_dict()[k], v) for k, v in source.items())


def test_interrupted_nested_load_reflattens_on_next_use() -> None:
    class Exploding(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):
            raise KeyError("boom")

    inner = nn.Sequential(nn.Linear(2, 2), Exploding(2, 2))
    wrapped = FlattenParamsWrapper(inner, _own_params(inner))
    parent = nn.ModuleDict({"w": wrapped})
    with pytest.raises(KeyError, match="boom"):
        parent.load_state_dict(parent.state_dict())
    assert [n for n, _ in wrapped.named_parameters(recurse=False)] == []  # still unflattened here
    wrapped(torch.ones(1, 2))
    assert [n for n, _ in wrapped.named_parameters(recurse=False)] == ["flat_param"]


def test_reflatten_reports_a_deleted_param_and_stays_usable() -> None:
    wrapped = _fpw_all(models.build("mlp"))
    with pytest.raises(RuntimeError, match="'net.2.bias' was removed"):
        with wrapped.unflatten_params():
            del wrapped.module.net[2].bias
    assert [n for n, _ in wrapped.named_parameters()] == ["flat_param"]
    assert wrapped.module.net[2].bias.shape == (15,)


def test_to_inside_unflatten_params_keeps_values() -> None:
    plain, wrapped = models.build("mlp"), _fpw_all(models.build("mlp"))
    with wrapped.unflatten_params():
        wrapped.double()
        assert wrapped.flat_param.dtype == torch.float64
    plain.double()
    x = models.batch("mlp").double()
    assert torch.equal(wrapped(x), plain(x))


def test_param_order_restored_when_only_some_params_of_a_module_are_listed() -> None:
    layer = nn.Linear(3, 3)
    wrapped = FlattenParamsWrapper(layer, [layer.get_parameter("weight")])
    assert list(wrapped.state_dict()) == ["weight", "bias"]
    with wrapped.unflatten_params():
        assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]


def test_shared_submodule_at_two_paths() -> None:
    shared = nn.Linear(2, 2)
    plain = nn.ModuleDict({"a": shared, "b": shared})
    wrapped = _fpw_all(copy.deepcopy(plain))
    assert wrapped.flat_param.param_names == ("a.weight", "a.bias")
    assert list(wrapped.state_dict()) == list(plain.state_dict()) == ["a.weight", "a.bias", "b.weight", "b.bias"]


def test_repr_mentions_the_flat_param() -> None:
    assert "flat_param: 6 params, 241 elements" in repr(_fpw_all(models.build("mlp")))
    assert "flat_param=None" in repr(FlattenParamsWrapper(nn.Linear(1, 1), []))


# -- what the wrapped modules see during state_dict / load_state_dict ----------------------------------


class Legacy(nn.Linear):
    """A module whose own state_dict code relies on its registered parameters (as version migrations do)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.seen: list[tuple[str, ...]] = []
        self.register_state_dict_post_hook(Legacy._record)

    @staticmethod
    def _record(module: Legacy, destination: dict, prefix: str, local_metadata: dict) -> None:
        # The unwrapped module's own post-hook sees its parameters registered and its keys written.
        assert all(isinstance(p, nn.Parameter) for p in module._parameters.values())
        module.seen.append(tuple(k[len(prefix):] for k in destination if k.startswith(prefix)))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        if local_metadata.get("version", 1) < 2 and prefix + "w" in state_dict:  # version 1 called it "w"
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")
        assert [n for n, _ in self.named_parameters(recurse=False)] == ["weight", "bias"]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)


def test_wrapped_modules_see_registered_parameters_in_state_dict_and_load() -> None:
    plain = nn.Sequential(Legacy(), nn.ReLU())
    wrapped = _fpw_all(copy.deepcopy(plain))
    assert list(wrapped.state_dict()) == list(plain.state_dict()) == ["0.weight", "0.bias"]
    assert wrapped.module[0].seen == plain[0].seen == [("weight", "bias")]
    # A version-1 checkpoint: the module's own _load_from_state_dict renames the key.
    old = plain.state_dict()
    old["0.w"] = torch.full((2, 3), 7.0)
    del old["0.weight"]
    _metadata(old)["0"]["version"] = 1
    wrapped.load_state_dict(old)
    assert torch.equal(wrapped.flat_param[:6], torch.full((6,), 7.0))


def test_state_dict_parameters_do_not_leak_between_calls() -> None:
    wrapped = _fpw_all(models.build("mlp"))
    first = wrapped.state_dict(keep_vars=True)
    first["net.0.weight"].requires_grad_(False)
    second = wrapped.state_dict(keep_vars=True)
    assert second["net.0.weight"] is not first["net.0.weight"] and second["net.0.weight"].requires_grad
    with wrapped.unflatten_params():
        inside = wrapped.module.net[0].weight
    wrapped.state_dict()
    with wrapped.unflatten_params():
        assert wrapped.module.net[0].weight is not inside


@pytest.mark.parametrize("change", ["data", "requires_grad", "to"])
def test_state_dict_follows_flat_param_changes(change: str) -> None:
    wrapped = _fpw_all(models.build("mlp"))
    wrapped.state_dict()  # leaves Parameters to reuse
    if change == "data":
        wrapped.flat_param.data = torch.arange(wrapped.flat_param.numel(), dtype=torch.float32)
    elif change == "requires_grad":
        wrapped.flat_param.requires_grad_(False)
    else:
        wrapped.double()
    sd = wrapped.state_dict(keep_vars=True)
    flat = wrapped.flat_param
    assert torch.equal(torch.cat([v.reshape(-1) for v in sd.values()]), flat.detach())
    assert all(v.requires_grad == flat.requires_grad and v.dtype == flat.dtype for v in sd.values())
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in sd.values())


def test_parameters_and_buffers_registered_as_none_are_skipped_and_keep_their_place() -> None:
    """A name registered as None is no tensor to flatten or to check for ties, and keeps its place."""
    module = nn.Linear(2, 2)
    module.register_parameter("absent", None)
    module.register_buffer("no_buffer", None)
    expected = list(module.state_dict())
    order = list(module._parameters)
    wrapped = FlattenParamsWrapper(module, list(module.parameters()))
    assert list(wrapped.state_dict()) == expected
    with wrapped.unflatten_params():
        assert list(module._parameters) == order
