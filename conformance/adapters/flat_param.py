"""Ops for FlatParameter wrapping (the FP section of ``conformance/SPEC.md``).

:class:`FlatParamOps` is what a test of the FP section may ask of an implementation; it is small on
purpose: build a flat parameter, wrap a module, and read back what the SPEC talks about. Everything
else (forward, ``state_dict``, ``load_state_dict``, ``deepcopy``, ``.to()``) the tests do on the
returned wrapper with plain ``nn.Module`` calls, because that is the contract.

Values crossing the protocol are plain: tuples and the two NamedTuples below, never an
implementation's own metadata classes. A feature an implementation lacks raises
:class:`~conformance.adapters.base.Unsupported` with the reason; the tests turn that into a skip.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch import Tensor

from conformance.adapters.unsupported import Unsupported

__all__ = ["FlatParamOps", "FlatParamInfo", "ShardInfo", "ReferenceFlatParamOps", "FairscaleFlatParamOps"]


class FlatParamInfo(NamedTuple):
    """What a flat parameter is made of, one entry per original parameter, in flat order."""

    names: tuple[str, ...]  # names relative to the wrapped module ("" entries allowed for a bare one)
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]


class ShardInfo(NamedTuple):
    """One shard of a flat parameter: the parameters it holds (part of) and which of their elements."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]  # full shapes
    numels: tuple[int, ...]  # full numels
    offsets: tuple[tuple[int, int], ...]  # per parameter: inclusive [first, last] index into param.reshape(-1)
    num_padded: int


@runtime_checkable
class FlatParamOps(Protocol):
    """Operations of the FP section. All calls are local to one process."""

    def make_flat_param(self, params: Sequence[Tensor], requires_grad: bool = True) -> nn.Parameter:
        """A flat parameter built from ``params`` (the implementation's FlatParameter class)."""
        ...

    def is_flat_param(self, value: Any) -> bool:
        """Whether ``value`` is a flat parameter of this implementation."""
        ...

    def param_views(self, flat_param: nn.Parameter, external_data: Tensor | None = None) -> list[Tensor]:
        """``flat_param.get_param_views(external_data)`` as a list."""
        ...

    def info(self, flat_param: nn.Parameter) -> FlatParamInfo:
        """Names, shapes and numels of the parameters in ``flat_param``."""
        ...

    def shard(self, flat_param: nn.Parameter, start: int, end: int, num_padded: int) -> ShardInfo:
        """Record the shard ``[start, end]`` (inclusive flat indices) with ``num_padded`` padding, return its metadata."""
        ...

    def shard_info(self, flat_param: nn.Parameter) -> ShardInfo:
        """The metadata of the shard recorded last (the whole flat parameter if none was)."""
        ...

    def wrap(self, module: nn.Module, param_list: Sequence[nn.Parameter]) -> nn.Module:
        """The implementation's FlattenParamsWrapper around ``module``, flattening ``param_list``."""
        ...

    def flat_param(self, wrapper: nn.Module) -> nn.Parameter | None:
        """The wrapper's flat parameter while flattened; None when it flattened nothing."""
        ...

    def unflatten_params(self, wrapper: nn.Module) -> AbstractContextManager[None]:
        """The wrapper's ``unflatten_params()`` context manager."""
        ...


def _shard_info(meta: Any) -> ShardInfo:
    return ShardInfo(
        tuple(meta.param_names),
        tuple(meta.param_shapes),
        tuple(meta.param_numels),
        tuple((int(r[0]), int(r[1])) for r in meta.param_offsets),
        int(meta.num_padded),
    )


