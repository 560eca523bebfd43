"""Unit tests of conformance/real_models.py, one process: builders, batches, units, the flat-parameter oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.real_models import (
    DTYPE,
    GLOBAL_BATCH,
    MISSING,
    REAL_MODELS,
    adamw,
    give_flat_parameter_grads,
    parameter_units,
    rank_slice,
    weight_decay_groups,
)

needs_transformers = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def test_the_zoo_is_defined_by_name() -> None:
    """The names are there with or without transformers (tests parametrize over them and then skip)."""
    assert list(REAL_MODELS) == ["gpt2", "llama", "llama-tied", "bert", "t5", "mixtral", "switch", "vit", "passthrough", "shared", "reused", "routed"]
    assert [n for n, real in REAL_MODELS.items() if not real.needs_transformers] == ["passthrough", "shared", "reused", "routed"]
    assert all(real.name == name for name, real in REAL_MODELS.items())


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_transformers) if r.needs_transformers else n for n, r in REAL_MODELS.items()])
def test_builder_is_deterministic_per_seed_and_seeds_differ(name: str) -> None:
    real = REAL_MODELS[name]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first, again, other = real.build(0), real.build(0), real.build(1)
    assert torch.equal(torch.random.get_rng_state(), before), "build() changed the global RNG"
    a, b, c = first.state_dict(), again.state_dict(), other.state_dict()
    assert list(a) == list(b) == list(c)
    assert all(torch.equal(a[k], b[k]) for k in a), "two builds of one seed differ"
    # Every randomly initialised parameter differs; constant ones (norm weights of ones, zero biases) cannot.
    random = [k for k, p in first.named_parameters() if p.unique().numel() > 1]
    assert len(random) >= 3
    same = [k for k in random if torch.equal(a[k], c[k])]
    assert not same, f"seeds 0 and 1 give equal values for {same}"
    assert {p.dtype for p in first.parameters()} == {DTYPE}


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_transformers) if r.needs_transformers else n for n, r in REAL_MODELS.items()])
def test_declared_ties_and_non_persistent_buffers_are_the_models(name: str) -> None:
    """``tied`` lists exactly the parameters held under several names; ``non_persistent`` exactly the
    buffers that no state dict has."""
    real = REAL_MODELS[name]
    model = real.build(0)
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    ties = sorted(tuple(group) for group in names.values() if len(group) > 1)
    assert ties == sorted(real.tied)
    state = model.state_dict()
    assert all(key in state for group in real.tied for key in group)
    assert sorted(n for n, _ in model.named_buffers() if n not in state) == sorted(real.non_persistent)


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_transformers) if r.needs_transformers else n for n, r in REAL_MODELS.items()])
def test_every_model_trains_and_its_units_are_its_blocks(name: str) -> None:
    real = REAL_MODELS[name]
    model = real.build(0)
    units = set(parameter_units(model, real.unit_classes).values())
    blocks = {path for path, module in model.named_modules() if isinstance(module, real.unit_classes)}
    assert len(blocks) >= 1 and units == blocks | {""}
    loss = real.loss(model, real.batch(0, GLOBAL_BATCH))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_batches_are_deterministic_and_rank_slices_cover_them(name: str) -> None:
    real = REAL_MODELS[name]
    batch = real.batch(3, GLOBAL_BATCH)
    again, other = real.batch(3, GLOBAL_BATCH), real.batch(4, GLOBAL_BATCH)
    assert list(batch) == list(again) and all(torch.equal(batch[k], again[k]) for k in batch)
    assert any(not torch.equal(batch[k], other[k]) for k in batch)
    assert {v.shape[0] for v in batch.values()} == {GLOBAL_BATCH}
    for world_size in (1, 2, 4):
        slices = [rank_slice(batch, rank, world_size) for rank in range(world_size)]
        for key, value in batch.items():
            pieces = [s[key] for s in slices]
            assert {p.shape[0] for p in pieces} == {GLOBAL_BATCH // world_size}
            assert torch.equal(torch.cat(pieces), value)


def test_rank_slice_refuses_a_batch_that_does_not_split_evenly() -> None:
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        rank_slice({"x": torch.zeros(4, 2)}, 0, 3)


# -- the flat-parameter oracle, on a small model of blocks whose experts may go unused ------------------------------


class Expert(nn.Linear):
    pass


class Block(nn.Module):
    """A norm and two experts; ``use`` picks the experts the forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.experts = nn.ModuleList([Expert(3, 3), Expert(3, 3)])
        self.use: tuple[int, ...] = (0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return x + sum((self.experts[i](x) for i in self.use), torch.zeros_like(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 3)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.spare = nn.Linear(3, 3)  # in the root unit, never used
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def route(self, block: int, experts: tuple[int, ...]) -> None:
        """Block ``block`` calls only ``experts`` from now on."""
        target = self.blocks[block]
        assert isinstance(target, Block)
        target.use = experts


def test_parameter_units_are_the_innermost_enclosing_blocks() -> None:
    units = parameter_units(Net(), (Block,))
    assert units["embed.weight"] == units["spare.bias"] == units["head.weight"] == ""
    assert units["blocks.0.norm.weight"] == units["blocks.0.experts.1.bias"] == "blocks.0"
    assert units["blocks.1.experts.0.weight"] == "blocks.1"
    # Nested units: an expert that is a unit of its own is not its block's.
    nested = parameter_units(Net(), (Block, Expert))
    assert nested["blocks.0.experts.1.weight"] == "blocks.0.experts.1" and nested["blocks.0.norm.bias"] == "blocks.0"


def test_flat_parameter_oracle_gives_zeros_exactly_where_a_flat_parameter_would() -> None:
    torch.manual_seed(0)
    model = Net()
    model.route(0, (0,))  # expert 1 of block 0 idle: its block has gradients
    model.route(1, (1,))
    model.blocks[1].requires_grad_(False)
    model.blocks[1].experts[1].requires_grad_(True)
    model(torch.randn(4, 3)).sum().backward()
    grads = {fqn: p.grad for fqn, p in model.named_parameters()}
    filled = give_flat_parameter_grads(model, (Block,))
    # In units with a gradient: every trainable parameter without one (block 0's idle expert; the root's
    # unused `spare`). Frozen parameters stay without (block 1's norm and expert 0).
    assert filled == ["blocks.0.experts.1.weight", "blocks.0.experts.1.bias", "spare.weight", "spare.bias"]
    for fqn, param in model.named_parameters():
        if fqn in filled:
            assert param.grad is not None and torch.equal(param.grad, torch.zeros_like(param))
        else:
            assert param.grad is grads[fqn], f"{fqn}: its gradient was replaced"
    assert model.blocks[1].norm.weight.grad is None and model.blocks[1].experts[0].weight.grad is None


def test_flat_parameter_oracle_leaves_a_unit_without_gradients_alone() -> None:
    model = Net()
    model.head(model.embed(torch.randn(2, 3))).sum().backward()  # the blocks take no part
    filled = give_flat_parameter_grads(model, (Block,))
    assert filled == ["spare.weight", "spare.bias"]
    assert all(p.grad is None for p in model.blocks.parameters())


def test_flat_parameter_oracle_steps_an_idle_parameter_as_adamw_steps_zeros() -> None:
    """AdamW decays a parameter whose gradient is zeros and creates its state; without a gradient it
    skips it: the difference the flat-parameter oracle makes."""
    model = Net()
    model.route(0, (0,))
    idle = model.blocks[0].experts[1].weight
    before = idle.detach().clone()
    decay = weight_decay_groups(model, (Block,), by_unit=False)
    optim = adamw([((fqn,), p) for fqn, p in model.named_parameters()], decay)
    model(torch.randn(4, 3)).sum().backward()
    give_flat_parameter_grads(model, (Block,))
    optim.step()
    lr, weight_decay = optim.param_groups[0]["lr"], optim.param_groups[0]["weight_decay"]
    assert torch.equal(idle.detach(), before * (1 - lr * weight_decay))
    assert set(optim.state[idle]) == {"step", "exp_avg", "exp_avg_sq"}


def test_weight_decay_groups_by_dimension_or_by_unit() -> None:
    model = Net()
    by_dim = weight_decay_groups(model, (Block,), by_unit=False)
    assert by_dim["embed.weight"] and by_dim["blocks.0.experts.0.weight"]
    assert not by_dim["embed.bias"] and not by_dim["blocks.0.norm.weight"]
    by_unit = weight_decay_groups(model, (Block,), by_unit=True)
    assert not by_unit["embed.weight"] and not by_unit["head.bias"]
    assert by_unit["blocks.0.norm.weight"] and by_unit["blocks.1.experts.1.bias"]


def test_adamw_refuses_a_parameter_that_spans_both_groups() -> None:
    model = Net()
    decay = weight_decay_groups(model, (Block,), by_unit=False)
    flat = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"falls in 2 weight-decay groups"):
        adamw([(("embed.weight", "embed.bias"), flat)], decay)
    optim = adamw([((fqn,), p) for fqn, p in model.named_parameters()], decay)
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]
