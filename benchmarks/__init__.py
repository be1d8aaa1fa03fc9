"""The benchmark suites and the results-page generator (not part of the installed library)."""