class ReferenceFlatParamOps:
    """This project's :mod:`reference.flat_param`."""

    def make_flat_param(self, params: Sequence[Tensor], requires_grad: bool = True) -> nn.Parameter:
        from reference.flat_param import FlatParameter

        return FlatParameter(params, requires_grad)

    def is_flat_param(self, value: Any) -> bool:
        from reference.flat_param import FlatParameter

        return isinstance(value, FlatParameter)

    def param_views(self, flat_param: nn.Parameter, external_data: Tensor | None = None) -> list[Tensor]:
        return list(flat_param.get_param_views(external_data))  # type: ignore[attr-defined]

    def info(self, flat_param: nn.Parameter) -> FlatParamInfo:
        meta = flat_param.metadata()  # type: ignore[attr-defined]
        return FlatParamInfo(tuple(meta.param_names), tuple(meta.param_shapes), tuple(meta.param_numels))

    def shard(self, flat_param: nn.Parameter, start: int, end: int, num_padded: int) -> ShardInfo:
        flat_param.shard_by_offsets(start, end, num_padded)  # type: ignore[attr-defined]
        return self.shard_info(flat_param)

    def shard_info(self, flat_param: nn.Parameter) -> ShardInfo:
        return _shard_info(flat_param.shard_metadata())  # type: ignore[attr-defined]

    def wrap(self, module: nn.Module, param_list: Sequence[nn.Parameter]) -> nn.Module:
        from reference.flat_param import FlattenParamsWrapper

        return FlattenParamsWrapper(module, param_list)

    def flat_param(self, wrapper: nn.Module) -> nn.Parameter | None:
        return wrapper.flat_param  # type: ignore[return-value]

    def unflatten_params(self, wrapper: nn.Module) -> AbstractContextManager[None]:
        return wrapper.unflatten_params()  # type: ignore[operator]


_FPW_SEGMENT = "_fpw_module."


class FairscaleFlatParamOps:
    """fairscale 0.4.13's ``fairscale.nn.misc.FlattenParamsWrapper``.

    Differences in API only (not behaviour) are bridged here: fairscale keeps a list ``flat_params``
    (one per parameter group; we always pass one group) registered as ``flat_param_0``, and its
    metadata names carry the ``_fpw_module`` segment of the wrapper and of every wrapper inside it.
    It has no shard metadata at all, which is a missing feature (skip), not a deviation. Behavioural
    deviations are in ``conformance/xfails/fairscale.txt``.
    """

    def make_flat_param(self, params: Sequence[Tensor], requires_grad: bool = True) -> nn.Parameter:
        from fairscale.nn.misc.flatten_params_wrapper import FlatParameter

        return FlatParameter(params, requires_grad)

    def is_flat_param(self, value: Any) -> bool:
        from fairscale.nn.misc.flatten_params_wrapper import FlatParameter

        return isinstance(value, FlatParameter)

    def param_views(self, flat_param: nn.Parameter, external_data: Tensor | None = None) -> list[Tensor]:
        return list(flat_param.get_param_views(external_data))  # type: ignore[attr-defined]

    def info(self, flat_param: nn.Parameter) -> FlatParamInfo:
        names, shapes, numels = flat_param.metadata()  # type: ignore[attr-defined]
        if not names:  # a FlatParameter made outside a wrapper has no names in fairscale
            names = [""] * len(shapes)
        # fairscale names parameters by their module path from the wrapper (`_fpw_module.net.0.weight`,
        # with the segment of every wrapper nested inside too); the protocol names them as the
        # state_dict does. fairscale's own FSDP drops those segments the same way where it uses the
        # names (`_clean_path`, for the metadata of consolidated checkpoints).
        names = [".".join(part for part in n.split(".") if part != _FPW_SEGMENT.rstrip(".")) for n in names]
        return FlatParamInfo(tuple(names), tuple(torch.Size(s) for s in shapes), tuple(numels))

    def shard(self, flat_param: nn.Parameter, start: int, end: int, num_padded: int) -> ShardInfo:
        raise Unsupported("fairscale's FlatParameter has no shard_by_offsets/shard_metadata")

    def shard_info(self, flat_param: nn.Parameter) -> ShardInfo:
        raise Unsupported("fairscale's FlatParameter has no shard_by_offsets/shard_metadata")

    def wrap(self, module: nn.Module, param_list: Sequence[nn.Parameter]) -> nn.Module:
        from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

        return FlattenParamsWrapper(module, param_list=list(param_list))

    def flat_param(self, wrapper: nn.Module) -> nn.Parameter | None:
        from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

        if not isinstance(wrapper, FlattenParamsWrapper):
            raise TypeError(f"fairscale flat_param: expected the FlattenParamsWrapper that wrap() returns, got {type(wrapper).__name__}")
        flat_params: list[nn.Parameter] = wrapper.flat_params
        return flat_params[0] if flat_params else None

    def unflatten_params(self, wrapper: nn.Module) -> AbstractContextManager[None]:
        return wrapper.unflatten_params()  # type: ignore[operator]
