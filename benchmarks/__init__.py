"""torchmem's benchmarks: ``python -m benchmarks`` runs them all and prints the tables."""
