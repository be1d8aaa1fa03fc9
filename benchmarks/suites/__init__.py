"""The benchmark suites, a file per subject; ``benchmarks/benchmark.py`` runs them by name (its ``--list``)."""
