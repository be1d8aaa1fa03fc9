"""The results page's benchmark suites (``benchmarks/benchmark.py``): the paper's findings and the peer comparisons."""
