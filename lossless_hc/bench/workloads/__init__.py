"""Training workloads used by the examples (scripts/train_*.py), `make demo` and the benchmarks:
small models built from torch.nn and offline data sets, chosen so that both compute and communication
are visible. Nothing here is part of the compression algorithm."""
