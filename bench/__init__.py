"""Benchmarks of statedict-conformance: asv classes (``bench_*.py``) and pytest-benchmark tests
(``test_*.py``) over the same workloads (:mod:`bench.workloads`), measured for the reference,
upstream torch and the raw limit of the hardware in the same run."""
