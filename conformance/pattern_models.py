"""The structural patterns behind real architectures, in plain torch: the suite catches each class of
defect without ``transformers`` (``conformance/real_models.py`` registers them beside the real ones).

=============  ===============================================================================
name           the pattern, and the real model it stands for
=============  ===============================================================================
passthrough    a unit's input is a tensor computed by another unit, and the unit returns it with its
               output: unchanged (T5's relative position bias) and as a view of it
shared         one module registered under several names (the shared embedding of an encoder and a
               decoder), used by both, outside every unit
reused         one unit called several times per step (weights shared across layers, as ALBERT)
routed         top-1 routing to experts by a fixed rule: with the global batch split over 2 or 4
               ranks, each expert is reached by some ranks' rows only, and one expert by no row
               (an MoE expert no token was routed to); a router gate that always has a gradient
=============  ===============================================================================

Every model takes ``x`` (``GLOBAL_BATCH`` rows of :data:`WIDTH` features; ``routed`` also ``expert``,
the expert index of each row) and returns a tensor whose mean square is the loss; sizes are uneven so
shards are uneven at every world size. Persistent and non-persistent buffers ride along in the blocks.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["WIDTH", "PassBlock", "PassFirst", "PassThrough", "Shared", "SharedBlock", "Reused", "ReusedBlock", "Routed", "MoELayer", "batch", "loss"]

#: Features of every pattern model's input.
WIDTH = 6


class PassFirst(nn.Module):
    """Computes the bias that the later blocks receive (T5's block 0 with its relative attention bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.bias_source = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = torch.tanh(self.bias_source(x))
        return torch.tanh(self.proj(x) + bias), bias


class PassBlock(nn.Module):
    """Receives the bias, uses it, and returns it with its output: unchanged, or as a view."""

    def __init__(self, as_view: bool) -> None:
        super().__init__()
        self.as_view = as_view
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))  # persistent
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, WIDTH), persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.tanh(self.proj(x) * self.scale + bias + self.shift)
        return out, bias.view(bias.shape) if self.as_view else bias


class PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = PassFirst()
        self.blocks = nn.ModuleList([PassBlock(as_view=False), PassBlock(as_view=False), PassBlock(as_view=True)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.first(x)
        for block in self.blocks:
            h, bias = block(h, bias)
        return self.head(h)


class SharedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Shared(nn.Module):
    """``encoder_embed`` and ``decoder_embed`` are one module (two names, one set of parameters), used
    by both halves; each half has a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, 5)
        self.encoder_embed = self.embed
        self.decoder_embed = self.embed
        self.encoder = SharedBlock()
        self.decoder = SharedBlock()
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.encoder_embed(x))
        return self.head(self.decoder(self.decoder_embed(x) + memory))


class ReusedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(7, 7)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))  # persistent int64 buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) + x


class Reused(nn.Module):
    """One block applied three times per step: its unit gathers, and its gradient accumulates, across calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 7)
        self.block = ReusedBlock()
        self.head = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = self.block(h)
        return self.head(h)


class MoELayer(nn.Module):
    """A router gate and three experts; each row goes to the expert its ``expert`` index names."""

    NUM_EXPERTS = 3

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, self.NUM_EXPERTS)
        self.experts = nn.ModuleList([nn.Linear(WIDTH, 5) for _ in range(self.NUM_EXPERTS)])

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        weight = torch.softmax(self.gate(x), dim=-1).gather(1, expert[:, None])
        out = x.new_zeros(x.shape[0], 5)
        for index, module in enumerate(self.experts):
            rows = (expert == index).nonzero().flatten()
            if rows.numel():  # an expert without rows takes no part: its grad stays None
                out = out.index_add(0, rows, module(x[rows]))
        return out * weight


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoELayer()
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.moe(x, expert)))


def batch(step: int, rows: int, *, routed: bool = False) -> dict[str, torch.Tensor]:
    """The global batch of a training step. ``routed``: rows go to expert 0 in the first half and
    expert 1 in the second (expert 2 never), so every slice over 2 or 4 ranks reaches one expert only."""
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(20_000 + step))
    if not routed:
        return {"x": x}
    return {"x": x, "expert": (torch.arange(rows) >= rows // 2).long()}


def loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean square of the output: a mean over rows."""
    out: torch.Tensor = model(**inputs)
    return out.float().pow(2).mean()
