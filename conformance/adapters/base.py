"""The protocol every implementation under test satisfies.

An adapter is a small class with a ``name`` and one method per capability of ``conformance/SPEC.md``.
Each method returns an *ops* object for that capability, typed by its ``Protocol`` (``FlatParamOps``,
``StateDictOps``, ``OptimStateOps``, ``CheckpointOps``, next to the shipped ops in
``conformance/adapters/<capability>.py``, so that a type checker checks a fork's adapter), or raises
:class:`Unsupported` with the reason the implementation does not provide it. One more method,
:meth:`Adapter.sharding`, returns the one way this implementation shards a model
(:class:`~conformance.adapters.sharding.ShardingOps`), which the SD, OS and ML tests all use. The harness turns ``Unsupported`` into a skip that names the
adapter, the capability and the reason, never into a pass.

A downstream project writes::

    from conformance.adapters.base import Adapter, Unsupported

    class MyForkAdapter(Adapter):
        name = "myfork"

        def checkpoint(self):
            from conformance.adapters.checkpoint import TorchCheckpointOps
            return MyCheckpointOps()          # anything satisfying CheckpointOps

and runs ``pytest conformance/ --impl mypkg.adapters:MyForkAdapter``.

Adapters are created on every rank from their spec string (``reference`` or ``pkg.mod:Class``), so
they pickle by spec, not by value: keep per-process state out of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

from conformance.adapters.unsupported import Unsupported

if TYPE_CHECKING:
    from conformance.adapters.async_checkpoint import AsyncCheckpointOps
    from conformance.adapters.checkpoint import CheckpointOps
    from conformance.adapters.flat_param import FlatParamOps
    from conformance.adapters.optim_state import OptimStateOps
    from conformance.adapters.sharding import ShardingOps
    from conformance.adapters.state_dict import StateDictOps

__all__ = ["Adapter", "Unsupported", "CAPABILITIES", "SHIPPED", "STACKS", "load_adapter", "capability_of"]

#: Capability name -> the SPEC.md ID prefix of its requirements.
CAPABILITIES: dict[str, str] = {
    "flat_param": "FP",
    "state_dict": "SD",
    "optim_state": "OS",
    "checkpoint": "ML",
    "async_checkpoint": "AS",
}

#: Shipped adapter names -> ``module:Class``.
SHIPPED: dict[str, str] = {
    "reference": "conformance.adapters.impls:ReferenceAdapter",
    "torch": "conformance.adapters.impls:TorchAdapter",
    "torch-fsdp2": "conformance.adapters.impls:TorchFSDP2Adapter",
    "fairscale": "conformance.adapters.impls:FairscaleAdapter",
}

#: Adapters for stacks built on torch, shipped by name but not run by default: each needs its stack
#: installed (``make stacks`` gives each a venv of its own; docs/stacks.md has the verdicts).
STACKS: dict[str, str] = {
    "megatron-core": "conformance.adapters.stacks.megatron:MegatronCoreAdapter",
    "deepspeed": "conformance.adapters.stacks.deepspeed:DeepSpeedAdapter",
    "torchtitan": "conformance.adapters.stacks.torchtitan:TorchtitanAdapter",
}


def capability_of(requirement_id: str) -> str | None:
    """The capability a requirement ID belongs to (``"OS-3"`` -> ``"optim_state"``); None for ``HX-``."""
    prefix = requirement_id.split("-", 1)[0]
    for capability, cap_prefix in CAPABILITIES.items():
        if cap_prefix == prefix:
            return capability
    return None


class Adapter:
    """Base class of implementation adapters. Subclasses override the capabilities they provide."""

    #: Short name used in test ids and the report.
    name: ClassVar[str] = "unnamed"
    #: The expected-failures file of this adapter's known deviations (format:
    #: :mod:`conformance.harness.xfails`), absolute or relative to the directory of the module that
    #: defines the class; None for none. Applied whenever the adapter is selected, and inherited: an
    #: adapter derived from this one gets these entries too (its own file comes first and may remove
    #: inherited entries with ``!pattern`` lines). A file that does not exist is a usage error.
    xfails_file: ClassVar[str | None] = None

    # -- what the stack is: declared, so that the suite does not assume torch's ------------------------

    #: The on-disk format its checkpoints are written in: ``"dcp"`` (torch.distributed.checkpoint's
    #: ``.metadata`` and ``.distcp`` files, which upstream DCP reads and writes: the DCP-format
    #: requirements apply, ML-2 and ML-25) or the name of the stack's own format (``"megatron"``,
    #: ``"deepspeed"``): the semantic requirements still apply, the DCP-format ones are skips naming it.
    checkpoint_format: ClassVar[str] = "dcp"
    #: Whether its checkpoint directory holds DCP's ``.metadata`` and data files (in it, or in a folder
    #: of it), even where the checkpoint as a whole is not DCP's (megatron-core writes DCP's files beside
    #: a ``metadata.json`` of its own): the tests that read DCP's metadata or place a fault by it (ML-3,
    #: ML-14, ML-19, ML-20, ML-23, ML-27) then apply. None: as ``checkpoint_format == "dcp"`` says.
    dcp_files: ClassVar[bool | None] = None
    #: Whether its checkpoint ops need an initialized process group. True: a save or load asked of a
    #: process without one (ML-12, a crash test's child without a group) is a skip naming the op.
    needs_process_group: ClassVar[bool] = False
    #: The device types its ops run on (``"cpu"`` for gloo ranks, ``"cuda"`` for nccl ranks): a rank test
    #: on another is a skip naming the device.
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    spec: str  # set by load_adapter: how to recreate this adapter on another process

    def flat_param(self) -> FlatParamOps:
        """Ops for FlatParameter wrapping (FP-*)."""
        raise Unsupported("not provided by this adapter")

    def state_dict(self) -> StateDictOps:
        """Ops for get/set_state_dict with submodules (SD-*)."""
        raise Unsupported("not provided by this adapter")

    def optim_state(self) -> OptimStateOps:
        """Ops for sharded models and their optimizer state dicts (OS-*)."""
        raise Unsupported("not provided by this adapter")

    def checkpoint(self) -> CheckpointOps:
        """Ops for distributed checkpoint save/load and meta-tensor loading (ML-*)."""
        raise Unsupported("not provided by this adapter")

    def async_checkpoint(self) -> AsyncCheckpointOps:
        """Ops for async saves (AS-*): staging, the background write and its futures."""
        raise Unsupported("not provided by this adapter")

    def sharding(self) -> ShardingOps:
        """How this implementation shards a model (:class:`~conformance.adapters.sharding.ShardingPlan`):
        the SD, OS and ML tests of sharded models all shard through it."""
        raise Unsupported("not provided by this adapter")

    # -- used by the harness -------------------------------------------------------------------

    def unsupported_reason(self, capability: str) -> str | None:
        """None if ``capability`` is provided, else the reason it is not."""
        try:
            getattr(self, capability)()
        except Unsupported as exc:
            return str(exc)
        return None

    @overload
    def require(self, capability: Literal["flat_param"]) -> FlatParamOps: ...
    @overload
    def require(self, capability: Literal["state_dict"]) -> StateDictOps: ...
    @overload
    def require(self, capability: Literal["optim_state"]) -> OptimStateOps: ...
    @overload
    def require(self, capability: Literal["checkpoint"]) -> CheckpointOps: ...
    @overload
    def require(self, capability: Literal["async_checkpoint"]) -> AsyncCheckpointOps: ...
    @overload
    def require(self, capability: Literal["sharding"]) -> ShardingOps: ...
    @overload
    def require(self, capability: str) -> Any: ...

    def require(self, capability: str) -> Any:
        """The ops of ``capability``, or a pytest skip naming the adapter, capability and reason. Typed by
        the capability's name (``require("checkpoint")`` is a ``CheckpointOps``)."""
        try:
            return getattr(self, capability)()
        except Unsupported as exc:
            import pytest

            pytest.skip(f"{self.name} does not provide {capability}: {exc}")

    def require_format(self, fmt: str, requirement: str) -> None:
        """Skip, naming ``requirement``, unless this stack writes checkpoints in ``fmt`` (``"dcp"``)."""
        if self.checkpoint_format != fmt:
            import pytest

            pytest.skip(f"{self.name} writes its own checkpoint format ({self.checkpoint_format!r}); "
                        f"{requirement} is about the {fmt} format")

    @property
    def has_dcp_files(self) -> bool:
        """Whether DCP's files can be read and damaged in this stack's checkpoints (:attr:`dcp_files`)."""
        return self.checkpoint_format == "dcp" if self.dcp_files is None else self.dcp_files

    def require_no_process_group(self, op: str) -> None:
        """Skip, naming ``op``, when this stack declares that its ops need a process group."""
        if self.needs_process_group:
            import pytest

            pytest.skip(f"{self.name} declares needs_process_group: {op} in a process without one is not provided")

    def why_not_on(self, device_type: str) -> str | None:
        """Why a rank test on ``device_type`` is a skip for this stack, or None when it runs there."""
        if device_type in self.devices:
            return None
        return f"{self.name} runs on {', '.join(self.devices)} only (declared devices); this world size runs on {device_type}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return load_adapter, (self.spec,)

    def __repr__(self) -> str:
        return f"<adapter {self.name} ({self.spec})>"


_CACHE: dict[str, Adapter] = {}


def load_adapter(spec: str) -> Adapter:
    """The adapter named by ``spec``: a shipped name (``reference``, ``torch``, ...) or ``pkg.module:Class``."""
    if spec in _CACHE:
        return _CACHE[spec]
    target = SHIPPED.get(spec) or STACKS.get(spec, spec)
    if ":" not in target:
        raise ValueError(
            f"unknown implementation {spec!r}: expected one of {sorted(SHIPPED | STACKS)} or 'package.module:AdapterClass'"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"implementation {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ValueError(f"implementation {spec!r}: {target!r} is not a subclass of conformance.adapters.base.Adapter")
    adapter = cls()
    adapter.spec = spec
    _CACHE[spec] = adapter
    return adapter
