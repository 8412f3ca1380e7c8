"""Benchmarks live here, apart from the tests (throughput, scale, weight sync). Later issues fill it."""
