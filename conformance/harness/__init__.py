"""The multi-rank harness of the conformance suite (pytest plugin, rank pools, xfails, requirement IDs).

How a test uses it (the contract; see ``conformance/SPEC.md`` HX-*):

``impl``
    Fixture, parametrized over ``--impl``: an :class:`~conformance.adapters.base.Adapter`.
    ``impl.require("checkpoint")`` returns that capability's ops or skips with the reason. A test whose
    ``req`` IDs belong to a capability (``FP``/``SD``/``OS``/``ML``) is skipped up front when the
    adapter lacks it.
``reference_impl``
    Fixture: the reference adapter, for differential checks of another implementation.
``dist``
    Asking for this argument makes the test a *rank test*: it is parametrized over ``--world-size``
    (ids ``ws1``, ``ws2``, ...) and its body runs on every rank of that world size's pool, with
    ``dist`` bound to that rank's :class:`~conformance.harness.context.RankContext`. Every other
    argument must pickle (parametrize values, ``tmp_path``, ``impl``).
``@pytest.mark.world_size(2, 4)`` / ``@pytest.mark.world_size(min=2)``
    Restricts a rank test (or a ``world_size_pair`` test) to those world sizes; if none of the selected
    ones qualifies, the test is a skip saying which to select.
``pools``
    Controller-side fixture: ``pools.run(world_size, fn, *args, **kwargs)`` runs the module-level
    function ``fn(ctx, *args, **kwargs)`` on every rank of that pool and returns the per-rank return
    values, rank order. For tests with several phases (save at 4 ranks, load at 2).
``world_size_pair``
    Argument parametrized over ordered pairs of distinct selected world sizes (ids ``ws4-ws2``).
``@pytest.mark.case_families("a", "b")`` / ``excluded_cases``
    A generated test names the families of cases it draws; the fixture gives the expected-failures
    entries ``exclude=NAME`` that apply to it for its adapter (inherited ones included), whose cases it
    then does not draw (see :mod:`conformance.harness.xfails`).

Under torchrun (:mod:`conformance.harness.torchrun`) the same contract holds with the job's ranks in
place of the pools: a rank body of world size ``w`` runs on ranks ``0 .. w-1`` of the job, whose default
process group is made for it and replaced when the world size changes. A module-level cache of
meshes or groups must therefore be a :func:`~conformance.rank_context.per_group_cache`, emptied
when its group goes. The plugin runs bodies through a :class:`~conformance.harness.runner.Runner`
(the pools, or the torchrun job's ranks), chosen once at configure.
"""
