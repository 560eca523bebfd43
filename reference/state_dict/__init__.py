"""get/set state_dict of a model and its optimizers, keyed by canonical FQNs, with submodule selection
(SPEC section SD); the reference of ``torch.distributed.checkpoint.state_dict``.

Modules:

- :mod:`reference.state_dict.options`    ``StateDictOptions``, ``IncompatibleKeys``
- :mod:`reference.state_dict.api`        ``get_state_dict`` / ``set_state_dict`` and the model and
  optimizer variants: FQN cleaning, submodule selection, validation before any change
- :mod:`reference.state_dict.backend`    where values come from and go to: plain (and DTensor) models,
  and models sharded by :mod:`reference.fsdp`; ``broadcast_from_rank0``
- :mod:`reference.state_dict.optim_fqn`  optimizer state dicts keyed by FQN (nested and flattened)

The canonical-FQN rule is :mod:`reference.fqn` (shared with the wrappers that register their segments).

Exports: the public API of :mod:`~reference.state_dict.api` and the options.
"""

from reference.state_dict.api import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from reference.state_dict.options import IncompatibleKeys, StateDictOptions

__all__ = [
    "StateDictOptions",
    "IncompatibleKeys",
    "get_state_dict",
    "set_state_dict",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
]
