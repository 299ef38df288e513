"""torq's benchmarks, each a module run as ``python -m benchmarks.NAME`` from the
repository's root; each writes a JSON record and a markdown table."""
