"""Benchmarks and workloads: the top layer, which may use everything below it (the core and the
engine adapters). ``python -m lossless_hc.bench COMMAND`` (see :mod:`lossless_hc.bench.cli`)."""
