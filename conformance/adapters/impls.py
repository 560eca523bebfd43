"""The shipped adapters. Each is a thin table from capability to the ops class that implements it;
the ops themselves live in one module per capability (``flat_param.py``, ``state_dict.py``,
``optim_state.py``, ``checkpoint.py`` in this package), imported only when asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.adapters.base import Adapter, Unsupported

if TYPE_CHECKING:  # the ops modules are imported only when a capability is asked for
    from conformance.adapters.async_checkpoint import AsyncCheckpointOps
    from conformance.adapters.checkpoint import CheckpointOps
    from conformance.adapters.flat_param import FlatParamOps
    from conformance.adapters.optim_state import OptimStateOps
    from conformance.adapters.sharding import ShardingOps
    from conformance.adapters.state_dict import StateDictOps


class ReferenceAdapter(Adapter):
    """This project's reference implementation (``import reference``)."""

    name = "reference"

    def flat_param(self) -> FlatParamOps:
        from conformance.adapters.flat_param import ReferenceFlatParamOps

        return ReferenceFlatParamOps()

    def state_dict(self) -> StateDictOps:
        from conformance.adapters.state_dict import ReferenceStateDictOps

        return ReferenceStateDictOps()

    def optim_state(self) -> OptimStateOps:
        from conformance.adapters.optim_state import ReferenceOptimStateOps

        return ReferenceOptimStateOps()

    def checkpoint(self) -> CheckpointOps:
        from conformance.adapters.checkpoint import ReferenceCheckpointOps

        return ReferenceCheckpointOps()

    def async_checkpoint(self) -> AsyncCheckpointOps:
        from conformance.adapters.async_checkpoint import ReferenceAsyncCheckpointOps

        return ReferenceAsyncCheckpointOps()

    def sharding(self) -> ShardingOps:
        from conformance.adapters.sharding import ReferenceShardingOps

        return ReferenceShardingOps()


class TorchAdapter(Adapter):
    """Upstream torch as installed (FSDP1, DCP, ``torch.distributed.checkpoint.state_dict``).

    A vendor fork is validated by installing it in the environment and selecting this adapter."""

    name = "torch"
    xfails_file = "../xfails/torch.txt"

    def flat_param(self) -> FlatParamOps:
        raise Unsupported("upstream torch has no public FlattenParamsWrapper (FSDP's FlatParameter is internal)")

    def state_dict(self) -> StateDictOps:
        from conformance.adapters.state_dict import TorchStateDictOps

        return TorchStateDictOps()

    def optim_state(self) -> OptimStateOps:
        from conformance.adapters.optim_state import TorchFSDP1OptimStateOps

        return TorchFSDP1OptimStateOps()

    def checkpoint(self) -> CheckpointOps:
        from conformance.adapters.checkpoint import TorchCheckpointOps

        return TorchCheckpointOps()

    def async_checkpoint(self) -> AsyncCheckpointOps:
        from conformance.adapters.async_checkpoint import TorchAsyncCheckpointOps

        return TorchAsyncCheckpointOps()

    def sharding(self) -> ShardingOps:
        from conformance.adapters.sharding import TorchFSDP1ShardingOps

        return TorchFSDP1ShardingOps()


class TorchFSDP2Adapter(Adapter):
    """Upstream torch's per-parameter sharding (``fully_shard``) with the DCP state_dict APIs."""

    name = "torch-fsdp2"
    xfails_file = "../xfails/torch-fsdp2.txt"

    def flat_param(self) -> FlatParamOps:
        raise Unsupported("fully_shard shards each parameter as a DTensor; it has no FlatParameter")

    def state_dict(self) -> StateDictOps:
        from conformance.adapters.state_dict import TorchFSDP2StateDictOps

        return TorchFSDP2StateDictOps()

    def optim_state(self) -> OptimStateOps:
        from conformance.adapters.optim_state import TorchFSDP2OptimStateOps

        return TorchFSDP2OptimStateOps()

    def checkpoint(self) -> CheckpointOps:
        from conformance.adapters.checkpoint import TorchFSDP2CheckpointOps

        return TorchFSDP2CheckpointOps()

    def async_checkpoint(self) -> AsyncCheckpointOps:
        raise Unsupported("the same torch.distributed.checkpoint.async_save as the torch adapter's, checked under torch")

    def sharding(self) -> ShardingOps:
        from conformance.adapters.sharding import TorchFSDP2ShardingOps

        return TorchFSDP2ShardingOps()


class FairscaleAdapter(Adapter):
    """fairscale's ``FlattenParamsWrapper``: checked for the flat-parameter section only."""

    name = "fairscale"
    xfails_file = "../xfails/fairscale.txt"

    def flat_param(self) -> FlatParamOps:
        try:
            import fairscale  # noqa: F401
        except ImportError as exc:
            raise Unsupported(f"fairscale is not installed ({exc})") from exc
        from conformance.adapters.flat_param import FairscaleFlatParamOps

        return FairscaleFlatParamOps()

    def state_dict(self) -> StateDictOps:
        raise Unsupported("fairscale is checked for FlatParameter wrapping only")

    def optim_state(self) -> OptimStateOps:
        raise Unsupported("fairscale is checked for FlatParameter wrapping only")

    def checkpoint(self) -> CheckpointOps:
        raise Unsupported("fairscale is checked for FlatParameter wrapping only")

    def sharding(self) -> ShardingOps:
        raise Unsupported("fairscale is checked for FlatParameter wrapping only")
