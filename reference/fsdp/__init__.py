"""A minimal flat-parameter sharded data parallel and its state (SPEC section OS).

Modules, each imported only by the ones after it:

- :mod:`reference.fsdp.sharding`     one sharded flat parameter (``FlatParamHandle``), built on the
  layout and shard metadata of :class:`reference.flat_param.FlatParameter`
- :mod:`reference.fsdp.unit`         the module wrapper ``FullyShardedDataParallel``, ``ShardingStrategy``,
  the units of a model and their group
- :mod:`reference.fsdp.model_state`  full and sharded (DTensor) model state dicts and their loads
- :mod:`reference.fsdp.optim_keys`   optimizer-state keying: ``_OptimStateKey``, ``FSDPParamInfo``,
  ``optim_state_dict`` / ``optim_state_dict_to_load``

Torch has ``FullyShardedDataParallel.optim_state_dict`` / ``optim_state_dict_to_load`` as static
methods; here they are the functions of :mod:`~reference.fsdp.optim_keys`, attached to the class below
(where both are defined), so that :mod:`~reference.fsdp.unit` does not import the keying that imports it.

Exports: the public names of all four.
"""

from reference.fsdp.model_state import (
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
    state_dict_layout,
    to_dtensor,
)
from reference.fsdp.optim_keys import (
    FSDPParamInfo,
    _OptimStateKey,
    get_fqn_to_fsdp_param_info,
    get_param_to_fqns,
    optim_state_dict,
    optim_state_dict_to_load,
)
from reference.fsdp.sharding import FlatParamHandle
from reference.fsdp.unit import (
    FLAT_PARAM,
    FSDP_WRAPPED_MODULE,
    AutoWrapPolicy,
    FullyShardedDataParallel,
    ShardingStrategy,
    model_group,
    reshard_all,
    units,
)

__all__ = [
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "AutoWrapPolicy",
    "FSDP_WRAPPED_MODULE",
    "FLAT_PARAM",
    "FlatParamHandle",
    "model_group",
    "units",
    "reshard_all",
    "full_state_dict",
    "sharded_state_dict",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "state_dict_layout",
    "to_dtensor",
    "_OptimStateKey",
    "FSDPParamInfo",
    "get_fqn_to_fsdp_param_info",
    "get_param_to_fqns",
    "optim_state_dict",
    "optim_state_dict_to_load",
]

# The torch-mirroring static API (see the module docstring).
FullyShardedDataParallel.optim_state_dict = staticmethod(optim_state_dict)  # type: ignore[attr-defined]
FullyShardedDataParallel.optim_state_dict_to_load = staticmethod(optim_state_dict_to_load)  # type: ignore[attr-defined]
