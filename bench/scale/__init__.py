"""Production world sizes, simulated: every save and load step that moves no tensor bytes, at N ranks.

A job of N ranks is simulated in one process. Each simulated rank gets its own state dict, built from a
layout (:mod:`bench.scale.layouts`): DTensors on a ``DeviceMesh`` as that rank sees it
(``DeviceMesh(..., _init_backend=False, _rank=r)``, how torch's own tests build a large mesh without
its processes), whose local tensors are zero-stride views of one element, so that 16,384 ranks cost no
tensor memory. The real planners then run on it, as they are: the reference's
``ReferenceSavePlanner``/``ReferenceLoadPlanner`` and torch's ``DefaultSavePlanner``/
``DefaultLoadPlanner``; each rank's local plan, the coordinator's global plan and metadata, the pickled
bytes of each, each rank's load planning from that metadata, resharding to another world size and the
second save of the same layout (:mod:`bench.scale.simulate`). Nothing of a planner is re-implemented
here; what only the layout decides (which piece a rank holds) is computed with ``torch.chunk``'s rule,
and the reference's planner checks it against the DTensor it is given.

``python -m bench.scale`` prints the figures; ``bench/test_scale.py`` and ``bench/bench_scale.py`` are
their pytest-benchmark and asv forms; docs/benchmarks.md has the table and the plot.
"""
