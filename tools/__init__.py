"""Command-line tools: the conformance report, the checkpoint inspector, the benchmark table."""
