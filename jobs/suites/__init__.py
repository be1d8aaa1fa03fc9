"""The results page's benchmark suites (``jobs/benchmark.py``): the paper's findings and the peer comparisons."""
