"""The suite's own statement of the canonical-FQN rule (SPEC, section SD, "canonical FQN").

A canonical FQN names a parameter or buffer by its place in the model as written: a raw name without
the segments that wrappers insert. The suite states the rule here, by spelling, independently of
``reference.fqn`` (which goes by the module tree): an oracle that reused the reference's rule could not
catch a bug in it. Spelling is enough for the suite's models, which never name a child like a wrapper
segment; DDP's ``module`` is left out for that reason (a model may well have a child called
``module``), and the suite's DDP oracles strip it where they wrap.
"""

from __future__ import annotations

__all__ = ["WRAPPER_SEGMENTS", "canonical_fqn"]

#: The segments wrappers insert into raw names: the reference and FSDP1's wrapped-module attribute,
#: activation checkpointing's, FlattenParamsWrapper's (reference and fairscale), torch.compile's.
WRAPPER_SEGMENTS: tuple[str, ...] = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_fpw_module", "_orig_mod")


def canonical_fqn(raw: str) -> str:
    """``raw`` without wrapper segments (whole segments only): ``_orig_mod.1._fsdp_wrapped_module.w``
    -> ``1.w``; ``a._orig_mod_x.b`` stays."""
    return ".".join(part for part in raw.split(".") if part not in WRAPPER_SEGMENTS)
