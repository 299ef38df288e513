"""The probes behind the research log's analyses: ``python -m benchmarks.diagnostics.NAME``."""
