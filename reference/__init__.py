"""The reference implementation of the state_dict semantics of sharded PyTorch models.

Package index: one package per section of ``conformance/SPEC.md``, and three shared modules.

- :mod:`reference.flat_param`    FlatParameter and FlattenParamsWrapper                       (FP-*)
    - :mod:`reference.flat_param.wrapper`       FlatParameter, its layout and shard metadata, the wrapper
    - :mod:`reference.flat_param.prefix_hooks`  hide a wrapper's path segment from state_dict keys
- :mod:`reference.state_dict`    get/set_state_dict with submodules                           (SD-*)
    - :mod:`reference.state_dict.options`    StateDictOptions, IncompatibleKeys
    - :mod:`reference.state_dict.api`        the get/set functions
    - :mod:`reference.state_dict.backend`    plain and sharded models; broadcast_from_rank0
    - :mod:`reference.state_dict.optim_fqn`  optimizer state dicts keyed by FQN
- :mod:`reference.fsdp`          a minimal flat-parameter sharded data parallel and its state   (OS-*)
    - :mod:`reference.fsdp.sharding`     one sharded flat parameter (FlatParamHandle)
    - :mod:`reference.fsdp.unit`         FullyShardedDataParallel, ShardingStrategy
    - :mod:`reference.fsdp.model_state`  full and sharded model state dicts
    - :mod:`reference.fsdp.optim_keys`   optimizer-state keying (_OptimStateKey, FSDPParamInfo)
- :mod:`reference.checkpoint`    DCP save/load with meta-tensor loading                        (ML-*)
- :mod:`reference.fqn`           the canonical-FQN rule; wrappers register their segments here
- :mod:`reference.comm`          the communication layer of flat_param/fsdp/state_dict/checkpoint: every
                                 collective, and agreement on failure (every rank raises the same error)
- :mod:`reference.host_bytes`    byte views of CPU tensors' memory for files and frames, without numpy

Imports go one way: ``fqn`` and ``host_bytes`` import no other module of the package, ``comm`` only
``host_bytes``; ``flat_param`` imports ``fqn``; ``fsdp`` imports those; ``state_dict`` imports all of
them (no cycles, checked by ``tests/reference/test_layout.py``). Submodules are imported on demand so that ``import reference``
stays cheap.
"""

__version__ = "0.1.0"
