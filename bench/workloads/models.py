"""Models of a chosen number of parameters, for the benchmarks that scale with keys, not bytes.

Parameters are tiny (1 to 5 elements, sizes that do not divide evenly) so that a figure measures the
per-key work of the state_dict machinery, not copying.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "Wide", "wide_model", "Level", "nested_model", "adam_with_state"]


class Block(nn.Module):
    """A unit holding ``n`` small parameters (``params.0`` ... ``params.<n-1>``)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        super().__init__()
        self.params = nn.ParameterList(
            nn.Parameter(torch.full(((offset + j) % 5 + 1,), float(offset + j) / 1000.0)) for j in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Touch every parameter so each gets a gradient (and thus optimizer state).
        return x + torch.stack([p.sum() for p in self.params]).sum()


class Wide(nn.Module):
    """``blocks.<i>.params.<j>``: see :func:`wide_model`."""

    def __init__(self, n_params: int, n_blocks: int) -> None:
        super().__init__()
        sizes = [n_params // n_blocks + (1 if i < n_params % n_blocks else 0) for i in range(n_blocks)]
        offsets = [sum(sizes[:i]) for i in range(n_blocks)]
        self.blocks = nn.ModuleList(Block(n, off) for n, off in zip(sizes, offsets))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def wide_model(n_params: int, n_blocks: int) -> Wide:
    """``n_params`` parameters spread as evenly as possible over ``n_blocks`` blocks."""
    if not 1 <= n_blocks <= n_params:
        raise ValueError(f"need 1 <= n_blocks <= n_params, got n_blocks={n_blocks}, n_params={n_params}")
    return Wide(n_params, n_blocks)


class Level(nn.Module):
    """One level of :func:`nested_model`: its own parameters and, except at the bottom, a ``child``."""

    def __init__(self, n: int, depth: int, offset: int = 0) -> None:
        super().__init__()
        per_level = n // depth
        self.params = Block(per_level, offset).params
        # A Level, or (once a wrapper has wrapped it, see bench.workloads.flat_param) that wrapper.
        self.child: nn.Module | None = Level(n - per_level, depth - 1, offset + per_level) if depth > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.stack([p.sum() for p in self.params]).sum()
        return self.child(x) if self.child is not None else x


def nested_model(n_params: int, depth: int) -> Level:
    """``n_params`` parameters over a chain of ``depth`` levels (``params.j``, ``child.params.j``, ...)."""
    if not 1 <= depth <= n_params:
        raise ValueError(f"need 1 <= depth <= n_params, got depth={depth}, n_params={n_params}")
    return Level(n_params, depth)


def adam_with_state(model: nn.Module) -> torch.optim.Optimizer:
    """Adam over ``model`` after one step with unit gradients, so every parameter has state."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim
