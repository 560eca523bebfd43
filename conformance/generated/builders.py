"""Models, optimizers and batches made from a spec: everything a generated run trains.

:func:`build` is deterministic in ``(spec, seed)``: two builds of one seed are equal bit for bit,
builds of two seeds differ in every parameter and buffer element (a load target starts different from
what is loaded). :func:`batch` is deterministic in ``(spec, step)`` and the same global rows at every
world size. :func:`make_optimizer` lays an optimizer out by an :class:`~conformance.generated.specs.OptimPlan`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conformance.asserts import bits
from conformance.generated.specs import GLOBAL_BATCH, Buffer, Linear, ModelSpec, Module, Node, OptimPlan, torch_dtype
from conformance.values import edge_values, perturb_hyperparameters

__all__ = [
    "GenLinear",
    "GenModule",
    "buffer_value",
    "build",
    "batch",
    "loss",
    "train_step",
    "hyperparameters",
    "make_optimizer",
    "oracle_params",
]

# The class names show in wrappers' names (FSDP2 makes ``FSDPGenModule``) and so in pinned messages.


class GenLinear(nn.Linear):
    """:class:`~conformance.generated.specs.Linear`: ``tanh`` of the linear map of the input's first
    ``in_features`` columns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x[:, : self.in_features]))


class GenModule(nn.Module):
    """:class:`~conformance.generated.specs.Module`: its children's outputs and its ties'
    ``tanh(x @ w.T)`` concatenated."""

    def __init__(self, tie_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.tie_names = tuple(tie_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [child(x) for child in self.children()]
        for name in self.tie_names:
            weight = getattr(self, name)
            outs.append(torch.tanh(F.linear(x[:, : weight.shape[1]], weight)))
        return torch.cat(outs, dim=1) if outs else x[:, :0]


def _value_pool(dtype: torch.dtype) -> torch.Tensor:
    """The edge values of ``dtype``, each bit pattern once (at least two)."""
    values = edge_values(dtype)
    seen: dict[bytes, int] = {}
    for i, raw in enumerate(bits(values).reshape(-1).tolist()):
        seen.setdefault(repr(raw).encode(), i)
    return values[list(seen.values())]


def buffer_value(buf: Buffer, seed: int) -> torch.Tensor:
    """Edge values of the buffer's dtype; two seeds differ in every element (consecutive pool entries)."""
    pool = _value_pool(torch_dtype(buf.dtype))
    numel = math.prod(buf.shape)
    index = (torch.arange(numel) * 3 + seed + (0 if buf.persistent else 5)) % pool.numel()
    return pool[index].reshape(buf.shape).clone()


def build(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The model of ``spec``; its parameters and buffers depend only on ``seed`` (the global RNG is
    left as it was)."""
    dtype = torch_dtype(spec.dtype)

    def make(node: Node) -> nn.Module:
        if isinstance(node, Linear):
            return GenLinear(node.in_features, node.out_features, bias=node.bias, dtype=dtype)
        module = GenModule([t.name for t in node.ties])
        for child in node.children:
            module.add_module(child.name, make(child))
        for buf in node.buffers:
            module.register_buffer(buf.name, buffer_value(buf, seed), persistent=buf.persistent)
        return module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make(spec.root)
    for path, node in spec.nodes():
        if isinstance(node, Module):
            holder = model.get_submodule(path)
            for tie in node.ties:
                weight = holder.get_submodule(tie.source).weight
                assert isinstance(weight, nn.Parameter), "a tie's source is a Linear"
                holder.register_parameter(tie.name, weight)
        elif node.frozen:
            model.get_submodule(path).requires_grad_(False)
    return model.to(device)


def batch(spec: ModelSpec, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global batch of training step ``step`` (every world size slices the same rows)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    data = torch.randn(GLOBAL_BATCH, spec.input_width, generator=gen, dtype=torch.float64)
    return data.to(torch_dtype(spec.dtype)).to(device)


def loss(output: torch.Tensor) -> torch.Tensor:
    """The loss every generated run minimises: the mean square of the model's output."""
    return output.pow(2).mean()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    """One step of ``optim`` on :func:`loss` of ``model(inputs)`` (gradients cleared first)."""
    optim.zero_grad(set_to_none=True)
    loss(model(inputs)).backward()
    optim.step()


def hyperparameters(kind: str, index: int) -> dict[str, Any]:
    """The source hyperparameters of group set ``index``, with a scheduler's and a user's extra key."""
    lr = (0.02, 0.05, 0.01, 0.03)[index % 4]
    weight_decay = (0.0, 0.01, 0.1, 0.02)[index % 4]
    extra = {"initial_lr": lr * 2, "sdc_custom": f"source-{index}"}
    if kind == "sgd":
        return {"lr": lr, "momentum": (0.9, 0.5, 0.8, 0.7)[index % 4], "weight_decay": weight_decay, **extra}
    return {"lr": lr, "betas": ((0.9, 0.99), (0.8, 0.95), (0.85, 0.9), (0.7, 0.999))[index % 4], "eps": 1e-8, "weight_decay": weight_decay, **extra}


def make_optimizer(kind: str, plan: OptimPlan, named: Sequence[tuple[Sequence[str], nn.Parameter]], *, perturb: bool = False) -> torch.optim.Optimizer:
    """An optimizer over ``named`` ((FQNs a parameter stands for, parameter); frozen ones left out),
    grouped and ordered by ``plan``; ``perturb``: every hyperparameter changed afterwards (a load target)."""
    group_of = {fqn: gi for gi, group in enumerate(plan.groups) for fqn in group}
    rank = {fqn: i for i, fqn in enumerate(plan.order)}
    members: list[list[tuple[int, nn.Parameter]]] = [[] for _ in plan.groups]
    for fqns, param in named:
        if not param.requires_grad:
            continue
        homes = {group_of[f] for f in fqns if f in group_of}
        if len(homes) != 1:
            raise AssertionError(f"generated-case layout error: parameter {list(fqns)} falls in groups {sorted(homes)}")
        members[homes.pop()].append((min(rank[f] for f in fqns if f in rank), param))
    index = plan.hyper_index or tuple(range(len(plan.groups)))
    groups = [{"params": [p for _, p in sorted(m, key=lambda t: t[0])], **hyperparameters(kind, h)} for m, h in zip(members, index)]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    optim = cls([g for g in groups if g["params"]])
    if perturb:
        perturb_hyperparameters(optim)
    return optim


def oracle_params(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """``named`` for :func:`make_optimizer` of an unwrapped model: each parameter under its own FQN."""
    return [((name,), p) for name, p in model.named_parameters()]
