"""FlatParameter wrapping (SPEC section FP): many parameters of a module as one 1-D parameter.

Modules:

- :mod:`reference.flat_param.wrapper`       ``FlatParameter`` (layout and shard metadata, inclusive
  :class:`ParamRange` ranges), ``FlattenParamsWrapper``, ``even_shard_range``
- :mod:`reference.flat_param.prefix_hooks`  the general key-rewrite hooks that hide a wrapper's path
  segment from ``state_dict()`` keys (``register_prefix_hooks``)

Exports: the public names of both.
"""

from reference.flat_param.prefix_hooks import PrefixHookHandles, clean_named_modules, hidden_child, register_prefix_hooks
from reference.flat_param.wrapper import (
    FLAT_PARAM,
    FPW_MODULE,
    FlatParameter,
    FlatParamMetadata,
    FlattenParamsWrapper,
    ParamRange,
    ShardMetadata,
    ShardRange,
    even_shard_range,
)

__all__ = [
    "FlatParameter",
    "FlattenParamsWrapper",
    "ParamRange",
    "FlatParamMetadata",
    "ShardMetadata",
    "ShardRange",
    "even_shard_range",
    "FLAT_PARAM",
    "FPW_MODULE",
    "PrefixHookHandles",
    "register_prefix_hooks",
    "hidden_child",
    "clean_named_modules",
]
