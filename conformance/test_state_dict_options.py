"""SD-28: the options of get/set state_dict combine (conformance/SPEC.md).

Each ``StateDictOptions`` field is tested alone elsewhere in the SD section; a fault that needs two
of them together (``keep_submodule_prefixes=False`` dropped when ``cpu_offload`` is set, say) passes
all of those. Here every pair of values of any two fields occurs in some case: a covering array
(:func:`conformance.pairwise.pairwise`, deterministic) of

=========================  ===================================================================
factor                     values
=========================  ===================================================================
full_state_dict            False, True
cpu_offload                False, True
ignore_frozen_params       False, True
submodules                 none; ``{enc}`` keeping prefixes; ``{enc}`` stripping them
strict                     True, False
broadcast_from_rank0       False, True (only with ``full_state_dict``: the other pairs are errors,
                           tested by test_state_dict's error cases)
flatten_optimizer_...      False, True
given                      the model dict a get gave, or that dict without one trainable entry
=========================  ===================================================================

crossed with three kinds of model: ``plain``, ``sharded`` (the adapter's sharding: reference FSDP,
torch's FSDP1 or ``fully_shard``) and ``dtensor`` (parameters that are DTensors without any unit, as
tensor parallelism leaves them). The model
(:class:`~conformance.state_dict_options_support.OptionsModel`) has what every option acts on: a frozen
and a trainable layer inside one selectable submodule ``enc``, a trainable head, a persistent buffer.

Each case is checked twice, on every rank:

* get (``row<i>_get``): the model and optimizer state dicts equal an oracle computed from the
  unwrapped model trained identically, with the options applied to it by their own definitions: the
  selection (prefixes kept or stripped), the frozen entries left out, full tensors or DTensors whose
  local shard is this rank's piece, the flat or nested optimizer form, every tensor on the CPU with
  ``cpu_offload``, and ``{}`` on ranks other than 0 with ``full_state_dict`` and ``cpu_offload``;
  ``strict`` and ``broadcast_from_rank0`` change nothing about a get. Values bit for bit on plain
  models, to float tolerance on sharded ones (ranks average gradients).
* set (``row<i>_set``): the source's own get (full or sharded, flat or nested), less the frozen
  entries with ``ignore_frozen_params`` and less one trainable entry when ``given`` says so, held by
  rank 0 alone with ``broadcast_from_rank0``, is set into a target that differs from the source in
  every value and hyperparameter. With ``strict`` and an entry missing: the same ``RuntimeError``
  naming it on every rank, and nothing changed. Otherwise: the given entries loaded bit for bit, the
  others (frozen, missing) as the target had them, exactly those reported in ``missing_keys``, and the
  optimizer state and hyperparameters as given.

Each row of the covering array is its own test (``...-row3]``), its get and its set checked as the
clauses SD-28.a and SD-28.b, so an implementation's known deviations are pinned per row and clause
(``test_options_combine[[]ws*-myfork-*-row3]  clauses=SD-28.b``); within a test, the target is set
back to its own state after the set (checked), and a failure names the row and its options.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.asserts import check_each
from conformance.state_dict_options_support import ROWS, Case, check_get, check_set, describe
from conformance.state_dict_support import PROMPTLY_S

KINDS = ("plain", "sharded", "dtensor")


@pytest.mark.req("SD-28", "SD-2", "SD-3", "SD-4", "SD-5", "SD-7", "SD-8", "SD-12", "SD-13", "SD-14", "SD-19")
@pytest.mark.rank_timeout(4 * PROMPTLY_S)
@pytest.mark.parametrize("row", range(len(ROWS)), ids=[f"row{index}" for index in range(len(ROWS))])
@pytest.mark.parametrize("kind", KINDS)
def test_options_combine(dist: Any, impl: Any, kind: str, row: int) -> None:
    """One row of the covering array :data:`ROWS` (every pair of option values is in some row), on one
    kind of model: get and set as the module docstring says, the set checked even when the get failed."""
    case = Case(kind, impl, dist)
    options, label = ROWS[row], f"row {row}: {describe(ROWS[row])}"

    def set_then_restore() -> None:
        try:
            check_set(case, options, label)
        finally:
            case.restore()

    check_each({"SD-28.a": lambda: check_get(case, options, label), "SD-28.b": set_then_restore})
