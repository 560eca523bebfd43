"""Command-line tools of this checkout: the benchmark table, the asv gate, mutation testing, stress runs.
The tools a fork's CI needs (report, pin_deviations, ckpt_inspect) are installed with the suite in
:mod:`conformance.cli`; ``python -m tools.<name>`` runs them here too."""
