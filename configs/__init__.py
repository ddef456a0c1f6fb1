"""Default configurations of the benchmark and example binaries."""
