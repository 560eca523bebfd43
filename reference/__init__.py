"""The reference implementation of the state_dict semantics of sharded PyTorch models.

One module per capability (see ``conformance/SPEC.md``):

- :mod:`reference.flat_param`   FlatParameter and FlattenParamsWrapper            (FP-*)
- :mod:`reference.fsdp`         a minimal flat-parameter sharded data parallel     (OS-*)
- :mod:`reference.optim_state`  FSDP optimizer-state keying                        (OS-*)
- :mod:`reference.state_dict`   get/set_state_dict with submodules                 (SD-*)
- :mod:`reference.checkpoint`   DCP save/load with meta-tensor loading             (ML-*)

Submodules are imported on demand so that ``import reference`` stays cheap.
"""

__version__ = "0.1.0"
