"""The model zoo: small, deterministic models of the shapes that break state_dict code.

Every model takes one tensor (``batch(name)``) and returns one tensor; ``loss`` turns that into a
scalar. Sizes are deliberately awkward: nothing divides by 4, so shards are uneven at every world size.

=========  =====================================================================================
name       what it exercises
=========  =====================================================================================
mlp        uneven layer sizes 5 -> 10 -> 15 -> 1 (the tensor-parallel test's shape)
tied       an embedding tied to the output head: one parameter, two FQNs
frozen     a frozen first layer (requires_grad=False) in its own submodule, trainable rest
buffers    persistent float buffer, non-persistent buffer, BatchNorm's int64 num_batches_tracked
nested     submodules named ``1`` and ``10`` (one name a prefix of the other), nesting 3 deep
groups     LayerNorm + linears, for several optimizer param groups with different hyperparameters
tiny       a 6-element weight and a 1-element bias: at 4 ranks some shards are empty
dtypes     float64 parameters (values float32 cannot hold) and one persistent buffer per dtype of
           :data:`conformance.values.EDGE_DTYPES` holding its edge values (NaN payloads, -0.0, inf,
           int64 beyond 2**53, ...), permuted by the seed
=========  =====================================================================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from conformance.asserts import bits
from conformance.values import EDGE_DTYPES, edge_values

__all__ = ["ZOO", "build", "batch", "loss", "param_groups", "train_step", "fingerprint"]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 15), nn.ReLU(), nn.Linear(15, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Tied(nn.Module):
    VOCAB = 11

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: state_dict lists it under both FQNs

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(5, 7)
        self.stem.requires_grad_(False)
        self.body = nn.Linear(7, 9)
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 6)
        self.norm = nn.BatchNorm1d(6)  # running_mean/var (float) and num_batches_tracked (int64)
        self.head = nn.Linear(6, 3)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 3))  # persistent
        self.register_buffer("scale", torch.full((3,), 0.75), persistent=False)  # never in a state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.proj(x)))) * self.scale + self.offset


class _Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh())
        self.proj = nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # "1" is a prefix of "10": a filter that matches "1" without a "." boundary takes both.
        self.add_module("1", _Block(5, 7))
        self.add_module("10", _Block(7, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "10")(getattr(self, "1")(x))


class Groups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 9)
        self.norm = nn.LayerNorm(9)
        self.out = nn.Linear(9, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 3, bias=False)  # 6 elements
        self.b = nn.Linear(3, 1)  # 3 + 1 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Dtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 4, dtype=torch.float64)
        self.head = nn.Linear(4, 3, dtype=torch.float64)
        for dtype in EDGE_DTYPES:
            edges = edge_values(dtype)
            # permuted by the global RNG that build() seeds: another seed puts other values in place
            self.register_buffer(f"edge_{str(dtype).removeprefix('torch.')}", edges[torch.randperm(edges.numel())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x.to(torch.float64))))


ZOO: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "tied": Tied,
    "frozen": Frozen,
    "buffers": Buffers,
    "nested": Nested,
    "groups": Groups,
    "tiny": Tiny,
    "dtypes": Dtypes,
}

_INPUT_FEATURES = {"dtypes": 5, "mlp": 5, "frozen": 5, "buffers": 5, "nested": 5, "groups": 5, "tiny": 2}


def build(name: str, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """A fresh zoo model whose parameters and buffers depend only on ``seed`` (not on global RNG state)."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {sorted(ZOO)}")
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = ZOO[name]()
    return model.to(device)


def batch(name: str, seed: int = 0, batch_size: int = 8, device: torch.device | str = "cpu") -> torch.Tensor:
    """A deterministic input batch for zoo model ``name``."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    if name == "tied":
        data = torch.randint(0, Tied.VOCAB, (batch_size, 3), generator=gen)
    elif name in _INPUT_FEATURES:
        data = torch.randn(batch_size, _INPUT_FEATURES[name], generator=gen)
    else:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {sorted(ZOO)}")
    return data.to(device)


def loss(output: torch.Tensor) -> torch.Tensor:
    """The scalar every test trains on."""
    return output.float().pow(2).mean()


def param_groups(model: nn.Module) -> list[dict]:
    """Two optimizer param groups with different hyperparameters: matrices, then everything else.

    Frozen parameters are left out, as a user would. Order follows ``named_parameters`` (tied
    parameters appear once)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trainable if p.dim() >= 2]
    others = [p for p in trainable if p.dim() < 2]
    groups = [{"params": matrices, "lr": 0.02, "weight_decay": 0.01}]
    if others:
        groups.append({"params": others, "lr": 0.01, "weight_decay": 0.0})
    return groups


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> torch.Tensor:
    """One step of ``loss(model(inputs))``; returns the detached loss."""
    optimizer.zero_grad(set_to_none=True)
    value = loss(model(inputs))
    value.backward()
    optimizer.step()
    return value.detach()


def fingerprint(model: torch.nn.Module) -> list[tuple[str, bytes]]:
    """Every state entry's bits (NaN payloads and -0.0 included), comparable across processes."""
    return [(k, bits(v).cpu().numpy().tobytes()) for k, v in model.state_dict().items()]
